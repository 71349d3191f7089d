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
    if !cols.is_multiple_of(vec) {
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
        let c = candidates(4096, DType::BF16, &[0]);
        assert_eq!(
            c.iter().map(|c| c.chunks).collect::<Vec<_>>(),
            vec![1, 2, 4]
        );
        assert_eq!(threads_for(4096, DType::BF16, 2), 256);
        // 32768 bf16 = 4096 vectors: only 4 per thread fits 1024 threads.
        assert_eq!(candidates(32768, DType::BF16, &[2, 4]).len(), 2);
    }
}

/// A launch configuration of a vectorized row kernel: vectors per thread, and for kernels with a
/// fixed grid (the norm backward) blocks per SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowConfig {
    pub chunks: usize,
    pub blocks_per_sm: u32,
}

impl std::fmt::Display for RowConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "chunks={}", self.chunks)?;
        if self.blocks_per_sm > 0 {
            write!(f, " grid={}/SM", self.blocks_per_sm)?;
        }
        Ok(())
    }
}

/// Threads per block for `chunks` vectors per thread.
pub fn threads_for(cols: usize, dtype: DType, chunks: usize) -> u32 {
    round_warps((cols / vec_width(dtype)).div_ceil(chunks))
}

/// The configurations worth timing: every compiled chunk count whose block fits 1024 threads,
/// crossed with `grids` (blocks per SM; `[0]` for one block per row).
pub fn candidates(cols: usize, dtype: DType, grids: &[u32]) -> Vec<RowConfig> {
    let vecs = cols / vec_width(dtype);
    let mut v = Vec::new();
    for chunks in [1, 2, MAX_CHUNKS] {
        if vecs.div_ceil(chunks) <= 1024 && (chunks == 1 || vecs.div_ceil(chunks / 2) >= 32) {
            for &g in grids {
                v.push(RowConfig {
                    chunks,
                    blocks_per_sm: g,
                });
            }
        }
    }
    v
}

/// The configuration of a vectorized row kernel for this problem: remembered from an earlier
/// measurement, or measured now by `time` (one call per candidate, on the caller's real buffers;
/// the kernels are idempotent, so re-running them is harmless). `key` names the kernel.
pub fn tuned(
    dev: &super::CudaDevice,
    key: &str,
    rows: usize,
    cols: usize,
    dtype: DType,
    grids: &[u32],
    time: impl FnMut(&RowConfig) -> crate::core::error::Result<f64>,
) -> crate::core::error::Result<RowConfig> {
    let cands = candidates(cols, dtype, grids);
    let key = format!(
        "{}/{key}/{dtype}/rows~{}/cols={cols}",
        dev.props().name,
        crate::core::tune::shape_class(&[rows])
    );
    crate::core::tune::pick(&key, &cands, time).map(|(c, _)| c)
}

/// Median milliseconds of `f` on `stream` over a few repeats: the measurement `tuned` uses.
pub fn time_briefly(
    dev: &super::CudaDevice,
    stream: &super::Stream,
    mut f: impl FnMut() -> crate::core::error::Result<()>,
) -> crate::core::error::Result<f64> {
    if super::is_capturing(stream) {
        return Err(crate::core::tune::not_now(
            "the stream is capturing a CUDA graph",
        ));
    }
    let budget = crate::core::harness::Budget {
        warmup: 2,
        min_reps: 5,
        max_reps: 25,
        target: std::time::Duration::from_millis(30),
    };
    crate::core::harness::bench::time_gpu(dev, stream, budget, |_| f()).map(|s| s.median_ms)
}
