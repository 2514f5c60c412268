//! A borrowed description of a tensor a caller holds (no new handle, no reference count), read
//! through the stable accessors: what a borrowed view of a Python `torch.Tensor` needs, without
//! asking torch's DLPack exchange table (whose borrowed export, `dltensor_from_py_object_no_sync`,
//! takes the GIL again through pybind11, copies the `at::Tensor` and converts it; measured, the
//! table call was about half of a borrowed view).

use std::ffi::c_void;

use super::sys::{AOTITorchError, AtenTensorHandle};
use super::{Error, Result, Torch};
use crate::DataType;
use crate::device::Device;
use crate::ffi::DLTensor;

type Get<T> = unsafe extern "C-unwind" fn(AtenTensorHandle, *mut T) -> AOTITorchError;

/// Entries of the dtype table (torch's codes are small: the c10 `ScalarType` values).
const CODES: usize = 64;

/// The accessors [`Describer::describe`] calls, every one present, with torch's codes asked once
/// ([`Torch::describer`]).
#[derive(Clone, Copy)]
pub struct Describer {
    dtype: Get<i32>,
    device_type: Get<i32>,
    layout: Get<i32>,
    dim: Get<i64>,
    sizes: Get<*mut i64>,
    strides: Get<*mut i64>,
    data_ptr: Get<*mut c_void>,
    cpu: i32,
    strided: i32,
    /// The data type of each dtype code DLPack has (indexed by the code).
    dtypes: [Option<DataType>; CODES],
}

impl std::fmt::Debug for Describer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Describer")
            .field("cpu", &self.cpu)
            .field("strided", &self.strided)
            .finish_non_exhaustive()
    }
}

impl Torch {
    /// The accessors a borrowed description reads ([`Describer::describe`]), or
    /// [`Error::Missing`] naming the first one this torch lacks.
    pub fn describer(&'static self) -> Result<Describer> {
        let s = &self.syms;
        let strided = self.need(s.aoti_torch_layout_strided, "aoti_torch_layout_strided")?;
        let mut dtypes = [None; CODES];
        for &(code, dtype) in &self.codes.dtypes {
            let i = usize::try_from(code)
                .ok()
                .filter(|&i| i < CODES)
                .ok_or_else(|| Error::Invalid(format!("dtype code: torch gave {code} for {dtype}")))?;
            dtypes[i] = Some(dtype);
        }
        Ok(Describer {
            dtype: self.need(s.aoti_torch_get_dtype, "aoti_torch_get_dtype")?,
            device_type: self.need(s.aoti_torch_get_device_type, "aoti_torch_get_device_type")?,
            layout: self.need(s.aoti_torch_get_layout, "aoti_torch_get_layout")?,
            dim: self.need(s.aoti_torch_get_dim, "aoti_torch_get_dim")?,
            sizes: self.need(s.aoti_torch_get_sizes, "aoti_torch_get_sizes")?,
            strides: self.need(s.aoti_torch_get_strides, "aoti_torch_get_strides")?,
            data_ptr: self.need(s.aoti_torch_get_data_ptr, "aoti_torch_get_data_ptr")?,
            cpu: self.codes.cpu,
            // SAFETY: a getter of torch's stable ABI taking nothing.
            strided: unsafe { strided() },
            dtypes,
        })
    }
}

impl Describer {
    /// The tensor at `handle` as a borrowed `DLTensor`, as torch's own DLPack export describes
    /// it: `data` the first element's address (the storage offset applied; NULL for an empty
    /// tensor), `byte_offset` 0, `shape` and `strides` (in elements) pointing into the tensor's
    /// own metadata, so valid only until something changes it. `None` for what it does not
    /// describe: a tensor not on the CPU, not strided, of a dtype this module has no DLPack type
    /// for, or one torch's accessors refuse (no storage, a wrapper without strides: torch keeps
    /// the error message (2.13+) or logs it (older)). Runs no Python. The data pointer is torch's
    /// mutable one (`data_ptr()`), as its DLPack export's: a copy-on-write storage is copied
    /// first.
    ///
    /// # Safety
    ///
    /// `handle` points to a live, defined `at::Tensor` of this [`Torch`] (an owning handle, or the
    /// `at::Tensor` a `THPVariable` holds, its Python object alive), and nothing changes that
    /// tensor's metadata on another thread during the call (torch's own rule for reading it).
    #[inline]
    pub unsafe fn describe(&self, handle: AtenTensorHandle) -> Option<DLTensor> {
        let mut t = DLTensor {
            data: std::ptr::null_mut(),
            device: Device::CPU.to_raw(),
            ndim: 0,
            dtype: DataType::UINT8.to_raw(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        // SAFETY: the caller's promise.
        unsafe { self.describe_into(handle, &mut t) }.then_some(t)
    }

    /// [`Describer::describe`] written into `out` field by field (no copy of the whole struct
    /// through a return value); `false` where `describe` gives `None` (then `out` holds no
    /// description).
    ///
    /// # Safety
    ///
    /// As for [`Describer::describe`].
    #[inline]
    pub unsafe fn describe_into(&self, handle: AtenTensorHandle, out: &mut DLTensor) -> bool {
        let mut code = 0i32;
        let mut device = 0i32;
        let mut layout = 0i32;
        let mut ndim = 0i64;
        // SAFETY: the caller's promise; each accessor writes one value of its type (and catches
        // its own C++ exceptions); the cheap reads first, so a tensor not described here is
        // refused before any accessor that may fail on it.
        unsafe {
            if (self.device_type)(handle, &mut device) != 0 || device != self.cpu {
                return false;
            }
            if (self.layout)(handle, &mut layout) != 0 || layout != self.strided {
                return false;
            }
            if (self.dtype)(handle, &mut code) != 0 {
                return false;
            }
            let Some(dtype) = usize::try_from(code).ok().and_then(|i| self.dtypes.get(i).copied().flatten())
            else {
                return false;
            };
            if (self.dim)(handle, &mut ndim) != 0 {
                return false;
            }
            let Some(ndim) = i32::try_from(ndim).ok().filter(|&n| (0..=crate::MAX_NDIM as i32).contains(&n))
            else {
                return false;
            };
            out.shape = std::ptr::null_mut();
            out.strides = std::ptr::null_mut();
            if ndim > 0
                && ((self.sizes)(handle, &mut out.shape) != 0
                    || (self.strides)(handle, &mut out.strides) != 0
                    || out.shape.is_null()
                    || out.strides.is_null())
            {
                return false;
            }
            if (self.data_ptr)(handle, &mut out.data) != 0 {
                return false;
            }
            out.device = Device::CPU.to_raw();
            out.ndim = ndim;
            out.dtype = dtype.to_raw();
            out.byte_offset = 0;
            true
        }
    }
}
