//! CUDA host code of the matmul family: launching each variant's kernel, and cuBLAS as the peer.
//!
//! Every variant goes the same way: `plan` (or `plan_with`, `plan_epilogue*`, `plan_grouped*`)
//! compiles its module and returns a `Launch` (kernel, block, shared memory, C tile, the extra
//! parameters it takes); `launch` (or `launch_with_epilogue`, `launch_grouped*`) queues it on a
//! stream with the GEMM parameters every kernel leads with (`FE_MATMUL_PARAMS`).
//!
//! The files:
//! - `mod.rs` (here): the kernel sources, `Ptrs` and `Launch`, planning and launching every
//!   variant (`plan_inner`, `launch_inner`), `kernel_specs` (every module the family compiles, for
//!   `ferrite kernels`) and `matmul_into`'s CUDA entry (`run`, `gemm_ptrs`);
//! - `simt.rs`: the fp32 SIMT rungs (`naive`, `coalesced` ... `warptile`);
//! - `mma.rs`: the `mma.sync` kernels (`mma`, `mma_pipelined`): stages and program;
//! - `wgmma.rs`: the Hopper `wgmma` kernel: launch configurations and their tuner, shared-memory
//!   layout, the persistent grid, the tf32 pack pre-pass;
//! - `tma.rs`: TMA tensor maps of the `wgmma` and `skinny` operands and outputs;
//! - `skinny.rs`: `skinny`, the short-A (decode) kernel;
//! - `epilogue.rs`: the fused epilogue kernels a linear layer plans and launches (element-wise,
//!   pairs, activation backward);
//! - `grouped.rs`: grouped GEMMs (a mixture of experts' expert GEMMs, the grouped GLU);
//! - `peers.rs`: cuBLAS and cuBLASLt on the same problem, the vendor peers.

mod epilogue;
mod grouped;
mod mma;
mod peers;
mod simt;
mod skinny;
mod tma;
mod wgmma;

pub use epilogue::{
    dact_colsum_ok, epilogue_specs, launch_with_epilogue, plan_epilogue, plan_epilogue_dact,
    plan_epilogue_pairs, Epi, EPILOGUE_PAIR_VARIANTS, EPILOGUE_VARIANTS,
};
pub use grouped::{
    grouped_layouts, grouped_specs, launch_grouped, launch_grouped_glu, plan_grouped,
    plan_grouped_glu, Grouping, Groups, MAX_GROUPS,
};
pub use peers::{cublas, LtOperands, LtPlan};
pub use skinny::{
    skinny_by_default, skinny_declines, skinny_refuses, SKINNY_DEFAULT_MAX_M, SKINNY_MAX_M,
};
pub use wgmma::{
    wg_config_named, wg_tuned, wgmma_declines, wgmma_declines_unpadded, wgmma_default_refuses,
    wgmma_function, Persistent, WgConfig, REPITCH_MIN_MACS, WGMMA_ARCH, WG_CLUSTERS, WG_CONFIGS,
    WG_CONFIG_VAR, WG_DACT, WG_DEFAULT,
};

