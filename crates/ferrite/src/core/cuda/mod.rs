//! The CUDA runtime layer: finding the driver (dynamically, so ferrite runs without CUDA), one
//! primary context per device, streams, events, device and page-locked host memory, kernel
//! launches that name the kernel when they fail.
//!
//! Memory ordering contract: ferrite allocates with `cuMemAllocAsync` on the device's own stream
//! and runs each op on the stream it is given (the device's stream when none is given). A caller
//! who passes another stream (PyTorch's current stream, a CUDA-graph capture stream) orders that
//! stream against ferrite's own, exactly as with two PyTorch streams.

// cuBLAS handles (the benches' vendor peers) and the launch geometry of row-wise kernels: used by
// the op families' CUDA host code and benches, not an interface of their own.
#[doc(hidden)]
pub mod blas;
pub mod jit;
#[doc(hidden)]
pub mod rows;
pub mod tma;

use super::device::Arch;
use super::error::{Error, Result};
use cudarc::driver::{result as drv, sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// cudarc's stream type, which [`Stream`] wraps (for callers that create streams with cudarc).
pub use cudarc::driver::CudaStream as RawStream;

/// A stream ops can run on: ferrite's own or one borrowed from a caller.
pub type Stream = Arc<CudaStream>;

/// Whether `stream` is capturing a CUDA graph (PyTorch's `reduce-overhead` mode, a user's
/// `torch.cuda.graph`): nothing may synchronise on it or time it then, so tuners take their
/// remembered or default choice. A query error counts as capturing (the cautious answer).
pub fn is_capturing(stream: &Stream) -> bool {
    // SAFETY: the stream is live for as long as the Arc is held.
    match unsafe { cudarc::driver::result::stream::is_capturing(stream.cu_stream()) } {
        Ok(s) => s != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
        Err(_) => true,
    }
}

/// Libraries the loader may not find on its own: preloading them by full path makes the later
/// `dlopen` by soname (inside cudarc) find the already-loaded copy.
fn preload_cuda_libraries() {
    let mut roots: Vec<String> = Vec::new();
    for var in ["FERRITE_CUDA_LIB_DIR", "CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            roots.push(v.clone());
            roots.push(format!("{v}/lib64"));
            roots.push(format!("{v}/lib"));
        }
    }
    roots.push("/usr/local/cuda/lib64".into());
    roots.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    for lib in ["libnvrtc.so.13", "libcublas.so.13", "libcublasLt.so.13"] {
        for root in &roots {
            let p = std::path::Path::new(root).join(lib);
            if p.exists() {
                // SAFETY: loading a CUDA library runs its initialisers, which have no
                // preconditions; the handle is leaked on purpose so the library stays loaded.
                if let Ok(l) = unsafe { libloading::Library::new(&p) } {
                    std::mem::forget(l);
                    break;
                }
            }
        }
    }
}

/// Whether CUDA can be used, and if not, why. Computed once. `FERRITE_DISABLE_CUDA=1` forces the
/// CPU-only path (used by tests of that path on GPU machines).
pub fn availability() -> Result<usize> {
    static AVAIL: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    AVAIL
        .get_or_init(|| {
            if std::env::var("FERRITE_DISABLE_CUDA").is_ok_and(|v| v != "0" && !v.is_empty()) {
                return Err("disabled by FERRITE_DISABLE_CUDA".into());
            }
            preload_cuda_libraries();
            // SAFETY: only probes whether the library can be opened.
            if !unsafe { sys::is_culib_present() } {
                return Err("no CUDA driver library (libcuda.so) found by the loader".into());
            }
            // cudarc panics when a symbol is missing (a driver older than CUDA 13); turn that into
            // a reason instead of a crash.
            let probe = std::panic::catch_unwind(|| {
                drv::init().map_err(|e| format!("cuInit failed: {e}"))?;
                CudaContext::device_count().map_err(|e| format!("cuDeviceGetCount failed: {e}"))
            });
            match probe {
                Ok(Ok(0)) => Err("the CUDA driver reports no devices".into()),
                Ok(Ok(n)) => Ok(n as usize),
                Ok(Err(e)) => Err(e),
                Err(_) => Err("the CUDA driver is too old for CUDA 13 (missing symbols)".into()),
            }
        })
        .clone()
        .map_err(Error::CudaUnavailable)
}

