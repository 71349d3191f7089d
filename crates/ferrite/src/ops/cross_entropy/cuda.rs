//! CUDA host code of the cross-entropy family: the target check kernel, the row kernels of the
//! variant, the scalar reduction, then (unless disabled) the read-back of the bad-target flag.

use super::{bad_target, CrossEntropyOptions, GradOut, Problem, Reduction, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, rows, CudaDevice, DeviceBuffer, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("cross_entropy", "kernels/cross_entropy.cu");
/// The functions of `program` (`ce_cluster` is in `cluster_program`'s modules only).
const FUNCS: [&str; 8] = [
    "ce_targets",
    "ce_naive_logsoftmax",
    "ce_naive_loss",
    "ce_naive_grad",
    "ce_fused",
    "ce_resident",
    "ce_reduce",
    "ce_scale_grad",
];

/// Bytes of the device status block (`struct Status` in the kernel).
pub const STATUS_BYTES: usize = 24;

pub fn program(dtype: DType, target: DType) -> Program {
    Program::new(SRC)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_TGT", target.cuda_name())
}

/// `ce_cluster` for clusters of `c` blocks (sm_90).
pub fn cluster_program(dtype: DType, target: DType, c: usize) -> Program {
    program(dtype, target).define("FE_CLUSTER", c)
}

/// Cluster sizes `cluster` is compiled for.
pub const CLUSTERS: [usize; 3] = [2, 4, 8];

pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for d in [DType::F32, DType::F16, DType::BF16] {
        for t in [DType::I64, DType::I32] {
            v.push(KernelSpec {
                program: program(d, t),
                functions: FUNCS.iter().map(|s| s.to_string()).collect(),
                min_arch: Arch::SM80,
            });
            for c in CLUSTERS {
                v.push(KernelSpec {
                    program: cluster_program(d, t, c),
                    functions: vec!["ce_cluster".into()],
                    min_arch: Arch::SM90,
                });
            }
        }
    }
    v
}

/// Device addresses of one call; `grad` and `loss` are 0 when not wanted.
#[derive(Clone, Copy, Debug)]
pub struct Ptrs {
    pub logits: u64,
    pub targets: u64,
    pub grad: u64,
    pub loss_rows: u64,
    pub loss: u64,
}

/// Threads per block of the fused row kernel: about four 16-byte vectors per thread per pass, at
/// most 512 so several rows' blocks share an SM (one row's reductions overlap another's loads) —
/// except for rows over 64 KiB, which get 1024 threads: fewer rows in flight (2 per SM), so
/// the rows being worked on (132 SMs × 2 × 100 KB at V = 50257 bf16 ≈ 26 MB) fit the H100's
/// 50 MB L2 and the second read of each row hits it instead of DRAM.
pub fn fused_threads(p: &Problem) -> u32 {
    if p.vocab * p.dtype.size_in_bytes() > 64 << 10 {
        return 1024;
    }
    let vecs = p.vocab.div_ceil(rows::vec_width(p.dtype));
    (vecs.div_ceil(4).div_ceil(32) * 32).clamp(32, 512) as u32
}

/// Launch shape of `resident`: fused's threads, and the row vectors each block keeps in shared
/// memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResidentGeom {
    pub threads: u32,
    /// Blocks per SM the shared memory was sized for.
    pub blocks_per_sm: usize,
    /// 16-byte vectors of a row kept on chip (the rest is read twice, from L2).
    pub cap: usize,
    /// Dynamic shared memory per block, bytes (cap × 16).
    pub smem: u32,
}

impl ResidentGeom {
    pub fn describe(&self, p: &Problem) -> String {
        let row = p.vocab * p.dtype.size_in_bytes();
        format!(
            "{} threads/row, {}/SM, {} KiB of the {} KiB row in shared memory",
            self.threads,
            self.blocks_per_sm,
            self.smem / 1024,
            row.div_ceil(1024)
        )
    }
}

