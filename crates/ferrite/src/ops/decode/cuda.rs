//! CUDA host code of the decode family: which kernel, its grid, the split count, the device error
//! flag and the split workspace.

use super::{device_error, AppendOptions, AppendProblem, DecodeOptions, PagedKv, Problem, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, CudaDevice, DeviceBuffer, Kernel, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("decode", "kernels/decode.cu");
const APPEND_SRC: KernelSource = kernel_source!("decode/append", "kernels/append.cu");

/// Warps per block of the gqa kernel.
pub const GQA_WARPS: usize = 4;
/// Threads per block of the naive and reduce kernels (the naive kernel assumes exactly this).
const NAIVE_THREADS: u32 = 128;
/// Fewest keys a split_kv partition gets: below this the reduce costs more than it spreads.
pub const MIN_PART_KEYS: usize = 256;
/// Most query heads one gqa block serves (registers: 8 floats of q and of acc per head per lane).
pub const MAX_HEADS_PER_BLOCK: usize = 8;
/// Warps per block of the pipelined kernel (each streams its own tiles through its own ring).
pub const PIPE_WARPS: usize = 4;
/// Depth of each warp's cp.async ring: PIPE_STAGES − 1 tiles in flight while one is computed.
pub const PIPE_STAGES: usize = 3;
/// Warps per block of the mma kernel: its math is cheap, so 2 warps × 2 tiles of 16 keys in flight
/// per block, and more blocks per SM, keep as many bytes queued with a finer grid.
pub const MMA_WARPS: usize = 2;
/// Keys per warp tile of the mma kernel (two n8 tiles of q·k, one k16 step of p·v).
pub const MMA_TILE_KEYS: usize = 16;
/// Fewest keys a pipelined partition gets (at most ~4 tiles per warp below this: the ring's fill
/// and the merge would cost more than the extra blocks bring).
pub const PIPE_MIN_PART_KEYS: usize = 256;
/// Share of a full wave of resident blocks that keeps HBM saturated: each block has
/// PIPE_WARPS · (PIPE_STAGES − 1) tiles (~32 KiB) in flight, so ~90% of the slots already queue
/// more bytes than the memory system's latency × bandwidth.
const PIPE_SATURATE: f64 = 0.9;
/// Cost of a split in the planner, relative to the kernel: the merge kernel, its launch and the
/// partials' traffic (a few µs against ~50–200 µs kernels).
const PIPE_SPLIT_COST: f64 = 0.02;
/// Ints in a schedule's header (mirrors SCHED_HEADER in decode.cu).
pub const SCHED_HEADER: usize = 8;
/// Header index of the planned chunk size (S_CHUNK in decode.cu).
pub const S_CHUNK: usize = 3;
/// Header index of the error flag of runs on the schedule (S_ERR in decode.cu).
pub const S_ERR: usize = 4;
/// Header index of the number of chunks planned (S_ITEMS in decode.cu).
pub const S_ITEMS: usize = 0;

/// Where a schedule buffer keeps what (mirrors decode.cu): the header, `indptr[batch + 1]`, the
/// `(sequence, chunk)` items, then the partials at `part_offset` (16-byte aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedLayout {
    /// Most chunks the plan may make (also the partial slots).
    pub max_items: usize,
    /// Byte offset of the partials.
    pub part_offset: usize,
    /// Bytes of the whole buffer.
    pub bytes: usize,
}

/// The schedule buffer of a batch of `batch` sequences, `heads_q` query heads of `head_dim`, for
/// `per_b` blocks per chunk on `slots` resident blocks: at most one chunk per sequence plus one
/// wave's worth of extra chunks (the kernel's grid is sized for that many; the blocks past the
/// planned chunks return at once).
pub fn sched_layout(
    batch: usize,
    heads_q: usize,
    head_dim: usize,
    per_b: usize,
    slots: usize,
) -> SchedLayout {
    let max_items = batch + slots.div_ceil(per_b.max(1));
    let ints = SCHED_HEADER + batch + 1 + 2 * max_items;
    let part_offset = (ints * 4).div_ceil(16) * 16;
    let bytes = part_offset + max_items * heads_q * (head_dim + 2) * 4;
    SchedLayout {
        max_items,
        part_offset,
        bytes,
    }
}