/// Whether NVRTC can be loaded (kernels can be compiled, with or without a GPU).
pub fn nvrtc_available() -> Result<()> {
    preload_cuda_libraries();
    // SAFETY: only probes whether the library can be opened.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::CudaUnavailable(
            "NVRTC (libnvrtc.so.13) not found: install the CUDA toolkit or the nvidia-cuda-nvrtc \
             wheel and put its lib folder on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// Properties read once from the device.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceProps {
    /// The device's name (`NVIDIA H100 80GB HBM3`, ...).
    pub name: String,
    /// Its ordinal, as in [`Device::Cuda`](crate::Device::Cuda).
    pub ordinal: usize,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// L2 cache, bytes.
    pub l2_bytes: u64,
    /// Device memory, bytes.
    pub total_mem: u64,
    /// The most shared memory one block may opt into, bytes.
    pub smem_per_block_optin: u32,
    /// Shared memory per SM, bytes.
    pub smem_per_sm: u32,
    /// Resident threads per SM at most.
    pub max_threads_per_sm: u32,
    /// 32-bit registers per SM.
    pub regs_per_sm: u32,
    /// Peak SM clock, kHz.
    pub clock_khz: u32,
    /// Peak memory clock, kHz.
    pub mem_clock_khz: u32,
    /// Memory bus width, bits.
    pub mem_bus_bits: u32,
    /// The NVRTC target kernels are built for (`sm_90a`, ...).
    pub target: String,
}

/// One GPU: its primary context, ferrite's stream on it, and the kernels loaded into it.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Stream,
    arch: Arch,
    props: DeviceProps,
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice({} {})", self.props.ordinal, self.props.name)
    }
}

/// The architecture of `device` when it is a GPU (None on the CPU): what variant selection and
/// the checks compare a variant's minimum architecture with.
pub fn arch_of(device: super::device::Device) -> Result<Option<Arch>> {
    match device {
        super::device::Device::Cuda(i) => Ok(Some(self::device(i)?.arch())),
        super::device::Device::Cpu => Ok(None),
    }
}

/// The device for `ordinal`, created once (retaining the primary context, the one PyTorch uses).
pub fn device(ordinal: usize) -> Result<Arc<CudaDevice>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    let count = availability()?;
    if ordinal >= count {
        return Err(Error::bad_arg(
            "cuda device",
            "ordinal",
            format!("< {count} (devices present)"),
            ordinal,
        ));
    }
    let mut map = DEVICES.get_or_init(Default::default).lock().unwrap();
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = Arc::new(CudaDevice::open(ordinal)?);
    map.insert(ordinal, d.clone());
    Ok(d)
}

