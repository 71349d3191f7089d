//! CUDA host code of the int8-weight matmul: the rungs' programs, the split-K choice and the
//! launches.

use super::{Problem, W8a16Options, ACT, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, CudaDevice, Kernel, KernelArgs, Stream};
use crate::core::device::Arch;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("w8a16", "kernels/w8a16.cu");

/// Weight rows (output columns) per `mma` block: 8 warps × four n8 tiles.
pub const ROWS: usize = 32;
/// k per warp step of `mma`.
const KCHUNK: usize = 64;
/// Tiles of 8 rows of A one `mma` block covers: 1, 2 or 4 (more rows: groups of 32 in grid.z,
/// each reading the weight again; 8 tiles would take over 250 registers and spill).
fn a_tiles(m: usize) -> u32 {
    match m {
        0..=8 => 1,
        9..=16 => 2,
        _ => 4,
    }
}

pub fn program(dtype: DType, nt: u32) -> Program {
    Program::new(SRC)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_NT", nt)
}

/// Every module the family compiles: each activation dtype with 1, 2 and 4 tiles of A.
pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for &d in ACT {
        for nt in [1, 2, 4] {
            v.push(KernelSpec {
                program: program(d, nt),
                functions: vec![
                    "w8a16_naive".into(),
                    "w8a16_mma".into(),
                    "w8a16_reduce".into(),
                ],
                min_arch: Arch::SM80,
            });
        }
    }
    v
}

/// Split-K factor of `mma` for `p` on `sms` SMs: enough blocks for about three per SM where
/// the weight's rows alone give fewer (each split keeps at least one 64-deep chunk per warp,
/// 8 per block), at most 16; 1 otherwise.
pub fn splits_for(p: &Problem, sms: u32) -> u32 {
    let blocks = p.n.div_ceil(ROWS) * p.m.div_ceil(8 * a_tiles(p.m) as usize);
    let target = 3 * sms.max(1) as usize;
    if blocks == 0 || blocks >= target {
        return 1;
    }
    let chunks = p.k.div_ceil(KCHUNK);
    let most = (chunks / 8).clamp(1, 16);
    let s = target.div_ceil(blocks).min(most);
    // Split z starts at z·⌈chunks/s⌉: as many splits as that needs, so none is empty.
    chunks.div_ceil(chunks.div_ceil(s.max(1))).max(1) as u32
}

/// Device pointers of one call: D, A, W, the scales, the bias (0: none).
#[derive(Clone, Copy, Debug)]
pub struct Ptrs {
    pub d: u64,
    pub a: u64,
    pub w: u64,
    pub scale: u64,
    pub bias: u64,
}

impl Ptrs {
    pub fn of(
        a: &Tensor,
        w: &Tensor,
        scale: &Tensor,
        bias: Option<&Tensor>,
        out: &Tensor,
    ) -> Result<Ptrs> {
        Ok(Ptrs {
            d: out.device_ptr()?,
            a: a.device_ptr()?,
            w: w.device_ptr()?,
            scale: scale.device_ptr()?,
            bias: match bias {
                Some(t) => t.device_ptr()?,
                None => 0,
            },
        })
    }
}

/// A planned launch: the variant's kernel, and for `mma` its split count and reduce pass.
#[derive(Clone)]
pub struct Launch {
    pub kernel: Kernel,
    pub reduce: Option<Kernel>,
    pub splits: u32,
    /// Tiles of 8 rows of A per block.
    pub nt: u32,
    /// The `naive` kernel (else `mma`).
    pub naive: bool,
    /// What the bench's config column shows.
    pub config: String,
}

