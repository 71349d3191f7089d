//! The Hopper `wgmma` kernel (kernels/wgmma.cu): its launch configurations and their tuner, the
//! shared-memory layout of each build (ring stages, C staging), the persistent grid, when it
//! declines a problem, and tf32's pack pre-pass for operands TMA cannot read as they are.

use super::epilogue::{with_epilogue, Epi};
use super::{launch, plan_with, Ptrs, WGMMA};
use crate::core::cuda::jit::Program;
use crate::core::cuda::{CudaDevice, DeviceBuffer, Kernel, KernelArgs, Stream};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::ops::matmul::{Gemm, Operand, OP};
use std::sync::Arc;

/// C tile of one `wgmma` block (rows, columns), bytes of k per stage (one 128-byte swizzle row:
/// 64 bf16/f16 or 32 f32 elements, see `wg_bk`), ring depth and threads (3 warpgroups).
pub(super) const WG_TILE: (u32, u32) = (128, 256);
const WG_ROW_BYTES: u32 = 128;
const WG_STAGES: u32 = 4;
/// The ring of the plain TMA-store build (16-bit C) and the activation backward: one stage less,
/// to make room for the consumers' whole C slices (`WG_STAGING`). Sustained on the H100
/// (8192×14336×4096 bf16) the 2-buffer staging beside 4 stages cost ~2% (each warp waited for
/// the TMA unit twice per tile); the 4th stage's lookahead measured nothing
/// (bench/results/2026-11-26-h100-gemm-sustained-linear-bwd: whole-slice-staging,
/// whole-slice-all-builds; bench/results/2026-11-25-h100-linear-dact-helpers/helpers-first-version).
/// The pair epilogue keeps 4 stages and 2 buffers per warp (`WG_PAIR_STAGING`): its forward ran
/// up to 8% slower the other way (whole-slice-all-builds).
const WG_STORE_STAGES: u32 = 3;
pub(super) const WG_THREADS: u32 = 384;
/// Cluster sizes `wgmma` is compiled for, and the one it runs with: pairs of blocks along m
/// sharing (multicasting) each B tile measured 0–5% faster than single blocks on the H100.
pub const WG_CLUSTERS: [u32; 2] = [1, 2];
pub(super) const WG_CLUSTER: u32 = 2;
/// Cluster rows per group of the grouped tile order (8 and 32 measured within noise of each
/// other at 8192³; 4 was slower).
pub(super) const WG_GROUP_M: u32 = 8;

/// A `wgmma` launch configuration: blocks per cluster (B multicast across them), cluster rows
/// per group of the tile order, and how the 16-bit plain kernel writes C (TMA stores from a
/// shared-memory staging area, or the earlier direct stores from registers). Shown in `bench`
/// as e.g. `c2g8` (`c2g8d`: direct stores), and accepted by `MatmulOptions::config` and
/// `ferrite bench matmul --config` under that name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WgConfig {
    pub cluster: u32,
    pub group_m: u32,
    /// TMA-store epilogue where the kernel has one (16-bit C, no fused epilogue) and the launch
    /// allows it (beta = 0, C 16-byte aligned); direct stores otherwise.
    pub tma_store: bool,
}

impl std::fmt::Display for WgConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = if self.tma_store { "" } else { "d" };
        write!(f, "c{}g{}{d}", self.cluster, self.group_m)
    }
}

/// What the untuned `wgmma` runs (and the epilogue kernels always run: they are compiled for
/// this cluster size only).
pub const WG_DEFAULT: WgConfig = WgConfig {
    cluster: WG_CLUSTER,
    group_m: WG_GROUP_M,
    tma_store: true,
};

/// The candidates the tuner times at a shape's first use, the default first (it is also what
/// runs when measuring is not possible, e.g. under CUDA-graph capture). Why these: the tile
/// order decides how much of A and B the SMs running at once share in L2 (8192³: a 4096-wide
/// band of B is 64 MiB, past the 50 MiB L2, so the group height matters more there than at
/// 4096³), and the cluster's B multicast halves B's L2→SM traffic but ties two blocks' progress.
pub const WG_CONFIGS: [WgConfig; 6] = [
    WG_DEFAULT,
    WgConfig {
        cluster: 2,
        group_m: 4,
        tma_store: true,
    },
    WgConfig {
        cluster: 2,
        group_m: 16,
        tma_store: true,
    },
    WgConfig {
        cluster: 1,
        group_m: 8,
        tma_store: true,
    },
    WgConfig {
        cluster: 1,
        group_m: 16,
        tma_store: true,
    },
    WgConfig {
        cluster: 2,
        group_m: 32,
        tma_store: true,
    },
];

/// The environment variable that forces one `wgmma` launch configuration (`c2g8`, `c1g16`, ...)
/// on every matmul call that names none, in place of the tuner's pick: a developer's knob, for
/// timing configurations through a front that cannot pass one (scripts/gpu-suite/power_clocks.py).
pub const WG_CONFIG_VAR: &str = "FERRITE_WGMMA_CONFIG";

/// The configuration `WG_CONFIG_VAR` forces, if set (read per call, so a process may change it
/// between calls; only `wgmma` calls that name no configuration look).
pub(super) fn forced_wg_config() -> Result<Option<WgConfig>> {
    let Some(name) = std::env::var_os(WG_CONFIG_VAR).filter(|s| !s.is_empty()) else {
        return Ok(None);
    };
    let name = name.to_string_lossy();
    wg_config_named(&name).map(Some).map_err(|_| {
        Error::bad_arg(
            "matmul",
            WG_CONFIG_VAR,
            "a `wgmma` launch configuration name (c2g8, c1g16, ...)",
            &name,
        )
    })
}

