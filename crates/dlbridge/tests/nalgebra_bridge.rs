//! The nalgebra bridge: strided matrix and vector views, borrow rules, and export of
//! `DMatrix`/`DVector`.
#![cfg(feature = "nalgebra")]

use std::sync::Arc;

use dlbridge::{Error, ManagedTensor, RawManagedTensor};
use nalgebra::{DMatrix, DVector};

fn through_abi(t: ManagedTensor) -> ManagedTensor {
    let RawManagedTensor::Versioned(p) = t.into_raw() else { panic!("exports are versioned") };
    // SAFETY: a pointer just given up by a ManagedTensor.
    unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap()
}

#[test]
fn row_major_and_column_major_tensors_are_strided_views_of_the_same_memory() {
    let t = through_abi(ManagedTensor::from_vec((0..6).collect::<Vec<i64>>(), &[2, 3]).unwrap());
    let g = t.as_dmatrix::<i64>().unwrap();
    let v = g.view();
    assert_eq!(v.as_ptr(), t.data_ptr().cast_const().cast::<i64>());
    assert_eq!(v.strides(), (3, 1));
    assert_eq!((v[(0, 2)], v[(1, 0)], v[(1, 2)]), (2, 3, 5));
    let f = ManagedTensor::from_host_strided((0..6).collect::<Vec<i64>>(), &[3, 2], &[1, 3], 0).unwrap();
    assert_eq!(f.as_dmatrix::<i64>().unwrap().view(), DMatrix::from_column_slice(3, 2, &[0, 1, 2, 3, 4, 5]));
    // Every other element of a vector.
    let s = ManagedTensor::from_host_strided(vec![1.0f32, 9.0, 2.0, 9.0, 3.0], &[3], &[2], 0).unwrap();
    let g = s.as_dvector::<f32>().unwrap();
    assert_eq!((g.view().len(), g.view()[1], g.view()[2]), (3, 2.0, 3.0));
    assert_eq!(g.view().as_ptr(), s.data_ptr().cast_const().cast::<f32>());
}

/// nalgebra's matrix iterator (used by `==`, `sum`, `iter`) computes, with `ptr.add`, the
/// address one row stride past the last element of each column: out of bounds of the allocation
/// for a row-major view or a strided vector. Miri reports it as undefined behaviour in nalgebra
/// itself, for views nalgebra makes from a slice (`from_slice_with_strides_generic`) as much as
/// for ours; natively it is an address computation that is never dereferenced.
#[test]
#[cfg_attr(
    miri,
    ignore = "nalgebra's iterator offsets out of bounds on row-major and strided views (nalgebra's own UB)"
)]
fn strided_views_iterate() {
    let t = ManagedTensor::from_vec((0..6).collect::<Vec<i64>>(), &[2, 3]).unwrap();
    assert_eq!(t.as_dmatrix::<i64>().unwrap().view(), DMatrix::from_row_slice(2, 3, &[0, 1, 2, 3, 4, 5]));
    let s = ManagedTensor::from_host_strided(vec![1.0f32, 9.0, 2.0, 9.0, 3.0], &[3], &[2], 0).unwrap();
    assert_eq!(s.as_dvector::<f32>().unwrap().view(), DVector::from_vec(vec![1.0f32, 2.0, 3.0]));
}

#[test]
fn mutable_views_write_through() {
    let mut t = ManagedTensor::from_vec(vec![0.0f64; 6], &[2, 3]).unwrap();
    t.as_dmatrix_mut::<f64>().unwrap().view_mut()[(1, 2)] = 4.5;
    assert_eq!(t.get::<f64>(&[1, 2]).unwrap(), 4.5);
    let mut v = ManagedTensor::from_vec(vec![0u32; 3], &[3]).unwrap();
    v.as_dvector_mut::<u32>().unwrap().view_mut().fill(7);
    assert_eq!(v.as_slice::<u32>().unwrap(), &[7, 7, 7]);
}

#[test]
fn refusals_name_what_is_wrong() {
    let r = ManagedTensor::from_host_strided((0..6).collect::<Vec<i32>>(), &[2, 3], &[3, -1], 2).unwrap();
    let e = r.as_dmatrix::<i32>().unwrap_err().to_string();
    assert!(e.contains("non-negative strides") && e.contains("strides (3, -1)"), "{e}");
    let v = ManagedTensor::from_vec(vec![1i32; 4], &[2, 2]).unwrap();
    let e = v.as_dvector::<i32>().unwrap_err().to_string();
    assert!(e.starts_with("expected a 1-d tensor (a nalgebra vector), got int32 shape (2, 2)"), "{e}");
    let mut b = ManagedTensor::from_host_strided(vec![1i32], &[4], &[0], 0).unwrap();
    assert_eq!(b.as_dvector::<i32>().unwrap().view().sum(), 4);
    assert!(b.as_dvector_mut::<i32>().unwrap_err().to_string().contains("writable"));
    let shared: Arc<[f32]> = Arc::from(vec![0.0; 4]);
    let mut ro = ManagedTensor::from_host(shared, &[2, 2]).unwrap();
    assert!(
        ro.as_dmatrix_mut::<f32>()
            .unwrap_err()
            .to_string()
            .contains("expected writable float32 cpu tensor, got read-only float32")
    );
}

