//! # decode — attention of one new token per sequence over a paged KV cache, and appending to it
//!
//! The cache is laid out as in vLLM: `key_cache`, `value_cache` `[num_blocks, block_size, Hkv, D]`
//! (one float dtype, contiguous); sequence b's key j lives in block `block_table[b, j / block_size]`
//! at offset `j % block_size` (`block_table` `[B, max_blocks_per_seq]` i32); `seq_lens` `[B]` i32
//! is each sequence's context length (0 ≤ len ≤ max_blocks_per_seq·block_size; may differ).
//!
//! `decode`: q `[B, Hq, D]` → o `[B, Hq, D]` (+ optional lse f32 `[B, Hq]`, natural log). The query
//! sits at position `len − 1` and sees keys `j ≥ len − 1 − window_left` (all when `window_left` is
//! −1); scores `s = scale·q·k` (scale 1/√D by default), soft-capped `softcap·tanh(s/softcap)` when
//! `softcap > 0`; query head h reads kv head `h / (Hq / Hkv)` (GQA; MQA when Hkv = 1). A sequence of
//! length 0 gives o = 0, lse = −inf. Block-table entries are read only for blocks holding visible
//! keys; the rest may hold anything (−1 for unused, as vLLM pads).
//!
//! `append_kv` (reshape-and-cache): k, v `[T, Hkv, D]` written to the caches at `slot_mapping`
//! `[T]` (i32; slot = block·block_size + offset; −1 skips the token). Bit-exact copies.
//!
//! Variants — CPU: `naive` (gather each sequence's context contiguous, then plain attention) →
//! `parallel` (cores over (sequence, kv head), reading through the block table, tiled online
//! softmax). CUDA: `naive` (a block per (sequence, query head), scalar loads) → `gqa` (a block per
//! (sequence, kv head) serving its query heads: each K/V byte read once, 16-byte loads) →
//! `split_kv` (flash-decoding: the context split across blocks, partial results reduced by a second
//! kernel) → `pipelined` (each warp streams key tiles through a cp.async ring in shared memory,
//! one softmax rescale per tile; the batch's keys split into chunks by a device-side plan, so a
//! ragged batch keeps every SM busy) → `pipelined_mma` (the same pipeline, q·k and p·v on tensor
//! cores). See kernels/decode.cu. Serving loops plan once per step and run every layer on the
//! plan: [`plan_into`] / [`decode_planned_into`] ([`DecodePlan`]).
//!
//! Bad indices: on the CPU every used block-table entry, seq_len and slot is checked on the host
//! before any work. On the GPU these live in device memory; the kernels never read outside the
//! cache — an out-of-range seq_len is treated as 0, an out-of-range block entry's keys are skipped,
//! an out-of-range slot is not written — and set bits of a device error flag that the host reads
//! back after the launch (one 4-byte copy + stream sync) and turns into an [`Error`].

// The rungs (CPU code, CUDA host code) and the family's check and bench: pub for the harness,
// the CLI and the families that reuse each other's rungs; the API is this module's items.
#[doc(hidden)]
pub mod bench;
#[doc(hidden)]
pub mod check;
#[doc(hidden)]
pub mod cpu;
#[doc(hidden)]
pub mod cuda;
mod plan;

pub use plan::{decode_planned_into, plan_errors, plan_into, plan_numel, DecodePlan, PlanShape};

use crate::core::cuda::Stream;
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::{
    BenchConfig, BenchRecord, Ceilings, CheckConfig, CheckRecord, KernelSpec, OpFamily,
};
use crate::core::tensor::{describe, Tensor};
use crate::core::variant::{self, Backend, VariantInfo};

/// The family's name, as errors, the CLI and the tables spell it.
pub const OP: &str = "decode";
/// `append_kv`'s name in errors.
pub const APPEND_OP: &str = "append_kv";
const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];
const HALVES: &[DType] = &[DType::F16, DType::BF16];

/// Largest head dim of the CUDA kernels (the naive kernel holds 2 output dims per thread of 128;
/// the gqa kernel holds one 16-byte vector of the row per lane, ≤ 32 lanes per key).
pub const GPU_MAX_HEAD_DIM: usize = 256;

/// Longest context a block table may address: i32 lengths, with headroom so the kernels' 32-bit
/// key indices never overflow while stepping past the end.
pub const MAX_CAPACITY: usize = (i32::MAX as usize) - 65536;

