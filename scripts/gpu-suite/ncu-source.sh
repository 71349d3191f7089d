#!/usr/bin/env bash
# Nsight Compute per-instruction profile of one kernel launch: warp-stall samples and shared /
# global excess per SASS line, for finding which instructions a kernel waits on (the section
# tables give only kernel totals). On the GPU machine, with the bundle's `ferrite` on PATH:
#   bash scripts/gpu-suite/ncu-source.sh OUTDIR NAME KERNEL_REGEX SKIP -- command...
# writes OUTDIR/NAME.txt (sections, with the source-counter tables in full), OUTDIR/NAME.ncu-rep
# and OUTDIR/NAME-sass.csv (the source page: one row per SASS instruction with its metrics).
# scripts/gpu-suite/sass_hotspots.py summarises the CSV.
set -uo pipefail
source "$(dirname "$0")/ncu-env.sh"
out=$1 name=$2 kernel=$3 skip=$4; shift 5
export PATH=$PATH:$cuda_tools_path
mkdir -p "$out"
ncu --clock-control none $stall_sections --import-source no --print-details all \
  -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 -f -o "$out/$name" "$@" > "$out/$name.txt" 2>&1
rc=$?
ncu -i "$out/$name.ncu-rep" --print-details all >> "$out/$name.txt" 2>&1
ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name-sass.csv" 2>&1
echo "$name: ncu rc=$rc, $(wc -l < "$out/$name-sass.csv") source rows"
exit $rc