pub fn naive_program(dtype: DType) -> Program {
    Program::new(SRC).define("FE_ELEM", dtype.cuda_name())
}

pub fn gqa_program(dtype: DType, head_dim: usize, heads_per_block: usize) -> Program {
    Program::new(SRC)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_GQA", 1)
        .define("FE_D", head_dim)
        .define("FE_G", heads_per_block)
        .define("FE_WARPS", GQA_WARPS)
}

/// Registers per thread allowed by the pipelined kernel's launch bounds: 4 blocks of 128 threads
/// per SM (128 registers) up to 4 query heads per block (q and acc: 64 floats per lane), 2 blocks
/// (255 registers) beyond.
pub fn pipe_min_blocks(heads_per_block: usize) -> usize {
    if heads_per_block <= 4 {
        4
    } else {
        2
    }
}

pub fn pipe_program(dtype: DType, head_dim: usize, heads_per_block: usize) -> Program {
    Program::new(SRC)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_PIPE", 1)
        .define("FE_D", head_dim)
        .define("FE_G", heads_per_block)
        .define("FE_WARPS", PIPE_WARPS)
        .define("FE_STAGES", PIPE_STAGES)
        .define("FE_MINB", pipe_min_blocks(heads_per_block))
}

/// Keys per warp tile of the pipelined kernel (mirrors TK in decode.cu): ~1024 elements of K
/// (2 KiB in 16-bit, as much again of V), a power of two in 4..=32, at least one key per key group.
pub fn pipe_tile_keys(head_dim: usize) -> usize {
    let lanes_per_key = (head_dim / 8).max(1).next_power_of_two();
    let keys_per_step = 32 / lanes_per_key.min(32);
    let by_size = 1usize << (1024 / head_dim.max(1)).max(1).ilog2();
    by_size.min(32).max(keys_per_step)
}

/// Dynamic shared memory of the pipelined kernel (mirrors SMEM_BYTES in decode.cu): the warps'
/// rings (reused for the warp merge) and each warp's score scratch.
pub fn pipe_smem_bytes(head_dim: usize, heads_per_block: usize) -> usize {
    let tk = pipe_tile_keys(head_dim);
    let gp = heads_per_block.next_power_of_two();
    let ring = PIPE_WARPS * PIPE_STAGES * 2 * tk * head_dim * 2;
    let epi = PIPE_WARPS * heads_per_block * (head_dim + 2) * 4;
    let e = tk * gp;
    let ws = (2 * e + gp).div_ceil(4) * 4;
    ring.max(epi) + PIPE_WARPS * ws * 4
}

pub fn mma_program(dtype: DType, head_dim: usize, heads_per_block: usize) -> Program {
    Program::new(SRC)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_MMA", 1)
        .define("FE_D", head_dim)
        .define("FE_G", heads_per_block)
        .define("FE_WARPS", MMA_WARPS)
        .define("FE_STAGES", PIPE_STAGES)
}

/// Dynamic shared memory of the mma kernel (mirrors M_SMEM_BYTES in decode.cu): the warps' rings
/// of 16-key tiles with rows padded by 16 bytes (reused for the warp merge).
pub fn mma_smem_bytes(head_dim: usize, heads_per_block: usize) -> usize {
    let ring = MMA_WARPS * PIPE_STAGES * 2 * MMA_TILE_KEYS * (head_dim + 8) * 2;
    let epi = MMA_WARPS * heads_per_block * (head_dim + 2) * 4;
    ring.max(epi)
}

