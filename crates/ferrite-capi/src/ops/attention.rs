//! Attention (dense and varlen): forward and backward.

use super::{read_opts, size};
use crate::boundary::call;
use crate::operand::{bad, write_back_all, Call, Operand};
use crate::{
    FerriteAttentionLayout, FerriteDevice, FerriteStatus, FerriteTensor,
    FERRITE_ATTENTION_LAYOUT_BSHD,
};
use ferrite::ops::attention;
use ferrite::Result;

/// Options of the attention calls (`ferrite_attention_options_default()`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteAttentionOptions {
    /// A `FERRITE_ATTENTION_LAYOUT_*` code (bshd; ignored for a varlen batch: `[total, H, D]`).
    pub layout: FerriteAttentionLayout,
    /// Each query sees keys up to its own position (bottom-right aligned) (false).
    pub causal: bool,
    /// Backward: the same bits on every run (slower on CUDA) (false).
    pub deterministic: bool,
    /// Score scale; 0: 1/√head_dim (0).
    pub scale: f32,
    /// Soft-cap c: scores become c·tanh(s/c); 0: off (0).
    pub softcap: f32,
    /// Keys visible to the left of a query's position; −1: unbounded (−1).
    pub window_left: i64,
    /// Keys visible to its right; −1: unbounded (causal makes it 0) (−1).
    pub window_right: i64,
}

/// A variable-length batch: q packed `[total_q, Hq, D]`, k and v `[total_k, Hkv, D]`, with int32
/// cumulative sequence lengths `[B + 1]` and the longest sequences.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteVarlen {
    /// int32 `[B + 1]`: query sequence b is rows cu_seqlens_q[b]..cu_seqlens_q[b + 1].
    pub cu_seqlens_q: *const FerriteTensor,
    /// int32 `[B + 1]`, the keys'.
    pub cu_seqlens_k: *const FerriteTensor,
    /// The longest query sequence.
    pub max_seqlen_q: i64,
    /// The longest key sequence.
    pub max_seqlen_k: i64,
}

/// bshd, not causal, deterministic off, scale 1/√D, no soft-cap, no window.
#[no_mangle]
pub extern "C" fn ferrite_attention_options_default() -> FerriteAttentionOptions {
    FerriteAttentionOptions {
        layout: FERRITE_ATTENTION_LAYOUT_BSHD,
        causal: false,
        deterministic: false,
        scale: 0.0,
        softcap: 0.0,
        window_left: -1,
        window_right: -1,
    }
}

/// The wrapped varlen tensors and sizes of a call.
struct VarlenOps {
    q: Operand,
    k: Operand,
    max_q: usize,
    max_k: usize,
}

impl VarlenOps {
    fn get(&self) -> attention::Varlen<'_> {
        attention::Varlen {
            cu_seqlens_q: &self.q.t,
            cu_seqlens_k: &self.k.t,
            max_seqlen_q: self.max_q,
            max_seqlen_k: self.max_k,
        }
    }
}

/// Reads the options and the varlen description of an attention call.
///
/// # Safety
/// The pointer contract (lib.rs) for `options`, `varlen` and the descriptors `varlen` points to.
unsafe fn attention_args(
    c: &mut Call,
    options: *const FerriteAttentionOptions,
    varlen: *const FerriteVarlen,
) -> Result<(attention::AttentionOptions, Option<VarlenOps>)> {
    let op = c.op();
    // SAFETY: forwarded to this function's contract.
    let o = unsafe { read_opts(op, "options", options)? }
        .unwrap_or_else(|| ferrite_attention_options_default());
    let layout = match o.layout.0 {
        0 => attention::Layout::Bshd,
        1 => attention::Layout::Bhsd,
        other => {
            return Err(bad(
                op,
                "options.layout",
                "a FERRITE_ATTENTION_LAYOUT_* code (0 bshd, 1 bhsd)",
                other,
            ))
        }
    };
    let opts = attention::AttentionOptions {
        variant: None,
        stream: c.stream(),
        layout,
        scale: (o.scale != 0.0).then_some(o.scale),
        causal: o.causal,
        window: (o.window_left, o.window_right),
        softcap: o.softcap,
        deterministic: o.deterministic,
    };
    // SAFETY: forwarded to this function's contract.
    let vl = match unsafe { read_opts(op, "varlen", varlen)? } {
        None => None,
        Some(v) => Some(VarlenOps {
            max_q: size(op, "varlen.max_seqlen_q", v.max_seqlen_q)?,
            max_k: size(op, "varlen.max_seqlen_k", v.max_seqlen_k)?,
            // SAFETY: forwarded to this function's contract.
            q: unsafe { c.tensor("varlen.cu_seqlens_q", v.cu_seqlens_q)? },
            // SAFETY: as above.
            k: unsafe { c.tensor("varlen.cu_seqlens_k", v.cu_seqlens_k)? },
        }),
    };
    Ok((opts, vl))
}

