//! # ferrite_capi — ferrite's ops for C (and anything that can call C)
//!
//! Built as `libferrite_capi.so` (cdylib) and `libferrite_capi.a` (staticlib); the header is
//! `include/ferrite.h`, generated from this crate by cbindgen (`src/tests/header.rs` checks that
//! the checked-in copy is current; `FERRITE_BLESS=1 cargo test -p ferrite-capi header` rewrites
//! it), and `ferrite.pc.in` is its pkg-config template (see the README of this crate).
//!
//! **Conventions.** Every op is a function `FerriteStatus ferrite_<op>(FerriteDevice device, ...)`
//! that writes into caller-provided outputs and returns a status code; on anything but
//! `FERRITE_STATUS_OK`, `ferrite_last_error()` returns the message (the text of the Rust error,
//! naming the op, the argument, what was expected and what was given). Tensors are described by
//! `FerriteTensor`: a data pointer, `ndim` sizes and strides (in elements; NULL strides:
//! row-major contiguous) and a dtype code. The `FerriteDevice` says where the pointers live:
//! host memory (the CPU path) or device memory of one CUDA device (the CUDA path, on the given
//! `cudaStream_t` / `CUstream`; NULL is the legacy default stream). CUDA work is queued on that
//! stream and the call returns without waiting for it, except where an op documents a read-back
//! (cross-entropy's target check, decode's index check).
//!
//! **Checked at the boundary**: NULL pointers, `ndim` outside 0..=8, negative sizes or strides,
//! sizes whose byte span overflows, unknown dtype / device / enum codes, data pointers not aligned
//! to their dtype, on CUDA a pointer that is not device memory of the chosen device or whose
//! allocation is smaller than the view, and a stream of another context. Everything else (shapes,
//! dtypes, layouts) is checked by ferrite itself. Panics never cross the boundary: each entry
//! point catches them and returns `FERRITE_STATUS_INTERNAL`.
//!
//! **What cannot be checked** (the caller's contract, stated once here for every entry point):
//! each non-NULL `FerriteTensor` pointer points to a readable descriptor whose `shape` (and
//! `strides`, when non-NULL) arrays hold `ndim` entries; a host tensor's data is memory this
//! process may read (and, for an output, write) over every element the view addresses; nothing
//! else reads or writes an output, or writes an input, while the call runs (on CUDA: until the
//! stream has passed the op's work). An output sharing elements with another argument is refused
//! where ferrite can see it and otherwise gives copy-in/copy-out results on the CPU and undefined
//! results on CUDA; in-place forms are explicit (`grad_in_place`, AdamW's state, the KV caches).

#![deny(unsafe_op_in_unsafe_fn)]

mod boundary;
mod operand;
mod ops;
#[cfg(test)]
mod tests;

pub use ops::*;

use std::ffi::{c_char, c_void};

/// The status every entry point returns.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FerriteStatus {
    /// The call succeeded (on CUDA: its work is queued on the stream).
    Ok = 0,
    /// An argument does not fit what the op accepts: a NULL pointer, a negative or overflowing
    /// size, an unknown code, a misaligned pointer, a shape or dtype the op refuses.
    InvalidArgument = 1,
    /// The arguments are valid but no implementation runs them here (a dtype the CPU path of the
    /// op lacks, a GPU older than sm_80, ...).
    Unsupported = 2,
    /// Host or device memory could not be allocated.
    OutOfMemory = 3,
    /// The CUDA path was asked for and CUDA cannot be used (no driver, no device): the message
    /// says why.
    CudaUnavailable = 4,
    /// A CUDA driver, NVRTC, cuBLAS call or a kernel launch failed.
    CudaError = 5,
    /// A bug in ferrite (a caught Rust panic) or an unexpected failure.
    Internal = 6,
}

/// A dtype code (`FERRITE_DTYPE_*`). Any other value is refused with
/// `FERRITE_STATUS_INVALID_ARGUMENT`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FerriteDtype(pub i32);

