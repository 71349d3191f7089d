//! CUDA host code of the linear family: the unfused baseline (plain GEMM + element-wise kernels),
//! the fused variants (matmul's epilogue hook in `mma_pipelined` and `wgmma`), and the backward
//! (dZ + deterministic db kernel, then matmul's GEMMs on views and stream-ordered scratch).

use super::{rows_view, Activation, Bwd, BwdOut, Fwd, FwdOut, LinearOptions, Problem, OP, OP_BWD};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, CudaDevice, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use crate::ops::matmul::cuda::{self as mmc, Ptrs};
use crate::ops::matmul::epilogue::EpiPtrs;
use crate::ops::matmul::{self, Gemm, Operand};
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("linear", "kernels/linear.cu");
const FUNCS: [&str; 7] = [
    "linear_splitk_sum",
    "linear_bias",
    "linear_act",
    "linear_add",
    "linear_bwd_dz",
    "linear_db",
    "linear_dact",
];
/// Threads per block of the element-wise and backward kernels.
const THREADS: u32 = 256;

pub fn program(dtype: DType, act: Activation) -> Program {
    Program::new(SRC)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_ACT", act.code())
}

/// This family's own modules. The fused GEMMs it launches are matmul's epilogue specialisations,
/// listed (and build-checked) by matmul's `kernel_specs` (`matmul::cuda::epilogue_specs`).
pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for act in Activation::ALL {
        for d in [DType::F32, DType::F16, DType::BF16] {
            v.push(KernelSpec {
                program: program(d, act),
                functions: FUNCS.iter().map(|s| s.to_string()).collect(),
                min_arch: Arch::SM80,
            });
        }
    }
    v
}

/// Why `persistent` (the wgmma epilogue kernel) cannot run `g`, or None. Operands whose rows TMA
/// cannot address (an odd k, a view at an odd offset) are re-pitched first by matmul's pre-pass;
/// unless asked for by name, small such problems stay on `fused` (matmul's
/// `wgmma_default_refuses`).
pub fn persistent_declines(g: &Gemm, arch: Option<Arch>, named: bool) -> Option<String> {
    if arch.is_some_and(|a| a.major != 9) {
        return Some(mmc::WGMMA_ARCH.to_string());
    }
    mmc::wgmma_declines(g).or_else(|| {
        if named {
            None
        } else {
            mmc::wgmma_default_refuses(g)
        }
    })
}

fn ctx(p: &Problem, stream: &Option<Stream>) -> Result<(Arc<CudaDevice>, Stream)> {
    let Device::Cuda(i) = p.device else {
        unreachable!("linear cuda path on {}", p.device)
    };
    let dev = device(i)?;
    let s = stream.clone().unwrap_or_else(|| dev.stream().clone());
    Ok((dev, s))
}

/// Row pitch of a 2-D row view (any value serves a single row).
fn ld_of(t2: &Tensor) -> usize {
    let cols = t2.shape()[1].max(1);
    if t2.shape()[0] <= 1 {
        cols
    } else {
        t2.strides()[0]
    }
}

/// Blocks for a grid-stride pass over `total` elements.
fn blocks_for(total: usize) -> u32 {
    total.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32
}

/// The epilogue operands of a forward call.
pub(super) fn epi_ptrs(p: &Problem, i: &Fwd, o: &FwdOut) -> Result<EpiPtrs> {
    let (r, ldr) = match i.residual {
        Some(r) => {
            let r2 = rows_view(OP, "residual", r)?;
            (r2.device_ptr()?, ld_of(&r2))
        }
        None => (0, p.n.max(1)),
    };
    Ok(EpiPtrs {
        bias: i.bias.map(|b| b.device_ptr()).transpose()?.unwrap_or(0),
        z: o.z.map(|z| z.device_ptr()).transpose()?.unwrap_or(0),
        ldz: p.n.max(1),
        stride_z: 0,
        r,
        ldr,
        stride_r: 0,
        part: 0,
    })
}

