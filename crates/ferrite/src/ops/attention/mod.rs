//! # attention — o = softmax(mask(softcap(scale·q·kᵀ)))·v, the log-sum-exp, and the backward
//!
//! Semantics as in the flash-attn package (docs/attention.md has the full page):
//! - q `[B, Sq, Hq, D]` (`Layout::Bshd`, default) or `[B, Hq, Sq, D]` (`Layout::Bhsd`); k, v the
//!   same with Hkv heads and Sk keys. Query head h reads kv head h / (Hq / Hkv) (GQA; MQA when
//!   Hkv = 1). Variable-length batches pack q as `[total_q, Hq, D]` and k/v as `[total_k, Hkv, D]`
//!   with i32 cumulative sequence lengths (`Varlen`).
//! - Scores s = scale·q·kᵀ (scale 1/√D by default), soft-capped s = c·tanh(s/c) when c > 0,
//!   then masked in absolute positions with the bottom-right alignment: query i of a sequence
//!   with lengths (sq, sk) sits at i + sk − sq; key j is visible iff it lies within
//!   [pos − window_left, pos + window_right] (−1 = unbounded on that side; causal = right 0).
//! - o like q; lse f32 `[B, Hq, Sq]` (padded) or `[Hq, total_q]` (varlen), natural log. Rows with
//!   no visible key give o = 0, lse = −inf and zero gradients.
//! - Backward from dO, o, lse: dq, dk, dv like q, k, v (dk/dv summed over a kv group).
//!
//! dtypes: f32, bf16, f16 on the CPU and on CUDA `naive`; fp32 arithmetic everywhere.
//!
//! Variants — CPU: `naive` (S and P materialised per (batch, head), one thread) → `tiled` (online
//! softmax over key tiles, S never materialised, (batch, head, query block) across cores). CUDA:
//! `naive` (S and P in global f32 workspaces of B·Hq·Sq·Sk floats: O(n²) memory) → `flash`
//! (sm_80, mma.sync) → `hopper` (sm_90a, wgmma). See cpu.rs and kernels/naive.cu.

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
#[doc(hidden)]
pub mod flash;
#[doc(hidden)]
pub mod hopper;

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
pub const OP: &str = "attention";
/// The backward's name in errors.
pub const OP_BWD: &str = "attention_backward";
const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];

const HALVES: &[DType] = &[DType::F16, DType::BF16];

/// The ladder, in order: each variant with what it supports and what it changes.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo { name: "naive", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any head dim", summary: "S and P materialised per (batch, head), one thread", rank: 1 },
        VariantInfo { name: "tiled", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any head dim", summary: "online softmax over key tiles (S never materialised), masked tiles skipped, query blocks across cores", rank: 2 },
        VariantInfo { name: "naive", backend: Backend::Cuda, dtypes: FLOATS, min_arch: Some(Arch::SM80), constraints: "any head dim; B·Hq·Sq·Sk f32 workspace (two in the backward)", summary: "S = scale·QKᵀ and P in global f32 buffers, a softmax kernel, then P·V; a thread per element", rank: 1 },
        VariantInfo {
            name: "flash",
            backend: Backend::Cuda,
            dtypes: HALVES,
            min_arch: Some(Arch::SM80),
            constraints: "bf16/f16; head dim 32, 64, 96 or 128; 16-byte aligned tensors, strides multiples of 8 elements",
            summary: "FlashAttention-2 on mma.sync: Q·Kᵀ and P·V on tensor cores, online softmax in registers, K/V tiles through a cp.async ring (S never leaves the SM); backward in one pass over the keys with dQ added through f32 atomics (5 GEMMs), or with `deterministic` the dK/dV and dQ kernels without atomics (7 GEMMs)",
            rank: 2,
        },
        VariantInfo {
            name: "hopper",
            backend: Backend::Cuda,
            dtypes: HALVES,
            min_arch: Some(Arch::SM90),
            constraints: "Hopper (compute capability 9.x) only; bf16/f16; head dim 64 or 128 (forward, and the wgmma backward unless `deterministic` or soft-capped: flash's backward kernels then); 16-byte aligned tensors, strides multiples of 8 elements",
            summary: "FlashAttention-3 steps: TMA loads into swizzled shared memory, wgmma (P from registers), producer/consumer warpgroups, softmax overlapped with the other warpgroup's GEMMs (ping-pong) and with its own P·V; backward on wgmma (dV/dK from register Pᵀ/dSᵀ, dQ from a swizzled dSᵀ tile)",
            rank: 3,
        },
    ]
}

