//! CUDA host code of the matmul family: launching each variant's kernel, and cuBLAS as the peer.

use super::epilogue::{Activation, EpiPtrs};
use super::{Gemm, MatmulOptions, Operand, OP};
use crate::core::cuda::jit::KernelSource;
use crate::core::cuda::jit::Program;
use crate::core::cuda::{blas, device, CudaDevice, DeviceBuffer, Kernel, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::{KernelSpec, Precision};
use crate::core::tensor::Tensor;
use std::sync::Arc;

/// A tiled kernel: `kernels/common.cuh` (launch conventions, layout dispatch, tile loaders)
/// followed by the kernel's own file.
macro_rules! tiled_source {
    ($name:literal, $file:literal) => {
        KernelSource {
            name: concat!("matmul/", $name),
            src: concat!(include_str!("kernels/common.cuh"), include_str!($file)),
        }
    };
}

const NAIVE: KernelSource = tiled_source!("naive", "kernels/naive.cu");
const COALESCED: KernelSource = tiled_source!("coalesced", "kernels/coalesced.cu");
const SMEM_TILED: KernelSource = tiled_source!("smem_tiled", "kernels/smem_tiled.cu");
const BLOCKTILE_1D: KernelSource = tiled_source!("blocktile_1d", "kernels/blocktile_1d.cu");
const BLOCKTILE_2D: KernelSource = tiled_source!("blocktile_2d", "kernels/blocktile_2d.cu");
const VECTORIZED: KernelSource = tiled_source!("vectorized", "kernels/vectorized.cu");
const WARPTILE: KernelSource = tiled_source!("warptile", "kernels/warptile.cu");
const MMA: KernelSource = tiled_source!("mma", "kernels/mma.cu");
const WGMMA: KernelSource = tiled_source!("wgmma", "kernels/wgmma.cu");
const SKINNY: KernelSource = tiled_source!("skinny", "kernels/skinny.cu");

/// One fp32 SIMT rung: its module, entry point, threads per block, C tile per block (rows,
/// columns) and a short description of the configuration.
struct Simt {
    name: &'static str,
    source: KernelSource,
    func: &'static str,
    threads: u32,
    tile: (u32, u32),
    /// Dynamic shared memory per block (bytes).
    smem: u32,
    config: &'static str,
}

/// `warptile`'s cp.async ring: 3 stages × 16 k × (260 + 132 padded floats) × 4 bytes, the
/// kernel's W_SMEM_BYTES (it traps when given less).
const WARPTILE_SMEM: u32 = 3 * 16 * (260 + 132) * 4;

const SIMT: &[Simt] = &[
    Simt {
        name: "coalesced",
        source: COALESCED,
        func: "matmul_coalesced",
        threads: 1024,
        tile: (32, 32),
        smem: 0,
        config: "block 32×32, 1 output/thread, lanes on the contiguous side",
    },
    Simt {
        name: "smem_tiled",
        source: SMEM_TILED,
        func: "matmul_smem_tiled",
        threads: 1024,
        tile: (32, 32),
        smem: 0,
        config: "tile 32×32×32 in smem, 1 output/thread",
    },
    Simt {
        name: "blocktile_1d",
        source: BLOCKTILE_1D,
        func: "matmul_blocktile_1d",
        threads: 512,
        tile: (64, 64),
        smem: 0,
        config: "tile 64×64×8, 8×1 outputs/thread",
    },
    Simt {
        name: "blocktile_2d",
        source: BLOCKTILE_2D,
        func: "matmul_blocktile_2d",
        threads: 256,
        tile: (128, 128),
        smem: 0,
        config: "tile 128×128×8, 8×8 outputs/thread",
    },
    Simt {
        name: "vectorized",
        source: VECTORIZED,
        func: "matmul_vectorized",
        threads: 256,
        tile: (128, 128),
        smem: 0,
        config: "tile 128×128×8, 8×8 outputs/thread, float4 loads",
    },
    Simt {
        name: "warptile",
        source: WARPTILE,
        func: "matmul_warptile",
        threads: 256,
        tile: (256, 128),
        smem: WARPTILE_SMEM,
        config: "tile 256×128×16, 8 warps of 64×64, 16×8 outputs/thread, 3-stage cp.async ring, 1 block/SM",
    },
];

/// Stages of the cp.async ring of `mma_pipelined` (`mma` has one).
const MMA_STAGES: u32 = 4;
/// Stages of `mma_pipelined` with the element-wise fused epilogue (all four layouts in one
/// module): at 3 and 4 the 16-bit epilogue kernels spill (ptxas: 255 registers + 8–1200 bytes);
/// at 2 none does (236–253 registers). The pair epilogue is compiled for one layout and runs the
/// plain kernel's MMA_STAGES (155–175 registers, no spills).
const MMA_EPI_STAGES: u32 = 2;
/// Shared memory per stage of the mma kernels: A and B tiles of 128 rows × (64 + 16) bytes.
const MMA_STAGE_BYTES: u32 = 2 * 128 * 80;

/// C tile of one `wgmma` block (rows, columns), bytes of k per stage (one 128-byte swizzle row:
/// 64 bf16/f16 or 32 f32 elements, see `wg_bk`), ring depth and threads (3 warpgroups).
const WG_TILE: (u32, u32) = (128, 256);
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
const WG_THREADS: u32 = 384;
/// Cluster sizes `wgmma` is compiled for, and the one it runs with: pairs of blocks along m
/// sharing (multicasting) each B tile measured 0–5% faster than single blocks on the H100.
pub const WG_CLUSTERS: [u32; 2] = [1, 2];
const WG_CLUSTER: u32 = 2;
/// Cluster rows per group of the grouped tile order (8 and 32 measured within noise of each
/// other at 8192³; 4 was slower).
const WG_GROUP_M: u32 = 8;

/// A `wgmma` launch configuration: blocks per cluster (B multicast across them), cluster rows
/// per group of the tile order, and how the 16-bit plain kernel writes C (TMA stores from a
/// shared-memory staging area, or the earlier direct stores from registers). Shown in `bench`
/// as e.g. `c2g8` (`c2g8d`: direct stores), and accepted by `MatmulOptions::config` and
/// `ferrite bench matmul --config` under that name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
fn forced_wg_config() -> Result<Option<WgConfig>> {
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
fn wg_smem(dtype: DType, epi: Option<Epi>) -> u32 {
    let (stages, staging) = wg_layout(dtype, epi);
    wg_ring_smem(stages) + staging + if is_dact(epi) { 16 } else { 0 }
}

/// Whether `epi` is the activation-backward epilogue (its module has its own ring and staging).
fn is_dact(epi: Option<Epi>) -> bool {
    matches!(epi, Some(Epi { dact: true, .. }))
}

/// Stages of the `wgmma` ring in the module for `dtype` / `epi`.
fn wg_stages(dtype: DType, epi: Option<Epi>) -> u32 {
    wg_layout(dtype, epi).0
}

/// Whether the `wgmma` module for `dtype` / `epi` has the TMA-store epilogue: 16-bit C with the
/// plain or the pair epilogue (Y and Z staged and TMA-stored on interior tiles; the element-wise
/// epilogue of `persistent` keeps its direct stores, as the ladder's earlier step).
fn wg_has_tma_store(dtype: DType, epi: Option<Epi>) -> bool {
    dtype != DType::F32 && epi.is_none_or(|e| e.pairs)
}

/// k per `wgmma` stage in elements (wgmma.cu's BK): 64 for bf16/f16, 32 for f32 (tf32).
fn wg_bk(dtype: DType) -> u32 {
    WG_ROW_BYTES / dtype.size_in_bytes() as u32
}

/// k of one wgmma instruction (wgmma.cu's KSTEP: 32 bytes of a K-major row): 16 for bf16/f16,
/// 8 for tf32.
fn wg_kstep(dtype: DType) -> u32 {
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

/// Whether a CUDA variant runs on tensor cores: f32 inputs then run as tf32, and only when the
/// caller asks for `Precision::Tf32`.
pub fn tensor_core(variant: &str) -> bool {
    matches!(variant, "mma" | "mma_pipelined" | "wgmma" | "skinny")
}

/// wgmma, setmaxnreg and the sm_90a target exist on Hopper only (later GPUs have other MMAs).
pub const WGMMA_ARCH: &str = "needs sm_90a (Hopper, compute capability 9.x)";

/// Why `wgmma` cannot run `g` (None: it can). bf16/f16: the tensor maps need 16-byte aligned
/// rows, leading dims and batch strides multiples of 8 elements (the base address is checked at
/// launch). f32 (tf32): any layout and alignment (operands TMA cannot read as they are are packed
/// first).
pub fn wgmma_declines(g: &Gemm) -> Option<String> {
    if !matches!(g.dtype, DType::BF16 | DType::F16 | DType::F32) {
        return Some("is bf16/f16 (and f32 as tf32) only".into());
    }
    if g.k == 0 {
        return None; // nothing is read: C = beta·C
    }
    let halves = if g.dtype == DType::F32 {
        &[][..]
    } else {
        &[("a", &g.a), ("b", &g.b)][..]
    };
    for &(name, o) in halves {
        if o.ld % 8 != 0 || o.batch_stride % 8 != 0 {
            return Some(format!(
                "needs 16-byte aligned rows for TMA: {name} has ld {} / batch stride {} (not multiples of 8 elements)",
                o.ld, o.batch_stride
            ));
        }
    }
    if g.m > i32::MAX as usize - 256 || g.n > i32::MAX as usize - 256 {
        return Some("needs m, n < 2^31 - 256 (32-bit TMA coordinates)".into());
    }
    None
}

/// The most rows of A `skinny` takes (8 tiles of the MMA's 8 columns).
pub const SKINNY_MAX_M: usize = 64;
/// The `skinny` kernel's entry points: tiles of 8 rows of A (matmul_skinny{MT}).
const SKINNY_TILES: [u32; 4] = [1, 2, 4, 8];
/// Warps per `skinny` block, split into k-slices × column groups.
const SKINNY_WARPS: u32 = 8;
/// Warps per SM the `skinny` k-split aims for (enough 16-byte loads in flight to cover the DRAM
/// latency at full bandwidth).
const SKINNY_WARPS_PER_SM: usize = 16;

/// Why `skinny` cannot run `g` (None: it can): bf16/f16, m ≤ 64, A row-major and B transposed
/// (both K-contiguous; linear's X and W).
pub fn skinny_declines(g: &Gemm) -> Option<String> {
    if !matches!(g.dtype, DType::BF16 | DType::F16) {
        return Some("is bf16/f16 only (tensor-core dot products)".into());
    }
    if g.m > SKINNY_MAX_M {
        return Some(format!(
            "takes m ≤ {SKINNY_MAX_M} (a short A: decode); m is {}",
            g.m
        ));
    }
    if g.a.trans || !g.b.trans {
        return Some(
            "needs A row-major and B transposed (both K-contiguous, as linear's X and W [n, k])"
                .into(),
        );
    }
    None
}

/// The most rows of A the default selection gives `skinny`; taller problems run `wgmma` /
/// `mma_pipelined` unless `skinny` is asked for by name. Measured on the H100 against `wgmma`
/// and cuBLAS in the same runs (bench/results/2026-11-27-h100-h200-skinny-decode, bf16, m = 1
/// and 8): `skinny` at 0.80–1.05× the better of cuBLAS and cuBLASLt and never behind `wgmma`
/// (2.1–2.7× ahead where n / 256 tiles leave SMs idle: 4096², 4096×14336); 16 rows and more
/// are not measured on the current kernel.
pub const SKINNY_DEFAULT_MAX_M: usize = 8;

/// Whether the default selection runs `skinny` on `g` (it runs whenever asked for by name).
pub fn skinny_by_default(g: &Gemm) -> bool {
    g.m <= SKINNY_DEFAULT_MAX_M
}

/// Why `skinny` does not run `g` in a selection (None: it does): it cannot (`skinny_declines`),
/// or, unless asked for by name (`named`), the default leaves `g` to the tiled kernels.
pub fn skinny_refuses(g: &Gemm, named: bool) -> Option<String> {
    skinny_declines(g).or_else(|| {
        (!named && !skinny_by_default(g)).then(|| {
            format!(
                "is chosen by default for m ≤ {SKINNY_DEFAULT_MAX_M} only (by name it takes up to {SKINNY_MAX_M})"
            )
        })
    })
}

/// `skinny`'s k-slices per column group (1, 2, 4 or 8): doubled while the warps are fewer than
/// SKINNY_WARPS_PER_SM per SM and every slice still gets a pass of k.
fn skinny_slices(g: &Gemm, sms: usize, mt: u32) -> u32 {
    let groups = g.n.div_ceil(16) * g.batch.max(1);
    let pass = skinny_pass(mt) as usize;
    let mut s = 1usize;
    while s < SKINNY_WARPS as usize && groups * s < sms * SKINNY_WARPS_PER_SM && g.k > s * pass {
        s *= 2;
    }
    s as u32
}

/// `skinny`'s dynamic shared memory (kernels/skinny.cu, `Pass`): the k-slices' partial sums, and
/// on sm_90 the warps' rings of B passes under them.
fn skinny_smem(dtype: DType, mt: u32, sm90: bool) -> u32 {
    let row = skinny_pass(mt) * dtype.size_in_bytes() as u32;
    let stages = if mt >= 8 { 4 } else { 3 };
    let ring = SKINNY_WARPS * stages * (16 * row + 8) + 128;
    let red = SKINNY_WARPS * mt * 4 * 32 * 4;
    if sm90 {
        ring.max(red)
    } else {
        red
    }
}

/// k per pass of `skinny` (kernels/skinny.cu, `Pass::K`): the TMA box's width on sm_90.
fn skinny_pass(mt: u32) -> u32 {
    32 * if mt >= 8 { 4 } else { 8 }
}

/// B's tensor map for `skinny` on sm_90 (boxes of one pass × 16 rows, no swizzle), or zeros
/// where the kernel reads B without one (sm_80, or B rows not 16-byte aligned: the kernel's
/// `fe_aligned16` test, made here alike).
fn skinny_b_map(g: &Gemm, b: u64, box_k: u32, sm90: bool) -> Result<TmaDesc> {
    let es = g.dtype.size_in_bytes();
    let aligned = b.is_multiple_of(16)
        && (g.b.ld * es).is_multiple_of(16)
        && (g.b.batch_stride * es).is_multiple_of(16);
    if !sm90 || !aligned {
        return Ok(TmaDesc([0; 16]));
    }
    tensor_map(
        g.dtype,
        b,
        g.k,
        g.n,
        g.b.ld,
        g.batch,
        g.b.batch_stride,
        [box_k, 16],
        false,
    )
}

fn skinny_program(dtype: DType, epi: Option<Epi>) -> Program {
    with_epilogue(
        Program::new(SKINNY).define("FE_ELEM", dtype.cuda_name()),
        epi,
    )
}

fn skinny_functions() -> Vec<String> {
    SKINNY_TILES
        .iter()
        .map(|t| format!("matmul_skinny{t}"))
        .collect()
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
    /// `wgmma` with the TMA-store epilogue compiled in and chosen (used where
    /// `wg_tma_store_ok` holds for the launch).
    pub tma_store: bool,
}

/// A CUtensorMap as the kernel's `const __grid_constant__ TmaDesc` parameter (128 bytes).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TmaDesc([u64; 16]);

/// The 3-D tensor map (contiguous dim, rows, batch) of one operand, boxes of `boxd`, zero fill
/// outside; `swizzle`: the 128-byte swizzle wgmma reads, else dense rows.
#[allow(clippy::too_many_arguments)]
fn tensor_map(
    dtype: DType,
    ptr: u64,
    inner: usize,
    outer: usize,
    ld: usize,
    batch: usize,
    batch_stride: usize,
    boxd: [u32; 2],
    swizzle: bool,
) -> Result<TmaDesc> {
    let es = dtype.size_in_bytes() as u64;
    let (inner, outer) = (inner.max(1) as u64, outer.max(1) as u64);
    let batch = if batch_stride == 0 {
        1
    } else {
        batch.max(1) as u64
    };
    let dims = [inner, outer, batch];
    let strides = [
        ld as u64 * es,
        if batch > 1 {
            batch_stride as u64 * es
        } else {
            ld as u64 * es * outer
        },
    ];
    tensor_map_encode(dtype, ptr, dims, strides, [boxd[0], boxd[1], 1], swizzle)
}

/// cuTensorMapEncodeTiled for a 3-D map (dims innermost first, byte strides of dims 1 and 2),
/// zero fill outside; `swizzle`: 128-byte swizzle, else the box lands as dense rows.
fn tensor_map_encode(
    dtype: DType,
    ptr: u64,
    dims: [u64; 3],
    strides: [u64; 2],
    boxd: [u32; 3],
    swizzle: bool,
) -> Result<TmaDesc> {
    use cudarc::driver::sys;
    let dt = match dtype {
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        // tf32 inputs are loaded as the f32 bits they are (wgmma reads them as tf32).
        DType::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        _ => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    let estr = [1u32; 3];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every array holds `rank` (3, strides 2) entries; the map is written by the call.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dt,
            3,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxd.as_ptr(),
            estr.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            if swizzle {
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
            } else {
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
            },
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::cuda(
            format!("cuTensorMapEncodeTiled (dims {dims:?}, strides {strides:?}, box {boxd:?})"),
            format!("{r:?}"),
        ));
    }
    // SAFETY: initialised by the successful call above.
    Ok(TmaDesc(unsafe { map.assume_init() }.opaque))
}

/// Whether a launch of a TMA-store `wgmma` kernel can store C (and Z) by TMA: beta = 0 (C is
/// only written), k > 0, and the base, row pitch and batch stride of C and of a present Z
/// multiples of 16 bytes (TMA's rule).
fn wg_tma_store_ok(g: &Gemm, c: u64, beta: f32, e: &EpiPtrs) -> bool {
    let es = g.dtype.size_in_bytes();
    let aligned = |ptr: u64, ld: usize, stride: usize| {
        ptr.is_multiple_of(16)
            && (ld * es).is_multiple_of(16)
            && (g.batch <= 1 || (stride * es).is_multiple_of(16))
    };
    beta == 0.0
        && g.k > 0
        && aligned(c, g.c.ld, g.c.batch_stride)
        && (e.z == 0 || aligned(e.z, e.ldz, e.stride_z))
}

/// The tensor map of an m×n output (C or Z) for the TMA-store epilogue: boxes of 64 columns × 16
/// rows (one consumer warp's store), 128-byte swizzle, as the kernel stages them.
fn wgmma_out_map(g: &Gemm, ptr: u64, ld: usize, batch_stride: usize) -> Result<TmaDesc> {
    tensor_map(
        g.dtype,
        ptr,
        g.n,
        g.m,
        ld,
        g.batch,
        batch_stride,
        [64, 16],
        true,
    )
}

/// Tensor maps of A and B for `wgmma`: an operand whose contiguous dim is k is one box of
/// 128 bytes of k (64 bf16/f16, 32 f32) × tile rows; one whose contiguous dim is m / n (16-bit
/// only) is loaded in 64×64 boxes.
fn wgmma_maps(g: &Gemm, p: Ptrs, cluster: u32) -> Result<(TmaDesc, TmaDesc)> {
    if g.k == 0 {
        return Ok((TmaDesc([0; 16]), TmaDesc([0; 16])));
    }
    if !p.a.is_multiple_of(16) || !p.b.is_multiple_of(16) {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: "CUDA variant `wgmma` needs 16-byte aligned operand bases (TMA)".into(),
        });
    }
    // With a cluster, each block loads (and multicasts) 1/cluster of the B tile.
    let (bm, bn) = (WG_TILE.0, WG_TILE.1 / cluster);
    let bk = wg_bk(g.dtype);
    let a = if g.a.trans {
        tensor_map(
            g.dtype,
            p.a,
            g.m,
            g.k,
            g.a.ld,
            g.batch,
            g.a.batch_stride,
            [64, 64],
            true,
        )?
    } else {
        tensor_map(
            g.dtype,
            p.a,
            g.k,
            g.m,
            g.a.ld,
            g.batch,
            g.a.batch_stride,
            [bk, bm],
            true,
        )?
    };
    let b = if g.b.trans {
        tensor_map(
            g.dtype,
            p.b,
            g.k,
            g.n,
            g.b.ld,
            g.batch,
            g.b.batch_stride,
            [bk, bn],
            true,
        )?
    } else {
        tensor_map(
            g.dtype,
            p.b,
            g.n,
            g.k,
            g.b.ld,
            g.batch,
            g.b.batch_stride,
            [64, 64],
            true,
        )?
    };
    Ok((a, b))
}

