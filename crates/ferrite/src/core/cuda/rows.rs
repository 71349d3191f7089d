//! Launch geometry shared by row-wise kernels (norms, softmax, ...): a block per row, and for the
//! vectorized kernels the row held in registers as 16-byte vectors, `chunks` per thread.

use crate::core::dtype::DType;

/// Most 16-byte vectors a thread holds (more would spill the backward kernels).
pub const MAX_CHUNKS: usize = 4;

/// Elements per 16-byte vector.
pub fn vec_width(dtype: DType) -> usize {
    16 / dtype.size_in_bytes()
}

/// Vectors per thread: as few as fit the row in 1024 threads, so short rows get many threads
/// with few registers each (occupancy), long rows up to MAX_CHUNKS per thread.
pub fn chunks(cols: usize, dtype: DType) -> usize {
    match (cols / vec_width(dtype)).div_ceil(1024) {
        0 | 1 => 1,
        2 => 2,
        _ => MAX_CHUNKS,
    }
}

fn round_warps(threads: usize) -> u32 {
    (threads.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// Threads per block of a vectorized row kernel.
pub fn threads_vectorized(cols: usize, dtype: DType) -> u32 {
    round_warps((cols / vec_width(dtype)).div_ceil(chunks(cols, dtype)))
}

/// Threads per block of a scalar row kernel (one element per thread per step).
pub fn threads_scalar(cols: usize) -> u32 {
    round_warps(cols.min(1024))
}

/// Blocks for `rows` rows (kernels loop over rows beyond the grid).
pub fn grid(rows: usize) -> u32 {
    rows.clamp(1, i32::MAX as usize) as u32
}

/// Why a vectorized row kernel cannot take rows of `cols` elements at these addresses, if so.
pub fn vectorized_unfit(cols: usize, dtype: DType, ptrs: &[u64]) -> Option<String> {
    let vec = vec_width(dtype);
    let max = 1024 * MAX_CHUNKS * vec;
    if cols % vec != 0 {
        return Some(format!(
            "needs cols a multiple of {vec} for {dtype} (got {cols})"
        ));
    }
    if cols > max {
        return Some(format!("needs cols ≤ {max} for {dtype} (got {cols})"));
    }
    if ptrs.iter().any(|&a| a % 16 != 0) {
        return Some("needs 16-byte aligned tensors".into());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry() {
        assert_eq!(
            (
                chunks(4096, DType::BF16),
                threads_vectorized(4096, DType::BF16)
            ),
            (1, 512)
        );
        assert_eq!(
            (
                chunks(16384, DType::BF16),
                threads_vectorized(16384, DType::BF16)
            ),
            (2, 1024)
        );
        assert_eq!(chunks(32768, DType::BF16), 4);
        assert!(vectorized_unfit(32768 + 8, DType::BF16, &[]).is_some());
        assert!(vectorized_unfit(4097, DType::BF16, &[]).is_some());
        assert!(vectorized_unfit(4096, DType::F32, &[8]).is_some());
        assert_eq!(threads_scalar(7), 32);
    }
}
