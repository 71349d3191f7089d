//! Host buffers whose size comes from user input, allocated fallibly: a request larger than the
//! machine can give is an `Error::HostMemory` naming what was being allocated, never an abort of
//! the process (Rust's infallible `vec!` aborts, which no caller — a Python user's process
//! included — can catch).

use crate::core::error::{Error, Result};

fn refused(what: &str, n: usize, elem: usize) -> Error {
    Error::HostMemory {
        what: what.into(),
        bytes: n as u128 * elem as u128,
    }
}

/// `n` zeroed elements. Zeroed pages come from the allocator's zeroing path (calloc: untouched
/// pages cost nothing until written), as `vec![0; n]` would.
pub fn zeroed<T: bytemuck::Zeroable>(n: usize, what: &str) -> Result<Vec<T>> {
    let size = std::mem::size_of::<T>();
    if n == 0 || size == 0 {
        return Ok(std::iter::repeat_with(T::zeroed).take(n).collect());
    }
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| refused(what, n, size))?;
    // SAFETY: `layout` has a non-zero size (n > 0, T not zero-sized).
    let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if p.is_null() {
        return Err(refused(what, n, size));
    }
    // SAFETY: `p` was allocated by the global allocator with the layout of `n` Ts (what a Vec of
    // capacity n uses), all bytes zero, which is a valid T (Zeroable); length = capacity = n.
    Ok(unsafe { Vec::from_raw_parts(p, n, n) })
}

/// An empty Vec with room for `n` elements.
pub fn with_capacity<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| refused(what, n, std::mem::size_of::<T>()))?;
    Ok(v)
}

/// A copy of `src`.
pub fn copy_of<T: Copy>(src: &[T], what: &str) -> Result<Vec<T>> {
    let mut v = with_capacity(src.len(), what)?;
    v.extend_from_slice(src);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_errors_not_aborts() {
        for n in [usize::MAX / 8, 1usize << 60] {
            let e = zeroed::<u64>(n, "a test buffer").unwrap_err().to_string();
            assert!(
                e.contains("a test buffer") && e.contains("host memory"),
                "{e}"
            );
            let e = with_capacity::<u32>(n, "a capacity")
                .unwrap_err()
                .to_string();
            assert!(e.contains("a capacity"), "{e}");
        }
        let v = zeroed::<u32>(1000, "small").unwrap();
        assert!(v.len() == 1000 && v.iter().all(|&x| x == 0));
        assert!(zeroed::<u8>(0, "empty").unwrap().is_empty());
        assert_eq!(copy_of(&[1u8, 2, 3], "copy").unwrap(), vec![1, 2, 3]);
    }
}