/// Which fused epilogue a kernel is compiled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Epi {
    pub act: Activation,
    /// The pair epilogue (`-DFE_EPI_PAIRS=1`: interior tiles stored as 2-element pairs with the
    /// bias in registers, SFU activations for 16-bit outputs; `mma_pipelined` and `wgmma` only)
    /// instead of the element-wise one.
    pub pairs: bool,
    /// The activation's backward (`-DFE_EPI_DACT=1`, `wgmma` with the pair epilogue only):
    /// C = alpha·acc · act'(R), R the pre-activation of the layer below (bias and Z absent).
    pub dact: bool,
}

/// The `FE_EPI` (and `FE_EPI_PAIRS`) defines of an epilogue kernel (absent for the plain GEMM, so
/// its module, cache key and code are exactly the plain kernel's).
fn with_epilogue(p: Program, epi: Option<Epi>) -> Program {
    match epi {
        Some(Epi { act, pairs, dact }) => {
            let p = p.define("FE_EPI", 1 + act.code());
            let p = if pairs {
                p.define("FE_EPI_PAIRS", 1)
            } else {
                p
            };
            if dact {
                p.define("FE_EPI_DACT", 1)
            } else {
                p
            }
        }
        None => p,
    }
}

fn wgmma_program(
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

/// Device pointers of the three operands (first element of each view).
#[derive(Clone, Copy, Debug)]
pub struct Ptrs {
    pub a: u64,
    pub b: u64,
    pub c: u64,
}

fn naive_program(dtype: DType, epi: Option<Activation>) -> Program {
    let epi = epi.map(|act| Epi {
        act,
        pairs: false,
        dact: false,
    });
    with_epilogue(
        Program::new(NAIVE).define("FE_ELEM", dtype.cuda_name()),
        epi,
    )
}

/// The mma kernel for `dtype` (f32 = tf32 inputs) with `stages` cp.async stages. `layout` (A
/// transposed, B transposed) compiles that layout only (the pair epilogue kernels: one body
/// instead of four keeps their registers at ~160, see mma.cu); None compiles all four, picked at
/// run time.
fn mma_program(
    dtype: DType,
    stages: u32,
    epi: Option<Epi>,
    layout: Option<(bool, bool)>,
) -> Program {
    let kind = match dtype {
        DType::BF16 => 1,
        DType::F32 => 2,
        _ => 0,
    };
    let mut p = Program::new(MMA)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_MMA_KIND", kind)
        .define("FE_STAGES", stages);
    if let Some((at, bt)) = layout {
        p = p
            .define("FE_A_TRANS", at as u32)
            .define("FE_B_TRANS", bt as u32);
    }
    with_epilogue(p, epi)
}

/// Layouts (A transposed, B transposed) the mma pair-epilogue kernels are build-checked in: the
/// linear layer's (X row-major, W `[out, in]` = B transposed) for every activation and dtype, the
/// other three for one activation (their bodies are the plain kernel's, checked there too).
const EPI_LINEAR_LAYOUT: (bool, bool) = (false, true);
const EPI_OTHER_LAYOUTS: [(bool, bool); 3] = [(false, false), (true, false), (true, true)];

/// Every module and specialisation this family compiles (for `ferrite kernels`).
pub fn kernel_specs() -> Vec<KernelSpec> {
    let spec = |program: Program, func: &str| KernelSpec {
        program,
        functions: vec![func.into()],
        min_arch: Arch::SM80,
    };
    let mut v: Vec<KernelSpec> = [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .map(|d| spec(naive_program(d, None), "matmul_naive"))
        .collect();
    v.extend(SIMT.iter().map(|r| spec(Program::new(r.source), r.func)));
    for stages in [1, MMA_STAGES] {
        for d in [DType::F16, DType::BF16, DType::F32] {
            v.push(spec(mma_program(d, stages, None, None), "matmul_mma"));
        }
    }
    for d in [DType::F16, DType::BF16] {
        for (at, bt) in [(false, false), (false, true), (true, false), (true, true)] {
            for cluster in WG_CLUSTERS {
                v.push(KernelSpec {
                    program: wgmma_program(d, at, bt, cluster, None),
                    functions: vec!["matmul_wgmma".into()],
                    min_arch: Arch::SM90,
                });
            }
        }
    }
    // tf32: one layout (K-major A and B; others are packed into it) and its pack pre-pass.
    for cluster in WG_CLUSTERS {
        v.push(KernelSpec {
            program: wgmma_program(DType::F32, false, true, cluster, None),
            functions: vec!["matmul_wgmma".into(), "matmul_wgmma_pack".into()],
            min_arch: Arch::SM90,
        });
    }
    for d in [DType::F16, DType::BF16] {
        v.push(KernelSpec {
            program: skinny_program(d, None),
            functions: skinny_functions(),
            min_arch: Arch::SM80,
        });
    }
    v.extend(epilogue_specs());
    v.extend(grouped_specs());
    v
}

/// The epilogue specialisations a linear layer launches: every activation for `naive` and
/// `mma_pipelined` (f32 = tf32, f16, bf16) and for `wgmma` in the layer's layout (X row-major,
/// W `[out, in]` row-major = B transposed) with the cluster it runs; element-wise and pair
/// epilogues (`mma_pipelined` with pairs: one module per layout, see EPI_LINEAR_LAYOUT).
pub fn epilogue_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for act in Activation::ALL {
        let elem = Some(Epi {
            act,
            pairs: false,
            dact: false,
        });
        let pairs = Some(Epi {
            act,
            pairs: true,
            dact: false,
        });
        for d in [DType::F32, DType::F16, DType::BF16] {
            v.push(KernelSpec {
                program: naive_program(d, Some(act)),
                functions: vec!["matmul_naive".into()],
                min_arch: Arch::SM80,
            });
            v.push(KernelSpec {
                program: mma_program(d, MMA_EPI_STAGES, elem, None),
                functions: vec!["matmul_mma".into()],
                min_arch: Arch::SM80,
            });
            let others: &[(bool, bool)] = if act == Activation::GeluTanh {
                &EPI_OTHER_LAYOUTS
            } else {
                &[]
            };
            for &layout in std::iter::once(&EPI_LINEAR_LAYOUT).chain(others) {
                v.push(KernelSpec {
                    program: mma_program(d, MMA_STAGES, pairs, Some(layout)),
                    functions: vec!["matmul_mma".into()],
                    min_arch: Arch::SM80,
                });
            }
        }
        for d in [DType::F16, DType::BF16] {
            v.push(KernelSpec {
                program: skinny_program(d, elem),
                functions: skinny_functions(),
                min_arch: Arch::SM80,
            });
            for epi in [elem, pairs] {
                v.push(KernelSpec {
                    program: wgmma_program(d, false, true, WG_CLUSTER, epi),
                    functions: vec!["matmul_wgmma".into()],
                    min_arch: Arch::SM90,
                });
            }
            // The linear backward's dX GEMM (dZ row-major · W row-major) forming the layer
            // below's dZ in its epilogue.
            if act != Activation::None {
                let dact = Epi {
                    act,
                    pairs: true,
                    dact: true,
                };
                v.push(KernelSpec {
                    program: wgmma_program(d, false, false, WG_DACT.cluster, Some(dact)),
                    functions: vec![wgmma_function(Some(dact)).into()],
                    min_arch: Arch::SM90,
                });
            }
        }
    }
    v
}

/// The `wgmma` kernel's function name in a module built with `epi`: the activation-backward build
/// is `matmul_wgmma_dact`, so a profile of a linear backward tells it from the plain GEMMs.
pub fn wgmma_function(epi: Option<Epi>) -> &'static str {
    match epi {
        Some(Epi { dact: true, .. }) => "matmul_wgmma_dact",
        _ => "matmul_wgmma",
    }
}

