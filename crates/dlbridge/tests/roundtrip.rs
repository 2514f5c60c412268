//! Export → raw ABI → import round trips for every `Element` type and the layouts that matter:
//! 0-d, size-0, Fortran order, negative and zero strides, legacy and versioned structs. Zero-copy
//! is shown by pointer equality and by a write on one side read on the other.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use dlbridge::{AlignedBuffer, DataType, Device, Element, Flags, ManagedTensor, RawManagedTensor};
use half::{bf16, f16};
use num_complex::Complex;

/// Hands a tensor to "a consumer" through the raw versioned pointer and takes it back in.
fn through_abi(t: ManagedTensor) -> ManagedTensor {
    match t.into_raw() {
        // SAFETY: a pointer just given up by a ManagedTensor; ownership passes back.
        RawManagedTensor::Versioned(p) => unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap(),
        // SAFETY: as above.
        RawManagedTensor::Legacy(p) => unsafe { ManagedTensor::from_raw_legacy(p) }.unwrap(),
    }
}

fn check_type<T: Element + PartialEq + std::fmt::Debug>(values: [T; 6]) {
    let v = values.to_vec();
    let ptr = v.as_ptr();
    let t = through_abi(ManagedTensor::from_vec(v, &[2, 3]).unwrap());
    assert_eq!(t.dtype(), T::DTYPE);
    assert_eq!(t.data_ptr().cast_const().cast::<T>(), ptr, "no copy for {}", T::DTYPE);
    assert_eq!(t.as_slice::<T>().unwrap(), &values);
    assert_eq!(t.version().unwrap(), dlbridge::Version::CURRENT);
    assert_eq!(t.nbytes(), 6 * size_of::<T>() as u128);
    // 0-d
    let t0 = through_abi(ManagedTensor::from_vec(vec![values[4]], &[]).unwrap());
    assert_eq!((t0.ndim(), t0.numel()), (0, 1));
    assert_eq!(t0.get::<T>(&[]).unwrap(), values[4]);
    // size 0
    let te = through_abi(ManagedTensor::from_vec(Vec::<T>::new(), &[3, 0, 2]).unwrap());
    assert_eq!((te.numel(), te.strides()), (0, &[2i64, 2, 1][..]));
    assert!(te.as_slice::<T>().unwrap().is_empty());
    assert!(te.is_c_contiguous() && te.is_f_contiguous());
    // Fortran order: the 3x2 transpose of the row-major 2x3 buffer.
    let tf = through_abi(ManagedTensor::from_host_strided(values.to_vec(), &[3, 2], &[1, 3], 0).unwrap());
    assert!(tf.is_f_contiguous() && !tf.is_c_contiguous());
    let expect_t = [values[0], values[3], values[1], values[4], values[2], values[5]];
    assert_eq!(tf.to_vec::<T>().unwrap(), expect_t);
    assert!(tf.as_slice::<T>().is_err(), "a slice is refused for Fortran order");
    // Negative strides: rows reversed and columns reversed.
    let tn = through_abi(ManagedTensor::from_host_strided(values.to_vec(), &[2, 3], &[-3, -1], 5).unwrap());
    let mut rev = values;
    rev.reverse();
    assert_eq!(tn.to_vec::<T>().unwrap(), rev);
    assert_eq!(tn.get::<T>(&[1, 2]).unwrap(), values[0]);
    // A compact copy of the negative-stride view is aligned and equal.
    let tc = tn.to_contiguous().unwrap();
    assert_eq!(tc.as_slice::<T>().unwrap(), &rev);
    assert_eq!(tc.data_ptr() as usize % 256, 0);
}