/// The pipelined kernel's partition count for `base` blocks per partition, `max_visible` keys
/// and `slots` resident blocks (SMs × blocks per SM). Models the run as waves of equal blocks:
/// full waves stream at full bandwidth; a last, partial wave of r blocks streams at
/// min(1, r / (PIPE_SATURATE · slots)) of it; each split adds PIPE_SPLIT_COST. The cheapest
/// count wins (ties: fewer splits). E.g. on 132 SMs × 4: B16 Hkv8 → 4 (512 blocks), B64 Hkv8 → 1
/// (512), B1 Hkv8 ctx32k → 60 (480).
pub fn plan_splits(base: usize, max_visible: usize, slots: usize) -> usize {
    let base = base.max(1);
    let slots = slots.max(1);
    let sat = (PIPE_SATURATE * slots as f64).ceil();
    let max_s = max_visible.div_ceil(PIPE_MIN_PART_KEYS).clamp(1, 65535);
    let cost = |s: usize| {
        let blocks = base * s;
        let (full, r) = (blocks / slots, blocks % slots);
        let tail = if r == 0 { 0.0 } else { (r as f64).max(sat) };
        let split = if s > 1 { PIPE_SPLIT_COST } else { 0.0 };
        ((full * slots) as f64 + tail) / blocks as f64 + split
    };
    let mut best = (1, cost(1));
    for s in 2..=max_s {
        let c = cost(s);
        if c < best.1 - 1e-9 {
            best = (s, c);
        }
    }
    best.0
}

pub fn append_program(unit: &str) -> Program {
    Program::new(APPEND_SRC).define("FE_UNIT", unit)
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for d in [DType::F32, DType::F16, DType::BF16] {
        v.push(KernelSpec {
            program: naive_program(d),
            functions: vec!["decode_naive".into()],
            min_arch: Arch::SM80,
        });
    }
    for d in [DType::F16, DType::BF16] {
        for (hd, g) in [
            (64, 1),
            (64, 8),
            (128, 1),
            (128, 4),
            (128, 8),
            (256, 4),
            (256, 8),
            (96, 3),
        ] {
            v.push(KernelSpec {
                program: gqa_program(d, hd, g),
                functions: vec![
                    "decode_naive".into(),
                    "decode_gqa".into(),
                    "decode_reduce".into(),
                ],
                min_arch: Arch::SM80,
            });
        }
    }
    for d in [DType::F16, DType::BF16] {
        for (hd, g) in [
            (64, 1),
            (64, 8),
            (128, 1),
            (128, 4),
            (128, 8),
            (256, 4),
            (256, 8),
            (96, 3),
        ] {
            v.push(KernelSpec {
                program: pipe_program(d, hd, g),
                functions: vec![
                    "decode_pipelined".into(),
                    "decode_merge".into(),
                    "decode_plan".into(),
                ],
                min_arch: Arch::SM80,
            });
        }
    }
    for d in [DType::F16, DType::BF16] {
        for (hd, g) in [
            (64, 1),
            (64, 8),
            (96, 3),
            (128, 1),
            (128, 4),
            (128, 8),
            (256, 4),
            (256, 8),
        ] {
            v.push(KernelSpec {
                program: mma_program(d, hd, g),
                functions: vec![
                    "decode_mma".into(),
                    "decode_merge".into(),
                    "decode_plan".into(),
                ],
                min_arch: Arch::SM80,
            });
        }
    }
    for u in ["uint4", "unsigned int", "unsigned short"] {
        v.push(KernelSpec {
            program: append_program(u),
            functions: vec!["append_kv".into()],
            min_arch: Arch::SM80,
        });
    }
    v
}

/// Query heads per gqa block: the largest divisor of the group ≤ MAX_HEADS_PER_BLOCK.
pub fn heads_per_block(group: usize) -> usize {
    (1..=MAX_HEADS_PER_BLOCK.min(group))
        .rev()
        .find(|g| group.is_multiple_of(*g))
        .unwrap_or(1)
}

/// Blocks of the gqa kernel without splitting.
fn base_blocks(p: &Problem) -> usize {
    p.batch * p.heads_kv * (p.group() / heads_per_block(p.group()))
}

/// split_kv's partition count: as many partitions as keep the grid within about 4 blocks per SM
/// (what fits resident at ~110 registers × 128 threads, so the grid runs as one wave rather than
/// one and a sliver), no partition under MIN_PART_KEYS keys, at most 65535 (grid.y).
pub fn auto_splits(p: &Problem, sm_count: usize) -> usize {
    let want = (4 * sm_count.max(1)) / base_blocks(p).max(1);
    let by_len = p.max_visible().div_ceil(MIN_PART_KEYS);
    want.min(by_len).clamp(1, 65535)
}