impl CudaDevice {
    fn open(ordinal: usize) -> Result<Self> {
        let ctx =
            CudaContext::new(ordinal).map_err(|e| Error::cuda("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: ferrite passes raw device pointers to kernels and orders work by streams itself
        // (see the module comment), so cudarc's per-slice event tracking is not used.
        unsafe { ctx.disable_event_tracking() };
        let attr = |a: sys::CUdevice_attribute| -> Result<u32> {
            ctx.attribute(a)
                .map(|v| v as u32)
                .map_err(|e| Error::cuda("cuDeviceGetAttribute", e))
        };
        use sys::CUdevice_attribute::*;
        let name = ctx.name().map_err(|e| Error::cuda("cuDeviceGetName", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| Error::cuda("cuDeviceGetAttribute", e))?;
        let arch = Arch::from_compute_capability(&name, major, minor)?;
        let props = DeviceProps {
            name,
            ordinal,
            sm_count: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            l2_bytes: attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as u64,
            total_mem: ctx
                .total_mem()
                .map_err(|e| Error::cuda("cuDeviceTotalMem", e))? as u64,
            smem_per_block_optin: attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
            smem_per_sm: attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
            max_threads_per_sm: attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?,
            regs_per_sm: attr(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR)?,
            clock_khz: attr(CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?,
            mem_clock_khz: attr(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)?,
            mem_bus_bits: attr(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?,
            target: arch.target().to_string(),
        };
        let stream = ctx
            .new_stream()
            .map_err(|e| Error::cuda("cuStreamCreate", e))?;
        let d = CudaDevice {
            ctx,
            stream,
            arch,
            props,
            modules: Mutex::new(HashMap::new()),
        };
        d.keep_freed_memory()?;
        Ok(d)
    }

    /// Lets the device's memory pool keep up to a quarter of the device's memory of freed
    /// blocks across synchronisations (its release threshold, 0 by default). With 0, every
    /// host wait hands the pool's free memory back to the driver, and the next large
    /// `cuMemAllocAsync` maps fresh pages — about a millisecond per GB, paid again after each
    /// wait (a layer that reads a count back mid-call paid it several times per call). A cache
    /// like PyTorch's, bounded so that other allocators in the process keep room; `alloc`
    /// trims it when an allocation fails.
    fn keep_freed_memory(&self) -> Result<()> {
        let pool = self.mem_pool()?;
        let mut keep: u64 = self.props.total_mem / 4;
        // SAFETY: RELEASE_THRESHOLD takes a cuuint64_t, read from `keep`.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep as *mut u64 as *mut c_void,
            )
            .result()
        }
        .map_err(|e| Error::cuda("cuMemPoolSetAttribute(RELEASE_THRESHOLD)", e))
    }

    /// The architecture kernels are compiled for on this device.
    pub fn arch(&self) -> Arch {
        self.arch
    }
    /// Name, SM count, memory and limits, read when the device was opened.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }
    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.props.ordinal
    }
    /// The primary context (the one the CUDA runtime and PyTorch use), for calls into cudarc.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// ferrite's own stream on this device (the default for ops given no stream).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Makes the device's context current on the calling thread (ops do this themselves; driver
    /// calls made outside ferrite may need it).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))
    }

    /// A new stream on this device.
    pub fn new_stream(&self) -> Result<Stream> {
        self.ctx
            .new_stream()
            .map_err(|e| Error::cuda("cuStreamCreate", e))
    }

    /// Wraps a stream created elsewhere (e.g. `torch.cuda.current_stream().cuda_stream`).
    ///
    /// # Safety
    /// `raw` must be a live `CUstream` of this device's primary context that outlives every use of
    /// the returned handle; ferrite never destroys it.
    pub unsafe fn wrap_stream(&self, raw: u64) -> Result<Stream> {
        // SAFETY: forwarded to the caller's contract above.
        Ok(unsafe { self.ctx.wrap_borrowed_stream(raw as sys::CUstream) })
    }

    /// Waits until `stream` has finished its work; a failure is reported as happening after
    /// `after` (the op or step that queued the work).
    pub fn synchronize(&self, stream: &Stream, after: &str) -> Result<()> {
        stream
            .synchronize()
            .map_err(|e| Error::cuda(format!("cuStreamSynchronize after {after}"), e))
    }

    /// Loads (once) the module under `key`: from `cubin` when given (no driver JIT), falling back
    /// to `ptx` if the driver refuses the cubin.
    pub(crate) fn module(
        &self,
        key: &str,
        ptx: &str,
        cubin: Option<&[u8]>,
    ) -> Result<Arc<CudaModule>> {
        let mut mods = self.modules.lock().unwrap();
        if let Some(m) = mods.get(key) {
            return Ok(m.clone());
        }
        let from_cubin = cubin.and_then(|c| {
            self.ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(c.to_vec()))
                .ok()
        });
        let m = match from_cubin {
            Some(m) => m,
            None => self
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                .map_err(|e| Error::cuda(format!("cuModuleLoadData ({key})"), e))?,
        };
        mods.insert(key.to_string(), m.clone());
        Ok(m)
    }

