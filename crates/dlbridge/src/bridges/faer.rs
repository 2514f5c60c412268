//! `faer` bridge (feature `faer`): 2-d tensors as `MatRef`/`MatMut` with any strides (negative,
//! and zero for read-only views), and `Mat<T>` exported as a column-major tensor, both without
//! copying.
//!
//! ```
//! use dlbridge::ManagedTensor;
//! // A row-major 2x3 tensor (as numpy or torch would hand it over)...
//! let t = ManagedTensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
//! let g = t.as_faer::<f64>().unwrap();
//! let m = g.mat();
//! assert_eq!((m.nrows(), m.ncols(), m.row_stride(), m.col_stride()), (2, 3, 3, 1));
//! assert_eq!(m[(1, 2)], 6.0);
//! assert_eq!(m.as_ptr(), t.data_ptr().cast_const().cast());
//! // ...and a faer matrix out, column-major with faer's column stride.
//! let a = faer::Mat::<f32>::from_fn(3, 2, |i, j| (10 * i + j) as f32);
//! let ptr = a.as_ptr();
//! let e = ManagedTensor::from_faer(a).unwrap();
//! assert_eq!((e.shape()[0], e.shape()[1], e.strides()[0]), (3, 2, 1));
//! assert_eq!(e.data_ptr().cast_const().cast(), ptr);
//! assert_eq!(e.get::<f32>(&[2, 1]).unwrap(), 21.0);
//! ```

use std::marker::PhantomData;
use std::ptr::NonNull;

use faer::{Mat, MatMut, MatRef};

use crate::borrow::Lease;
use crate::dtype::Element;
use crate::error::Result;
use crate::export::HostBuffer;
use crate::managed::ManagedTensor;

/// A read-only faer view of a 2-d tensor ([`ManagedTensor::as_faer`]). It holds a shared lease
/// on the memory (see [`crate::borrow`]) until it drops; [`FaerRef::mat`] lends a `MatRef` for as
/// long as the guard is borrowed.
#[derive(Debug)]
pub struct FaerRef<'a, T> {
    raw: Raw<T>,
    _lease: Lease,
    _tensor: PhantomData<&'a T>,
}

/// A mutable faer view of a 2-d tensor ([`ManagedTensor::as_faer_mut`]). It holds an exclusive
/// lease on the memory until it drops; [`FaerMut::mat_mut`] lends a `MatMut`.
#[derive(Debug)]
pub struct FaerMut<'a, T> {
    raw: Raw<T>,
    _lease: Lease,
    _tensor: PhantomData<&'a mut T>,
}

/// First element, extents and strides (in elements) of a checked 2-d view.
#[derive(Debug)]
struct Raw<T> {
    first: NonNull<T>,
    shape: [usize; 2],
    strides: [isize; 2],
}

impl<T> FaerRef<'_, T> {
    /// The matrix, borrowed from the guard (it cannot outlive the guard's lease).
    pub fn mat(&self) -> MatRef<'_, T> {
        let Raw { first, shape: [r, c], strides: [rs, cs] } = self.raw;
        // SAFETY: `strided_view` checked host memory of dtype T, aligned, every element the
        // strides reach inside the validated span and of valid value; the tensor outlives 'a and
        // the shared lease keeps dlbridge's mutable access away while this borrow of the guard
        // lives.
        unsafe { MatRef::from_raw_parts(first.as_ptr(), r, c, rs, cs) }
    }
}

impl<T> FaerMut<'_, T> {
    /// The matrix, read-only, borrowed from the guard.
    pub fn mat(&self) -> MatRef<'_, T> {
        let Raw { first, shape: [r, c], strides: [rs, cs] } = self.raw;
        // SAFETY: as in `FaerRef::mat`; `&self` excludes the guard's mutable borrow.
        unsafe { MatRef::from_raw_parts(first.as_ptr(), r, c, rs, cs) }
    }

    /// The matrix, mutable, borrowed from the guard.
    pub fn mat_mut(&mut self) -> MatMut<'_, T> {
        let Raw { first, shape: [r, c], strides: [rs, cs] } = self.raw;
        // SAFETY: as in `FaerRef::mat`, and: the tensor is writable, no two indices reach the
        // same element (`may_overlap` said so), the exclusive lease and `&mut self` make this the
        // only access dlbridge hands out while the borrow lives.
        unsafe { MatMut::from_raw_parts_mut(first.as_ptr(), r, c, rs, cs) }
    }
}

impl ManagedTensor {
    fn faer_raw<T: Element>(&self, write: bool) -> Result<(Raw<T>, Lease)> {
        let (shape, strides) = super::dims::<2>(self, "a faer matrix")?;
        let (first, lease) = self.strided_view::<T>(write)?;
        Ok((Raw { first, shape, strides }, lease))
    }

    /// A read-only faer view of a 2-d host tensor of dtype `T`, with the tensor's strides
    /// (row-major, column-major, negative, zero), without copying. It holds a shared lease:
    /// [`crate::Error::AlreadyBorrowed`] while another handle over the same memory holds a
    /// mutable slice or view.
    pub fn as_faer<T: Element>(&self) -> Result<FaerRef<'_, T>> {
        let (raw, lease) = self.faer_raw::<T>(false)?;
        Ok(FaerRef { raw, _lease: lease, _tensor: PhantomData })
    }

    /// A mutable faer view; refused for read-only tensors and for layouts whose elements may
    /// overlap ([`crate::layout::may_overlap`]). It holds an exclusive lease.
    pub fn as_faer_mut<T: Element>(&mut self) -> Result<FaerMut<'_, T>> {
        let (raw, lease) = self.faer_raw::<T>(true)?;
        Ok(FaerMut { raw, _lease: lease, _tensor: PhantomData })
    }

    /// Exports a faer `Mat<T>` without copying: shape `(nrows, ncols)`, strides `(1, col_stride)`
    /// (faer pads each column to its SIMD alignment, so `col_stride` may exceed `nrows`; the
    /// padding is never part of the tensor). The matrix is freed when the last consumer releases
    /// the tensor.
    pub fn from_faer<T: Element>(m: Mat<T>) -> Result<Self> {
        let shape = [m.nrows(), m.ncols()];
        let strides = [1, m.col_stride()];
        ManagedTensor::from_host_strided(FaerMat(m), &shape, &strides, 0)
    }
}

/// A faer matrix as the owner of an exported tensor.
struct FaerMat<T>(Mat<T>);

// SAFETY: faer allocates `col_stride * ncols` elements (column stride = row capacity >= nrows,
// column capacity >= ncols) and never moves them while the `Mat` lives (it holds a raw pointer,
// so moving the `Mat` moves no allocation); `elem_count` is the span from the first element to
// the last one the layout reaches. The padding rows inside that span are allocated but may be
// uninitialised: no index of the exported layout reaches them, and neither dlbridge nor a DLPack
// consumer reads anything but the elements the layout reaches. The `Mat` is owned here alone.
unsafe impl<T: Element> HostBuffer for FaerMat<T> {
    type Elem = T;
    fn as_mut_ptr(&mut self) -> *mut T {
        self.0.as_ptr_mut()
    }
    fn elem_count(&self) -> usize {
        let (r, c) = (self.0.nrows(), self.0.ncols());
        if r == 0 || c == 0 { 0 } else { (c - 1) * self.0.col_stride() as usize + r }
    }
}
