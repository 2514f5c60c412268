//! The cudarc bridge on a real GPU: a CudaSlice exported and viewed back without copying. These
//! need a CUDA device and driver (`cargo test --features cudarc -- --ignored` where one is); the
//! checks that need none are unit tests in `src/bridges/cudarc.rs`.
#![cfg(feature = "cudarc")]

use cudarc::driver::CudaContext;
use dlbridge::{Error, ManagedTensor, RawManagedTensor};

fn through_abi(t: ManagedTensor) -> ManagedTensor {
    let RawManagedTensor::Versioned(p) = t.into_raw() else { panic!("exports are versioned") };
    // SAFETY: a pointer just given up by a ManagedTensor.
    unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_slice_round_trip_is_zero_copy_and_writes_are_shared() {
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let slice = stream.clone_htod(&[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let other = ctx.new_stream().unwrap();
    let mut t = through_abi(ManagedTensor::from_cuda_slice(slice, Some(&other)).unwrap());
    assert_eq!(t.device().to_string(), "cuda:0");
    assert_eq!(t.shape(), &[4]);
    let ptr = t.data_ptr() as u64;
    {
        let g = t.as_cuda_view::<f32>(&other).unwrap();
        let v = g.view();
        assert_eq!(other.clone_dtoh(&v).unwrap(), [1.0, 2.0, 3.0, 4.0]);
        let (p, _rec) = cudarc::driver::DevicePtr::device_ptr(&v, &other);
        assert_eq!(p, ptr);
    }
    {
        let mut g = t.as_cuda_view_mut::<f32>(&other).unwrap();
        other.memset_zeros(&mut g.view_mut()).unwrap();
    }
    let g = t.as_cuda_view::<f32>(&other).unwrap();
    assert_eq!(other.clone_dtoh(&g.view()).unwrap(), [0.0; 4]);
    // A second handle over the same device memory cannot take it mutably meanwhile.
    let shared = std::sync::Arc::new(
        ManagedTensor::from_cuda_slice(other.clone_htod(&[1u8, 2]).unwrap(), None).unwrap(),
    );
    // SAFETY: fresh exports of a live tensor.
    let a = unsafe { ManagedTensor::from_raw_versioned(shared.export_versioned().as_ptr()) }.unwrap();
    // SAFETY: as above.
    let mut b = unsafe { ManagedTensor::from_raw_versioned(shared.export_versioned().as_ptr()) }.unwrap();
    let ra = a.as_cuda_view::<u8>(&other).unwrap();
    assert!(matches!(b.as_cuda_view_mut::<u8>(&other), Err(Error::AlreadyBorrowed { .. })));
    drop(ra);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_view_on_another_device_is_refused() {
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let t = ManagedTensor::from_cuda_slice(stream.clone_htod(&[1i32, 2]).unwrap(), None).unwrap();
    let e = t.as_cuda_view::<i64>(&stream).unwrap_err().to_string();
    assert!(e.starts_with("expected a C-contiguous int64 CUDA tensor on cuda:0"), "{e}");
    let cpu = ManagedTensor::from_vec(vec![1i32, 2], &[2]).unwrap();
    let e = cpu.as_cuda_view::<i32>(&stream).unwrap_err().to_string();
    assert!(e.ends_with("on cpu"), "{e}");
}