    /// Allocates `bytes` of device memory on `stream` (stream-ordered). Contents are undefined.
    pub fn alloc(self: &Arc<Self>, bytes: usize, stream: &Stream) -> Result<DeviceBuffer> {
        self.bind()?;
        let ptr = if bytes == 0 {
            0
        } else {
            // SAFETY: the context is bound; the pointer is freed exactly once in Drop.
            let first = unsafe { drv::malloc_async(stream.cu_stream(), bytes) };
            let again = || {
                // Out of memory with freed blocks cached in the pool: give them back and retry.
                let pool = self.mem_pool()?;
                // SAFETY: trims unused pool memory (blocks in use are kept by the driver).
                let _ = unsafe { sys::cuMemPoolTrimTo(pool, 0) };
                // SAFETY: as above.
                Ok::<_, Error>(unsafe { drv::malloc_async(stream.cu_stream(), bytes) })
            };
            match first {
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => again()?,
                r => r,
            }
            .map_err(|e| {
                Error::cuda(
                    format!("cuMemAllocAsync of {bytes} bytes on {}", self.props.name),
                    e,
                )
            })?
        };
        Ok(DeviceBuffer {
            ptr,
            bytes,
            dev: self.clone(),
            free_on: Some(stream.clone()),
        })
    }

    /// The stream-ordered memory pool `alloc` (cuMemAllocAsync) draws from: the device's current
    /// pool (its default pool unless somebody replaced it).
    fn mem_pool(&self) -> Result<sys::CUmemoryPool> {
        self.bind()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer; the device handle is this context's device.
        unsafe { sys::cuDeviceGetMemPool(&mut pool, self.ctx.cu_device()).result() }
            .map_err(|e| Error::cuda("cuDeviceGetMemPool", e))?;
        Ok(pool)
    }

    /// Bytes of the memory pool in use now and its high-water mark since the last
    /// `reset_pool_peak` (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT` / `_HIGH`). Synchronize first to
    /// see the effect of queued allocations and frees.
    pub fn pool_usage(&self) -> Result<(u64, u64)> {
        let pool = self.mem_pool()?;
        let get = |attr: sys::CUmemPool_attribute| -> Result<u64> {
            let mut v: u64 = 0;
            // SAFETY: both attributes are cuuint64_t values written to `v`.
            unsafe {
                sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut c_void).result()
            }
            .map_err(|e| Error::cuda("cuMemPoolGetAttribute", e))?;
            Ok(v)
        };
        use sys::CUmemPool_attribute::*;
        Ok((
            get(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            get(CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        ))
    }

    /// Resets the pool's high-water mark (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`; the driver only
    /// accepts 0), so the next `pool_usage` reports the peak of what ran since.
    pub fn reset_pool_peak(&self) -> Result<()> {
        let pool = self.mem_pool()?;
        let mut zero: u64 = 0;
        // SAFETY: USED_MEM_HIGH takes a cuuint64_t, and 0 is the only value it accepts.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut zero as *mut u64 as *mut c_void,
            )
            .result()
        }
        .map_err(|e| Error::cuda("cuMemPoolSetAttribute(USED_MEM_HIGH)", e))
    }

    /// Page-locked host memory that the CPU may read fast (not write-combined).
    pub fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer> {
        self.bind()?;
        // SAFETY: the memory is only handed out as bytes after the allocation succeeded; freed in Drop.
        let ptr = unsafe { drv::malloc_host(bytes.max(1), 0) }
            .map_err(|e| Error::cuda(format!("cuMemHostAlloc of {bytes} bytes"), e))?;
        Ok(PinnedBuffer {
            ptr: ptr as *mut u8,
            bytes,
            ctx: self.ctx.clone(),
        })
    }

    /// Copies host bytes into device memory at `dst`, ordered on `stream`.
    ///
    /// # Safety
    /// `dst..dst+src.len()` must be device memory of this device, and `src` must stay alive and
    /// unmodified until the stream has passed this copy (synchronize, or use pinned memory + events).
    pub unsafe fn htod(&self, dst: u64, src: &[u8], stream: &Stream) -> Result<()> {
        self.bind()?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: forwarded to the caller's contract.
        unsafe { drv::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .map_err(|e| Error::cuda("cuMemcpyHtoDAsync", e))
    }

    /// Copies device memory at `src` into host bytes, ordered on `stream`.
    ///
    /// # Safety
    /// `src..src+dst.len()` must be device memory of this device; `dst` must stay alive until the
    /// stream has passed this copy.
    pub unsafe fn dtoh(&self, dst: &mut [u8], src: u64, stream: &Stream) -> Result<()> {
        self.bind()?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: forwarded to the caller's contract.
        unsafe { drv::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
            .map_err(|e| Error::cuda("cuMemcpyDtoHAsync", e))
    }

    /// Copies `bytes` between two device addresses, ordered on `stream`.
    ///
    /// # Safety
    /// Both ranges must be device memory of this device, `bytes` long.
    pub unsafe fn dtod(&self, dst: u64, src: u64, bytes: usize, stream: &Stream) -> Result<()> {
        self.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: forwarded to the caller's contract.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
            .map_err(|e| Error::cuda("cuMemcpyDtoDAsync", e))
    }

    /// Sets `bytes` of device memory at `dst` to `byte`, ordered on `stream`.
    ///
    /// # Safety
    /// `dst..dst+bytes` must be device memory of this device.
    pub unsafe fn memset(&self, dst: u64, byte: u8, bytes: usize, stream: &Stream) -> Result<()> {
        self.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: forwarded to the caller's contract.
        unsafe { drv::memset_d8_async(dst, byte, bytes, stream.cu_stream()) }
            .map_err(|e| Error::cuda("cuMemsetD8Async", e))
    }
}

/// Device memory owned by ferrite (freed stream-ordered on drop) or borrowed from a caller.
pub struct DeviceBuffer {
    ptr: u64,
    bytes: usize,
    dev: Arc<CudaDevice>,
    /// `None` for borrowed memory (never freed by ferrite).
    free_on: Option<Stream>,
}

impl DeviceBuffer {
    /// Wraps device memory that somebody else owns (a PyTorch tensor's storage).
    ///
    /// # Safety
    /// `ptr..ptr+bytes` must be device memory of `dev` that stays allocated while this buffer and
    /// every tensor viewing it live.
    pub unsafe fn borrowed(dev: Arc<CudaDevice>, ptr: u64, bytes: usize) -> Self {
        DeviceBuffer {
            ptr,
            bytes,
            dev,
            free_on: None,
        }
    }
    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// The device the memory belongs to.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let (Some(stream), true) = (&self.free_on, self.ptr != 0) {
            let _ = self.dev.bind();
            // SAFETY: ptr came from cuMemAllocAsync in `alloc` and is freed only here, on the
            // stream that allocated it, after all work that stream queued on it.
            let _ = unsafe { drv::free_async(self.ptr, stream.cu_stream()) };
        }
    }
}