/// (keys per partition, partitions) for `splits` requested partitions.
pub fn partitions(p: &Problem, splits: usize) -> (usize, usize) {
    let mv = p.max_visible().max(1);
    let size = mv.div_ceil(splits.clamp(1, 65535));
    (size, mv.div_ceil(size))
}

/// A kernel choice for one problem with its launch shape, the error flag, and (split_kv) the
/// workspace; reusable across calls on the same problem (the bench times `run` alone).
pub struct Prepared {
    pub kernel: Kernel,
    pub reduce: Option<Kernel>,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    /// Dynamic shared memory per block (the pipelined kernel's rings).
    pub smem: u32,
    pub part_size: usize,
    pub parts: usize,
    pub config: String,
    /// The gqa or pipelined kernel (else the naive one): their parameter lists differ.
    gqa: bool,
    /// The pipelined or mma kernel (decode_merge, and the schedule parameters).
    pipe: bool,
    /// The pipelined kernels' scheduled mode (no split count named): a block per unit that
    /// decode_plan wrote into a schedule buffer, which also holds the partials and the flag.
    pub sched: Option<Sched>,
    /// The error flag of the unscheduled kernels (a scheduled run's lives in its buffer).
    err: Option<DeviceBuffer>,
    workspace: Option<DeviceBuffer>,
    dev: Arc<CudaDevice>,
}

/// The scheduled mode of a pipelined kernel.
pub struct Sched {
    plan: Kernel,
    /// The schedule buffer's layout for this problem on this device.
    pub layout: SchedLayout,
    /// Units (kv head × query-head groups) per chunk.
    pub per_b: usize,
    /// Resident blocks of the kernel on the whole device.
    pub slots: usize,
}

/// Device addresses of a decode call.
#[derive(Clone, Copy, Debug)]
pub struct Ptrs {
    pub o: u64,
    /// 0 = no lse.
    pub lse: u64,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub block_table: u64,
    pub seq_lens: u64,
}

fn grid_x(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n)
        .ok()
        .filter(|&g| g <= i32::MAX as u32)
        .ok_or_else(|| Error::Other(format!("decode: {what} grid of {n} blocks exceeds 2³¹−1")))
}

/// The kernel(s) for `variant` on `p`, with their own flag and workspace (a scheduled variant's
/// schedule buffer included: `run` plans and launches).
pub fn prepare(
    variant: &str,
    p: &Problem,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    num_splits: Option<usize>,
) -> Result<Prepared> {
    prepare_with(variant, p, dev, stream, num_splits, true)
}

