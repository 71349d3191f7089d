//! Memory a caller owns, seen as tensors for the length of one call: what the bindings (the
//! PyTorch module, the C API) share. Device memory is wrapped as it is. Host memory is borrowed
//! in place when that is sound (8-byte aligned, and no other argument of the same call covers any
//! of its bytes), else copied into a buffer of its own and, for outputs, copied back after the
//! op — only the view's own elements, since the span's other bytes may belong to another argument
//! (the other slots of a packed gradient).

use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::layout::{checked_bytes, Layout};
use crate::core::tensor::Tensor;

/// The host spans one call has borrowed so far: a later argument overlapping any of them is
/// copied instead (two tensors must never borrow the same bytes).
#[derive(Default, Debug)]
pub struct HostBorrows {
    spans: Vec<(u64, u64)>,
}

/// An argument wrapped for one call: the tensor ops take, and for a host copy where it came from.
pub struct Borrowed {
    /// The argument as ferrite's ops take it (a view of the caller's memory, or of the copy).
    pub t: Tensor,
    copy: Option<HostCopy>,
}

/// A host copy: the caller's address and span, the copy viewed whole (`base`, over `words`).
struct HostCopy {
    ptr: u64,
    bytes: usize,
    base: Tensor,
    // Declared after the tensor that views it, so it is dropped after it.
    _words: Vec<u64>,
}

/// The bytes a view of `shape`/`strides` (offset 0) of `dtype` spans from its first element.
pub fn span_bytes(op: &str, shape: &[usize], strides: &[usize], dtype: DType) -> Result<usize> {
    let layout = Layout::new(shape.to_vec(), strides.to_vec(), 0)?;
    checked_bytes(op, layout.max_offset(op)?, dtype.size_in_bytes())
}

impl HostBorrows {
    /// A call's empty list (nothing borrowed yet).
    pub fn new() -> HostBorrows {
        HostBorrows::default()
    }

    /// Host memory at `ptr` viewed as `shape`/`strides`/`dtype`: borrowed in place, or a copy
    /// (see the module's docs). `op`/`arg` name it in errors; a copy the host cannot hold is
    /// `Error::HostMemory`, not an abort.
    ///
    /// # Safety
    /// The bytes the view spans from `ptr` (`span_bytes`) are host memory readable (and writable,
    /// for an output) for the whole call and touched by nothing else meanwhile; every `Borrowed`
    /// of the call is dropped before the call returns.
    pub unsafe fn wrap(
        &mut self,
        op: &str,
        arg: &str,
        ptr: u64,
        shape: &[usize],
        strides: &[usize],
        dtype: DType,
    ) -> Result<Borrowed> {
        let bytes = span_bytes(op, shape, strides, dtype)?;
        if bytes > 0 && ptr == 0 {
            return Err(Error::bad_arg(
                op,
                arg,
                "a non-null data pointer",
                "a null pointer",
            ));
        }
        let (lo, hi) = (ptr, ptr.saturating_add(bytes as u64));
        let shared = self.spans.iter().any(|&(a, b)| lo < b && a < hi);
        if bytes == 0 || (ptr.is_multiple_of(8) && !shared) {
            self.spans.push((lo, hi));
            // SAFETY: the caller's contract makes the view's `bytes` bytes from `ptr` host memory
            // readable and writable for the call, touched by nothing else; no other argument of
            // this call borrows any of them (checked above: overlapping ones are copies).
            let t = unsafe { Tensor::from_host_ptr(ptr, shape, strides, dtype)? };
            return Ok(Borrowed { t, copy: None });
        }
        let mut words = host_words(op, arg, bytes)?;
        let at = words.as_mut_ptr();
        // SAFETY: the caller's `bytes` bytes at `ptr` are readable (contract) and `words` is a
        // separate allocation of at least `bytes` bytes.
        unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, at as *mut u8, bytes) };
        let span = bytes / dtype.size_in_bytes();
        // SAFETY: `words` is 8-byte aligned, holds `span` elements of the dtype, lives in the
        // `HostCopy` beside the tensor viewing it (dropped after it), and nothing else borrows it.
        let base = unsafe { Tensor::from_host_ptr(at as u64, &[span], &[1], dtype)? };
        let t = base.as_strided(shape, strides, 0)?;
        Ok(Borrowed {
            t,
            copy: Some(HostCopy {
                ptr,
                bytes,
                base,
                _words: words,
            }),
        })
    }
}

/// A zeroed, 8-byte aligned host buffer of at least `bytes` bytes; an error (not an abort) when
/// the host cannot give it.
fn host_words(op: &str, arg: &str, bytes: usize) -> Result<Vec<u64>> {
    let n = bytes.div_ceil(8);
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::HostMemory {
        what: format!("{op}: a host copy of `{arg}`"),
        bytes: bytes as u128,
    })?;
    v.resize(n, 0);
    Ok(v)
}

