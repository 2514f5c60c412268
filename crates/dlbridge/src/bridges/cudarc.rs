//! `cudarc` bridge (feature `cudarc`; cudarc's `driver` API with dynamic loading, so it builds
//! without a CUDA installation and loads `libcuda` when first used): a CUDA tensor from torch,
//! cupy or jax as a typed cudarc `CudaView`/`CudaViewMut`, and a `CudaSlice<T>` exported as a
//! CUDA tensor that keeps the slice alive, without copying either way.
//!
//! Views: the tensor must be on the device of the stream's context (the ordinal is checked),
//! of dtype `T`, C-contiguous (a cudarc slice is contiguous), with aligned data; a mutable view
//! also needs a writable tensor. Views hold a lease on the device range in the borrow registry
//! ([`crate::borrow`]; CUDA's unified addressing keeps device ranges apart from host ones), so two
//! handles over the same device memory cannot give a mutable view beside another view. The view
//! is of memory the producer owns: the guard never frees it. The stream is the one the tensor was
//! imported for (Python: `from_dlpack(x, stream=...)` made that stream wait on the producer's work,
//! as the DLPack standard asks of producers); queue work on that stream.
//!
//! Export ([`ManagedTensor::from_cuda_slice`]) does the producer's half of the stream handshake:
//! with a consumer stream, that stream waits (an event recorded on the slice's stream) for all
//! work queued so far on the slice's stream; without one, the slice's stream is synchronized. The
//! slice is freed (stream-ordered, on its own stream) when the consumer calls the deleter; a
//! consumer that queued work reading it on another stream synchronizes before releasing it, as
//! with any stream-ordered producer.
//!
//! What needs a GPU (building a `CudaContext`) is tested where one is present
//! (`#[ignore = "needs a CUDA GPU"]` elsewhere); the checks run without one:
//!
//! ```
//! use dlbridge::{DataType, Device, Flags, ManagedTensor};
//! // A CPU tensor is no CUDA tensor: refused before any driver call.
//! let cpu = ManagedTensor::from_vec(vec![1.0f32; 4], &[4]).unwrap();
//! let e = cpu.cuda_view_check::<f32>(0, false).unwrap_err().to_string();
//! assert_eq!(e, "expected a C-contiguous float32 CUDA tensor on cuda:0 (the stream's device), got float32 shape (4,) strides (1,) on cpu");
//! ```

use std::ffi::c_void;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtrMut, DeviceRepr};

use crate::borrow::Lease;
use crate::device::{Device, DeviceType};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::flags::Flags;
use crate::managed::ManagedTensor;

/// A read-only cudarc view of a CUDA tensor ([`ManagedTensor::as_cuda_view`]); holds a shared
/// lease on the device range until it drops. [`CudaViewGuard::view`] lends a `CudaView`.
#[derive(Debug)]
pub struct CudaViewGuard<'a, T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    _lease: Lease,
    _tensor: PhantomData<&'a ManagedTensor>,
}

/// A mutable cudarc view of a writable CUDA tensor ([`ManagedTensor::as_cuda_view_mut`]); holds
/// an exclusive lease. [`CudaViewGuardMut::view_mut`] lends a `CudaViewMut`.
#[derive(Debug)]
pub struct CudaViewGuardMut<'a, T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    _lease: Lease,
    _tensor: PhantomData<&'a mut ManagedTensor>,
}

impl<T> CudaViewGuard<'_, T> {
    /// The device elements as a cudarc view, borrowed from the guard.
    pub fn view(&self) -> CudaView<'_, T> {
        self.slice.as_view()
    }
}

impl<T> CudaViewGuardMut<'_, T> {
    /// The device elements as a read-only cudarc view, borrowed from the guard.
    pub fn view(&self) -> CudaView<'_, T> {
        self.slice.as_view()
    }

    /// The device elements as a mutable cudarc view, borrowed from the guard.
    pub fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.as_view_mut()
    }
}

/// The producer's memory is never freed here: the slice made over it is leaked (its events and
/// stream handle are released), and the tensor's own deleter runs when the tensor drops.
fn leak<T>(slice: &mut ManuallyDrop<CudaSlice<T>>) {
    // SAFETY: called once, from the guard's drop; the slice is not used afterwards.
    let _ = unsafe { ManuallyDrop::take(slice) }.leak();
}

impl<T> Drop for CudaViewGuard<'_, T> {
    fn drop(&mut self) {
        leak(&mut self.slice);
    }
}