/// Bits of the device error flag (mirrored in kernels/decode.cu and kernels/append.cu): a
/// seq_len outside `0..=max_blocks_per_seq·block_size`.
pub const ERR_SEQ_LEN: i32 = 1;
/// A block-table entry a query reads outside `0..num_blocks`.
pub const ERR_BLOCK: i32 = 2;
/// A slot outside the caches (and not −1).
pub const ERR_SLOT: i32 = 4;
/// A pipelined kernel was launched with less shared memory than it needs (a host bug).
pub const ERR_LAUNCH: i32 = 8;
/// A plan tensor whose schedule cannot come from `plan_into` for this batch (overwritten, or
/// planned for another shape).
pub const ERR_PLAN: i32 = 16;

/// The ladder, in order: each variant with what it supports and what it changes.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo { name: "naive", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any head dim", summary: "one thread; each sequence's context gathered contiguous, then plain attention", rank: 1 },
        VariantInfo { name: "parallel", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any head dim", summary: "cores over (sequence, kv head), all query heads of the group at once, through the block table, tiled online softmax", rank: 2 },
        VariantInfo { name: "naive", backend: Backend::Cuda, dtypes: FLOATS, min_arch: Some(Arch::SM80), constraints: "head dim ≤ 256", summary: "a block per (sequence, query head); a thread per key, scalar loads through the block table; K/V re-read by every query head of a group", rank: 1 },
        VariantInfo { name: "gqa", backend: Backend::Cuda, dtypes: HALVES, min_arch: Some(Arch::SM80), constraints: "head dim a multiple of 8, ≤ 256", summary: "a block per (sequence, kv head) serving its query heads: each K/V byte read once, 16-byte loads, lanes split a key's row, online softmax in registers, next key prefetched", rank: 2 },
        VariantInfo { name: "split_kv", backend: Backend::Cuda, dtypes: HALVES, min_arch: Some(Arch::SM80), constraints: "head dim a multiple of 8, ≤ 256; chosen when B·Hkv blocks would not fill the GPU", summary: "flash-decoding: the gqa kernel over context partitions (count from the SM count) writing partial (max, sum, acc), then a reduce kernel", rank: 3 },
        VariantInfo { name: "pipelined", backend: Backend::Cuda, dtypes: HALVES, min_arch: Some(Arch::SM80), constraints: "head dim a multiple of 8, ≤ 256", summary: "each warp streams tiles of keys through a 3-stage cp.async ring (2 tiles of K/V in flight whatever the registers), one softmax rescale per tile, scores reduced by recursive halving; partitions planned from resident blocks per SM so the grid fills whole waves; parallel merge", rank: 5 },
        VariantInfo { name: "pipelined_mma", backend: Backend::Cuda, dtypes: HALVES, min_arch: Some(Arch::SM80), constraints: "head dim a multiple of 16, ≤ 256", summary: "the pipelined kernel with q·k and p·v on tensor cores (mma.sync m16n8k16: the block's query heads as rows, 16-key tiles; p rounded to 16 bits before p·v): ~37 instructions per key instead of ~78 FFMAs, unpacks and shuffles, so issue stays far below what the copies need (measured 2–3% slower than pipelined on the H100: the default is pipelined)", rank: 4 },
    ]
}

/// The paged KV cache a decode step reads.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    /// `[num_blocks, block_size, Hkv, D]`.
    pub key_cache: &'a Tensor,
    /// Same shape and dtype as `key_cache`.
    pub value_cache: &'a Tensor,
    /// `[B, max_blocks_per_seq]` i32.
    pub block_table: &'a Tensor,
    /// `[B]` i32.
    pub seq_lens: &'a Tensor,
}

/// Options of one decode step. `Default`: best variant, the device's own stream, scale 1/√D,
/// no soft-cap, no window, the partition count from the SM count.
#[derive(Clone, Debug)]
pub struct DecodeOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
    /// None = 1/√D.
    pub scale: Option<f32>,
    /// 0 = off.
    pub softcap: f32,
    /// Keys `j ≥ len − 1 − window_left` are visible; −1 = all.
    pub window_left: i64,
    /// `split_kv`: number of context partitions (None = from the SM count).
    pub num_splits: Option<usize>,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            variant: None,
            stream: None,
            scale: None,
            softcap: 0.0,
            window_left: -1,
            num_splits: None,
        }
    }
}