/// The configuration named `name` (as `WgConfig`'s Display writes it): a tuning candidate, or
/// one with a `d` suffix (the same launch with direct stores, for comparisons).
pub fn wg_config_named(name: &str) -> Result<WgConfig> {
    let (base, tma_store) = match name.strip_suffix('d') {
        Some(b) => (b, false),
        None => (name, true),
    };
    WG_CONFIGS
        .iter()
        .find(|c| c.to_string() == base)
        .map(|&c| WgConfig { tma_store, ..c })
        .ok_or_else(|| {
            Error::bad_arg(
                OP,
                "config",
                format!(
                    "a `wgmma` configuration: one of {} (a `d` suffix: direct stores of C)",
                    WG_CONFIGS.map(|c| c.to_string()).join(", ")
                ),
                name,
            )
        })
}
/// Dynamic shared memory of a `wgmma` ring of `stages`: A 128 rows + B 256 rows of 128 bytes of
/// k per stage (48 KiB for every dtype), its 2·stages mbarriers, and 1 KiB of slack to align the
/// ring to the 1024-byte swizzle atom.
const fn wg_ring_smem(stages: u32) -> u32 {
    stages * (WG_TILE.0 + WG_TILE.1) * WG_ROW_BYTES + 16 * stages + 1024
}
/// The C staging area (wgmma.cu's STAGING_BYTES) of the plain TMA-store and the activation-
/// backward builds: 8 consumer warps × 4 buffers × one 16×64 box of 16-bit C — each warp's whole
/// 16×256 slice; the pair epilogue's: 2 buffers per warp.
const WG_STAGING: u32 = 8 * 4 * 16 * 128;
const WG_PAIR_STAGING: u32 = 8 * 2 * 16 * 128;
const _: () = assert!(
    wg_ring_smem(WG_STORE_STAGES) + WG_STAGING + 16 <= 227 * 1024
        && wg_ring_smem(WG_STAGES) + WG_PAIR_STAGING <= 227 * 1024,
    "the wgmma rings beside their staging areas fit one H100 block"
);

/// The activation-backward kernel's launch: no cluster. With its 3-stage ring a stage that also
/// waits on the peer block's consumers left the producer too little lookahead (H100, 8192×4096
/// ←4096: 0.452 ms against 0.470 for 2-block clusters in the same rounds, two alternations;
/// bench/results/2026-11-25-h100-linear-dact-helpers/ring-prefetch-no-cluster).
pub const WG_DACT: WgConfig = WgConfig {
    cluster: 1,
    group_m: WG_GROUP_M,
    tma_store: true,
};

/// Ring stages and C staging bytes of the `wgmma` module for `dtype` / `epi`.
fn wg_layout(dtype: DType, epi: Option<Epi>) -> (u32, u32) {
    match epi {
        _ if !wg_has_tma_store(dtype, epi) => (WG_STAGES, 0),
        Some(e) if !e.dact => (WG_STAGES, WG_PAIR_STAGING),
        _ => (WG_STORE_STAGES, WG_STAGING),
    }
}

/// Dynamic shared memory of the `wgmma` module for `dtype` / `epi`: its ring and staging area,
/// and the activation-backward build's two staging-handshake mbarriers.
pub(super) fn wg_smem(dtype: DType, epi: Option<Epi>) -> u32 {
    let (stages, staging) = wg_layout(dtype, epi);
    wg_ring_smem(stages) + staging + if is_dact(epi) { 16 } else { 0 }
}

/// Whether `epi` is the activation-backward epilogue (its module has its own ring and staging).
fn is_dact(epi: Option<Epi>) -> bool {
    matches!(epi, Some(Epi { dact: true, .. }))
}

/// Stages of the `wgmma` ring in the module for `dtype` / `epi`.
pub(super) fn wg_stages(dtype: DType, epi: Option<Epi>) -> u32 {
    wg_layout(dtype, epi).0
}

/// Whether the `wgmma` module for `dtype` / `epi` has the TMA-store epilogue: 16-bit C with the
/// plain or the pair epilogue (Y and Z staged and TMA-stored on interior tiles; the element-wise
/// epilogue of `persistent` keeps its direct stores, as the ladder's earlier step).
pub(super) fn wg_has_tma_store(dtype: DType, epi: Option<Epi>) -> bool {
    dtype != DType::F32 && epi.is_none_or(|e| e.pairs)
}

/// k per `wgmma` stage in elements (wgmma.cu's BK): 64 for bf16/f16, 32 for f32 (tf32).
pub(super) fn wg_bk(dtype: DType) -> u32 {
    WG_ROW_BYTES / dtype.size_in_bytes() as u32
}

/// k of one wgmma instruction (wgmma.cu's KSTEP: 32 bytes of a K-major row): 16 for bf16/f16,
/// 8 for tf32.
pub(super) fn wg_kstep(dtype: DType) -> u32 {
    32 / dtype.size_in_bytes() as u32
}

/// Leading dimension of an operand packed K-major for tf32 `wgmma`: k rounded up to 4 floats, so
/// every row starts 16-byte aligned (TMA).
fn tf32_packed_ld(k: usize) -> usize {
    k.max(1).div_ceil(4) * 4
}

