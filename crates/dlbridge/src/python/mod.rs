//! The Python layer (feature `python`, PyO3): `dlbridge.from_dlpack`, `dlbridge.Tensor`, the
//! vocabulary types, and the capsule protocol. It is a layer over the core, never the other way
//! round: everything it knows about tensors comes from [`crate::ManagedTensor`].
//!
//! For a downstream PyO3 extension, [`ManagedTensor`](crate::ManagedTensor) is both an argument
//! type (it imports any DLPack producer) and a return type (it becomes a `dlbridge.Tensor`):
//!
//! ```no_run
//! use dlbridge::ManagedTensor;
//! use pyo3::prelude::*;
//!
//! /// Doubles every float32 of a host tensor from any library, in place.
//! #[pyfunction]
//! fn double(mut t: ManagedTensor) -> PyResult<ManagedTensor> {
//!     for x in t.as_slice_mut::<f32>()?.iter_mut() {
//!         *x *= 2.0;
//!     }
//!     Ok(t)
//! }
//! ```

mod export;
mod import;
mod kernels;
mod processes;
mod runtime;
#[cfg(feature = "test-hooks")]
mod test_hooks;

use pyo3::prelude::*;

pub use export::{Framework, Output};
pub use import::{
    AnyTensor, EXCHANGE_API_CAPSULE, ExchangeApi, ImportOptions, TENSOR_EXCHANGE_API, asdlpack_with,
    from_dlpack_with,
};
#[cfg(all(feature = "torch-stable", unix))]
pub use kernels::install_torch_version_hooks;
pub use kernels::{
    AttrValue, Attrs, HostSpec, KernelDef, ParamShape, ParamShapeFn, ResultDType, ResultDef, ResultShape,
    ShapeFn, TensorList, TensorMut, TensorRef, TensorView, add_kernel, xla_capsule,
};
pub use runtime::{
    DLTENSOR, DLTENSOR_VERSIONED, PyDType, PyDevice, PyOwner, Tensor, USED_DLTENSOR, USED_DLTENSOR_VERSIONED,
    argument_error, consume, device_type_enum, device_type_member, is_capsule,
};

use crate::dtype::DataType;

/// Extracts an optional keyword value as `T`; a wrong type is a TypeError naming the argument.
fn keyword<'py, T: for<'a> FromPyObject<'a, 'py>>(
    fname: &str,
    name: &str,
    v: Option<Borrowed<'_, 'py, PyAny>>,
) -> PyResult<Option<T>> {
    match v.filter(|v| !v.is_none()) {
        None => Ok(None),
        Some(v) => v.extract::<T>().map(Some).map_err(|e| {
            let e: PyErr = e.into();
            pyo3::exceptions::PyTypeError::new_err(format!(
                "{fname}(): argument '{name}': {}",
                e.value(v.py())
            ))
        }),
    }
}

/// `dlbridge.from_dlpack`: imports any DLPack producer (an object with `__dlpack__`, a bare
/// capsule, or a `dlbridge.Tensor`) as a `dlbridge.Tensor`, without copying unless `copy=True`.
/// (Fastcall, see `fastcall.rs`: this is the entry point of every Python-level import.)
static FROM_DLPACK_DEF: runtime::fastcall::StaticDef = runtime::fastcall::StaticDef::new(
    c"from_dlpack",
    from_dlpack_fastcall,
    c"from_dlpack(x, /, *, device=None, copy=None, stream=None, legacy_writable=False)\n--\n\nImports any DLPack producer as a `dlbridge.Tensor`, without copying unless asked.\n\nArguments:\n  x: an object with `__dlpack__` (numpy, torch, jax, tensorflow, pyarrow, cupy, array-api\n    libraries, a `dlbridge.Tensor`) or a bare DLPack capsule (\"dltensor\" or\n    \"dltensor_versioned\"), which is consumed. For bytes, memoryviews, mmaps or objects with\n    `__array_interface__` / `__cuda_array_interface__`, use `asdlpack`.\n  device: the device the result must be on: \"cpu\", \"cuda:1\", a `dlbridge.Device` or a\n    `(DeviceType, id)` tuple. Passed to the producer as `dl_device`; dlbridge itself never\n    moves data between devices. None: wherever the producer's tensor is.\n  copy: True: always a new, writable copy; False: never a copy (BufferError if the producer\n    needs one); None: whatever the producer does (usually no copy).\n  stream: passed to the producer's `__dlpack__(stream=...)` as given (device producers only:\n    the producer makes that stream wait for its work). None: no stream.\n  legacy_writable: treat tensors from legacy (pre-1.0) capsules, which cannot say whether\n    writing is allowed, as writable. Default False: they are read-only.\n\nReturns:\n  A `dlbridge.Tensor` over the producer's memory (the same memory unless copied), accepted by\n  every DLPack consumer as often as asked.\n\nRaises:\n  TypeError: `x` is not an array (no `__dlpack__`, not a DLPack capsule), or an argument has\n    the wrong type.\n  BufferError: the tensor cannot be imported: the producer refused the export (its exception\n    is the `__cause__`), an invalid or unsupported tensor (the message names the field), a\n    torch tensor that requires grad or is lazily conjugated or negated, the wrong device, or a\n    copy needed with `copy=False`.\n  ValueError: a capsule that was already consumed, or a malformed device name.",
);