/// A validated decode problem.
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// B: sequences (one query token each).
    pub batch: usize,
    /// Hq: query heads.
    pub heads_q: usize,
    /// Hkv: kv heads in the cache (divides Hq).
    pub heads_kv: usize,
    /// D: the head dim.
    pub head_dim: usize,
    /// Blocks in the cache.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Columns of the block table: the most blocks a sequence may use.
    pub max_blocks: usize,
    /// The shared dtype of q, o and the caches.
    pub dtype: DType,
    /// The shared device.
    pub device: Device,
    /// The score scale.
    pub scale: f32,
    /// The soft-cap (0: off).
    pub softcap: f32,
    /// Keys visible before the query's position (−1: all).
    pub window_left: i64,
}

impl Problem {
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }
    /// The longest context a sequence can have.
    pub fn capacity(&self) -> usize {
        self.max_blocks * self.block_size
    }
    /// The most keys one query can see.
    pub fn max_visible(&self) -> usize {
        if self.window_left >= 0 {
            self.capacity().min(self.window_left as usize + 1)
        } else {
            self.capacity()
        }
    }
    /// The visible key range [lo, len) of a sequence of length `len`.
    pub fn visible(&self, len: usize) -> (usize, usize) {
        let lo = if self.window_left >= 0 {
            len.saturating_sub(1 + self.window_left as usize)
        } else {
            0
        };
        (lo, len)
    }
}

fn expect(
    op: &str,
    name: &str,
    t: &Tensor,
    dtype: DType,
    device: Device,
    shape: &[usize],
) -> Result<()> {
    if t.dtype() != dtype || t.device() != device || t.shape() != shape || !t.is_contiguous() {
        return Err(Error::bad_arg(
            op,
            name,
            format!("a contiguous {dtype}{shape:?} tensor on {device}"),
            describe(t),
        ));
    }
    Ok(())
}

/// Checks shapes, dtypes, devices and options; on the CPU also every seq_len and every
/// block-table entry a query will read.
pub fn validate(
    q: &Tensor,
    kv: &PagedKv,
    o: &Tensor,
    lse: Option<&Tensor>,
    opts: &DecodeOptions,
) -> Result<Problem> {
    if q.rank() != 3 || !q.is_contiguous() || !FLOATS.contains(&q.dtype()) || q.shape()[2] == 0 {
        return Err(Error::bad_arg(
            OP,
            "q",
            "a contiguous f32/f16/bf16 [B, Hq, D] tensor with D ≥ 1",
            describe(q),
        ));
    }
    let (batch, heads_q, head_dim) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let (dtype, device) = (q.dtype(), q.device());
    let kc = kv.key_cache;
    if kc.rank() != 4 || kc.shape()[3] != head_dim || kc.shape()[1] == 0 || kc.shape()[2] == 0 {
        return Err(Error::bad_arg(
            OP,
            "key_cache",
            format!("[num_blocks, block_size ≥ 1, Hkv ≥ 1, D = {head_dim}] (D of q)"),
            describe(kc),
        ));
    }
    let (num_blocks, block_size, heads_kv) = (kc.shape()[0], kc.shape()[1], kc.shape()[2]);
    expect(OP, "key_cache", kc, dtype, device, kc.shape())?;
    expect(OP, "value_cache", kv.value_cache, dtype, device, kc.shape())?;
    if heads_q == 0 || heads_q % heads_kv != 0 {
        return Err(Error::bad_arg(
            OP,
            "q",
            format!("a query head count ≥ 1 divisible by the caches' {heads_kv} kv heads"),
            format!("{heads_q} query heads"),
        ));
    }
    let bt = kv.block_table;
    if bt.rank() != 2 || bt.shape()[0] != batch {
        return Err(Error::bad_arg(
            OP,
            "block_table",
            format!("i32 [B = {batch}, max_blocks_per_seq]"),
            describe(bt),
        ));
    }
    let max_blocks = bt.shape()[1];
    expect(OP, "block_table", bt, DType::I32, device, bt.shape())?;
    expect(OP, "seq_lens", kv.seq_lens, DType::I32, device, &[batch])?;
    expect(OP, "o", o, dtype, device, q.shape())?;
    if let Some(l) = lse {
        expect(OP, "lse", l, DType::F32, device, &[batch, heads_q])?;
    }
    let ins = [q, kc, kv.value_cache, bt, kv.seq_lens];
    for (name, out) in std::iter::once(("o", o)).chain(lse.map(|l| ("lse", l))) {
        if ins.iter().any(|i| out.shares_storage(i))
            || lse.is_some_and(|l| name == "o" && o.shares_storage(l))
        {
            return Err(Error::bad_arg(
                OP,
                name,
                "a buffer distinct from the inputs and the other output",
                "a view of one of them",
            ));
        }
    }
    let scale = opts.scale.unwrap_or(1.0 / (head_dim as f32).sqrt());
    if !scale.is_finite() {
        return Err(Error::bad_arg(OP, "scale", "a finite number", scale));
    }
    if !(opts.softcap == 0.0 || (opts.softcap.is_normal() && opts.softcap > 0.0)) {
        return Err(Error::bad_arg(
            OP,
            "softcap",
            "a finite number ≥ 0 (0 = off)",
            opts.softcap,
        ));
    }
    if opts.window_left < -1 {
        return Err(Error::bad_arg(
            OP,
            "window_left",
            "≥ 0, or −1 for no window",
            opts.window_left,
        ));
    }
    if max_blocks
        .checked_mul(block_size)
        .is_none_or(|c| c > MAX_CAPACITY)
    {
        return Err(Error::bad_arg(
            OP,
            "block_table",
            format!("max_blocks_per_seq · block_size ≤ {MAX_CAPACITY} (lengths are i32)"),
            format!("{max_blocks} · {block_size}"),
        ));
    }
    if opts.num_splits == Some(0) {
        return Err(Error::bad_arg(OP, "num_splits", "≥ 1 (or None)", 0));
    }
    let p = Problem {
        batch,
        heads_q,
        heads_kv,
        head_dim,
        num_blocks,
        block_size,
        max_blocks,
        dtype,
        device,
        scale,
        softcap: opts.softcap,
        window_left: opts.window_left,
    };
    if device == Device::Cpu {
        let lens = kv.seq_lens.to_vec::<i32>()?;
        let table = bt.to_vec::<i32>()?;
        check_indices(&p, &lens, &table)?;
    }
    Ok(p)
}