/// 32-bit IEEE float.
pub const FERRITE_DTYPE_F32: FerriteDtype = FerriteDtype(0);
/// 16-bit IEEE float (`__half`).
pub const FERRITE_DTYPE_F16: FerriteDtype = FerriteDtype(1);
/// bfloat16 (`__nv_bfloat16`).
pub const FERRITE_DTYPE_BF16: FerriteDtype = FerriteDtype(2);
/// `int32_t` (indices: block tables, sequence lengths, slots, cumulative lengths, targets).
pub const FERRITE_DTYPE_I32: FerriteDtype = FerriteDtype(3);
/// `int64_t` (cross-entropy targets as PyTorch stores them).
pub const FERRITE_DTYPE_I64: FerriteDtype = FerriteDtype(4);
/// `uint8_t`.
pub const FERRITE_DTYPE_U8: FerriteDtype = FerriteDtype(5);
/// `uint16_t`.
pub const FERRITE_DTYPE_U16: FerriteDtype = FerriteDtype(6);
/// `uint32_t`.
pub const FERRITE_DTYPE_U32: FerriteDtype = FerriteDtype(7);

/// Where an op runs (`FERRITE_DEVICE_*`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FerriteDeviceKind(pub i32);

/// Host memory, the CPU path.
pub const FERRITE_DEVICE_CPU: FerriteDeviceKind = FerriteDeviceKind(0);
/// Device memory of CUDA device `index`, the CUDA path.
pub const FERRITE_DEVICE_CUDA: FerriteDeviceKind = FerriteDeviceKind(1);

/// The device an op runs on and, for CUDA, the stream it runs on.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteDevice {
    /// `FERRITE_DEVICE_CPU` or `FERRITE_DEVICE_CUDA`.
    pub kind: FerriteDeviceKind,
    /// The CUDA device ordinal (as `cudaSetDevice` counts); 0 for the CPU.
    pub index: i32,
    /// CUDA: a `cudaStream_t` / `CUstream` of that device's primary context (the one the CUDA
    /// runtime uses); NULL is the legacy default stream. The CPU: NULL.
    pub stream: *mut c_void,
}

/// The largest `ndim` a `FerriteTensor` may have.
pub const FERRITE_MAX_DIMS: i32 = 8;

/// A tensor: memory owned by the caller, viewed with sizes and strides. Nothing is copied or
/// freed by ferrite (CPU views that are not 8-byte aligned, or that overlap another argument, are
/// copied in, and outputs copied back, within the call).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteTensor {
    /// The first element (host or device memory, as the call's `FerriteDevice` says), aligned
    /// to the dtype's size. May be NULL only when the tensor has no elements.
    pub data: *mut c_void,
    /// `ndim` sizes, each ≥ 0. May be NULL when `ndim` is 0 (a scalar).
    pub shape: *const i64,
    /// `ndim` strides in elements, each ≥ 0, or NULL for row-major contiguous.
    pub strides: *const i64,
    /// The number of dims, 0 to `FERRITE_MAX_DIMS`.
    pub ndim: i32,
    /// A `FERRITE_DTYPE_*` code.
    pub dtype: FerriteDtype,
}

/// An activation code (`FERRITE_ACTIVATION_*`): linear's epilogue, the MoE experts' gate.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FerriteActivation(pub i32);

/// The identity.
pub const FERRITE_ACTIVATION_NONE: FerriteActivation = FerriteActivation(0);
/// max(v, 0).
pub const FERRITE_ACTIVATION_RELU: FerriteActivation = FerriteActivation(1);
/// GELU, tanh approximation.
pub const FERRITE_ACTIVATION_GELU_TANH: FerriteActivation = FerriteActivation(2);
/// GELU, exact (erf).
pub const FERRITE_ACTIVATION_GELU_ERF: FerriteActivation = FerriteActivation(3);
/// SiLU / swish: v·σ(v).
pub const FERRITE_ACTIVATION_SILU: FerriteActivation = FerriteActivation(4);

/// The dims of attention's q, k, v, o (`FERRITE_ATTENTION_LAYOUT_*`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FerriteAttentionLayout(pub i32);