/// The kernels of `variant` for `p` (compiled at first use, then cached by the device).
pub fn plan(variant: &str, p: &Problem, dev: &Arc<CudaDevice>) -> Result<Launch> {
    match variant {
        "naive" => Ok(Launch {
            kernel: dev.kernel(&program(p.dtype, 1), "w8a16_naive")?,
            reduce: None,
            splits: 1,
            nt: 1,
            naive: true,
            config: "16×16 outputs per block".into(),
        }),
        "mma" => {
            let nt = a_tiles(p.m);
            let prog = program(p.dtype, nt);
            let splits = splits_for(p, dev.props().sm_count);
            Ok(Launch {
                kernel: dev.kernel(&prog, "w8a16_mma")?,
                reduce: (splits > 1)
                    .then(|| dev.kernel(&prog, "w8a16_reduce"))
                    .transpose()?,
                splits,
                nt,
                naive: false,
                config: format!(
                    "{ROWS} weight rows × {} rows of A per block{}",
                    8 * nt,
                    if splits > 1 {
                        format!(", split-K {splits}")
                    } else {
                        String::new()
                    }
                ),
            })
        }
        _ => Err(Error::NoVariant {
            op: OP.into(),
            msg: format!("no CUDA variant named `{variant}`"),
        }),
    }
}

/// Queues the planned kernels on `p` with operands at `q`.
pub fn launch(
    l: &Launch,
    p: &Problem,
    q: Ptrs,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
) -> Result<()> {
    if p.m == 0 || p.n == 0 {
        return Ok(());
    }
    let (m, n, k) = (p.m as i64, p.n as i64, p.k as i64);
    if l.naive {
        let mut args = KernelArgs::new();
        args.push(q.d)
            .push(q.a)
            .push(q.w)
            .push(q.scale)
            .push(q.bias)
            .push(m)
            .push(n)
            .push(k)
            .push(p.lda as i64)
            .push(p.ldw as i64)
            .push(p.ldd as i64);
        let grid = (
            (p.n as u64).div_ceil(16).min(u32::MAX as u64) as u32,
            (p.m as u64).div_ceil(16).clamp(1, 65535) as u32,
            1,
        );
        return l.kernel.launch(stream, grid, (256, 1, 1), 0, &mut args);
    }
    if let Some(why) = super::mma_declines(p, &[q.a, q.w]) {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: format!("CUDA variant `mma` {why}"),
        });
    }
    let m_groups = p.m.div_ceil(8 * l.nt as usize);
    if m_groups > 65535 {
        return Err(Error::bad_arg(
            OP,
            "a",
            format!("at most {} rows for `mma`", 65535 * 8 * l.nt as usize),
            p.m,
        ));
    }
    // Split-K's fp32 partials (stream-ordered: freed after the reduce pass is queued).
    let part = if l.splits > 1 {
        Some(dev.alloc(l.splits as usize * p.m * p.n * 4, stream)?)
    } else {
        None
    };
    let mut args = KernelArgs::new();
    args.push(q.d)
        .push(part.as_ref().map_or(0, |b| b.ptr()))
        .push(q.a)
        .push(q.w)
        .push(q.scale)
        .push(q.bias)
        .push(m)
        .push(n)
        .push(k)
        .push(p.lda as i64)
        .push(p.ldw as i64)
        .push(p.ldd as i64)
        .push(l.splits as i32);
    let grid = (p.n.div_ceil(ROWS) as u32, l.splits, m_groups as u32);
    l.kernel.launch(stream, grid, (256, 1, 1), 0, &mut args)?;
    if let (Some(r), Some(part)) = (&l.reduce, &part) {
        let mut args = KernelArgs::new();
        args.push(q.d)
            .push(part.ptr())
            .push(q.scale)
            .push(q.bias)
            .push(m)
            .push(n)
            .push(p.ldd as i64)
            .push(l.splits as i32);
        let blocks = (p.m * p.n).div_ceil(256) as u32;
        r.launch(stream, (blocks, 1, 1), (256, 1, 1), 0, &mut args)?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn run(
    variant: &str,
    p: &Problem,
    a: &Tensor,
    w: &Tensor,
    scale: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
    opts: &W8a16Options,
) -> Result<()> {
    let crate::core::device::Device::Cuda(i) = p.device else {
        unreachable!("w8a16 cuda path on {}", p.device)
    };
    let dev = device(i)?;
    let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    let l = plan(variant, p, &dev)?;
    launch(&l, p, Ptrs::of(a, w, scale, bias, out)?, &dev, &stream)
}