pub fn forward(
    variant: &str,
    p: &Problem,
    g: &Gemm,
    i: &Fwd,
    o: &FwdOut,
    opts: &LinearOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, &opts.stream)?;
    let e = epi_ptrs(p, i, o)?;
    let ptrs = Ptrs {
        a: i.x.device_ptr()?,
        b: i.w.device_ptr()?,
        c: o.y.device_ptr()?,
    };
    match variant {
        "naive" => forward_unfused(p, g, ptrs, e, opts, &dev, &stream),
        "fused" | "persistent" | "fused_pairs" | "persistent_pairs" | "skinny" => {
            let l = plan_fused(variant, g, &dev, opts.activation)?;
            mmc::launch_with_epilogue(&l, g, ptrs, 1.0, 0.0, e, &stream)
        }
        other => Err(Error::NoVariant {
            op: OP.into(),
            msg: format!("no CUDA variant named `{other}`"),
        }),
    }
}

/// The matmul epilogue kernel a fused variant launches: `fused*` = `mma_pipelined`,
/// `persistent*` = `wgmma`; `*_pairs` with the pair epilogue; `skinny` = matmul's decode kernel.
pub fn plan_fused(
    variant: &str,
    g: &Gemm,
    dev: &Arc<CudaDevice>,
    act: Activation,
) -> Result<mmc::Launch> {
    if variant == "skinny" {
        return mmc::plan_epilogue("skinny", g, dev, act);
    }
    let gemm = if variant.starts_with("fused") {
        "mma_pipelined"
    } else {
        "wgmma"
    };
    if variant.ends_with("_pairs") {
        mmc::plan_epilogue_pairs(gemm, g, dev, act)
    } else {
        mmc::plan_epilogue(gemm, g, dev, act)
    }
}

/// The unfused baseline: the plain GEMM matmul would pick, then one kernel per epilogue step.
fn forward_unfused(
    p: &Problem,
    g: &Gemm,
    ptrs: Ptrs,
    e: EpiPtrs,
    opts: &LinearOptions,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
) -> Result<()> {
    let mm_opts = matmul::MatmulOptions {
        stream: Some(stream.clone()),
        ..opts.matmul()
    };
    mmc::gemm_ptrs(g, ptrs, &mm_opts)?;
    let (m, n) = (p.m as i64, p.n as i64);
    let grid = (blocks_for(p.m * p.n), 1, 1);
    let block = (THREADS, 1, 1);
    let prog = program(p.dtype, opts.activation);
    if e.bias != 0 || e.z != 0 {
        let k = dev.kernel(&prog, "linear_bias")?;
        let mut a = KernelArgs::new();
        a.push(ptrs.c)
            .push(n)
            .push(e.bias)
            .push(e.z)
            .push(e.ldz as i64)
            .push(m)
            .push(n);
        k.launch(stream, grid, block, 0, &mut a)?;
    }
    if opts.activation != Activation::None {
        let k = dev.kernel(&prog, "linear_act")?;
        let mut a = KernelArgs::new();
        a.push(ptrs.c).push(n).push(m).push(n);
        k.launch(stream, grid, block, 0, &mut a)?;
    }
    if e.r != 0 {
        let k = dev.kernel(&prog, "linear_add")?;
        let mut a = KernelArgs::new();
        a.push(ptrs.c)
            .push(n)
            .push(e.r)
            .push(e.ldr as i64)
            .push(m)
            .push(n);
        k.launch(stream, grid, block, 0, &mut a)?;
    }
    Ok(())
}

/// The dX GEMM with the activation-backward epilogue (`wgmma`, bf16/f16, Hopper), or None where
/// it does not run (the caller then runs the plain GEMM and `linear_dact`).
fn plan_dact(g: &Gemm, dev: &Arc<CudaDevice>, act: Activation) -> Result<Option<mmc::Launch>> {
    if g.dtype == DType::F32 || persistent_declines(g, Some(dev.arch()), false).is_some() {
        return Ok(None);
    }
    match mmc::plan_epilogue_dact(g, dev, act) {
        Ok(l) => Ok(Some(l)),
        Err(e @ Error::BadArg { .. }) => Err(e),
        Err(_) => Ok(None),
    }
}

