//! `skinny` (kernels/skinny.cu), the short-A (decode) kernel: which problems it takes and is
//! chosen for by default, its k-split, shared memory and program.

use super::epilogue::{with_epilogue, Epi};
use super::SKINNY;
use crate::core::cuda::jit::Program;
use crate::core::dtype::DType;
use crate::ops::matmul::Gemm;

/// The most rows of A `skinny` takes (8 tiles of the MMA's 8 columns).
pub const SKINNY_MAX_M: usize = 64;
/// The `skinny` kernel's entry points: tiles of 8 rows of A (matmul_skinny{MT}).
pub(super) const SKINNY_TILES: [u32; 4] = [1, 2, 4, 8];
/// Warps per `skinny` block, split into k-slices × column groups.
pub(super) const SKINNY_WARPS: u32 = 8;
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
pub(super) fn skinny_slices(g: &Gemm, sms: usize, mt: u32) -> u32 {
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
pub(super) fn skinny_smem(dtype: DType, mt: u32, sm90: bool) -> u32 {
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
pub(super) fn skinny_pass(mt: u32) -> u32 {
    32 * if mt >= 8 { 4 } else { 8 }
}

pub(super) fn skinny_program(dtype: DType, epi: Option<Epi>) -> Program {
    with_epilogue(
        Program::new(SKINNY).define("FE_ELEM", dtype.cuda_name()),
        epi,
    )
}

pub(super) fn skinny_functions() -> Vec<String> {
    SKINNY_TILES
        .iter()
        .map(|t| format!("matmul_skinny{t}"))
        .collect()
}