/// The kernel, block shape, dynamic shared memory and C tile per block a variant launches with.
pub struct Launch {
    pub kernel: Kernel,
    pub block: (u32, u32, u32),
    pub smem: u32,
    /// Rows × columns of C one block computes (the grid covers n by x, m by y).
    pub tile: (u32, u32),
    pub config: String,
    /// `wgmma`: a persistent grid walking all tiles (x only), A/B tensor maps and the tile
    /// order appended to the parameters; None: the common grid.
    pub persistent: Option<Persistent>,
    /// Compiled with the fused epilogue of this activation: its parameters follow the others.
    pub epilogue: Option<Epi>,
    /// tf32 `wgmma`: the pre-pass that packs an operand the kernel cannot read as it is (m/n-
    /// contiguous, or rows not 16-byte aligned) into a K-major tf32-rounded copy; `launch` runs
    /// it first where needed (see `tf32_direct`).
    pub pack: Option<Kernel>,
    /// `skinny`: the kernel takes B's tensor map after the GEMM parameters (boxes of this k
    /// width; `skinny_b_map`), and whether it is built for sm_90 (zeros are passed otherwise).
    pub b_map: Option<(u32, bool)>,
}

pub fn plan(variant: &str, g: &Gemm, dev: &Arc<CudaDevice>) -> Result<Launch> {
    plan_inner(variant, g, dev, None, WG_DEFAULT)
}

