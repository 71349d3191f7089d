//! The tensor: a view (shape, strides, offset — see `Layout`) over storage on the CPU or a GPU.
//! Views share storage (`Arc`); ops write outputs through the storage's lock, so a caller can hand
//! ferrite its own output buffers. Device storage may be borrowed (a PyTorch tensor's memory).

use super::cuda::{self, CudaDevice, DeviceBuffer, Stream};
use super::device::Device;
use super::dtype::{read_as_f64, write_from_f64, DType, Element};
use super::error::{Error, Result};
use super::host;
use super::layout::{checked_bytes, checked_numel, Layout};
use super::rng::Rng;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Host bytes, 8-byte aligned so every dtype can be viewed in place: owned, or borrowed from
/// the caller (a PyTorch CPU tensor's memory, see [`Tensor::from_host_ptr`]).
pub struct HostBytes {
    mem: HostMem,
    len: usize,
}

enum HostMem {
    Owned(Vec<u64>),
    /// Memory owned elsewhere; never freed here.
    Borrowed(std::ptr::NonNull<u8>),
}

// SAFETY: an owned buffer is a Vec. A borrowed one is only created through
// `HostBytes::borrowed`, whose contract makes the memory valid for the storage's whole life and
// accessed by nobody else while the tensor does; every access then goes through the storage's
// RwLock like an owned buffer's, so sharing the handle between threads is as safe as the Vec's.
unsafe impl Send for HostBytes {}
// SAFETY: as above.
unsafe impl Sync for HostBytes {}

impl HostBytes {
    /// `len` zeroed bytes; `what` names the buffer in the error when the host cannot give them.
    pub fn zeroed(len: usize, what: &str) -> Result<Self> {
        Ok(HostBytes {
            mem: HostMem::Owned(crate::core::host::zeroed::<u64>(len.div_ceil(8), what)?),
            len,
        })
    }

    /// Wraps `len` bytes at `ptr` without copying.
    ///
    /// # Safety
    /// `ptr` is non-null, 8-byte aligned and valid for reads and writes of `len` bytes for as
    /// long as the returned value (and every tensor sharing it) lives; while it does, no one
    /// else writes those bytes, and no other `HostBytes` borrows any of them (two borrows of
    /// overlapping memory behind two different locks could alias a `&mut`).
    pub unsafe fn borrowed(ptr: *mut u8, len: usize) -> Self {
        // An empty span is never dereferenced: any aligned non-null address stands in for it.
        let p = match std::ptr::NonNull::new(ptr) {
            Some(p) if len > 0 => p,
            _ => std::ptr::NonNull::<u64>::dangling().cast(),
        };
        debug_assert!((p.as_ptr() as usize).is_multiple_of(8));
        HostBytes {
            mem: HostMem::Borrowed(p),
            len,
        }
    }

    /// Whether the bytes belong to the caller (borrowed) rather than to this value.
    pub fn is_borrowed(&self) -> bool {
        matches!(self.mem, HostMem::Borrowed(_))
    }

    /// The bytes, read-only.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.mem {
            HostMem::Owned(w) => &bytemuck::cast_slice(w)[..self.len],
            // SAFETY: `borrowed`'s contract: valid for `len` bytes, not written by anyone else
            // while this shared borrow (taken under the storage's read lock) lives.
            HostMem::Borrowed(p) => unsafe { std::slice::from_raw_parts(p.as_ptr(), self.len) },
        }
    }
    /// The bytes, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.mem {
            HostMem::Owned(w) => &mut bytemuck::cast_slice_mut(w)[..self.len],
            // SAFETY: `borrowed`'s contract, and `&mut self` (the storage's write lock): no other
            // reference to these bytes exists while this one lives.
            HostMem::Borrowed(p) => unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), self.len) },
        }
    }
    /// The bytes viewed as elements of `T` (the 8-byte alignment makes every dtype fit).
    pub fn as_slice<T: Element>(&self) -> &[T] {
        bytemuck::cast_slice(self.as_bytes())
    }
    /// The bytes viewed as writable elements of `T`.
    pub fn as_mut_slice<T: Element>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.as_bytes_mut())
    }
}