/// Pack (and so round to nearest tf32) every operand of tf32 `wgmma`, even those it could read in
/// place. Off: an operand read in place is multiplied as the tensor core reads f32 bits as tf32
/// (the low 13 mantissa bits dropped, as cuBLAS's shared-memory tf32 kernels do), about twice the
/// error of rounding (docs/matmul.md); on: mma_pipelined's rounding everywhere, for one extra
/// read and write of each operand.
const TF32_PACK_ALWAYS: bool = false;

/// Whether tf32 `wgmma` reads this operand straight from the caller's memory (K-major: A
/// row-major / B transposed, rows 16-byte aligned, base 16-byte aligned) or first packs it
/// (`matmul_wgmma_pack`: a K-major, tf32-rounded copy in stream-ordered scratch).
fn tf32_direct(o: &Operand, is_a: bool, base: u64) -> bool {
    let k_major = if is_a { !o.trans } else { o.trans };
    k_major && o.ld.is_multiple_of(4) && o.batch_stride.is_multiple_of(4) && base.is_multiple_of(16)
}

/// Strides (sr, sp) with op(X)[r][p] = X[r·sr + p·sp] (r along m for A / n for B, p along k):
/// what the pack pre-pass reads; sp = 1 when X is k-contiguous.
fn tf32_pack_strides(o: &Operand, is_a: bool) -> (usize, usize) {
    let k_major = if is_a { !o.trans } else { o.trans };
    if k_major {
        (o.ld, 1)
    } else {
        (1, o.ld)
    }
}

/// The operand as the tf32 kernel sees it after packing (`rows` = m for A, n for B): K-major
/// (A row-major, B transposed), rows `tf32_packed_ld(k)` apart, batches `rows · ld` apart, or one
/// shared copy when the original broadcasts (batch stride 0).
fn tf32_packed(o: &Operand, is_a: bool, rows: usize, k: usize) -> Operand {
    let ld = tf32_packed_ld(k);
    Operand {
        ld,
        trans: !is_a,
        batch_stride: if o.batch_stride == 0 { 0 } else { rows * ld },
    }
}

/// Runs `copy` on each operand of `g` (A, then B) and, where it made a copy (an operand `wgmma`
/// cannot read in place), returns the problem and pointers with the copy in its place; `keep`
/// holds the copies (stream-ordered scratch) until the caller has queued the GEMM. `copy` gets
/// the operand, whether it is A, its rows (m for A, n for B) and its base address.
fn replace_operands(
    g: &Gemm,
    p: Ptrs,
    keep: &mut Vec<DeviceBuffer>,
    mut copy: impl FnMut(&Operand, bool, usize, u64) -> Result<Option<(Operand, DeviceBuffer)>>,
) -> Result<(Gemm, Ptrs)> {
    let (mut g2, mut p2) = (*g, p);
    if g.k == 0 || g.batch == 0 || g.m == 0 || g.n == 0 {
        return Ok((g2, p2));
    }
    for is_a in [true, false] {
        let (o, rows, base) = if is_a {
            (g.a, g.m, p.a)
        } else {
            (g.b, g.n, p.b)
        };
        let Some((packed, buf)) = copy(&o, is_a, rows, base)? else {
            continue;
        };
        if is_a {
            (g2.a, p2.a) = (packed, buf.ptr());
        } else {
            (g2.b, p2.b) = (packed, buf.ptr());
        }
        keep.push(buf);
    }
    Ok((g2, p2))
}

/// Runs the tf32 pack pre-pass on every operand `tf32_direct` rejects and returns the problem and
/// pointers as the tf32 `wgmma` kernel then reads them (`replace_operands`).
pub(super) fn tf32_pack(
    k: &Kernel,
    g: &Gemm,
    p: Ptrs,
    stream: &Stream,
    keep: &mut Vec<DeviceBuffer>,
) -> Result<(Gemm, Ptrs)> {
    replace_operands(g, p, keep, |o, is_a, rows, base| {
        if !TF32_PACK_ALWAYS && tf32_direct(o, is_a, base) {
            return Ok(None);
        }
        let packed = tf32_packed(o, is_a, rows, g.k);
        let copies = if o.batch_stride == 0 { 1 } else { g.batch };
        let buf = k.dev.alloc(copies * rows * packed.ld * 4, stream)?;
        let (sr, sp) = tf32_pack_strides(o, is_a);
        let mut args = KernelArgs::new();
        args.push(buf.ptr())
            .push(base)
            .push(rows as i64)
            .push(g.k as i64)
            .push(sr as i64)
            .push(sp as i64)
            .push(o.batch_stride as i64)
            .push(packed.ld as i64)
            .push(copies as i64);
        let grid = (
            (rows as u32).div_ceil(32),
            (g.k as u32).div_ceil(32).clamp(1, 65535),
            (copies as u32).clamp(1, 65535),
        );
        k.launch(stream, grid, (32, 8, 1), 0, &mut args)?;
        Ok(Some((packed, buf)))
    })
}

/// Whether 16-bit `wgmma` reads this operand in place: its tensor map needs the row pitch and the
/// batch stride to be multiples of 8 elements and the base 16-byte aligned.
pub(super) fn rows_aligned16(o: &Operand, base: u64) -> bool {
    o.ld.is_multiple_of(8) && o.batch_stride.is_multiple_of(8) && base.is_multiple_of(16)
}

