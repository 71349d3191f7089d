//! Paged decode and the KV-cache append.

use super::{read_opts, size};
use crate::boundary::call;
use crate::operand::{opt_ref, write_back_all, Call};
use crate::{FerriteDevice, FerriteStatus, FerriteTensor};
use ferrite::ops::decode;

/// Options of `ferrite_paged_decode` (`ferrite_decode_options_default()`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteDecodeOptions {
    /// Score scale; 0: 1/√head_dim (0).
    pub scale: f32,
    /// Soft-cap; 0: off (0).
    pub softcap: f32,
    /// Keys j ≥ len − 1 − window_left are visible; −1: all (−1).
    pub window_left: i64,
    /// CUDA `split_kv`: context partitions; 0: from the SM count (0).
    pub num_splits: i64,
}

/// scale 1/√D, no soft-cap, no window, partitions chosen by ferrite.
#[no_mangle]
pub extern "C" fn ferrite_decode_options_default() -> FerriteDecodeOptions {
    FerriteDecodeOptions {
        scale: 0.0,
        softcap: 0.0,
        window_left: -1,
        num_splits: 0,
    }
}

/// One decode step over a paged KV cache (vLLM's layout): q `[B, Hq, D]`, key_cache and
/// value_cache `[num_blocks, block_size, Hkv, D]`, block_table int32 `[B, max_blocks]`, seq_lens
/// int32 `[B]`; o like q, lse f32 `[B, Hq]` (optional). Bad indices are errors (on CUDA found by
/// the kernels and read back: one small copy and a synchronisation of the stream).
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_paged_decode(
    device: FerriteDevice,
    q: *const FerriteTensor,
    key_cache: *const FerriteTensor,
    value_cache: *const FerriteTensor,
    block_table: *const FerriteTensor,
    seq_lens: *const FerriteTensor,
    o: *const FerriteTensor,
    lse: *const FerriteTensor,
    options: *const FerriteDecodeOptions,
) -> FerriteStatus {
    const OP: &str = "ferrite_paged_decode";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let opt = unsafe { read_opts(OP, "options", options)? }
            .unwrap_or_else(|| ferrite_decode_options_default());
        // SAFETY: this function's contract.
        let (q, kc, vc, table, lens, o, lse) = unsafe {
            (
                c.tensor("q", q)?,
                c.tensor("key_cache", key_cache)?,
                c.tensor("value_cache", value_cache)?,
                c.tensor("block_table", block_table)?,
                c.tensor("seq_lens", seq_lens)?,
                c.tensor("o", o)?,
                c.opt_tensor("lse", lse)?,
            )
        };
        let opts = decode::DecodeOptions {
            variant: None,
            stream: c.stream(),
            scale: (opt.scale != 0.0).then_some(opt.scale),
            softcap: opt.softcap,
            window_left: opt.window_left,
            num_splits: match size(OP, "options.num_splits", opt.num_splits)? {
                0 => None,
                n => Some(n),
            },
        };
        let kv = decode::PagedKv {
            key_cache: &kc.t,
            value_cache: &vc.t,
            block_table: &table.t,
            seq_lens: &lens.t,
        };
        decode::decode_into(&q.t, &kv, &o.t, opt_ref(&lse), &opts)?;
        write_back_all(&[Some(&o), lse.as_ref()])
    })
}

/// Writes k, v `[T, Hkv, D]` into the paged caches at slot_mapping (int32 `[T]`; slot =
/// block·block_size + offset; −1 skips a token). The caches are updated in place.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_append_kv(
    device: FerriteDevice,
    k: *const FerriteTensor,
    v: *const FerriteTensor,
    key_cache: *const FerriteTensor,
    value_cache: *const FerriteTensor,
    slot_mapping: *const FerriteTensor,
) -> FerriteStatus {
    const OP: &str = "ferrite_append_kv";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (k, v, kc, vc, slots) = unsafe {
            (
                c.tensor("k", k)?,
                c.tensor("v", v)?,
                c.tensor("key_cache", key_cache)?,
                c.tensor("value_cache", value_cache)?,
                c.tensor("slot_mapping", slot_mapping)?,
            )
        };
        let opts = decode::AppendOptions { stream: c.stream() };
        decode::append_kv(&k.t, &v.t, &kc.t, &vc.t, &slots.t, &opts)?;
        write_back_all(&[Some(&kc), Some(&vc)])
    })
}