use self::epilogue::epilogue_note;
use self::mma::{mma_program, MMA_EPI_STAGES, MMA_STAGES, MMA_STAGE_BYTES};
use self::simt::{naive_program, SIMT};
use self::skinny::{
    skinny_functions, skinny_pass, skinny_program, skinny_slices, skinny_smem, SKINNY_TILES,
    SKINNY_WARPS,
};
use self::tma::{skinny_b_map, wg_tma_store_ok, wgmma_maps, wgmma_out_map, TmaDesc};
use self::wgmma::{
    forced_wg_config, repitch16, tf32_pack, wg_bk, wg_has_tma_store, wg_kstep, wg_pack_function,
    wg_smem, wg_splits, wg_stages, wgmma_program, WG_THREADS, WG_TILE,
};
use super::epilogue::EpiPtrs;
use super::{Gemm, MatmulOptions, OP};
use crate::core::cuda::jit::KernelSource;
use crate::core::cuda::jit::Program;
use crate::core::cuda::{device, CudaDevice, Kernel, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use std::sync::Arc;

/// A tiled kernel: `kernels/common.cuh` (launch conventions, layout dispatch, tile loaders)
/// followed by the kernel's own file (`$file` relative to the family's folder, `ops/matmul/`).
macro_rules! tiled_source {
    ($name:literal, $file:literal) => {
        KernelSource {
            name: concat!("matmul/", $name),
            src: concat!(
                include_str!("../kernels/common.cuh"),
                include_str!(concat!("../", $file))
            ),
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

/// The config note of a 16-bit `wgmma` plan: what happens to operands TMA cannot address.
const UNALIGNED_NOTE: &str = ", operands with rows not 16-byte aligned first re-pitched";

/// Whether a CUDA variant runs on tensor cores: f32 inputs then run as tf32, and only when the
/// caller asks for `Precision::Tf32`.
pub fn tensor_core(variant: &str) -> bool {
    matches!(variant, "mma" | "mma_pipelined" | "wgmma" | "skinny")
}

/// Device pointers of the three operands (first element of each view).
#[derive(Clone, Copy, Debug)]
pub struct Ptrs {
    pub a: u64,
    pub b: u64,
    pub c: u64,
}

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
                    functions: vec![
                        "matmul_wgmma".into(),
                        wg_pack_function(d).into(),
                        "matmul_splitk_reduce".into(),
                    ],
                    min_arch: Arch::SM90,
                });
            }
        }
    }
    // tf32: one layout (K-major A and B; others are packed into it) and its pack pre-pass.
    for cluster in WG_CLUSTERS {
        v.push(KernelSpec {
            program: wgmma_program(DType::F32, false, true, cluster, None),
            functions: vec!["matmul_wgmma".into(), wg_pack_function(DType::F32).into()],
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

/// The kernel, block shape, dynamic shared memory and C tile per block a variant launches with.
#[derive(Clone)]
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
    /// Split-K `wgmma` (`Persistent::splits` > 1): the pass that sums the splits' fp32 partials
    /// into C (`matmul_splitk_reduce`).
    pub reduce: Option<Kernel>,
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

/// Plans kept by `plan_inner` before its map is cleared (every key is a distinct problem shape).
const LAUNCH_CACHE_MAX: usize = 4096;

/// `plan_uncached`, remembered per (device, variant, problem, epilogue, configuration): a plan is
/// a function of these, and building one — the program's defines and label, kernel lookups keyed
/// by that label, the configuration text — costs µs of host on every op call that plans (the
/// linear layer's forward and backward, each bench launch's plan).
fn plan_inner(
    variant: &str,
    g: &Gemm,
    dev: &Arc<CudaDevice>,
    epi: Option<Epi>,
    wg: WgConfig,
) -> Result<Launch> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    type Key = (usize, String, Gemm, Option<Epi>, WgConfig);
    static LAUNCHES: OnceLock<Mutex<HashMap<Key, Launch>>> = OnceLock::new();
    let launches = LAUNCHES.get_or_init(Default::default);
    let key: Key = (dev.ordinal(), variant.to_string(), *g, epi, wg);
    if let Some(l) = launches.lock().unwrap().get(&key) {
        return Ok(l.clone());
    }
    let l = plan_uncached(variant, g, dev, epi, wg)?;
    let mut map = launches.lock().unwrap();
    if map.len() >= LAUNCH_CACHE_MAX {
        map.clear();
    }
    map.insert(key, l.clone());
    Ok(l)
}

fn plan_uncached(
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
            reduce: None,
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
            reduce: None,
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
                reduce: None,
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
            // Split-K (plain 16-bit GEMMs with few tiles): single-block clusters (a pair's second
            // block would hold no rows at m ≤ 128).
            let splits = if epi.is_none() {
                wg_splits(g, dev.props().sm_count)
            } else {
                1
            };
            let cluster = if splits > 1 { 1 } else { wg.cluster };
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
            let pack = Some(dev.kernel(&program, wg_pack_function(g.dtype))?);
            let reduce = if splits > 1 {
                Some(dev.kernel(&program, "matmul_splitk_reduce")?)
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
                DType::BF16 => ("bf16", UNALIGNED_NOTE),
                _ => ("f16", UNALIGNED_NOTE),
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
                    if splits > 1 {
                        format!("k split {splits} ways, fp32 partials summed in a second pass")
                    } else if has_store && wg.tma_store {
                        "C staged in shared memory and written by TMA stores".into()
                    } else {
                        "C stored from registers".into()
                    },
                    epilogue_note(epi)
                ),
                persistent: Some(Persistent {
                    ctas: sms,
                    group_m,
                    cluster,
                    tma_store: has_store && wg.tma_store,
                    splits,
                }),
                epilogue: epi,
                pack,
                reduce,
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
            reduce: None,
                b_map: Some((skinny_pass(mt), sm90)),
            })
        }
        _ => Err(refuse("does not exist")),
    }
}