/// As [`prepare`]; `own_schedule` false leaves a scheduled variant without a schedule buffer
/// (the caller's plan provides it: [`Prepared::launch`]).
pub fn prepare_with(
    variant: &str,
    p: &Problem,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    num_splits: Option<usize>,
    own_schedule: bool,
) -> Result<Prepared> {
    let sms = dev.props().sm_count as usize;
    let mut sched = None;
    let (kernel, reduce, grid, threads, smem, part_size, parts, config) = match variant {
        "naive" => (
            dev.kernel(&naive_program(p.dtype), "decode_naive")?,
            None,
            (grid_x(p.batch * p.heads_q, "naive")?, 1, 1),
            NAIVE_THREADS,
            0,
            0,
            1,
            "a block per (sequence, query head)".to_string(),
        ),
        "gqa" | "split_kv" => {
            let g = heads_per_block(p.group());
            let prog = gqa_program(p.dtype, p.head_dim, g);
            let splits = if variant == "gqa" {
                1
            } else {
                num_splits.unwrap_or_else(|| auto_splits(p, sms))
            };
            let (size, parts) = partitions(p, splits);
            let k = dev.kernel(&prog, "decode_gqa")?;
            let r = if parts > 1 {
                Some(dev.kernel(&prog, "decode_reduce")?)
            } else {
                None
            };
            (
                k,
                r,
                (grid_x(base_blocks(p), "gqa")?, parts as u32, 1),
                (GQA_WARPS * 32) as u32,
                0,
                size,
                parts,
                format!(
                    "{g} q heads/block, {GQA_WARPS} warps, {parts} partition(s) of {size} keys"
                ),
            )
        }
        "pipelined" | "pipelined_mma" => {
            let g = heads_per_block(p.group());
            let mma = variant == "pipelined_mma";
            let (prog, func, smem, warps, tile) = if mma {
                (
                    mma_program(p.dtype, p.head_dim, g),
                    "decode_mma",
                    mma_smem_bytes(p.head_dim, g),
                    MMA_WARPS,
                    MMA_TILE_KEYS,
                )
            } else {
                (
                    pipe_program(p.dtype, p.head_dim, g),
                    "decode_pipelined",
                    pipe_smem_bytes(p.head_dim, g),
                    PIPE_WARPS,
                    pipe_tile_keys(p.head_dim),
                )
            };
            let k = dev.kernel(&prog, func)?;
            k.allow_dynamic_smem(smem as u32)?;
            let threads = (warps * 32) as u32;
            // Resident blocks per SM as the driver computes them (registers, shared memory).
            let max_warps = (dev.props().max_threads_per_sm / 32) as f64;
            let per_sm = (k.occupancy(threads, smem as u32)? * max_warps / warps as f64)
                .round()
                .max(1.0) as usize;
            let geometry = format!(
                "{g} q heads/block, {warps} warps × {PIPE_STAGES}-stage rings of {tile}-key tiles, {per_sm} blocks/SM"
            );
            if let Some(splits) = num_splits {
                let (size, parts) = partitions(p, splits);
                let r = if parts > 1 {
                    Some(dev.kernel(&prog, "decode_merge")?)
                } else {
                    None
                };
                (
                    k,
                    r,
                    (grid_x(base_blocks(p), "pipelined")?, parts as u32, 1),
                    threads,
                    smem as u32,
                    size,
                    parts,
                    format!("{geometry}, {parts} partition(s) of {size} keys"),
                )
            } else {
                let per_b = base_blocks(p) / p.batch.max(1);
                let slots = sms * per_sm;
                let layout = sched_layout(p.batch, p.heads_q, p.head_dim, per_b, slots);
                let blocks = layout.max_items * per_b;
                sched = Some(Sched {
                    plan: dev.kernel(&prog, "decode_plan")?,
                    layout,
                    per_b,
                    slots,
                });
                (
                    k,
                    Some(dev.kernel(&prog, "decode_merge")?),
                    (grid_x(blocks, "pipelined")?, 1, 1),
                    threads,
                    smem as u32,
                    0,
                    0,
                    format!("{geometry}, scheduled (≤ {} chunks)", layout.max_items),
                )
            }
        }
        other => {
            return Err(Error::NoVariant {
                op: OP.into(),
                msg: format!("no CUDA variant named `{other}`"),
            })
        }
    };
    let err = if sched.is_none() {
        Some(dev.alloc(4, stream)?)
    } else {
        None
    };
    let workspace = if let Some(sc) = &sched {
        // The schedule, its partials and its flag.
        own_schedule
            .then(|| dev.alloc(sc.layout.bytes, stream))
            .transpose()?
    } else if parts > 1 {
        // (max, sum, acc[D]) per (row, partition): decode_reduce's interleaved layout, or
        // decode_merge's acc block followed by the (max, sum) pairs — the same bytes.
        let bytes = p.batch * p.heads_q * parts * (p.head_dim + 2) * 4;
        Some(dev.alloc(bytes, stream)?)
    } else {
        None
    };
    Ok(Prepared {
        kernel,
        reduce,
        grid,
        threads,
        smem,
        part_size,
        parts,
        config,
        gqa: variant != "naive",
        pipe: variant.starts_with("pipelined"),
        sched,
        err,
        workspace,
        dev: dev.clone(),
    })
}

