//! From a Python object to a [`ManagedTensor`]: which protocol the object speaks, decided here
//! once, and the object handed to the file that speaks it, which returns the tensor. Nothing below
//! calls back here.
//!
//! [`from_dlpack_with`], in order: a numpy array read through its struct ([`super::numpy`]), a
//! `dlbridge.Tensor` (shared, no Python call), a bare capsule of either name ([`consume`], in the
//! runtime's `capsule.rs`), the type's C exchange table ([`super::exchange`]), then the
//! `__dlpack__` method ([`super::dlpack`]). [`asdlpack_with`] takes every DLPack producer that way,
//! then the buffer protocol, `__array_interface__` and `__cuda_array_interface__`
//! ([`super::protocols`]).

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;

use super::cache;
use super::dlpack::{self, ImportOptions};
use super::protocols::{
    AnyTensor, from_array_interface, from_buffer, from_cuda_array_interface, not_an_array,
};
use crate::device::Device;
use crate::flags::Flags;
use crate::managed::ManagedTensor;
use crate::python::runtime::Tensor;
use crate::python::runtime::{consume, is_capsule};

/// Imports any DLPack producer (or bare capsule) with the given options.
pub fn from_dlpack_with<'py>(obj: &Bound<'py, PyAny>, opts: &ImportOptions<'py>) -> PyResult<ManagedTensor> {
    let py = obj.py();
    crate::python::runtime::enter(py);
    let plain =
        opts.stream.is_none() && opts.copy != Some(true) && opts.device.is_none_or(|d| d == Device::CPU);
    if plain {
        if let Some(p) = super::numpy::parts_exact(obj) {
            if let Some(t) = super::numpy::from_numpy(obj, p)? {
                return finish(t, opts, false);
            }
        }
    }
    if let Ok(t) = obj.cast_exact::<Tensor>() {
        let shared = t.get().shared();
        // SAFETY: a fresh struct sharing the Tensor's data, owned here.
        let mt = unsafe { ManagedTensor::from_raw_versioned(shared.export_versioned().as_ptr()) }?;
        return finish(mt, opts, true);
    }
    if is_capsule(obj) {
        let mt = consume(obj, &|| "from_dlpack".to_owned())?;
        return finish(mt, opts, true);
    }
    let ty = obj.get_type();
    let info = cache::type_info(&ty)?;
    if plain && info.numpy {
        if let Some(t) =
            super::numpy::parts(obj).map(|p| super::numpy::from_numpy(obj, p)).transpose()?.flatten()
        {
            return finish(t, opts, false);
        }
    }
    // The C exchange API: no Python call at all. Its export does not synchronise streams, which the
    // standard allows only where there is nothing to synchronise: host memory, no stream asked.
    if let Some(api) = info.exchange {
        if plain {
            // A failure of the table function itself falls through to the producer's __dlpack__,
            // whose refusal is the producer's documented one (a BufferError for torch).
            if let Ok(mt) = api.managed_tensor_or_table_error(obj)? {
                if mt.device() == Device::CPU {
                    return finish(mt, opts, false);
                }
                // Device memory: take the protocol path, which handles streams.
            }
        }
    }
    if !info.dlpack && !obj.hasattr(intern!(py, "__dlpack__"))? {
        return Err(not_an_array(obj, "__dlpack__ or a DLPack capsule"));
    }
    let (mt, self_copy) = dlpack::from_method(obj, opts, &ty, info)?;
    finish(mt, opts, self_copy)
}

/// Imports any object that speaks DLPack, the buffer protocol, `__array_interface__` or
/// `__cuda_array_interface__`. `device_id` names the CUDA device of a CUDA-array-interface pointer
/// when no CUDA driver can tell.
pub fn asdlpack_with(obj: &Bound<'_, PyAny>, device_id: Option<i32>) -> PyResult<AnyTensor> {
    let py = obj.py();
    let plain = |tensor| Ok(AnyTensor { tensor, producer_stream: None });
    // Whether the type defines __dlpack__ comes from the per-type cache (no attribute lookup on
    // the object, which would make a bound method each call).
    if super::numpy::parts_exact(obj).is_some()
        || obj.cast_exact::<Tensor>().is_ok()
        || is_capsule(obj)
        || cache::type_info(&obj.get_type())?.dlpack
    {
        return plain(from_dlpack_with(obj, &ImportOptions::default())?);
    }
    // The DLPack producers above entered through from_dlpack_with; the other protocols here.
    crate::python::runtime::enter(py);
    // SAFETY: a type-slot check on a live object.
    if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } == 1 {
        return plain(from_buffer(obj)?);
    }
    if let Some(ai) = obj.getattr_opt(intern!(py, "__array_interface__"))? {
        return plain(from_array_interface(obj, &ai)?);
    }
    if let Some(cai) = obj.getattr_opt(intern!(py, "__cuda_array_interface__"))? {
        return from_cuda_array_interface(obj, &cai, device_id);
    }
    Err(not_an_array(obj, ""))
}

/// Applies what the producer could not: read-only for legacy tensors, the device check, and a
/// copy when `copy=True` was asked of a producer that did not take the keyword (`self_copy`) or
/// that returned read-only memory (jax's copy comes as a legacy capsule): a copy the caller asked
/// for is writable, always.
#[inline]
fn finish(mt: ManagedTensor, opts: &ImportOptions<'_>, self_copy: bool) -> PyResult<ManagedTensor> {
    let mut mt = if !mt.is_versioned() && !opts.legacy_writable { mt.into_read_only() } else { mt };
    if let Some(want) = opts.device {
        let got = mt.device();
        let alias = want == Device::CPU && got.is_host_accessible();
        if got != want && !alias {
            return Err(PyBufferError::new_err(format!(
                "device: asked for {want}, but the tensor is on {got} and dlbridge does not move data between devices"
            )));
        }
    }
    if opts.copy == Some(true) && (self_copy || mt.is_read_only()) {
        mt = mt.to_contiguous()?.with_flags(Flags::IS_COPIED);
    }
    Ok(mt)
}

impl<'a, 'py> FromPyObject<'a, 'py> for ManagedTensor {
    type Error = PyErr;

    /// Imports any DLPack producer with default options, so `#[pyfunction] fn f(t: ManagedTensor)`
    /// takes numpy arrays, torch tensors, jax arrays, capsules and `dlbridge.Tensor`s.
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        from_dlpack_with(&obj.to_owned(), &ImportOptions::default())
    }
}