/// The operand as stored, (outer, inner): rows of the storage and elements per row (`inner` is
/// contiguous). `rows` is m for A, n for B: A is m×k (stored k×m when transposed), B is k×n
/// (stored n×k when transposed).
fn stored_dims(o: &Operand, is_a: bool, rows: usize, k: usize) -> (usize, usize) {
    if is_a != o.trans {
        (rows, k)
    } else {
        (k, rows)
    }
}

/// The operand after `repitch16`: the same layout with rows `inner` rounded up to 8 elements
/// apart, batches `outer` rows apart (or one shared copy when the original broadcasts).
fn repitched(o: &Operand, outer: usize, inner: usize) -> Operand {
    let ld = inner.max(1).div_ceil(8) * 8;
    Operand {
        ld,
        trans: o.trans,
        batch_stride: if o.batch_stride == 0 { 0 } else { outer * ld },
    }
}

/// Runs the 16-bit pre-pass (`matmul_wgmma_repitch`) on every operand whose rows TMA cannot
/// address (`rows_aligned16`) and returns the problem and pointers as `wgmma` then reads them
/// (`replace_operands`).
pub(super) fn repitch16(
    k: &Kernel,
    g: &Gemm,
    p: Ptrs,
    stream: &Stream,
    keep: &mut Vec<DeviceBuffer>,
) -> Result<(Gemm, Ptrs)> {
    replace_operands(g, p, keep, |o, is_a, rows, base| {
        if rows_aligned16(o, base) {
            return Ok(None);
        }
        let (outer, inner) = stored_dims(o, is_a, rows, g.k);
        let packed = repitched(o, outer, inner);
        let copies = if o.batch_stride == 0 { 1 } else { g.batch };
        let buf = k.dev.alloc(copies * outer * packed.ld * 2, stream)?;
        let mut args = KernelArgs::new();
        args.push(buf.ptr())
            .push(base)
            .push(outer as i64)
            .push(inner as i64)
            .push(o.ld as i64)
            .push(o.batch_stride as i64)
            .push(packed.ld as i64)
            .push(copies as i64);
        let grid = (
            ((packed.ld / 8) as u32).div_ceil(128),
            ((copies * outer) as u64).clamp(1, 65535) as u32,
            1,
        );
        k.launch(stream, grid, (128, 1, 1), 0, &mut args)?;
        Ok(Some((packed, buf)))
    })
}

/// The pre-pass a `wgmma` launch of `dtype` runs on operands it cannot read in place: tf32's pack
/// (K-major, rounded) or the 16-bit re-pitch.
pub(super) fn wg_pack_function(dtype: DType) -> &'static str {
    if dtype == DType::F32 {
        "matmul_wgmma_pack"
    } else {
        "matmul_wgmma_repitch"
    }
}

/// wgmma, setmaxnreg and the sm_90a target exist on Hopper only (later GPUs have other MMAs).
pub const WGMMA_ARCH: &str = "needs sm_90a (Hopper, compute capability 9.x)";

/// Why `wgmma` cannot run `g` (None: it can). Any layout and alignment: operands TMA cannot read
/// as they are go through a pre-pass first (tf32: packed K-major; 16-bit: re-pitched to 16-byte
/// rows, `repitch16`).
pub fn wgmma_declines(g: &Gemm) -> Option<String> {
    if !matches!(g.dtype, DType::BF16 | DType::F16 | DType::F32) {
        return Some("is bf16/f16 (and f32 as tf32) only".into());
    }
    if g.k == 0 {
        return None; // nothing is read: C = beta·C
    }
    if g.m > i32::MAX as usize - 256 || g.n > i32::MAX as usize - 256 {
        return Some("needs m, n < 2^31 - 256 (32-bit TMA coordinates)".into());
    }
    None
}

/// Multiply-adds (m·n·k·batch) from which the default selection gives a 16-bit problem whose rows
/// TMA cannot address to `wgmma` (with the re-pitch pre-pass) rather than to `mma_pipelined`,
/// which reads such rows in place: the pre-pass costs a launch, a stream-ordered allocation and
/// one pass over each unaligned operand. Measured on the H200 (bf16 NN, same call): 127×255×33
/// (1.1 M multiply-adds) 13.3 µs `mma_pipelined` against 21.3 µs re-pitched `wgmma`; 256×264×257
/// (17 M) 20.3 against 15.8; 1024×1000×1001 73.9 against 23.1, 2048×2047×2049 370 against 61
/// (1.97× cuBLAS; bench/results/2026-11-28-h200-matmul-sweep/repitch-threshold).
pub const REPITCH_MIN_MACS: u64 = 1 << 24;

/// Why the default selection leaves `g` to another rung although `wgmma` can run it (None: it
/// takes it): a small 16-bit problem whose rows need the re-pitch pre-pass (`REPITCH_MIN_MACS`).
pub fn wgmma_default_refuses(g: &Gemm) -> Option<String> {
    let macs = (g.m as u64)
        .saturating_mul(g.n as u64)
        .saturating_mul(g.k as u64)
        .saturating_mul(g.batch as u64);
    (wgmma_declines_unpadded(g).is_some() && macs < REPITCH_MIN_MACS).then(|| {
        format!(
            "is chosen by default for rows TMA cannot address (re-pitched first) only from {REPITCH_MIN_MACS} multiply-adds; this problem has {macs}"
        )
    })
}