/// The memory behind a tensor, shared by all its views.
pub enum Storage {
    /// Host memory.
    Cpu(HostBytes),
    /// GPU memory (from ferrite's stream-ordered pool, or borrowed).
    Cuda(DeviceBuffer),
}

/// An n-dimensional view (shape, strides and offset in elements: a [`Layout`]) over CPU or GPU
/// storage of one [`DType`].
///
/// Cloning a tensor or taking a view ([`t`](Tensor::t), [`narrow`](Tensor::narrow),
/// [`reshape`](Tensor::reshape), [`as_strided`](Tensor::as_strided)) shares the storage; ops
/// write outputs through it, so a caller keeps its own output buffers (`*_into` functions).
/// Storage may belong to someone else ([`Tensor::from_device_ptr`], [`Tensor::from_host_ptr`]):
/// that is how PyTorch's and C callers' memory reaches the ops without a copy.
///
/// ```rust
/// use ferrite::{Device, DType, Tensor};
/// let x = Tensor::from_vec((0..6).map(|v| v as f32).collect(), &[2, 3])?;
/// let xt = x.t()?; // [3, 2], strides [1, 3]: a view, no copy
/// assert_eq!(xt.to_vec::<f32>()?, vec![0., 3., 1., 4., 2., 5.]);
/// assert_eq!(Tensor::full(&[2], DType::BF16, Device::Cpu, 1.5)?.to_f32_vec()?, vec![1.5, 1.5]);
/// # Ok::<(), ferrite::Error>(())
/// ```
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<RwLock<Storage>>,
    layout: Layout,
    dtype: DType,
    device: Device,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({} {:?} strides {:?} on {})",
            self.dtype,
            self.layout.shape(),
            self.layout.strides(),
            self.device
        )
    }
}

/// Describes a tensor for error messages: `bf16[127, 33] on cuda:0`.
pub fn describe(t: &Tensor) -> String {
    let mut s = format!("{}{:?} on {}", t.dtype, t.shape(), t.device);
    if !t.is_contiguous() {
        s.push_str(&format!(" (strides {:?})", t.strides()));
    }
    s
}

/// The layout of a view over memory owned elsewhere and the bytes it addresses from its base.
fn borrowed_span(
    op: &str,
    shape: &[usize],
    strides: &[usize],
    dtype: DType,
) -> Result<(Layout, usize)> {
    let layout = Layout::new(shape.to_vec(), strides.to_vec(), 0)?;
    let end = layout.max_offset(op)?;
    let bytes = checked_bytes(op, end, dtype.size_in_bytes())?;
    Ok((layout, bytes))
}

impl Tensor {
    fn from_storage(storage: Storage, shape: &[usize], dtype: DType, device: Device) -> Self {
        Tensor {
            storage: Arc::new(RwLock::new(storage)),
            layout: Layout::contiguous(shape),
            dtype,
            device,
        }
    }