#[test]
fn every_element_type_round_trips() {
    check_type::<i8>([1, -2, 3, -4, 5, i8::MIN]);
    check_type::<i16>([1, -2, 3, -4, 5, i16::MAX]);
    check_type::<i32>([1, -2, 3, -4, 5, i32::MIN]);
    check_type::<i64>([1, -2, 3, -4, 5, i64::MAX]);
    check_type::<u8>([1, 2, 3, 4, 5, u8::MAX]);
    check_type::<u16>([1, 2, 3, 4, 5, u16::MAX]);
    check_type::<u32>([1, 2, 3, 4, 5, u32::MAX]);
    check_type::<u64>([1, 2, 3, 4, 5, u64::MAX]);
    check_type::<f32>([1.5, -2.0, 3.25, f32::MAX, 0.0, -0.0]);
    check_type::<f64>([1.5, -2.0, 3.25, f64::MIN, 1e-300, 7.0]);
    check_type::<f16>([1.0, 2.0, -3.0, 4.5, 0.25, 65504.0].map(f16::from_f32));
    check_type::<bf16>([1.0, 2.0, -3.0, 4.5, 0.25, 1e30].map(bf16::from_f32));
    check_type::<Complex<f32>>(
        [(1., 2.), (3., 4.), (5., 6.), (7., 8.), (9., 10.), (-1., -2.)].map(|(r, i)| Complex::new(r, i)),
    );
    check_type::<Complex<f64>>(
        [(1., 2.), (3., 4.), (5., 6.), (7., 8.), (9., 10.), (-1., -2.)].map(|(r, i)| Complex::new(r, i)),
    );
    check_type::<bool>([true, false, true, true, false, false]);
}

#[test]
fn dtypes_without_a_rust_type_round_trip_as_bytes() {
    for dtype in DataType::ALL {
        let Some(item) = dtype.itemsize() else {
            // Packed sub-byte: 6 elements of 4 or 6 bits.
            let bytes = (6 * dtype.storage_bits(false)).div_ceil(8) as usize;
            let t = through_abi(
                ManagedTensor::from_host_bytes(AlignedBuffer::<u8>::zeroed(bytes), dtype, &[6], None, 0)
                    .unwrap(),
            );
            assert_eq!((t.dtype(), t.nbytes()), (dtype, bytes as u128));
            continue;
        };
        let t = through_abi(
            ManagedTensor::from_host_bytes(vec![7u8; 6 * item], dtype, &[2, 3], None, 0).unwrap(),
        );
        assert_eq!(
            (t.dtype(), t.nbytes(), t.to_contiguous().unwrap().dtype()),
            (dtype, 6 * item as u128, dtype)
        );
    }
}

#[test]
fn bool_tensors_with_bytes_other_than_zero_or_one_are_refused() {
    let t = ManagedTensor::from_host_bytes(vec![0u8, 1, 2], DataType::BOOL, &[3], None, 0).unwrap();
    let err = t.as_slice::<bool>().unwrap_err().to_string();
    assert!(err.contains("bool values only"), "{err}");
    assert!(t.get::<bool>(&[1]).unwrap());
    assert!(t.get::<bool>(&[2]).is_err());
}

#[test]
fn a_write_on_one_side_is_seen_on_the_other() {
    let shared = Arc::new(ManagedTensor::from_vec(vec![0u32; 4], &[4]).unwrap());
    let mut consumer = through_abi({
        // SAFETY: a fresh struct owned here, sharing `shared`'s data.
        unsafe { ManagedTensor::from_raw_versioned(shared.export_versioned().as_ptr()) }.unwrap()
    });
    assert_eq!(consumer.data_ptr(), shared.data_ptr());
    consumer.as_slice_mut::<u32>().unwrap()[2] = 42;
    assert_eq!(shared.as_slice::<u32>().unwrap(), &[0, 0, 42, 0]);
    // The data outlives the original handle while the consumer holds it.
    let p = shared.data_ptr();
    drop(shared);
    assert_eq!(consumer.data_ptr(), p);
    assert_eq!(consumer.as_slice::<u32>().unwrap()[2], 42);
}

#[test]
fn legacy_export_shares_data_and_keeps_it_alive() {
    let shared =
        Arc::new(ManagedTensor::from_host_strided(vec![1i16, 2, 3, 4, 5, 6], &[3, 2], &[1, 3], 0).unwrap());
    let p = shared.export_legacy().unwrap().as_ptr();
    drop(shared.clone());
    // SAFETY: a fresh legacy struct owned here.
    let t = unsafe { ManagedTensor::from_raw_legacy(p) }.unwrap();
    assert_eq!((t.strides(), t.version()), (&[1i64, 3][..], None));
    assert_eq!(t.data_ptr(), shared.data_ptr());
    drop(shared);
    assert_eq!(t.to_vec::<i16>().unwrap(), [1, 4, 2, 5, 3, 6]);
}

