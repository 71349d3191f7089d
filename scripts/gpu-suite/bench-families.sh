#!/usr/bin/env bash
# Benches the named op families one by one (each under its own time limit), so a long suite can be
# split over several device calls; writes $OUT/<tag>.tgz with <family>.{txt,json,svg} and a log.
#   bash .gpu-bundle/bench-families.sh TAG SECONDS_PER_FAMILY FAMILY... [-- extra bench args]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tag=$1; limit=$2; shift 2
fams=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do fams+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
OUT=${OUT:-$PWD/gpu-suite-out}
dir="$OUT/$tag"; mkdir -p "$dir"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export FERRITE_CACHE_DIR=${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv; } > "$dir/machine.txt" 2>&1
status=0
for f in "${fams[@]}"; do
  start=$(date +%s)
  timeout "$limit" "$here/bin/ferrite" bench "$f" --device cuda --json "$dir/$f.json" --plot "$dir/$f.svg" "$@" > "$dir/$f.txt" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  echo "$f: rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$dir/log.txt"
done
(cd "$OUT" && tar czf "$tag.tgz" "$tag" && rm -rf "$tag")
exit $status
