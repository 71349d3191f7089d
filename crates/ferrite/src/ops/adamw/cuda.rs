//! CUDA host code of the AdamW family: per-tensor launches (`naive`) and the multi-tensor plan
//! (`multi_tensor`: the tensor table and block map uploaded once, then one launch per step).

use super::{AdamWHyper, AdamWOptions, AdamWTensor, Hyper, Problem, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, CudaDevice, DeviceBuffer, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("adamw", "kernels/adamw.cu");
/// Elements per block of `adamw_multi` (FE_CHUNK in the kernel).
pub const CHUNK: usize = 16384;
const MULTI_THREADS: u32 = 256;
const NAIVE_THREADS: u32 = 256;

pub fn program(param: DType, grad: DType) -> Program {
    Program::new(SRC)
        .define("FE_PARAM", param.cuda_name())
        .define("FE_GRAD", grad.cuda_name())
        .define("FE_MASTER", (param == DType::BF16) as i32)
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    [
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::BF16, DType::F32),
    ]
    .into_iter()
    .map(|(p, g)| KernelSpec {
        program: program(p, g),
        functions: vec!["adamw_naive".into(), "adamw_multi".into()],
        min_arch: Arch::SM80,
    })
    .collect()
}

fn ctx(device_: Device, stream: Option<&Stream>) -> Result<(Arc<CudaDevice>, Stream)> {
    let Device::Cuda(i) = device_ else {
        return Err(Error::bad_arg(OP, "tensors", "CUDA tensors", device_));
    };
    let dev = device(i)?;
    let s = stream.cloned().unwrap_or_else(|| dev.stream().clone());
    Ok((dev, s))
}

fn ptrs(t: &AdamWTensor) -> Result<[u64; 5]> {
    Ok([
        t.param.device_ptr()?,
        t.grad.device_ptr()?,
        t.exp_avg.device_ptr()?,
        t.exp_avg_sq.device_ptr()?,
        t.master.map_or(Ok(0), |m| m.device_ptr())?,
    ])
}

/// `naive`: one launch per tensor.
pub fn launch_naive(
    p: &Problem,
    ts: &[AdamWTensor],
    h: &Hyper,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
) -> Result<()> {
    let k = dev.kernel(&program(p.param, p.grad), "adamw_naive")?;
    for t in ts {
        let n = t.param.numel();
        if n == 0 {
            continue;
        }
        let [pp, g, m, v, w] = ptrs(t)?;
        let blocks = n.div_ceil(NAIVE_THREADS as usize).min(1 << 20) as u32;
        let mut a = KernelArgs::new();
        a.push(pp)
            .push(g)
            .push(m)
            .push(v)
            .push(w)
            .push(n as i64)
            .push(*h);
        k.launch(stream, (blocks, 1, 1), (NAIVE_THREADS, 1, 1), 0, &mut a)?;
    }
    Ok(())
}

/// A tensor list ready for `multi_tensor` steps: its table and block map live on the device, so
/// a step is one launch with no host→device traffic and no synchronisation (graph-capturable).
/// Holds the tensors (their storage stays alive while the plan does).
pub struct AdamWPlan {
    problem: Problem,
    dev: Arc<CudaDevice>,
    table: DeviceBuffer,
    blocks: DeviceBuffer,
    nblocks: usize,
    _keep: Vec<Tensor>,
}

impl AdamWPlan {
    /// Validates the list and uploads its table (one copy and a synchronisation of `stream`).
    pub fn new(ts: &[AdamWTensor], stream: Option<&Stream>) -> Result<Self> {
        let p = super::validate(ts)?;
        let (dev, s) = ctx(p.device, stream)?;
        let mut table: Vec<u64> = Vec::with_capacity(6 * ts.len());
        let mut map: Vec<u32> = Vec::new();
        for (i, t) in ts.iter().enumerate() {
            let n = t.param.numel();
            table.extend(ptrs(t)?);
            table.push(n as u64);
            let chunks = n.div_ceil(CHUNK);
            if chunks > u32::MAX as usize || i > u32::MAX as usize {
                return Err(Error::Overflow {
                    op: OP.into(),
                    what: format!("tensors[{i}] has {n} elements ({chunks} chunks)"),
                });
            }
            for c in 0..chunks {
                map.extend([i as u32, c as u32]);
            }
        }
        let nblocks = map.len() / 2;
        if nblocks > i32::MAX as usize {
            return Err(Error::Overflow {
                op: OP.into(),
                what: format!("{nblocks} blocks"),
            });
        }
        let tb: &[u8] = bytemuck::cast_slice(&table);
        let mb: &[u8] = bytemuck::cast_slice(&map);
        let dt = dev.alloc(tb.len(), &s)?;
        let dm = dev.alloc(mb.len().max(8), &s)?;
        // SAFETY: each buffer holds its slice's bytes; the slices live past the synchronize.
        unsafe {
            dev.htod(dt.ptr(), tb, &s)?;
            dev.htod(dm.ptr(), mb, &s)?;
        }
        dev.synchronize(&s, "adamw table upload")?;
        let mut keep = Vec::new();
        for t in ts {
            keep.extend([t.param, t.grad, t.exp_avg, t.exp_avg_sq].map(Tensor::clone));
            keep.extend(t.master.cloned());
        }
        Ok(AdamWPlan {
            problem: p,
            dev,
            table: dt,
            blocks: dm,
            nblocks,
            _keep: keep,
        })
    }

    /// The list's dtypes, device and sizes.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    /// One step: a single launch over every tensor of the list.
    pub fn step(&self, hp: &AdamWHyper, stream: Option<&Stream>) -> Result<()> {
        let h = hp.validate()?;
        self.launch(&h, stream)
    }

    fn launch(&self, h: &Hyper, stream: Option<&Stream>) -> Result<()> {
        if self.nblocks == 0 {
            return Ok(());
        }
        let s = stream.cloned().unwrap_or_else(|| self.dev.stream().clone());
        let p = &self.problem;
        let k = self.dev.kernel(&program(p.param, p.grad), "adamw_multi")?;
        let mut a = KernelArgs::new();
        a.push(self.table.ptr()).push(self.blocks.ptr()).push(*h);
        k.launch(
            &s,
            (self.nblocks as u32, 1, 1),
            (MULTI_THREADS, 1, 1),
            0,
            &mut a,
        )
    }

    /// The kernel and block size a step launches (bench reports).
    pub fn kernel(&self) -> Result<(crate::core::cuda::Kernel, u32)> {
        let p = &self.problem;
        Ok((
            self.dev.kernel(&program(p.param, p.grad), "adamw_multi")?,
            MULTI_THREADS,
        ))
    }
}

pub(super) fn step(
    variant: &str,
    p: &Problem,
    ts: &[AdamWTensor],
    h: &Hyper,
    opts: &AdamWOptions,
) -> Result<()> {
    let (dev, s) = ctx(p.device, opts.stream.as_ref())?;
    match variant {
        "naive" => launch_naive(p, ts, h, &dev, &s),
        "multi_tensor" => AdamWPlan::new(ts, Some(&s))?.launch(h, Some(&s)),
        other => Err(Error::NoVariant {
            op: OP.into(),
            msg: format!("no CUDA variant named `{other}`"),
        }),
    }
}
