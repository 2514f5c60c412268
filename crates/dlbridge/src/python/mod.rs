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

/// Imports any DLPack producer (an object with `__dlpack__`, a bare capsule, or a
/// `dlbridge.Tensor`) as a `dlbridge.Tensor`, without copying unless `copy=True`.
#[pyfunction]
#[pyo3(signature = (x, /, *, device=None, copy=None, stream=None, legacy_writable=false))]
fn from_dlpack<'py>(
    x: &Bound<'py, PyAny>,
    device: Option<&Bound<'py, PyAny>>,
    copy: Option<bool>,
    stream: Option<Bound<'py, PyAny>>,
    legacy_writable: bool,
) -> PyResult<Tensor> {
    let opts = import::options(device, copy, stream, legacy_writable)?;
    Ok(Tensor::new(from_dlpack_with(x, &opts)?))
}

/// Wraps any object that speaks an array protocol (DLPack, the buffer protocol,
/// `__array_interface__`, `__cuda_array_interface__`) as a `dlbridge.Tensor`, without copying.
/// `device_id` names the CUDA device of a CUDA-array-interface pointer when no driver can tell.
#[pyfunction]
#[pyo3(signature = (obj, /, *, device_id=None))]
fn asdlpack(obj: &Bound<'_, PyAny>, device_id: Option<i32>) -> PyResult<Tensor> {
    let any = asdlpack_with(obj, device_id)?;
    Ok(Tensor::with_producer_stream(any.tensor, any.producer_stream))
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
    m.add_function(wrap_pyfunction!(from_dlpack, m)?)?;
    m.add_function(wrap_pyfunction!(asdlpack, m)?)?;
    m.add_function(wrap_pyfunction!(_drop_on_native_thread, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_driver_available, m)?)?;
    m.add_function(wrap_pyfunction!(_numpy_fast_path, m)?)?;
    m.add_function(wrap_pyfunction!(_view, m)?)?;
    m.add_function(wrap_pyfunction!(_view_then, m)?)?;
    m.add_class::<HostileBuffer>()?;
    m.add("__dlpack_version__", (crate::ffi::DLPACK_MAJOR_VERSION, crate::ffi::DLPACK_MINOR_VERSION))?;
    for t in DataType::ALL {
        m.add(t.to_string().as_str(), PyDType(t))?;
    }
    Ok(())
}
