//! Shape, strides and offset of a tensor view, all in elements and 64-bit. Every product is
//! checked, so a shape whose element count or byte size would overflow is an error, not a wrap.

use super::error::{Error, Result};

/// How a tensor view maps indices to element offsets in its storage: `offset + Σ index[d] ·
/// strides[d]`. Strides are in elements and never negative; a layout can only be built when its
/// element count and extent fit in 64 bits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Element count of `shape`, checked.
pub fn checked_numel(op: &str, shape: &[usize]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d).ok_or_else(|| Error::Overflow {
            op: op.into(),
            what: format!("shape {shape:?} has more than 2^64 elements"),
        })
    })
}

/// Byte size of `numel` elements of `elem_size` bytes, checked against `isize::MAX` (the largest
/// allocation Rust and CUDA pointers can address).
pub fn checked_bytes(op: &str, numel: usize, elem_size: usize) -> Result<usize> {
    numel
        .checked_mul(elem_size)
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| Error::Overflow {
            op: op.into(),
            what: format!("{numel} elements of {elem_size} bytes exceed the addressable range"),
        })
}

/// Row-major strides for `shape` (last dim stride 1), saturating rather than overflowing: pair it
/// with [`checked_numel`] when the shape comes from outside.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc = acc.saturating_mul(shape[i]);
    }
    strides
}

impl Layout {
    /// A row-major layout of `shape` from offset 0. The shape is not checked here (tensor
    /// constructors check it first); use [`Layout::new`] for shapes from outside.
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// A view with explicit strides and offset (in elements), refused when the ranks differ or
    /// the element count or extent would overflow.
    pub fn new(shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Result<Self> {
        if shape.len() != strides.len() {
            return Err(Error::bad_arg(
                "Layout::new",
                "strides",
                format!("{} strides (one per dim of shape {shape:?})", shape.len()),
                format!("{strides:?}"),
            ));
        }
        // A zero stride lets the extent stay small while the element count overflows: both
        // are checked, so `numel` never overflows on a constructed layout.
        checked_numel("Layout::new", &shape)?;
        let l = Layout {
            shape,
            strides,
            offset,
        };
        l.max_offset("Layout::new")?;
        Ok(l)
    }

    /// Size of each dim.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Distance in elements between neighbours along each dim.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// Offset of the first element in the storage, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    /// Element count; layouts are validated at construction so this cannot overflow.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// One past the largest element offset this view touches (0 for an empty view), checked.
    pub fn max_offset(&self, op: &str) -> Result<usize> {
        if self.shape.contains(&0) {
            return Ok(self.offset);
        }
        let mut end = self.offset;
        for (&d, &s) in self.shape.iter().zip(&self.strides) {
            let span = (d - 1).checked_mul(s).ok_or_else(|| Error::Overflow {
                op: op.into(),
                what: format!("dim {d} × stride {s}"),
            })?;
            end = end.checked_add(span).ok_or_else(|| Error::Overflow {
                op: op.into(),
                what: "view extent".into(),
            })?;
        }
        end.checked_add(1).ok_or_else(|| Error::Overflow {
            op: op.into(),
            what: "view extent".into(),
        })
    }

    /// Row-major contiguous (dims of size 1 may carry any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1usize;
        for i in (0..self.shape.len()).rev() {
            if self.shape[i] != 1 && self.strides[i] != acc {
                return false;
            }
            acc = acc.saturating_mul(self.shape[i]);
        }
        true
    }

    /// Swaps two dims: a view, no copy.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Self> {
        let r = self.rank();
        if a >= r || b >= r {
            return Err(Error::bad_arg(
                "transpose",
                "dims",
                format!("dims < rank {r}"),
                format!("({a}, {b})"),
            ));
        }
        let mut l = self.clone();
        l.shape.swap(a, b);
        l.strides.swap(a, b);
        Ok(l)
    }

    /// Narrows `dim` to `start..start+len`: a view, no copy.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Self> {
        let r = self.rank();
        if dim >= r {
            return Err(Error::bad_arg("narrow", "dim", format!("< rank {r}"), dim));
        }
        let end = start.checked_add(len);
        if end.is_none_or(|e| e > self.shape[dim]) {
            return Err(Error::bad_arg(
                "narrow",
                "start/len",
                format!("start + len <= {} (size of dim {dim})", self.shape[dim]),
                format!("start {start}, len {len}"),
            ));
        }
        let mut l = self.clone();
        // start ≤ size − len: inside the checked extent, except for an empty narrow at the end of
        // a dim, whose offset may pass it (and then never addresses anything).
        l.offset = start
            .checked_mul(self.strides[dim])
            .and_then(|d| self.offset.checked_add(d))
            .unwrap_or(self.offset);
        l.shape[dim] = len;
        Ok(l)
    }

    /// A new shape over the same elements; only for contiguous views (otherwise the caller copies).
    pub fn reshape(&self, shape: &[usize]) -> Result<Self> {
        let n = checked_numel("reshape", shape)?;
        if n != self.numel() {
            return Err(Error::bad_arg(
                "reshape",
                "shape",
                format!("{} elements (from shape {:?})", self.numel(), self.shape),
                format!("{shape:?} ({n} elements)"),
            ));
        }
        if !self.is_contiguous() {
            return Err(Error::bad_arg(
                "reshape",
                "self",
                "a contiguous view (call .contiguous() first)",
                format!("shape {:?} strides {:?}", self.shape, self.strides),
            ));
        }
        Ok(Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: self.offset,
        })
    }

    /// Offsets of every element in row-major order of the view.
    pub fn offsets(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.numel();
        let rank = self.rank();
        let mut idx = vec![0usize; rank];
        let mut cur = self.offset;
        (0..n).map(move |k| {
            if k > 0 {
                // Step back before wrapping a dim, never past it: every intermediate `cur` is an
                // offset of the view (≤ its checked extent), so nothing can overflow.
                for d in (0..rank).rev() {
                    if idx[d] + 1 < self.shape[d] {
                        idx[d] += 1;
                        cur += self.strides[d];
                        break;
                    }
                    cur -= self.strides[d] * idx[d];
                    idx[d] = 0;
                }
            }
            cur
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_narrow_offsets() {
        let l = Layout::contiguous(&[2, 3]);
        let t = l.transpose(0, 1).unwrap();
        assert_eq!(t.offsets().collect::<Vec<_>>(), vec![0, 3, 1, 4, 2, 5]);
        assert!(!t.is_contiguous());
        let n = l.narrow(1, 1, 2).unwrap();
        assert_eq!(n.offsets().collect::<Vec<_>>(), vec![1, 2, 4, 5]);
        assert!(l.narrow(1, 2, 2).is_err());
        assert!(t.reshape(&[6]).is_err());
        assert_eq!(l.reshape(&[3, 2]).unwrap().shape(), &[3, 2]);
    }

    #[test]
    fn overflow_is_an_error() {
        assert!(checked_numel("t", &[1 << 40, 1 << 30]).is_err());
        assert!(checked_bytes("t", 1 << 62, 4).is_err());
        // 2^31 elements and beyond are fine: sizes are 64-bit.
        assert_eq!(checked_numel("t", &[1 << 16, 1 << 16]).unwrap(), 1 << 32);
        assert!(Layout::new(vec![usize::MAX / 2, 3], vec![3, 1], 0).is_err());
    }
}