unsafe extern "C" fn from_dlpack_fastcall(
    _module: *mut pyo3::ffi::PyObject,
    args: *const *mut pyo3::ffi::PyObject,
    nargs: pyo3::ffi::Py_ssize_t,
    kwnames: *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject {
    // SAFETY: CPython calls a function with the GIL held.
    let py = unsafe { Python::assume_attached() };
    runtime::fastcall::run(py, || {
        let names = [
            pyo3::intern!(py, "device"),
            pyo3::intern!(py, "copy"),
            pyo3::intern!(py, "stream"),
            pyo3::intern!(py, "legacy_writable"),
        ];
        // SAFETY: CPython's fastcall arguments, alive for the call.
        let ([x], [device, copy, stream, legacy]) =
            unsafe { runtime::fastcall::parse::<1, 4>(py, "from_dlpack", args, nargs, kwnames, names) }?;
        let opts = if device.is_none() && copy.is_none() && stream.is_none() && legacy.is_none() {
            ImportOptions::default()
        } else {
            let copy = keyword::<bool>("from_dlpack", "copy", copy)?;
            let legacy = keyword::<bool>("from_dlpack", "legacy_writable", legacy)?.unwrap_or(false);
            let stream = stream.filter(|s| !s.is_none()).map(|s| s.to_owned());
            import::options(device.as_deref().filter(|d| !d.is_none()), copy, stream, legacy)?
        };
        Ok(Bound::new(py, Tensor::new(from_dlpack_with(&x, &opts)?))?.into_any())
    })
}

/// `dlbridge.asdlpack`: wraps any object that speaks an array protocol (DLPack, the buffer
/// protocol, `__array_interface__`, `__cuda_array_interface__`) as a `dlbridge.Tensor`, without
/// copying. `device_id` names the CUDA device of a CUDA-array-interface pointer when no driver can
/// tell. (Fastcall, see `fastcall.rs`.)
static ASDLPACK_DEF: runtime::fastcall::StaticDef = runtime::fastcall::StaticDef::new(
    c"asdlpack",
    asdlpack_fastcall,
    c"asdlpack(obj, /, *, device_id=None)\n--\n\nWraps any object that speaks an array protocol as a `dlbridge.Tensor`, without copying.\n\nArguments:\n  obj: a DLPack producer (imported as `from_dlpack(obj)` would), a buffer-protocol exporter\n    (bytes, bytearray, array.array, memoryview, mmap, ...), or an object with\n    `__array_interface__` (v3) or `__cuda_array_interface__` (v2/v3). The object is kept\n    alive, and its buffer held, as long as the tensor lives.\n  device_id: the CUDA device ordinal of a `__cuda_array_interface__` pointer, for when the\n    CUDA driver is not there to tell. None: asked of the driver.\n\nReturns:\n  A `dlbridge.Tensor` over the object's memory (read-only where the object is), accepted by\n  every DLPack consumer as often as asked. A consumer that passes a stream is made to wait on\n  the producer's `stream` (`__cuda_array_interface__` v3).\n\nRaises:\n  TypeError: `obj` speaks no array protocol, or an argument or an interface field has the\n    wrong type.\n  BufferError: the memory cannot be described as a tensor (a buffer format or typestr with no\n    DLPack dtype, a layout DLPack cannot express, an invalid interface dictionary), or a DLPack\n    producer's refusal.\n  ValueError: an interface dictionary with a field missing or out of range.",
);

unsafe extern "C" fn asdlpack_fastcall(
    _module: *mut pyo3::ffi::PyObject,
    args: *const *mut pyo3::ffi::PyObject,
    nargs: pyo3::ffi::Py_ssize_t,
    kwnames: *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject {
    // SAFETY: CPython calls a function with the GIL held.
    let py = unsafe { Python::assume_attached() };
    runtime::fastcall::run(py, || {
        // SAFETY: CPython's fastcall arguments, alive for the call.
        let ([obj], [device_id]) = unsafe {
            runtime::fastcall::parse::<1, 1>(
                py,
                "asdlpack",
                args,
                nargs,
                kwnames,
                [pyo3::intern!(py, "device_id")],
            )
        }?;
        let device_id = keyword::<i32>("asdlpack", "device_id", device_id)?;
        let any = asdlpack_with(&obj, device_id)?;
        Ok(Bound::new(py, Tensor::with_producer_stream(any.tensor, any.producer_stream))?.into_any())
    })
}

/// Adds dlbridge's classes, functions and constants to a Python module (the `dlbridge._dlbridge`
/// extension calls this; a downstream extension may too).
pub fn init_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Tensor>()?;
    m.add_class::<PyDType>()?;
    m.add_class::<PyDevice>()?;
    m.add("DeviceType", device_type_enum(py)?)?;
    m.add("from_dlpack", FROM_DLPACK_DEF.function(m)?)?;
    m.add("asdlpack", ASDLPACK_DEF.function(m)?)?;
    #[cfg(target_os = "linux")]
    processes::add(m)?;
    #[cfg(feature = "test-hooks")]
    test_hooks::add(m)?;
    runtime::join_process(py);
    m.add("__dlpack_version__", (crate::ffi::DLPACK_MAJOR_VERSION, crate::ffi::DLPACK_MINOR_VERSION))?;
    for t in DataType::ALL {
        m.add(t.to_string().as_str(), PyDType(t))?;
    }
    Ok(())
}
