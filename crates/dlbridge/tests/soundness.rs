//! The aliasing rule of dlbridge's safe API, each case a regression test for a reproduced defect
//! (issue 12): no two live mutable borrows, and no mutable beside a shared one, of the same memory,
//! whichever handles they come from; layouts whose elements overlap are never handed out mutably.
//! Runs under Miri too (`make miri`).

use std::sync::Arc;

use dlbridge::{DataType, Device, Error, Flags, ManagedTensor};

/// Two handles over one buffer, as a function given the same array twice gets them.
fn twice(v: Vec<f64>) -> (Arc<ManagedTensor>, ManagedTensor, ManagedTensor) {
    let n = v.len();
    let t = Arc::new(ManagedTensor::from_vec(v, &[n]).unwrap());
    // SAFETY: fresh owning exports, each taken in once.
    let a = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    // SAFETY: as above.
    let b = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    assert_eq!(a.data_ptr(), b.data_ptr());
    (t, a, b)
}

fn borrowed(r: Result<impl Sized, Error>) -> bool {
    matches!(r, Err(Error::AlreadyBorrowed { .. }))
}

#[test]
fn two_mutable_slices_of_one_buffer_are_refused() {
    let (_t, mut a, mut b) = twice(vec![0.0; 4]);
    let mut wa = a.as_slice_mut::<f64>().unwrap();
    assert!(borrowed(b.as_slice_mut::<f64>()));
    wa[0] = 1.0;
    drop(wa);
    // Once the first guard is gone, the other handle may write.
    b.as_slice_mut::<f64>().unwrap()[1] = 2.0;
    assert_eq!(a.as_slice::<f64>().unwrap(), &[1.0, 2.0, 0.0, 0.0]);
}

#[test]
fn a_mutable_and_a_shared_borrow_are_refused_either_way_round() {
    let (_t, mut a, b) = twice(vec![0.0; 4]);
    let r = b.as_slice::<f64>().unwrap();
    assert!(borrowed(a.as_slice_mut::<f64>()));
    // A shared read beside a shared slice is fine.
    assert_eq!(a.get::<f64>(&[0]).unwrap(), 0.0);
    drop(r);
    let w = a.as_slice_mut::<f64>().unwrap();
    assert!(borrowed(b.as_slice::<f64>()));
    assert!(borrowed(b.get::<f64>(&[0])));
    assert!(borrowed(b.to_vec::<f64>()));
    assert!(borrowed(b.to_contiguous()));
    drop(w);
    assert_eq!(b.to_vec::<f64>().unwrap(), [0.0; 4]);
}

#[test]
fn shared_borrows_coexist() {
    let (_t, a, b) = twice(vec![1.0, 2.0]);
    let (ra, rb) = (a.as_slice::<f64>().unwrap(), b.as_slice::<f64>().unwrap());
    assert_eq!(ra[1] + rb[0], 3.0);
    assert_eq!(a.get::<f64>(&[1]).unwrap(), 2.0);
}

#[test]
fn overlapping_but_not_equal_ranges_conflict() {
    // Two handles over different, overlapping parts of one buffer.
    let buf = Arc::new(ManagedTensor::from_vec(vec![0u32; 8], &[8]).unwrap());
    let view = |first: usize, len: usize| {
        let owner = Arc::clone(&buf);
        let data = buf.data_ptr().cast::<u32>().wrapping_add(first).cast();
        // SAFETY: `len` elements from `first` lie inside the buffer `owner` keeps alive.
        unsafe {
            ManagedTensor::from_raw_parts(
                data,
                Device::CPU,
                DataType::UINT32,
                &[len as i64],
                None,
                0,
                Flags::NONE,
                owner,
            )
        }
        .unwrap()
    };
    let (mut lo, mut hi, mut apart) = (view(0, 5), view(4, 4), view(5, 3));
    let w = lo.as_slice_mut::<u32>().unwrap();
    assert!(borrowed(hi.as_slice_mut::<u32>()));
    // Adjacent but disjoint memory is independent.
    apart.as_slice_mut::<u32>().unwrap()[0] = 7;
    drop(w);
    assert_eq!(hi.as_slice_mut::<u32>().unwrap()[1], 7);
}

