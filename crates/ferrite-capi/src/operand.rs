//! From C descriptors to ferrite tensors, the way the PyTorch binding (crates/ferrite-py) wraps
//! its descriptors: device memory as `Tensor::from_device_ptr` on the caller's stream, host memory
//! borrowed in place with `Tensor::from_host_ptr` where that is sound (8-byte aligned, and no
//! byte of it borrowed already in this call) and otherwise copied in (and, for an output, copied
//! back after the op, element by element of the view). Before any of that, everything a C caller
//! can get wrong about a descriptor is checked here and refused with an error naming the argument.

use crate::{FerriteDevice, FerriteDtype, FerriteTensor, FERRITE_DEVICE_CPU, FERRITE_DEVICE_CUDA};
use cudarc::driver::sys;
use ferrite::core::borrow::HostBorrows;
pub(crate) use ferrite::core::borrow::{opt_ref, write_back_all, Borrowed as Operand};
use ferrite::core::cuda::{self as fcuda, CudaDevice, Stream};
use ferrite::{DType, Error, Result, Tensor};
use std::ffi::c_void;
use std::sync::Arc;

/// The dtype of a code, or None.
pub(crate) fn dtype_of(code: FerriteDtype) -> Option<DType> {
    Some(match code.0 {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::BF16,
        3 => DType::I32,
        4 => DType::I64,
        5 => DType::U8,
        6 => DType::U16,
        7 => DType::U32,
        _ => return None,
    })
}

const DTYPE_CODES: &str =
    "a FERRITE_DTYPE_* code (0 f32, 1 f16, 2 bf16, 3 i32, 4 i64, 5 u8, 6 u16, 7 u32)";

/// Where this call runs.
enum Target {
    Cpu,
    Cuda {
        dev: Arc<CudaDevice>,
        stream: Stream,
    },
}

/// One entry point's call: its name (for errors), its target, and the host spans borrowed so far.
pub(crate) struct Call {
    op: &'static str,
    target: Target,
    borrows: HostBorrows,
    // Dropped last: the calling thread's CUDA context as it was before the call.
    _restore: Option<CtxRestore>,
}

/// Makes its context the calling thread's current CUDA context again when dropped: ferrite binds
/// the device's primary context to run its work, and a C caller's thread keeps whatever context
/// it had (the primary one for CUDA runtime users, its own for driver API users).
struct CtxRestore(sys::CUcontext);

impl CtxRestore {
    /// The thread's current context, once the driver is known to be usable (`availability`).
    fn capture() -> Option<CtxRestore> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; the driver library is loaded and initialised
        // (the caller checked `availability()` first, so this cannot hit a missing library).
        let r = unsafe { sys::cuCtxGetCurrent(&mut ctx) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(CtxRestore(ctx))
    }
}

impl Drop for CtxRestore {
    fn drop(&mut self) {
        // SAFETY: the context was current on this thread when captured and the caller keeps it
        // alive across its own call; a null context just unbinds the thread. Failures leave the
        // thread as ferrite left it, which is no worse than not restoring.
        let _ = unsafe { sys::cuCtxSetCurrent(self.0) };
    }
}

/// A descriptor read and checked: its pointer, shape, strides, dtype and the bytes its view spans.
struct Desc {
    ptr: u64,
    shape: Vec<usize>,
    strides: Vec<usize>,
    dtype: DType,
    bytes: usize,
}

/// `Error::bad_arg`, shorter.
pub(crate) fn bad(
    op: &str,
    arg: &str,
    expected: impl std::fmt::Display,
    got: impl std::fmt::Display,
) -> Error {
    Error::bad_arg(op, arg, expected, got)
}

/// `n` int64 values at `p`, checked to be a readable-looking array (non-null, aligned).
///
/// # Safety
/// A non-null, aligned `p` points to `n` readable int64 values.
unsafe fn read_i64s(op: &str, arg: &str, what: &str, p: *const i64, n: usize) -> Result<Vec<i64>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() || !p.is_aligned() {
        return Err(bad(
            op,
            arg,
            format!("`{what}`: a non-null, 8-byte aligned array of {n} int64_t"),
            format!("{p:p}"),
        ));
    }
    // SAFETY: non-null and aligned (checked above); `n` readable values by the contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
}