/// Dim order of padded q, k, v and o (the head dim is always last and contiguous).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `[batch, seq, heads, head_dim]`: flash-attn's order.
    Bshd,
    /// `[batch, heads, seq, head_dim]`: `scaled_dot_product_attention`'s order.
    Bhsd,
}

/// Options of one call (forward and backward take the same). `Default`: best variant, the
/// device's own stream, `Bshd`, scale 1/√D, no mask, no soft-cap, the fast backward.
#[derive(Clone, Debug)]
pub struct AttentionOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
    /// Default Bshd (ignored when varlen: packed [total, H, D]).
    pub layout: Layout,
    /// None = 1/sqrt(D).
    pub scale: Option<f32>,
    /// Each query sees only keys at or before its position (bottom-right aligned).
    pub causal: bool,
    /// (left, right), −1 = unbounded; causal forces right = 0.
    pub window: (i64, i64),
    /// 0 = off.
    pub softcap: f32,
    /// Backward: same bits every run. The CPU variants and CUDA `naive` always are; `flash` and
    /// `hopper` then run their backward without atomics (recomputing S and dP once more for dQ:
    /// 7 GEMMs of work instead of 5, slower).
    pub deterministic: bool,
}

impl Default for AttentionOptions {
    fn default() -> Self {
        AttentionOptions {
            variant: None,
            stream: None,
            layout: Layout::Bshd,
            scale: None,
            causal: false,
            window: (-1, -1),
            softcap: 0.0,
            deterministic: false,
        }
    }
}

/// Variable-length batch: cumulative sequence lengths (device tensors on GPU, i32, [B+1]) and
/// the maximum lengths (host values, used for grid sizes).
#[derive(Clone, Copy, Debug)]
pub struct Varlen<'a> {
    /// Sequence b's queries are rows `cu[b]..cu[b+1]` of q.
    pub cu_seqlens_q: &'a Tensor,
    /// Sequence b's keys are rows `cu[b]..cu[b+1]` of k and v.
    pub cu_seqlens_k: &'a Tensor,
    /// The longest query sequence.
    pub max_seqlen_q: usize,
    /// The longest key sequence.
    pub max_seqlen_k: usize,
}

/// Everything a kernel needs, after validation: sizes and element strides of each tensor.
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// B: sequences.
    pub batch: usize,
    /// Hq: query heads.
    pub heads_q: usize,
    /// Hkv: key/value heads (divides Hq).
    pub heads_kv: usize,
    /// Sq: queries per sequence (the longest when varlen).
    pub seqlen_q: usize,
    /// Sk: keys per sequence (the longest when varlen).
    pub seqlen_k: usize,
    /// D: the head dim.
    pub head_dim: usize,
    /// The shared dtype of q, k, v, o.
    pub dtype: DType,
    /// The shared device.
    pub device: Device,
    /// Packed sequences with cumulative lengths.
    pub varlen: bool,
    /// The score scale.
    pub scale: f32,
    /// The soft-cap c (0: off).
    pub softcap: f32,
    /// Keys visible before the query's position (−1: all), after folding `causal` in.
    pub window_left: i64,
    /// Keys visible after the query's position (−1: all; 0 when causal).
    pub window_right: i64,
    /// Element strides (batch, seq, head) of q, k, v, o (and dO/dq/dk/dv share their partner's
    /// strides: they must have the same layout as q/k/v/o); the last dim is contiguous.
    pub q_stride: [i64; 3],
    /// k's (batch, seq, head) strides.
    pub k_stride: [i64; 3],
    /// v's (batch, seq, head) strides.
    pub v_stride: [i64; 3],
    /// o's (batch, seq, head) strides.
    pub o_stride: [i64; 3],
}

