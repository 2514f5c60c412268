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
//!     for x in t.as_slice_mut::<f32>()? {
//!         *x *= 2.0;
//!     }
//!     Ok(t)
//! }
//! ```

mod cache;
mod capsule;
mod exchange;
mod fastcall;
mod import;
mod numpy;
mod protocols;
mod tensor;
mod types;
mod view;

use pyo3::prelude::*;

pub use capsule::{
    DLTENSOR, DLTENSOR_VERSIONED, USED_DLTENSOR, USED_DLTENSOR_VERSIONED, consume, is_capsule,
};
pub use exchange::{EXCHANGE_API_CAPSULE, ExchangeApi, TENSOR_EXCHANGE_API};
pub use import::{ImportOptions, from_dlpack_with};
pub use protocols::{AnyTensor, PyOwner, asdlpack_with};
pub use tensor::Tensor;
pub use types::{PyDType, PyDevice, device_type_enum, device_type_member};
pub use view::TensorView;

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
static FROM_DLPACK_DEF: fastcall::StaticDef = fastcall::StaticDef::new(
    c"from_dlpack",
    from_dlpack_fastcall,
    c"from_dlpack(x, /, *, device=None, copy=None, stream=None, legacy_writable=False)\n--\n\nImports any DLPack producer (an object with `__dlpack__`, a bare capsule, or a\n`dlbridge.Tensor`) as a `dlbridge.Tensor`, without copying unless `copy=True`.",
);