/// `[batch, seq, heads, head_dim]` (flash-attn's).
pub const FERRITE_ATTENTION_LAYOUT_BSHD: FerriteAttentionLayout = FerriteAttentionLayout(0);
/// `[batch, heads, seq, head_dim]` (PyTorch SDPA's).
pub const FERRITE_ATTENTION_LAYOUT_BHSD: FerriteAttentionLayout = FerriteAttentionLayout(1);

/// How cross-entropy combines the per-row losses (`FERRITE_REDUCTION_*`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FerriteReduction(pub i32);

/// The mean over the rows not ignored.
pub const FERRITE_REDUCTION_MEAN: FerriteReduction = FerriteReduction(0);
/// The sum.
pub const FERRITE_REDUCTION_SUM: FerriteReduction = FerriteReduction(1);
/// None: the per-row losses are the result (the scalar output, if asked, is their sum).
pub const FERRITE_REDUCTION_NONE: FerriteReduction = FerriteReduction(2);

/// How the MoE router scores experts (`FERRITE_MOE_SCORE_*`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FerriteMoeScore(pub i32);

/// softmax over the experts (Mixtral, Qwen3-MoE).
pub const FERRITE_MOE_SCORE_SOFTMAX: FerriteMoeScore = FerriteMoeScore(0);
/// sigmoid per expert (DeepSeek-V3).
pub const FERRITE_MOE_SCORE_SIGMOID: FerriteMoeScore = FerriteMoeScore(1);

/// The library's version, major part (this header's; `ferrite_version_number()` is the
/// library's).
pub const FERRITE_VERSION_MAJOR: i32 = 0;
/// The library's version, minor part.
pub const FERRITE_VERSION_MINOR: i32 = 1;
/// The library's version, patch part.
pub const FERRITE_VERSION_PATCH: i32 = 0;

const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

/// The version of the library, e.g. "0.1.0" (a static string).
#[no_mangle]
pub extern "C" fn ferrite_version() -> *const c_char {
    VERSION.as_ptr().cast()
}

/// The version of the library as major·10000 + minor·100 + patch (compare with the header's
/// `FERRITE_VERSION_*`).
#[no_mangle]
pub extern "C" fn ferrite_version_number() -> i32 {
    boundary::version_number()
}

/// The message of the last call on this thread that did not return `FERRITE_STATUS_OK`, or ""
/// after a call that did. Never NULL; valid until the next ferrite call on this thread.
#[no_mangle]
pub extern "C" fn ferrite_last_error() -> *const c_char {
    boundary::last_error()
}

/// A static name for a status code ("FERRITE_STATUS_OK", ...; "unknown status" for other values).
#[no_mangle]
pub extern "C" fn ferrite_status_name(status: i32) -> *const c_char {
    boundary::status_name(status)
}

/// A `FerriteDevice` for the CPU path (host pointers).
#[no_mangle]
pub extern "C" fn ferrite_device_cpu() -> FerriteDevice {
    FerriteDevice {
        kind: FERRITE_DEVICE_CPU,
        index: 0,
        stream: std::ptr::null_mut(),
    }
}

/// A `FerriteDevice` for CUDA device `index` and `stream` (NULL: the legacy default stream).
#[no_mangle]
pub extern "C" fn ferrite_device_cuda(index: i32, stream: *mut c_void) -> FerriteDevice {
    FerriteDevice {
        kind: FERRITE_DEVICE_CUDA,
        index,
        stream,
    }
}

/// Writes the number of CUDA devices ferrite can use to `*count`. Without a usable CUDA driver
/// or device: `*count` = 0 and `FERRITE_STATUS_CUDA_UNAVAILABLE`, with the reason in
/// `ferrite_last_error()`.
///
/// # Safety
/// `count` is NULL (refused) or points to writable memory for one `int32_t`.
#[no_mangle]
pub unsafe extern "C" fn ferrite_cuda_device_count(count: *mut i32) -> FerriteStatus {
    // SAFETY: forwarded to this function's contract.
    unsafe { boundary::cuda_device_count(count) }
}
