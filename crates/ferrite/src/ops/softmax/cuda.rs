//! CUDA host code of the softmax family.

use super::{Problem, SoftmaxOptions, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, rows, CudaDevice, Kernel, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("softmax", "kernels/softmax.cu");
const FUNCS: [&str; 4] = [
    "softmax_fwd_naive",
    "softmax_fwd_vec",
    "softmax_bwd_naive",
    "softmax_bwd_vec",
];

pub fn program(dtype: DType, chunks: usize) -> Program {
    Program::new(SRC)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_CHUNKS", chunks)
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for d in [DType::F32, DType::F16, DType::BF16] {
        for chunks in [1, 2, rows::MAX_CHUNKS] {
            v.push(KernelSpec {
                program: program(d, chunks),
                functions: FUNCS.iter().map(|s| s.to_string()).collect(),
                min_arch: Arch::SM80,
            });
        }
    }
    v
}

pub struct Launch {
    pub kernel: Kernel,
    pub threads: u32,
    pub config: String,
}

fn kernel_for(
    p: &Problem,
    backward: bool,
    vectorized: bool,
    chunks: usize,
    dev: &Arc<CudaDevice>,
) -> Result<Launch> {
    let f = match (vectorized, backward) {
        (false, false) => "softmax_fwd_naive",
        (false, true) => "softmax_bwd_naive",
        (true, false) => "softmax_fwd_vec",
        (true, true) => "softmax_bwd_vec",
    };
    let threads = if vectorized {
        rows::threads_for(p.cols, p.dtype, chunks)
    } else {
        rows::threads_scalar(p.cols)
    };
    let config = if vectorized {
        format!("chunks={chunks} ({threads} threads/row), tuned")
    } else {
        format!("{threads} threads/row")
    };
    Ok(Launch {
        kernel: dev.kernel(&program(p.dtype, chunks), f)?,
        threads,
        config,
    })
}

/// The kernel of `variant` for the forward (`backward == false`) or backward pass; the
/// vectorized one is tuned on these buffers (`ptrs`, as for `launch`) at first use.
pub fn plan(
    variant: &str,
    p: &Problem,
    backward: bool,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    ptrs: &[u64],
    scale: f32,
) -> Result<Launch> {
    match variant {
        "naive" => kernel_for(p, backward, false, 1, dev),
        "vectorized" => {
            let key = if backward {
                "softmax_bwd"
            } else {
                "softmax_fwd"
            };
            let c = rows::tuned(dev, key, p.rows, p.cols, p.dtype, &[0], |c| {
                let l = kernel_for(p, backward, true, c.chunks, dev)?;
                rows::time_briefly(dev, stream, || launch(&l, p, ptrs, scale, stream))
            })?;
            kernel_for(p, backward, true, c.chunks, dev)
        }
        other => Err(Error::NoVariant {
            op: OP.into(),
            msg: format!("no CUDA variant named `{other}`"),
        }),
    }
}

/// Forward: `ptrs` = [y, x]; backward: [dx, dy, y].
pub fn launch(l: &Launch, p: &Problem, ptrs: &[u64], scale: f32, stream: &Stream) -> Result<()> {
    let mut a = KernelArgs::new();
    for &q in ptrs {
        a.push(q);
    }
    a.push(p.rows as i64).push(p.cols as i64).push(scale);
    l.kernel.launch(
        stream,
        (rows::grid(p.rows), 1, 1),
        (l.threads, 1, 1),
        0,
        &mut a,
    )
}

fn ctx(p: &Problem, opts: &SoftmaxOptions) -> Result<(Arc<CudaDevice>, Stream)> {
    let Device::Cuda(i) = p.device else {
        unreachable!("softmax cuda path on {}", p.device)
    };
    let dev = device(i)?;
    let s = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    Ok((dev, s))
}

pub(super) fn forward(
    variant: &str,
    p: &Problem,
    x: &Tensor,
    y: &Tensor,
    opts: &SoftmaxOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, opts)?;
    let ptrs = [y.device_ptr()?, x.device_ptr()?];
    let l = plan(variant, p, false, &dev, &stream, &ptrs, opts.scale)?;
    launch(&l, p, &ptrs, opts.scale, &stream)
}

pub(super) fn backward(
    variant: &str,
    p: &Problem,
    dy: &Tensor,
    y: &Tensor,
    dx: &Tensor,
    opts: &SoftmaxOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, opts)?;
    let ptrs = [dx.device_ptr()?, dy.device_ptr()?, y.device_ptr()?];
    let l = plan(variant, p, true, &dev, &stream, &ptrs, opts.scale)?;
    launch(&l, p, &ptrs, opts.scale, &stream)
}
