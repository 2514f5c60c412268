//! Pure shape and stride arithmetic: element counts, spans, contiguity, compact strides.
//!
//! No pointers here, and every operation is overflow-checked, so any `i64` input is safe to feed
//! (this module is a fuzz target). Strides are in elements, as in DLPack.
//!
//! ```
//! use dlbridge::layout;
//! let shape = [2, 3, 4];
//! let c = layout::c_strides(&shape);
//! assert_eq!(c, [12, 4, 1]);
//! assert!(layout::is_c_contiguous(&shape, &c));
//! assert!(layout::is_f_contiguous(&shape, &layout::f_strides(&shape)));
//! assert_eq!(layout::element_span(&[3, 4], &[-4, 1]).unwrap(), (-8, 3));
//! ```

use crate::error::{Error, Result};

/// The number of elements of `shape`; every extent must be non-negative and the product must fit
/// in `isize`.
pub fn element_count(shape: &[i64]) -> Result<u64> {
    // One pass: a negative extent is an error wherever it is; a zero anywhere makes the count 0
    // (and then an overflowing product of the other extents is irrelevant).
    let mut n: u64 = 1;
    let mut overflow = false;
    let mut zero = false;
    for (axis, &d) in shape.iter().enumerate() {
        if d < 0 {
            return Err(Error::NegativeDim { axis, value: d });
        }
        zero |= d == 0;
        match n.checked_mul(d as u64) {
            Some(m) if m <= isize::MAX as u64 => n = m,
            _ => overflow = true,
        }
    }
    if zero {
        Ok(0)
    } else if overflow {
        Err(Error::ElementCountOverflow { shape: shape.to_vec() })
    } else {
        Ok(n)
    }
}

/// Compact row-major (C order) strides for `shape`. Exact whenever the element count fits in
/// `isize`; for shapes with a zero extent (where any stride is valid) the values saturate
/// instead of overflowing.
pub fn c_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1; shape.len()];
    c_strides_into(shape, &mut strides);
    strides
}

/// [`c_strides`] written into `strides` (of `shape`'s length), for callers that keep their own
/// storage.
pub(crate) fn c_strides_into(shape: &[i64], strides: &mut [i64]) {
    debug_assert_eq!(shape.len(), strides.len());
    let mut acc: i64 = 1;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(d.max(1));
    }
}

/// Compact column-major (Fortran order) strides for `shape`; see [`c_strides`].
pub fn f_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1; shape.len()];
    let mut acc: i64 = 1;
    for (s, &d) in strides.iter_mut().zip(shape) {
        *s = acc;
        acc = acc.saturating_mul(d.max(1));
    }
    strides
}

fn is_compact<'a>(dims: impl Iterator<Item = (&'a i64, &'a i64)>, shape: &[i64]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expected: i64 = 1;
    for (&d, &s) in dims {
        if d == 1 {
            continue;
        }
        if s != expected {
            return false;
        }
        match expected.checked_mul(d) {
            Some(e) => expected = e,
            None => return false,
        }
    }
    true
}

/// Whether elements are laid out in row-major order with no gaps. Strides of size-1 axes are
/// ignored, and a tensor with no elements is contiguous, as numpy and torch decide.
pub fn is_c_contiguous(shape: &[i64], strides: &[i64]) -> bool {
    shape.len() == strides.len() && is_compact(shape.iter().zip(strides).rev(), shape)
}

/// Whether elements are laid out in column-major order with no gaps; see [`is_c_contiguous`].
pub fn is_f_contiguous(shape: &[i64], strides: &[i64]) -> bool {
    shape.len() == strides.len() && is_compact(shape.iter().zip(strides), shape)
}

/// The lowest and highest element offsets, relative to the first element (index all zeros), that
/// a tensor with at least one element reaches. Negative strides give a negative lowest offset; a
/// tensor with no elements gives `(0, -1)` (an empty range). Errors with [`Error::SpanOverflow`]
/// when an offset does not fit in `i64`, and [`Error::NegativeDim`] for a negative extent.
pub fn element_span(shape: &[i64], strides: &[i64]) -> Result<(i64, i64)> {
    let overflow = || Error::SpanOverflow { shape: shape.to_vec(), strides: strides.to_vec() };
    if shape.len() != strides.len() {
        return Err(overflow());
    }
    let (mut lo, mut hi) = (0i64, 0i64);
    for (axis, (&d, &s)) in shape.iter().zip(strides).enumerate() {
        if d == 0 {
            return Ok((0, -1));
        }
        if d < 0 {
            return Err(Error::NegativeDim { axis, value: d });
        }
        let reach = (d - 1).checked_mul(s).ok_or_else(overflow)?;
        if reach < 0 {
            lo = lo.checked_add(reach).ok_or_else(overflow)?;
        } else {
            hi = hi.checked_add(reach).ok_or_else(overflow)?;
        }
    }
    Ok((lo, hi))
}

