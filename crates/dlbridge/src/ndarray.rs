//! `ndarray` bridge (feature `ndarray`): views over a [`ManagedTensor`] with any strides, and
//! export of owned `ndarray` arrays without copying.
//!
//! Views keep the tensor's own layout: Fortran order, broadcast (zero) strides on read-only
//! views, and negative strides all map directly onto ndarray strides (no axis reversal is imposed
//! on the caller).
//!
//! ```
//! use dlbridge::ManagedTensor;
//! use ndarray::{array, s};
//! let a = array![[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]];
//! let flipped = a.slice_move(s![.., ..;-1]);
//! let t = ManagedTensor::from_ndarray(flipped).unwrap();
//! assert_eq!(t.strides(), &[3, -1]);
//! let v = t.as_array::<f32>().unwrap();
//! assert_eq!(*v, array![[3.0f32, 2.0, 1.0], [6.0, 5.0, 4.0]].into_dyn());
//! ```

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use ndarray::{Array, ArrayBase, ArrayViewD, ArrayViewMutD, Axis, Dimension, IxDyn, ShapeBuilder};

use crate::borrow::Lease;
use crate::dtype::Element;
use crate::error::Result;
use crate::managed::ManagedTensor;

/// A read-only `ndarray` view ([`ManagedTensor::as_array`]): derefs to `ndarray::ArrayRef` (every
/// read method; `.view()` for an `ArrayView` as long as the guard) and holds a shared lease on the memory (see [`crate::borrow`]) until it drops.
#[derive(Debug)]
pub struct ArrayGuard<'a, T> {
    view: ArrayViewD<'a, T>,
    _lease: Lease,
}

/// A mutable `ndarray` view ([`ManagedTensor::as_array_mut`]): derefs mutably to
/// `ndarray::ArrayRef` (`mapv_inplace`, `view_mut()`, indexing) and holds an exclusive lease on the memory until it drops.
#[derive(Debug)]
pub struct ArrayGuardMut<'a, T> {
    view: ArrayViewMutD<'a, T>,
    _lease: Lease,
}

impl<T: PartialEq, S: ndarray::Data<Elem = T>> PartialEq<ArrayBase<S, IxDyn>> for ArrayGuard<'_, T> {
    fn eq(&self, other: &ArrayBase<S, IxDyn>) -> bool {
        self.view == *other
    }
}

impl<T: PartialEq, S: ndarray::Data<Elem = T>> PartialEq<ArrayBase<S, IxDyn>> for ArrayGuardMut<'_, T> {
    fn eq(&self, other: &ArrayBase<S, IxDyn>) -> bool {
        self.view == *other
    }
}

// The guards deref to ndarray's unsized `ArrayRef` rather than to the view itself: an
// `ArrayViewD<'a, T>` reached through `&self` could be cloned (or, mutably, swapped out) and
// outlive the guard and its lease; an `&ArrayRef` only lends views as long as the guard.
impl<T> Deref for ArrayGuard<'_, T> {
    type Target = ndarray::ArrayRef<T, IxDyn>;
    fn deref(&self) -> &ndarray::ArrayRef<T, IxDyn> {
        &self.view
    }
}

impl<T> Deref for ArrayGuardMut<'_, T> {
    type Target = ndarray::ArrayRef<T, IxDyn>;
    fn deref(&self) -> &ndarray::ArrayRef<T, IxDyn> {
        &self.view
    }
}

impl<T> DerefMut for ArrayGuardMut<'_, T> {
    fn deref_mut(&mut self) -> &mut ndarray::ArrayRef<T, IxDyn> {
        &mut self.view
    }
}

/// The pieces ndarray needs: the lowest-address element, shape and absolute strides, plus the
/// axes whose stride was negative (to invert after building the view).
struct Raw<T> {
    low: NonNull<T>,
    shape: Vec<usize>,
    strides: Vec<usize>,
    negative: Vec<usize>,
}

impl<T> Raw<T> {
    /// The shape and strides for ndarray. An empty view takes ndarray's own default strides: the
    /// strides of an empty tensor are never used, and custom zero strides on an axis longer than
    /// one fail ndarray's aliasing check for mutable views even when another axis is empty.
    fn stride_shape(&self) -> ndarray::StrideShape<IxDyn> {
        if self.shape.contains(&0) {
            IxDyn(&self.shape).into()
        } else {
            IxDyn(&self.shape).strides(IxDyn(&self.strides))
        }
    }
}