/// Why `wgmma` cannot read `g`'s operands in place (None: it can), for the launches that have no
/// pre-pass (the grouped GEMMs): TMA needs 16-byte aligned rows, leading dims and batch strides
/// multiples of 8 elements (the base address is checked at launch).
pub fn wgmma_declines_unpadded(g: &Gemm) -> Option<String> {
    if let Some(why) = wgmma_declines(g) {
        return Some(why);
    }
    if g.k == 0 || g.dtype == DType::F32 {
        return None;
    }
    for (name, o) in [("a", &g.a), ("b", &g.b)] {
        if o.ld % 8 != 0 || o.batch_stride % 8 != 0 {
            return Some(format!(
                "needs 16-byte aligned rows for TMA: {name} has ld {} / batch stride {} (not multiples of 8 elements)",
                o.ld, o.batch_stride
            ));
        }
    }
    None
}

/// Most splits of k `wg_splits` takes: beyond, the workspace's passes outgrow the gain.
const WG_MAX_SPLITS: usize = 16;
/// Fewest k tiles (of 64) per split: a split's pipeline fill (4 stages) and its partial tile's
/// write need a few k steps of work behind them.
const WG_MIN_SPLIT_KTILES: usize = 4;
/// Split-K's cost model (H100/H200): µs per 64-wide k step of one 128×256 tile (2.1 M
/// multiply-adds at a block's share of the tensor rate, or the step's 48 KiB at its share of the
/// bandwidth when the weight streams), the reduce pass's fixed cost (its launch behind the GEMM,
/// the workspace's stream-ordered allocation: ~5 µs of host per call measured on the H200) and
/// the DRAM rate its fp32 partials move at (bytes per µs).
const SPLIT_US_PER_KSTEP: f64 = 0.5;
const SPLIT_REDUCE_US: f64 = 5.0;
const SPLIT_BYTES_PER_US: f64 = 2.5e6;

/// Splits of k for the plain 16-bit `wgmma` on `g` (1: none). A 128×256 tile per block leaves
/// most SMs idle when C has few tiles — a short M (16–256 rows: decode batches, small prefills)
/// against 4096 columns is 16–32 tiles on 132 SMs, each block walking all of k alone. Splitting
/// k into s ranges gives tiles·s blocks, each writing an fp32 partial tile, and a second pass
/// sums the s partials in order (deterministic) into C with α and β. Only where fewer than half
/// the SMs would have a tile; s (≤ 16, ≥ 4 k tiles per range, tiles·s ≤ SMs) is the one whose k
/// steps saved per block most exceed the reduce pass (its launch, the partials written and read,
/// C written) — at k = 768 the pass costs more than the 6 steps it saves (2048×768×768: 25 µs
/// split against cuBLAS's 9 measured on the H200), at 16×4096×14336 it saves ~100 µs.
pub(super) fn wg_splits(g: &Gemm, sms: u32) -> u32 {
    if g.batch != 1 || g.k == 0 || g.dtype == DType::F32 {
        return 1;
    }
    let tiles = g.m.div_ceil(WG_TILE.0 as usize) * g.n.div_ceil(WG_TILE.1 as usize);
    if tiles == 0 || tiles * 2 > sms as usize {
        return 1;
    }
    let ktiles = g.k.div_ceil(wg_bk(g.dtype) as usize);
    let most = (sms as usize / tiles)
        .min(ktiles / WG_MIN_SPLIT_KTILES)
        .min(WG_MAX_SPLITS);
    let mn = (g.m * g.n) as f64;
    let gain = |s: usize| {
        let saved = (ktiles - ktiles.div_ceil(s)) as f64 * SPLIT_US_PER_KSTEP;
        let moved = 2.0 * s as f64 * mn * 4.0 + mn * g.dtype.size_in_bytes() as f64;
        saved - SPLIT_REDUCE_US - moved / SPLIT_BYTES_PER_US
    };
    let best = (2..=most).max_by(|&a, &b| gain(a).total_cmp(&gain(b)));
    match best {
        // The kernel gives split z the k tiles from z·⌈ktiles/s⌉: as many splits as that needs,
        // so none is empty.
        Some(s) if gain(s) > 0.0 => ktiles.div_ceil(ktiles.div_ceil(s)) as u32,
        _ => 1,
    }
}

/// How the persistent `wgmma` grid walks the C tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Persistent {
    /// At most this many blocks (one per SM).
    pub ctas: u32,
    /// Row tiles per group of the grouped (L2-friendly) tile order.
    pub group_m: u32,
    /// Blocks per cluster along m (1, or 2: B tiles multicast to the pair).
    pub cluster: u32,
    /// Splits of k (1: none): each split's fp32 partial C into a workspace, summed by
    /// `matmul_splitk_reduce` (`wg_splits`).
    pub splits: u32,
    /// `wgmma` with the TMA-store epilogue compiled in and chosen (used where
    /// `wg_tma_store_ok` holds for the launch).
    pub tma_store: bool,
}

pub(super) fn wgmma_program(
    dtype: DType,
    a_trans: bool,
    b_trans: bool,
    cluster: u32,
    epi: Option<Epi>,
) -> Program {
    let mut p = Program::new(WGMMA)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_WGMMA_BF16", (dtype == DType::BF16) as u32);
    if dtype == DType::F32 {
        p = p.define("FE_WGMMA_TF32", 1);
    }
    let p = p
        .define("FE_A_TRANS", a_trans as u32)
        .define("FE_B_TRANS", b_trans as u32)
        .define("FE_STAGES", wg_stages(dtype, epi))
        .define("FE_CLUSTER", cluster);
    let p = if wg_has_tma_store(dtype, epi) {
        p.define("FE_TMA_STORE", 1)
    } else {
        p
    };
    with_epilogue(p, epi)
}