impl Prepared {
    /// Plans the lengths at `seq_lens` into the schedule at `buf` (scheduled mode; nothing
    /// otherwise): clears the header, error flag included, and queues decode_plan.
    pub fn plan(&self, p: &Problem, seq_lens: u64, buf: u64, stream: &Stream) -> Result<()> {
        let Some(sc) = &self.sched else {
            return Ok(());
        };
        // SAFETY: `buf` holds at least `sc.layout.bytes` ≥ the header (checked by the callers).
        unsafe { self.dev.memset(buf, 0, SCHED_HEADER * 4, stream)? };
        let mut a = KernelArgs::new();
        a.push(buf)
            .push(seq_lens)
            .push(p.batch as i64)
            .push(p.capacity() as i64)
            .push(p.window_left)
            .push(sc.per_b as i64)
            .push(sc.slots as i64)
            .push(sc.layout.max_items as i64);
        sc.plan.launch(stream, (1, 1, 1), (256, 1, 1), 0, &mut a)
    }

    /// The convenience path: clears the flag (or plans into the own schedule buffer) and queues
    /// the kernel(s) on `stream`.
    pub fn run(&self, p: &Problem, x: &Ptrs, stream: &Stream) -> Result<()> {
        if self.sched.is_none() {
            return self.launch(p, x, 0, stream);
        }
        let own = self.workspace.as_ref().map_or(0, |w| w.ptr());
        self.plan(p, x.seq_lens, own, stream)?;
        self.launch(p, x, own, stream)
    }

    /// Plans into the own schedule buffer (scheduled mode; nothing otherwise).
    pub fn plan_own(&self, p: &Problem, x: &Ptrs, stream: &Stream) -> Result<()> {
        match (&self.sched, &self.workspace) {
            (Some(_), Some(w)) => self.plan(p, x.seq_lens, w.ptr(), stream),
            _ => Ok(()),
        }
    }

    /// Queues the kernel(s) on the own schedule as last planned (scheduled mode), else as `run`.
    pub fn launch_own(&self, p: &Problem, x: &Ptrs, stream: &Stream) -> Result<()> {
        match (&self.sched, &self.workspace) {
            (Some(_), Some(w)) => self.launch(p, x, w.ptr(), stream),
            _ => self.run(p, x, stream),
        }
    }