/// db[j] = Σ_p part[p][j] over `parts` f32 partial rows of n (`linear_db`: fixed order, the
/// same bits every run); with no parts every db[j] is the empty sum, 0.
fn col_sum(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    dtype: DType,
    part: u64,
    parts: usize,
    n: usize,
    db: &Tensor,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let kern = dev.kernel(&program(dtype, Activation::None), "linear_db")?;
    let mut a = KernelArgs::new();
    a.push(part)
        .push(parts as i64)
        .push(n as i64)
        .push(db.device_ptr()?);
    kern.launch(
        stream,
        ((n as u32).div_ceil(32).max(1), 1, 1),
        (32, 16, 1),
        0,
        &mut a,
    )
}

/// Slices of the token rows that dW's GEMM is split into (1: none). dW [n, k] of a layer is small
/// next to its reduction over m tokens: 768×768 is 18 tiles of 128×256 for 132 SMs. Split-K runs
/// `s` slices as one batched GEMM (s·tiles tiles) into bf16 partials, then a fixed-order sum.
/// The model: a wave of the persistent grid costs the same whatever s (each tile does 1/s of the
/// K loop), so time ∝ ⌈s·tiles / SMs⌉ / s, plus ~2% per slice for the partials' traffic and the
/// sum. Slices stay multiples of 64 rows and at least 1024 rows.
pub fn dw_split(n: usize, k: usize, m: usize, sms: usize) -> usize {
    let tiles = n.div_ceil(128) * k.div_ceil(256);
    let cost = |s: usize| (tiles * s).div_ceil(sms.max(1)) as f64 / s as f64 + 0.02 * s as f64;
    [1, 2, 4, 8]
        .into_iter()
        .filter(|&s| s == 1 || (m.is_multiple_of(64 * s) && m / s >= 1024))
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
        .unwrap_or(1)
}

/// dW by split-K: slice j of the m token rows gives partial j of a `[split, n, k]` scratch (one
/// batched GEMM), then `linear_splitk_sum` adds the partials in order into dW (fp32 sums, the same
/// bits every run).
fn dw_split_k(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    g: &Gemm,
    p: Ptrs,
    split: usize,
    dtype: DType,
    mm_opts: &matmul::MatmulOptions,
) -> Result<()> {
    let (n, k, rows) = (g.m, g.n, g.k / split);
    let es = dtype.size_in_bytes();
    let part = dev.alloc(split * n * k * es, stream)?;
    let sg = Gemm {
        batch: split,
        k: rows,
        a: Operand {
            batch_stride: rows * g.a.ld,
            ..g.a
        },
        b: Operand {
            batch_stride: rows * g.b.ld,
            ..g.b
        },
        c: Operand {
            ld: k,
            trans: false,
            batch_stride: n * k,
        },
        ..*g
    };
    mmc::gemm_ptrs(
        &sg,
        Ptrs {
            a: p.a,
            b: p.b,
            c: part.ptr(),
        },
        mm_opts,
    )?;
    let kern = dev.kernel(&program(dtype, Activation::None), "linear_splitk_sum")?;
    let count = n * k;
    let mut a = KernelArgs::new();
    a.push(part.ptr())
        .push(split as i64)
        .push(count as i64)
        .push(p.c);
    kern.launch(
        stream,
        (blocks_for(count), 1, 1),
        (THREADS, 1, 1),
        0,
        &mut a,
    )?;
    drop(part);
    Ok(())
}

/// Where `linear_bwd_dz` reads and writes: dY (`g`, rows `ldg` apart), Z (0 when the program's
/// activation is none), dZ (0: not written) and the `[chunks, n]` f32 column partials (0: none).
struct DzPass {
    g: u64,
    ldg: usize,
    z: u64,
    ldz: usize,
    dz: u64,
    lddz: usize,
    partial: u64,
}

/// One launch of `linear_bwd_dz` over m×n (m·n > 0): dZ = dY ⊙ act'(Z) where `dz` is set, and
/// the column sums of dZ over fixed chunks of `rows_per_chunk(m)` rows where `partial` is set.
fn launch_bwd_dz(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    prog: &Program,
    p: &DzPass,
    m: usize,
    n: usize,
) -> Result<()> {
    let rpc = rows_per_chunk(m);
    let kern = dev.kernel(prog, "linear_bwd_dz")?;
    let mut a = KernelArgs::new();
    a.push(p.g)
        .push(p.ldg as i64)
        .push(p.z)
        .push(p.ldz as i64)
        .push(p.dz)
        .push(p.lddz as i64)
        .push(p.partial)
        .push(m as i64)
        .push(n as i64)
        .push(rpc as i64);
    let col_blocks = (n as u32).div_ceil(THREADS).max(1);
    let chunks = m.div_ceil(rpc) as u32;
    kern.launch(stream, (col_blocks, chunks, 1), (THREADS, 1, 1), 0, &mut a)
}

