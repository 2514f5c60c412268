//! The arrow bridge: PrimitiveArray and FixedSizeListArray both ways without copying, owners
//! released exactly once, leases held while arrow reads, nulls refused.
#![cfg(feature = "arrow")]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arrow_array::types::{Float64Type, Int32Type, UInt8Type};
use arrow_array::{Array, FixedSizeListArray, Float64Array, Int32Array};
use arrow_schema::Field;
use dlbridge::{DataType, Device, Error, Flags, ManagedTensor};

/// A buffer whose drop is counted, exported through `from_raw_parts` as a foreign producer would.
struct Counted(Vec<f64>, Arc<AtomicUsize>);
impl Drop for Counted {
    fn drop(&mut self) {
        self.1.fetch_add(1, Ordering::SeqCst);
    }
}

fn counted(values: Vec<f64>) -> (ManagedTensor, Arc<AtomicUsize>) {
    let drops = Arc::new(AtomicUsize::new(0));
    let mut owner = Counted(values, drops.clone());
    let (ptr, n) = (owner.0.as_mut_ptr(), owner.0.len());
    // SAFETY: `n` f64 in a Vec the owner keeps alive and in place.
    let t = unsafe {
        ManagedTensor::from_raw_parts(
            ptr.cast(),
            Device::CPU,
            DataType::FLOAT64,
            &[n as i64],
            None,
            0,
            Flags::NONE,
            owner,
        )
    }
    .unwrap();
    (t, drops)
}

#[test]
fn primitive_array_round_trip_is_zero_copy_and_frees_once() {
    let (t, drops) = counted(vec![1.0, 2.0, 3.0, 4.0]);
    let ptr = t.data_ptr().cast_const();
    let a = t.into_arrow::<Float64Type>().unwrap();
    assert_eq!(a.values().as_ptr().cast(), ptr);
    assert_eq!(a.values().as_ref(), &[1.0, 2.0, 3.0, 4.0]);
    let back = ManagedTensor::from_arrow(&a).unwrap();
    assert_eq!(back.data_ptr().cast_const(), ptr);
    assert!(back.is_read_only());
    let sliced = a.slice(1, 2);
    let s = ManagedTensor::from_arrow(&sliced).unwrap();
    assert_eq!(s.data_ptr().cast_const(), ptr.wrapping_byte_add(8));
    assert_eq!(s.as_slice::<f64>().unwrap(), &[2.0, 3.0]);
    drop((a, sliced, back));
    assert_eq!(drops.load(Ordering::SeqCst), 0, "the tensor `s` still holds the arrow buffer");
    drop(s);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
}

#[test]
fn arrow_holds_a_shared_lease_while_it_reads() {
    let t = Arc::new(ManagedTensor::from_vec(vec![1i32, 2, 3], &[3]).unwrap());
    // SAFETY: fresh exports of a live tensor.
    let a = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    // SAFETY: as above.
    let mut b = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    let arr = a.into_arrow::<Int32Type>().unwrap();
    assert!(matches!(b.as_slice_mut::<i32>(), Err(Error::AlreadyBorrowed { .. })));
    assert_eq!(b.as_slice::<i32>().unwrap(), &[1, 2, 3]);
    drop(arr);
    b.as_slice_mut::<i32>().unwrap()[0] = 5;
}

#[test]
fn refusals_name_what_is_wrong() {
    let nulls = Int32Array::from(vec![Some(1), None, Some(3)]);
    let e = ManagedTensor::from_arrow(&nulls).unwrap_err().to_string();
    assert_eq!(
        e,
        "expected an arrow array without nulls (PrimitiveArray; a tensor has no validity bitmap), got null_count 1 of 3 values"
    );
    let two_d = ManagedTensor::from_vec(vec![1i32; 4], &[2, 2]).unwrap();
    let e = two_d.into_arrow::<Int32Type>().unwrap_err().to_string();
    assert!(e.starts_with("expected a 1-d tensor (an arrow array)"), "{e}");
    let strided = ManagedTensor::from_host_strided(vec![1i32; 4], &[2], &[2], 0).unwrap();
    let e = strided.into_arrow::<Int32Type>().unwrap_err().to_string();
    assert!(e.contains("in C order") && e.contains("strides (2,)"), "{e}");
    let wrong = ManagedTensor::from_vec(vec![1i32; 4], &[4]).unwrap();
    let e = wrong.into_arrow::<Float64Type>().unwrap_err().to_string();
    assert!(e.starts_with("expected float64 cpu tensor, got int32"), "{e}");
    let one_d = ManagedTensor::from_vec(vec![1u8; 4], &[4]).unwrap();
    assert!(one_d.into_arrow_tensor::<UInt8Type>().unwrap_err().to_string().contains("2 or more dimensions"));
}

