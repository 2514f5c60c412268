//! One test per validation rule of `ManagedTensor::from_raw_*`: a fake producer (written for the
//! test, since no real library emits malformed tensors on purpose) hands over a malformed tensor,
//! and each test asserts the error, that its message names the field, and that the producer's
//! deleter ran exactly once.

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use dlbridge::ffi::{
    DLDataType, DLDataTypeCode, DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned,
    DLPackVersion, DLTensor,
};
use dlbridge::{DataType, Device, Error, Flags, MAX_NDIM, ManagedTensor, Version};

/// What a fake producer allocates per tensor: the struct first, then what it points to.
#[repr(C)]
struct FakeVersioned {
    managed: DLManagedTensorVersioned,
    shape: Vec<i64>,
    strides: Vec<i64>,
    data: Vec<u64>,
    deleted: Arc<AtomicUsize>,
}

#[repr(C)]
struct FakeLegacy {
    managed: DLManagedTensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
    data: Vec<u64>,
    deleted: Arc<AtomicUsize>,
}

unsafe extern "C" fn fake_versioned_deleter(p: *mut DLManagedTensorVersioned) {
    // SAFETY: only installed on boxes made by `fake_versioned`.
    let b = unsafe { Box::from_raw(p.cast::<FakeVersioned>()) };
    b.deleted.fetch_add(1, Ordering::SeqCst);
}

unsafe extern "C" fn fake_legacy_deleter(p: *mut DLManagedTensor) {
    // SAFETY: only installed on boxes made by `fake_legacy`.
    let b = unsafe { Box::from_raw(p.cast::<FakeLegacy>()) };
    b.deleted.fetch_add(1, Ordering::SeqCst);
}

/// A well-formed 2x3 float32 CPU tensor, then `edit` applied to the struct.
fn fake_versioned(
    edit: impl FnOnce(&mut DLManagedTensorVersioned),
) -> (*mut DLManagedTensorVersioned, Arc<AtomicUsize>) {
    let deleted = Arc::new(AtomicUsize::new(0));
    let mut b = Box::new(FakeVersioned {
        managed: DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 3 },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(fake_versioned_deleter),
            flags: 0,
            dl_tensor: blank_tensor(),
        },
        shape: vec![2, 3],
        strides: vec![3, 1],
        data: vec![0; 3],
        deleted: deleted.clone(),
    });
    b.managed.dl_tensor.shape = b.shape.as_mut_ptr();
    b.managed.dl_tensor.strides = b.strides.as_mut_ptr();
    b.managed.dl_tensor.data = b.data.as_mut_ptr().cast();
    edit(&mut b.managed);
    (Box::into_raw(b).cast(), deleted)
}

fn fake_legacy(edit: impl FnOnce(&mut DLManagedTensor)) -> (*mut DLManagedTensor, Arc<AtomicUsize>) {
    let deleted = Arc::new(AtomicUsize::new(0));
    let mut b = Box::new(FakeLegacy {
        managed: DLManagedTensor {
            dl_tensor: blank_tensor(),
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(fake_legacy_deleter),
        },
        shape: vec![2, 3],
        strides: vec![3, 1],
        data: vec![0; 3],
        deleted: deleted.clone(),
    });
    b.managed.dl_tensor.shape = b.shape.as_mut_ptr();
    b.managed.dl_tensor.strides = b.strides.as_mut_ptr();
    b.managed.dl_tensor.data = b.data.as_mut_ptr().cast();
    edit(&mut b.managed);
    (Box::into_raw(b).cast(), deleted)
}

