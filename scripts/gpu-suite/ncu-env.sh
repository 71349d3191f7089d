# Sourced by the GPU-suite scripts that profile (ncu-*.sh): the Nsight Compute
# sections they collect, and where ncu and compute-sanitizer live on the GPU machine.
ncu_sections='--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis'
stall_sections="$ncu_sections --section SourceCounters --section InstructionStats"
cuda_tools_path="/usr/local/cuda/bin:$(ls -d /opt/nvidia/nsight-compute/* 2>/dev/null | tail -n 1)"