#[cfg(test)]
impl Problem {
    /// A padded, contiguous `[B, S, H, D]` problem for the host-side tests: scale 1/√D, no
    /// soft-cap, no window (tests set those with struct update syntax).
    pub(crate) fn padded_bshd(
        batch: usize,
        (heads_q, heads_kv): (usize, usize),
        (seqlen_q, seqlen_k): (usize, usize),
        head_dim: usize,
        dtype: DType,
        device: Device,
    ) -> Problem {
        let st = |s: usize, h: usize| {
            [
                (s * h * head_dim) as i64,
                (h * head_dim) as i64,
                head_dim as i64,
            ]
        };
        Problem {
            batch,
            heads_q,
            heads_kv,
            seqlen_q,
            seqlen_k,
            head_dim,
            dtype,
            device,
            varlen: false,
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: 0.0,
            window_left: -1,
            window_right: -1,
            q_stride: st(seqlen_q, heads_q),
            k_stride: st(seqlen_k, heads_kv),
            v_stride: st(seqlen_k, heads_kv),
            o_stride: st(seqlen_q, heads_q),
        }
    }
}

impl Problem {
    /// Forward FLOPs by the usual convention: 4·B·Hq·Sq·Sk·D, halved when causal.
    pub fn flops_forward(&self, causal: bool) -> f64 {
        let f = 4.0
            * (self.batch * self.heads_q) as f64
            * self.seqlen_q as f64
            * self.seqlen_k as f64
            * self.head_dim as f64;
        if causal {
            f / 2.0
        } else {
            f
        }
    }
}

/// The host copy of the sequence table: per sequence, its first row and its length, for q and k.
/// Rows count through the whole batch: varlen, the row in the packed seq dimension; padded,
/// b·S + i (sequence b starts at b·S and has the full length).
#[derive(Clone, Debug)]
pub struct Seqs {
    /// (first row, length) of each sequence's queries.
    pub q: Vec<(usize, usize)>,
    /// (first row, length) of each sequence's keys.
    pub k: Vec<(usize, usize)>,
    /// Rows of packed q (varlen: lse's row length); B·Sq when padded.
    pub total_q: usize,
}

impl Seqs {
    fn padded(p: &Problem) -> Seqs {
        Seqs {
            q: (0..p.batch).map(|b| (b * p.seqlen_q, p.seqlen_q)).collect(),
            k: (0..p.batch).map(|b| (b * p.seqlen_k, p.seqlen_k)).collect(),
            total_q: p.batch * p.seqlen_q,
        }
    }
}

/// Visible keys of query row `i` of a sequence of lengths (sq, sk): the half-open range
/// [lo, hi) (empty when lo ≥ hi). Bottom-right aligned: the query sits at i + sk − sq.
pub fn visible_keys(i: usize, sq: usize, sk: usize, wl: i64, wr: i64) -> (usize, usize) {
    let pos = i as i64 + sk as i64 - sq as i64;
    let lo = if wl >= 0 { (pos - wl).max(0) } else { 0 };
    let hi = if wr >= 0 {
        (pos + wr + 1).min(sk as i64)
    } else {
        sk as i64
    };
    if hi <= lo {
        (0, 0)
    } else {
        (lo as usize, hi as usize)
    }
}

/// (batch, seq, head) element strides of a `[B, S, H, D]` / `[B, H, S, D]` / `[T, H, D]` tensor
/// with `strides`.
pub fn bsh_strides(layout: Layout, varlen: bool, strides: &[usize]) -> [i64; 3] {
    let s = |i: usize| strides[i] as i64;
    if varlen {
        [0, s(0), s(1)]
    } else {
        match layout {
            Layout::Bshd => [s(0), s(1), s(2)],
            Layout::Bhsd => [s(0), s(2), s(1)],
        }
    }
}