#[test]
fn a_mutable_view_excludes_views_from_other_handles() {
    let t = Arc::new(ManagedTensor::from_vec(vec![0u8; 4], &[4]).unwrap());
    // SAFETY: fresh exports of a live tensor.
    let mut a = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    // SAFETY: as above.
    let b = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    let g = b.as_dvector::<u8>().unwrap();
    assert!(matches!(a.as_dvector_mut::<u8>(), Err(Error::AlreadyBorrowed { .. })));
    drop(g);
    a.as_dvector_mut::<u8>().unwrap().view_mut()[0] = 1;
}

#[test]
fn dmatrix_and_dvector_export_without_copy() {
    let m = DMatrix::from_fn(4, 3, |i, j| (i * 3 + j) as u16);
    let ptr = m.as_ptr();
    let mut t = through_abi(ManagedTensor::from_dmatrix(m.clone()).unwrap());
    assert_ne!(t.data_ptr().cast_const().cast::<u16>(), ptr, "m.clone() has its own buffer");
    let mine = m;
    let ptr = mine.as_ptr();
    let mut t2 = through_abi(ManagedTensor::from_dmatrix(mine).unwrap());
    assert_eq!(t2.data_ptr().cast_const().cast::<u16>(), ptr);
    assert_eq!((t2.shape(), t2.strides()), (&[4i64, 3][..], &[1i64, 4][..]));
    assert_eq!(t2.get::<u16>(&[3, 1]).unwrap(), 10);
    t2.as_dmatrix_mut::<u16>().unwrap().view_mut()[(0, 0)] = 99;
    assert_eq!(t2.as_dmatrix::<u16>().unwrap().view().as_ptr(), ptr);
    assert_eq!(t2.get::<u16>(&[0, 0]).unwrap(), 99);
    t.as_dmatrix_mut::<u16>().unwrap();
    let v = DVector::from_vec(vec![1.5f64, 2.5]);
    let ptr = v.as_ptr();
    let e = through_abi(ManagedTensor::from_dvector(v).unwrap());
    assert_eq!(e.as_slice::<f64>().unwrap().as_ptr(), ptr);
    let empty = ManagedTensor::from_dmatrix(DMatrix::<f32>::zeros(0, 3)).unwrap();
    assert_eq!(empty.as_dmatrix::<f32>().unwrap().view().shape(), (0, 3));
}

/// nalgebra's product takes its loop count from a strided column's memory span
/// (dimforge/nalgebra#1616): a row-major view as the left operand makes it write past the result
/// (not tested here: it is undefined behaviour). The documented workarounds, checked under Miri: an
/// owned column-major copy (by indexing, or from the tensor's slice), a column-major view on the
/// left, a row-major view on the right.
#[test]
fn products_over_views_with_the_documented_workarounds() {
    let t = ManagedTensor::from_vec((0..6).map(f64::from).collect(), &[2, 3]).unwrap();
    let b = DMatrix::from_column_slice(3, 2, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let want = DMatrix::from_row_slice(2, 2, &[8.0, 17.0, 26.0, 62.0]);
    let g = t.as_dmatrix::<f64>().unwrap();
    let v = g.view();
    let by_index = DMatrix::from_fn(v.nrows(), v.ncols(), |i, j| v[(i, j)]);
    assert_eq!(&by_index * &b, want);
    let from_slice = DMatrix::from_row_slice(2, 3, &t.as_slice::<f64>().unwrap());
    assert_eq!(&from_slice * &b, want);
    // The same matrix stored column-major (a Fortran-ordered tensor): row stride 1, safe on the left.
    let f =
        ManagedTensor::from_host_strided(vec![0.0f64, 3.0, 1.0, 4.0, 2.0, 5.0], &[2, 3], &[1, 2], 0).unwrap();
    let fg = f.as_dmatrix::<f64>().unwrap();
    assert_eq!(fg.view().strides(), (1, 2));
    assert_eq!(fg.view() * &b, want);
    // A row-major view on the right is read by index, element by element.
    let bt = ManagedTensor::from_vec(vec![1.0f64, 4.0, 2.0, 5.0, 3.0, 6.0], &[3, 2]).unwrap();
    let bg = bt.as_dmatrix::<f64>().unwrap();
    assert_eq!(&by_index * bg.view(), want);
}