/// Reads and checks the descriptor `d` of argument `arg`.
///
/// # Safety
/// A non-null, aligned `d` points to a readable `FerriteTensor` whose non-null, aligned `shape`
/// and `strides` hold `ndim` readable entries.
unsafe fn read_desc(op: &str, arg: &str, d: *const FerriteTensor) -> Result<Desc> {
    if d.is_null() {
        return Err(bad(op, arg, "a FerriteTensor", "a null pointer"));
    }
    if !d.is_aligned() {
        return Err(bad(
            op,
            arg,
            "an aligned FerriteTensor pointer",
            format!("{d:p}"),
        ));
    }
    // SAFETY: non-null and aligned (checked above), readable by the caller's contract.
    let d = unsafe { d.read() };
    if !(0..=crate::FERRITE_MAX_DIMS).contains(&d.ndim) {
        return Err(bad(
            op,
            arg,
            format!("ndim in 0..={}", crate::FERRITE_MAX_DIMS),
            d.ndim,
        ));
    }
    let dtype = dtype_of(d.dtype).ok_or_else(|| bad(op, arg, DTYPE_CODES, d.dtype.0))?;
    let n = d.ndim as usize;
    // SAFETY: forwarded to this function's contract.
    let shape = unsafe { read_i64s(op, arg, "shape", d.shape, n)? };
    if let Some(i) = shape.iter().position(|&s| s < 0) {
        return Err(bad(
            op,
            arg,
            "sizes ≥ 0",
            format!("shape {shape:?} (shape[{i}] = {})", shape[i]),
        ));
    }
    let shape: Vec<usize> = shape.iter().map(|&s| s as usize).collect();
    let strides: Vec<usize> = if d.strides.is_null() {
        ferrite::core::layout::contiguous_strides(&shape)
    } else {
        // SAFETY: forwarded to this function's contract.
        let s = unsafe { read_i64s(op, arg, "strides", d.strides, n)? };
        if let Some(i) = s.iter().position(|&v| v < 0) {
            return Err(bad(
                op,
                arg,
                "strides ≥ 0 (in elements; NULL for row-major)",
                format!("strides {s:?} (strides[{i}] = {})", s[i]),
            ));
        }
        s.iter().map(|&v| v as usize).collect()
    };
    // The element count and the span (one past the largest offset), checked in 64 bits, then in
    // bytes against isize::MAX: a size the address space cannot hold is refused, never wrapped.
    let too_big = || {
        bad(
            op,
            arg,
            "a view whose bytes fit in the address space",
            format!("{dtype} shape {shape:?} strides {strides:?}"),
        )
    };
    shape
        .iter()
        .try_fold(1usize, |a, &s| a.checked_mul(s))
        .ok_or_else(too_big)?;
    let span = if shape.contains(&0) {
        0
    } else {
        shape
            .iter()
            .zip(&strides)
            .try_fold(1usize, |end, (&s, &st)| {
                (s - 1).checked_mul(st).and_then(|x| end.checked_add(x))
            })
            .ok_or_else(too_big)?
    };
    let bytes = span
        .checked_mul(dtype.size_in_bytes())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(too_big)?;
    let ptr = d.data as u64;
    if bytes > 0 {
        if ptr == 0 {
            return Err(bad(op, arg, "a non-null data pointer", "a null pointer"));
        }
        if ptr.checked_add(bytes as u64).is_none() {
            return Err(bad(
                op,
                arg,
                "a data span inside the address space",
                format!("{bytes} bytes from {ptr:#x}"),
            ));
        }
        let align = dtype.size_in_bytes() as u64;
        if !ptr.is_multiple_of(align) {
            return Err(bad(
                op,
                arg,
                format!("a data pointer aligned to {align} bytes ({dtype})"),
                format!("{ptr:#x}"),
            ));
        }
    }
    Ok(Desc {
        ptr,
        shape,
        strides,
        dtype,
        bytes,
    })
}

