//! `nalgebra` bridge (feature `nalgebra`): 2-d tensors as `DMatrixView`/`DMatrixViewMut` and 1-d
//! tensors as `DVectorView`/`DVectorViewMut`, with the tensor's strides (row-major, column-major,
//! any non-negative step), and `DMatrix`/`DVector` exported, all without copying.
//!
//! nalgebra's strides are unsigned, so a tensor with a negative stride (a reversed axis) is
//! refused with an error that says so (copy it with [`ManagedTensor::to_contiguous`] first).
//!
//! Known in nalgebra 0.34 itself: its element iterator (behind `==`, `sum`, `iter`, `add_scalar`,
//! `clone_owned`) computes with `ptr.add` an address one row stride past each column's last
//! element, which lies outside the allocation for a row-major view or a strided vector. Miri reports
//! this as undefined behaviour in nalgebra for views nalgebra makes from a slice too; the address is
//! never read. Indexing and the views themselves are unaffected.
//!
//! Also in nalgebra (0.34 and 0.35, [dimforge/nalgebra#1616]): the matrix product (`*`, `gemm`,
//! `gemv`, `mul_to`) and `axpy`/`axcpy` take their loop count from the memory span of a strided
//! column, not from its length. With a row-major view (any row stride above 1) as the **left**
//! operand of a product, or a strided vector as the `x` of `axpy`, nalgebra writes past the end of
//! the result column: a heap overflow inside nalgebra, reached from safe code (debug builds stop at
//! the standard library's `get_unchecked_mut` check instead). Views as the right operand, column-major
//! views (row stride 1, as from a Fortran-ordered tensor) and indexing are unaffected. Workaround:
//! give nalgebra a column-major operand, an owned copy made by indexing or from the tensor's slice
//! (not `clone_owned`/`into_owned`, which iterate):
//!
//! ```
//! # use dlbridge::ManagedTensor;
//! # use nalgebra::DMatrix;
//! let t = ManagedTensor::from_vec(vec![0.0f64, 1.0, 2.0, 3.0, 4.0, 5.0], &[2, 3]).unwrap(); // row-major
//! let b = DMatrix::from_column_slice(3, 2, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
//! let g = t.as_dmatrix::<f64>().unwrap();
//! let v = g.view();
//! // Not `v * &b` (nalgebra#1616): copy into a column-major DMatrix first...
//! let a = DMatrix::from_fn(v.nrows(), v.ncols(), |i, j| v[(i, j)]);
//! assert_eq!(&a * &b, DMatrix::from_row_slice(2, 2, &[8.0, 17.0, 26.0, 62.0]));
//! // ...or, for a C-contiguous tensor, straight from its slice.
//! let a = DMatrix::from_row_slice(2, 3, &t.as_slice::<f64>().unwrap());
//! assert_eq!(&a * &b, DMatrix::from_row_slice(2, 2, &[8.0, 17.0, 26.0, 62.0]));
//! ```
//!
//! [dimforge/nalgebra#1616]: https://github.com/dimforge/nalgebra/issues/1616
//!
//! ```
//! use dlbridge::ManagedTensor;
//! use nalgebra::{DMatrix, DVector};
//! // A row-major 2x3 tensor (numpy's default layout) is a strided nalgebra view...
//! let t = ManagedTensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
//! let g = t.as_dmatrix::<f64>().unwrap();
//! let v = g.view();
//! assert_eq!((v.shape(), v.strides(), v[(1, 2)]), ((2, 3), (3, 1), 6.0));
//! assert_eq!(v.as_ptr(), t.data_ptr().cast_const().cast());
//! // ...and a DMatrix leaves column-major, its Vec handed over.
//! let m = DMatrix::from_fn(3, 2, |i, j| (10 * i + j) as f32);
//! let ptr = m.as_ptr();
//! let e = ManagedTensor::from_dmatrix(m).unwrap();
//! assert_eq!((e.shape(), e.strides()), (&[3i64, 2][..], &[1i64, 3][..]));
//! assert_eq!(e.data_ptr().cast_const().cast(), ptr);
//! let v = ManagedTensor::from_dvector(DVector::from_vec(vec![1u8, 2, 3])).unwrap();
//! assert_eq!(v.as_dvector::<u8>().unwrap().view()[2], 3);
//! ```

use std::marker::PhantomData;
use std::ptr::NonNull;

use nalgebra::{
    DMatrix, DMatrixView, DMatrixViewMut, DVector, DVectorView, DVectorViewMut, Dyn, U1, ViewStorage,
    ViewStorageMut,
};

use crate::borrow::Lease;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::managed::ManagedTensor;

/// First element, extents and (non-negative) strides in elements of a checked view.
#[derive(Debug)]
struct Raw<T> {
    first: NonNull<T>,
    shape: [usize; 2],
    strides: [usize; 2],
}