/// The host check of seq_lens and the block-table entries a query reads (CPU tensors; the GPU
/// kernels do the same per key and report through the error flag).
pub fn check_indices(p: &Problem, lens: &[i32], table: &[i32]) -> Result<()> {
    for (b, &len) in lens.iter().enumerate() {
        if len < 0 || len as usize > p.capacity() {
            return Err(Error::bad_arg(
                OP,
                "seq_lens",
                format!(
                    "lengths in 0..={} (max_blocks_per_seq {} × block_size {})",
                    p.capacity(),
                    p.max_blocks,
                    p.block_size
                ),
                format!("seq_lens[{b}] = {len}"),
            ));
        }
        let (lo, hi) = p.visible(len as usize);
        if hi == 0 {
            continue;
        }
        for i in lo / p.block_size..=(hi - 1) / p.block_size {
            let e = table[b * p.max_blocks + i];
            if e < 0 || e as usize >= p.num_blocks {
                return Err(Error::bad_arg(
                    OP,
                    "block_table",
                    format!(
                        "entries in 0..{} for the blocks holding visible keys",
                        p.num_blocks
                    ),
                    format!("block_table[{b}, {i}] = {e} (seq_lens[{b}] = {len})"),
                ));
            }
        }
    }
    Ok(())
}

/// Turns the device error flag read back after a launch into an error (0 = none).
pub fn device_error(op: &str, bits: i32) -> Result<()> {
    if bits == 0 {
        return Ok(());
    }
    let mut what = Vec::new();
    if bits & ERR_SEQ_LEN != 0 {
        what.push(
            "a seq_len outside 0..=max_blocks_per_seq·block_size (its row was computed as empty)",
        );
    }
    if bits & ERR_BLOCK != 0 {
        what.push(
            "a block_table entry outside 0..num_blocks for a visible key (those keys were skipped)",
        );
    }
    if bits & ERR_SLOT != 0 {
        what.push("a slot outside −1..num_blocks·block_size (those tokens were not written)");
    }
    if bits & ERR_LAUNCH != 0 {
        what.push("a kernel launched with too little shared memory (nothing was computed)");
    }
    if bits & ERR_PLAN != 0 {
        what.push("a plan whose schedule was not made for this batch (those units were skipped)");
    }
    if bits & !(ERR_SEQ_LEN | ERR_BLOCK | ERR_SLOT | ERR_LAUNCH | ERR_PLAN) != 0 {
        what.push("an unknown error bit");
    }
    if bits & ERR_PLAN != 0 && bits & (ERR_SEQ_LEN | ERR_BLOCK | ERR_SLOT) == 0 {
        return Err(Error::bad_arg(
            op,
            "plan",
            "a plan made by plan_into for this batch",
            format!(
                "{} (device check, flag {bits:#x}; the output is not valid)",
                what.join("; ")
            ),
        ));
    }
    if bits & (ERR_SEQ_LEN | ERR_BLOCK | ERR_SLOT) == 0 {
        // No index at fault: an internal error, not the caller's argument.
        return Err(Error::Other(format!(
            "{op}: {} (device flag {bits:#x})",
            what.join("; ")
        )));
    }
    let arg = if bits & ERR_SLOT != 0 {
        "slot_mapping"
    } else if bits & ERR_BLOCK != 0 {
        "block_table"
    } else {
        "seq_lens"
    };
    Err(Error::bad_arg(
        op,
        arg,
        "indices inside the cache",
        format!(
            "{} (device check, flag {bits:#x}; the output is not valid)",
            what.join("; ")
        ),
    ))
}