/// The most blocks per SM (as the threads allow) whose shared memory still holds a whole row;
/// when even one block cannot, one block per SM keeping as much of the row as fits (at
/// V = 128256 bf16: 227 of 251 KiB on an H100; the remainder, ~3 MB over all SMs, is re-read
/// from L2).
pub fn resident_geom(dev: &CudaDevice, p: &Problem) -> ResidentGeom {
    let threads = fused_threads(p);
    let props = dev.props();
    let (blocks_per_sm, cap) = resident_shape(
        threads,
        props.max_threads_per_sm,
        props.smem_per_sm as usize,
        props.smem_per_block_optin as usize,
        p.vocab / rows::vec_width(p.dtype),
    );
    ResidentGeom {
        threads,
        blocks_per_sm,
        cap,
        smem: (cap * 16) as u32,
    }
}

/// Launch shape of `cluster`: a row split over `cluster` blocks, each keeping `per` vectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClusterGeom {
    pub cluster: usize,
    pub threads: u32,
    /// Blocks per SM (shares of that many rows on chip at once).
    pub blocks_per_sm: usize,
    /// 16-byte vectors of a row per block.
    pub per: usize,
    /// Dynamic shared memory per block, bytes (per × 16).
    pub smem: u32,
}

impl ClusterGeom {
    pub fn describe(&self, p: &Problem) -> String {
        format!(
            "clusters of {} per row, {} threads/block, {}/SM, {} KiB of the {} KiB row per block",
            self.cluster,
            self.threads,
            self.blocks_per_sm,
            self.smem.div_ceil(1024),
            (p.vocab * p.dtype.size_in_bytes()).div_ceil(1024)
        )
    }
}

/// `ce_cluster`'s `__launch_bounds__(640, 2)`: at most 640 threads per block, and registers
/// (≤ 48) for two such blocks — 1280 threads — per SM; the shape plans within both.
pub const CLUSTER_BLOCK_THREADS: usize = 640;
pub const CLUSTER_SM_THREADS: u32 = 1280;

/// The shape of `ce_cluster` with clusters of `c` for rows of `full` 16-byte vectors on an SM with
/// `smem_per_sm` bytes of shared memory (`smem_optin` per block) and `max_threads_per_sm`
/// threads; None when a block's share does not fit. About four vectors per thread, as many
/// blocks per SM as the shared memory holds (threads shrink to let them all in).
pub fn cluster_shape(
    c: usize,
    max_threads_per_sm: u32,
    smem_per_sm: usize,
    smem_optin: usize,
    full: usize,
) -> Option<ClusterGeom> {
    // Per block: the kernel's static ~300 bytes and the 1 KiB the driver reserves.
    let (stat, reserve) = (512, 512 + 1024);
    let per = full.div_ceil(c).max(1);
    let bytes = per * 16;
    if bytes + stat > smem_optin {
        return None;
    }
    let by_smem = (smem_per_sm / (bytes + reserve)).clamp(1, 32);
    let want = (per.div_ceil(4).div_ceil(32) * 32).clamp(64, CLUSTER_BLOCK_THREADS);
    let room = (max_threads_per_sm as usize / by_smem) / 32 * 32;
    let threads = want.min(room).max(64);
    let blocks = by_smem.min(max_threads_per_sm as usize / threads).max(1);
    Some(ClusterGeom {
        cluster: c,
        threads: threads as u32,
        blocks_per_sm: blocks,
        per,
        smem: bytes as u32,
    })
}