/// (batch, seq, heads, dim) of a q/k/v-like tensor, or None for the wrong rank.
fn dims(t: &Tensor, layout: Layout, varlen: bool) -> Option<(usize, usize, usize, usize)> {
    let s = t.shape();
    match (varlen, s.len()) {
        (true, 3) => Some((0, s[0], s[1], s[2])),
        (false, 4) => Some(match layout {
            Layout::Bshd => (s[0], s[1], s[2], s[3]),
            Layout::Bhsd => (s[0], s[2], s[1], s[3]),
        }),
        _ => None,
    }
}

fn layout_words(layout: Layout, varlen: bool, heads: &str, seq: &str) -> String {
    if varlen {
        format!("[total_{seq}, {heads}, D] (varlen)")
    } else {
        match layout {
            Layout::Bshd => format!("[B, S{seq}, {heads}, D] (bshd)"),
            Layout::Bhsd => format!("[B, {heads}, S{seq}, D] (bhsd)"),
        }
    }
}

fn last_contiguous(t: &Tensor) -> bool {
    t.shape().last().is_some_and(|&d| d <= 1) || t.strides().last() == Some(&1)
}

/// `t` must have `shape`, `like`'s dtype and device, and a contiguous last dim.
fn expect_like(op: &str, name: &str, t: &Tensor, like: &Tensor, shape: &[usize]) -> Result<()> {
    if t.shape() != shape
        || t.dtype() != like.dtype()
        || t.device() != like.device()
        || !last_contiguous(t)
    {
        return Err(Error::bad_arg(
            op,
            name,
            format!(
                "{}{shape:?} on {} with a contiguous last dim",
                like.dtype(),
                like.device()
            ),
            describe(t),
        ));
    }
    Ok(())
}

/// Gradient-side tensors must have their partner's strides (the kernels index both alike).
fn expect_same_strides(op: &str, name: &str, t: &Tensor, partner: &str, p: &Tensor) -> Result<()> {
    if t.strides() != p.strides() {
        return Err(Error::bad_arg(
            op,
            name,
            format!("the strides of `{partner}` ({:?})", p.strides()),
            describe(t),
        ));
    }
    Ok(())
}

/// Outputs may not share storage with an input or with each other.
fn check_distinct(op: &str, outs: &[(&str, &Tensor)], ins: &[&Tensor]) -> Result<()> {
    for (k, (name, o)) in outs.iter().enumerate() {
        if ins.iter().any(|i| o.shares_storage(i)) {
            return Err(Error::bad_arg(
                op,
                *name,
                "a buffer distinct from the inputs",
                "a view of an input",
            ));
        }
        if let Some((other, _)) = outs[..k].iter().find(|(_, o2)| o.shares_storage(o2)) {
            return Err(Error::bad_arg(
                op,
                *name,
                format!("a buffer distinct from the output `{other}`"),
                format!("a view of `{other}`"),
            ));
        }
    }
    Ok(())
}