#[test]
fn read_only_sources_export_read_only() {
    let arc: Arc<[f32]> = vec![1.0, 2.0].into();
    let mut t = ManagedTensor::from_host(arc, &[2]).unwrap();
    assert!(t.is_read_only());
    assert!(t.as_slice_mut::<f32>().is_err());
    // Broadcast (zero) strides overlap, so they export read-only too.
    let b = ManagedTensor::from_host_strided(vec![9u8, 8], &[4, 2], &[0, 1], 0).unwrap();
    assert!(b.is_read_only());
    assert_eq!(b.to_vec::<u8>().unwrap(), [9, 8, 9, 8, 9, 8, 9, 8]);
    let shared = Arc::new(ManagedTensor::from_vec(vec![1u8], &[1]).unwrap().into_read_only());
    // SAFETY: a fresh struct owned here.
    let again = unsafe { ManagedTensor::from_raw_versioned(shared.export_versioned().as_ptr()) }.unwrap();
    assert!(again.flags().contains(Flags::READ_ONLY));
}

#[test]
fn layouts_reaching_outside_the_buffer_are_refused() {
    for (shape, strides, first) in [
        (vec![2usize, 3], vec![3isize, 1], 1usize),
        (vec![7], vec![1], 0),
        (vec![3], vec![-1], 1),
        (vec![2], vec![10], 0),
    ] {
        let e = ManagedTensor::from_host_strided(vec![0u8; 6], &shape, &strides, first).unwrap_err();
        assert!(e.to_string().starts_with("buffer:"), "{e}");
    }
    let e = ManagedTensor::from_vec(vec![0u8; 5], &[2, 3]).unwrap_err().to_string();
    assert_eq!(e, "buffer: layout needs 6 elements for shape (2, 3), buffer has 5 elements");
}

/// An owner that counts its drops (a stand-in for a device allocation).
struct CountingOwner(Arc<AtomicUsize>);
impl Drop for CountingOwner {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn custom_owners_are_dropped_exactly_once() {
    let drops = Arc::new(AtomicUsize::new(0));
    let fake_device_ptr = 0x7000_0000_0000usize as *mut std::ffi::c_void;
    // SAFETY: the pointer is recorded and never dereferenced (CUDA memory is not host-accessible).
    let t = unsafe {
        ManagedTensor::from_raw_parts(
            fake_device_ptr,
            Device::cuda(0),
            DataType::FLOAT32,
            &[8],
            None,
            64,
            Flags::NONE,
            CountingOwner(drops.clone()),
        )
    }
    .unwrap();
    assert_eq!(t.data_ptr() as usize, 0x7000_0000_0000 + 64);
    assert_eq!(t.byte_offset(), 64);
    let err = t.as_slice::<f32>().unwrap_err().to_string();
    assert!(err.ends_with("on cuda:0"), "{err}");
    let t = through_abi(t);
    std::thread::spawn(move || drop(t)).join().unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    // Refused metadata drops the owner at once.
    // SAFETY: as above.
    let e = unsafe {
        ManagedTensor::from_raw_parts(
            fake_device_ptr,
            Device::cuda(0),
            DataType::FLOAT32,
            &[-1],
            None,
            0,
            Flags::NONE,
            CountingOwner(drops.clone()),
        )
    }
    .unwrap_err();
    assert!(matches!(e, dlbridge::Error::NegativeDim { .. }));
    assert_eq!(drops.load(Ordering::SeqCst), 2);
}

/// An owner whose drop panics: the deleter must swallow it rather than unwind into C.
struct PanickingOwner;
impl Drop for PanickingOwner {
    fn drop(&mut self) {
        panic!("owner drop panicked (expected by the test)");
    }
}

#[test]
fn a_panicking_owner_does_not_unwind_out_of_the_deleter() {
    // SAFETY: dangling-but-unused host pointer with zero elements.
    let t = unsafe {
        ManagedTensor::from_raw_parts(
            std::ptr::null_mut(),
            Device::CPU,
            DataType::UINT8,
            &[0],
            None,
            0,
            Flags::NONE,
            PanickingOwner,
        )
    }
    .unwrap();
    drop(t);
}