/// `plan` with `wgmma`'s configuration `cfg` (other variants ignore it).
pub fn plan_with(variant: &str, g: &Gemm, dev: &Arc<CudaDevice>, cfg: WgConfig) -> Result<Launch> {
    plan_inner(variant, g, dev, None, cfg)
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
    let mut gs = *g;
    gs.c.ld = g.n;
    gs.c.trans = false;
    gs.c.batch_stride = g.m * g.n;
    let scratch = dev.alloc(g.batch * g.m * g.n * g.dtype.size_in_bytes(), stream)?;
    let q = Ptrs {
        c: scratch.ptr(),
        ..p
    };
    tune::pick(&key, &WG_CONFIGS, |&cfg| {
        let l = plan_with("wgmma", &gs, dev, cfg)?;
        crate::core::cuda::rows::time_briefly(dev, stream, || launch(&l, &gs, q, 1.0, 0.0, stream))
    })
    .map(|(c, _)| c)
}

/// The variants that have the pair epilogue (`plan_epilogue_pairs`).
pub const EPILOGUE_PAIR_VARIANTS: [&str; 2] = ["mma_pipelined", "wgmma"];

/// `plan_epilogue` with the pair epilogue: interior tiles (every row and column of the
/// warpgroup's / warp's block inside C, pairs of C, Z, R and the bias 2-element aligned,
/// beta == 0) stored as 2-element pairs with the bias pairs in registers, activations on the SFU
/// for 16-bit outputs; other tiles element by element. `mma_pipelined` is compiled for `g`'s
/// layout only and runs the plain kernel's 4 stages. Launch it with `launch_with_epilogue`.
pub fn plan_epilogue_pairs(
    variant: &str,
    g: &Gemm,
    dev: &Arc<CudaDevice>,
    act: Activation,
) -> Result<Launch> {
    if !EPILOGUE_PAIR_VARIANTS.contains(&variant) {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: format!(
                "CUDA variant `{variant}` has no pair epilogue (those that do: {})",
                EPILOGUE_PAIR_VARIANTS.join(", ")
            ),
        });
    }
    plan_inner(
        variant,
        g,
        dev,
        Some(Epi {
            act,
            pairs: true,
            dact: false,
        }),
        WG_DEFAULT,
    )
}

/// `wgmma` with the activation-backward epilogue: C = alpha·acc · act'(R) (`-DFE_EPI_DACT`),
/// R passed as `EpiPtrs::r` (indexed like C), bias and Z absent. Interior tiles go through the
/// TMA-store pair epilogue with R loaded a box ahead, edge tiles element by element. 16-bit
/// only. Launch it with `launch_with_epilogue`.
pub fn plan_epilogue_dact(g: &Gemm, dev: &Arc<CudaDevice>, act: Activation) -> Result<Launch> {
    if g.dtype == DType::F32 {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: "the activation-backward epilogue is bf16/f16 `wgmma` only".into(),
        });
    }
    let epi = Epi {
        act,
        pairs: true,
        dact: true,
    };
    plan_inner("wgmma", g, dev, Some(epi), WG_DACT)
}

/// Whether launch `l` of the activation-backward epilogue can also write the column sums
/// (`EpiPtrs::part`): every tile holding output rows must take the kernel's TMA-store pair path,
/// which is the only one that writes them — m a multiple of 64 (a consumer's rows), n of the
/// tile width, one batch, beta = 0, C 16-byte aligned (TMA store) and R's pairs aligned.
pub fn dact_colsum_ok(l: &Launch, g: &Gemm, p: Ptrs, beta: f32, e: &EpiPtrs) -> bool {
    let es = g.dtype.size_in_bytes();
    matches!(l.epilogue, Some(Epi { dact: true, .. }))
        && l.persistent.is_some_and(|pp| pp.tma_store)
        && g.batch == 1
        && g.m.is_multiple_of(64)
        && g.n.is_multiple_of(l.tile.1 as usize)
        && wg_tma_store_ok(g, p.c, beta, e)
        && p.c.is_multiple_of(2 * es as u64)
        && g.c.ld.is_multiple_of(2)
        && e.r.is_multiple_of(2 * es as u64)
        && e.ldr.is_multiple_of(2)
}

/// The variants that have the fused epilogue.
pub const EPILOGUE_VARIANTS: [&str; 4] = ["naive", "mma_pipelined", "wgmma", "skinny"];

/// `plan` for a kernel with the fused epilogue (bias, `act`, Z, residual; see `epilogue.rs`):
/// `naive`, `mma_pipelined`, `wgmma` or `skinny`. Launch it with `launch_with_epilogue`.
pub fn plan_epilogue(
    variant: &str,
    g: &Gemm,
    dev: &Arc<CudaDevice>,
    act: Activation,
) -> Result<Launch> {
    if !EPILOGUE_VARIANTS.contains(&variant) {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: format!(
                "CUDA variant `{variant}` has no fused epilogue (those that do: {})",
                EPILOGUE_VARIANTS.join(", ")
            ),
        });
    }
    plan_inner(
        variant,
        g,
        dev,
        Some(Epi {
            act,
            pairs: false,
            dact: false,
        }),
        WG_DEFAULT,
    )
}