/// db[j] = Σ_i g[i][j] over an m×n matrix with rows `ld` apart: the dZ/db kernel with no dZ to
/// write (row chunks in a fixed order), then `col_sum` of the chunk partials.
#[allow(clippy::too_many_arguments)]
fn db_pass(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    dtype: DType,
    g: u64,
    ld: usize,
    m: usize,
    n: usize,
    db: &Tensor,
) -> Result<()> {
    if m * n == 0 {
        return col_sum(dev, stream, dtype, 0, 0, n, db);
    }
    let chunks = m.div_ceil(rows_per_chunk(m));
    let partial = dev.alloc(chunks * n * 4, stream)?;
    let pass = DzPass {
        g,
        ldg: ld,
        z: 0,
        ldz: n.max(1),
        dz: 0,
        lddz: n.max(1),
        partial: partial.ptr(),
    };
    launch_bwd_dz(dev, stream, &program(dtype, Activation::None), &pass, m, n)?;
    col_sum(dev, stream, dtype, partial.ptr(), chunks, n, db)
}

/// Rows per block of the dZ/db kernel: 64, more when m would need over 65535 chunks (grid y).
pub fn rows_per_chunk(m: usize) -> usize {
    64usize.max(m.div_ceil(65535))
}

/// A plain row-major operand of a GEMM.
fn operand(ld: usize, trans: bool) -> Operand {
    Operand {
        ld: ld.max(1),
        trans,
        batch_stride: 0,
    }
}

