//! One error type for the whole library. Every variant names what went wrong in words a user can
//! act on: the op, the argument, what was expected and what was given; kernel errors name the kernel.

use std::fmt;

/// `std::result::Result` with ferrite's [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, in words a user can act on. `Display` gives the whole message (the
/// Python front raises it as `ValueError`, `MemoryError` or `RuntimeError`; the C API returns it
/// from `ferrite_last_error`).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument of an op does not fit what the op accepts.
    #[error("{op}: argument `{arg}`: expected {expected}, got {got}")]
    BadArg {
        /// The op (or function) that refused the argument.
        op: String,
        /// The argument's name as the op's signature spells it.
        arg: String,
        /// What the op accepts there.
        expected: String,
        /// What it was given (for tensors: shape, strides, dtype and device).
        got: String,
    },

    /// A size computation would overflow 64 bits (or the addressable range).
    #[error("{op}: size overflow: {what}")]
    Overflow {
        /// The op whose size computation overflowed.
        op: String,
        /// The quantity that overflowed.
        what: String,
    },

    /// No CUDA device can be used; the reason says why (no driver, no device, ...).
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),

    /// The device is older than anything ferrite builds kernels for.
    #[error(
        "unsupported GPU architecture sm_{major}{minor} ({name}): ferrite needs sm_80 or newer"
    )]
    UnsupportedArch {
        /// The device's name as the driver reports it.
        name: String,
        /// Compute capability, major part.
        major: i32,
        /// Compute capability, minor part.
        minor: i32,
    },

    /// No variant of an op can run the request, or the named one does not exist / cannot.
    #[error("{op}: {msg}")]
    NoVariant {
        /// The op asked to run.
        op: String,
        /// Why nothing can run it (each variant's reason when one was asked for by name).
        msg: String,
    },

    /// NVRTC could not compile a kernel module; `log` is NVRTC's own log.
    #[error("NVRTC failed to compile `{module}` for {arch} (options: {options}):\n{log}")]
    Compile {
        /// The module's label (family, kernel file and specialisation).
        module: String,
        /// The target it was compiled for (`sm_90a`, ...).
        arch: String,
        /// The compiler options, as passed.
        options: String,
        /// The compiler's log.
        log: String,
    },

    /// A kernel launch (or the work it queued) failed.
    #[error(
        "kernel `{kernel}` (grid {grid:?}, block {block:?}, {smem} B dynamic shared memory): {msg}"
    )]
    Launch {
        /// The kernel's function name.
        kernel: String,
        /// Grid dimensions of the launch.
        grid: (u32, u32, u32),
        /// Block dimensions of the launch.
        block: (u32, u32, u32),
        /// Dynamic shared memory asked for, bytes.
        smem: u32,
        /// The driver's error.
        msg: String,
    },

    /// Any other CUDA driver / cuBLAS / NVRTC call that failed, with the call named.
    #[error("{call}: {msg}")]
    Cuda {
        /// The API call (`cuMemAllocAsync`, `cublasLtMatmul`, ...).
        call: String,
        /// The library's error.
        msg: String,
    },

    /// A host buffer the request needs is larger than the machine can give.
    #[error(
        "{what}: cannot allocate {bytes} bytes of host memory (more than this machine can give)"
    )]
    HostMemory {
        /// The buffer that could not be allocated (op and purpose).
        what: String,
        /// Its size: u128, since the request itself may exceed 64 bits.
        bytes: u128,
    },

    /// A file or device read, write or open failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, with the path.
        context: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// Anything else (data formats, the trainer's run checks), as one message.
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

    /// An [`Error::Cuda`] naming the failed call.
    pub fn cuda(call: impl Into<String>, err: impl fmt::Display) -> Self {
        Error::Cuda {
            call: call.into(),
            msg: err.to_string(),
        }
    }

    /// An [`Error::Io`] with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
