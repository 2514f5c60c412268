//! The ndarray bridge: views with every kind of stride, and export of owned arrays.
#![cfg(feature = "ndarray")]

use dlbridge::{ManagedTensor, RawManagedTensor};
use ndarray::{Array, Array2, ShapeBuilder, array, s};

fn through_abi(t: ManagedTensor) -> ManagedTensor {
    let RawManagedTensor::Versioned(p) = t.into_raw() else { panic!("exports are versioned") };
    // SAFETY: a pointer just given up by a ManagedTensor.
    unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap()
}

#[test]
fn c_order_array_exports_without_copy_and_views_back() {
    let a: Array2<f64> = Array::from_shape_fn((3, 4), |(i, j)| (i * 10 + j) as f64);
    let ptr = a.as_ptr();
    let t = through_abi(ManagedTensor::from_ndarray(a.clone()).unwrap());
    assert_ne!(t.data_ptr().cast_const().cast::<f64>(), ptr, "a.clone() has its own buffer");
    let b = a.clone();
    let bptr = b.as_ptr();
    let t2 = through_abi(ManagedTensor::from_ndarray(b).unwrap());
    assert_eq!(t2.data_ptr().cast_const().cast::<f64>(), bptr);
    assert_eq!(t.as_array::<f64>().unwrap(), a.view().into_dyn());
    assert_eq!(t2.strides(), &[4, 1]);
}

#[test]
fn fortran_order_array_keeps_its_layout() {
    let a = Array::from_shape_vec((2, 3).f(), vec![1i32, 2, 3, 4, 5, 6]).unwrap();
    let expect = a.clone();
    let t = through_abi(ManagedTensor::from_ndarray(a).unwrap());
    assert_eq!(t.strides(), &[1, 2]);
    assert!(t.is_f_contiguous());
    let v = t.as_array::<i32>().unwrap();
    assert_eq!(v, expect.into_dyn());
    assert_eq!(v.strides(), &[1, 2]);
}

#[test]
fn sliced_array_with_offset_and_negative_strides() {
    let a: Array2<u16> = Array::from_shape_fn((4, 5), |(i, j)| (i * 5 + j) as u16);
    let expect = a.slice(s![1..;2, ..;-2]).to_owned();
    let sliced = a.slice_move(s![1..;2, ..;-2]);
    let t = through_abi(ManagedTensor::from_ndarray(sliced).unwrap());
    assert_eq!(t.shape(), &[2, 3]);
    assert_eq!(t.strides(), &[10, -2]);
    assert_eq!(t.as_array::<u16>().unwrap(), expect.view().into_dyn());
    assert_eq!(t.to_vec::<u16>().unwrap(), expect.iter().copied().collect::<Vec<_>>());
}

#[test]
fn broadcast_strides_view_read_only_and_refuse_mutable_views() {
    let mut t = ManagedTensor::from_host_strided(vec![1.0f32, 2.0, 3.0], &[4, 3], &[0, 1], 0).unwrap();
    let v = t.as_array::<f32>().unwrap();
    assert_eq!(v, array![[1.0f32, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]].into_dyn());
    assert_eq!(v.strides(), &[0, 1]);
    let err = t.as_array_mut::<f32>().unwrap_err().to_string();
    assert!(err.contains("writable"), "{err}");
}

#[test]
fn mutable_view_writes_are_seen_through_the_tensor() {
    let mut t = ManagedTensor::from_host_strided(vec![0i64; 6], &[3, 2], &[-2, 1], 4).unwrap();
    {
        let mut v = t.as_array_mut::<i64>().unwrap();
        v[[0, 1]] = 7;
        v[[2, 0]] = 9;
    }
    assert_eq!(t.get::<i64>(&[0, 1]).unwrap(), 7);
    assert_eq!(t.get::<i64>(&[2, 0]).unwrap(), 9);
    assert_eq!(t.to_vec::<i64>().unwrap(), [0, 7, 0, 0, 9, 0]);
}

#[test]
fn empty_and_zero_dim_views() {
    let t = ManagedTensor::from_vec(Vec::<f32>::new(), &[0, 3]).unwrap();
    assert_eq!(t.as_array::<f32>().unwrap().shape(), &[0, 3]);
    let s = ManagedTensor::from_vec(vec![5u8], &[]).unwrap();
    assert_eq!(s.as_array::<u8>().unwrap().view().into_dimensionality::<ndarray::Ix0>().unwrap()[()], 5);
}

#[test]
fn wrong_dtype_device_and_bool_bytes_are_refused() {
    let t = ManagedTensor::from_vec(vec![1u8, 2], &[2]).unwrap();
    let err = t.as_array::<f32>().unwrap_err().to_string();
    assert_eq!(err, "expected float32 cpu tensor, got uint8 (2,) on cpu");
    let b = ManagedTensor::from_host_bytes(vec![0u8, 3], dlbridge::DataType::BOOL, &[2], None, 0).unwrap();
    assert!(b.as_array::<bool>().is_err());
}

/// An empty tensor whose C strides hold a zero on a longer axis ((2, 0) has strides (0, 1)):
/// mutable and shared views work (ndarray's own aliasing check used to panic on them).
#[test]
fn empty_views_with_zero_strides_on_longer_axes() {
    for shape in [[2usize, 0], [0, 3]] {
        let mut t = ManagedTensor::from_vec(Vec::<f64>::new(), &shape).unwrap();
        assert_eq!(t.as_array::<f64>().unwrap().shape(), shape);
        let mut v = t.as_array_mut::<f64>().unwrap();
        v.fill(1.0);
        assert_eq!(v.shape(), shape);
    }
}