/// Page-locked host memory (cuMemHostAlloc without write-combining: fast for CPU reads too).
pub struct PinnedBuffer {
    ptr: *mut u8,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain host memory owned by this value; access goes through &/&mut.
unsafe impl Send for PinnedBuffer {}
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// The bytes, read-only.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of `bytes` (at least 1) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }
    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }
    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: ptr came from cuMemHostAlloc and is freed only here.
        let _ = unsafe { drv::free_host(self.ptr as *mut c_void) };
    }
}

/// A pair of events timing the work queued between `start` and `stop` on one stream.
pub struct GpuTimer {
    start: sys::CUevent,
    stop: sys::CUevent,
    ctx: Arc<CudaContext>,
}

impl GpuTimer {
    /// Two events on `dev`'s context.
    pub fn new(dev: &CudaDevice) -> Result<Self> {
        dev.bind()?;
        let f = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let start = drv::event::create(f).map_err(|e| Error::cuda("cuEventCreate", e))?;
        let stop = drv::event::create(f).map_err(|e| Error::cuda("cuEventCreate", e))?;
        Ok(GpuTimer {
            start,
            stop,
            ctx: dev.ctx.clone(),
        })
    }
    /// Records the start event on `stream`.
    pub fn start(&self, stream: &Stream) -> Result<()> {
        // SAFETY: both handles are live events of this context.
        unsafe { drv::event::record(self.start, stream.cu_stream()) }
            .map_err(|e| Error::cuda("cuEventRecord", e))
    }
    /// Records the stop event on `stream`.
    pub fn stop(&self, stream: &Stream) -> Result<()> {
        // SAFETY: as above.
        unsafe { drv::event::record(self.stop, stream.cu_stream()) }
            .map_err(|e| Error::cuda("cuEventRecord", e))
    }
    /// Waits for the stop event and returns the elapsed milliseconds.
    pub fn elapsed_ms(&self) -> Result<f64> {
        // SAFETY: live events; cuEventSynchronize has no other precondition.
        unsafe { sys::cuEventSynchronize(self.stop).result() }
            .map_err(|e| Error::cuda("cuEventSynchronize (a kernel timed here failed)", e))?;
        // SAFETY: both events were recorded on the same stream.
        unsafe { drv::event::elapsed(self.start, self.stop) }
            .map(|v| v as f64)
            .map_err(|e| Error::cuda("cuEventElapsedTime", e))
    }
    /// Milliseconds from this timer's stop to `later`'s start (both recorded on one stream, this
    /// one first): the stream's idle or busy time between two timed spans.
    pub fn gap_ms(&self, later: &GpuTimer) -> Result<f64> {
        // SAFETY: live events; the caller recorded both, this stop before `later`'s start.
        unsafe { sys::cuEventSynchronize(later.start).result() }
            .map_err(|e| Error::cuda("cuEventSynchronize", e))?;
        // SAFETY: both events were recorded on the same stream.
        unsafe { drv::event::elapsed(self.stop, later.start) }
            .map(|v| v as f64)
            .map_err(|e| Error::cuda("cuEventElapsedTime", e))
    }
}

