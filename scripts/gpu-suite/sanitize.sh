#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck over `ferrite check <family> --quick` on the
# GPU (every family's CUDA variants against the f64 reference, on odd shapes): one job per (tool,
# family), run JOBS at a time spread over the visible GPUs, each with --trace (so a job cut by its
# time limit still shows how far it got); each job's log and a summary (ERROR SUMMARY per job, the
# check's last line) under $OUT. Exit status 0 when every job finishes with 0 errors and its checks
# pass. A family may name some of its variants, `matmul:wgmma:skinny` (`--variant` each): a large
# family split over several jobs finishes under a sanitizer within one job's time limit.
#   usage: [TOOLS="memcheck ..."] [JOBS=N] [GPUS="1 2 3"] OUT=results bash .gpu-bundle/sanitize.sh [seconds per job, default 300] [families...]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-results}"; mkdir -p "$out"
limit="${1:-300}"; shift || true
families=("$@")
[ ${#families[@]} -eq 0 ] && families=(matmul linear norm softmax activation cross_entropy adamw attention decode rotary moe scaled_mm copy)
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
read -r -a gpu_ids <<< "${GPUS:-$(seq -s ' ' 0 $(( $(nvidia-smi -L | wc -l) - 1 )))}"
gpus=${#gpu_ids[@]}
jobs_max=${JOBS:-$((gpus * 3))}
# A job's name in file names: `matmul:wgmma:skinny` → `matmul_wgmma_skinny`.
job_name() { echo "${1//:/_}"; }
run_one() {  # tool family[:variant...] gpu
  local name log start fam variants=()
  name=$(job_name "$2"); log="$out/$1-$name.log"
  IFS=: read -r -a parts <<< "$2"; fam=${parts[0]}
  for v in "${parts[@]:1}"; do variants+=(--variant "$v"); done
  start=$(date +%s)
  CUDA_VISIBLE_DEVICES=$3 FERRITE_CACHE_DIR=/tmp/ferrite-sanitize-$1-$name timeout "$limit" \
    "$cs" --tool "$1" --error-exitcode 9 --print-limit 20 \
    "$here/bin/ferrite" check "$fam" "${variants[@]}" --quick --device cuda --trace > "$log" 2>&1
  echo "exit $? after $(( $(date +%s) - start )) s" >> "$log"
}
i=0
for tool in ${TOOLS:-memcheck racecheck synccheck}; do
  for fam in "${families[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do sleep 1; done
    run_one "$tool" "$fam" "${gpu_ids[$((i % gpus))]}" &
    i=$((i + 1))
  done
done
wait
status=0
{
  echo "compute-sanitizer $("$cs" --version | grep -o 'Version [0-9.]*' | head -1), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ferrite check <family> --quick --device cuda"
  for tool in ${TOOLS:-memcheck racecheck synccheck}; do
    for fam in "${families[@]}"; do
      log="$out/$tool-$(job_name "$fam").log"
      # memcheck/synccheck print "ERROR SUMMARY: n errors", racecheck "RACECHECK SUMMARY: … (n errors, …)".
      summary=$(grep -hE "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | sed 's/=* *//')
      cases=$(grep -hE "cases, [0-9]+ passed" "$log" | tail -1)
      printf '%-10s %-14s %-60s %-22s %s\n' "$tool" "$fam" "${summary:-no summary}" "$(tail -1 "$log")" "${cases:-(unfinished)}"
      case "$summary" in *" 0 errors"* | *"(0 errors"*) ;; *) status=1 ;; esac
      case "$cases" in *" 0 failed"*) ;; *) status=1 ;; esac
    done
  done
} | tee "$out/sanitize-summary.txt"
exit $status
