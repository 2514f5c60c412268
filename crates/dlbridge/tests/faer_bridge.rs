//! The faer bridge: views with every kind of stride, borrow rules, and export of `Mat<T>`.
#![cfg(feature = "faer")]

use std::sync::Arc;

use dlbridge::{Error, ManagedTensor, RawManagedTensor};

fn through_abi(t: ManagedTensor) -> ManagedTensor {
    let RawManagedTensor::Versioned(p) = t.into_raw() else { panic!("exports are versioned") };
    // SAFETY: a pointer just given up by a ManagedTensor.
    unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap()
}

#[test]
fn row_major_tensor_is_a_matref_over_the_same_memory() {
    let t = through_abi(ManagedTensor::from_vec((0..6).map(f64::from).collect(), &[2, 3]).unwrap());
    let g = t.as_faer::<f64>().unwrap();
    let m = g.mat();
    assert_eq!(m.as_ptr(), t.data_ptr().cast_const().cast::<f64>());
    assert_eq!((m.nrows(), m.ncols(), m.row_stride(), m.col_stride()), (2, 3, 3, 1));
    for i in 0..2 {
        for j in 0..3 {
            assert_eq!(m[(i, j)], (3 * i + j) as f64);
        }
    }
}

#[test]
fn negative_and_column_major_strides_map_directly() {
    // Rows reversed: first element at index 3 of the buffer, row stride -3.
    let t = ManagedTensor::from_host_strided((0..6).collect::<Vec<i32>>(), &[2, 3], &[-3, 1], 3).unwrap();
    let g = t.as_faer::<i32>().unwrap();
    assert_eq!((g.mat().row_stride(), g.mat()[(0, 0)], g.mat()[(1, 2)]), (-3, 3, 2));
    let f = ManagedTensor::from_host_strided((0..6).collect::<Vec<i32>>(), &[3, 2], &[1, 3], 0).unwrap();
    let g = f.as_faer::<i32>().unwrap();
    assert_eq!((g.mat().col_stride(), g.mat()[(2, 1)]), (3, 5));
}

#[test]
fn mutable_view_writes_are_seen_through_the_tensor() {
    let mut t = ManagedTensor::from_host_strided(vec![0f32; 6], &[2, 3], &[1, -2], 4).unwrap();
    {
        let mut g = t.as_faer_mut::<f32>().unwrap();
        let mut m = g.mat_mut();
        m[(1, 0)] = 7.0;
        m[(0, 2)] = 9.0;
    }
    assert_eq!(t.get::<f32>(&[1, 0]).unwrap(), 7.0);
    assert_eq!(t.get::<f32>(&[0, 2]).unwrap(), 9.0);
}

#[test]
fn refusals_name_what_is_wrong() {
    let shared: Arc<[f64]> = Arc::from(vec![1.0; 4]);
    let mut ro = ManagedTensor::from_host(shared, &[2, 2]).unwrap();
    assert!(ro.as_faer::<f64>().is_ok());
    let e = ro.as_faer_mut::<f64>().unwrap_err().to_string();
    assert!(e.starts_with("expected writable float64 cpu tensor, got read-only float64"), "{e}");

    // Broadcast (zero) strides: readable, never mutable.
    let mut b = ManagedTensor::from_host_strided(vec![1.0f64, 2.0], &[3, 2], &[0, 1], 0).unwrap();
    assert_eq!(b.as_faer::<f64>().unwrap().mat()[(2, 1)], 2.0);
    let e = b.as_faer_mut::<f64>().unwrap_err().to_string();
    assert!(e.contains("writable"), "{e}");

    let v = ManagedTensor::from_vec(vec![1.0f64; 4], &[4]).unwrap();
    let e = v.as_faer::<f64>().unwrap_err().to_string();
    assert_eq!(e, "expected a 2-d tensor (a faer matrix), got float64 shape (4,) strides (1,) on cpu");
    let m = ManagedTensor::from_vec(vec![1i32; 4], &[2, 2]).unwrap();
    let e = m.as_faer::<f64>().unwrap_err().to_string();
    assert!(e.starts_with("expected float64 cpu tensor, got int32"), "{e}");
}

#[test]
fn a_mutable_view_excludes_views_from_other_handles() {
    let t = Arc::new(ManagedTensor::from_vec(vec![0u16; 4], &[2, 2]).unwrap());
    // SAFETY: fresh exports of a live tensor.
    let mut a = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    // SAFETY: as above.
    let b = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    let mut w = a.as_faer_mut::<u16>().unwrap();
    assert!(matches!(b.as_faer::<u16>(), Err(Error::AlreadyBorrowed { .. })));
    assert!(matches!(b.as_slice::<u16>(), Err(Error::AlreadyBorrowed { .. })));
    w.mat_mut()[(1, 1)] = 5;
    drop(w);
    assert_eq!(b.as_faer::<u16>().unwrap().mat()[(1, 1)], 5);
}

#[test]
fn mat_exports_without_copy_keeping_its_column_stride() {
    let a = faer::Mat::<f64>::from_fn(5, 3, |i, j| (10 * i + j) as f64);
    let (ptr, cs) = (a.as_ptr(), a.col_stride());
    let mut t = through_abi(ManagedTensor::from_faer(a).unwrap());
    assert_eq!(t.data_ptr().cast_const().cast::<f64>(), ptr);
    assert_eq!(t.shape(), &[5, 3]);
    assert_eq!(t.strides(), &[1, cs as i64]);
    assert!(!t.is_read_only());
    assert_eq!(t.get::<f64>(&[4, 2]).unwrap(), 42.0);
    // Writable: a write through a view of the export lands in the matrix's memory.
    t.as_faer_mut::<f64>().unwrap().mat_mut()[(0, 1)] = -1.0;
    let g = t.as_faer::<f64>().unwrap();
    assert_eq!((g.mat().as_ptr(), g.mat()[(0, 1)]), (ptr, -1.0));
}

#[test]
fn empty_matrices_both_ways() {
    let t = ManagedTensor::from_faer(faer::Mat::<f32>::zeros(0, 4)).unwrap();
    assert_eq!(t.shape(), &[0, 4]);
    let g = t.as_faer::<f32>().unwrap();
    assert_eq!((g.mat().nrows(), g.mat().ncols()), (0, 4));
    let e = ManagedTensor::from_vec(Vec::<f32>::new(), &[3, 0]).unwrap();
    assert_eq!(e.as_faer::<f32>().unwrap().mat().nrows(), 3);
}
