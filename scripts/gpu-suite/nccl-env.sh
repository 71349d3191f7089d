# Sourced by the multi-GPU scripts: ferrite loads NCCL as libnccl.so (cudarc's loader); torch's
# wheels ship libnccl.so.2 — link it under that name and put it on the loader's path.
lib=$(python3 -c '
import glob, os, site
for d in site.getsitepackages():
    for f in sorted(glob.glob(os.path.join(d, "nvidia", "**", "libnccl.so*"), recursive=True)):
        print(f); raise SystemExit' 2>/dev/null)
mkdir -p /tmp/ferrite-nccl && [ -n "$lib" ] && ln -sf "$lib" /tmp/ferrite-nccl/libnccl.so
echo "NCCL library: ${lib:-not found}" | tee "$out/nccl-lib.txt"
export LD_LIBRARY_PATH="/tmp/ferrite-nccl:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
