//! One flat buffer cut into named tensors (parameters, gradients, optimizer state), as llm.c
//! keeps its model: whole-buffer passes (AdamW per weight-decay group, the gradient norm, a
//! checkpoint) are one call each, and each slot is still an ordinary tensor for the ops.
//!
//! Slots are borrowed tensors (`Tensor::from_host_ptr` / `from_device_ptr`) over disjoint ranges
//! of the owner, so each has storage of its own: an op may write `dW` and `db` of one layer in
//! one call (ops refuse two outputs that view one storage).

use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::Tensor;

/// Slots start on multiples of this many elements (128 bytes for bf16): every slot is aligned
/// for 16-byte vector loads and TMA descriptors.
pub const ALIGN: usize = 64;

/// A flat, zero-initialised buffer of `len` elements and views into it.
///
/// Invariant (what makes the borrowed views sound, upheld by the trainer that owns both): the
/// arena outlives every view cut from it (the model struct declares its views before its arenas,
/// so they drop first); ops run one at a time on the calling thread and hold no slice of a view
/// past their return, so two views covering the same bytes (a slot and its weight-decay group)
/// are never accessed at once.
pub struct Arena {
    owner: Tensor,
    len: usize,
}

impl Arena {
    /// `len` zeroed elements of `dtype` on `device`.
    pub fn new(len: usize, dtype: DType, device: Device) -> Result<Arena> {
        let owner = Tensor::empty(&[len.max(1)], dtype, device)?;
        if let Device::Cuda(_) = device {
            let dev = owner.cuda_device()?;
            // SAFETY: the owner holds len.max(1) elements of dtype.
            unsafe { dev.memset(owner.device_ptr()?, 0, owner.nbytes(), dev.stream())? };
        }
        Ok(Arena { owner, len })
    }

    /// Elements in the arena.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.owner.dtype()
    }
    /// Where it lives.
    pub fn device(&self) -> Device {
        self.owner.device()
    }
    /// The owning tensor `[len]` (whole-buffer reads: checkpoints, tests).
    pub fn owner(&self) -> &Tensor {
        &self.owner
    }

    fn base(&self) -> Result<u64> {
        match self.owner.device() {
            Device::Cuda(_) => self.owner.device_ptr(),
            Device::Cpu => match self.owner.dtype() {
                DType::F32 => self.owner.with_cpu::<f32, _>(|s| s.as_ptr() as u64),
                DType::BF16 => self.owner.with_cpu::<half::bf16, _>(|s| s.as_ptr() as u64),
                DType::F16 => self.owner.with_cpu::<half::f16, _>(|s| s.as_ptr() as u64),
                DType::I32 => self.owner.with_cpu::<i32, _>(|s| s.as_ptr() as u64),
                other => Err(Error::bad_arg(
                    "train::Arena",
                    "dtype",
                    "f32, bf16, f16 or i32",
                    other,
                ))?,
            },
        }
    }

    /// A contiguous view of `shape` starting at element `offset`.
    pub fn view(&self, offset: usize, shape: &[usize]) -> Result<Tensor> {
        let mut strides = vec![1usize; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        self.view_strided(offset, shape, &strides)
    }

    /// A strided view starting at element `offset`; every element it addresses lies inside the
    /// arena (checked).
    pub fn view_strided(
        &self,
        offset: usize,
        shape: &[usize],
        strides: &[usize],
    ) -> Result<Tensor> {
        let span = if shape.contains(&0) {
            0
        } else {
            1 + shape
                .iter()
                .zip(strides)
                .map(|(&n, &s)| (n - 1) * s)
                .sum::<usize>()
        };
        if offset + span > self.len {
            return Err(Error::bad_arg(
                "train::Arena::view",
                "offset/shape",
                format!("a view inside the arena's {} elements", self.len),
                format!("offset {offset}, shape {shape:?}, strides {strides:?}"),
            ));
        }
        let es = self.owner.dtype().size_in_bytes() as u64;
        let ptr = self.base()? + offset as u64 * es;
        let dtype = self.owner.dtype();
        // SAFETY: [offset, offset + span) lies inside the owner's allocation (checked above), which
        // lives as long as the arena; the arena's invariant (see the type) keeps overlapping
        // views from being accessed at the same time.
        match self.owner.device() {
            Device::Cuda(_) => unsafe {
                Tensor::from_device_ptr(self.owner.cuda_device()?, ptr, shape, strides, dtype)
            },
            Device::Cpu => unsafe { Tensor::from_host_ptr(ptr, shape, strides, dtype) },
        }
    }

    /// The whole arena as `[len]`.
    pub fn whole(&self) -> Result<Tensor> {
        self.view(0, &[self.len])
    }
}

/// Hands out aligned offsets for named slots.
#[derive(Default, Clone, Debug)]
pub struct Layout {
    /// (name, offset, shape) of each slot, in push order.
    pub slots: Vec<(String, usize, Vec<usize>)>,
    /// Elements up to the end of the last slot (or the last alignment).
    pub len: usize,
}

impl Layout {
    /// Reserves `shape`, aligned, and returns its offset.
    pub fn push(&mut self, name: impl Into<String>, shape: &[usize]) -> usize {
        let off = self.len.div_ceil(ALIGN) * ALIGN;
        let n: usize = shape.iter().product();
        self.slots.push((name.into(), off, shape.to_vec()));
        self.len = off + n;
        off
    }
    /// (offset, elements) of the slot `name`.
    pub fn span(&self, name: &str) -> Option<(usize, usize)> {
        self.slots
            .iter()
            .find(|s| s.0 == name)
            .map(|(_, o, shape)| (*o, shape.iter().product()))
    }
    /// Pads the end to the alignment (so a following group starts aligned).
    pub fn align(&mut self) {
        self.len = self.len.div_ceil(ALIGN) * ALIGN;
    }
}
