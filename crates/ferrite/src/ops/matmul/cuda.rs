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

/// Every module and specialisation this family compiles (for `ferrite kernels`).
pub fn kernel_specs() -> Vec<KernelSpec> {
    [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .map(|d| KernelSpec {
            program: naive_program(d),
            functions: vec!["matmul_naive".into()],
            min_arch: Arch::SM80,
        })
        .collect()
}

/// The kernel, block shape and dynamic shared memory a variant launches with.
pub struct Launch {
    pub kernel: Kernel,
    pub block: (u32, u32, u32),
    pub smem: u32,
    pub config: String,
}

pub fn plan(variant: &str, g: &Gemm, dev: &Arc<CudaDevice>) -> Result<Launch> {
    match variant {
        "naive" => Ok(Launch {
            kernel: dev.kernel(&naive_program(g.dtype), "matmul_naive")?,
            block: (32, 8, 1),
            smem: 0,
            config: "block 32×8, 1 output/thread".into(),
        }),
        other => Err(Error::NoVariant {
            op: OP.into(),
            msg: format!("no CUDA variant named `{other}`"),
        }),
    }
}

/// Queues the planned kernel on `stream` for operands at `p`.
pub fn launch(l: &Launch, g: &Gemm, p: Ptrs, alpha: f32, beta: f32, stream: &Stream) -> Result<()> {
    let grid = (
        (g.n as u32).div_ceil(l.block.0),
        ((g.m as u32).div_ceil(l.block.1)).clamp(1, 65535),
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