impl<T> Drop for CudaViewGuardMut<'_, T> {
    fn drop(&mut self) {
        leak(&mut self.slice);
    }
}

impl ManagedTensor {
    /// What a cudarc view of this tensor needs, checked without touching the driver: a CUDA
    /// (or CUDA managed) tensor on device `ordinal`, of dtype `T`, C-contiguous, aligned, and
    /// writable if `write`. [`ManagedTensor::as_cuda_view`] calls it with its stream's device.
    pub fn cuda_view_check<T: Element>(&self, ordinal: usize, write: bool) -> Result<()> {
        let device = self.device();
        let cuda = matches!(device.device_type(), DeviceType::CUDA | DeviceType::CUDA_MANAGED);
        let ok = cuda
            && usize::try_from(device.id()).ok() == Some(ordinal)
            && self.dtype() == T::DTYPE
            && self.is_c_contiguous()
            && !(write && self.is_read_only());
        let need = |extra: &str| Error::Incompatible {
            expected: format!(
                "a C-contiguous{} {} CUDA tensor on cuda:{ordinal} (the stream's device){extra}",
                if write { " writable" } else { "" },
                T::DTYPE
            ),
            found: self.describe(),
        };
        if !ok {
            return Err(need(""));
        }
        if !T::ALL_BIT_PATTERNS_VALID {
            // Device memory cannot be checked for valid values (0 or 1 for bool) without copying
            // it, and a cudarc copy to the host would make invalid Rust values.
            return Err(need(" of a type every bit pattern is a value of (not bool)"));
        }
        if self.numel() > 0 && !self.data_ptr().cast::<T>().is_aligned() {
            return Err(need(&format!(" with data aligned to {} bytes", align_of::<T>())));
        }
        Ok(())
    }

