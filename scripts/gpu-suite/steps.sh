#!/usr/bin/env bash
# Runs named steps, each under its own time limit, with the bundle's `ferrite` first on PATH, and
# packs their outputs into $OUT/<tag>.tgz (the device tool returns few files): one device call can
# then carry a check, a bench and a data run without one slow step eating the others' time.
#   bash scripts/gpu-suite/steps.sh TAG BUNDLE_DIR 'name|seconds|command' ...
# Each command runs in the repository root with $D (the step's output folder) set; its stdout
# and stderr go to $D/<name>.txt.
set -uo pipefail
tag=$1; bundle=$(cd "$2" && pwd); shift 2
OUT=${OUT:-$PWD/gpu-suite-out}
dir="$OUT/$tag"; mkdir -p "$dir"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export FERRITE_CACHE_DIR=${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}
export PATH="$bundle:$bundle/bin:$PATH"
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv; } > "$dir/machine.txt" 2>&1
status=0
for s in "$@"; do
  name=${s%%|*}; rest=${s#*|}; limit=${rest%%|*}; cmd=${rest#*|}
  start=$(date +%s)
  D="$dir" timeout "$limit" bash -c "$cmd" > "$dir/$name.txt" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  echo "$name: rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$dir/log.txt"
  tail -n 4 "$dir/$name.txt"
  # Packed after every step: if the device call's own limit ends the run, what is done comes back.
  (cd "$OUT" && tar czf "$tag.tgz.part" "$tag" && mv "$tag.tgz.part" "$tag.tgz")
done
rm -rf "${OUT:?}/$tag"
exit $status