#[test]
fn a_guard_held_on_another_thread_blocks_access_here() {
    let (_t, mut a, b) = twice(vec![0.0; 16]);
    let (held, release) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut w = a.as_slice_mut::<f64>().unwrap();
            held.wait();
            release.wait();
            w[3] = 3.0;
        });
        held.wait();
        assert!(borrowed(b.as_slice::<f64>()));
        release.wait();
    });
    assert_eq!(b.as_slice::<f64>().unwrap()[3], 3.0);
}

#[test]
fn overlapping_strides_export_read_only() {
    // from_host_strided(vec![0.; 3], &[2, 2], &[1, 1], 0): four indices, three addresses.
    let t = ManagedTensor::from_host_strided(vec![0.0f64; 3], &[2, 2], &[1, 1], 0).unwrap();
    assert!(t.is_read_only());
    let z = ManagedTensor::from_host_strided(vec![0.0f64; 3], &[4, 3], &[0, 1], 0).unwrap();
    assert!(z.is_read_only());
    // Disjoint strided layouts stay writable.
    let ok = ManagedTensor::from_host_strided(vec![0.0f64; 12], &[3, 2], &[4, 2], 0).unwrap();
    assert!(!ok.is_read_only());
}

#[cfg(feature = "ndarray")]
#[test]
fn a_writable_overlapping_tensor_refuses_mutable_views() {
    let buf = Arc::new(ManagedTensor::from_vec(vec![0.0f64; 3], &[3]).unwrap());
    let owner = Arc::clone(&buf);
    // A producer that says writable for as_strided(np.zeros(3), (2, 2), (8, 8)).
    // SAFETY: every element the layout reaches (offsets 0..=2) lies in the buffer owner keeps.
    let mut t = unsafe {
        ManagedTensor::from_raw_parts(
            buf.data_ptr(),
            Device::CPU,
            DataType::FLOAT64,
            &[2, 2],
            Some(&[1, 1]),
            0,
            Flags::NONE,
            owner,
        )
    }
    .unwrap();
    assert!(!t.is_read_only());
    let e = t.as_array_mut::<f64>().unwrap_err().to_string();
    assert!(e.contains("do not overlap"), "{e}");
    assert!(t.as_slice_mut::<f64>().is_err());
    assert_eq!(t.as_array::<f64>().unwrap().sum(), 0.0);
}

#[cfg(feature = "ndarray")]
#[test]
fn ndarray_guards_follow_the_rule_too() {
    let (_t, mut a, b) = twice(vec![1.0; 6]);
    let mut w = a.as_array_mut::<f64>().unwrap();
    assert!(borrowed(b.as_array::<f64>()));
    w.mapv_inplace(|x| x * 2.0);
    drop(w);
    assert_eq!(b.as_array::<f64>().unwrap().sum(), 12.0);
}

#[test]
fn every_export_survives_stacked_borrows() {
    // Miri flagged `Box::into_raw` retagging each export after its dims pointers were taken; this
    // walks every export path and reads the dims back through the raw struct.
    for ndim in [0usize, 1, 3, 8, 9] {
        let shape = vec![1usize; ndim];
        let t = Arc::new(ManagedTensor::from_vec(vec![5i16], &shape).unwrap());
        assert_eq!(t.shape().len(), ndim);
        let v = t.export_versioned();
        // SAFETY: a live export; shape/strides hold ndim values.
        unsafe {
            let d = &(*v.as_ptr()).dl_tensor;
            if ndim > 0 {
                assert_eq!(std::slice::from_raw_parts(d.shape, ndim), vec![1i64; ndim]);
                assert_eq!(std::slice::from_raw_parts(d.strides, ndim), vec![1i64; ndim]);
            }
            ((*v.as_ptr()).deleter.unwrap())(v.as_ptr());
        }
        let l = t.export_legacy().unwrap();
        // SAFETY: a live export, deleted once.
        let back = unsafe { ManagedTensor::from_raw_legacy(l.as_ptr()) }.unwrap();
        assert_eq!(back.to_vec::<i16>().unwrap(), [5]);
    }
}