impl Call {
    /// The call's target from the caller's device selector.
    pub(crate) fn new(op: &'static str, device: FerriteDevice) -> Result<Call> {
        let mut restore = None;
        let target = match device.kind {
            FERRITE_DEVICE_CPU => {
                if !device.stream.is_null() {
                    return Err(bad(
                        op,
                        "device.stream",
                        "NULL for the CPU",
                        format!("{:p}", device.stream),
                    ));
                }
                Target::Cpu
            }
            FERRITE_DEVICE_CUDA => {
                if device.index < 0 {
                    return Err(bad(
                        op,
                        "device.index",
                        "a CUDA device ordinal ≥ 0",
                        device.index,
                    ));
                }
                fcuda::availability()?;
                restore = CtxRestore::capture();
                let dev = fcuda::device(device.index as usize).map_err(|e| match e {
                    Error::BadArg { expected, got, .. } => bad(
                        op,
                        "device.index",
                        format!("a CUDA device ordinal {expected}"),
                        got,
                    ),
                    other => other,
                })?;
                let stream = wrap_stream(op, &dev, device.stream)?;
                Target::Cuda { dev, stream }
            }
            other => {
                return Err(bad(
                    op,
                    "device.kind",
                    "FERRITE_DEVICE_CPU (0) or FERRITE_DEVICE_CUDA (1)",
                    other.0,
                ))
            }
        };
        Ok(Call {
            op,
            target,
            borrows: HostBorrows::new(),
            _restore: restore,
        })
    }

    pub(crate) fn op(&self) -> &'static str {
        self.op
    }

    /// The stream ops run on (CUDA), None on the CPU.
    pub(crate) fn stream(&self) -> Option<Stream> {
        match &self.target {
            Target::Cpu => None,
            Target::Cuda { stream, .. } => Some(stream.clone()),
        }
    }

    /// A new tensor on this call's device (on CUDA: allocated and freed in stream order on the
    /// call's stream), for buffers an op needs that the C API does not ask the caller for.
    pub(crate) fn scratch(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        match &self.target {
            Target::Cpu => Tensor::empty(shape, dtype, ferrite::Device::Cpu),
            Target::Cuda { dev, stream } => Tensor::empty_on(shape, dtype, dev, stream),
        }
    }

    /// Wraps the required argument `arg`.
    ///
    /// # Safety
    /// `d` is NULL or points to a descriptor that meets the crate's pointer contract (lib.rs).
    pub(crate) unsafe fn tensor(&mut self, arg: &str, d: *const FerriteTensor) -> Result<Operand> {
        // SAFETY: forwarded to this function's contract.
        let desc = unsafe { read_desc(self.op, arg, d)? };
        self.wrap(arg, desc)
    }

    /// Wraps the optional argument `arg` (NULL: not given).
    ///
    /// # Safety
    /// As for `Call::tensor`.
    pub(crate) unsafe fn opt_tensor(
        &mut self,
        arg: &str,
        d: *const FerriteTensor,
    ) -> Result<Option<Operand>> {
        if d.is_null() {
            return Ok(None);
        }
        // SAFETY: forwarded to this function's contract.
        unsafe { self.tensor(arg, d) }.map(Some)
    }

    fn wrap(&mut self, arg: &str, d: Desc) -> Result<Operand> {
        let op = self.op;
        match &self.target {
            Target::Cuda { dev, .. } => {
                if d.bytes > 0 {
                    check_device_memory(op, arg, dev, d.ptr, d.bytes)?;
                }
                // SAFETY: the pointer is device memory of `dev` whose allocation holds the view's
                // whole span (checked just above where the driver can tell; the caller's contract
                // otherwise), alive for the call; ferrite never frees borrowed memory.
                let t = unsafe {
                    Tensor::from_device_ptr(dev.clone(), d.ptr, &d.shape, &d.strides, d.dtype)?
                };
                Ok(Operand::direct(t))
            }
            // SAFETY: by the caller's contract the view's bytes from `ptr` are host memory
            // readable (and writable for outputs) for the whole call and touched by nobody else
            // meanwhile; every operand is dropped before the entry point returns.
            Target::Cpu => unsafe {
                self.borrows
                    .wrap(op, arg, d.ptr, &d.shape, &d.strides, d.dtype)
            },
        }
    }
}