    /// Queues the kernel(s) on the plan buffer at `sched_buf` (planned before, on this stream or
    /// one ordered before it; its flag collects the errors) — launches only, no host
    /// synchronisation, allocation or copy. `sched_buf` 0 (unscheduled variants only): this
    /// preparation's own flag, cleared first.
    pub fn launch(&self, p: &Problem, x: &Ptrs, sched_buf: u64, stream: &Stream) -> Result<()> {
        // The flag: a plan's (sticky) or, without one, this preparation's own (cleared).
        let err = match (sched_buf, &self.err) {
            (0, Some(e)) => {
                // SAFETY: `e` is a live 4-byte allocation of this device.
                unsafe { self.dev.memset(e.ptr(), 0, 4, stream)? };
                e.ptr()
            }
            (0, None) => unreachable!("a scheduled decode launched without its schedule"),
            (buf, _) => buf + (S_ERR * 4) as u64,
        };
        let part = match &self.sched {
            Some(sc) => sched_buf + sc.layout.part_offset as u64,
            None => self.workspace.as_ref().map_or(0, |w| w.ptr()),
        };
        let pipelined = self.pipe;
        let mut a = KernelArgs::new();
        a.push(x.o).push(x.lse);
        if self.gqa {
            a.push(part);
        }
        a.push(x.q)
            .push(x.k)
            .push(x.v)
            .push(x.block_table)
            .push(x.seq_lens)
            .push(err)
            .push(p.batch as i64)
            .push(p.heads_q as i64)
            .push(p.heads_kv as i64);
        if !self.gqa {
            a.push(p.head_dim as i64);
        }
        a.push(p.num_blocks as i64)
            .push(p.block_size as i64)
            .push(p.max_blocks as i64)
            .push(p.scale)
            .push(p.softcap)
            .push(if p.softcap > 0.0 {
                1.0 / p.softcap
            } else {
                0.0
            })
            .push(p.window_left);
        if self.gqa {
            a.push(self.part_size as i64).push(self.parts as i64);
        }
        let max_items = self.sched.as_ref().map_or(0, |sc| sc.layout.max_items);
        if pipelined {
            let sched = if self.sched.is_some() { sched_buf } else { 0 };
            a.push(sched).push(max_items as i64);
        }
        self.kernel
            .launch(stream, self.grid, (self.threads, 1, 1), self.smem, &mut a)?;
        let rows = p.batch * p.heads_q;
        // The merge (or split_kv's reduce) over `blocks` blocks of 128 threads, grid-stride.
        let merge = |k: &Kernel, blocks: usize, a: &mut KernelArgs| {
            let g = grid_x(blocks.min(1 << 30), "merge")?;
            k.launch(stream, (g, 1, 1), (NAIVE_THREADS, 1, 1), 0, a)
        };
        let Some(r) = &self.reduce else {
            return Ok(());
        };
        let mut a = KernelArgs::new();
        a.push(x.o).push(x.lse).push(part);
        if self.sched.is_some() {
            // Rows of sequences in one piece return at once: a grid of a few waves.
            a.push(sched_buf)
                .push(p.batch as i64)
                .push(p.heads_q as i64)
                .push(0i64)
                .push(max_items as i64);
            let sms = self.dev.props().sm_count as usize;
            merge(r, rows.min(8 * sms), &mut a)?;
        } else if pipelined {
            a.push(0u64)
                .push(p.batch as i64)
                .push(p.heads_q as i64)
                .push(self.parts as i64)
                .push((p.batch * self.parts) as i64);
            merge(r, rows, &mut a)?;
        } else {
            // decode_reduce (split_kv).
            a.push(rows as i64).push(self.parts as i64);
            merge(r, rows, &mut a)?;
        }
        Ok(())
    }

    /// Waits for the stream and turns the error flag into an error (a scheduled run's flag in
    /// its own schedule buffer).
    pub fn read_error(&self, stream: &Stream, op: &str) -> Result<()> {
        match (&self.err, &self.workspace) {
            (Some(e), _) => read_flag(&self.dev, e.ptr(), stream, op),
            (None, Some(w)) => read_flag(&self.dev, w.ptr() + (S_ERR * 4) as u64, stream, op),
            (None, None) => Ok(()),
        }
    }

    /// The chunk size and chunk count the last plan into the own schedule chose (waits for the
    /// stream); None when unscheduled.
    pub fn planned(&self, stream: &Stream) -> Result<Option<(usize, usize)>> {
        let (Some(_), Some(w)) = (&self.sched, &self.workspace) else {
            return Ok(None);
        };
        let mut h = [0u8; SCHED_HEADER * 4];
        // SAFETY: the schedule buffer holds at least the header; `h` lives until the sync.
        unsafe { self.dev.dtoh(&mut h, w.ptr(), stream)? };
        self.dev.synchronize(stream, super::OP)?;
        let int =
            |i: usize| i32::from_le_bytes(h[4 * i..4 * i + 4].try_into().unwrap()).max(0) as usize;
        Ok(Some((int(S_CHUNK), int(S_ITEMS))))
    }
}

/// Reads the 4-byte flag at `err` (after waiting for the stream) into an error.
pub fn read_flag(dev: &CudaDevice, err: u64, stream: &Stream, op: &str) -> Result<()> {
    let mut h = [0u8; 4];
    // SAFETY: `err` points at 4 live bytes of this device; `h` lives until the synchronize below.
    unsafe { dev.dtoh(&mut h, err, stream)? };
    dev.synchronize(stream, op)?;
    device_error(op, i32::from_le_bytes(h))
}

pub(super) fn ctx(d: Device, s: &Option<Stream>) -> Result<(Arc<CudaDevice>, Stream)> {
    let Device::Cuda(i) = d else {
        unreachable!("decode cuda path on {d}")
    };
    let dev = device(i)?;
    let s = s.clone().unwrap_or_else(|| dev.stream().clone());
    Ok((dev, s))
}

