//! DLPack negotiation: the `__dlpack__` method's path of an import (the order of the paths is
//! [`super::dispatch`]'s). The producer is asked for `max_version=(1, 3)` with `stream`,
//! `dl_device` and `copy` forwarded when given; only a producer that rejects those keywords (a
//! `TypeError` about keyword arguments) is called again the legacy way, and then dlbridge itself
//! does what the producer could not (copy host memory; check the device).

use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use super::cache::{self, TypeInfo};
use crate::device::{Device, DeviceType};
use crate::managed::ManagedTensor;
use crate::python::runtime::consume;
use crate::python::runtime::extract_device;

/// How to import: the keyword arguments of `dlbridge.from_dlpack`.
#[derive(Default, Clone)]
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

/// Whether an error from `__dlpack__(copy=True)` may mean "this producer cannot copy" (tensorflow
/// raises RuntimeError): an ordinary exception, not an interrupt, an exit or a MemoryError.
fn cannot_copy(py: Python<'_>, e: &PyErr) -> bool {
    e.is_instance_of::<pyo3::exceptions::PyException>(py)
        && !e.is_instance_of::<pyo3::exceptions::PyMemoryError>(py)
}

/// The error contract: whatever a producer raises when it refuses an export reaches the caller as
/// a `BufferError` whose `__cause__` is the producer's exception (a `BufferError` of the producer's
/// own passes as it is). Interrupts, exits and `MemoryError` pass untouched: they are not refusals.
fn refused(obj: &Bound<'_, PyAny>, method: &str, e: PyErr) -> PyErr {
    let py = obj.py();
    if e.is_instance_of::<PyBufferError>(py)
        || !e.is_instance_of::<pyo3::exceptions::PyException>(py)
        || e.is_instance_of::<pyo3::exceptions::PyMemoryError>(py)
    {
        return e;
    }
    let kind = e.get_type(py).qualname().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
    let err = if is_jax_tracer(obj) {
        // Not the producer's fault: a traced value has no memory to export. Say what to change.
        let first = e.value(py).to_string();
        let first = first.lines().next().unwrap_or_default().to_owned();
        PyBufferError::new_err(format!(
            "got a jax tracer (a value inside jax.jit, vmap or grad, which has no memory yet): a \
             Rust function cannot read it there; register the function as a kernel to use it inside \
             jax.jit (dlbridge::python::add_kernel with an XLA FFI handler, or \
             dlbridge.kernels.kernel(fn, ffi=...)), or call it outside the traced function \
             ({}.{method}() raised {kind}: {first})",
            type_name(obj)
        ))
    } else {
        PyBufferError::new_err(format!(
            "{}.{method}() refused the export ({kind}: {})",
            type_name(obj),
            e.value(py)
        ))
    };
    err.set_cause(py, Some(e));
    err
}

/// Whether `obj` is a jax tracer (jax imported, and `obj` an instance of `jax.core.Tracer`).
/// Asked only once an export failed.
fn is_jax_tracer(obj: &Bound<'_, PyAny>) -> bool {
    let py = obj.py();
    let tracer = || -> PyResult<bool> {
        let Some(jax) = py.import("sys")?.getattr("modules")?.get_item("jax").ok() else {
            return Ok(false);
        };
        obj.is_instance(&jax.getattr("core")?.getattr("Tracer")?)
    };
    tracer().unwrap_or(false)
}

/// Reads `__dlpack_device__()`'s `(type, id)` result.
fn producer_device(obj: &Bound<'_, PyAny>) -> PyResult<Option<Device>> {
    let py = obj.py();
    // A property or __getattr__ may refuse already when the method is looked up.
    let found = obj
        .getattr_opt(intern!(py, "__dlpack_device__"))
        .map_err(|e| refused(obj, "__dlpack_device__", e))?;
    let Some(f) = found else { return Ok(None) };
    let r = f.call0().map_err(|e| refused(obj, "__dlpack_device__", e))?;
    let (t, id) = r.extract::<(i32, i32)>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{}.__dlpack_device__() returned {}, expected a (device_type, device_id) tuple of ints",
            type_name(obj),
            r.repr().map(|s| s.to_string()).unwrap_or_default()
        ))
    })?;
    Ok(Some(Device::new(DeviceType(t), id)))
}