/// Attention forward (FlashAttention semantics): o = softmax(mask(softcap(scale·q·kᵀ)))·v and lse
/// (natural log, f32 `[B, Hq, Sq]`, or `[Hq, total_q]` for a varlen batch). q `[B, Sq, Hq, D]`
/// (bshd) or `[B, Hq, Sq, D]` (bhsd), k and v with Hkv heads (GQA: Hq a multiple of Hkv) and Sk
/// keys, o like q; f32, f16 or bf16. `varlen`, `options` may be NULL.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_attention_forward(
    device: FerriteDevice,
    q: *const FerriteTensor,
    k: *const FerriteTensor,
    v: *const FerriteTensor,
    o: *const FerriteTensor,
    lse: *const FerriteTensor,
    varlen: *const FerriteVarlen,
    options: *const FerriteAttentionOptions,
) -> FerriteStatus {
    const OP: &str = "ferrite_attention_forward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (q, k, v, o, lse) = unsafe {
            (
                c.tensor("q", q)?,
                c.tensor("k", k)?,
                c.tensor("v", v)?,
                c.tensor("o", o)?,
                c.tensor("lse", lse)?,
            )
        };
        // SAFETY: this function's contract.
        let (opts, vl) = unsafe { attention_args(&mut c, options, varlen)? };
        let vl_ref = vl.as_ref().map(VarlenOps::get);
        attention::attention_forward_into(&q.t, &k.t, &v.t, &o.t, &lse.t, vl_ref.as_ref(), &opts)?;
        write_back_all(&[Some(&o), Some(&lse)])
    })
}

/// Attention backward: dq, dk, dv (like q, k, v, with their strides) from dout (like o, with o's
/// strides), q, k, v, o and the forward's lse; the probabilities are recomputed.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_attention_backward(
    device: FerriteDevice,
    dout: *const FerriteTensor,
    q: *const FerriteTensor,
    k: *const FerriteTensor,
    v: *const FerriteTensor,
    o: *const FerriteTensor,
    lse: *const FerriteTensor,
    dq: *const FerriteTensor,
    dk: *const FerriteTensor,
    dv: *const FerriteTensor,
    varlen: *const FerriteVarlen,
    options: *const FerriteAttentionOptions,
) -> FerriteStatus {
    const OP: &str = "ferrite_attention_backward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (dout, q, k, v, o, lse, dq, dk, dv) = unsafe {
            (
                c.tensor("dout", dout)?,
                c.tensor("q", q)?,
                c.tensor("k", k)?,
                c.tensor("v", v)?,
                c.tensor("o", o)?,
                c.tensor("lse", lse)?,
                c.tensor("dq", dq)?,
                c.tensor("dk", dk)?,
                c.tensor("dv", dv)?,
            )
        };
        // SAFETY: this function's contract.
        let (opts, vl) = unsafe { attention_args(&mut c, options, varlen)? };
        let vl_ref = vl.as_ref().map(VarlenOps::get);
        attention::attention_backward_into(
            &dout.t,
            &q.t,
            &k.t,
            &v.t,
            &o.t,
            &lse.t,
            &dq.t,
            &dk.t,
            &dv.t,
            vl_ref.as_ref(),
            &opts,
        )?;
        write_back_all(&[Some(&dq), Some(&dk), Some(&dv)])
    })
}