/// The `wgmma` kernel's function name in a module built with `epi`: the activation-backward build
/// is `matmul_wgmma_dact`, so a profile of a linear backward tells it from the plain GEMMs.
pub fn wgmma_function(epi: Option<Epi>) -> &'static str {
    match epi {
        Some(Epi { dact: true, .. }) => "matmul_wgmma_dact",
        _ => "matmul_wgmma",
    }
}

/// The tuner's key for `wgmma` on `g`: device, dtype, layout and the power-of-two class of
/// m, n, k, batch (a config that wins at 8192³ is not assumed to win at 512³).
fn wg_tune_key(dev: &CudaDevice, g: &Gemm) -> String {
    format!(
        "{}/matmul_wgmma/{}/{}{}/{}",
        dev.props().name,
        g.dtype,
        if g.a.trans { 'T' } else { 'N' },
        if g.b.trans { 'T' } else { 'N' },
        crate::core::tune::shape_class(&[g.m, g.n, g.k, g.batch])
    )
}

/// `g` and `p` with C moved to fresh scratch (dense rows, stream-ordered, alive while the buffer
/// is): what a tuner times candidates on, leaving the caller's C untouched.
pub(super) fn scratch_c(
    g: &Gemm,
    p: Ptrs,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
) -> Result<(Gemm, Ptrs, DeviceBuffer)> {
    let mut gs = *g;
    gs.c.ld = g.n;
    gs.c.trans = false;
    gs.c.batch_stride = g.m * g.n;
    let scratch = dev.alloc(g.batch * g.m * g.n * g.dtype.size_in_bytes(), stream)?;
    let q = Ptrs {
        c: scratch.ptr(),
        ..p
    };
    Ok((gs, q, scratch))
}