/// The `__dlpack__` method's path of [`from_dlpack_with`](super::from_dlpack_with): the device
/// announced, the call with the options (or the legacy call), the capsule consumed and checked.
/// Returns the tensor and whether a copy asked for is still dlbridge's to make.
pub(super) fn from_method<'py>(
    obj: &Bound<'py, PyAny>,
    opts: &ImportOptions<'py>,
    ty: &Bound<'py, PyType>,
    info: TypeInfo,
) -> PyResult<(ManagedTensor, bool)> {
    let py = obj.py();
    // Asked first, as the standard says (it is how a consumer picks a stream), and checked against
    // the capsule below. The hot producers (numpy, torch) never reach this path.
    let announced = producer_device(obj)?;
    // torch's own __dlpack__ exports a lazily negated tensor as if its memory held the result
    // (a copy resolves it): refused here as on the table path.
    if let Some(state) = info.torch {
        if opts.copy != Some(true) {
            super::exchange::refuse_negative_bit(obj, state)?;
        }
    }
    // The standard: a consumer passes `stream` only for device memory (numpy refuses any other).
    let host_opts;
    let call_opts = match (&opts.stream, announced) {
        (Some(s), Some(d)) if d.device_type() == DeviceType::CPU => {
            if s.extract::<i64>().ok() != Some(-1) {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "from_dlpack: stream {} for a cpu tensor; only None or -1 (no synchronisation) apply",
                    s.repr().map(|r| r.to_string()).unwrap_or_default()
                )));
            }
            host_opts = ImportOptions { stream: None, ..opts.clone() };
            &host_opts
        }
        _ => opts,
    };
    // `self_copy`: the producer was called without `copy`, so a copy asked for is dlbridge's to make.
    let legacy = |e| refused(obj, "__dlpack__", e);
    let (capsule, self_copy) = if info.legacy {
        (call_legacy(obj, call_opts).map_err(legacy)?, true)
    } else {
        match call_dlpack(obj, call_opts) {
            Ok(c) => (c, false),
            Err(e) if rejects_keywords(py, &e) => {
                cache::mark_legacy(ty);
                (call_legacy(obj, call_opts).map_err(legacy)?, true)
            }
            // A producer that cannot copy (tensorflow raises RuntimeError): dlbridge copies, from
            // the producer's own export; if that fails too, the producer's first word stands.
            Err(e) if opts.copy == Some(true) && cannot_copy(py, &e) => {
                match call_dlpack(obj, &ImportOptions { copy: None, ..call_opts.clone() }) {
                    Ok(c) => (c, true),
                    Err(_) => return Err(refused(obj, "__dlpack__", e)),
                }
            }
            Err(e) => return Err(refused(obj, "__dlpack__", e)),
        }
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
    Ok((mt, self_copy))
}

/// Interned keyword names, made once: `("max_version",)` for the common call.
static KW_MAX_VERSION: PyOnceLock<Py<PyTuple>> = PyOnceLock::new();

/// `obj.__dlpack__(max_version=(1, 3), [stream=], [dl_device=], [copy=])` by vectorcall.
fn call_dlpack<'py>(obj: &Bound<'py, PyAny>, opts: &ImportOptions<'py>) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let plain = opts.stream.is_none() && opts.device.is_none() && opts.copy.is_none();
    let mv = max_version(py)?;
    let mut extra: Vec<Bound<'py, PyAny>> = Vec::new();
    let kwnames = if plain {
        KW_MAX_VERSION
            .get_or_try_init(py, || PyTuple::new(py, [intern!(py, "max_version")]).map(Bound::unbind))?
            .bind(py)
            .clone()
    } else {
        let mut names = vec![intern!(py, "max_version").clone()];
        if let Some(s) = &opts.stream {
            names.push(intern!(py, "stream").clone());
            extra.push(s.clone());
        }
        if let Some(d) = opts.device {
            names.push(intern!(py, "dl_device").clone());
            extra.push((d.device_type().0, d.id()).into_pyobject(py)?.into_any());
        }
        if let Some(c) = opts.copy {
            names.push(intern!(py, "copy").clone());
            extra.push(pyo3::types::PyBool::new(py, c).to_owned().into_any());
        }
        PyTuple::new(py, names)?
    };
    // self, max_version, then at most three more keyword values: no allocation per call.
    let mut args = [std::ptr::null_mut::<pyo3::ffi::PyObject>(); 5];
    args[0] = obj.as_ptr();
    args[1] = mv.as_ptr();
    for (slot, e) in args[2..].iter_mut().zip(&extra) {
        *slot = e.as_ptr();
    }
    // SAFETY: `args` holds self then one value per keyword name, all borrowed and alive for the
    // call; nargsf counts self only; the result is a new reference or NULL with an exception.
    unsafe {
        let r = pyo3::ffi::PyObject_VectorcallMethod(
            intern!(py, "__dlpack__").as_ptr(),
            args.as_ptr(),
            1,
            kwnames.as_ptr(),
        );
        Bound::from_owned_ptr_or_err(py, r)
    }
}

/// The pre-2023 call: `obj.__dlpack__()` or `obj.__dlpack__(stream=...)`.
fn call_legacy<'py>(obj: &Bound<'py, PyAny>, opts: &ImportOptions<'py>) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let method = obj.getattr(intern!(py, "__dlpack__"))?;
    match &opts.stream {
        Some(s) => {
            let kw = PyDict::new(py);
            kw.set_item(intern!(py, "stream"), s)?;
            method.call((), Some(&kw))
        }
        None => method.call0(),
    }
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