impl ManagedTensor {
    /// Checks, leases (shared, or exclusive for `write`) and describes the view, through the
    /// one path of every typed strided view (`strided_view`); the lease is taken before any
    /// element is read.
    fn ndarray_raw<T: Element>(&self, write: bool) -> Result<(Raw<T>, Lease)> {
        let shape: Vec<usize> = self.shape().iter().map(|&d| d as usize).collect();
        let (first, lease) = self.strided_view::<T>(write)?;
        if self.numel() == 0 {
            // ndarray requires the product of the non-zero extents to fit isize, even for an empty
            // array ((0, 2^62, 2^62) is a valid empty tensor but not a valid ndarray shape).
            let fits = shape.iter().filter(|&&d| d != 0).try_fold(1usize, |acc, &d| acc.checked_mul(d));
            if fits.is_none_or(|n| n > isize::MAX as usize) {
                return Err(
                    self.refuse_view::<T>(write, " whose non-zero extents multiply to at most isize::MAX")
                );
            }
            let zeros = vec![0; shape.len()];
            return Ok((Raw { low: NonNull::dangling(), shape, strides: zeros, negative: vec![] }, lease));
        }
        let (lo, _) = crate::layout::element_span(self.shape(), self.strides())?;
        let negative = (0..shape.len()).filter(|&ax| self.strides()[ax] < 0 && shape[ax] > 1).collect();
        let strides = self
            .strides()
            .iter()
            .zip(&shape)
            .map(|(&s, &d)| if d > 1 { s.unsigned_abs() as usize } else { 0 })
            .collect();
        // SAFETY: `lo` is the lowest element offset of the validated span, inside the allocation,
        // so the result is in bounds and non-NULL.
        let low = unsafe { NonNull::new_unchecked(first.as_ptr().offset(lo as isize)) };
        Ok((Raw { low, shape, strides, negative }, lease))
    }

    /// A read-only `ndarray` view of a host tensor of dtype `T`, with the tensor's strides
    /// (negative and zero included). It holds a shared lease on the memory while it lives (see
    /// [`crate::borrow`]): [`crate::Error::AlreadyBorrowed`] if another handle over the same
    /// memory holds a mutable slice or view.
    pub fn as_array<T: Element>(&self) -> Result<ArrayGuard<'_, T>> {
        let (r, lease) = self.ndarray_raw::<T>(false)?;
        // SAFETY: host memory of dtype T, aligned, every reachable element inside the validated
        // span, strides non-negative from the lowest address (an empty view reaches no element);
        // kept alive by `&self`; no mutable access through dlbridge while the shared lease lives.
        let mut v = unsafe { ArrayViewD::from_shape_ptr(r.stride_shape(), r.low.as_ptr()) };
        for ax in r.negative {
            v.invert_axis(Axis(ax));
        }
        Ok(ArrayGuard { view: v, _lease: lease })
    }

    /// A mutable `ndarray` view; refused for read-only tensors and for layouts whose elements may
    /// overlap ([`crate::layout::may_overlap`]: a mutable view may not alias). It holds an
    /// exclusive lease on the memory while it lives.
    pub fn as_array_mut<T: Element>(&mut self) -> Result<ArrayGuardMut<'_, T>> {
        let (r, lease) = self.ndarray_raw::<T>(true)?;
        // SAFETY: as in as_array; `&mut self` and the exclusive lease make this the only access
        // dlbridge hands out, the tensor is writable, and no two indices reach the same element
        // (`may_overlap` said so for this shape and these strides).
        let mut v = unsafe { ArrayViewMutD::from_shape_ptr(r.stride_shape(), r.low.as_ptr()) };
        for ax in r.negative {
            v.invert_axis(Axis(ax));
        }
        Ok(ArrayGuardMut { view: v, _lease: lease })
    }

    /// Exports an owned `ndarray` array without copying: C or Fortran order, any strides
    /// (negative ones included), and a start offset inside its buffer.
    pub fn from_ndarray<T: Element, D: Dimension>(a: Array<T, D>) -> Result<Self> {
        let shape = a.shape().to_vec();
        let strides = a.strides().to_vec();
        let (vec, offset) = a.into_raw_vec_and_offset();
        ManagedTensor::from_host_strided(vec, &shape, &strides, offset.unwrap_or(0))
    }
}