fn blank_tensor() -> DLTensor {
    DLTensor {
        data: std::ptr::null_mut(),
        device: DLDevice { device_type: DLDeviceType::CPU, device_id: 0 },
        ndim: 2,
        dtype: DLDataType { code: DLDataTypeCode::FLOAT, bits: 32, lanes: 1 },
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// Feeds an edited versioned tensor and returns the error; asserts the deleter ran once and that
/// the message names `field`.
fn refuse(field: &str, edit: impl Fn(&mut DLTensor)) -> Error {
    let (p, deleted) = fake_versioned(|m| edit(&mut m.dl_tensor));
    // SAFETY: a live fake tensor whose ownership passes to the call.
    let err = unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap_err();
    assert_eq!(deleted.load(Ordering::SeqCst), 1, "deleter count after refusing: {err}");
    assert!(err.to_string().contains(field), "{err:?} should name {field}: {err}");
    // The same malformed tensor through the legacy door.
    let (p, deleted) = fake_legacy(|m| {
        let mut t = m.dl_tensor;
        edit(&mut t);
        m.dl_tensor = t;
    });
    // SAFETY: as above.
    let legacy_err = unsafe { ManagedTensor::from_raw_legacy(p) }.unwrap_err();
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
    // Same refusal (addresses inside the two fakes differ, so compare the kind).
    assert_eq!(std::mem::discriminant(&legacy_err), std::mem::discriminant(&err));
    err
}

#[test]
fn a_well_formed_tensor_is_accepted_and_deleted_once_on_drop() {
    let (p, deleted) = fake_versioned(|_| {});
    // SAFETY: a live fake tensor.
    let t = unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap();
    assert_eq!(
        (t.shape(), t.strides(), t.dtype(), t.device()),
        (&[2i64, 3][..], &[3i64, 1][..], DataType::FLOAT32, Device::CPU)
    );
    assert_eq!(t.version(), Some(Version { major: 1, minor: 3 }));
    assert_eq!(deleted.load(Ordering::SeqCst), 0);
    drop(t);
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
}

#[test]
fn null_pointer_is_refused() {
    // SAFETY: NULL is allowed by the contract.
    let versioned = unsafe { ManagedTensor::from_raw_versioned(std::ptr::null_mut()) };
    // SAFETY: as above.
    let legacy = unsafe { ManagedTensor::from_raw_legacy(std::ptr::null_mut()) };
    assert_eq!(versioned.unwrap_err(), Error::NullTensor);
    assert_eq!(legacy.unwrap_err(), Error::NullTensor);
}

#[test]
fn major_version_other_than_one_is_refused_after_deleting() {
    for major in [0, 2, u32::MAX] {
        let (p, deleted) = fake_versioned(|m| {
            m.version.major = major;
            // Beyond the frozen prefix anything may be there: poison it.
            m.dl_tensor.ndim = -5;
            m.dl_tensor.shape = std::ptr::dangling_mut::<i64>();
        });
        // SAFETY: a live fake tensor.
        let err = unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap_err();
        assert_eq!(err, Error::UnsupportedVersion { major, minor: 3 });
        assert!(err.to_string().starts_with("version:"));
        assert_eq!(deleted.load(Ordering::SeqCst), 1);
    }
}

#[test]
fn any_minor_version_of_major_one_is_accepted() {
    let (p, deleted) = fake_versioned(|m| m.version.minor = 99);
    // SAFETY: a live fake tensor.
    let t = unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap();
    assert_eq!(t.version().unwrap().minor, 99);
    drop(t);
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
}

#[test]
fn negative_ndim() {
    assert_eq!(refuse("ndim", |t| t.ndim = -1), Error::InvalidNdim { ndim: -1, max: MAX_NDIM });
}

#[test]
fn ndim_over_the_limit() {
    assert_eq!(refuse("ndim", |t| t.ndim = 65), Error::InvalidNdim { ndim: 65, max: 64 });
    assert_eq!(refuse("ndim", |t| t.ndim = 1_000_000), Error::InvalidNdim { ndim: 1_000_000, max: 64 });
}

#[test]
fn null_shape_with_dims() {
    assert_eq!(refuse("shape", |t| t.shape = std::ptr::null_mut()), Error::NullShape { ndim: 2 });
}

#[test]
fn misaligned_shape_and_strides() {
    let e = refuse("shape", |t| t.shape = t.shape.cast::<u8>().wrapping_add(1).cast());
    assert!(matches!(e, Error::MisalignedPointer { field: "shape", .. }));
    let e = refuse("strides", |t| t.strides = t.strides.cast::<u8>().wrapping_add(4).cast());
    assert!(matches!(e, Error::MisalignedPointer { field: "strides", .. }));
}

#[test]
fn negative_dimension() {
    let e = refuse("shape[1]", |t| {
        // SAFETY: the fake's shape has two entries.
        unsafe { *t.shape.add(1) = -3 }
    });
    assert_eq!(e, Error::NegativeDim { axis: 1, value: -3 });
}

#[test]
fn element_count_overflow() {
    let e = refuse("shape", |t| unsafe {
        // SAFETY: two entries.
        *t.shape = 1 << 62;
        *t.shape.add(1) = 8;
    });
    assert!(matches!(e, Error::ElementCountOverflow { .. }), "{e:?}");
}

#[test]
fn byte_span_overflow_from_strides() {
    let e = refuse("strides", |t| unsafe {
        // SAFETY: two entries.
        *t.strides = i64::MAX / 2;
    });
    assert!(matches!(e, Error::SpanOverflow { .. }), "{e:?}");
}

#[test]
fn span_wrapping_the_address_space_up_and_down() {
    // Positive strides from a pointer near the top of the address space.
    let e = refuse("strides", |t| t.data = (usize::MAX - 8) as *mut c_void);
    assert!(matches!(e, Error::SpanOverflow { .. }), "{e:?}");
    // Negative strides reaching below address zero.
    let e = refuse("strides", |t| {
        t.data = 0x10 as *mut c_void;
        // SAFETY: two entries.
        unsafe { *t.strides = -100 };
    });
    assert!(matches!(e, Error::SpanOverflow { .. }), "{e:?}");
}

#[test]
fn null_data_with_elements() {
    assert_eq!(refuse("data", |t| t.data = std::ptr::null_mut()), Error::NullData { numel: 6 });
}

#[test]
fn null_data_without_elements_is_accepted() {
    let (p, deleted) = fake_versioned(|m| {
        m.dl_tensor.data = std::ptr::null_mut();
        // SAFETY: two entries.
        unsafe { *m.dl_tensor.shape = 0 };
    });
    // SAFETY: a live fake tensor.
    let t = unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap();
    assert_eq!((t.numel(), t.as_slice::<f32>().unwrap().len()), (0, 0));
    drop(t);
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
}

#[test]
fn unknown_type_code() {
    // 18 (kDLBcomplex) is named since the 1.3 tag; 19 is the first code the header leaves free.
    assert_eq!(
        refuse("dtype.code", |t| t.dtype.code = DLDataTypeCode(19)),
        Error::UnknownTypeCode { code: 19 }
    );
    assert_eq!(
        refuse("dtype.code", |t| t.dtype.code = DLDataTypeCode(255)),
        Error::UnknownTypeCode { code: 255 }
    );
}

#[test]
fn bits_invalid_for_the_code() {
    for (code, bits) in [
        (DLDataTypeCode::FLOAT6_E2M3FN, 8),
        (DLDataTypeCode::FLOAT6_E3M2FN, 4),
        (DLDataTypeCode::FLOAT4_E2M1FN, 8),
        (DLDataTypeCode::BOOL, 1),
        (DLDataTypeCode::BOOL, 16),
        (DLDataTypeCode::FLOAT, 8),
        (DLDataTypeCode::FLOAT, 0),
        (DLDataTypeCode::BFLOAT, 32),
        (DLDataTypeCode::FLOAT8_E4M3FN, 16),
        (DLDataTypeCode::INT, 3),
        (DLDataTypeCode::COMPLEX, 16),
        (DLDataTypeCode::BCOMPLEX, 16),
        (DLDataTypeCode::BCOMPLEX, 64),
    ] {
        let e = refuse("dtype.bits", |t| t.dtype = DLDataType { code, bits, lanes: 1 });
        assert!(matches!(e, Error::InvalidBits { .. }), "{e:?}");
        assert!(e.to_string().contains(&format!("dtype.bits: {bits} ")), "{e}");
    }
}

#[test]
fn zero_lanes() {
    let e = refuse("dtype.lanes", |t| t.dtype.lanes = 0);
    assert!(matches!(e, Error::ZeroLanes { .. }), "{e:?}");
}

#[test]
fn unknown_device_type() {
    // 19-21 (TPU, TPU host, Ascend) are named since the 1.3 tag; 22 is the first type left free.
    for v in [0, 5, 6, 22, 23, -1, i32::MAX] {
        let e = refuse("device.device_type", |t| t.device.device_type = DLDeviceType(v));
        assert_eq!(e, Error::UnknownDeviceType { device_type: v });
    }
}

#[test]
fn codes_merged_into_the_header_after_1_3_are_accepted() {
    let accept = |edit: &dyn Fn(&mut DLTensor)| {
        let (p, deleted) = fake_versioned(|m| edit(&mut m.dl_tensor));
        // SAFETY: a live fake tensor.
        let t = unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap();
        (t, deleted)
    };
    // kDLBcomplex: two bfloat16, 32 bits (the fake's 24 bytes hold its 2x3 elements).
    let (t, deleted) =
        accept(&|t| t.dtype = DLDataType { code: DLDataTypeCode::BCOMPLEX, bits: 32, lanes: 1 });
    assert_eq!(
        (t.dtype(), t.dtype().to_string(), t.nbytes()),
        (DataType::BCOMPLEX32, "bcomplex32".into(), 24)
    );
    assert_eq!(t.to_contiguous().unwrap().dtype(), DataType::BCOMPLEX32);
    drop(t);
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
    // kDLTPUHost is pinned host memory (the header's mirror of kDLCUDAHost): the CPU reads it.
    let (t, _) = accept(&|t| t.device = DLDevice { device_type: DLDeviceType::TPU_HOST, device_id: 0 });
    assert_eq!((t.device().to_string(), t.is_host_accessible()), ("tpu_host".into(), true));
    assert_eq!(t.as_slice::<f32>().unwrap(), [0.0; 6]);
    // kDLTPU and kDLAscend are device memory: accepted, named, never read from the host.
    for (dt, name) in [(DLDeviceType::TPU, "tpu:1"), (DLDeviceType::ASCEND, "ascend:1")] {
        let (t, deleted) = accept(&|t| t.device = DLDevice { device_type: dt, device_id: 1 });
        assert_eq!((t.device().to_string(), t.is_host_accessible()), (name.into(), false));
        assert!(t.as_slice::<f32>().is_err() && t.get::<f32>(&[0, 0]).is_err());
        drop(t);
        assert_eq!(deleted.load(Ordering::SeqCst), 1);
    }
}

#[test]
fn byte_offset_overflow() {
    let e = refuse("byte_offset", |t| t.byte_offset = u64::MAX);
    assert!(matches!(e, Error::ByteOffsetOverflow { byte_offset: u64::MAX, .. }), "{e:?}");
}

#[test]
fn null_strides_mean_compact_row_major() {
    let (p, deleted) = fake_legacy(|m| m.dl_tensor.strides = std::ptr::null_mut());
    // SAFETY: a live fake tensor.
    let t = unsafe { ManagedTensor::from_raw_legacy(p) }.unwrap();
    assert!(t.had_null_strides());
    assert_eq!(t.strides(), &[3, 1]);
    assert!(t.is_c_contiguous());
    assert_eq!(t.version(), None);
    assert_eq!(t.flags(), Flags::NONE);
    drop(t);
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
}

#[test]
fn zero_dim_tensor_may_have_null_shape_and_strides() {
    let (p, deleted) = fake_versioned(|m| {
        m.dl_tensor.ndim = 0;
        m.dl_tensor.shape = std::ptr::null_mut();
        m.dl_tensor.strides = std::ptr::null_mut();
    });
    // SAFETY: a live fake tensor.
    let t = unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap();
    assert_eq!((t.ndim(), t.numel(), t.shape().len(), t.strides().len()), (0, 1, 0, 0));
    drop(t);
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
}

#[test]
fn null_deleter_is_never_called() {
    // Refused with a NULL deleter: nothing to call, nothing crashes. The fake leaks its box, as a
    // producer with no deleter intends (it owns the memory elsewhere).
    let (p, deleted) = fake_versioned(|m| {
        m.deleter = None;
        m.dl_tensor.ndim = -1;
    });
    // SAFETY: a live fake tensor.
    assert!(unsafe { ManagedTensor::from_raw_versioned(p) }.is_err());
    assert_eq!(deleted.load(Ordering::SeqCst), 0);
    // Accepted with a NULL deleter, then dropped.
    let (p2, deleted2) = fake_versioned(|m| m.deleter = None);
    // SAFETY: as above.
    drop(unsafe { ManagedTensor::from_raw_versioned(p2) }.unwrap());
    assert_eq!(deleted2.load(Ordering::SeqCst), 0);
    // SAFETY: both boxes are still ours (no deleter ran); free them to keep valgrind quiet.
    unsafe {
        drop(Box::from_raw(p.cast::<FakeVersioned>()));
        drop(Box::from_raw(p2.cast::<FakeVersioned>()));
    }
}

#[test]
fn flags_are_read_from_versioned_tensors() {
    let (p, _) = fake_versioned(|m| m.flags = Flags::READ_ONLY.0 | Flags::IS_COPIED.0 | 0x100);
    // SAFETY: a live fake tensor.
    let mut t = unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap();
    assert!(t.is_read_only() && t.flags().is_copied());
    assert_eq!(t.flags().0 & 0x100, 0x100, "unknown bits are kept");
    let err = t.as_slice_mut::<f32>().unwrap_err().to_string();
    assert!(err.starts_with("expected writable float32 C-contiguous cpu tensor, got read-only "), "{err}");
}

#[test]
fn deleter_runs_once_on_another_thread() {
    let (p, deleted) = fake_versioned(|_| {});
    // SAFETY: a live fake tensor.
    let t = unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap();
    std::thread::spawn(move || drop(t)).join().unwrap();
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
}

#[test]
fn deleters_run_once_each_across_many_threads() {
    let counters: Vec<_> = (0..8)
        .map(|_| {
            let tensors: Vec<_> = (0..200)
                .map(|_| {
                    let (p, c) = fake_versioned(|_| {});
                    // SAFETY: a live fake tensor.
                    (unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap(), c)
                })
                .collect();
            let counters: Vec<_> = tensors.iter().map(|(_, c)| c.clone()).collect();
            let handle = std::thread::spawn(move || drop(tensors));
            (handle, counters)
        })
        .collect();
    for (h, cs) in counters {
        h.join().unwrap();
        assert!(cs.iter().all(|c| c.load(Ordering::SeqCst) == 1));
    }
}

#[test]
fn into_raw_hands_ownership_back_without_deleting() {
    let (p, deleted) = fake_versioned(|_| {});
    // SAFETY: a live fake tensor.
    let t = unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap().into_read_only();
    let raw = t.into_raw();
    assert_eq!(deleted.load(Ordering::SeqCst), 0);
    let dlbridge::RawManagedTensor::Versioned(q) = raw else { panic!("expected versioned") };
    assert_eq!(q, p);
    // SAFETY: we own it again; the read-only flag set on our side was written into the struct.
    let again = unsafe { ManagedTensor::from_raw_versioned(q) }.unwrap();
    assert!(again.is_read_only());
    drop(again);
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
}