/// Queues the planned kernel on `stream` for operands at `p`.
pub fn launch(l: &Launch, g: &Gemm, p: Ptrs, alpha: f32, beta: f32, stream: &Stream) -> Result<()> {
    launch_inner(l, g, p, alpha, beta, EpiPtrs::default(), None, stream)
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
    // wgmma: operands it cannot read as they are go through its pre-pass first (tf32: packed
    // K-major; 16-bit: rows re-pitched to 16 bytes); the scratch is freed (stream-ordered, after
    // the GEMM) when `_scratch` drops.
    let mut _scratch = Vec::new();
    let (g, p) = match &l.pack {
        Some(k) if g.dtype == DType::F32 => tf32_pack(k, g, p, stream, &mut _scratch)?,
        Some(k) => repitch16(k, g, p, stream, &mut _scratch)?,
        None => (*g, p),
    };
    // Split-K: the splits run as the batch of an unbatched problem (A and B batch strides 0),
    // writing fp32 partials [splits][m][n] into a workspace; the reduce pass below writes C.
    let splits = l.persistent.map_or(1, |pp| pp.splits);
    let (g_out, p_out, alpha_out, beta_out) = (g, p, alpha, beta);
    let mut _workspace = None;
    let (g, p, alpha, beta) = if splits > 1 {
        let ws = l
            .kernel
            .dev
            .alloc(splits as usize * g.m * g.n * 4, stream)?;
        let mut gs = g;
        gs.batch = splits as usize;
        gs.a.batch_stride = 0;
        gs.b.batch_stride = 0;
        gs.c.ld = g.n;
        gs.c.batch_stride = g.m * g.n;
        let ps = Ptrs { c: ws.ptr(), ..p };
        _workspace = Some(ws);
        (gs, ps, 1.0, 0.0)
    } else {
        (g, p, alpha, beta)
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
        let store = splits == 1 && pp.tma_store && wg_tma_store_ok(g, p.c, beta, &e);
        let none = TmaDesc::UNUSED;
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
            .push(store as i32)
            .push((splits > 1) as i32);
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
    l.kernel.launch(stream, grid, l.block, l.smem, &mut args)?;
    match (&l.reduce, &_workspace) {
        (Some(reduce), Some(ws)) => {
            let (g, mn) = (g_out, (g_out.m * g_out.n) as u64);
            let mut args = KernelArgs::new();
            args.push(p_out.c)
                .push(ws.ptr())
                .push(g.m as i64)
                .push(g.n as i64)
                .push(g.c.ld as i64)
                .push(splits as i32)
                .push(alpha_out)
                .push(beta_out);
            let blocks = mn.div_ceil(512).clamp(1, 4 * 1024) as u32;
            reduce.launch(stream, (blocks, 1, 1), (256, 1, 1), 0, &mut args)
        }
        _ => Ok(()),
    }
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

pub(super) fn run(
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
    gemm_ptrs(g, p, opts)
}

/// `matmul_into` on raw device pointers (operands that are not tensors, e.g. another op's
/// stream-ordered scratch): picks the variant as `matmul_into` does and launches it on
/// `opts.stream`. The caller guarantees that `p` addresses live buffers of `g.dtype` on `g`'s
/// device laid out as `g` says.
pub fn gemm_ptrs(g: &Gemm, p: Ptrs, opts: &MatmulOptions) -> Result<()> {
    let Device::Cuda(i) = g.device else {
        unreachable!("cuda::gemm_ptrs on a CPU problem")
    };
    if g.batch == 0 || g.m == 0 || g.n == 0 {
        // Nothing to write; the request is still checked (a named variant that cannot run it).
        return super::select(g, opts).map(|_| ());
    }
    let dev = device(i)?;
    let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    let (_, l) = planned(g, p, opts, &dev, &stream)?;
    launch(&l, g, p, opts.alpha, opts.beta, &stream)
}

/// The variant `gemm_ptrs` runs for `g` under `opts` (after the short-A race, which this may run
/// and remember): what `bench matmul --sweep` names in its default rows.
pub fn default_variant(g: &Gemm, p: Ptrs, opts: &MatmulOptions) -> Result<&'static str> {
    let Device::Cuda(i) = g.device else {
        return Ok(super::select(g, opts)?.name);
    };
    let dev = device(i)?;
    let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    Ok(planned(g, p, opts, &dev, &stream)?.0)
}

/// What a call resolved to, by everything that decides it: the problem (shape, layout, dtype,
/// device) and the options that pick the variant.
#[derive(Clone, PartialEq, Eq, Hash)]
struct PlanKey {
    g: Gemm,
    variant: Option<String>,
    config: Option<String>,
    precision: crate::core::harness::Precision,
}

/// Whether the default selection times `skinny` against `wgmma` for `g` (`short_pick`): a short
/// 16-bit A (m ≤ 64) with both operands K-contiguous on Hopper, where both run and the faster
/// one depends on m, n·k and alignment — `skinny` streams the weight once with every SM busy and
/// no tile overhead (a 768² layer at 16 rows: ~8 µs against ~13 for `wgmma`, H200), `wgmma`
/// with split-K wins from 16 rows on large weights, and on rows TMA cannot address (re-pitched)
/// `skinny` falls back to element loads (1×4097² 57 µs; `wgmma` 47 at 16 rows).
fn races_short(g: &Gemm, opts: &MatmulOptions, dev: &CudaDevice, selected: &str) -> bool {
    opts.variant.is_none()
        && matches!(selected, "skinny" | "wgmma")
        && dev.arch().major == 9
        && skinny_declines(g).is_none()
        && wgmma_declines(g).is_none()
        && wgmma_default_refuses(g).is_none()
}

/// `skinny` or `wgmma` for a short A, whichever ran faster at the shape class's first use (the
/// selection's pick first: it stands while a CUDA graph is captured), remembered in tune.json.
/// Each candidate writes a scratch C with β = 0, so the caller's C is untouched.
fn short_pick(
    g: &Gemm,
    p: Ptrs,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    selected: &'static str,
) -> Result<&'static str> {
    use crate::core::tune;
    let aligned = [(g.a, p.a), (g.b, p.b)]
        .iter()
        .all(|(o, base)| self::wgmma::rows_aligned16(o, *base));
    let key = format!(
        "{}/matmul_short/{}/{}/{}",
        dev.props().name,
        g.dtype,
        if aligned { "aligned" } else { "unaligned" },
        tune::shape_class(&[g.m, g.n, g.k, g.batch])
    );
    let other = if selected == "skinny" {
        "wgmma"
    } else {
        "skinny"
    };
    let candidates = [selected, other];
    if let Some(v) = tune::remembered(&key, &candidates) {
        return Ok(v);
    }
    if crate::core::cuda::is_capturing(stream) {
        return Ok(selected);
    }
    let (gs, q, _scratch) = self::wgmma::scratch_c(g, p, dev, stream)?;
    tune::pick(&key, &candidates, |&v| {
        let cfg = if v == "wgmma" {
            wg_tuned(&gs, q, dev, stream)?
        } else {
            WG_DEFAULT
        };
        let l = plan_with(v, &gs, dev, cfg)?;
        crate::core::cuda::rows::time_briefly(dev, stream, || launch(&l, &gs, q, 1.0, 0.0, stream))
    })
    .map(|(v, _)| v)
}