/// The cluster size `cluster` runs: the smallest whose blocks fit three or more to an SM, else
/// the one fitting the most. Measured (H100, V = 128256 bf16, one cluster per row): clusters of
/// 2 (one 640-thread block per SM) 58.9% of copy, of 4 (three per SM) 78.8%, of 8 (six) 78.4%;
/// V = 50257: 81.5 / 80.0 / 51.8% (eight 64-thread blocks move too few bytes at once).
pub fn cluster_geom(dev: &CudaDevice, p: &Problem, force: Option<usize>) -> Result<ClusterGeom> {
    let props = dev.props();
    let full = p.vocab / rows::vec_width(p.dtype);
    let shape = |c| {
        cluster_shape(
            c,
            props.max_threads_per_sm.min(CLUSTER_SM_THREADS),
            props.smem_per_sm as usize,
            props.smem_per_block_optin as usize,
            full,
        )
    };
    if let Some(c) = force {
        return shape(c).ok_or_else(|| Error::NoVariant {
            op: OP.into(),
            msg: format!("CUDA variant `cluster`: a row's share for clusters of {c} does not fit shared memory"),
        });
    }
    pick_cluster(CLUSTERS.iter().filter_map(|&c| shape(c)))
}

/// The rule of `cluster_geom` over the shapes that fit.
pub fn pick_cluster(shapes: impl Iterator<Item = ClusterGeom>) -> Result<ClusterGeom> {
    let all: Vec<ClusterGeom> = shapes.collect();
    all.iter()
        .find(|g| g.blocks_per_sm >= 3)
        .or_else(|| {
            all.iter()
                .max_by_key(|g| (g.blocks_per_sm, usize::MAX - g.cluster))
        })
        .copied()
        .ok_or_else(|| Error::NoVariant {
            op: OP.into(),
            msg: "CUDA variant `cluster`: no cluster size fits a row's share in shared memory"
                .into(),
        })
}

/// (blocks per SM, vectors kept) for blocks of `threads` on an SM with `smem_per_sm` bytes of
/// shared memory (`smem_optin` at most per block) and rows of `full` 16-byte vectors.
pub fn resident_shape(
    threads: u32,
    max_threads_per_sm: u32,
    smem_per_sm: usize,
    smem_optin: usize,
    full: usize,
) -> (usize, usize) {
    // Per block: the kernel's static 256 bytes and the 1 KiB the driver reserves.
    let reserve = 256 + 1024;
    let per_block_max = smem_optin.saturating_sub(256);
    let fit =
        |blocks: usize| ((smem_per_sm / blocks).saturating_sub(reserve)).min(per_block_max) / 16;
    let most = (max_threads_per_sm / threads.max(1)).max(1) as usize;
    let blocks = (1..=most).rev().find(|&b| fit(b) >= full).unwrap_or(1);
    (blocks, full.min(fit(blocks)))
}

/// Scratch a call needs on the device: the status block and, for `naive`, the N×V f32 log-probs.
pub struct Scratch {
    pub status: DeviceBuffer,
    pub logp: Option<DeviceBuffer>,
}

impl Scratch {
    pub fn new(variant: &str, p: &Problem, dev: &Arc<CudaDevice>, s: &Stream) -> Result<Self> {
        let logp = if variant == "naive" {
            let bytes = p
                .rows
                .checked_mul(p.vocab)
                .and_then(|e| e.checked_mul(4))
                .ok_or_else(|| Error::Overflow {
                    op: OP.into(),
                    what: format!("{}×{} f32 intermediate", p.rows, p.vocab),
                })?;
            Some(dev.alloc(bytes, s)?)
        } else {
            None
        };
        Ok(Scratch {
            status: dev.alloc(STATUS_BYTES, s)?,
            logp,
        })
    }
}