/// Why a CUDA variant cannot take this problem (beyond dtype/arch), if so. `auto` marks a default
/// pick (not requested by name): split_kv then declines when it would use one partition.
pub fn unfit(
    v: &str,
    p: &Problem,
    sm_count: usize,
    num_splits: Option<usize>,
    auto: bool,
) -> Option<String> {
    match v {
        "naive" if p.head_dim > GPU_MAX_HEAD_DIM => Some(format!(
            "supports head dims ≤ {GPU_MAX_HEAD_DIM} (got {})",
            p.head_dim
        )),
        "pipelined_mma" if !p.head_dim.is_multiple_of(16) || p.head_dim > GPU_MAX_HEAD_DIM => Some(format!(
            "supports head dims that are multiples of 16 up to {GPU_MAX_HEAD_DIM} (64, 96, 128, 256, ...; got {})",
            p.head_dim
        )),
        "gqa" | "split_kv" | "pipelined" if !p.head_dim.is_multiple_of(8) || p.head_dim > GPU_MAX_HEAD_DIM => Some(format!(
            "supports head dims that are multiples of 8 up to {GPU_MAX_HEAD_DIM} (64, 128, 256, ...; got {})",
            p.head_dim
        )),
        "split_kv" if auto && num_splits.is_none() && cuda::auto_splits(p, sm_count) == 1 => {
            Some("would use one partition here (enough (sequence, kv head) blocks, or a short context): gqa is the same kernel without the reduce".into())
        }
        _ => None,
    }
}

fn select(p: &Problem, opts: &DecodeOptions) -> Result<&'static str> {
    let vs = variants();
    let (arch, sms) = match p.device {
        Device::Cuda(i) => {
            let d = crate::core::cuda::device(i)?;
            (Some(d.arch()), d.props().sm_count as usize)
        }
        Device::Cpu => (None, 0),
    };
    let auto = opts.variant.is_none();
    let v = variant::select(
        OP,
        &vs,
        opts.variant.as_deref(),
        Backend::of(p.device),
        p.dtype,
        arch,
        |v| {
            (v.backend == Backend::Cuda)
                .then(|| unfit(v.name, p, sms, opts.num_splits, auto))
                .flatten()
        },
    )?;
    Ok(v.name)
}

/// Decode attention into caller-provided o (and lse).
pub fn decode_into(
    q: &Tensor,
    kv: &PagedKv,
    o: &Tensor,
    lse: Option<&Tensor>,
    opts: &DecodeOptions,
) -> Result<()> {
    let p = validate(q, kv, o, lse, opts)?;
    let v = select(&p, opts)?;
    if p.batch == 0 {
        return Ok(());
    }
    match p.device {
        Device::Cpu => cpu::decode(v, &p, q, kv, o, lse),
        Device::Cuda(_) => cuda::decode(v, &p, q, kv, o, lse, opts),
    }
}

/// Allocating decode: (o, lse).
pub fn decode(q: &Tensor, kv: &PagedKv, opts: &DecodeOptions) -> Result<(Tensor, Tensor)> {
    let o = Tensor::empty(q.shape(), q.dtype(), q.device())?;
    let b = q.shape().first().copied().unwrap_or(0);
    let h = q.shape().get(1).copied().unwrap_or(0);
    let lse = Tensor::empty(&[b, h], DType::F32, q.device())?;
    decode_into(q, kv, &o, Some(&lse), opts)?;
    Ok((o, lse))
}

/// Options of one append. `Default`: the device's own stream.
#[derive(Clone, Debug, Default)]
pub struct AppendOptions {
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
}