macro_rules! guard {
    ($(#[$doc:meta])* $name:ident, $borrow:ty) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name<'a, T> {
            raw: Raw<T>,
            _lease: Lease,
            _tensor: PhantomData<$borrow>,
        }
    };
}

guard!(
    /// A read-only nalgebra matrix view of a 2-d tensor ([`ManagedTensor::as_dmatrix`]); holds a
    /// shared lease on the memory (see [`crate::borrow`]) until it drops.
    DMatrixGuard, &'a T
);
guard!(
    /// A mutable nalgebra matrix view of a 2-d tensor ([`ManagedTensor::as_dmatrix_mut`]); holds
    /// an exclusive lease on the memory until it drops.
    DMatrixGuardMut, &'a mut T
);
guard!(
    /// A read-only nalgebra vector view of a 1-d tensor ([`ManagedTensor::as_dvector`]); holds a
    /// shared lease on the memory until it drops.
    DVectorGuard, &'a T
);
guard!(
    /// A mutable nalgebra vector view of a 1-d tensor ([`ManagedTensor::as_dvector_mut`]); holds an
    /// exclusive lease on the memory until it drops.
    DVectorGuardMut, &'a mut T
);

impl<T> Clone for Raw<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Raw<T> {}

impl<T> Raw<T> {
    /// # Safety
    ///
    /// Made by `nalgebra_raw` (checked and leased) over a tensor that outlives the result, and no
    /// mutable view of the same memory lives meanwhile.
    unsafe fn matrix<'b>(self) -> DMatrixView<'b, T, Dyn, Dyn> {
        let Raw { first, shape: [r, c], strides: [rs, cs] } = self;
        // SAFETY: the caller's promise: host memory of dtype T, aligned, every element the
        // strides reach inside the validated span and of valid value.
        let s = unsafe {
            ViewStorage::from_raw_parts(first.as_ptr().cast_const(), (Dyn(r), Dyn(c)), (Dyn(rs), Dyn(cs)))
        };
        DMatrixView::from_data(s)
    }

    /// # Safety
    ///
    /// As for `matrix`, made for writing (writable, non-overlapping, exclusive lease), and no other
    /// view of the same memory lives meanwhile.
    unsafe fn matrix_mut<'b>(self) -> DMatrixViewMut<'b, T, Dyn, Dyn> {
        let Raw { first, shape: [r, c], strides: [rs, cs] } = self;
        // SAFETY: the caller's promise.
        let s =
            unsafe { ViewStorageMut::from_raw_parts(first.as_ptr(), (Dyn(r), Dyn(c)), (Dyn(rs), Dyn(cs))) };
        DMatrixViewMut::from_data(s)
    }

    /// # Safety
    ///
    /// As for `matrix`, over a 1-d tensor.
    unsafe fn vector<'b>(self) -> DVectorView<'b, T, Dyn, Dyn> {
        let Raw { first, shape: [n, _], strides: [s, cs] } = self;
        // SAFETY: the caller's promise (one column: the column stride is never applied).
        let st = unsafe {
            ViewStorage::from_raw_parts(first.as_ptr().cast_const(), (Dyn(n), U1), (Dyn(s), Dyn(cs)))
        };
        DVectorView::from_data(st)
    }

    /// # Safety
    ///
    /// As for `matrix_mut`, over a 1-d tensor.
    unsafe fn vector_mut<'b>(self) -> DVectorViewMut<'b, T, Dyn, Dyn> {
        let Raw { first, shape: [n, _], strides: [s, cs] } = self;
        // SAFETY: the caller's promise.
        let st = unsafe { ViewStorageMut::from_raw_parts(first.as_ptr(), (Dyn(n), U1), (Dyn(s), Dyn(cs))) };
        DVectorViewMut::from_data(st)
    }
}

impl<T> DMatrixGuard<'_, T> {
    /// The matrix view, borrowed from the guard (it cannot outlive the guard's lease).
    pub fn view(&self) -> DMatrixView<'_, T, Dyn, Dyn> {
        // SAFETY: made by `nalgebra_raw`; the tensor outlives the guard; the shared lease is held.
        unsafe { self.raw.matrix() }
    }
}

impl<T> DMatrixGuardMut<'_, T> {
    /// The matrix, read-only, borrowed from the guard.
    pub fn view(&self) -> DMatrixView<'_, T, Dyn, Dyn> {
        // SAFETY: as in `DMatrixGuard::view`; `&self` excludes the guard's mutable borrow.
        unsafe { self.raw.matrix() }
    }

    /// The matrix, mutable, borrowed from the guard.
    pub fn view_mut(&mut self) -> DMatrixViewMut<'_, T, Dyn, Dyn> {
        // SAFETY: made by `nalgebra_raw` for writing; the exclusive lease and `&mut self` make
        // this the only view dlbridge hands out while the borrow lives.
        unsafe { self.raw.matrix_mut() }
    }
}