/// Wraps the caller's stream after checking that it belongs to `dev`'s primary context. NULL and
/// the special handles `CU_STREAM_LEGACY` (1) and `CU_STREAM_PER_THREAD` (2) name the default
/// streams of whatever context is current, which ferrite makes `dev`'s.
fn wrap_stream(op: &str, dev: &Arc<CudaDevice>, raw: *mut c_void) -> Result<Stream> {
    let addr = raw as u64;
    if addr > 2 {
        dev.bind()?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer. A handle that is not a live stream makes the
        // driver return an error code, which is reported.
        let r = unsafe { sys::cuStreamGetCtx(raw as sys::CUstream, &mut ctx) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(bad(
                op,
                "device.stream",
                format!(
                    "a live cudaStream_t of cuda:{} (or NULL for the default stream)",
                    dev.ordinal()
                ),
                format!("{raw:p} (cuStreamGetCtx: {r:?})"),
            ));
        }
        if ctx != dev.context().cu_ctx() {
            return Err(bad(
                op,
                "device.stream",
                format!(
                    "a stream of cuda:{}'s primary context (the one the CUDA runtime uses)",
                    dev.ordinal()
                ),
                format!("{raw:p}, a stream of another context"),
            ));
        }
    }
    // SAFETY: `raw` is a live stream of `dev`'s primary context (checked above) or one of the
    // default-stream handles; the caller keeps it alive for the call, and the handle made here is
    // dropped before the call returns (ferrite never destroys a borrowed stream).
    unsafe { dev.wrap_stream(addr) }
}

/// Checks that `ptr..ptr+bytes` is memory a kernel on `dev` can use: device memory of `dev`
/// (cudaMalloc, cudaMallocAsync) whose allocation holds the whole span, managed memory, or pinned
/// host memory (cudaMallocHost / cudaHostRegister, mapped into the device's address space).
fn check_device_memory(
    op: &str,
    arg: &str,
    dev: &CudaDevice,
    ptr: u64,
    bytes: usize,
) -> Result<()> {
    use sys::CUpointer_attribute::*;
    dev.bind()?;
    let expected = || {
        format!(
            "device memory of cuda:{} (cudaMalloc, cudaMallocAsync, managed or pinned host memory)",
            dev.ordinal()
        )
    };
    let attr = |a: sys::CUpointer_attribute, out: *mut c_void| -> sys::CUresult {
        // SAFETY: `out` points to a value of the size the attribute writes (u32 for the memory
        // type, i32 for the ordinal, u64 for the range start, usize for the range size).
        unsafe { sys::cuPointerGetAttribute(out, a, ptr) }
    };
    let mut mem_type: u32 = 0;
    if attr(
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        &mut mem_type as *mut u32 as *mut c_void,
    ) != sys::CUresult::CUDA_SUCCESS
    {
        return Err(bad(
            op,
            arg,
            expected(),
            format!("{ptr:#x}, an address CUDA does not know (host memory from malloc?)"),
        ));
    }
    if mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        // Managed or pinned host memory: reachable from every device.
        return Ok(());
    }
    let mut ordinal: i32 = -1;
    if attr(
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        &mut ordinal as *mut i32 as *mut c_void,
    ) == sys::CUresult::CUDA_SUCCESS
        && ordinal != dev.ordinal() as i32
    {
        return Err(bad(
            op,
            arg,
            expected(),
            format!("{ptr:#x}, memory of cuda:{ordinal}"),
        ));
    }
    let (mut start, mut size): (u64, usize) = (0, 0);
    if attr(
        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        &mut start as *mut u64 as *mut c_void,
    ) == sys::CUresult::CUDA_SUCCESS
        && attr(
            CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            &mut size as *mut usize as *mut c_void,
        ) == sys::CUresult::CUDA_SUCCESS
        && size > 0
    {
        let end = start.saturating_add(size as u64);
        if ptr.saturating_add(bytes as u64) > end {
            return Err(bad(
                op,
                arg,
                format!("a view inside its allocation ({bytes} bytes from the data pointer)"),
                format!(
                    "{ptr:#x}, whose allocation ends {} bytes after it",
                    end.saturating_sub(ptr)
                ),
            ));
        }
    }
    Ok(())
}