/// `wgmma`'s configuration for `g`: remembered, or timed now on the caller's A and B (each
/// candidate writes a scratch C with beta = 0, so the caller's C is untouched) — or the default,
/// not remembered, while the stream captures a CUDA graph (nothing may be timed then).
pub fn wg_tuned(g: &Gemm, p: Ptrs, dev: &Arc<CudaDevice>, stream: &Stream) -> Result<WgConfig> {
    use crate::core::tune;
    let key = wg_tune_key(dev, g);
    if let Some(c) = tune::remembered(&key, &WG_CONFIGS) {
        return Ok(c);
    }
    if crate::core::cuda::is_capturing(stream) {
        return Ok(WG_DEFAULT);
    }
    let (gs, q, _scratch) = scratch_c(g, p, dev, stream)?;
    tune::pick(&key, &WG_CONFIGS, |&cfg| {
        let l = plan_with("wgmma", &gs, dev, cfg)?;
        crate::core::cuda::rows::time_briefly(dev, stream, || launch(&l, &gs, q, 1.0, 0.0, stream))
    })
    .map(|(c, _)| c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::act::Activation;

    /// op(X)[r][p] of an operand in the kernels' convention (common.cuh): A (is_a) is m×k,
    /// A[a_trans ? p·lda + i : i·lda + p]; B is k×n, B[b_trans ? j·ldb + p : p·ldb + j]; plus
    /// z·batch_stride. `r` is i for A and j for B.
    fn op_at(x: &[f32], o: &Operand, is_a: bool, z: usize, r: usize, p: usize) -> f32 {
        let idx = if is_a == o.trans {
            p * o.ld + r
        } else {
            r * o.ld + p
        };
        x[z * o.batch_stride + idx]
    }

    /// op(Y) == op(X) element by element over `batch` × `rows` × `k`: a pre-pass's copy `y`
    /// (laid out as `py`) holds what the original `x` (laid out as `px`) does.
    fn assert_same_op(
        (y, py): (&[f32], &Operand),
        (x, px): (&[f32], &Operand),
        is_a: bool,
        [batch, rows, k]: [usize; 3],
    ) {
        for z in 0..batch {
            for r in 0..rows {
                for p in 0..k {
                    assert_eq!(
                        op_at(y, py, is_a, z, r, p),
                        op_at(x, px, is_a, z, r, p),
                        "is_a {is_a} {px:?} → {py:?}: z {z} r {r} p {p}"
                    );
                }
            }
        }
    }

    #[test]
    fn splits_fill_idle_sms_without_empty_or_tiny_ranges() {
        let g = |m: usize, n: usize, k: usize, batch: usize| Gemm {
            batch,
            m,
            n,
            k,
            a: Operand {
                ld: k,
                trans: false,
                batch_stride: m * k,
            },
            b: Operand {
                ld: k,
                trans: true,
                batch_stride: n * k,
            },
            c: Operand {
                ld: n,
                trans: false,
                batch_stride: m * n,
            },
            dtype: DType::BF16,
            device: crate::core::device::Device::Cpu,
        };
        // Decode and small prefills against Llama-3-8B-like projections: 16–56 tiles.
        assert_eq!(wg_splits(&g(16, 4096, 14336, 1), 132), 8);
        assert_eq!(wg_splits(&g(16, 4096, 4096, 1), 132), 8);
        assert!(wg_splits(&g(256, 4096, 4096, 1), 132) > 1);
        assert_eq!(wg_splits(&g(128, 14336, 4096, 1), 132), 1);
        // Enough tiles, batched, short k or large partials (the pass costs more than it saves:
        // 128×14336×4096 ran 55.8 µs split in two, 49.9 whole on the H200), tf32: no split.
        assert_eq!(wg_splits(&g(1000, 4096, 4096, 1), 132), 1);
        assert_eq!(wg_splits(&g(16, 4096, 14336, 2), 132), 1);
        assert_eq!(wg_splits(&g(16, 768, 192, 1), 132), 1);
        assert_eq!(wg_splits(&g(2048, 768, 768, 1), 132), 1);
        assert_eq!(wg_splits(&g(16, 768, 768, 1), 132), 1);
        let mut f = g(16, 4096, 14336, 1);
        f.dtype = DType::F32;
        assert_eq!(wg_splits(&f, 132), 1);
        for (m, n, k) in [
            (1, 256, 4296),
            (64, 300, 1400),
            (77, 768, 768),
            (200, 2000, 99999),
        ] {
            let s = wg_splits(&g(m, n, k, 1), 132) as usize;
            let ktiles = k.div_ceil(64);
            let per = ktiles.div_ceil(s);
            let tiles = m.div_ceil(128) * n.div_ceil(256);
            assert!(s <= WG_MAX_SPLITS && s * tiles <= 132, "{m}×{n}×{k}: {s}");
            assert!(s == 1 || per >= WG_MIN_SPLIT_KTILES, "{m}×{n}×{k}: {s}");
            assert!(
                (s - 1) * per < ktiles,
                "{m}×{n}×{k}: split {s} of {per} is empty"
            );
        }
    }

    #[test]
    fn repitch16_keeps_op_x_and_aligns_its_rows() {
        // (is_a, trans, ld, batch_stride, rows, k, batch): every layout, odd ld and strides,
        // batched and broadcast, a row of one element.
        let cases = [
            (true, false, 5, 0, 3, 5, 1),
            (true, true, 7, 7 * 6, 7, 6, 2),
            (false, false, 9, 0, 9, 4, 3),
            (false, true, 13, 13 * 9, 9, 13, 2),
            (false, false, 33, 33 * 3 + 1, 33, 3, 2),
            (true, true, 1, 0, 1, 1, 1),
            (true, false, 4097, 0, 2, 4097, 1),
        ];
        for (is_a, trans, ld, bs, rows, k, batch) in cases {
            let o = Operand {
                ld,
                trans,
                batch_stride: bs,
            };
            let len = bs * batch + ld * rows.max(k) + 1;
            let x: Vec<f32> = (0..len).map(|i| i as f32 + 0.5).collect();
            // Mirror of matmul_wgmma_repitch: Y[(z·outer + r)·ldy + c] = X[z·stride + r·ld + c]
            // for c < inner, zeros up to ldy.
            let (outer, inner) = stored_dims(&o, is_a, rows, k);
            let packed = repitched(&o, outer, inner);
            let copies = if bs == 0 { 1 } else { batch };
            let mut y = vec![f32::NAN; copies * outer * packed.ld];
            for z in 0..copies {
                for r in 0..outer {
                    for c in 0..packed.ld {
                        y[(z * outer + r) * packed.ld + c] = if c < inner {
                            x[z * bs + r * ld + c]
                        } else {
                            0.0
                        };
                    }
                }
            }
            assert!(rows_aligned16(&packed, 256), "{packed:?}");
            assert!(packed.ld >= inner && packed.ld < inner + 8);
            assert_eq!(packed.trans, trans);
            assert_same_op((&y, &packed), (&x, &o), is_a, [batch, rows, k]);
        }
        // In place: pitch, batch stride and base all 16-byte multiples.
        let o = |ld, batch_stride| Operand {
            ld,
            trans: false,
            batch_stride,
        };
        assert!(rows_aligned16(&o(64, 0), 0));
        assert!(!rows_aligned16(&o(64, 0), 2));
        assert!(!rows_aligned16(&o(63, 0), 0));
        assert!(!rows_aligned16(&o(64, 64 * 3 + 4), 0));
    }

    #[test]
    fn tf32_pack_keeps_op_x_and_makes_it_k_major() {
        // (is_a, trans, ld, batch_stride, rows, k, batch): every layout, odd and aligned ld,
        // batched and broadcast.
        let cases = [
            (true, false, 5, 0, 3, 5, 1),
            (true, true, 7, 7 * 6, 7, 6, 2),
            (false, false, 9, 0, 9, 4, 3),
            (false, true, 8, 8 * 9, 9, 8, 2),
            (false, false, 33, 33 * 3, 33, 3, 2),
            (true, true, 1, 0, 1, 1, 1),
        ];
        for (is_a, trans, ld, bs, rows, k, batch) in cases {
            let o = Operand {
                ld,
                trans,
                batch_stride: bs,
            };
            // Source storage with distinct values.
            let len = bs * batch.max(1) + ld * rows.max(k) + 1;
            let x: Vec<f32> = (0..len).map(|i| i as f32 + 0.5).collect();
            // Mirror of matmul_wgmma_pack: Y[z][r][p] = X[z·stride + r·sr + p·sp].
            let packed = tf32_packed(&o, is_a, rows, k);
            let (sr, sp) = tf32_pack_strides(&o, is_a);
            let copies = if bs == 0 { 1 } else { batch };
            let mut y = vec![f32::NAN; copies * rows * packed.ld];
            for z in 0..copies {
                for r in 0..rows {
                    for p in 0..k {
                        y[z * rows * packed.ld + r * packed.ld + p] = x[z * bs + r * sr + p * sp];
                    }
                }
            }
            assert_eq!(packed.ld % 4, 0, "16-byte rows");
            assert!(packed.ld >= k);
            // K-major and aligned: the kernel reads it in place (at a 16-byte aligned base).
            assert!(tf32_direct(&packed, is_a, 256));
            assert_same_op((&y, &packed), (&x, &o), is_a, [batch, rows, k]);
        }
        // Operands read in place: K-major with 16-byte rows and base only.
        let km = |is_a: bool, ld| Operand {
            ld,
            trans: !is_a,
            batch_stride: 0,
        };
        assert!(tf32_direct(&km(true, 64), true, 0x1000));
        assert!(tf32_direct(&km(false, 64), false, 0x1000));
        assert!(!tf32_direct(&km(true, 66), true, 0x1000));
        assert!(!tf32_direct(&km(true, 64), true, 0x1004));
        assert!(!tf32_direct(&km(true, 64), false, 0x1000)); // B row-major: n-contiguous
    }

    /// 128-byte swizzle as TMA writes it and wgmma reads it: the 16-byte chunk index (address
    /// bits 4–6) XORed with the row within the 1024-byte atom (bits 7–9).
    fn sw128(off: u32) -> u32 {
        off ^ (((off >> 7) & 7) << 4)
    }

    #[test]
    fn wgmma_stage_layout_is_the_same_bytes_for_every_dtype() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let es = dtype.size_in_bytes() as u32;
            let (bk, ks) = (wg_bk(dtype), wg_kstep(dtype));
            assert_eq!(
                bk * es,
                WG_ROW_BYTES,
                "{dtype:?}: a stage is one swizzle row of k"
            );
            assert_eq!(
                ks * es,
                32,
                "{dtype:?}: one wgmma reads 32 bytes of each row"
            );
            assert_eq!(bk / ks, 4, "{dtype:?}: 4 wgmmas per stage");
            // A tile (128 rows × bk) as the K-major box lands (row r at r·128 bytes, element c
            // at c·es, swizzled), against what the consumers' descriptors address: start
            // kk·32 (+ warpgroup c·8 KiB), 8-row groups SBO = 1024 bytes apart, rows 128 apart.
            let mut seen = std::collections::HashSet::new();
            for r in 0..WG_TILE.0 {
                for c in 0..bk {
                    let written = sw128(r * 128 + c * es);
                    let (wg, i) = (r / 64, r % 64);
                    let (kk, j) = (c / ks, c % ks);
                    let start = wg * 64 * 128 + kk * 32;
                    let read = sw128(start + (i / 8) * 1024 + (i % 8) * 128 + j * es);
                    assert_eq!(written, read, "{dtype:?} row {r} k {c}");
                    assert!(written < WG_TILE.0 * WG_ROW_BYTES);
                    assert!(seen.insert(written), "two elements at byte {written}");
                }
            }
        }
        assert_eq!(
            wg_ring_smem(WG_STAGES),
            WG_STAGES * 48 * 1024 + 16 * WG_STAGES + 1024,
            "48 KiB per stage"
        );
    }

    /// The TMA-store epilogue (wgmma.cu, store_warp_tma): each stmatrix.x4 lane address, with the
    /// fragment each of its 4 matrices holds, must put every element of the warp's 16×64 box
    /// where the TMA store (128-byte swizzle, rows of 64 16-bit elements) reads it — once.
    #[test]
    fn wgmma_tma_store_staging_matches_the_swizzled_box() {
        let mut seen = std::collections::HashSet::new();
        for p in 0..4u32 {
            for lane in 0..32u32 {
                let (lr, mat) = (lane & 7, lane >> 3);
                // The kernel's address for this lane: row (mat & 1)·8 + lr, chunk 2p + mat/2.
                let chunk = 2 * p + (mat >> 1);
                let addr = ((mat & 1) * 8 + lr) * 128 + ((chunk ^ lr) << 4);
                // Matrix `mat` holds fragment rows 8·(mat & 1) + 0..8 and columns 8·(2p + mat/2)
                // + 0..8 of the box; this lane's address is its row lr, 8 elements wide.
                let (row, col0) = ((mat & 1) * 8 + lr, 8 * (2 * p + (mat >> 1)));
                for e in 0..8 {
                    let read = sw128(row * 128 + (col0 + e) * 2);
                    assert_eq!(addr + 2 * e, read, "p {p} lane {lane} element {e}");
                    assert!(read < 16 * 128);
                    assert!(seen.insert(read));
                }
            }
        }
        assert_eq!(seen.len(), 16 * 64, "every element of the box written");
        let pair = Epi {
            act: Activation::GeluTanh,
            pairs: true,
            dact: false,
        };
        let dact = Epi { dact: true, ..pair };
        let smem = |e| wg_smem(DType::BF16, e);
        assert_eq!(
            smem(None),
            wg_ring_smem(3) + WG_STAGING,
            "3 stages beside whole slices"
        );
        assert_eq!(smem(Some(dact)), smem(None) + 16, "and the DACT handshake");
        assert_eq!(
            smem(Some(pair)),
            wg_ring_smem(4) + WG_PAIR_STAGING,
            "pairs: 4 stages"
        );
        assert_eq!(
            wg_smem(DType::F32, None),
            wg_ring_smem(4),
            "no store epilogue: 4 stages"
        );
        assert_eq!(
            WG_STAGING,
            8 * 4 * 16 * 64 * 2,
            "each warp's 16×256 slice of 16-bit C"
        );
        for e in [None, Some(pair), Some(dact)] {
            assert!(smem(e) <= 227 * 1024, "ring + staging fit one H100 block");
        }
    }
}