#[test]
fn fixed_shape_tensor_round_trip_is_zero_copy() {
    let t = ManagedTensor::from_vec((0..24).map(f64::from).collect(), &[2, 3, 4]).unwrap();
    let ptr = t.data_ptr().cast_const();
    let (field, list) = t.into_arrow_tensor::<Float64Type>().unwrap();
    assert_eq!(field.metadata()["ARROW:extension:name"], "arrow.fixed_shape_tensor");
    assert_eq!((list.len(), list.value_length()), (2, 12));
    let values = list.values().as_any().downcast_ref::<Float64Array>().unwrap();
    assert_eq!(values.values().as_ptr().cast(), ptr);
    let back = ManagedTensor::from_arrow_tensor::<Float64Type>(&list, Some(&field)).unwrap();
    assert_eq!((back.data_ptr().cast_const(), back.shape()), (ptr, &[2i64, 3, 4][..]));
    assert_eq!(back.get::<f64>(&[1, 2, 3]).unwrap(), 23.0);
    // Without the extension field: (n, size).
    let flat = ManagedTensor::from_arrow_tensor::<Float64Type>(&list, None).unwrap();
    assert_eq!(flat.shape(), &[2, 12]);
    // One list of the slice, its values offset.
    let one = ManagedTensor::from_arrow_tensor::<Float64Type>(&list.slice(1, 1), Some(&field)).unwrap();
    assert_eq!((one.data_ptr().cast_const(), one.shape()), (ptr.wrapping_byte_add(96), &[1i64, 3, 4][..]));
    let e = ManagedTensor::from_arrow_tensor::<Int32Type>(&list, None).unwrap_err().to_string();
    assert_eq!(e, "expected FixedSizeList values of type Int32, got values of type Float64");
}

#[test]
fn permutation_becomes_strides() {
    // Cells of logical shape (2, 3) stored as their transpose (physical shape (3, 2)).
    let values = Arc::new(Int32Array::from((0..6).collect::<Vec<i32>>()));
    let item = Arc::new(Field::new("item", arrow_schema::DataType::Int32, false));
    let list = FixedSizeListArray::try_new(item, 6, values, None).unwrap();
    let meta = HashMap::from([
        ("ARROW:extension:name".to_string(), "arrow.fixed_shape_tensor".to_string()),
        ("ARROW:extension:metadata".to_string(), r#"{"shape":[2,3],"permutation":[1,0]}"#.to_string()),
    ]);
    let field = Field::new("t", list.data_type().clone(), false).with_metadata(meta.clone());
    let t = ManagedTensor::from_arrow_tensor::<Int32Type>(&list, Some(&field)).unwrap();
    assert_eq!((t.shape(), t.strides()), (&[1i64, 2, 3][..], &[6i64, 1, 2][..]));
    assert_eq!(t.get::<i32>(&[0, 1, 2]).unwrap(), 5);
    assert_eq!(t.get::<i32>(&[0, 0, 1]).unwrap(), 2);
    let mut bad = meta;
    bad.insert("ARROW:extension:metadata".into(), r#"{"shape":[2,3],"permutation":[0,0]}"#.into());
    let field = Field::new("t", list.data_type().clone(), false).with_metadata(bad);
    let e = ManagedTensor::from_arrow_tensor::<Int32Type>(&list, Some(&field)).unwrap_err().to_string();
    assert!(e.contains("\"permutation\" of the shape's axes"), "{e}");
}

#[test]
fn lists_with_nulls_are_refused() {
    let values = Arc::new(Int32Array::from(vec![1, 2, 3, 4]));
    let item = Arc::new(Field::new("item", arrow_schema::DataType::Int32, false));
    let nulls = arrow_buffer::NullBuffer::from(vec![true, false]);
    let list = FixedSizeListArray::try_new(item, 2, values, Some(nulls)).unwrap();
    let e = ManagedTensor::from_arrow_tensor::<Int32Type>(&list, None).unwrap_err().to_string();
    assert!(e.contains("without nulls (FixedSizeListArray") && e.contains("null_count 1 of 2"), "{e}");
}

/// Issue 20: lists of 0 values made `FixedSizeListArray::try_new` count 0 lists, so `(2, 0, 3)`
/// came back `(0, 0, 3)`. Every empty shape keeps every extent, both ways.
#[test]
fn empty_tensors_keep_their_shape_through_fixed_size_lists() {
    for shape in [[2, 0, 3], [0, 2, 3], [2, 3, 0], [0, 0, 0], [5, 0, 0], [1, 0, 1]] {
        let t = ManagedTensor::from_vec(Vec::<f64>::new(), &shape).unwrap();
        let (field, list) = t.into_arrow_tensor::<Float64Type>().unwrap();
        assert_eq!((list.len(), list.value_length() as usize), (shape[0], shape[1] * shape[2]), "{shape:?}");
        let cell = format!("{{\"shape\":[{},{}]}}", shape[1], shape[2]);
        assert_eq!(field.metadata()["ARROW:extension:metadata"], cell);
        let back = ManagedTensor::from_arrow_tensor::<Float64Type>(&list, Some(&field)).unwrap();
        let want: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        assert_eq!((back.shape(), back.numel()), (&want[..], 0), "{shape:?}");
        let flat = ManagedTensor::from_arrow_tensor::<Float64Type>(&list, None).unwrap();
        assert_eq!(flat.shape(), &[shape[0] as i64, (shape[1] * shape[2]) as i64]);
    }
    // 2-d: n lists of 0 values.
    let t = ManagedTensor::from_vec(Vec::<i32>::new(), &[4, 0]).unwrap();
    let (field, list) = t.into_arrow_tensor::<Int32Type>().unwrap();
    assert_eq!((list.len(), list.value_length()), (4, 0));
    let back = ManagedTensor::from_arrow_tensor::<Int32Type>(&list, Some(&field)).unwrap();
    assert_eq!(back.shape(), &[4, 0]);
    // A zero cell extent makes every list empty even when the other extents' product overflows.
    let huge = ManagedTensor::from_host_bytes(
        Vec::<u8>::new(),
        dlbridge::DataType::UINT8,
        &[3, 1 << 40, 1 << 40, 0],
        None,
        0,
    )
    .unwrap();
    let (_, list) = huge.into_arrow_tensor::<UInt8Type>().unwrap();
    assert_eq!((list.len(), list.value_length()), (3, 0));
}
