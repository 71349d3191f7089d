//! CUDA host code of the matmul family: launching each variant's kernel, and cuBLAS as the peer.

use super::{Gemm, MatmulOptions, OP};
use crate::core::cuda::jit::KernelSource;
use crate::core::cuda::jit::Program;
use crate::core::cuda::{blas, device, CudaDevice, Kernel, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::{KernelSpec, Precision};
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const NAIVE: KernelSource = kernel_source!("matmul/naive", "kernels/naive.cu");

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

const COALESCED: KernelSource = tiled_source!("coalesced", "kernels/coalesced.cu");
const SMEM_TILED: KernelSource = tiled_source!("smem_tiled", "kernels/smem_tiled.cu");
const BLOCKTILE_1D: KernelSource = tiled_source!("blocktile_1d", "kernels/blocktile_1d.cu");
const BLOCKTILE_2D: KernelSource = tiled_source!("blocktile_2d", "kernels/blocktile_2d.cu");
const VECTORIZED: KernelSource = tiled_source!("vectorized", "kernels/vectorized.cu");
const WARPTILE: KernelSource = tiled_source!("warptile", "kernels/warptile.cu");
const MMA: KernelSource = tiled_source!("mma", "kernels/mma.cu");

/// One fp32 SIMT rung: its module, entry point, threads per block, C tile per block (rows,
/// columns) and a short description of the configuration.
struct Simt {
    name: &'static str,
    source: KernelSource,
    func: &'static str,
    threads: u32,
    tile: (u32, u32),
    config: &'static str,
}

const SIMT: &[Simt] = &[
    Simt {
        name: "coalesced",
        source: COALESCED,
        func: "matmul_coalesced",
        threads: 1024,
        tile: (32, 32),
        config: "block 32×32, 1 output/thread, lanes on the contiguous side",
    },
    Simt {
        name: "smem_tiled",
        source: SMEM_TILED,
        func: "matmul_smem_tiled",
        threads: 1024,
        tile: (32, 32),
        config: "tile 32×32×32 in smem, 1 output/thread",
    },
    Simt {
        name: "blocktile_1d",
        source: BLOCKTILE_1D,
        func: "matmul_blocktile_1d",
        threads: 512,
        tile: (64, 64),
        config: "tile 64×64×8, 8×1 outputs/thread",
    },
    Simt {
        name: "blocktile_2d",
        source: BLOCKTILE_2D,
        func: "matmul_blocktile_2d",
        threads: 256,
        tile: (128, 128),
        config: "tile 128×128×8, 8×8 outputs/thread",
    },
    Simt {
        name: "vectorized",
        source: VECTORIZED,
        func: "matmul_vectorized",
        threads: 256,
        tile: (128, 128),
        config: "tile 128×128×8, 8×8 outputs/thread, float4 loads",
    },
    Simt {
        name: "warptile",
        source: WARPTILE,
        func: "matmul_warptile",
        threads: 256,
        tile: (128, 128),
        config: "tile 128×128×16, 8 warps of 32×64, 8×8 outputs/thread, register prefetch",
    },
];

/// Stages of the cp.async ring of `mma_pipelined` (`mma` has one).
const MMA_STAGES: u32 = 4;
/// Shared memory per stage of the mma kernels: A and B tiles of 128 rows × (64 + 16) bytes.
const MMA_STAGE_BYTES: u32 = 2 * 128 * 80;

/// Whether a CUDA variant runs on tensor cores: f32 inputs then run as tf32, and only when the
/// caller asks for `Precision::Tf32`.
pub fn tensor_core(variant: &str) -> bool {
    matches!(variant, "mma" | "mma_pipelined")
}

/// Device pointers of the three operands (first element of each view).
#[derive(Clone, Copy, Debug)]
pub struct Ptrs {
    pub a: u64,
    pub b: u64,
    pub c: u64,
}

fn naive_program(dtype: DType) -> Program {
    Program::new(NAIVE).define("FE_ELEM", dtype.cuda_name())
}

/// The mma kernel for `dtype` (f32 = tf32 inputs) with `stages` cp.async stages.
fn mma_program(dtype: DType, stages: u32) -> Program {
    let kind = match dtype {
        DType::BF16 => 1,
        DType::F32 => 2,
        _ => 0,
    };
    Program::new(MMA)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_MMA_KIND", kind)
        .define("FE_STAGES", stages)
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
        .map(|d| spec(naive_program(d), "matmul_naive"))
        .collect();
    v.extend(SIMT.iter().map(|r| spec(Program::new(r.source), r.func)));
    for stages in [1, MMA_STAGES] {
        for d in [DType::F16, DType::BF16, DType::F32] {
            v.push(spec(mma_program(d, stages), "matmul_mma"));
        }
    }
    v
}

/// The kernel, block shape, dynamic shared memory and C tile per block a variant launches with.
pub struct Launch {
    pub kernel: Kernel,
    pub block: (u32, u32, u32),
    pub smem: u32,
    /// Rows × columns of C one block computes (the grid covers n by x, m by y).
    pub tile: (u32, u32),
    pub config: String,
}

pub fn plan(variant: &str, g: &Gemm, dev: &Arc<CudaDevice>) -> Result<Launch> {
    let refuse = |why: &str| Error::NoVariant {
        op: OP.into(),
        msg: format!("CUDA variant `{variant}` {why}"),
    };
    if let Some(r) = SIMT.iter().find(|r| r.name == variant) {
        if g.dtype != DType::F32 {
            return Err(refuse("is f32 only"));
        }
        return Ok(Launch {
            kernel: dev.kernel(&Program::new(r.source), r.func)?,
            block: (r.threads, 1, 1),
            smem: 0,
            tile: r.tile,
            config: r.config.into(),
        });
    }
    match variant {
        "naive" => Ok(Launch {
            kernel: dev.kernel(&naive_program(g.dtype), "matmul_naive")?,
            block: (32, 8, 1),
            smem: 0,
            tile: (8, 32),
            config: "block 32×8, 1 output/thread".into(),
        }),
        "mma" | "mma_pipelined" => {
            let stages = if variant == "mma" { 1 } else { MMA_STAGES };
            let kernel = dev.kernel(&mma_program(g.dtype, stages), "matmul_mma")?;
            let smem = stages * MMA_STAGE_BYTES;
            if smem > 48 * 1024 {
                kernel.set_max_dynamic_smem(smem)?;
            }
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
                    "tile 128×128×{}, warps 2×4 of 64×32, {what}, {stages} cp.async stage{}",
                    64 / g.dtype.size_in_bytes(),
                    if stages > 1 { "s" } else { "" }
                ),
            })
        }
        _ => Err(refuse("does not exist")),
    }
}

/// Queues the planned kernel on `stream` for operands at `p`.
pub fn launch(l: &Launch, g: &Gemm, p: Ptrs, alpha: f32, beta: f32, stream: &Stream) -> Result<()> {
    // Kernels stride over row tiles and batches beyond the y/z limits.
    let grid = (
        (g.n as u32).div_ceil(l.tile.1),
        (g.m as u32).div_ceil(l.tile.0).clamp(1, 65535),
        (g.batch as u32).clamp(1, 65535),
    );
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
    l.kernel.launch(stream, grid, l.block, l.smem, &mut args)
}

pub(super) fn run(
    variant: &str,
    g: &Gemm,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    opts: &MatmulOptions,
) -> Result<()> {
    let Device::Cuda(i) = g.device else {
        unreachable!("cuda::run on a CPU problem")
    };
    let dev = device(i)?;
    let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    let p = Ptrs {
        a: a.device_ptr()?,
        b: b.device_ptr()?,
        c: c.device_ptr()?,
    };
    let l = plan(variant, g, &dev)?;
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
