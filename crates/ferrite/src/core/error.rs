//! One error type for the whole library. Every variant names what went wrong in words a user can
//! act on: the op, the argument, what was expected and what was given; kernel errors name the kernel.

use std::fmt;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument of an op does not fit what the op accepts.
    #[error("{op}: argument `{arg}`: expected {expected}, got {got}")]
    BadArg {
        op: String,
        arg: String,
        expected: String,
        got: String,
    },

    /// A size computation would overflow 64 bits (or the addressable range).
    #[error("{op}: size overflow: {what}")]
    Overflow { op: String, what: String },

    /// No CUDA device can be used; the reason says why (no driver, no device, ...).
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),

    /// The device is older than anything ferrite builds kernels for.
    #[error(
        "unsupported GPU architecture sm_{major}{minor} ({name}): ferrite needs sm_80 or newer"
    )]
    UnsupportedArch {
        name: String,
        major: i32,
        minor: i32,
    },

    /// No variant of an op can run the request, or the named one does not exist / cannot.
    #[error("{op}: {msg}")]
    NoVariant { op: String, msg: String },

    /// NVRTC could not compile a kernel module; `log` is NVRTC's own log.
    #[error("NVRTC failed to compile `{module}` for {arch} (options: {options}):\n{log}")]
    Compile {
        module: String,
        arch: String,
        options: String,
        log: String,
    },

    /// A kernel launch (or the work it queued) failed.
    #[error(
        "kernel `{kernel}` (grid {grid:?}, block {block:?}, {smem} B dynamic shared memory): {msg}"
    )]
    Launch {
        kernel: String,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        msg: String,
    },

    /// Any other CUDA driver / cuBLAS / NVRTC call that failed, with the call named.
    #[error("{call}: {msg}")]
    Cuda { call: String, msg: String },

    /// A host buffer the request needs is larger than the machine can give.
    #[error(
        "{what}: cannot allocate {bytes} bytes of host memory (more than this machine can give)"
    )]
    HostMemory { what: String, bytes: u128 },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    #[error("{0}")]
    Other(String),
}

impl Error {
    /// Shorthand for the most common error: a bad argument.
    pub fn bad_arg(
        op: impl Into<String>,
        arg: impl Into<String>,
        expected: impl fmt::Display,
        got: impl fmt::Display,
    ) -> Self {
        Error::BadArg {
            op: op.into(),
            arg: arg.into(),
            expected: expected.to_string(),
            got: got.to_string(),
        }
    }

    pub fn cuda(call: impl Into<String>, err: impl fmt::Display) -> Self {
        Error::Cuda {
            call: call.into(),
            msg: err.to_string(),
        }
    }

    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