impl Drop for GpuTimer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: both events were created in `new` and are destroyed only here.
        unsafe {
            let _ = drv::event::destroy(self.start);
            let _ = drv::event::destroy(self.stop);
        }
    }
}

/// Kernel parameters, each kept in its own 8-byte-aligned heap slot so the pointers handed to
/// `cuLaunchKernel` stay valid while the argument list lives.
#[derive(Default)]
pub struct KernelArgs {
    slots: Vec<Box<[u64]>>,
}

impl KernelArgs {
    /// An empty parameter list.
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds one parameter. `T` must be laid out exactly as the kernel's parameter (a device
    /// pointer as `u64`, `int` as `i32`, a `float`, a `#[repr(C)]` struct...).
    pub fn push<T: Copy + 'static>(&mut self, v: T) -> &mut Self {
        let words = std::mem::size_of::<T>().div_ceil(8).max(1);
        let mut slot = vec![0u64; words].into_boxed_slice();
        // SAFETY: the slot holds at least size_of::<T>() bytes; the write is unaligned-safe.
        unsafe { std::ptr::write_unaligned(slot.as_mut_ptr() as *mut T, v) };
        self.slots.push(slot);
        self
    }
    fn pointers(&mut self) -> Vec<*mut c_void> {
        self.slots
            .iter_mut()
            .map(|s| s.as_mut_ptr() as *mut c_void)
            .collect()
    }
}

/// A kernel loaded into a device, with its name for error messages and reports.
#[derive(Clone)]
pub struct Kernel {
    /// The kernel's function name.
    pub name: String,
    /// The loaded function.
    pub func: CudaFunction,
    /// The device it is loaded into.
    pub dev: Arc<CudaDevice>,
    /// Bytes of static shared memory (read once at load: `allow_dynamic_smem` runs per launch).
    pub static_smem: u32,
    /// What launches of this kernel would otherwise ask the driver on every op call, answered
    /// once and shared by every clone of the kernel.
    facts: Arc<LaunchFacts>,
}

/// A kernel's launch facts: resident blocks per SM by (threads, dynamic shared memory), and the
/// dynamic shared-memory limit set on it (0: the default 48 KiB).
#[derive(Default)]
pub(crate) struct LaunchFacts {
    blocks: Mutex<HashMap<(u32, u32), u32>>,
    smem_limit: std::sync::atomic::AtomicU32,
}

/// Static resource use of a kernel, as the driver reports it.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct KernelResources {
    /// Registers per thread.
    pub registers: i32,
    /// Static shared memory per block, bytes.
    pub static_smem: i32,
    /// Local memory per thread (spills and stack), bytes.
    pub local_bytes: i32,
    /// The largest block it can launch with.
    pub max_threads: i32,
}