/// Reads and checks one cu_seqlens tensor: i32 `[batch + 1]` (batch taken from the first one when
/// `batch` is None), 0 first, non-decreasing, last = `total`, no length above `max`.
fn read_cu(
    op: &str,
    name: &str,
    t: &Tensor,
    device: Device,
    batch: Option<usize>,
    total: usize,
    max: usize,
    max_name: &str,
) -> Result<Vec<(usize, usize)>> {
    if t.dtype() != DType::I32 || t.rank() != 1 || t.device() != device || t.shape()[0] == 0 {
        return Err(Error::bad_arg(
            op,
            name,
            format!(
                "an i32 tensor [B + 1] on {device}{}",
                batch.map(|b| format!(" (B = {b})")).unwrap_or_default()
            ),
            describe(t),
        ));
    }
    if let Some(b) = batch {
        if t.shape()[0] != b + 1 {
            return Err(Error::bad_arg(
                op,
                name,
                format!("{} entries (B + 1 with B = {b} from cu_seqlens_q)", b + 1),
                describe(t),
            ));
        }
    }
    let cu = t.to_vec::<i32>()?;
    if cu[0] != 0 {
        return Err(Error::bad_arg(op, name, "first entry 0", cu[0]));
    }
    let mut seqs = Vec::with_capacity(cu.len() - 1);
    for (b, w) in cu.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(Error::bad_arg(
                op,
                name,
                "non-decreasing entries",
                format!("entry {} = {} after {}", b + 1, w[1], w[0]),
            ));
        }
        let len = (w[1] - w[0]) as usize;
        if len > max {
            return Err(Error::bad_arg(
                op,
                max_name,
                format!("≥ every sequence length in `{name}`"),
                format!("{max} (sequence {b} has length {len})"),
            ));
        }
        seqs.push((w[0] as usize, len));
    }
    let last = *cu.last().unwrap();
    if last as usize != total {
        return Err(Error::bad_arg(
            op,
            name,
            format!("last entry = {total} (the packed rows of the tensor)"),
            last,
        ));
    }
    Ok(seqs)
}

/// The checked problem and the host copy of its sequence table.
pub struct Checked {
    /// Sizes, strides and options.
    pub p: Problem,
    /// The sequence table.
    pub seqs: Seqs,
}