fn plan_inner(
    variant: &str,
    g: &Gemm,
    dev: &Arc<CudaDevice>,
    epi: Option<Epi>,
    wg: WgConfig,
) -> Result<Launch> {
    let refuse = |why: &str| Error::NoVariant {
        op: OP.into(),
        msg: format!("CUDA variant `{variant}` {why}"),
    };
    if let Some(r) = SIMT.iter().find(|r| r.name == variant) {
        if g.dtype != DType::F32 {
            return Err(refuse("is f32 only"));
        }
        let kernel = dev.kernel(&Program::new(r.source), r.func)?;
        if r.smem > 0 {
            kernel.allow_dynamic_smem(r.smem)?;
        }
        return Ok(Launch {
            kernel,
            block: (r.threads, 1, 1),
            smem: r.smem,
            tile: r.tile,
            config: r.config.into(),
            persistent: None,
            epilogue: None,
            pack: None,
            b_map: None,
        });
    }
    match variant {
        "naive" => Ok(Launch {
            kernel: dev.kernel(&naive_program(g.dtype, epi.map(|e| e.act)), "matmul_naive")?,
            block: (32, 8, 1),
            smem: 0,
            tile: (8, 32),
            config: "block 32×8, 1 output/thread".into(),
            persistent: None,
            epilogue: epi,
            pack: None,
            b_map: None,
        }),
        "mma" | "mma_pipelined" => {
            let stages = match (variant, epi) {
                ("mma", _) => 1,
                (_, Some(Epi { pairs: false, .. })) => MMA_EPI_STAGES,
                _ => MMA_STAGES,
            };
            // The pair epilogue kernel is compiled for this problem's layout only.
            let layout = epi.filter(|e| e.pairs).map(|_| (g.a.trans, g.b.trans));
            let kernel = dev.kernel(&mma_program(g.dtype, stages, epi, layout), "matmul_mma")?;
            let smem = stages * MMA_STAGE_BYTES;
            kernel.allow_dynamic_smem(smem)?;
            let what = match g.dtype {
                DType::F32 => "m16n8k8 tf32",
                DType::BF16 => "m16n8k16 bf16",
                _ => "m16n8k16 f16",
            };
            Ok(Launch {
                kernel,
                block: (256, 1, 1),
                smem,
                tile: (128, 128),
                config: format!(
                    "tile 128×128×{}, warps 2×4 of 64×32, {what}, {stages} cp.async stage{}{}",
                    64 / g.dtype.size_in_bytes(),
                    if stages > 1 { "s" } else { "" },
                    epilogue_note(epi)
                ),
                persistent: None,
                epilogue: epi,
                pack: None,
                b_map: None,
            })
        }
        "wgmma" => {
            if let Some(why) = wgmma_declines(g) {
                return Err(refuse(&why));
            }
            if dev.arch().major != 9 {
                return Err(refuse(WGMMA_ARCH));
            }
            let tf32 = g.dtype == DType::F32;
            if tf32 && epi.is_some() {
                return Err(refuse(
                    "has no fused epilogue for f32/tf32 (mma_pipelined has one)",
                ));
            }
            let cluster = wg.cluster;
            // tf32 wgmma reads K-major operands only: one kernel (A row-major, B transposed),
            // other layouts packed into it at launch.
            let (at, bt) = if tf32 {
                (false, true)
            } else {
                (g.a.trans, g.b.trans)
            };
            let program = wgmma_program(g.dtype, at, bt, cluster, epi);
            let kernel = dev.kernel(&program, wgmma_function(epi))?;
            let has_store = wg_has_tma_store(g.dtype, epi);
            let smem = wg_smem(g.dtype, epi);
            kernel.set_max_dynamic_smem(smem)?;
            let pack = if tf32 {
                Some(dev.kernel(&program, "matmul_wgmma_pack")?)
            } else {
                None
            };
            let sms = (dev.props().sm_count / cluster * cluster).max(cluster);
            let group_m = wg.group_m;
            let (ty, note) = match g.dtype {
                DType::F32 => (
                    "tf32",
                    ", m/n-contiguous or unaligned operands first packed K-major (tf32-rounded)",
                ),
                DType::BF16 => ("bf16", ""),
                _ => ("f16", ""),
            };
            Ok(Launch {
                kernel,
                block: (WG_THREADS, 1, 1),
                smem,
                tile: WG_TILE,
                config: format!(
                    "tile {}×{}×{}, TMA 128B-swizzle {}-stage ring, 1 producer + 2 consumer warpgroups m64n{}k{} {ty}, persistent grid ≤ {sms}, groups of {group_m} row tiles, cluster {cluster}×1 (B multicast), {}{note}{}",
                    WG_TILE.0,
                    WG_TILE.1,
                    wg_bk(g.dtype),
                    wg_stages(g.dtype, epi),
                    WG_TILE.1,
                    wg_kstep(g.dtype),
                    if has_store && wg.tma_store {
                        "C staged in shared memory and written by TMA stores"
                    } else {
                        "C stored from registers"
                    },
                    epilogue_note(epi)
                ),
                persistent: Some(Persistent {
                    ctas: sms,
                    group_m,
                    cluster,
                    tma_store: has_store && wg.tma_store,
                }),
                epilogue: epi,
                pack,
                b_map: None,
            })
        }
        "skinny" => {
            if let Some(why) = skinny_declines(g) {
                return Err(refuse(&why));
            }
            if epi.is_some_and(|e| e.pairs || e.dact) {
                return Err(refuse("has the element-wise epilogue only"));
            }
            let rows = g.m.max(1).div_ceil(8) as u32;
            let mt = *SKINNY_TILES.iter().find(|&&t| t >= rows).unwrap_or(&8);
            let s = skinny_slices(g, dev.props().sm_count as usize, mt);
            let groups = SKINNY_WARPS / s;
            let kernel =
                dev.kernel(&skinny_program(g.dtype, epi), &format!("matmul_skinny{mt}"))?;
            let sm90 = dev.arch().major >= 9;
            let smem = skinny_smem(g.dtype, mt, sm90);
            kernel.allow_dynamic_smem(smem)?;
            Ok(Launch {
                kernel,
                block: (32, s, groups),
                smem,
                tile: (SKINNY_MAX_M as u32, 16 * groups),
                config: format!(
                    "{groups} column group{} of 16 × {s} k-slice{} per block, {mt} tile{} of 8 rows of A, mma.sync m16n8k16 with B as the A operand, B {}{}",
                    if groups > 1 { "s" } else { "" },
                    if s > 1 { "s" } else { "" },
                    if mt > 1 { "s" } else { "" },
                    if sm90 {
                        "through per-warp rings of TMA boxes"
                    } else {
                        "by 16-byte streaming loads"
                    },
                    epilogue_note(epi)
                ),
                persistent: None,
                epilogue: epi,
                pack: None,
                b_map: Some((skinny_pass(mt), sm90)),
            })
        }
        _ => Err(refuse("does not exist")),
    }
}

/// The config suffix of an epilogue kernel.
fn epilogue_note(epi: Option<Epi>) -> String {
    match epi {
        Some(Epi {
            act, dact: true, ..
        }) => format!(
            ", fused {act}' epilogue (C = acc·{act}'(R): the layer below's dZ; consumers stage the whole tile, 3 helper warps apply {act}' and store it under the next tile's mainloop)"
        ),
        Some(Epi {
            act, pairs: true, ..
        }) => format!(
            ", fused {act} pair epilogue (interior tiles: bias pairs in registers, 2-element stores)"
        ),
        Some(Epi { act, .. }) => format!(", fused {act} epilogue element by element"),
        None => String::new(),
    }
}

/// Queues the planned kernel on `stream` for operands at `p`.
pub fn launch(l: &Launch, g: &Gemm, p: Ptrs, alpha: f32, beta: f32, stream: &Stream) -> Result<()> {
    launch_inner(l, g, p, alpha, beta, EpiPtrs::default(), None, stream)
}

/// Queues a kernel planned by `plan_epilogue`; `e` holds the bias / Z / residual addresses (0 =
/// absent) and the layouts of Z and R (indexed like C). The caller guarantees that each present
/// pointer addresses a live buffer of `g.dtype` covering the batch × m × n elements it indexes
/// (bias: n elements).
pub fn launch_with_epilogue(
    l: &Launch,
    g: &Gemm,
    p: Ptrs,
    alpha: f32,
    beta: f32,
    e: EpiPtrs,
    stream: &Stream,
) -> Result<()> {
    match l.epilogue {
        Some(Epi { dact: true, .. }) if e.r == 0 || e.bias != 0 || e.z != 0 => {
            return Err(Error::Other(format!(
                "matmul: the activation-backward epilogue ({}) takes R (the pre-activation) and \
                 no bias or Z",
                l.kernel.name
            )));
        }
        _ => {}
    }
    if l.epilogue.is_none() {
        return Err(Error::Other(format!(
            "matmul: launch_with_epilogue on a plain kernel ({}); plan it with plan_epilogue",
            l.kernel.name
        )));
    }
    launch_inner(l, g, p, alpha, beta, e, None, stream)
}

#[allow(clippy::too_many_arguments)]
fn launch_inner(
    l: &Launch,
    g: &Gemm,
    p: Ptrs,
    alpha: f32,
    beta: f32,
    e: EpiPtrs,
    grouped: Option<Groups>,
    stream: &Stream,
) -> Result<()> {
    // tf32 wgmma: operands it cannot read as they are go through the pack pre-pass first; the
    // scratch is freed (stream-ordered, after the GEMM) when `_scratch` drops.
    let mut _scratch = Vec::new();
    let (g, p) = match &l.pack {
        Some(k) => tf32_pack(k, g, p, stream, &mut _scratch)?,
        None => (*g, p),
    };
    let g = &g;
    // Kernels stride over row tiles and batches beyond the y/z limits.
    let grid = match l.persistent {
        Some(Persistent { ctas, cluster, .. }) => {
            // Whole clusters, each taking `cluster` vertically adjacent tiles at a time.
            let c = cluster as u64;
            let row_tiles = (g.m as u64).div_ceil(l.tile.0 as u64).div_ceil(c);
            let tiles = match grouped {
                // At most one partial tile per group beyond the rows' own.
                Some(Groups {
                    mode: Grouping::M,
                    groups,
                    ..
                }) => row_tiles + groups as u64,
                _ => row_tiles * g.batch as u64,
            } * (g.n as u64).div_ceil(l.tile.1 as u64);
            ((tiles.clamp(1, ctas as u64 / c) * c) as u32, 1, 1)
        }
        None => {
            let row_tiles = (g.m as u32).div_ceil(l.tile.0);
            let (y, z) = match grouped {
                Some(Groups {
                    mode: Grouping::M,
                    groups,
                    ..
                }) => (row_tiles.saturating_add(groups as u32), 1),
                _ => (row_tiles, g.batch as u32),
            };
            (
                (g.n as u32).div_ceil(l.tile.1),
                y.clamp(1, 65535),
                z.clamp(1, 65535),
            )
        }
    };
    let mut args = gemm_args(g, p, alpha, beta);
    if let Some((box_k, sm90)) = l.b_map {
        args.push(skinny_b_map(g, p.b, box_k, sm90)?);
    }
    if let Some(pp) = l.persistent {
        let (ta, tb) = wgmma_maps(g, p, pp.cluster)?;
        let store = pp.tma_store && wg_tma_store_ok(g, p.c, beta, &e);
        let none = TmaDesc([0; 16]);
        let (tc, tz) = if store {
            let tz = if e.z != 0 {
                wgmma_out_map(g, e.z, e.ldz, e.stride_z)?
            } else {
                none
            };
            (wgmma_out_map(g, p.c, g.c.ld, g.c.batch_stride)?, tz)
        } else {
            (none, none)
        };
        args.push(ta)
            .push(tb)
            .push(tc)
            .push(tz)
            .push(pp.group_m.max(1) as i32)
            .push(store as i32);
    }
    if let Some(epi) = l.epilogue {
        args.push(e.bias)
            .push(e.z)
            .push(e.ldz as i64)
            .push(e.stride_z as i64)
            .push(e.r)
            .push(e.ldr as i64)
            .push(e.stride_r as i64);
        if epi.dact {
            if e.part != 0 && !dact_colsum_ok(l, g, p, beta, &e) {
                return Err(Error::NoVariant {
                    op: OP.into(),
                    msg: "the activation-backward epilogue's column sums need every tile on its \
                          TMA-store path (rows a multiple of 64, columns of the tile width, \
                          16-byte aligned C and R)"
                        .into(),
                });
            }
            args.push(e.part);
        }
    } else if e.part != 0 {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: "column sums come only from the activation-backward epilogue".into(),
        });
    }
    if let Some(gr) = grouped {
        args.push(gr.ends).push(gr.groups as i32);
    }
    l.kernel.launch(stream, grid, l.block, l.smem, &mut args)
}