/// Queues every kernel of `variant` on `stream` (no synchronisation).
pub fn launch(
    variant: &str,
    p: &Problem,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    ptrs: Ptrs,
    scratch: &Scratch,
    opts: &CrossEntropyOptions,
) -> Result<()> {
    let prog = program(p.dtype, p.target_dtype);
    let (n, v, ld) = (p.rows as i64, p.vocab as i64, p.ld as i64);
    let mean = (opts.reduction == Reduction::Mean) as i32;
    let status = scratch.status.ptr();
    let grid = (rows::grid(p.rows), 1, 1);

    let k = dev.kernel(&prog, "ce_targets")?;
    let mut a = KernelArgs::new();
    a.push(status)
        .push(ptrs.targets)
        .push(n)
        .push(v)
        .push(opts.ignore_index);
    k.launch(stream, (1, 1, 1), (1024, 1, 1), 0, &mut a)?;

    // `ce_fused`'s parameters, which `ce_resident` takes too (then its resident cap).
    let fused_args = || {
        let mut a = KernelArgs::new();
        a.push(ptrs.grad)
            .push(ptrs.loss_rows)
            .push(ptrs.logits)
            .push(ptrs.targets)
            .push(status)
            .push(n)
            .push(v)
            .push(ld)
            .push(opts.ignore_index)
            .push(opts.label_smoothing)
            .push(opts.dloss)
            .push(mean);
        a
    };
    match variant {
        "naive" => {
            let logp = scratch
                .logp
                .as_ref()
                .expect("naive scratch has the intermediate")
                .ptr();
            let threads = rows::threads_scalar(p.vocab);
            let k = dev.kernel(&prog, "ce_naive_logsoftmax")?;
            let mut a = KernelArgs::new();
            a.push(logp).push(ptrs.logits).push(n).push(v).push(ld);
            k.launch(stream, grid, (threads, 1, 1), 0, &mut a)?;

            let k = dev.kernel(&prog, "ce_naive_loss")?;
            let mut a = KernelArgs::new();
            a.push(ptrs.loss_rows)
                .push(logp)
                .push(ptrs.targets)
                .push(n)
                .push(v)
                .push(opts.ignore_index)
                .push(opts.label_smoothing);
            k.launch(stream, grid, (threads, 1, 1), 0, &mut a)?;

            if ptrs.grad != 0 {
                let k = dev.kernel(&prog, "ce_naive_grad")?;
                let mut a = KernelArgs::new();
                a.push(ptrs.grad)
                    .push(logp)
                    .push(ptrs.targets)
                    .push(status)
                    .push(n)
                    .push(v)
                    .push(ld)
                    .push(opts.ignore_index)
                    .push(opts.label_smoothing)
                    .push(opts.dloss)
                    .push(mean);
                k.launch(stream, grid, (threads, 1, 1), 0, &mut a)?;
            }
        }
        "fused" => {
            let k = dev.kernel(&prog, "ce_fused")?;
            let mut a = fused_args();
            k.launch(stream, grid, (fused_threads(p), 1, 1), 0, &mut a)?;
        }
        "resident" => {
            let g = resident_geom(dev, p);
            let k = dev.kernel(&prog, "ce_resident")?;
            k.allow_dynamic_smem(g.smem)?;
            let mut a = fused_args();
            a.push(g.cap as i64);
            k.launch(stream, grid, (g.threads, 1, 1), g.smem, &mut a)?;
        }
        "cluster" => {
            let g = cluster_geom(dev, p, opts.cluster)?;
            let k = dev.kernel(
                &cluster_program(p.dtype, p.target_dtype, g.cluster),
                "ce_cluster",
            )?;
            k.allow_dynamic_smem(g.smem)?;
            let mut a = fused_args();
            a.push(g.per as i64);
            // One cluster per row, not a persistent grid: the hardware fits fewer clusters at
            // once than blocks per SM × SMs ÷ C suggests (a cluster's blocks share a GPC), and a
            // persistent grid sized past that ran its last clusters' rows as a second wave
            // (measured on the H100: 58–64% of copy at V = 128256). Blocks of finished rows are replaced
            // as they go.
            let clusters = p.rows;
            let blocks = u32::try_from(clusters * g.cluster).map_err(|_| {
                Error::bad_arg(OP, "logits", "a launch grid within 32 bits", clusters)
            })?;
            k.launch(stream, (blocks, 1, 1), (g.threads, 1, 1), g.smem, &mut a)?;
        }
        other => {
            return Err(Error::NoVariant {
                op: OP.into(),
                msg: format!("no CUDA variant named `{other}`"),
            })
        }
    }

    if ptrs.loss != 0 {
        let k = dev.kernel(&prog, "ce_reduce")?;
        let mut a = KernelArgs::new();
        a.push(ptrs.loss)
            .push(ptrs.loss_rows)
            .push(status)
            .push(n)
            .push(mean);
        k.launch(stream, (1, 1, 1), (1024, 1, 1), 0, &mut a)?;
    }
    Ok(())
}

