//! The boundary every entry point goes through: panics caught, errors turned into status codes,
//! the thread-local last-error message.

use crate::FerriteStatus;
use ferrite::Error;
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

const EMPTY: &[u8] = b"\0";

fn set_last_error(msg: &str) {
    // Interior NULs would cut the message short in C: shown as spaces instead.
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // A thread being torn down has no slot left: nothing to record then.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

/// Empties the message (without allocating when it is empty already: the common case).
fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|e| {
        if let Ok(mut e) = e.try_borrow_mut() {
            if !e.as_bytes().is_empty() {
                *e = CString::default();
            }
        }
    });
}

pub(crate) fn last_error() -> *const c_char {
    catch_unwind(|| {
        LAST_ERROR
            .try_with(|e| e.borrow().as_ptr())
            .unwrap_or(EMPTY.as_ptr().cast())
    })
    .unwrap_or(EMPTY.as_ptr().cast())
}

/// The status a ferrite error maps to.
pub(crate) fn status_of(e: &Error) -> FerriteStatus {
    match e {
        Error::BadArg { .. } | Error::Overflow { .. } => FerriteStatus::InvalidArgument,
        Error::NoVariant { .. } | Error::UnsupportedArch { .. } => FerriteStatus::Unsupported,
        Error::HostMemory { .. } => FerriteStatus::OutOfMemory,
        Error::CudaUnavailable(_) => FerriteStatus::CudaUnavailable,
        Error::Cuda { msg, .. } | Error::Launch { msg, .. }
            if msg.contains("OUT_OF_MEMORY") || msg.contains("out of memory") =>
        {
            FerriteStatus::OutOfMemory
        }
        Error::Cuda { .. } | Error::Launch { .. } | Error::Compile { .. } => {
            FerriteStatus::CudaError
        }
        Error::Io { .. } | Error::Other(_) => FerriteStatus::Internal,
    }
}

/// The message for `e` raised by entry point `op`: the Rust error's text, prefixed with `op`
/// where the error itself names no op (a CUDA failure, a host allocation, ...).
pub(crate) fn message_of(op: &str, e: &Error) -> String {
    match e {
        Error::BadArg { .. } | Error::Overflow { .. } | Error::NoVariant { .. } => e.to_string(),
        _ => format!("{op}: {e}"),
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| p.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)")
}

/// Runs an entry point's body: clears the last error, catches panics, records the message of a
/// failure and returns its status.
pub(crate) fn call(op: &str, body: impl FnOnce() -> ferrite::Result<()>) -> FerriteStatus {
    clear_last_error();
    let (status, msg) = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return FerriteStatus::Ok,
        Ok(Err(e)) => (status_of(&e), message_of(op, &e)),
        Err(p) => {
            let msg = format!(
                "{op}: internal error in ferrite (a Rust panic): {}",
                panic_text(p.as_ref())
            );
            // Dropping a panic payload can itself panic: keep that inside too.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(p)));
            (FerriteStatus::Internal, msg)
        }
    };
    // Formatting cannot panic here, but recording must not unwind into C either.
    let _ = catch_unwind(AssertUnwindSafe(|| set_last_error(&msg)));
    status
}

pub(crate) fn status_name(status: i32) -> *const c_char {
    let s: &'static [u8] = match status {
        0 => b"FERRITE_STATUS_OK\0",
        1 => b"FERRITE_STATUS_INVALID_ARGUMENT\0",
        2 => b"FERRITE_STATUS_UNSUPPORTED\0",
        3 => b"FERRITE_STATUS_OUT_OF_MEMORY\0",
        4 => b"FERRITE_STATUS_CUDA_UNAVAILABLE\0",
        5 => b"FERRITE_STATUS_CUDA_ERROR\0",
        6 => b"FERRITE_STATUS_INTERNAL\0",
        _ => b"unknown status\0",
    };
    s.as_ptr().cast()
}

const fn parse_u32(s: &str) -> i32 {
    let b = s.as_bytes();
    let mut i = 0;
    let mut v = 0i32;
    while i < b.len() {
        v = v * 10 + (b[i] - b'0') as i32;
        i += 1;
    }
    v
}

pub(crate) const fn version_number() -> i32 {
    parse_u32(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
        + parse_u32(env!("CARGO_PKG_VERSION_MINOR")) * 100
        + parse_u32(env!("CARGO_PKG_VERSION_PATCH"))
}

/// `ferrite_cuda_device_count`.
///
/// # Safety
/// `count` is NULL or valid for writing one i32.
pub(crate) unsafe fn cuda_device_count(count: *mut i32) -> FerriteStatus {
    const OP: &str = "ferrite_cuda_device_count";
    call(OP, || {
        if count.is_null() || !count.is_aligned() {
            return Err(Error::bad_arg(
                OP,
                "count",
                "a non-null, aligned int32_t pointer",
                format!("{count:p}"),
            ));
        }
        let n = ferrite::core::cuda::availability();
        // SAFETY: checked non-null and aligned; writable by the caller's contract.
        unsafe { count.write(n.as_ref().map_or(0, |&n| n.min(i32::MAX as usize) as i32)) };
        n.map(|_| ())
    })
}