#[test]
fn every_host_buffer_kind_exports_soundly() {
    // Box<[T]> was UB under Stacked Borrows: its data pointer was taken before the box moved into
    // the export (a move retags a Box). Each kind is read and, where writable, written.
    let from_box = ManagedTensor::from_host(vec![1u32, 2, 3, 4].into_boxed_slice(), &[4]).unwrap();
    let mut from_vec = ManagedTensor::from_host(vec![1u32, 2, 3, 4], &[4]).unwrap();
    let from_arc = ManagedTensor::from_host(Arc::<[u32]>::from(vec![1u32, 2, 3, 4]), &[4]).unwrap();
    let from_aligned =
        ManagedTensor::from_host(dlbridge::AlignedBuffer::from_slice(&[1u32, 2, 3, 4]), &[4]).unwrap();
    for t in [&from_box, &from_vec, &from_arc, &from_aligned] {
        assert_eq!(t.as_slice::<u32>().unwrap(), &[1, 2, 3, 4]);
    }
    let mut boxed = from_box;
    boxed.as_slice_mut::<u32>().unwrap()[0] = 9;
    from_vec.as_slice_mut::<u32>().unwrap()[0] = 9;
    assert_eq!((boxed.get::<u32>(&[0]).unwrap(), from_vec.get::<u32>(&[0]).unwrap()), (9, 9));
    assert!(from_arc.is_read_only());
    let strided =
        ManagedTensor::from_host_strided(vec![1u32, 2, 3, 4].into_boxed_slice(), &[2], &[-2], 3).unwrap();
    assert_eq!(strided.to_vec::<u32>().unwrap(), [4, 2]);
}

#[test]
fn a_read_only_tensor_is_never_exported_as_legacy() {
    // A legacy struct cannot say read-only: the consumer would write memory behind an Arc<[u8]>.
    let shared: Arc<[u8]> = Arc::from(vec![1u8, 2, 3, 4]);
    let t = Arc::new(ManagedTensor::from_host(shared, &[4]).unwrap());
    let e = t.export_legacy().unwrap_err().to_string();
    assert!(e.contains("legacy"), "{e}");
    // The versioned form carries the flag through.
    // SAFETY: a fresh owning export, taken in once.
    let back = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    assert!(back.is_read_only());
}

#[cfg(feature = "ndarray")]
#[test]
fn an_empty_tensor_too_large_for_ndarray_is_refused() {
    // ndarray requires the non-zero extents to multiply to at most isize::MAX, even when empty.
    let t = ManagedTensor::from_vec(Vec::<f32>::new(), &[0, 1 << 62, 1 << 62]).unwrap();
    let e = t.as_array::<f32>().unwrap_err().to_string();
    assert!(e.contains("isize::MAX"), "{e}");
    let ok = ManagedTensor::from_vec(Vec::<f32>::new(), &[0, 3]).unwrap();
    assert_eq!(ok.as_array::<f32>().unwrap().shape(), &[0, 3]);
}

/// Typed guards can cross into a closure that runs without the GIL or on another thread (a
/// kernel body on rayon): they are Send and Sync for element types that are.
#[test]
fn guards_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<dlbridge::SliceRef<'static, f32>>();
    send_sync::<dlbridge::SliceMut<'static, half::bf16>>();
    #[cfg(feature = "ndarray")]
    {
        send_sync::<dlbridge::ndarray::ArrayGuard<'static, f64>>();
        send_sync::<dlbridge::ndarray::ArrayGuardMut<'static, f64>>();
    }
    let mut t = dlbridge::ManagedTensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    let mut s = t.as_slice_mut::<f32>().unwrap();
    std::thread::scope(|sc| {
        sc.spawn(|| s.iter_mut().for_each(|x| *x *= 2.0));
    });
    drop(s);
    assert_eq!(t.to_vec::<f32>().unwrap(), [2.0, 4.0, 6.0, 8.0]);
}