/// Every GEMM kernel's leading parameters (FE_MATMUL_PARAMS).
fn gemm_args(g: &Gemm, p: Ptrs, alpha: f32, beta: f32) -> KernelArgs {
    let mut args = KernelArgs::new();
    args.push(p.c)
        .push(p.a)
        .push(p.b)
        .push(g.m as i64)
        .push(g.n as i64)
        .push(g.k as i64)
        .push(g.a.ld as i64)
        .push(g.b.ld as i64)
        .push(g.c.ld as i64)
        .push(g.a.trans as i32)
        .push(g.b.trans as i32)
        .push(g.a.batch_stride as i64)
        .push(g.b.batch_stride as i64)
        .push(g.c.batch_stride as i64)
        .push(g.batch as i64)
        .push(alpha)
        .push(beta);
    args
}

/// Which dimension a grouped GEMM splits into groups (the kernels' `-DFE_GROUPED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grouping {
    /// Rows of A and C: C[rows of g] = A[rows of g]·B_g, B batched by group (the expert GEMMs of
    /// a mixture of experts; `torch._grouped_mm` with 2-D A and 3-D B). `Gemm::batch` is the
    /// group count (B's batch), A and C have batch stride 0.
    M,
    /// k: C_g = op(A)[k of g]·op(B)[k of g] (a per-expert weight gradient, Xᵀ·dY), A stored
    /// `[k, m]` (transposed) and B `[k, n]` (not transposed), C batched by group.
    K,
}

impl Grouping {
    fn code(self) -> u32 {
        match self {
            Grouping::M => 1,
            Grouping::K => 2,
        }
    }
}

/// The group boundaries of one grouped launch: a device array of `groups` int32 cumulative row
/// ends (group g owns rows / k `[ends[g-1], ends[g])`, ends[-1] = 0), nondecreasing and ending at
/// most at the operand's extent — the caller guarantees it (moe validates on the host or builds
/// them on the device from a histogram).
#[derive(Clone, Copy, Debug)]
pub struct Groups {
    pub mode: Grouping,
    pub ends: u64,
    pub groups: usize,
}

/// Most groups a grouped launch takes (the kernels' MAX_GROUPS: prefix sums in shared memory).
pub const MAX_GROUPS: usize = 1024;

/// The layouts (A transposed, B transposed) grouped kernels are compiled for: M-grouped A
/// row-major with B either way (the forward's `[E, K, N]` weights and the backward's transposed
/// ones), K-grouped A and B both stored k-major (`Xᵀ·dY`).
pub fn grouped_layouts(mode: Grouping) -> &'static [(bool, bool)] {
    match mode {
        Grouping::M => &[(false, false), (false, true)],
        Grouping::K => &[(true, false)],
    }
}

fn grouped_program(variant: &str, dtype: DType, mode: Grouping, at: bool, bt: bool) -> Program {
    let p = if variant == "wgmma" {
        wgmma_program(dtype, at, bt, 1, None)
    } else {
        mma_program(dtype, MMA_STAGES, None, Some((at, bt)))
    };
    p.define("FE_GROUPED", mode.code())
}

/// The grouped GEMM modules (for `ferrite kernels`): `mma_pipelined` for every float dtype and
/// `wgmma` for the 16-bit ones, in each mode's layouts.
pub fn grouped_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for mode in [Grouping::M, Grouping::K] {
        for &(at, bt) in grouped_layouts(mode) {
            for d in [DType::F32, DType::F16, DType::BF16] {
                v.push(KernelSpec {
                    program: grouped_program("mma_pipelined", d, mode, at, bt),
                    functions: vec!["matmul_mma".into()],
                    min_arch: Arch::SM80,
                });
                if d != DType::F32 {
                    v.push(KernelSpec {
                        program: grouped_program("wgmma", d, mode, at, bt),
                        functions: vec!["matmul_wgmma".into()],
                        min_arch: Arch::SM90,
                    });
                }
            }
        }
    }
    // The GLU builds of the two GLUs MLPs use most (SwiGLU, GeGLU-tanh); the other activations
    // compile the same code with another formula.
    for d in [DType::F16, DType::BF16] {
        for act in [Activation::Silu, Activation::GeluTanh] {
            v.push(KernelSpec {
                program: grouped_glu_program(d, act),
                functions: vec!["matmul_wgmma".into()],
                min_arch: Arch::SM90,
            });
        }
    }
    v
}

fn grouped_glu_program(dtype: DType, act: Activation) -> Program {
    grouped_program("wgmma", dtype, Grouping::M, false, false).define("FE_GLU", 1 + act.code())
}

/// Plans the M-grouped `wgmma` GEMM with the GLU in its epilogue (wgmma.cu's `FE_GLU`): `g` is
/// the up projection `[m, k]·[batch][k, n]` with `n = 2·nh` columns (gate | up) and C the GLU
/// output `[m, nh]` (`g.c.ld = nh`). Needs sm_90, f16/bf16, B not transposed and `nh` a multiple
/// of 8 (16-byte rows for the TMA store).
pub fn plan_grouped_glu(g: &Gemm, act: Activation, dev: &Arc<CudaDevice>) -> Result<Launch> {
    let refuse = |why: String| Error::NoVariant {
        op: OP.into(),
        msg: format!("the GLU-fused grouped `wgmma` {why}"),
    };
    if g.dtype == DType::F32 {
        return Err(refuse("takes f16/bf16".into()));
    }
    if dev.arch().major != 9 {
        return Err(refuse(WGMMA_ARCH.into()));
    }
    if g.a.trans || g.b.trans {
        return Err(refuse("reads A row-major and B [k, n]".into()));
    }
    if !g.n.is_multiple_of(16) || g.c.ld != g.n / 2 {
        return Err(refuse(format!(
            "needs n = 2·nh with nh a multiple of 8 and C's ld = nh, got n {} and ld {}",
            g.n, g.c.ld
        )));
    }
    if let Some(why) = wgmma_declines(g) {
        return Err(refuse(why));
    }
    let tile = (WG_TILE.0, WG_TILE.1 / 2);
    grouped_wgmma_launch(
        &grouped_glu_program(g.dtype, act),
        g.dtype,
        tile,
        dev,
        |sms| {
            format!(
            "tile {}×{} of the GLU output ({} B columns: gate and up), TMA + wgmma, persistent grid ≤ {sms}, {} GLU in the epilogue, M-grouped",
            tile.0,
            tile.1,
            WG_TILE.1,
            act.name()
        )
        },
    )
}

/// The launch of a grouped persistent `wgmma` module (no cluster, TMA store), `tile` the C tile
/// one block computes; `config(sms)` describes it.
fn grouped_wgmma_launch(
    program: &Program,
    dtype: DType,
    tile: (u32, u32),
    dev: &Arc<CudaDevice>,
    config: impl Fn(u32) -> String,
) -> Result<Launch> {
    let kernel = dev.kernel(program, "matmul_wgmma")?;
    let smem = wg_smem(dtype, None);
    kernel.set_max_dynamic_smem(smem)?;
    let sms = dev.props().sm_count.max(1);
    Ok(Launch {
        kernel,
        block: (WG_THREADS, 1, 1),
        smem,
        tile,
        config: config(sms),
        persistent: Some(Persistent {
            ctas: sms,
            group_m: WG_GROUP_M,
            cluster: 1,
            tma_store: true,
        }),
        epilogue: None,
        pack: None,
        b_map: None,
    })
}