/// The backward. `variant` only decides how `Bwd::x_pre` is applied: `naive` runs the plain dX
/// GEMM and then `linear_dact`; every other variant forms the layer below's dZ in the dX GEMM's
/// epilogue (`wgmma`'s activation-backward epilogue) where that kernel can run, else the same two
/// steps.
pub fn backward(
    variant: &str,
    p: &Problem,
    i: &Bwd,
    o: &BwdOut,
    opts: &LinearOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, &opts.stream)?;
    let (m, n, k) = (p.m, p.n, p.k);
    let act = opts.activation;
    let es = p.dtype.size_in_bytes();
    let dy2 = rows_view(OP_BWD, "dy", i.dy)?;
    let x2 = rows_view(OP_BWD, "x", i.x)?;
    let (dy_ptr, lddy) = (dy2.device_ptr()?, ld_of(&dy2));
    let (z_ptr, ldz) = match (act, i.z) {
        (Activation::None, _) | (_, None) => (0, n.max(1)),
        (_, Some(z)) => {
            let z2 = rows_view(OP_BWD, "z", z)?;
            (z2.device_ptr()?, ld_of(&z2))
        }
    };
    let need_dz = act != Activation::None && (o.dx.is_some() || o.dw.is_some());
    // Scratch on the op's stream: freed there, after the work queued on it.
    let dz_buf = if need_dz && m * n > 0 {
        Some(dev.alloc(m * n * es, &stream)?)
    } else {
        None
    };
    let (dz_ptr, lddz) = match &dz_buf {
        Some(b) => (b.ptr(), n.max(1)),
        None => (dy_ptr, lddy),
    };
    let chunks = m.div_ceil(rows_per_chunk(m));
    let partial = match o.db {
        Some(_) if m * n > 0 => Some(dev.alloc(chunks * n * 4, &stream)?),
        _ => None,
    };
    if m * n > 0 && (dz_buf.is_some() || partial.is_some()) {
        let pass = DzPass {
            g: dy_ptr,
            ldg: lddy,
            z: z_ptr,
            ldz,
            dz: dz_buf.as_ref().map_or(0, |b| b.ptr()),
            lddz,
            partial: partial.as_ref().map_or(0, |b| b.ptr()),
        };
        launch_bwd_dz(&dev, &stream, &program(p.dtype, act), &pass, m, n)?;
    }
    if let Some(db) = o.db {
        // With m = 0 no chunk exists and every db[j] is the empty sum, 0.
        let parts = if m == 0 { 0 } else { chunks };
        let part = partial.as_ref().map_or(0, |b| b.ptr());
        col_sum(&dev, &stream, p.dtype, part, parts, n, db)?;
    }
    let mm_opts = matmul::MatmulOptions {
        stream: Some(stream.clone()),
        ..opts.matmul()
    };
    if let Some(dx) = o.dx {
        // dX [m, k] = dZ [m, n] · W [n, k]
        let g = Gemm {
            batch: 1,
            m,
            n: k,
            k: n,
            a: operand(lddz, false),
            b: operand(ld_of(i.w), false),
            c: operand(k, false),
            dtype: p.dtype,
            device: p.device,
        };
        let ptrs = Ptrs {
            a: dz_ptr,
            b: i.w.device_ptr()?,
            c: dx.device_ptr()?,
        };
        match i.x_pre {
            Some((z_in, act_in)) if act_in != Activation::None && m * k > 0 => {
                let z2 = rows_view(OP_BWD, "x_pre", z_in)?;
                let (zp, ldzi) = (z2.device_ptr()?, ld_of(&z2));
                let fused = if variant == "naive" {
                    None
                } else {
                    plan_dact(&g, &dev, act_in)?
                };
                let mut e = EpiPtrs {
                    bias: 0,
                    z: 0,
                    ldz: k.max(1),
                    stride_z: 0,
                    r: zp,
                    ldr: ldzi,
                    stride_r: 0,
                    part: 0,
                };
                // The layer below's db from the epilogue's 16-row column sums where every tile
                // writes them; else (and on the unfused path) a pass over dx below.
                let groups = m / 16;
                let colsum = match (&fused, o.db_pre) {
                    (Some(l), Some(_)) if mmc::dact_colsum_ok(l, &g, ptrs, 0.0, &e) => {
                        Some(dev.alloc(groups * k * 4, &stream)?)
                    }
                    _ => None,
                };
                match fused {
                    Some(l) => {
                        e.part = colsum.as_ref().map_or(0, |b| b.ptr());
                        mmc::launch_with_epilogue(&l, &g, ptrs, 1.0, 0.0, e, &stream)?;
                    }
                    None => {
                        mmc::gemm_ptrs(&g, ptrs, &mm_opts)?;
                        let kern = dev.kernel(&program(p.dtype, act_in), "linear_dact")?;
                        let mut a = KernelArgs::new();
                        a.push(ptrs.c)
                            .push(k as i64)
                            .push(zp)
                            .push(ldzi as i64)
                            .push(m as i64)
                            .push(k as i64);
                        kern.launch(
                            &stream,
                            (blocks_for(m * k), 1, 1),
                            (THREADS, 1, 1),
                            0,
                            &mut a,
                        )?;
                    }
                }
                if let Some(dbp) = o.db_pre {
                    match &colsum {
                        Some(part) => col_sum(&dev, &stream, p.dtype, part.ptr(), groups, k, dbp)?,
                        None => db_pass(&dev, &stream, p.dtype, ptrs.c, k, m, k, dbp)?,
                    }
                }
                drop(colsum);
            }
            _ => mmc::gemm_ptrs(&g, ptrs, &mm_opts)?,
        }
    }
    if let Some(dw) = o.dw {
        // dW [n, k] = dZᵀ [n, m] (dZ read transposed in place) · X [m, k]
        let g = Gemm {
            batch: 1,
            m: n,
            n: k,
            k: m,
            a: operand(lddz, true),
            b: operand(ld_of(&x2), false),
            c: operand(k, false),
            dtype: p.dtype,
            device: p.device,
        };
        let ptrs = Ptrs {
            a: dz_ptr,
            b: x2.device_ptr()?,
            c: dw.device_ptr()?,
        };
        let split = dw_split(n, k, m, dev.props().sm_count as usize);
        if split > 1 && variant != "naive" {
            dw_split_k(&dev, &stream, &g, ptrs, split, p.dtype, &mm_opts)?;
        } else {
            mmc::gemm_ptrs(&g, ptrs, &mm_opts)?;
        }
    }
    // The scratch buffers drop here: their frees are queued on `stream` after the GEMMs.
    drop((dz_buf, partial));
    Ok(())
}
