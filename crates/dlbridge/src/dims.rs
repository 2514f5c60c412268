//! [`Dims`]: the one place a tensor description's shape and strides are stored by dlbridge
//! itself (exports, borrowed views, buffer-protocol reads): inline up to [`INLINE`] dimensions,
//! on the heap beyond.

/// Dimensions stored inline; more spill to one heap allocation.
pub(crate) const INLINE: usize = 8;

/// A shape followed by its strides (`2 * ndim` values).
// The readers serve the Python layer (and the tests).
#[cfg_attr(not(any(feature = "python", test)), allow(dead_code))]
pub(crate) struct Dims {
    ndim: usize,
    inline: [i64; 2 * INLINE],
    heap: Vec<i64>,
}

#[cfg_attr(not(any(feature = "python", test)), allow(dead_code))]
impl Dims {
    /// No dimensions.
    pub(crate) const fn new() -> Self {
        Self { ndim: 0, inline: [0; 2 * INLINE], heap: Vec::new() }
    }

    /// Replaces the contents with `shape` and `strides` (of equal length). Pointers taken before
    /// are stale afterwards.
    #[inline(always)]
    pub(crate) fn set(&mut self, shape: &[i64], strides: &[i64]) {
        let n = shape.len();
        // (Unequal lengths go the general way, which refuses them as it always did: a panic.)
        if n > INLINE || strides.len() != n || self.heap.capacity() != 0 {
            return self.set_spilled(shape, strides);
        }
        self.ndim = n;
        // One loop writing both (a view's tensor has few dimensions: two `memcpy` calls cost more
        // than the copy).
        let (s, t) = self.inline.split_at_mut(n);
        for ((s, t), (&a, &b)) in s.iter_mut().zip(t.iter_mut()).zip(shape.iter().zip(strides)) {
            *s = a;
            *t = b;
        }
    }

    /// [`Dims::set`] with more than [`INLINE`] dimensions, or a heap allocation to give back.
    #[cold]
    #[inline(never)]
    fn set_spilled(&mut self, shape: &[i64], strides: &[i64]) {
        let (s, t) = self.resize(shape.len());
        s.copy_from_slice(shape);
        t.copy_from_slice(strides);
    }

    /// Makes room for `ndim` dimensions and returns (shape, strides) to fill. Pointers taken
    /// before are stale afterwards.
    pub(crate) fn resize(&mut self, ndim: usize) -> (&mut [i64], &mut [i64]) {
        self.ndim = ndim;
        let all: &mut [i64] = if ndim <= INLINE {
            if self.heap.capacity() != 0 {
                self.heap = Vec::new();
            }
            &mut self.inline[..2 * ndim]
        } else {
            self.heap.clear();
            self.heap.resize(2 * ndim, 0);
            &mut self.heap
        };
        all.split_at_mut(ndim)
    }

    /// The number of dimensions.
    pub(crate) fn ndim(&self) -> usize {
        self.ndim
    }

    /// The shape.
    pub(crate) fn shape(&self) -> &[i64] {
        &self.all()[..self.ndim]
    }

    /// The strides.
    pub(crate) fn strides(&self) -> &[i64] {
        &self.all()[self.ndim..]
    }

    fn all(&self) -> &[i64] {
        if self.ndim <= INLINE { &self.inline[..2 * self.ndim] } else { &self.heap }
    }

    /// Pointers to the shape and the strides for a `DLTensor` (both NULL for no dimensions),
    /// derived from `this` without making a reference to the whole `Dims`, so they stay valid
    /// (under Stacked Borrows too) while the `Dims` is only read or moved as part of a heap block
    /// that does not move, until it is next written.
    ///
    /// # Safety
    ///
    /// `this` points to a live `Dims` that nothing else accesses during the call.
    pub(crate) unsafe fn pointers(this: *mut Self) -> (*mut i64, *mut i64) {
        // SAFETY: the caller's promise; fields read and addressed through the raw pointer.
        unsafe {
            let n = (*this).ndim;
            if n == 0 {
                return (std::ptr::null_mut(), std::ptr::null_mut());
            }
            let base: *mut i64 = if n <= INLINE {
                std::ptr::addr_of_mut!((*this).inline).cast()
            } else {
                (*std::ptr::addr_of_mut!((*this).heap)).as_mut_ptr()
            };
            (base, base.add(n))
        }
    }
}

/// Writes a slice like a Python tuple: `(3, 4)`, `(3,)`, `()`.
pub(crate) fn tuple<T: std::fmt::Display>(items: &[T]) -> String {
    match items {
        [one] => format!("({one},)"),
        _ => format!("({})", items.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_and_heap_hold_what_was_set() {
        for n in [0usize, 1, 8, 9, 20] {
            let shape: Vec<i64> = (0..n as i64).collect();
            let strides: Vec<i64> = (0..n as i64).map(|x| -x).collect();
            let mut d = Dims::new();
            d.set(&shape, &strides);
            assert_eq!((d.ndim(), d.shape(), d.strides()), (n, &shape[..], &strides[..]));
            // SAFETY: a live Dims, accessed by nothing else during the call.
            let (sp, tp) = unsafe { Dims::pointers(&mut d) };
            if n == 0 {
                assert!(sp.is_null() && tp.is_null());
            } else {
                // SAFETY: n values at each, valid until `d` is next written.
                unsafe {
                    assert_eq!(std::slice::from_raw_parts(sp, n), &shape[..]);
                    assert_eq!(std::slice::from_raw_parts(tp, n), &strides[..]);
                }
            }
        }
        let mut d = Dims::new();
        d.set(&[1; 12], &[2; 12]);
        d.set(&[3], &[4]);
        assert_eq!((d.shape(), d.strides()), (&[3i64][..], &[4i64][..]));
        // Inline again after spilling, and a spill after inline values: each reads back whole.
        d.set(&[5, 6], &[7, 8]);
        assert_eq!((d.shape(), d.strides()), (&[5i64, 6][..], &[7i64, 8][..]));
        d.set(&[9; 10], &[1; 10]);
        assert_eq!((d.shape(), d.strides()), (&[9i64; 10][..], &[1i64; 10][..]));
    }

    #[test]
    #[should_panic]
    fn unequal_lengths_are_refused_not_truncated() {
        Dims::new().set(&[1, 2], &[1]);
    }
}
