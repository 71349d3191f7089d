#!/bin/bash
# Host emulation of the row kernels on the default CUDA path — activation (bias+act+dropout with
# the 16-bit Philox mask, GLU), norm (vectorized backward with the cp.async ring, one-launch
# column sums), cross_entropy (ce_resident, ce_fused) — against the CPU path, which CI tests.
# refgen/ (Rust, the ferrite crate) writes each case's random inputs and the CPU outputs (and
# core::philox's mask); extract.py turns the family's .cu into host C++; *_drv.cpp run the
# kernels on emu_rows.h with the launch geometry of the family's cuda.rs and compare. Not
# covered: timing, the memory model, the SFU's approximation error (libm stands in).
#
#   scripts/rows-emu/run.sh [act|norm|ce ...]     (all three by default; ~15 min on 2 cores)
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
families=${*:-act norm ce}

cp "$root/Cargo.lock" "$here/refgen/Cargo.lock"
(cd "$here/refgen" && cargo build --offline -q)
ref="$CARGO_TARGET_DIR/debug/rows-emu-refgen"
cp "$here"/emu_rows.h "$here"/common.h "$here"/*_drv.cpp "$work/"
ks="$root/crates/ferrite/src/ops"
build() {  # build NAME SRC.cu DRIVER defines...
  local name=$1 src=$2 drv=$3
  shift 3
  mkdir -p "$work/$name"
  python3 "$here/extract.py" "$src" "$work/$name/kernel_host.cpp"
  cp "$work"/emu_rows.h "$work"/common.h "$work/$drv" "$work/$name/"
  g++ -std=c++20 -O1 -pthread -Wno-unknown-pragmas "$@" "$work/$name/$drv" -o "$work/$name/drv"
}
fail=0
run() {  # run BUILD ARGS...: one case; its report is printed, a FAIL counted
  local b=$1
  shift
  if ! "$work/$b/drv" "$@" >"$work/out" 2>&1; then fail=$((fail + 1)); cat "$work/out"; else
    grep -E "^(PASS|SKIP|case|  FAIL|  skip|  resident)" "$work/out" | grep -v "^case" || true; fi
}
elem() { case $1 in f32) echo float ;; bf16) echo __nv_bfloat16 ;; f16) echo __half ;; esac; }
acts=(none relu gelu_tanh gelu_erf silu)

for fam in $families; do
  case $fam in
  act)
    for dt in f32 bf16 f16; do
      for a in 0 1 2 3 4; do
        if [ $dt = f16 ] && [ $a != 2 ] && [ $a != 4 ]; then continue; fi
        build act_${dt}_$a "$ks/activation/kernels/activation.cu" act_drv.cpp \
          -DFE_ELEM=$(elem $dt) -DFE_ACT=$a
        c=$work/c
        ps="0 0.1 0.5"; [ $dt = f16 ] && ps=0.1
        for p in $ps; do
          # The counter crosses 2³² inside the tensor (carry into counter word 1).
          off=$(((1 << 32) - 3000 + a * 7))
          rm -rf $c; $ref act dtype=$dt act=${acts[a]} rows=37 cols=1000 p=$p bias=1 glu=0 \
            seed=$((11 + a)) dseed=$((0x5e3779b97f4a7c15 + a)) offset=$off out=$c
          run act_${dt}_$a dir=$c rows=37 cols=1000 bias=1 glu=0 dseed=$((0x5e3779b97f4a7c15 + a)) \
            offset=$off sm=2 bpsm=1,8
        done
        [ $dt = f16 ] && continue
        # Wider rows: several column blocks with a partial last one; no bias; the H100's grid.
        rm -rf $c; $ref act dtype=$dt act=${acts[a]} rows=37 cols=4104 p=0.1 bias=0 glu=0 seed=5 \
          dseed=77 offset=123456789 out=$c
        run act_${dt}_$a dir=$c rows=37 cols=4104 bias=0 glu=0 dseed=77 offset=123456789 sm=132 bpsm=1,4
        # Odd columns: only the naive chain applies (fused needs cols % 16 bytes).
        rm -rf $c; $ref act dtype=$dt act=${acts[a]} rows=7 cols=1001 p=0.5 bias=1 glu=0 seed=6 \
          dseed=78 offset=5 out=$c
        run act_${dt}_$a dir=$c rows=7 cols=1001 bias=1 glu=0 dseed=78 offset=5 sm=2 bpsm=1
        rm -rf $c; $ref act dtype=$dt act=${acts[a]} rows=37 cols=1000 glu=1 seed=7 out=$c
        run act_${dt}_$a dir=$c rows=37 cols=1000 glu=1
      done
    done
    ;;
  norm)
    for kind in rms layer; do
      rms=$([ $kind = rms ] && echo 1 || echo 0)
      for dt in f32 bf16; do
        for ch in 1 2 4; do
          build norm_${kind}_${dt}_$ch "$ks/norm/kernels/norm.cu" norm_drv.cpp \
            -DFE_ELEM=$(elem $dt) -DFE_RMS=$rms -DFE_CHUNKS=$ch -DFE_STAGES=3
        done
        for cols in 200 1000 4088; do
          c=$work/c
          rm -rf $c; $ref norm kind=$kind dtype=$dt rows=37 cols=$cols w=1 b=1 res=0 eps=1e-5 \
            seed=$cols out=$c
          for ch in 1 2 4; do
            # sm=2: grids of 4 and 16 blocks walk ~9 and ~2 rows each through the ring.
            run norm_${kind}_${dt}_$ch dir=$c rows=37 cols=$cols w=1 b=1 res=0 eps=1e-5 sm=2 \
              bpsm=2,8 naive=$([ $ch = 1 ] && [ $cols != 4088 ] && echo 1 || echo 0)
          done
        done
        # No weight (dw skipped, db only for layer), a residual; the H100's grid (37 blocks).
        rm -rf $c; $ref norm kind=$kind dtype=$dt rows=37 cols=1000 w=0 b=1 res=1 eps=1e-6 \
          seed=3 out=$c
        run norm_${kind}_${dt}_2 dir=$c rows=37 cols=1000 w=0 b=1 res=1 eps=1e-6 sm=132 bpsm=2
      done
    done
    ;;
  ce)
    for dt in f32 bf16 f16; do
      for tg in i64 i32; do
        [ $tg = i32 ] && [ $dt != bf16 ] && continue
        tgt=$([ $tg = i64 ] && echo "long long" || echo int)
        build ce_${dt}_$tg "$ks/cross_entropy/kernels/cross_entropy.cu" ce_drv.cpp \
          -DFE_ELEM=$(elem $dt) "-DFE_TGT=$tgt"
        c=$work/c
        rm -rf $c; $ref ce dtype=$dt tgt=$tg rows=6 v=3001 eps=0.1 red=mean dloss=1.5 ninf=0 \
          ignore_every=4 seed=3 out=$c
        run ce_${dt}_$tg dir=$c rows=6 v=3001 eps=0.1 red=mean dloss=1.5
        # A small shared memory per SM: only part of the row resident; misaligned rows, in place.
        run ce_${dt}_$tg dir=$c rows=6 v=3001 eps=0.1 red=mean dloss=1.5 smem_sm=4096 lead=1 inplace=1
        rm -rf $c; $ref ce dtype=$dt tgt=$tg rows=5 v=3000 eps=0 red=sum dloss=0.7 ninf=0 \
          ignore_every=0 seed=4 out=$c
        run ce_${dt}_$tg dir=$c rows=5 v=3000 eps=0 red=sum dloss=0.7 smem_sm=16384 lead=3
        # Masked classes (−inf logits) at the start of every row.
        rm -rf $c; $ref ce dtype=$dt tgt=$tg rows=4 v=3000 eps=0.1 red=mean dloss=1 ninf=100 \
          ignore_every=0 seed=5 out=$c
        run ce_${dt}_$tg dir=$c rows=4 v=3000 eps=0.1 red=mean dloss=1
        # Masked classes without smoothing: a finite loss (the smoothing term is skipped).
        rm -rf $c; $ref ce dtype=$dt tgt=$tg rows=4 v=3000 eps=0 red=mean dloss=1 ninf=100 \
          ignore_every=0 seed=7 out=$c
        run ce_${dt}_$tg dir=$c rows=4 v=3000 eps=0 red=mean dloss=1
      done
      # Rows over the H100's 227 KiB: one block per SM keeps 14512 of the row's vectors.
      big=$([ $dt = f32 ] && echo 60000 || echo 120000)
      tg=i64
      rm -rf $c; $ref ce dtype=$dt tgt=$tg rows=3 v=$big eps=0.1 red=mean dloss=1 ninf=0 \
        ignore_every=0 seed=6 out=$c
      run ce_${dt}_$tg dir=$c rows=3 v=$big eps=0.1 red=mean dloss=1
    done
    ;;
  esac
done
echo "failed cases: $fail"
exit $((fail > 0))