/// Checks q, k, v, o, lse (and the varlen table) and builds the Problem.
fn validate(
    op: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    varlen: Option<&Varlen>,
    opts: &AttentionOptions,
) -> Result<Checked> {
    let vl = varlen.is_some();
    let layout = opts.layout;
    let (b, sq, hq, d) = dims(q, layout, vl)
        .filter(|_| FLOATS.contains(&q.dtype()) && last_contiguous(q))
        .filter(|&(_, _, h, d)| h > 0 && d > 0)
        .ok_or_else(|| {
            Error::bad_arg(
                op,
                "q",
                format!(
                    "an f32/f16/bf16 tensor {} with Hq ≥ 1, D ≥ 1 and a contiguous last dim",
                    layout_words(layout, vl, "Hq", "q")
                ),
                describe(q),
            )
        })?;
    let kv_dims = |t: &Tensor, name: &str| -> Result<(usize, usize, usize, usize)> {
        let words = || {
            format!(
                "{}{} on {} with Hkv ≥ 1, D = {d}{} and a contiguous last dim",
                q.dtype(),
                layout_words(layout, vl, "Hkv", "k"),
                q.device(),
                if vl {
                    String::new()
                } else {
                    format!(", B = {b}")
                }
            )
        };
        let dd = dims(t, layout, vl)
            .filter(|_| t.dtype() == q.dtype() && t.device() == q.device() && last_contiguous(t))
            .filter(|&(tb, _, h, td)| h > 0 && td == d && tb == b)
            .ok_or_else(|| Error::bad_arg(op, name, words(), describe(t)))?;
        Ok(dd)
    };
    let (_, sk, hkv, _) = kv_dims(k, "k")?;
    if v.shape() != k.shape() {
        return Err(Error::bad_arg(
            op,
            "v",
            format!("the shape of `k` ({:?})", k.shape()),
            describe(v),
        ));
    }
    kv_dims(v, "v")?;
    if hq % hkv != 0 {
        return Err(Error::bad_arg(
            op,
            "k",
            format!("a kv head count dividing the {hq} query heads"),
            format!("{hkv} kv heads ({})", describe(k)),
        ));
    }
    expect_like(op, "o", o, q, q.shape())?;
    let scale = opts.scale.unwrap_or(1.0 / (d as f32).sqrt());
    if !scale.is_finite() {
        return Err(Error::bad_arg(op, "scale", "a finite number", scale));
    }
    if !opts.softcap.is_finite() || opts.softcap < 0.0 {
        return Err(Error::bad_arg(
            op,
            "softcap",
            "a finite value ≥ 0 (0 = off)",
            opts.softcap,
        ));
    }
    let (wl, wr) = opts.window;
    if wl < -1 || wr < -1 {
        return Err(Error::bad_arg(
            op,
            "window",
            "(left, right) each ≥ 0, or −1 for unbounded",
            format!("({wl}, {wr})"),
        ));
    }
    let wr = if opts.causal { 0 } else { wr };
    let device = q.device();
    // The sequence table; for varlen, read on the host after the caller's stream has produced it.
    let (batch, seqlen_q, seqlen_k, seqs) = match varlen {
        None => (b, sq, sk, None),
        Some(vlen) => {
            if let (Some(s), Device::Cuda(i)) = (&opts.stream, device) {
                crate::core::cuda::device(i)?.synchronize(s, "attention: reading cu_seqlens")?;
            }
            let (total_q, total_k) = (sq, sk);
            let sq_list = read_cu(
                op,
                "cu_seqlens_q",
                vlen.cu_seqlens_q,
                device,
                None,
                total_q,
                vlen.max_seqlen_q,
                "max_seqlen_q",
            )?;
            let sk_list = read_cu(
                op,
                "cu_seqlens_k",
                vlen.cu_seqlens_k,
                device,
                Some(sq_list.len()),
                total_k,
                vlen.max_seqlen_k,
                "max_seqlen_k",
            )?;
            (
                sq_list.len(),
                vlen.max_seqlen_q,
                vlen.max_seqlen_k,
                Some(Seqs {
                    q: sq_list,
                    k: sk_list,
                    total_q,
                }),
            )
        }
    };
    let lse_shape: Vec<usize> = if vl { vec![hq, sq] } else { vec![b, hq, sq] };
    if lse.shape() != lse_shape.as_slice()
        || lse.dtype() != DType::F32
        || lse.device() != device
        || !lse.is_contiguous()
    {
        return Err(Error::bad_arg(
            op,
            "lse",
            format!(
                "a contiguous f32{lse_shape:?} on {device} ({})",
                if vl { "[Hq, total_q]" } else { "[B, Hq, Sq]" }
            ),
            describe(lse),
        ));
    }
    let p = Problem {
        batch,
        heads_q: hq,
        heads_kv: hkv,
        seqlen_q,
        seqlen_k,
        head_dim: d,
        dtype: q.dtype(),
        device,
        varlen: vl,
        scale,
        softcap: opts.softcap,
        window_left: wl,
        window_right: wr,
        q_stride: bsh_strides(layout, vl, q.strides()),
        k_stride: bsh_strides(layout, vl, k.strides()),
        v_stride: bsh_strides(layout, vl, v.strides()),
        o_stride: bsh_strides(layout, vl, o.strides()),
    };
    let seqs = seqs.unwrap_or_else(|| Seqs::padded(&p));
    Ok(Checked { p, seqs })
}

/// Why `v` cannot take this problem, if so. Head-dim and shape limits of each variant live here
/// (the tensor-core variants take a fixed set of head dims).
/// Why variant `v` cannot run `p` (None when it can). `ptrs` are the device addresses of the
/// call's q/k/v/o-like tensors (empty on the CPU).
pub fn unfit(v: &VariantInfo, p: &Problem, backward: bool, ptrs: &[u64]) -> Option<String> {
    match (v.backend, v.name) {
        (Backend::Cuda, "flash") => flash::unfit(p, ptrs),
        (Backend::Cuda, "hopper") => {
            let arch = match p.device {
                Device::Cuda(i) => crate::core::cuda::device(i).ok().map(|d| d.arch()),
                Device::Cpu => None,
            };
            if arch.map(|a| a.major) != Some(9) {
                return Some("needs a Hopper GPU (compute capability 9.x: wgmma, TMA)".into());
            }
            if backward {
                flash::unfit(p, ptrs)
            } else {
                hopper::unfit(p, ptrs)
            }
        }
        (Backend::Cuda, "naive") => {
            let n = (p.batch as u128)
                * (p.heads_q as u128)
                * (p.seqlen_q as u128)
                * (p.seqlen_k as u128);
            (n * 4 > i64::MAX as u128).then(|| {
                format!("needs a B·Hq·Sq·Sk f32 workspace below 2⁶³ bytes (got {n} elements)")
            })
        }
        _ => None,
    }
}