    fn cuda_slice<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        write: bool,
    ) -> Result<(ManuallyDrop<CudaSlice<T>>, Lease)> {
        self.cuda_view_check::<T>(stream.context().ordinal(), write)?;
        let lease = self.lease_span(write)?;
        let ptr = if self.numel() == 0 { 0 } else { self.data_ptr() as u64 };
        // SAFETY: `ptr` is the first of `numel` aligned elements of dtype T in device memory of
        // the stream's device (checked), valid while the tensor lives, which the guard's lifetime
        // bounds. The slice is never dropped (it would free the producer's memory): the guard
        // leaks it. DLPack tensors hold initialised bytes, and every bit pattern is a value of T
        // (checked: bool is refused).
        let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, self.numel()) };
        Ok((ManuallyDrop::new(slice), lease))
    }

    /// A read-only cudarc view of this CUDA tensor for work on `stream` (whose context must be on
    /// the tensor's device). Holds a shared lease on the device range.
    pub fn as_cuda_view<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
    ) -> Result<CudaViewGuard<'_, T>> {
        let (slice, lease) = self.cuda_slice(stream, false)?;
        Ok(CudaViewGuard { slice, _lease: lease, _tensor: PhantomData })
    }

    /// A mutable cudarc view of this writable CUDA tensor for work on `stream`. Holds an
    /// exclusive lease on the device range.
    pub fn as_cuda_view_mut<T: Element + DeviceRepr>(
        &mut self,
        stream: &Arc<CudaStream>,
    ) -> Result<CudaViewGuardMut<'_, T>> {
        let (slice, lease) = self.cuda_slice(stream, true)?;
        Ok(CudaViewGuardMut { slice, _lease: lease, _tensor: PhantomData })
    }

    /// Exports a `CudaSlice<T>` as a 1-d CUDA tensor on the slice's device without copying; the
    /// tensor owns the slice (freed when the consumer releases the tensor). `consumer` is the
    /// stream the consumer will use: it is made to wait for the work queued on the slice's stream
    /// (the producer's half of the DLPack stream handshake); `None` synchronizes the slice's stream.
    pub fn from_cuda_slice<T: Element + DeviceRepr>(
        mut slice: CudaSlice<T>,
        consumer: Option<&CudaStream>,
    ) -> Result<Self> {
        let driver = |e: cudarc::driver::DriverError| Error::Incompatible {
            expected: "the CUDA stream handshake to succeed".into(),
            found: e.to_string(),
        };
        let stream = Arc::clone(slice.stream());
        let ordinal = i32::try_from(slice.ordinal()).expect("CUDA ordinals fit i32");
        let len = slice.len();
        let ptr = {
            // Taken as for a write: the consumer may write (the export is writable).
            let (ptr, _record) = slice.device_ptr_mut(&stream);
            ptr
        };
        match consumer {
            Some(c) => c.join(&stream).map_err(driver)?,
            None => stream.synchronize().map_err(driver)?,
        }
        let len = i64::try_from(len).expect("a CudaSlice's length fits i64");
        // SAFETY: `ptr` is the slice's allocation of `len` elements of T on device `ordinal`,
        // kept alive by the slice, which the tensor owns and drops exactly once; a CudaSlice is
        // Send. Consumers may write: the slice is owned by the tensor alone.
        unsafe {
            ManagedTensor::from_raw_parts(
                ptr as usize as *mut c_void,
                Device::cuda(ordinal),
                T::DTYPE,
                &[len],
                None,
                0,
                Flags::NONE,
                slice,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DataType;

    /// A pretend CUDA tensor: the address is recorded, never dereferenced.
    fn fake(
        device: Device,
        dtype: DataType,
        shape: &[i64],
        strides: Option<&[i64]>,
        flags: Flags,
    ) -> ManagedTensor {
        // SAFETY: device memory is never dereferenced on the CPU; nothing reads the address.
        unsafe {
            ManagedTensor::from_raw_parts(
                0x7f00_0000_0000 as *mut c_void,
                device,
                dtype,
                shape,
                strides,
                0,
                flags,
                (),
            )
        }
        .unwrap()
    }

    #[test]
    fn the_view_checks_name_what_is_wrong() {
        let t = fake(Device::cuda(1), DataType::FLOAT32, &[2, 3], None, Flags::NONE);
        assert!(t.cuda_view_check::<f32>(1, true).is_ok());
        let e = t.cuda_view_check::<f32>(0, false).unwrap_err().to_string();
        assert_eq!(
            e,
            "expected a C-contiguous float32 CUDA tensor on cuda:0 (the stream's device), got float32 shape \
             (2, 3) strides (3, 1) on cuda:1"
        );
        let e = t.cuda_view_check::<f64>(1, false).unwrap_err().to_string();
        assert!(e.starts_with("expected a C-contiguous float64 CUDA tensor on cuda:1"), "{e}");
        let f = fake(Device::cuda(0), DataType::FLOAT32, &[2, 3], Some(&[1, 2]), Flags::NONE);
        assert!(f.cuda_view_check::<f32>(0, false).unwrap_err().to_string().contains("strides (1, 2)"));
        let ro = fake(Device::cuda(0), DataType::INT64, &[4], None, Flags::READ_ONLY);
        assert!(ro.cuda_view_check::<i64>(0, false).is_ok());
        let e = ro.cuda_view_check::<i64>(0, true).unwrap_err().to_string();
        assert!(e.starts_with("expected a C-contiguous writable int64 CUDA tensor"), "{e}");
        let b = fake(Device::cuda(0), DataType::BOOL, &[4], None, Flags::NONE);
        let e = b.cuda_view_check::<bool>(0, false).unwrap_err().to_string();
        assert!(e.contains("not bool"), "{e}");
        let rocm = fake(Device::new(DeviceType::ROCM, 0), DataType::FLOAT32, &[4], None, Flags::NONE);
        assert!(rocm.cuda_view_check::<f32>(0, false).unwrap_err().to_string().ends_with("on rocm:0"));
    }

    #[test]
    fn misaligned_device_data_is_refused() {
        // SAFETY: as in `fake`.
        let t = unsafe {
            ManagedTensor::from_raw_parts(
                0x7f00_0000_0002 as *mut c_void,
                Device::cuda(0),
                DataType::FLOAT32,
                &[4],
                None,
                0,
                Flags::NONE,
                (),
            )
        }
        .unwrap();
        let e = t.cuda_view_check::<f32>(0, false).unwrap_err().to_string();
        assert!(e.contains("with data aligned to 4 bytes"), "{e}");
    }

    #[test]
    fn device_ranges_are_leased_like_host_ones() {
        let t = fake(Device::cuda(0), DataType::FLOAT32, &[4], None, Flags::NONE);
        let u = fake(Device::cuda(0), DataType::FLOAT32, &[2], None, Flags::NONE);
        let w = t.lease_span(true).unwrap();
        assert!(matches!(u.lease_span(false), Err(Error::AlreadyBorrowed { .. })));
        drop(w);
        let _r = u.lease_span(false).unwrap();
    }
}