    /// A CPU tensor owning `data`, row-major with `shape`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        let n = checked_numel("Tensor::from_vec", shape)?;
        if n != data.len() {
            return Err(Error::bad_arg(
                "Tensor::from_vec",
                "data",
                format!("{n} elements for shape {shape:?}"),
                format!("{} elements", data.len()),
            ));
        }
        let mut hb = HostBytes::zeroed(n * T::DTYPE.size_in_bytes(), "Tensor::from_vec")?;
        hb.as_mut_slice::<T>().copy_from_slice(&data);
        Ok(Self::from_storage(
            Storage::Cpu(hb),
            shape,
            T::DTYPE,
            Device::Cpu,
        ))
    }

    /// Uninitialised on a GPU, zeroed on the CPU. Ops that write every element take these.
    pub fn empty(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        let n = checked_numel("Tensor::empty", shape)?;
        let bytes = checked_bytes("Tensor::empty", n, dtype.size_in_bytes())?;
        let storage = match device {
            Device::Cpu => Storage::Cpu(HostBytes::zeroed(bytes, "Tensor::empty")?),
            Device::Cuda(i) => {
                let dev = cuda::device(i)?;
                return Self::empty_on(shape, dtype, &dev, dev.stream());
            }
        };
        Ok(Self::from_storage(storage, shape, dtype, device))
    }

    /// `empty` on a GPU, allocated in stream order on `stream` (a workspace used and dropped by
    /// work queued on that stream, not the device's own).
    pub fn empty_on(
        shape: &[usize],
        dtype: DType,
        dev: &Arc<CudaDevice>,
        stream: &Stream,
    ) -> Result<Tensor> {
        let n = checked_numel("Tensor::empty_on", shape)?;
        let bytes = checked_bytes("Tensor::empty_on", n, dtype.size_in_bytes())?;
        let storage = Storage::Cuda(dev.alloc(bytes, stream)?);
        Ok(Self::from_storage(
            storage,
            shape,
            dtype,
            Device::Cuda(dev.ordinal()),
        ))
    }

    /// A contiguous copy converted to `dtype` on the same device, element by element through the
    /// host (rounded to nearest even; FP8 saturates, see `core::fp8`; integers truncate): for
    /// preparing inputs and tests, not a device kernel.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let v = self.to_f64_vec()?;
        let bytes = checked_bytes("Tensor::to_dtype", v.len(), dtype.size_in_bytes())?;
        let mut hb = HostBytes::zeroed(bytes, "Tensor::to_dtype")?;
        for (i, &x) in v.iter().enumerate() {
            write_from_f64(hb.as_bytes_mut(), dtype, i, x);
        }
        Self::from_storage(Storage::Cpu(hb), self.shape(), dtype, Device::Cpu)
            .to_device(self.device)
    }

    /// Every element set to `v` (rounded to the dtype).
    pub fn full(shape: &[usize], dtype: DType, device: Device, v: f64) -> Result<Tensor> {
        let n = checked_numel("Tensor::full", shape)?;
        let bytes = checked_bytes("Tensor::full", n, dtype.size_in_bytes())?;
        let mut hb = HostBytes::zeroed(bytes, "Tensor::full")?;
        for i in 0..n {
            write_from_f64(hb.as_bytes_mut(), dtype, i, v);
        }
        Self::from_storage(Storage::Cpu(hb), shape, dtype, Device::Cpu).to_device(device)
    }

    /// Uniform random in [lo, hi) from `seed` (integers: truncated).
    pub fn rand(
        shape: &[usize],
        dtype: DType,
        device: Device,
        seed: u64,
        lo: f64,
        hi: f64,
    ) -> Result<Tensor> {
        use rayon::prelude::*;
        // Elements per task: the bench's inputs reach 10⁹ elements (seconds on one core), and
        // each task starts the one sequence where its chunk starts, so any split writes the same
        // values.
        const CHUNK: usize = 1 << 16;
        let n = checked_numel("Tensor::rand", shape)?;
        let es = dtype.size_in_bytes();
        let bytes = checked_bytes("Tensor::rand", n, es)?;
        let mut hb = HostBytes::zeroed(bytes, "Tensor::rand")?;
        let rng = Rng::new(seed);
        hb.as_bytes_mut()
            .par_chunks_mut(CHUNK * es)
            .enumerate()
            .for_each(|(c, chunk)| {
                let mut rng = rng.skip((c * CHUNK) as u64);
                for i in 0..chunk.len() / es {
                    write_from_f64(chunk, dtype, i, rng.uniform(lo, hi));
                }
            });
        Self::from_storage(Storage::Cpu(hb), shape, dtype, Device::Cpu).to_device(device)
    }

    /// Wraps device memory owned elsewhere (e.g. a PyTorch tensor) as a tensor view.
    ///
    /// # Safety
    /// `ptr` must point to device memory of `dev` holding at least every element the layout
    /// (`shape`, `strides`, offset 0) addresses, alive and not freed while the tensor lives.
    pub unsafe fn from_device_ptr(
        dev: Arc<CudaDevice>,
        ptr: u64,
        shape: &[usize],
        strides: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let (layout, bytes) = borrowed_span("Tensor::from_device_ptr", shape, strides, dtype)?;
        let ordinal = dev.ordinal();
        // SAFETY: forwarded to the caller's contract.
        let buf = unsafe { DeviceBuffer::borrowed(dev, ptr, bytes) };
        Ok(Tensor {
            storage: Arc::new(RwLock::new(Storage::Cuda(buf))),
            layout,
            dtype,
            device: Device::Cuda(ordinal),
        })
    }

    /// Wraps host memory owned elsewhere (e.g. a PyTorch CPU tensor) as a tensor view, without
    /// copying: ops read and write it in place.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of every element the layout (`shape`, `strides`,
    /// offset 0) addresses, for as long as the tensor (and its views) live; meanwhile nothing
    /// else may write that memory, and no other borrowed tensor may cover any of it (see
    /// [`HostBytes::borrowed`]). A `ptr` that is not 8-byte aligned is refused (an error, not
    /// UB): ferrite's CPU code may view host bytes as any element type.
    pub unsafe fn from_host_ptr(
        ptr: u64,
        shape: &[usize],
        strides: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let (layout, bytes) = borrowed_span("Tensor::from_host_ptr", shape, strides, dtype)?;
        if bytes > 0 && (ptr == 0 || !ptr.is_multiple_of(8)) {
            return Err(Error::bad_arg(
                "Tensor::from_host_ptr",
                "ptr",
                "a non-null, 8-byte aligned address",
                format!("{ptr:#x}"),
            ));
        }
        // SAFETY: forwarded to the caller's contract (alignment checked above; an empty span is
        // never dereferenced).
        let hb = unsafe { HostBytes::borrowed(ptr as *mut u8, bytes) };
        Ok(Tensor {
            storage: Arc::new(RwLock::new(Storage::Cpu(hb))),
            layout,
            dtype,
            device: Device::Cpu,
        })
    }

    /// Size of each dim.
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }
    /// Element strides of each dim.
    pub fn strides(&self) -> &[usize] {
        self.layout.strides()
    }
    /// Shape, strides and offset together.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Where the storage lives.
    pub fn device(&self) -> Device {
        self.device
    }
    /// Number of elements the view covers.
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }
    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.layout.rank()
    }
    /// Row-major contiguous (size-1 dims may carry any stride).
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }
    /// Bytes the view covers if contiguous.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size_in_bytes()
    }
    /// Whether two tensors view the same storage (an op refuses an output aliasing an input).
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    fn with_layout(&self, layout: Layout) -> Tensor {
        Tensor {
            storage: self.storage.clone(),
            layout,
            dtype: self.dtype,
            device: self.device,
        }
    }
    /// The same elements under a new shape: a view of a contiguous tensor, an error otherwise
    /// (call [`contiguous`](Tensor::contiguous) first).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        Ok(self.with_layout(self.layout.reshape(shape)?))
    }
    /// Dims `a` and `b` swapped: a view, no copy.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        Ok(self.with_layout(self.layout.transpose(a, b)?))
    }
    /// The 2-D transpose of the last two dims.
    pub fn t(&self) -> Result<Tensor> {
        let r = self.rank();
        if r < 2 {
            return Err(Error::bad_arg("t", "self", "rank ≥ 2", describe(self)));
        }
        self.transpose(r - 2, r - 1)
    }
    /// Any view of this tensor's storage (shape, strides and offset in elements), checked to lie
    /// inside the storage.
    pub fn as_strided(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<Tensor> {
        let layout = Layout::new(shape.to_vec(), strides.to_vec(), offset)?;
        let end = layout.max_offset("as_strided")?;
        let have = self.storage_elements()?;
        if end > have {
            return Err(Error::bad_arg(
                "as_strided",
                "shape/strides/offset",
                format!("a view inside the storage's {have} elements"),
                format!(
                    "shape {shape:?} strides {strides:?} offset {offset} (reaches element {end})"
                ),
            ));
        }
        Ok(self.with_layout(layout))
    }

    fn storage_elements(&self) -> Result<usize> {
        let bytes = match &*self.read_storage()? {
            Storage::Cpu(h) => h.as_bytes().len(),
            Storage::Cuda(b) => b.bytes(),
        };
        Ok(bytes / self.dtype.size_in_bytes())
    }

    /// `dim` narrowed to `start..start + len`: a view, no copy.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        Ok(self.with_layout(self.layout.narrow(dim, start, len)?))
    }

    pub(crate) fn read_storage(&self) -> Result<RwLockReadGuard<'_, Storage>> {
        self.storage
            .try_read()
            .map_err(|_| Error::Other("tensor storage is being written by another op".into()))
    }
    pub(crate) fn write_storage(&self) -> Result<RwLockWriteGuard<'_, Storage>> {
        self.storage.try_write().map_err(|_| {
            Error::Other("tensor storage is in use by another op (aliasing output?)".into())
        })
    }

    /// The CUDA device of a GPU tensor.
    pub fn cuda_device(&self) -> Result<Arc<CudaDevice>> {
        match &*self.read_storage()? {
            Storage::Cuda(b) => Ok(b.device().clone()),
            Storage::Cpu(_) => Err(Error::bad_arg(
                "cuda_device",
                "self",
                "a CUDA tensor",
                describe(self),
            )),
        }
    }

    /// Device address of the view's first element (GPU tensors).
    pub fn device_ptr(&self) -> Result<u64> {
        match &*self.read_storage()? {
            Storage::Cuda(b) => {
                Ok(b.ptr() + (self.layout.offset() * self.dtype.size_in_bytes()) as u64)
            }
            Storage::Cpu(_) => Err(Error::bad_arg(
                "device_ptr",
                "self",
                "a CUDA tensor",
                describe(self),
            )),
        }
    }

    /// Runs `f` on the CPU elements the storage holds from the view's offset on (contiguous
    /// views read exactly `numel` from there; strided ones index with `strides()`).
    pub fn with_cpu<T: Element, R>(&self, f: impl FnOnce(&[T]) -> R) -> Result<R> {
        self.expect_dtype("with_cpu", "self", T::DTYPE)?;
        match &*self.read_storage()? {
            Storage::Cpu(h) => Ok(f(&h.as_slice::<T>()[self.layout.offset()..])),
            Storage::Cuda(_) => Err(Error::bad_arg(
                "with_cpu",
                "self",
                "a CPU tensor",
                describe(self),
            )),
        }
    }

    /// [`with_cpu`](Tensor::with_cpu) with write access, under the storage's write lock (an
    /// error while another view of the same storage is being read or written).
    pub fn with_cpu_mut<T: Element, R>(&self, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        self.expect_dtype("with_cpu_mut", "self", T::DTYPE)?;
        match &mut *self.write_storage()? {
            Storage::Cpu(h) => Ok(f(&mut h.as_mut_slice::<T>()[self.layout.offset()..])),
            Storage::Cuda(_) => Err(Error::bad_arg(
                "with_cpu_mut",
                "self",
                "a CPU tensor",
                describe(self),
            )),
        }
    }

    /// An [`Error::BadArg`] for `op`'s argument `arg` unless the tensor is of `dtype`.
    pub fn expect_dtype(&self, op: &str, arg: &str, dtype: DType) -> Result<()> {
        if self.dtype != dtype {
            return Err(Error::bad_arg(
                op,
                arg,
                format!("dtype {dtype}"),
                describe(self),
            ));
        }
        Ok(())
    }

    /// The tensor as a matrix whose rows are contiguous (rank 2, unit column stride, rows that do
    /// not overlap) — how GEMM operands with k contiguous are read: (rows, cols, row pitch in
    /// elements). An [`Error::BadArg`] for `op`'s argument `arg` otherwise, naming `what` (e.g.
    /// `"[m, k]"`).
    pub fn matrix_rows(&self, op: &str, arg: &str, what: &str) -> Result<(usize, usize, usize)> {
        let s = self.shape();
        let st = self.strides();
        if s.len() != 2 || (s[1] > 1 && st[1] != 1) || (s[0] > 1 && st[0] < s[1]) {
            return Err(Error::bad_arg(
                op,
                arg,
                format!(
                    "{what}: a rank-2 tensor with unit column stride and rows that do not overlap"
                ),
                describe(self),
            ));
        }
        Ok((s[0], s[1], st[0].max(s[1])))
    }

    /// An op's output against its inputs (`(argument name, tensor)`): every input on the output's
    /// device, and the output sharing storage with none of them. An [`Error::BadArg`] naming the
    /// first input that is elsewhere, or `out` when it is a view of an input.
    pub fn expect_output_of<'a>(
        &self,
        op: &str,
        inputs: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    ) -> Result<()> {
        let device = self.device();
        for (name, t) in inputs {
            if t.device() != device {
                return Err(Error::bad_arg(
                    op,
                    name,
                    format!("a tensor on {device} (the output's device)"),
                    describe(t),
                ));
            }
            if self.shares_storage(t) {
                return Err(Error::bad_arg(
                    op,
                    "out",
                    "a buffer distinct from the inputs",
                    format!("a view of `{name}`"),
                ));
            }
        }
        Ok(())
    }

    /// The view's bytes in row-major order (copied from the device if needed).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let es = self.dtype.size_in_bytes();
        match &*self.read_storage()? {
            Storage::Cpu(h) => {
                let src = h.as_bytes();
                if self.is_contiguous() {
                    let o = self.layout.offset() * es;
                    return host::copy_of(&src[o..o + self.nbytes()], "a host copy of a tensor");
                }
                let mut out = host::with_capacity(self.nbytes(), "a host copy of a tensor")?;
                for off in self.layout.offsets() {
                    out.extend_from_slice(&src[off * es..(off + 1) * es]);
                }
                Ok(out)
            }
            Storage::Cuda(b) => {
                let dev = b.device().clone();
                // Copy the whole span the view touches, then gather on the host.
                let span = self.layout.max_offset("to_bytes")? - self.layout.offset();
                let mut staged = host::zeroed::<u8>(span * es, "a device→host copy")?;
                let base = b.ptr() + (self.layout.offset() * es) as u64;
                let stream = dev.stream().clone();
                // SAFETY: base..base+span*es lies inside the buffer (layout validated against
                // it); `staged` lives until the synchronize below.
                unsafe { dev.dtoh(&mut staged, base, &stream)? };
                dev.synchronize(&stream, "device→host copy")?;
                if self.is_contiguous() {
                    return Ok(staged);
                }
                let rel = self.with_layout(Layout::new(
                    self.shape().to_vec(),
                    self.strides().to_vec(),
                    0,
                )?);
                let mut out = host::with_capacity(self.nbytes(), "a device→host copy")?;
                for off in rel.layout.offsets() {
                    out.extend_from_slice(&staged[off * es..(off + 1) * es]);
                }
                Ok(out)
            }
        }
    }

    /// The view's elements in row-major order.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.expect_dtype("to_vec", "self", T::DTYPE)?;
        let bytes = self.to_bytes()?;
        let mut v = host::zeroed::<T>(self.numel(), "Tensor::to_vec")?;
        bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&bytes);
        Ok(v)
    }

    /// The view's elements as f64, row-major (for references and error norms).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        let bytes = self.to_bytes()?;
        let mut v = host::with_capacity(self.numel(), "Tensor::to_f64_vec")?;
        v.extend((0..self.numel()).map(|i| read_as_f64(&bytes, self.dtype, i)));
        Ok(v)
    }

    /// The view's elements as f32, row-major (float math on the CPU paths).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let bytes = self.to_bytes()?;
        let mut v = host::with_capacity(self.numel(), "Tensor::to_f32_vec")?;
        match self.dtype {
            DType::F32 => v.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap())),
            ),
            DType::F16 => v.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            DType::BF16 => v.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            _ => v.extend((0..self.numel()).map(|i| read_as_f64(&bytes, self.dtype, i) as f32)),
        }
        Ok(v)
    }

    /// Writes `v` (rounded to the dtype) into a contiguous CPU tensor, in row-major order.
    pub fn write_f32(&self, v: &[f32]) -> Result<()> {
        if v.len() != self.numel() || !self.is_contiguous() {
            return Err(Error::bad_arg(
                "write_f32",
                "self",
                format!("a contiguous tensor of {} elements", v.len()),
                describe(self),
            ));
        }
        match self.dtype {
            DType::F32 => self.with_cpu_mut::<f32, _>(|d| d[..v.len()].copy_from_slice(v)),
            DType::F16 => self.with_cpu_mut::<half::f16, _>(|d| {
                d.iter_mut()
                    .zip(v)
                    .for_each(|(o, &x)| *o = half::f16::from_f32(x))
            }),
            DType::BF16 => self.with_cpu_mut::<half::bf16, _>(|d| {
                d.iter_mut()
                    .zip(v)
                    .for_each(|(o, &x)| *o = half::bf16::from_f32(x))
            }),
            other => Err(Error::bad_arg("write_f32", "self", "a float tensor", other)),
        }
    }

    /// A contiguous copy on `device` (or a cheap clone sharing storage if already there and
    /// contiguous; see `deep_copy` for a copy that never shares).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device && self.is_contiguous() {
            return Ok(self.clone());
        }
        self.copy_to(device)
    }

    /// A contiguous copy with storage of its own, on the same device.
    pub fn deep_copy(&self) -> Result<Tensor> {
        self.copy_to(self.device)
    }

    fn copy_to(&self, device: Device) -> Result<Tensor> {
        let bytes = self.to_bytes()?;
        match device {
            Device::Cpu => {
                let mut hb = HostBytes::zeroed(bytes.len(), "a host copy of a tensor")?;
                hb.as_bytes_mut().copy_from_slice(&bytes);
                Ok(Self::from_storage(
                    Storage::Cpu(hb),
                    self.shape(),
                    self.dtype,
                    Device::Cpu,
                ))
            }
            Device::Cuda(i) => {
                let dev = cuda::device(i)?;
                let stream = dev.stream().clone();
                let buf = dev.alloc(bytes.len(), &stream)?;
                // SAFETY: buf holds bytes.len() bytes; `bytes` lives until the synchronize.
                unsafe { dev.htod(buf.ptr(), &bytes, &stream)? };
                dev.synchronize(&stream, "host→device copy")?;
                Ok(Self::from_storage(
                    Storage::Cuda(buf),
                    self.shape(),
                    self.dtype,
                    device,
                ))
            }
        }
    }

    /// A contiguous version (a copy only if needed).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let c = self.to_device(Device::Cpu)?;
        c.to_device(self.device)
    }

    /// Fills the whole view with a value no correct kernel writes: NaN for floats, all-ones bits
    /// for integers. Outputs are poisoned before a checked run so an unwritten element fails.
    pub fn poison(&self, stream: Option<&Stream>) -> Result<()> {
        if !self.is_contiguous() {
            return Err(Error::bad_arg(
                "poison",
                "self",
                "a contiguous view",
                describe(self),
            ));
        }
        // 0xFF bytes are NaN in f32/f16/bf16 and -1 / MAX in the integer types.
        match &mut *self.write_storage()? {
            Storage::Cpu(h) => {
                let o = self.layout.offset() * self.dtype.size_in_bytes();
                h.as_bytes_mut()[o..o + self.nbytes()].fill(0xFF);
                Ok(())
            }
            Storage::Cuda(b) => {
                let dev = b.device().clone();
                let s = stream.unwrap_or(dev.stream()).clone();
                let p = b.ptr() + (self.layout.offset() * self.dtype.size_in_bytes()) as u64;
                // SAFETY: the view lies inside the buffer.
                unsafe { dev.memset(p, 0xFF, self.nbytes(), &s) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fill is split across threads, each chunk starting the one sequence at its own
    /// offset: the values are those of a single draw in order, whatever the split.
    #[test]
    fn rand_is_one_sequence_in_order() {
        let n = 3 * (1 << 16) + 5;
        let t = Tensor::rand(&[n], DType::F32, Device::Cpu, 42, -2.0, 3.0).unwrap();
        let mut rng = Rng::new(42);
        let want: Vec<f32> = (0..n).map(|_| rng.uniform(-2.0, 3.0) as f32).collect();
        assert_eq!(t.to_vec::<f32>().unwrap(), want);
    }

    #[test]
    fn views_and_round_trip() {
        let t = Tensor::from_vec((0..6).map(|x| x as f32).collect(), &[2, 3]).unwrap();
        assert_eq!(
            t.t().unwrap().to_vec::<f32>().unwrap(),
            vec![0., 3., 1., 4., 2., 5.]
        );
        assert_eq!(
            t.narrow(1, 1, 2).unwrap().to_vec::<f32>().unwrap(),
            vec![1., 2., 4., 5.]
        );
        assert!(t.to_vec::<i32>().is_err());
        let e = Tensor::from_vec(vec![1.0f32; 5], &[2, 3])
            .unwrap_err()
            .to_string();
        assert!(e.contains("6 elements") && e.contains("5 elements"), "{e}");
        let p = Tensor::rand(&[7], DType::BF16, Device::Cpu, 1, -1.0, 1.0).unwrap();
        p.poison(None).unwrap();
        assert!(p.to_f64_vec().unwrap().iter().all(|v| v.is_nan()));
    }

    #[test]
    fn as_strided_stays_inside_storage() {
        let t = Tensor::from_vec((0..12).map(|x| x as f32).collect(), &[12]).unwrap();
        let v = t.as_strided(&[3, 2], &[4, 2], 1).unwrap();
        assert_eq!(v.to_vec::<f32>().unwrap(), vec![1., 3., 5., 7., 9., 11.]);
        let e = t.as_strided(&[3, 2], &[4, 2], 2).unwrap_err().to_string();
        assert!(
            e.contains("12 elements") && e.contains("reaches element 13"),
            "{e}"
        );
    }

    #[test]
    fn empty_tensors_and_overflow() {
        let t = Tensor::empty(&[0, 5], DType::F32, Device::Cpu).unwrap();
        assert_eq!(t.numel(), 0);
        assert!(t.to_vec::<f32>().unwrap().is_empty());
        let e = Tensor::empty(&[1 << 40, 1 << 30], DType::F32, Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("overflow"), "{e}");
    }
}

#[cfg(test)]
mod host_memory_tests {
    use super::*;

    /// Sizes the host cannot give are errors naming the buffer, not an abort of the process: a
    /// new tensor, and the contiguous copy of a broadcast view of one element.
    #[test]
    fn oversized_host_buffers_are_errors() {
        for e in [
            Tensor::empty(&[1 << 44], DType::F32, Device::Cpu).unwrap_err(),
            Tensor::rand(&[1 << 20, 1 << 24], DType::BF16, Device::Cpu, 1, -1.0, 1.0).unwrap_err(),
        ] {
            assert!(matches!(e, Error::HostMemory { .. }), "{e}");
        }
        let one = Tensor::from_vec(vec![1.5f32], &[1]).unwrap();
        let wide = one.with_layout(Layout::new(vec![1 << 43], vec![0], 0).unwrap());
        for e in [
            wide.to_vec::<f32>().unwrap_err(),
            wide.to_f64_vec().unwrap_err(),
            wide.to_f32_vec().unwrap_err(),
            wide.deep_copy().unwrap_err(),
        ] {
            let s = e.to_string();
            assert!(
                matches!(e, Error::HostMemory { .. }) && s.contains("host memory"),
                "{s}"
            );
        }
        // Small ones still work.
        let small = one.with_layout(Layout::new(vec![3], vec![0], 0).unwrap());
        assert_eq!(small.to_vec::<f32>().unwrap(), vec![1.5; 3]);
    }
}
