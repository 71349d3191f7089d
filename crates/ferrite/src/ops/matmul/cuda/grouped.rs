//! Grouped GEMMs (the kernels' `-DFE_GROUPED`): one launch over groups of rows or of k, each
//! with its own B or C (a mixture of experts), on `mma_pipelined` or `wgmma`; and the M-grouped
//! `wgmma` with the GLU fused into its epilogue.

use super::mma::{mma_program, MMA_STAGES, MMA_STAGE_BYTES};
use super::tma::{encode, tensor_map, wgmma_maps, TmaDesc};
use super::wgmma::{
    wg_smem, wgmma_declines_unpadded, wgmma_program, Persistent, WGMMA_ARCH, WG_GROUP_M,
    WG_THREADS, WG_TILE,
};
use super::{gemm_args, launch_inner, Launch, Ptrs};
use crate::core::cuda::jit::Program;
use crate::core::cuda::{CudaDevice, Stream};
use crate::core::device::Arch;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::ops::matmul::epilogue::{Activation, EpiPtrs};
use crate::ops::matmul::{Gemm, OP};
use std::sync::Arc;

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
    if let Some(why) = wgmma_declines_unpadded(g) {
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
            splits: 1,
        }),
        epilogue: None,
        pack: None,
        reduce: None,
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
        Some(ph) => encode(
            g.dtype,
            ph,
            [nh as u64, 2, rows],
            &[nh as u64 * es, g.n as u64 * es],
            [64, 1, 16],
            true,
        )?,
        None => TmaDesc::UNUSED,
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
        .push(1 | if h.is_some() { 2 } else { 0 })
        .push(0i32); // no split-K
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
                reduce: None,
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
            if let Some(why) = wgmma_declines_unpadded(g) {
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