unsafe extern "C" fn from_dlpack_fastcall(
    _module: *mut pyo3::ffi::PyObject,
    args: *const *mut pyo3::ffi::PyObject,
    nargs: pyo3::ffi::Py_ssize_t,
    kwnames: *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject {
    // SAFETY: CPython calls a function with the GIL held.
    let py = unsafe { Python::assume_attached() };
    fastcall::run(py, || {
        let names = [
            pyo3::intern!(py, "device"),
            pyo3::intern!(py, "copy"),
            pyo3::intern!(py, "stream"),
            pyo3::intern!(py, "legacy_writable"),
        ];
        // SAFETY: CPython's fastcall arguments, alive for the call.
        let ([x], [device, copy, stream, legacy]) =
            unsafe { fastcall::parse::<1, 4>(py, "from_dlpack", args, nargs, kwnames, names) }?;
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
static ASDLPACK_DEF: fastcall::StaticDef = fastcall::StaticDef::new(
    c"asdlpack",
    asdlpack_fastcall,
    c"asdlpack(obj, /, *, device_id=None)\n--\n\nWraps any object that speaks an array protocol (DLPack, the buffer protocol,\n`__array_interface__`, `__cuda_array_interface__`) as a `dlbridge.Tensor`, without copying.\n`device_id` names the CUDA device of a CUDA-array-interface pointer when no driver can tell.",
);

unsafe extern "C" fn asdlpack_fastcall(
    _module: *mut pyo3::ffi::PyObject,
    args: *const *mut pyo3::ffi::PyObject,
    nargs: pyo3::ffi::Py_ssize_t,
    kwnames: *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject {
    // SAFETY: CPython calls a function with the GIL held.
    let py = unsafe { Python::assume_attached() };
    fastcall::run(py, || {
        // SAFETY: CPython's fastcall arguments, alive for the call.
        let ([obj], [device_id]) = unsafe {
            fastcall::parse::<1, 1>(py, "asdlpack", args, nargs, kwnames, [pyo3::intern!(py, "device_id")])
        }?;
        let device_id = keyword::<i32>("asdlpack", "device_id", device_id)?;
        let any = asdlpack_with(&obj, device_id)?;
        Ok(Bound::new(py, Tensor::with_producer_stream(any.tensor, any.producer_stream))?.into_any())
    })
}

/// Whether a CUDA driver could be loaded in this process (tests use it to pick expectations).
#[pyfunction]
fn _cuda_driver_available() -> bool {
    crate::cuda::Driver::get().is_ok()
}

/// Whether the verified numpy struct fast path is on in this process (tests and benchmarks).
#[pyfunction]
fn _numpy_fast_path() -> bool {
    numpy::fast_path_enabled()
}

/// What the view test hooks return: `(data_ptr, shape, strides, dtype name, readonly)`.
type ViewSeen = (usize, Vec<i64>, Vec<i64>, String, bool);

/// Test hook: what a borrowed [`TensorView`] of `x` sees, as
/// `(data_ptr, shape, strides, dtype name, readonly)`.
#[pyfunction]
fn _view(x: TensorView<'_>) -> ViewSeen {
    (x.data_ptr() as usize, x.shape().to_vec(), x.strides().to_vec(), x.dtype().to_string(), x.is_read_only())
}

/// Test hook: borrows `x` as a [`TensorView`], calls `f()` (Python code that may change `x`'s
/// metadata in place), then returns what the view sees, as [`_view`] does.
#[pyfunction]
fn _view_then(x: TensorView<'_>, f: &Bound<'_, PyAny>) -> PyResult<ViewSeen> {
    f.call0()?;
    Ok(_view(x))
}

/// Test hook: what `x`'s `ManagedTensor` sees through `Deref`, as [`_view`] does, with its
/// description.
#[pyfunction]
fn _view_deref(x: TensorView<'_>) -> (ViewSeen, String) {
    let m: &crate::ManagedTensor = &x;
    let seen = (
        m.data_ptr() as usize,
        m.shape().to_vec(),
        m.strides().to_vec(),
        m.dtype().to_string(),
        m.is_read_only(),
    );
    (seen, m.describe())
}

/// Test hook: adds `delta` to every element of a C-contiguous float64 view in place (through
/// `as_slice_mut`), then returns the sum `as_slice` reads.
#[pyfunction]
fn _view_add(mut x: TensorView<'_>, delta: f64) -> PyResult<f64> {
    x.as_slice_mut::<f64>()?.iter_mut().for_each(|v| *v += delta);
    Ok(x.as_slice::<f64>()?.iter().sum())
}

/// Test hook: imports `x`, then drops the imported tensor on a new native thread that never held
/// the GIL, while this thread has released it. The producer's deleter must cope (take the GIL
/// itself); the test checks it ran.
#[pyfunction]
fn _drop_on_native_thread(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<()> {
    let t = from_dlpack_with(x, &ImportOptions::default())?;
    py.detach(move || std::thread::spawn(move || drop(t)).join())
        .map_err(|_| pyo3::exceptions::PyRuntimeError::new_err("the native thread panicked"))
}

/// Test hook: a buffer exporter that reports whatever metadata it is given (shape, strides,
/// itemsize, format, len), over a small internal buffer, so the hostile-input tests can hand dlbridge
/// inconsistent buffer views no real exporter produces. dlbridge must refuse them before reading.
#[pyclass(name = "_HostileBuffer", module = "dlbridge", frozen)]
struct HostileBuffer {
    data: Vec<u8>,
    shape: Vec<isize>,
    strides: Vec<isize>,
    itemsize: isize,
    format: std::ffi::CString,
    len: isize,
}

#[pymethods]
impl HostileBuffer {
    #[new]
    #[pyo3(signature = (*, shape, strides, itemsize, format, length))]
    fn new(
        shape: Vec<isize>,
        strides: Vec<isize>,
        itemsize: isize,
        format: &str,
        length: isize,
    ) -> PyResult<Self> {
        let format = std::ffi::CString::new(format)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        Ok(Self { data: vec![0; 64], shape, strides, itemsize, format, len: length })
    }

    unsafe fn __getbuffer__(
        slf: PyRef<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        _flags: std::ffi::c_int,
    ) -> PyResult<()> {
        let (buf, shape, strides) = (slf.data.as_ptr(), slf.shape.as_ptr(), slf.strides.as_ptr());
        let (len, itemsize, ndim, format) = (slf.len, slf.itemsize, slf.shape.len(), slf.format.as_ptr());
        // SAFETY: filling the consumer's view; the arrays live as long as this frozen object, which
        // the view references.
        unsafe {
            let v = &mut *view;
            v.obj = slf.into_ptr();
            v.buf = buf.cast_mut().cast();
            v.len = len;
            v.readonly = 1;
            v.itemsize = itemsize;
            v.format = format.cast_mut();
            v.ndim = ndim as std::ffi::c_int;
            v.shape = shape.cast_mut();
            v.strides = strides.cast_mut();
            v.suboffsets = std::ptr::null_mut();
            v.internal = std::ptr::null_mut();
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}
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
    m.add_function(wrap_pyfunction!(_drop_on_native_thread, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_driver_available, m)?)?;
    m.add_function(wrap_pyfunction!(_numpy_fast_path, m)?)?;
    m.add_function(wrap_pyfunction!(_view, m)?)?;
    m.add_function(wrap_pyfunction!(_view_then, m)?)?;
    m.add_function(wrap_pyfunction!(_view_deref, m)?)?;
    m.add_function(wrap_pyfunction!(_view_add, m)?)?;
    m.add_class::<HostileBuffer>()?;
    m.add("__dlpack_version__", (crate::ffi::DLPACK_MAJOR_VERSION, crate::ffi::DLPACK_MINOR_VERSION))?;
    for t in DataType::ALL {
        m.add(t.to_string().as_str(), PyDType(t))?;
    }
    Ok(())
}