/// Whether two different indices of a tensor may reach the same element: a conservative test
/// (it may say yes for some layouts whose elements happen not to collide, never no for one whose
/// do). Axes of extent 1 are ignored and a tensor with no elements never overlaps. Sorted by
/// absolute stride, each axis must step past everything the smaller axes reach:
/// `|stride| > sum(|stride_j| * (extent_j - 1))` over the axes before it. Every C- or
/// F-contiguous layout, and every slice of one, passes.
///
/// ```
/// use dlbridge::layout::may_overlap;
/// assert!(!may_overlap(&[2, 3], &[3, 1]));
/// assert!(!may_overlap(&[2, 3], &[-6, 2]));  // reversed rows, every other column
/// assert!(may_overlap(&[2, 2], &[1, 1]));    // as_strided(zeros(3), (2, 2), (8, 8))
/// assert!(may_overlap(&[4], &[0]));          // broadcast
/// assert!(!may_overlap(&[0, 4], &[0, 0]));   // no elements
/// ```
pub fn may_overlap(shape: &[i64], strides: &[i64]) -> bool {
    if shape.len() != strides.len() || shape.iter().any(|&d| d <= 0) {
        // A mismatched layout is refused elsewhere; an empty one has nothing to overlap.
        return shape.len() != strides.len();
    }
    // The common layouts first: one axis (elements meet only at stride 0), and compact row-major
    // strides (each element its own offset).
    if let ([d], [s]) = (shape, strides) {
        return *d > 1 && *s == 0;
    }
    if is_c_contiguous(shape, strides) {
        return false;
    }
    // (stride, steps) of every axis that steps, sorted by stride: on the stack for the usual ranks.
    let mut inline = [(0u64, 0u64); crate::dims::INLINE];
    let mut heap = Vec::new();
    let axes: &mut [(u64, u64)] = if shape.len() <= inline.len() {
        &mut inline
    } else {
        heap.resize(shape.len(), (0, 0));
        &mut heap
    };
    let mut n = 0;
    for (&d, &s) in shape.iter().zip(strides).filter(|&(&d, _)| d > 1) {
        axes[n] = (s.unsigned_abs(), d as u64 - 1);
        n += 1;
    }
    let axes = &mut axes[..n];
    axes.sort_unstable();
    let mut reach: u64 = 0;
    for &mut (stride, steps) in axes {
        if stride <= reach {
            return true;
        }
        match stride.checked_mul(steps).and_then(|r| reach.checked_add(r)) {
            Some(r) => reach = r,
            // Past u64 every later stride is smaller than the reach: call it overlapping.
            None => return true,
        }
    }
    false
}

/// The byte range `[start, end)` relative to the first element's address that a tensor with at
/// least one element touches, for elements of `storage_bits` bits each (packed when not a
/// multiple of 8). The range must fit in `isize` in both directions.
pub fn byte_span(shape: &[i64], strides: &[i64], storage_bits: u64) -> Result<(isize, isize)> {
    let overflow = || Error::SpanOverflow { shape: shape.to_vec(), strides: strides.to_vec() };
    let (lo, hi) = element_span(shape, strides)?;
    if storage_bits % 8 == 0 {
        // Whole bytes (every type but the packed sub-byte ones): exact in i64 arithmetic.
        let item = i64::try_from(storage_bits / 8).map_err(|_| overflow())?;
        let start = lo.checked_mul(item);
        let end = hi.checked_add(1).and_then(|h| h.checked_mul(item));
        let fit = |v: Option<i64>| v.and_then(|v| isize::try_from(v).ok());
        return match (fit(start), fit(end)) {
            (Some(s), Some(e)) if e.checked_sub(s).is_some() => Ok((s, e)),
            _ => Err(overflow()),
        };
    }
    let bits = i128::from(storage_bits);
    let start = (i128::from(lo) * bits).div_euclid(8);
    let end = ((i128::from(hi) + 1) * bits + 7).div_euclid(8);
    let fits = |v: i128| isize::try_from(v).map_err(|_| overflow());
    let (start, end) = (fits(start)?, fits(end)?);
    // The whole extent must also be a valid allocation size.
    end.checked_sub(start).ok_or_else(overflow)?;
    Ok((start, end))
}