/// Queues a GEMM planned by `plan_grouped_glu`: `p.c` receives the GLU output `[g.m, g.n / 2]`,
/// `h` (when given) the pre-activations `[g.m, g.n]` (gate | up). The caller guarantees what
/// `launch_grouped` asks, with C and h covering `g.m` rows and 16-byte aligned bases.
pub fn launch_grouped_glu(
    l: &Launch,
    g: &Gemm,
    p: Ptrs,
    h: Option<u64>,
    groups: Groups,
    stream: &Stream,
) -> Result<()> {
    if groups.groups == 0 || groups.groups > MAX_GROUPS || groups.groups != g.batch {
        return Err(Error::Other(format!(
            "grouped GLU matmul: {} groups for a problem of batch {} (1..={MAX_GROUPS})",
            groups.groups, g.batch
        )));
    }
    let Some(pp) = l.persistent else {
        return Err(Error::Other(format!(
            "grouped GLU matmul: {} is not the persistent wgmma kernel",
            l.kernel.name
        )));
    };
    if [p.a, p.b, p.c, h.unwrap_or(0)]
        .iter()
        .any(|q| !q.is_multiple_of(16))
        || g.k == 0
    {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: "the GLU-fused grouped wgmma needs 16-byte aligned operands and k > 0".into(),
        });
    }
    let nh = g.n / 2;
    let es = g.dtype.size_in_bytes() as u64;
    let rows = g.m.max(1) as u64;
    let (ta, tb) = wgmma_maps(g, p, 1)?;
    let tc = tensor_map(g.dtype, p.c, nh, g.m, nh, 1, 0, [64, 16], true)?;
    // The pre-activations as (column, half, row): half 0 the gate's columns, 1 the up's.
    let th = match h {
        Some(ph) => tensor_map_encode(
            g.dtype,
            ph,
            [nh as u64, 2, rows],
            [nh as u64 * es, g.n as u64 * es],
            [64, 1, 16],
            true,
        )?,
        None => TmaDesc([0; 16]),
    };
    let tiles = ((g.m as u64).div_ceil(l.tile.0 as u64) + groups.groups as u64)
        * (nh as u64).div_ceil(l.tile.1 as u64);
    let grid = (tiles.clamp(1, pp.ctas as u64) as u32, 1, 1);
    let mut args = gemm_args(g, p, 1.0, 0.0);
    args.push(ta)
        .push(tb)
        .push(tc)
        .push(th)
        .push(pp.group_m.max(1) as i32)
        .push(1 | if h.is_some() { 2 } else { 0 });
    args.push(groups.ends).push(groups.groups as i32);
    args.push(h.unwrap_or(0));
    l.kernel.launch(stream, grid, l.block, l.smem, &mut args)
}

/// Plans a grouped GEMM on `variant` (`mma_pipelined`, or `wgmma` on sm_90 for f16/bf16): the
/// kernel of the problem's layout compiled with `-DFE_GROUPED`. `g` describes the whole launch
/// (see `Grouping`); K-grouped `wgmma` further needs every group boundary a multiple of 64 rows
/// (whole TMA k slices) — the caller's padded layout.
pub fn plan_grouped(
    variant: &str,
    g: &Gemm,
    mode: Grouping,
    dev: &Arc<CudaDevice>,
) -> Result<Launch> {
    let refuse = |why: String| Error::NoVariant {
        op: OP.into(),
        msg: format!("grouped CUDA variant `{variant}` {why}"),
    };
    let layout = (g.a.trans, g.b.trans);
    if !grouped_layouts(mode).contains(&layout) {
        return Err(refuse(format!(
            "is compiled for layouts (A trans, B trans) {:?} in {mode:?} mode, not {layout:?}",
            grouped_layouts(mode)
        )));
    }
    match variant {
        "mma_pipelined" => {
            let kernel = dev.kernel(
                &grouped_program(variant, g.dtype, mode, layout.0, layout.1),
                "matmul_mma",
            )?;
            let smem = MMA_STAGES * MMA_STAGE_BYTES;
            kernel.allow_dynamic_smem(smem)?;
            Ok(Launch {
                kernel,
                block: (256, 1, 1),
                smem,
                tile: (128, 128),
                config: format!(
                    "tile 128×128, mma.sync, {MMA_STAGES} cp.async stages, {mode:?}-grouped"
                ),
                persistent: None,
                epilogue: None,
                pack: None,
                b_map: None,
            })
        }
        "wgmma" => {
            if g.dtype == DType::F32 {
                return Err(refuse("takes f16/bf16 (tf32 runs on mma_pipelined)".into()));
            }
            if dev.arch().major != 9 {
                return Err(refuse(WGMMA_ARCH.into()));
            }
            if let Some(why) = wgmma_declines(g) {
                return Err(refuse(why));
            }
            let program = grouped_program(variant, g.dtype, mode, layout.0, layout.1);
            grouped_wgmma_launch(&program, g.dtype, WG_TILE, dev, |sms| {
                format!(
                    "tile {}×{}, TMA + wgmma, persistent grid ≤ {sms} over every group's tiles, {mode:?}-grouped",
                    WG_TILE.0, WG_TILE.1
                )
            })
        }
        _ => Err(refuse("does not exist (mma_pipelined, wgmma)".into())),
    }
}

/// Queues a grouped GEMM planned by `plan_grouped`. The caller guarantees that the operands
/// cover `g` (A and C `g.m` rows in M mode, A and B `g.k` rows in K mode, B / C `g.batch`
/// groups), that `groups.ends` addresses `groups.groups` (≤ MAX_GROUPS, = g.batch) int32 values
/// as `Groups` describes, and — K-grouped `wgmma` — that every boundary is a multiple of 64.
#[allow(clippy::too_many_arguments)]
pub fn launch_grouped(
    l: &Launch,
    g: &Gemm,
    p: Ptrs,
    groups: Groups,
    alpha: f32,
    beta: f32,
    stream: &Stream,
) -> Result<()> {
    if groups.groups == 0 || groups.groups > MAX_GROUPS || groups.groups != g.batch {
        return Err(Error::Other(format!(
            "grouped matmul: {} groups for a problem of batch {} (1..={MAX_GROUPS})",
            groups.groups, g.batch
        )));
    }
    launch_inner(
        l,
        g,
        p,
        alpha,
        beta,
        EpiPtrs::default(),
        Some(groups),
        stream,
    )
}

/// Runs the tf32 pack pre-pass on every operand `tf32_direct` rejects and returns the problem and
/// pointers as the tf32 `wgmma` kernel then reads them; `keep` holds the scratch until the caller
/// has queued the GEMM.
fn tf32_pack(
    k: &Kernel,
    g: &Gemm,
    p: Ptrs,
    stream: &Stream,
    keep: &mut Vec<DeviceBuffer>,
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
        if !TF32_PACK_ALWAYS && tf32_direct(&o, is_a, base) {
            continue;
        }
        let packed = tf32_packed(&o, is_a, rows, g.k);
        let copies = if o.batch_stride == 0 { 1 } else { g.batch };
        let buf = k.dev.alloc(copies * rows * packed.ld * 4, stream)?;
        let (sr, sp) = tf32_pack_strides(&o, is_a);
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
        if is_a {
            (g2.a, p2.a) = (packed, buf.ptr());
        } else {
            (g2.b, p2.b) = (packed, buf.ptr());
        }
        keep.push(buf);
    }
    Ok((g2, p2))
}

pub(super) fn run(
    variant: &str,
    g: &Gemm,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    opts: &MatmulOptions,
) -> Result<()> {
    let p = Ptrs {
        a: a.device_ptr()?,
        b: b.device_ptr()?,
        c: c.device_ptr()?,
    };
    run_ptrs(variant, g, p, opts)
}

/// `matmul_into` on raw device pointers (operands that are not tensors, e.g. another op's
/// stream-ordered scratch): picks the variant as `matmul_into` does and launches it on
/// `opts.stream`. The caller guarantees that `p` addresses live buffers of `g.dtype` on `g`'s
/// device laid out as `g` says.
pub fn gemm_ptrs(g: &Gemm, p: Ptrs, opts: &MatmulOptions) -> Result<()> {
    let v = super::select(g, opts)?;
    if g.batch == 0 || g.m == 0 || g.n == 0 {
        return Ok(());
    }
    run_ptrs(v.name, g, p, opts)
}

fn run_ptrs(variant: &str, g: &Gemm, p: Ptrs, opts: &MatmulOptions) -> Result<()> {
    let Device::Cuda(i) = g.device else {
        unreachable!("cuda::run on a CPU problem")
    };
    let dev = device(i)?;
    let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    // `wgmma` chosen by default on views whose base is not 16-byte aligned (TMA cannot address
    // them): the next rung runs them instead. Asked for by name, it declines (wgmma_maps).
    let variant = if variant == "wgmma"
        && opts.variant.is_none()
        && g.k > 0
        && g.dtype != DType::F32
        && (!p.a.is_multiple_of(16) || !p.b.is_multiple_of(16))
    {
        "mma_pipelined"
    } else {
        variant
    };
    let cfg = match (&opts.config, variant) {
        (Some(name), "wgmma") => wg_config_named(name)?,
        (None, "wgmma") => match forced_wg_config()? {
            Some(cfg) => cfg,
            // Tuned at a shape's first use: on the H100 every configuration passed `check matmul`
            // and the tuned picks ran at 0.89–0.98× cuBLAS (bench/results/2026-11-23-h100-wgmma-tuner).
            None if g.k > 0 && g.batch * g.m * g.n > 0 => wg_tuned(g, p, &dev, &stream)?,
            None => WG_DEFAULT,
        },
        _ => WG_DEFAULT,
    };
    let l = plan_with(variant, g, &dev, cfg)?;
    launch(&l, g, p, opts.alpha, opts.beta, &stream)
}