pub fn ptrs(q: &Tensor, kv: &PagedKv, o: &Tensor, lse: Option<&Tensor>) -> Result<Ptrs> {
    Ok(Ptrs {
        o: o.device_ptr()?,
        lse: lse.map(|l| l.device_ptr()).transpose()?.unwrap_or(0),
        q: q.device_ptr()?,
        k: kv.key_cache.device_ptr()?,
        v: kv.value_cache.device_ptr()?,
        block_table: kv.block_table.device_ptr()?,
        seq_lens: kv.seq_lens.device_ptr()?,
    })
}

pub(super) fn decode(
    variant: &str,
    p: &Problem,
    q: &Tensor,
    kv: &PagedKv,
    o: &Tensor,
    lse: Option<&Tensor>,
    opts: &DecodeOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p.device, &opts.stream)?;
    let x = ptrs(q, kv, o, lse)?;
    check_aligned(variant, &x)?;
    let pr = prepare(variant, p, &dev, &stream, opts.num_splits)?;
    pr.run(p, &x, &stream)?;
    pr.read_error(&stream, OP)
}

/// The decode on a plan buffer at `plan` with its preparation (see plan.rs): launches only.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_planned(
    variant: &str,
    pr: &Prepared,
    p: &Problem,
    q: &Tensor,
    kv: &PagedKv,
    o: &Tensor,
    lse: Option<&Tensor>,
    plan: u64,
    stream: &Stream,
) -> Result<()> {
    let x = ptrs(q, kv, o, lse)?;
    check_aligned(variant, &x)?;
    pr.launch(p, &x, plan, stream)
}

fn check_aligned(variant: &str, x: &Ptrs) -> Result<()> {
    if variant != "naive" && [x.q, x.k, x.v, x.o].iter().any(|a| a % 16 != 0) {
        return Err(Error::bad_arg(
            OP,
            "q/key_cache/value_cache/o",
            format!("16-byte aligned device pointers for the `{variant}` variant"),
            "a misaligned view",
        ));
    }
    Ok(())
}

/// The widest copy unit the rows and pointers allow.
pub fn append_unit(p: &AppendProblem, ptrs: &[u64]) -> (&'static str, usize) {
    let rb = p.row_elems * p.dtype.size_in_bytes();
    let fits = |n: usize| rb.is_multiple_of(n) && ptrs.iter().all(|&a| a % n as u64 == 0);
    if fits(16) {
        ("uint4", 16)
    } else if fits(4) {
        ("unsigned int", 4)
    } else {
        ("unsigned short", 2)
    }
}

pub(super) fn append(
    p: &AppendProblem,
    k: &Tensor,
    v: &Tensor,
    key_cache: &Tensor,
    value_cache: &Tensor,
    slot_mapping: &Tensor,
    opts: &AppendOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p.device, &opts.stream)?;
    let ptrs = [
        key_cache.device_ptr()?,
        value_cache.device_ptr()?,
        k.device_ptr()?,
        v.device_ptr()?,
    ];
    let (unit, ub) = append_unit(p, &ptrs);
    let kernel = dev.kernel(&append_program(unit), "append_kv")?;
    let err = dev.alloc(4, &stream)?;
    // SAFETY: `err` is a live 4-byte allocation of this device.
    unsafe { dev.memset(err.ptr(), 0, 4, &stream)? };
    let row_units = p.row_elems * p.dtype.size_in_bytes() / ub;
    let mut a = KernelArgs::new();
    for q in ptrs {
        a.push(q);
    }
    a.push(slot_mapping.device_ptr()?)
        .push(err.ptr())
        .push(p.tokens as i64)
        .push(row_units as i64)
        .push(p.slots as i64);
    let threads = (row_units.div_ceil(32) * 32).clamp(32, 256) as u32;
    kernel.launch(
        &stream,
        (grid_x(p.tokens.min(1 << 20), "append")?, 1, 1),
        (threads, 1, 1),
        0,
        &mut a,
    )?;
    read_flag(&dev, err.ptr(), &stream, super::APPEND_OP)
}