impl<T> DVectorGuard<'_, T> {
    /// The vector view, borrowed from the guard.
    pub fn view(&self) -> DVectorView<'_, T, Dyn, Dyn> {
        // SAFETY: as in `DMatrixGuard::view`.
        unsafe { self.raw.vector() }
    }
}

impl<T> DVectorGuardMut<'_, T> {
    /// The vector, read-only, borrowed from the guard.
    pub fn view(&self) -> DVectorView<'_, T, Dyn, Dyn> {
        // SAFETY: as in `DMatrixGuard::view`; `&self` excludes the guard's mutable borrow.
        unsafe { self.raw.vector() }
    }

    /// The vector, mutable, borrowed from the guard.
    pub fn view_mut(&mut self) -> DVectorViewMut<'_, T, Dyn, Dyn> {
        // SAFETY: as in `DMatrixGuardMut::view_mut`.
        unsafe { self.raw.vector_mut() }
    }
}

impl ManagedTensor {
    /// Checks (ndim, strides nalgebra can hold) and leases through the one typed-view path.
    fn nalgebra_raw<T: Element, const N: usize>(&self, write: bool) -> Result<(Raw<T>, Lease)> {
        let what = if N == 2 { "a nalgebra matrix" } else { "a nalgebra vector" };
        let (shape, strides) = super::dims::<N>(self, what)?;
        let mut raw_strides = [0usize; 2];
        for ax in 0..N {
            // A stride of an axis of extent 0 or 1 is never applied.
            raw_strides[ax] = match strides[ax] {
                _ if shape[ax] <= 1 => 0,
                s if s >= 0 => s as usize,
                _ => {
                    return Err(Error::Incompatible {
                        expected: format!("non-negative strides ({what}: nalgebra strides are unsigned)"),
                        found: self.describe(),
                    });
                }
            };
        }
        let (first, lease) = self.strided_view::<T>(write)?;
        let raw_shape = if N == 2 { [shape[0], shape[N - 1]] } else { [shape[0], 1] };
        if N == 1 {
            raw_strides[1] = raw_strides[0].saturating_mul(shape[0]);
        }
        Ok((Raw { first, shape: raw_shape, strides: raw_strides }, lease))
    }

    /// A read-only nalgebra view (`DMatrixView` with dynamic strides) of a 2-d host tensor of
    /// dtype `T`, any non-negative strides, without copying. Holds a shared lease.
    pub fn as_dmatrix<T: Element>(&self) -> Result<DMatrixGuard<'_, T>> {
        let (raw, lease) = self.nalgebra_raw::<T, 2>(false)?;
        Ok(DMatrixGuard { raw, _lease: lease, _tensor: PhantomData })
    }

    /// A mutable nalgebra matrix view; refused for read-only tensors and for layouts whose
    /// elements may overlap. Holds an exclusive lease.
    pub fn as_dmatrix_mut<T: Element>(&mut self) -> Result<DMatrixGuardMut<'_, T>> {
        let (raw, lease) = self.nalgebra_raw::<T, 2>(true)?;
        Ok(DMatrixGuardMut { raw, _lease: lease, _tensor: PhantomData })
    }

    /// A read-only nalgebra `DVectorView` (dynamic stride) of a 1-d host tensor of dtype `T`.
    pub fn as_dvector<T: Element>(&self) -> Result<DVectorGuard<'_, T>> {
        let (raw, lease) = self.nalgebra_raw::<T, 1>(false)?;
        Ok(DVectorGuard { raw, _lease: lease, _tensor: PhantomData })
    }

    /// A mutable nalgebra `DVectorViewMut` of a 1-d host tensor; refused for read-only tensors and
    /// zero strides.
    pub fn as_dvector_mut<T: Element>(&mut self) -> Result<DVectorGuardMut<'_, T>> {
        let (raw, lease) = self.nalgebra_raw::<T, 1>(true)?;
        Ok(DVectorGuardMut { raw, _lease: lease, _tensor: PhantomData })
    }

    /// Exports a `DMatrix` without copying: its `Vec` becomes the tensor's buffer, shape
    /// `(nrows, ncols)`, column-major strides `(1, nrows)`.
    pub fn from_dmatrix<T: Element>(m: DMatrix<T>) -> Result<Self> {
        let (r, c) = m.shape();
        let v: Vec<T> = m.data.into();
        ManagedTensor::from_host_strided(v, &[r, c], &[1, r as isize], 0)
    }

    /// Exports a `DVector` without copying: its `Vec` becomes the tensor's buffer.
    pub fn from_dvector<T: Element>(v: DVector<T>) -> Result<Self> {
        let n = v.len();
        let v: Vec<T> = v.data.into();
        ManagedTensor::from_vec(v, &[n])
    }
}