fn select(
    p: &Problem,
    requested: Option<&str>,
    backward: bool,
    ptrs: &[u64],
) -> Result<&'static str> {
    let vs = variants();
    let arch = crate::core::cuda::arch_of(p.device)?;
    let v = variant::select(
        if backward { OP_BWD } else { OP },
        &vs,
        requested,
        Backend::of(p.device),
        p.dtype,
        arch,
        |v| unfit(v, p, backward, ptrs),
    )?;
    Ok(v.name)
}

/// Device addresses of `ts` on a GPU problem (empty on the CPU), for the variants' alignment checks.
fn device_ptrs(p: &Problem, ts: &[&Tensor]) -> Result<Vec<u64>> {
    if p.device.is_cuda() {
        ts.iter().map(|t| t.device_ptr()).collect()
    } else {
        Ok(vec![])
    }
}

/// Forward into caller-provided `o` (like q) and `lse` (f32 `[B, Hq, Sq]` or `[Hq, total_q]`).
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_into(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    varlen: Option<&Varlen>,
    opts: &AttentionOptions,
) -> Result<()> {
    let c = validate(OP, q, k, v, o, lse, varlen, opts)?;
    let mut ins = vec![q, k, v];
    if let Some(vl) = varlen {
        ins.extend([vl.cu_seqlens_q, vl.cu_seqlens_k]);
    }
    check_distinct(OP, &[("o", o), ("lse", lse)], &ins)?;
    let ptrs = device_ptrs(&c.p, &[q, k, v, o])?;
    let name = select(&c.p, opts.variant.as_deref(), false, &ptrs)?;
    match c.p.device {
        Device::Cpu => cpu::forward(name, &c.p, &c.seqs, q, k, v, o, lse),
        Device::Cuda(_) => cuda::forward(name, &c.p, &c.seqs, q, k, v, o, lse, varlen, opts),
    }
}

/// Backward into caller-provided dq, dk, dv (like q, k, v, with their strides), from dO (like o,
/// with o's strides), o and lse of the forward.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_into(
    dout: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    dq: &Tensor,
    dk: &Tensor,
    dv: &Tensor,
    varlen: Option<&Varlen>,
    opts: &AttentionOptions,
) -> Result<()> {
    let op = OP_BWD;
    let c = validate(op, q, k, v, o, lse, varlen, opts)?;
    expect_like(op, "dout", dout, q, q.shape())?;
    expect_same_strides(op, "dout", dout, "o", o)?;
    for (name, t, partner, pname) in [("dq", dq, q, "q"), ("dk", dk, k, "k"), ("dv", dv, v, "v")] {
        expect_like(op, name, t, q, partner.shape())?;
        expect_same_strides(op, name, t, pname, partner)?;
    }
    let mut ins = vec![dout, q, k, v, o, lse];
    if let Some(vl) = varlen {
        ins.extend([vl.cu_seqlens_q, vl.cu_seqlens_k]);
    }
    check_distinct(op, &[("dq", dq), ("dk", dk), ("dv", dv)], &ins)?;
    let ptrs = device_ptrs(&c.p, &[dout, q, k, v, o, dq, dk, dv])?;
    let name = select(&c.p, opts.variant.as_deref(), true, &ptrs)?;
    let t = BwdTensors {
        dout,
        q,
        k,
        v,
        o,
        lse,
        dq,
        dk,
        dv,
    };
    match c.p.device {
        Device::Cpu => cpu::backward(name, &c.p, &c.seqs, &t),
        Device::Cuda(_) => cuda::backward(name, &c.p, &c.seqs, &t, varlen, opts),
    }
}

