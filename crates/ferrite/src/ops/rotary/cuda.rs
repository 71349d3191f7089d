//! CUDA host code of the rotary family.

use super::{Problem, RotaryOptions, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, Kernel, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;

const SRC: KernelSource = kernel_source!("rotary", "kernels/rotary.cu");
const FUNCS: [&str; 2] = ["rotary_naive", "rotary_vec"];
const THREADS: u32 = 256;

pub fn program(dtype: DType) -> Program {
    Program::new(SRC).define("FE_ELEM", dtype.cuda_name())
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .map(|d| KernelSpec {
            program: program(d),
            functions: FUNCS.iter().map(|s| s.to_string()).collect(),
            min_arch: Arch::SM80,
        })
        .collect()
}

/// A planned launch: the kernel and its grid.
pub struct Launch {
    pub kernel: Kernel,
    pub blocks: u32,
}

/// Work items of one launch (threads' loop trip over all of them).
fn work(variant: &str, p: &Problem, interleaved: bool) -> usize {
    let tail = if p.in_place { 0 } else { p.dim - 2 * p.half };
    let per_head = if variant == "vectorized" {
        let vec = 16 / p.dtype.size_in_bytes();
        (if interleaved { 2 * p.half } else { p.half }) / vec + tail / vec
    } else {
        p.half + tail
    };
    p.tokens * p.heads * per_head
}

pub fn plan(variant: &str, p: &Problem, interleaved: bool) -> Result<Launch> {
    let Device::Cuda(i) = p.device else {
        unreachable!("rotary cuda path on {}", p.device)
    };
    let f = match variant {
        "naive" => "rotary_naive",
        "vectorized" => "rotary_vec",
        other => {
            return Err(Error::NoVariant {
                op: OP.into(),
                msg: format!("no CUDA variant named `{other}`"),
            })
        }
    };
    let dev = device(i)?;
    // A grid-stride loop: enough blocks to fill the device several times over, no more.
    let cap = dev.props().sm_count.max(1) as usize * 16;
    let blocks = work(variant, p, interleaved)
        .div_ceil(THREADS as usize)
        .clamp(1, cap);
    Ok(Launch {
        kernel: dev.kernel(&program(p.dtype), f)?,
        blocks: blocks as u32,
    })
}

/// `ptrs` = [out, x, cos, sin, offsets or 0, cu_seqlens or 0].
pub fn launch(
    l: &Launch,
    p: &Problem,
    o: &RotaryOptions,
    ptrs: [u64; 6],
    stream: &Stream,
) -> Result<()> {
    let mut a = KernelArgs::new();
    for q in ptrs {
        a.push(q);
    }
    a.push(p.tokens as i64)
        .push(p.batch as i64)
        .push(p.seqlen as i64)
        .push(p.heads as i64)
        .push(p.dim as i64)
        .push(p.half as i64)
        .push(p.ro_len as i64)
        .push(o.offset as i64);
    for s in p.xs.iter().chain(&p.os) {
        a.push(*s as i64);
    }
    a.push(o.interleaved as i32)
        .push(if o.conjugate { -1.0f32 } else { 1.0 })
        .push(!p.in_place as i32);
    l.kernel
        .launch(stream, (l.blocks, 1, 1), (THREADS, 1, 1), 0, &mut a)
}

pub(super) fn rotary(
    variant: &str,
    p: &Problem,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    out: &Tensor,
    o: &RotaryOptions,
) -> Result<()> {
    let dev = x.cuda_device()?;
    let stream = o.stream.clone().unwrap_or_else(|| dev.stream().clone());
    let opt_ptr = |t: &Option<Tensor>| t.as_ref().map_or(Ok(0), |t| t.device_ptr());
    let ptrs = [
        out.device_ptr()?,
        x.device_ptr()?,
        cos.device_ptr()?,
        sin.device_ptr()?,
        opt_ptr(&o.offsets)?,
        opt_ptr(&o.cu_seqlens)?,
    ];
    let l = plan(variant, p, o.interleaved)?;
    launch(&l, p, o, ptrs, &stream)
}
