//! TMA tensor maps (CUtensorMap) as the sm_90 kernels take them (`TmaDesc` in hopper.cuh): one
//! encoder for every family that loads or stores tiles with the tensor memory accelerator
//! (matmul's `wgmma`, attention's `hopper`, the FP8 `scaled_mm`).

use crate::core::dtype::DType;
use crate::core::error::{Error, Result};

/// A CUtensorMap as a kernel's `const __grid_constant__ TmaDesc` parameter (128 bytes).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TmaDesc(pub [u64; 16]);

impl TmaDesc {
    /// The all-zero map a kernel receives where it reads nothing through it.
    pub const UNUSED: TmaDesc = TmaDesc([0; 16]);
}

/// The element type TMA moves for `dtype`: 16-bit floats as themselves, f32 as its bits (tf32
/// kernels read them as tf32), every 1-byte type (FP8 included) as bytes.
fn map_dtype(dtype: DType) -> cudarc::driver::sys::CUtensorMapDataType {
    use cudarc::driver::sys::CUtensorMapDataType as T;
    match dtype {
        DType::BF16 => T::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F16 => T::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::F32 => T::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        DType::I32 => T::CU_TENSOR_MAP_DATA_TYPE_INT32,
        DType::U32 => T::CU_TENSOR_MAP_DATA_TYPE_UINT32,
        DType::U16 => T::CU_TENSOR_MAP_DATA_TYPE_UINT16,
        DType::I64 => T::CU_TENSOR_MAP_DATA_TYPE_INT64,
        DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => T::CU_TENSOR_MAP_DATA_TYPE_UINT8,
    }
}

/// cuTensorMapEncodeTiled for a rank-`R` map (R = 2…5): `dims` innermost first, the byte strides
/// of dims 1…R−1 (`strides`, R − 1 of them), a box of `boxd`, zero fill outside the tensor;
/// `swizzle`: the 128-byte swizzle wgmma reads, else the box lands as dense rows.
pub fn encode<const R: usize>(
    dtype: DType,
    ptr: u64,
    dims: [u64; R],
    strides: &[u64],
    boxd: [u32; R],
    swizzle: bool,
) -> Result<TmaDesc> {
    use cudarc::driver::sys;
    if !(2..=5).contains(&R) || strides.len() != R - 1 {
        return Err(Error::cuda(
            "cuTensorMapEncodeTiled",
            format!(
                "a rank-{R} map takes {} strides, got {}",
                R - 1,
                strides.len()
            ),
        ));
    }
    let estr = [1u32; R];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: dims, box and element strides hold R entries and strides R − 1 (checked above), as
    // the call reads for rank R; the map is written by the call.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            map_dtype(dtype),
            R as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxd.as_ptr(),
            estr.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            if swizzle {
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
            } else {
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
            },
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::cuda(
            format!("cuTensorMapEncodeTiled (dims {dims:?}, strides {strides:?}, box {boxd:?})"),
            format!("{r:?}"),
        ));
    }
    // SAFETY: initialised by the successful call above.
    Ok(TmaDesc(unsafe { map.assume_init() }.opaque))
}

/// The 3-D map (contiguous dim, rows, batch) of a row-major matrix or a batch of them: `inner`
/// elements per row, `outer` rows `ld` elements apart, `batch` matrices `batch_stride` apart (0:
/// one matrix broadcast), boxes of `boxd` (inner, rows).
#[allow(clippy::too_many_arguments)]
pub fn matrix_map(
    dtype: DType,
    ptr: u64,
    inner: usize,
    outer: usize,
    ld: usize,
    batch: usize,
    batch_stride: usize,
    boxd: [u32; 2],
    swizzle: bool,
) -> Result<TmaDesc> {
    let es = dtype.size_in_bytes() as u64;
    let (inner, outer) = (inner.max(1) as u64, outer.max(1) as u64);
    let batch = if batch_stride == 0 {
        1
    } else {
        batch.max(1) as u64
    };
    let strides = [
        ld as u64 * es,
        if batch > 1 {
            batch_stride as u64 * es
        } else {
            ld as u64 * es * outer
        },
    ];
    encode(
        dtype,
        ptr,
        [inner, outer, batch],
        &strides,
        [boxd[0], boxd[1], 1],
        swizzle,
    )
}