/// cuBLAS on the same problem: the vendor peer. Row-major C = op(A)·op(B) is computed as the
/// column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, so B goes first and the transposes carry over unchanged.
pub fn cublas(
    dev: &CudaDevice,
    g: &Gemm,
    p: Ptrs,
    alpha: f32,
    beta: f32,
    precision: Precision,
    stream: &Stream,
) -> Result<()> {
    use cudarc::cublas::{result as cb, sys};
    let h = blas::handle(dev, stream)?;
    let h = h.lock().unwrap();
    let (dt, compute) = match (g.dtype, precision) {
        (DType::F32, Precision::Tf32) => (
            sys::cudaDataType::CUDA_R_32F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        ),
        (DType::F32, _) => (
            sys::cudaDataType::CUDA_R_32F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        (DType::F16, _) => (
            sys::cudaDataType::CUDA_R_16F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        (DType::BF16, _) => (
            sys::cudaDataType::CUDA_R_16BF,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        (d, _) => return Err(Error::bad_arg("cublas", "dtype", "f32, f16 or bf16", d)),
    };
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    dev.bind()?;
    // SAFETY: the pointers address the validated operands of `g` on this device (the caller
    // guarantees it); alpha/beta are host f32 as the compute type expects; the handle is locked.
    unsafe {
        cb::gemm_strided_batched_ex(
            h.handle(),
            op(g.b.trans),
            op(g.a.trans),
            g.n as i32,
            g.m as i32,
            g.k as i32,
            &alpha as *const f32 as *const _,
            p.b as *const _,
            dt,
            g.b.ld as i32,
            g.b.batch_stride as i64,
            p.a as *const _,
            dt,
            g.a.ld as i32,
            g.a.batch_stride as i64,
            &beta as *const f32 as *const _,
            p.c as *mut _,
            dt,
            g.c.ld as i32,
            g.c.batch_stride as i64,
            g.batch as i32,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| {
        Error::cuda(
            format!("cublasGemmStridedBatchedEx ({})", g.label()),
            format!("{e:?}"),
        )
    })
}

/// cuBLASLt's pick for one problem, the second vendor peer: the matmul descriptor, the three
/// layouts (column-major, as cuBLAS sees C = A·B: Cᵀ = Bᵀ·Aᵀ, like [`cublas`]), the heuristic's
/// best algorithm for a 32 MiB workspace, and the workspace — made once and reused by every call,
/// as a framework caches them (what PyTorch's Lt path does).
pub struct LtPlan {
    handle: cudarc::cublaslt::sys::cublasLtHandle_t,
    desc: cudarc::cublaslt::sys::cublasLtMatmulDesc_t,
    layouts: [cudarc::cublaslt::sys::cublasLtMatrixLayout_t; 3],
    algo: cudarc::cublaslt::sys::cublasLtMatmulAlgo_t,
    workspace: crate::core::cuda::DeviceBuffer,
    stream: Stream,
    /// The algorithm's id and tile as cuBLASLt reports them (for the bench's config column).
    pub config: String,
}

const LT_WORKSPACE: usize = 32 << 20;

impl LtPlan {
    pub fn new(
        dev: &Arc<CudaDevice>,
        g: &Gemm,
        precision: Precision,
        stream: &Stream,
    ) -> Result<Self> {
        use cudarc::cublaslt::{result as lt, sys};
        let err = |what: &str, e: lt::CublasError| {
            Error::cuda(format!("{what} ({})", g.label()), format!("{e:?}"))
        };
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::CudaUnavailable(
                "cuBLASLt (libcublasLt.so.13) not found by the loader".into(),
            ));
        }
        // The same mapping as `cublas` above, but cudarc's cuBLASLt bindings declare their own
        // copies of these enums, so the two matches cannot share one function.
        let (dt, compute) = match (g.dtype, precision) {
            (DType::F32, Precision::Tf32) => (
                sys::cudaDataType::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            ),
            (DType::F32, _) => (
                sys::cudaDataType::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            (DType::F16, _) => (
                sys::cudaDataType::CUDA_R_16F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            (DType::BF16, _) => (
                sys::cudaDataType::CUDA_R_16BF,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            (d, _) => return Err(Error::bad_arg("cublaslt", "dtype", "f32, f16 or bf16", d)),
        };
        dev.bind()?;
        let workspace = dev.alloc(LT_WORKSPACE, stream)?;
        let handle = lt::create_handle().map_err(|e| err("cublasLtCreate", e))?;
        // From here every created object is owned by `plan`, whose Drop frees what exists.
        let mut plan = LtPlan {
            handle,
            desc: std::ptr::null_mut(),
            layouts: [std::ptr::null_mut(); 3],
            algo: cudarc::cublaslt::sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            workspace,
            stream: stream.clone(),
            config: String::new(),
        };
        plan.desc = lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)
            .map_err(|e| err("cublasLtMatmulDescCreate", e))?;
        // cuBLAS's column-major view: its A is our B (n × k), its B our A (k × m), C is n × m.
        let (op_a, op_b) = (g.b.trans as i32, g.a.trans as i32); // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
        for (attr, v) in [
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                op_a,
            ),
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                op_b,
            ),
        ] {
            // SAFETY: live descriptor; the attribute is an int32 cublasOperation_t.
            unsafe {
                lt::set_matmul_desc_attribute(plan.desc, attr, &v as *const i32 as *const _, 4)
            }
            .map_err(|e| err("cublasLtMatmulDescSetAttribute", e))?;
        }
        let shapes = [
            if g.b.trans {
                (g.k, g.n, g.b)
            } else {
                (g.n, g.k, g.b)
            },
            if g.a.trans {
                (g.m, g.k, g.a)
            } else {
                (g.k, g.m, g.a)
            },
            (g.n, g.m, g.c),
        ];
        for (i, (rows, cols, op)) in shapes.into_iter().enumerate() {
            let l = lt::create_matrix_layout(dt, rows as u64, cols as u64, op.ld as i64)
                .map_err(|e| err("cublasLtMatrixLayoutCreate", e))?;
            plan.layouts[i] = l;
            if g.batch > 1 {
                let (count, stride) = (g.batch as i32, op.batch_stride as i64);
                // SAFETY: live layout; BATCH_COUNT is an int32, STRIDED_BATCH_OFFSET an int64
                // (0 broadcasts the operand over the batch).
                unsafe {
                    lt::set_matrix_layout_attribute(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count as *const i32 as *const _, 4)
                        .and_then(|()| lt::set_matrix_layout_attribute(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride as *const i64 as *const _, 8))
                }
                .map_err(|e| err("cublasLtMatrixLayoutSetAttribute", e))?;
            }
        }
        let pref =
            lt::create_matmul_pref().map_err(|e| err("cublasLtMatmulPreferenceCreate", e))?;
        let ws = LT_WORKSPACE as u64;
        // SAFETY: live preference; MAX_WORKSPACE_BYTES is a uint64. The heuristic reads only the
        // live descriptors and layouts. The preference is destroyed right after.
        let heur = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const _,
                8,
            )
            .and_then(|()| {
                let [a, b, c] = plan.layouts;
                lt::get_matmul_algo_heuristic(plan.handle, plan.desc, a, b, c, c, pref)
            })
        };
        // SAFETY: created above, used by nothing else.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let heur = heur.map_err(|e| err("cublasLtMatmulAlgoGetHeuristic", e))?;
        plan.algo = heur.algo;
        plan.config = format!(
            "cublasLtMatmul, heuristic's best algorithm ({} B workspace of {} MiB), {} compute",
            heur.workspaceSize,
            LT_WORKSPACE >> 20,
            match precision {
                Precision::F32 => "fp32",
                Precision::Tf32 => "fast-tf32",
                _ => "fp32-accumulate",
            }
        );
        Ok(plan)
    }

    /// Queues C = α·A·B + β·C for operands at `p` (the problem the plan was made for).
    pub fn run(&self, p: Ptrs, alpha: f32, beta: f32) -> Result<()> {
        use cudarc::cublaslt::result as lt;
        let [a, b, c] = self.layouts;
        // SAFETY: the pointers address the validated operands of the plan's problem on this
        // device (the caller's contract, as for `cublas`); alpha/beta are host f32 (scale type
        // f32); descriptors, algorithm and workspace are live and sized as the heuristic asked.
        unsafe {
            lt::matmul(
                self.handle,
                self.desc,
                &alpha as *const f32 as *const _,
                &beta as *const f32 as *const _,
                p.b as *const _,
                a,
                p.a as *const _,
                b,
                p.c as *const _,
                c,
                p.c as *mut _,
                c,
                &self.algo,
                self.workspace.ptr() as *mut _,
                LT_WORKSPACE,
                self.stream.cu_stream() as _,
            )
        }
        .map_err(|e| Error::cuda("cublasLtMatmul", format!("{e:?}")))
    }
}

impl Drop for LtPlan {
    fn drop(&mut self) {
        use cudarc::cublaslt::result as lt;
        // SAFETY: each object was created by `new` and is destroyed only here (null: never made).
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            for z in 0..batch {
                for r in 0..rows {
                    for p in 0..k {
                        assert_eq!(
                            op_at(&y, &packed, is_a, z, r, p),
                            op_at(&x, &o, is_a, z, r, p),
                            "is_a {is_a} trans {trans} ld {ld} z {z} r {r} p {p}"
                        );
                    }
                }
            }
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