/// Reads the status block back (synchronises `stream`): the first bad row and its value.
pub fn read_status(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    scratch: &Scratch,
) -> Result<Option<(usize, i64)>> {
    let mut host = [0u8; STATUS_BYTES];
    // SAFETY: the status buffer holds STATUS_BYTES bytes; `host` lives past the synchronize.
    unsafe { dev.dtoh(&mut host, scratch.status.ptr(), stream)? };
    dev.synchronize(stream, "cross_entropy target check read-back")?;
    let row = u64::from_le_bytes(host[8..16].try_into().unwrap());
    let value = i64::from_le_bytes(host[16..24].try_into().unwrap());
    Ok((row != u64::MAX).then_some((row as usize, value)))
}

#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    variant: &str,
    p: &Problem,
    logits: &Tensor,
    targets: &Tensor,
    loss_rows: &Tensor,
    loss: Option<&Tensor>,
    grad: GradOut,
    opts: &CrossEntropyOptions,
) -> Result<()> {
    let Device::Cuda(i) = p.device else {
        unreachable!("cross_entropy cuda path on {}", p.device)
    };
    let dev = device(i)?;
    let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    let ptrs = Ptrs {
        logits: logits.device_ptr()?,
        targets: targets.device_ptr()?,
        grad: match grad {
            GradOut::Skip => 0,
            GradOut::Into(g) => g.device_ptr()?,
            GradOut::InPlace => logits.device_ptr()?,
        },
        loss_rows: loss_rows.device_ptr()?,
        loss: loss.map_or(Ok(0), |l| l.device_ptr())?,
    };
    let scratch = Scratch::new(variant, p, &dev, &stream)?;
    launch(variant, p, &dev, &stream, ptrs, &scratch, opts)?;
    if opts.check_targets {
        if let Some((row, value)) = read_status(&dev, &stream, &scratch)? {
            return Err(bad_target(row, value, p, opts.ignore_index));
        }
    }
    Ok(())
}

/// dlogits *= dloss in place on the device (see `ce_scale_grad`).
pub fn scale_grad(
    grad: &Tensor,
    dloss: &Tensor,
    (rows, cols, ld): (usize, usize, usize),
    stream: Option<Stream>,
) -> Result<()> {
    let dev = grad.cuda_device()?;
    let stream = stream.unwrap_or_else(|| dev.stream().clone());
    let k = dev.kernel(&program(grad.dtype(), DType::I64), "ce_scale_grad")?;
    let gp = grad.device_ptr()?;
    let es = grad.dtype().size_in_bytes();
    let vec =
        gp.is_multiple_of(16) && (cols * es).is_multiple_of(16) && (ld * es).is_multiple_of(16);
    let per_row = dloss.numel() != 1;
    let threads = 256usize;
    let work = (rows * cols).div_ceil(if vec { 16 / es } else { 1 });
    let blocks = work
        .div_ceil(threads)
        .clamp(1, dev.props().sm_count as usize * 8);
    let mut a = KernelArgs::new();
    a.push(gp)
        .push(dloss.device_ptr()?)
        .push(rows as i64)
        .push(cols as i64)
        .push(ld as i64)
        .push(per_row as i32)
        .push(vec as i32);
    k.launch(
        &stream,
        (blocks as u32, 1, 1),
        (threads as u32, 1, 1),
        0,
        &mut a,
    )
}