impl Borrowed {
    /// A tensor that needs no copying back (device memory, or a tensor of the binding's own).
    pub fn direct(t: Tensor) -> Borrowed {
        Borrowed { t, copy: None }
    }

    /// Copies an output held as a host copy back into the caller's memory: the whole span when
    /// the view covers it, else only the view's own elements (runs of whole rows when the last
    /// dim has stride 1).
    pub fn write_back(&self) -> Result<()> {
        let Some(h) = &self.copy else {
            return Ok(());
        };
        if h.bytes == 0 {
            return Ok(());
        }
        let bytes = h.base.to_bytes()?;
        if self.t.is_contiguous() && self.t.nbytes() == h.bytes {
            // SAFETY: `ptr..ptr+bytes` is the caller's writable output span (`wrap`'s contract)
            // and `bytes` (a fresh Vec) does not overlap it.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), h.ptr as *mut u8, h.bytes) };
            return Ok(());
        }
        let es = self.t.dtype().size_in_bytes();
        let r = self.t.rank();
        let rows = (r > 0 && self.t.strides()[r - 1] == 1)
            .then(|| self.t.narrow(r - 1, 0, 1).ok())
            .flatten();
        let (starts, run): (Vec<usize>, usize) = match &rows {
            Some(v) => (v.layout().offsets().collect(), self.t.shape()[r - 1] * es),
            None => (self.t.layout().offsets().collect(), es),
        };
        for off in starts {
            let at = off * es;
            debug_assert!(at + run <= h.bytes);
            // SAFETY: `off` starts a run of the view's own elements, so `at + run ≤ bytes` (the
            // span ends at the view's largest offset); the destination is the caller's writable
            // output memory and the source a separate Vec.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr().add(at),
                    (h.ptr as *mut u8).add(at),
                    run,
                )
            };
        }
        Ok(())
    }
}

/// Writes every output back (see `Borrowed::write_back`).
pub fn write_back_all(outs: &[Option<&Borrowed>]) -> Result<()> {
    outs.iter().flatten().try_for_each(|o| o.write_back())
}

/// The tensor of an optional argument.
pub fn opt_ref(o: &Option<Borrowed>) -> Option<&Tensor> {
    o.as_ref().map(|o| &o.t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_and_unaligned_host_arguments_are_copies_written_back_to_their_own_elements() {
        // A packed [3, 4] f32 buffer: slot 0 and slot 1 (column views, overlapping spans) as two
        // outputs of one call. The first is borrowed in place, the second (its span overlaps)
        // is a copy; writing it back must not touch slot 0's elements.
        let mut buf: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let base = buf.as_mut_ptr() as u64;
        let mut b = HostBorrows::new();
        // SAFETY: `buf` outlives both views and nothing else touches it during the test.
        let s0 = unsafe { b.wrap("t", "a", base, &[3], &[4], DType::F32) }.unwrap();
        let s1 = unsafe { b.wrap("t", "b", base + 4, &[3], &[4], DType::F32) }.unwrap();
        assert!(s0.copy.is_none() && s1.copy.is_some());
        // The op writes slot 0 in place and every element of slot 1's copy (whose span, elements
        // 1..=9, also holds copies of slot 0's elements 4 and 8).
        for (i, v) in [(0, -1.0), (4, -2.0), (8, -3.0)] {
            // SAFETY: inside `buf`, which outlives the views.
            unsafe { *(base as *mut f32).add(i) = v };
        }
        let copy = &s1.copy.as_ref().unwrap().base;
        copy.write_f32(&(100..109).map(|v| v as f32).collect::<Vec<_>>())
            .unwrap();
        s1.write_back().unwrap();
        drop((s0, s1));
        assert_eq!(
            buf,
            [-1.0, 100.0, 2.0, 3.0, -2.0, 104.0, 6.0, 7.0, -3.0, 108.0, 10.0, 11.0]
        );
        // Unaligned: a copy; a null pointer with a non-empty view: an error naming the argument.
        let mut b = HostBorrows::new();
        let mut bytes = [0u8; 12];
        let p = bytes.as_mut_ptr() as u64;
        let odd = if p.is_multiple_of(8) { p + 4 } else { p };
        // SAFETY: 2 f32 (8 bytes) from `odd` lie inside `bytes`.
        let u = unsafe { b.wrap("t", "c", odd, &[2], &[1], DType::F32) }.unwrap();
        assert!(u.copy.is_some());
        // SAFETY: an empty call is refused before any memory is read.
        let e = unsafe { b.wrap("t", "d", 0, &[2], &[1], DType::F32) }
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("`d`") && e.contains("null"), "{e}");
    }
}