/// Plans kept by `planned` before the map is cleared (a workload of ever-new shapes, e.g. ragged
/// batches, would otherwise grow it without bound).
const PLAN_CACHE_MAX: usize = 4096;

/// The launch that runs `g` under `opts`: the variant `select` picks, `wgmma`'s configuration
/// (named, forced by the environment, or the tuner's) and its plan — remembered per problem, so
/// that a repeated call costs a map lookup instead of the selection, the tuner's lookup and the
/// planning (program labels, kernel lookups, the configuration text): ~10 µs of host per call
/// before, more than a small GEMM's GPU time. Not remembered while the stream captures a CUDA
/// graph and the tuner could not measure (its default then stands in for one call).
fn planned(
    g: &Gemm,
    p: Ptrs,
    opts: &MatmulOptions,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
) -> Result<(&'static str, Arc<Launch>)> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    type Plans = HashMap<PlanKey, (&'static str, Arc<Launch>)>;
    static PLANS: OnceLock<Mutex<Plans>> = OnceLock::new();
    let key = PlanKey {
        g: *g,
        variant: opts.variant.clone(),
        config: opts.config.clone(),
        precision: super::precision_of(g, opts),
    };
    let plans = PLANS.get_or_init(Default::default);
    if let Some(l) = plans.lock().unwrap().get(&key) {
        return Ok(l.clone());
    }
    let selected = super::select(g, opts)?.name;
    let variant = if races_short(g, opts, dev, selected) {
        short_pick(g, p, dev, stream, selected)?
    } else {
        selected
    };
    let cfg = match (&opts.config, variant) {
        (Some(name), "wgmma") => wg_config_named(name)?,
        (None, "wgmma") => match forced_wg_config()? {
            Some(cfg) => cfg,
            // Tuned at a shape's first use: on the H100 every configuration passed `check matmul`
            // and the tuned picks ran at 0.89–0.98× cuBLAS (bench/results/2026-11-23-h100-wgmma-tuner).
            None if g.k > 0 => wg_tuned(g, p, dev, stream)?,
            None => WG_DEFAULT,
        },
        _ => WG_DEFAULT,
    };
    let l = Arc::new(plan_with(variant, g, dev, cfg)?);
    if !crate::core::cuda::is_capturing(stream) {
        let mut map = plans.lock().unwrap();
        if map.len() >= PLAN_CACHE_MAX {
            map.clear();
        }
        map.insert(key, (variant, l.clone()));
    }
    Ok((variant, l))
}