/// Bytes taken by `numel` compact elements of `storage_bits` bits (packed sub-byte elements share
/// bytes, rounded up at the end).
pub fn compact_byte_size(numel: u64, storage_bits: u64) -> Result<u64> {
    let bits = u128::from(numel) * u128::from(storage_bits);
    u64::try_from(bits.div_ceil(8))
        .ok()
        .filter(|&b| b <= isize::MAX as u64)
        .ok_or_else(|| Error::ElementCountOverflow { shape: vec![numel as i64] })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every multi-index of `shape`, in C order.
    fn indices(shape: &[i64]) -> Vec<Vec<i64>> {
        let mut out = vec![vec![]];
        for &d in shape {
            out = out
                .into_iter()
                .flat_map(|prefix| {
                    (0..d).map(move |i| {
                        let mut p = prefix.clone();
                        p.push(i);
                        p
                    })
                })
                .collect();
        }
        out
    }

    fn offset(index: &[i64], strides: &[i64]) -> i64 {
        index.iter().zip(strides).map(|(i, s)| i * s).sum()
    }

    fn small_shape() -> impl Strategy<Value = Vec<i64>> {
        prop::collection::vec(0i64..5, 0..5)
    }

    /// A shape with extents in `dims` and strides of the same length.
    fn shape_and_strides(dims: std::ops::Range<i64>) -> impl Strategy<Value = (Vec<i64>, Vec<i64>)> {
        (0usize..5).prop_flat_map(move |n| {
            (prop::collection::vec(dims.clone(), n), prop::collection::vec(-30i64..30, n))
        })
    }

    proptest! {
        #[test]
        fn element_count_matches_product(shape in small_shape()) {
            prop_assert_eq!(element_count(&shape).unwrap(), shape.iter().product::<i64>() as u64);
        }

        #[test]
        fn c_strides_visit_every_offset_in_order(shape in small_shape()) {
            let strides = c_strides(&shape);
            let offs: Vec<i64> = indices(&shape).iter().map(|i| offset(i, &strides)).collect();
            prop_assert_eq!(offs, (0..element_count(&shape).unwrap() as i64).collect::<Vec<_>>());
            prop_assert!(is_c_contiguous(&shape, &strides));
        }

        #[test]
        fn f_strides_are_reversed_c_strides(shape in small_shape()) {
            let mut rev = shape.clone();
            rev.reverse();
            let mut f = f_strides(&shape);
            f.reverse();
            prop_assert_eq!(f, c_strides(&rev));
            prop_assert!(is_f_contiguous(&shape, &f_strides(&shape)));
        }

        #[test]
        fn contiguity_matches_naive_enumeration((shape, strides) in shape_and_strides(0..5)) {
            let n = element_count(&shape).unwrap() as i64;
            let c_offs: Vec<i64> = indices(&shape).iter().map(|i| offset(i, &strides)).collect();
            let naive_c = n == 0 || c_offs == (0..n).collect::<Vec<_>>();
            prop_assert_eq!(is_c_contiguous(&shape, &strides), naive_c);
            let (mut rs, mut rst) = (shape.clone(), strides.clone());
            rs.reverse();
            rst.reverse();
            let f_offs: Vec<i64> = indices(&rs).iter().map(|i| offset(i, &rst)).collect();
            let naive_f = n == 0 || f_offs == (0..n).collect::<Vec<_>>();
            prop_assert_eq!(is_f_contiguous(&shape, &strides), naive_f);
        }

        /// Whatever the overlap test calls disjoint has distinct offsets for distinct indices, and
        /// every contiguous layout is called disjoint.
        #[test]
        fn may_overlap_is_conservative((shape, strides) in shape_and_strides(0..5)) {
            let mut offs: Vec<i64> = indices(&shape).iter().map(|i| offset(i, &strides)).collect();
            let n = offs.len();
            offs.sort_unstable();
            offs.dedup();
            if !may_overlap(&shape, &strides) {
                prop_assert_eq!(offs.len(), n);
            }
            if is_c_contiguous(&shape, &strides) || is_f_contiguous(&shape, &strides) {
                prop_assert!(!may_overlap(&shape, &strides));
            }
        }

        #[test]
        fn span_matches_naive_min_and_max((shape, strides) in shape_and_strides(1..5)) {
            let offs: Vec<i64> = indices(&shape).iter().map(|i| offset(i, &strides)).collect();
            let naive = (*offs.iter().min().unwrap(), *offs.iter().max().unwrap());
            prop_assert_eq!(element_span(&shape, &strides).unwrap(), naive);
            let (b0, b1) = byte_span(&shape, &strides, 32).unwrap();
            prop_assert_eq!((b0 as i64, b1 as i64), (naive.0 * 4, naive.1 * 4 + 4));
        }

        #[test]
        fn byte_span_agrees_with_exact_wide_arithmetic(
            shape in prop::collection::vec(1i64..4, 1..4),
            strides in prop::collection::vec(prop_oneof![any::<i64>(), -1000i64..1000], 1..4),
            bytes in prop_oneof![Just(1u64), Just(2), Just(4), Just(8), Just(16), Just(1u64 << 40)],
        ) {
            let n = shape.len().min(strides.len());
            let (shape, strides) = (&shape[..n], &strides[..n]);
            // Reference: i128 end to end, in range only if both ends and their distance fit isize.
            let expected = element_span(shape, strides).ok().and_then(|(lo, hi)| {
                let (s, e) = (i128::from(lo) * i128::from(bytes), (i128::from(hi) + 1) * i128::from(bytes));
                let fit = |v: i128| isize::try_from(v).ok();
                let (s, e) = (fit(s)?, fit(e)?);
                e.checked_sub(s).map(|_| (s, e))
            });
            prop_assert_eq!(byte_span(shape, strides, bytes * 8).ok(), expected);
        }

        #[test]
        fn arithmetic_never_panics_on_any_input(
            shape in prop::collection::vec(any::<i64>(), 0..6),
            strides in prop::collection::vec(any::<i64>(), 0..6),
            bits in 0u64..=2048,
        ) {
            let _ = element_count(&shape);
            let _ = c_strides(&shape);
            let _ = f_strides(&shape);
            let _ = is_c_contiguous(&shape, &strides);
            let _ = is_f_contiguous(&shape, &strides);
            let _ = element_span(&shape, &strides);
            let _ = byte_span(&shape, &strides, bits);
            let _ = compact_byte_size(shape.first().copied().unwrap_or(0).unsigned_abs(), bits);
        }
    }

    #[test]
    fn overflow_is_reported_not_wrapped() {
        assert!(matches!(element_count(&[i64::MAX, 2]), Err(Error::ElementCountOverflow { .. })));
        assert!(matches!(element_count(&[1 << 62, 4]), Err(Error::ElementCountOverflow { .. })));
        assert_eq!(element_count(&[i64::MAX, 0]).unwrap(), 0);
        assert!(matches!(element_count(&[3, -1]), Err(Error::NegativeDim { axis: 1, value: -1 })));
        assert!(matches!(element_span(&[3, 2], &[i64::MAX, 1]), Err(Error::SpanOverflow { .. })));
        assert!(matches!(byte_span(&[2], &[i64::MAX / 2], 64), Err(Error::SpanOverflow { .. })));
        assert!(compact_byte_size(u64::MAX, 8).is_err());
    }

    #[test]
    fn packed_sub_byte_spans_round_up() {
        // Five packed 4-bit elements take three bytes.
        assert_eq!(byte_span(&[5], &[1], 4).unwrap(), (0, 3));
        assert_eq!(compact_byte_size(5, 4).unwrap(), 3);
        assert_eq!(compact_byte_size(4, 6).unwrap(), 3);
    }

    #[test]
    fn size_one_and_size_zero_axes_accept_any_stride() {
        assert!(is_c_contiguous(&[3, 1, 4], &[4, 999, 1]));
        assert!(is_f_contiguous(&[1, 5], &[-7, 1]));
        assert!(is_c_contiguous(&[0, 5], &[123, -9]));
        assert!(is_c_contiguous(&[], &[]));
        assert!(!is_c_contiguous(&[2, 2], &[1, 2]));
    }
}