impl Kernel {
    /// Registers, shared and local memory and the block limit, from the driver.
    pub fn resources(&self) -> Result<KernelResources> {
        let e = |x| Error::cuda(format!("cuFuncGetAttribute({})", self.name), x);
        Ok(KernelResources {
            registers: self.func.num_regs().map_err(e)?,
            static_smem: self.func.shared_size_bytes().map_err(e)?,
            local_bytes: self.func.local_size_bytes().map_err(e)?,
            max_threads: self.func.max_threads_per_block().map_err(e)?,
        })
    }

    /// Blocks of `block_threads` threads and `dyn_smem` bytes of dynamic shared memory that can
    /// be resident on one SM at once (registers, shared memory and threads all counted). Asked
    /// of the driver once per (device, kernel, launch shape): the answer cannot change, and a
    /// driver call costs tens of µs of host time on some machines — per op call, that shows.
    pub fn max_active_blocks(&self, block_threads: u32, dyn_smem: u32) -> Result<u32> {
        let key = (block_threads, dyn_smem);
        if let Some(&b) = self.facts.blocks.lock().unwrap().get(&key) {
            return Ok(b);
        }
        let b = self
            .func
            .occupancy_max_active_blocks_per_multiprocessor(block_threads, dyn_smem as usize, None)
            .map_err(|e| {
                Error::cuda(
                    format!("cuOccupancyMaxActiveBlocksPerMultiprocessor({})", self.name),
                    e,
                )
            })?;
        self.facts.blocks.lock().unwrap().insert(key, b);
        Ok(b)
    }

    /// Theoretical occupancy: resident warps per SM over the SM's maximum.
    pub fn occupancy(&self, block_threads: u32, dyn_smem: u32) -> Result<f64> {
        let blocks = self.max_active_blocks(block_threads, dyn_smem)?;
        let warps = blocks * block_threads.div_ceil(32);
        Ok(warps as f64 / (self.dev.props.max_threads_per_sm / 32) as f64)
    }

    /// Raises the dynamic shared-memory limit (needed above 48 KiB).
    pub fn set_max_dynamic_smem(&self, bytes: u32) -> Result<()> {
        let r = self
            .func
            .set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| {
                Error::cuda(
                    format!(
                        "cuFuncSetAttribute({}, max dynamic smem {bytes})",
                        self.name
                    ),
                    e,
                )
            });
        let set = if r.is_ok() { bytes } else { 0 };
        self.facts
            .smem_limit
            .store(set, std::sync::atomic::Ordering::Relaxed);
        r
    }

    /// Lets a launch use `bytes` of dynamic shared memory: the opt-in is needed once dynamic plus
    /// static shared memory pass 48 KiB (not the dynamic bytes alone — a kernel at exactly 48 KiB
    /// dynamic with a few static reduction slots fails to launch without it).
    /// The limit set is remembered per (device, kernel): only a larger request calls the driver
    /// again (host time per op call, as for `max_active_blocks`).
    pub fn allow_dynamic_smem(&self, bytes: u32) -> Result<()> {
        if bytes == 0 || bytes as usize + self.static_smem as usize <= 48 * 1024 {
            return Ok(());
        }
        if self
            .facts
            .smem_limit
            .load(std::sync::atomic::Ordering::Relaxed)
            >= bytes
        {
            return Ok(());
        }
        self.set_max_dynamic_smem(bytes)
    }

    /// Launches on `stream`. A launch error names the kernel and its launch shape.
    pub fn launch(
        &self,
        stream: &Stream,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &mut KernelArgs,
    ) -> Result<()> {
        let err = |msg: String| Error::Launch {
            kernel: self.name.clone(),
            grid,
            block,
            smem,
            msg,
        };
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 || grid.1 > 65535 || grid.2 > 65535 {
            return Err(err(
                "grid dimensions out of range (x ≥ 1, y and z in 1..=65535)".into(),
            ));
        }
        self.dev.bind()?;
        let mut ptrs = args.pointers();
        // SAFETY: every parameter slot was pushed in the kernel's parameter order with the
        // kernel's parameter types (each op's host code pairs with its .cu source); the device
        // pointers among them are live allocations of this device, ordered on `stream`.
        unsafe {
            drv::launch_kernel(
                self.func.cu_function(),
                grid,
                block,
                smem,
                stream.cu_stream(),
                &mut ptrs,
            )
        }
        .map_err(|e| err(e.to_string()))
    }
}