/// The tensors of a backward call, validated.
pub struct BwdTensors<'a> {
    /// dO, like o.
    pub dout: &'a Tensor,
    /// The forward's queries.
    pub q: &'a Tensor,
    /// The forward's keys.
    pub k: &'a Tensor,
    /// The forward's values.
    pub v: &'a Tensor,
    /// The forward's output.
    pub o: &'a Tensor,
    /// The forward's log-sum-exp.
    pub lse: &'a Tensor,
    /// Receives dQ, like q.
    pub dq: &'a Tensor,
    /// Receives dK, like k.
    pub dk: &'a Tensor,
    /// Receives dV, like v.
    pub dv: &'a Tensor,
}

/// Allocating forward of a padded batch: (o, lse).
///
/// Causal grouped-query attention on the CPU (on a GPU the same call runs `flash` or `hopper`
/// for bf16/f16):
///
/// ```rust
/// use ferrite::ops::attention::{attention, AttentionOptions};
/// use ferrite::{DType, Device, Tensor};
/// let (b, s, d) = (2, 16, 32);
/// let q = Tensor::rand(&[b, s, 8, d], DType::F32, Device::Cpu, 1, -1.0, 1.0)?; // 8 query heads
/// let k = Tensor::rand(&[b, s, 2, d], DType::F32, Device::Cpu, 2, -1.0, 1.0)?; // 2 kv heads
/// let v = Tensor::rand(&[b, s, 2, d], DType::F32, Device::Cpu, 3, -1.0, 1.0)?;
/// let opts = AttentionOptions { causal: true, ..Default::default() };
/// let (o, lse) = attention(&q, &k, &v, &opts)?;
/// assert_eq!((o.shape(), lse.shape()), (&[b, s, 8, d][..], &[b, 8, s][..]));
/// // The first query sees only the first key: its output is that key's value row.
/// let (o, v) = (o.to_vec::<f32>()?, v.to_vec::<f32>()?);
/// assert!((0..d).all(|i| (o[i] - v[i]).abs() < 1e-6));
/// # Ok::<(), ferrite::Error>(())
/// ```
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOptions,
) -> Result<(Tensor, Tensor)> {
    let o = Tensor::empty(q.shape(), q.dtype(), q.device())?;
    let lse_shape = match (dims(q, opts.layout, false), q.rank()) {
        (Some((b, sq, hq, _)), 4) => vec![b, hq, sq],
        _ => vec![0],
    };
    let lse = Tensor::empty(&lse_shape, DType::F32, q.device())?;
    attention_forward_into(q, k, v, &o, &lse, None, opts)?;
    Ok((o, lse))
}

/// Allocating backward of a padded batch: (dq, dk, dv).
pub fn attention_backward(
    dout: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    opts: &AttentionOptions,
) -> Result<(Tensor, Tensor, Tensor)> {
    // Gradients come back contiguous, so their partners are made contiguous too (strides match).
    let like = |t: &Tensor| Tensor::empty(t.shape(), t.dtype(), t.device());
    let (dq, dk, dv) = (like(q)?, like(k)?, like(v)?);
    attention_backward_into(
        &dout.contiguous()?,
        &q.contiguous()?,
        &k.contiguous()?,
        &v.contiguous()?,
        &o.contiguous()?,
        lse,
        &dq,
        &dk,
        &dv,
        None,
        opts,
    )?;
    Ok((dq, dk, dv))
}

/// The family as the harness sees it (check, bench, kernels).
pub struct Attention;

impl OpFamily for Attention {
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
    fn kernels(&self) -> Vec<KernelSpec> {
        cuda::kernel_specs()
    }
}

#[cfg(test)]
mod tests;