/// A validated append: tokens and the bytes of one token's row (Hkv·D elements).
#[derive(Clone, Copy, Debug)]
pub struct AppendProblem {
    /// T: tokens to write.
    pub tokens: usize,
    /// Hkv·D: elements of one token's row.
    pub row_elems: usize,
    /// num_blocks·block_size: slots in each cache.
    pub slots: usize,
    /// The shared dtype.
    pub dtype: DType,
    /// The shared device.
    pub device: Device,
}

/// Checks an append's tensors (shapes, dtypes, devices, contiguity; on the CPU every slot) and
/// returns the problem.
pub fn validate_append(
    k: &Tensor,
    v: &Tensor,
    key_cache: &Tensor,
    value_cache: &Tensor,
    slot_mapping: &Tensor,
) -> Result<AppendProblem> {
    let op = APPEND_OP;
    let kc = key_cache;
    if kc.rank() != 4 || !kc.is_contiguous() || !FLOATS.contains(&kc.dtype()) {
        return Err(Error::bad_arg(
            op,
            "key_cache",
            "a contiguous f32/f16/bf16 [num_blocks, block_size, Hkv, D] tensor",
            describe(kc),
        ));
    }
    let (dtype, device) = (kc.dtype(), kc.device());
    expect(op, "value_cache", value_cache, dtype, device, kc.shape())?;
    let t = k.shape().first().copied().unwrap_or(0);
    let row = [t, kc.shape()[2], kc.shape()[3]];
    expect(op, "k", k, dtype, device, &row)?;
    expect(op, "v", v, dtype, device, &row)?;
    expect(op, "slot_mapping", slot_mapping, DType::I32, device, &[t])?;
    for (name, out) in [("key_cache", kc), ("value_cache", value_cache)] {
        if [k, v, slot_mapping].iter().any(|i| out.shares_storage(i))
            || kc.shares_storage(value_cache)
        {
            return Err(Error::bad_arg(
                op,
                name,
                "a buffer distinct from k, v, slot_mapping and the other cache",
                "a view of one of them",
            ));
        }
    }
    let p = AppendProblem {
        tokens: t,
        row_elems: kc.shape()[2] * kc.shape()[3],
        slots: kc.shape()[0] * kc.shape()[1],
        dtype,
        device,
    };
    if device == Device::Cpu {
        for (i, &s) in slot_mapping.to_vec::<i32>()?.iter().enumerate() {
            if s < -1 || (s >= 0 && s as usize >= p.slots) {
                return Err(Error::bad_arg(
                    op,
                    "slot_mapping",
                    format!(
                        "slots in 0..{} (num_blocks·block_size), or −1 to skip",
                        p.slots
                    ),
                    format!("slot_mapping[{i}] = {s}"),
                ));
            }
        }
    }
    Ok(p)
}

/// Writes k, v `[T, Hkv, D]` into the caches at `slot_mapping` (i32 `[T]`, −1 = skip). When two
/// tokens name the same slot, which one lands is unspecified (as in vLLM).
pub fn append_kv(
    k: &Tensor,
    v: &Tensor,
    key_cache: &Tensor,
    value_cache: &Tensor,
    slot_mapping: &Tensor,
    opts: &AppendOptions,
) -> Result<()> {
    let p = validate_append(k, v, key_cache, value_cache, slot_mapping)?;
    if p.tokens == 0 || p.row_elems == 0 {
        return Ok(());
    }
    match p.device {
        Device::Cpu => cpu::append(&p, k, v, key_cache, value_cache, slot_mapping),
        Device::Cuda(_) => cuda::append(&p, k, v, key_cache, value_cache, slot_mapping, opts),
    }
}

/// The family as the harness sees it (check, bench, kernels).
pub struct Decode;

impl OpFamily for Decode {
    fn name(&self) -> &'static str {
        OP
    }
    fn variants(&self) -> Vec<VariantInfo> {
        variants()
    }
    fn check(&self, cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
        check::run(cfg, out)
    }
    fn bench(
        &self,
        cfg: &BenchConfig,
        ceilings: &Ceilings,
        progress: &mut dyn FnMut(&str),
        out: &mut Vec<BenchRecord>,
    ) -> Result<()> {
        bench::run(cfg, ceilings, progress, out)
    }
    fn bench_takes_size(&self) -> bool {
        false
    }
    fn kernels(&self) -> Vec<KernelSpec> {
        cuda::kernel_specs()
    }
}

#[cfg(test)]
mod tests;
