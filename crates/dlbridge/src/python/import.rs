//! From a Python object to a [`ManagedTensor`]: protocol choice and DLPack negotiation.
//!
//! Order: a `dlbridge.Tensor` (shared, no Python call), a bare capsule of either name, then any
//! object with `__dlpack__`. The producer is asked for `max_version=(1, 3)` with `stream`,
//! `dl_device` and `copy` forwarded when given; only a producer that rejects those keywords (a
//! `TypeError` about keyword arguments) is called again the legacy way, and then dlbridge itself
//! does what the producer could not (copy host memory; check the device).

use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};

use super::capsule::{consume, is_capsule};
use super::tensor::Tensor;
use super::types::extract_device;
use crate::device::{Device, DeviceType};
use crate::flags::Flags;
use crate::managed::ManagedTensor;

/// How to import: the keyword arguments of `dlbridge.from_dlpack`.
#[derive(Default)]
pub struct ImportOptions<'py> {
    /// The device the result must be on (`dl_device` for the producer); `None`: the producer's.
    pub device: Option<Device>,
    /// `Some(true)`: always a copy; `Some(false)`: never a copy (BufferError if one is needed);
    /// `None`: whatever the producer does.
    pub copy: Option<bool>,
    /// Forwarded to `__dlpack__(stream=...)` as given.
    pub stream: Option<Bound<'py, PyAny>>,
    /// Treat tensors from legacy capsules as writable. Legacy capsules cannot say whether writing
    /// is allowed, so by default such tensors are read-only (numpy decides the same way).
    pub legacy_writable: bool,
}

static MAX_VERSION: PyOnceLock<Py<PyTuple>> = PyOnceLock::new();

/// `(1, 3)`, made once.
fn max_version(py: Python<'_>) -> PyResult<&Bound<'_, PyTuple>> {
    Ok(MAX_VERSION.get_or_try_init(py, || PyTuple::new(py, [1u32, 3]).map(Bound::unbind))?.bind(py))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().fully_qualified_name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// Whether a TypeError from `__dlpack__(max_version=..., ...)` says the producer does not take
/// those keywords (a pre-2023 producer), as opposed to a TypeError raised inside a new one.
fn rejects_keywords(py: Python<'_>, e: &PyErr) -> bool {
    if !e.is_instance_of::<PyTypeError>(py) {
        return false;
    }
    let msg = e.value(py).to_string();
    msg.contains("takes no keyword arguments")
        || (msg.contains("unexpected keyword argument")
            && ["max_version", "dl_device", "copy", "stream"].iter().any(|k| msg.contains(k)))
}

/// Reads `__dlpack_device__()`'s `(type, id)` result.
fn producer_device(obj: &Bound<'_, PyAny>) -> PyResult<Option<Device>> {
    let py = obj.py();
    let Some(f) = obj.getattr_opt(intern!(py, "__dlpack_device__"))? else { return Ok(None) };
    let r = f.call0()?;
    let (t, id) = r.extract::<(i32, i32)>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{}.__dlpack_device__() returned {}, expected a (device_type, device_id) tuple of ints",
            type_name(obj),
            r.repr().map(|s| s.to_string()).unwrap_or_default()
        ))
    })?;
    Ok(Some(Device::new(DeviceType(t), id)))
}

/// Imports any DLPack producer (or bare capsule) with the given options.
pub fn from_dlpack_with<'py>(obj: &Bound<'py, PyAny>, opts: &ImportOptions<'py>) -> PyResult<ManagedTensor> {
    let py = obj.py();
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
    let Some(method) = obj.getattr_opt(intern!(py, "__dlpack__"))? else {
        return Err(PyTypeError::new_err(format!(
            "from_dlpack: {} does not support DLPack (it has no __dlpack__ method and is not a DLPack capsule)",
            type_name(obj)
        )));
    };
    let announced = producer_device(obj)?;
    let kwargs = PyDict::new(py);
    kwargs.set_item(intern!(py, "max_version"), max_version(py)?)?;
    if let Some(s) = &opts.stream {
        kwargs.set_item(intern!(py, "stream"), s)?;
    }
    if let Some(d) = opts.device {
        kwargs.set_item(intern!(py, "dl_device"), (d.device_type().0, d.id()))?;
    }
    if let Some(c) = opts.copy {
        kwargs.set_item(intern!(py, "copy"), c)?;
    }
    let (capsule, legacy_call) = match method.call((), Some(&kwargs)) {
        Ok(c) => (c, false),
        Err(e) if rejects_keywords(py, &e) => {
            let c = match &opts.stream {
                Some(s) => {
                    let kw = PyDict::new(py);
                    kw.set_item(intern!(py, "stream"), s)?;
                    method.call((), Some(&kw))?
                }
                None => method.call0()?,
            };
            (c, true)
        }
        Err(e) => return Err(e),
    };
    let mt = consume(&capsule, &|| format!("the object returned by {}.__dlpack__()", type_name(obj)))?;
    if let Some(a) = announced {
        let got = mt.device();
        // torch reports pinned memory as cuda_host in __dlpack_device__ but cpu in the capsule:
        // two host-accessible kinds of the same memory are not a disagreement.
        let alias = a.is_host_accessible() && got.is_host_accessible();
        if a != got && !alias && opts.device.is_none() {
            return Err(PyBufferError::new_err(format!(
                "device: {}.__dlpack_device__() says {a} but its capsule holds a tensor on {got}",
                type_name(obj)
            )));
        }
    }
    finish(mt, opts, legacy_call)
}

/// Applies what the producer could not: read-only for legacy tensors, the device check, and a
/// copy when `copy=True` was asked of a producer that did not take the keyword (`self_copy`).
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
    if self_copy && opts.copy == Some(true) {
        mt = mt.to_contiguous()?.with_flags(Flags::IS_COPIED);
    }
    Ok(mt)
}

/// `from_dlpack`'s keyword arguments, read from Python values.
pub fn options<'py>(
    device: Option<&Bound<'py, PyAny>>,
    copy: Option<bool>,
    stream: Option<Bound<'py, PyAny>>,
    legacy_writable: bool,
) -> PyResult<ImportOptions<'py>> {
    Ok(ImportOptions { device: device.map(extract_device).transpose()?, copy, stream, legacy_writable })
}

impl<'a, 'py> FromPyObject<'a, 'py> for ManagedTensor {
    type Error = PyErr;

    /// Imports any DLPack producer with default options, so `#[pyfunction] fn f(t: ManagedTensor)`
    /// takes numpy arrays, torch tensors, jax arrays, capsules and `dlbridge.Tensor`s.
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        from_dlpack_with(&obj.to_owned(), &ImportOptions::default())
    }
}
