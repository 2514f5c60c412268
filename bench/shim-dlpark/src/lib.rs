//! Benchmark shim: the operations the Python benchmark times, done with the `dlpark` crate (0.10,
//! on pyo3 0.30) through its public API only. It mirrors bench/shim-dlbridge and
//! bench/shim-pyo3-dlpack.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use dlpark::ffi::{DLDataType, DLDevice};
use dlpark::metadata::Fixed;
use dlpark::python::consumer::exchange::ExchangeApi;
use dlpark::python::from_dlpack;
use dlpark::versioned;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// The floor: a trivial function taking one object.
#[pyfunction]
fn noop(_x: &Bound<'_, PyAny>) -> usize {
    0
}

/// Owned import of any Python object with `dlpark::python::from_dlpack(obj, None, None)`, the
/// one-step import: it uses the producer's DLPack C exchange API when its type has one (torch),
/// else `__dlpack_device__` + `__dlpack__(max_version=...)`, else legacy `__dlpack__()`. Then
/// `validate()` (required before reading metadata), read the data pointer (byte offset applied),
/// drop (the producer's deleter runs here, inside the call).
#[pyfunction]
fn import_ptr(x: &Bound<'_, PyAny>) -> PyResult<usize> {
    let t = from_dlpack(x.as_borrowed(), None, None)?;
    let r = t.validate().map_err(value_error)?;
    Ok(r.data_ptr() as usize + r.byte_offset() as usize)
}

/// The same for a bare DLPack capsule: dlpark has no separate public capsule import;
/// `from_dlpack` consumes an existing (legacy or versioned) capsule directly.
#[pyfunction]
fn import_capsule_ptr(capsule: &Bound<'_, PyAny>) -> PyResult<usize> {
    import_ptr(capsule)
}

thread_local! {
    /// The exchange table of the last type seen (a reference to the type with it): looked up
    /// once, as a consumer that keeps its producer's table does.
    static TABLE: std::cell::RefCell<Option<(Py<pyo3::types::PyType>, ExchangeApi)>> =
        const { std::cell::RefCell::new(None) };
}

/// Borrowed view through the producer's C exchange API, what dlpark's public API offers for it
/// (`ExchangeApi::with_tensor_view_no_sync`: the table's `dltensor_from_py_object_no_sync`, then
/// its `current_work_stream` for the tensor's device), with the table looked up once per type
/// (`ExchangeApi::from_object` reads the type's attribute) and nothing checked: the data pointer
/// is read straight from the `DLTensor` torch filled. Objects whose type has no C exchange API
/// (numpy) raise TypeError.
#[pyfunction]
fn view_ptr(x: &Bound<'_, PyAny>) -> PyResult<usize> {
    let ty = x.get_type_ptr();
    TABLE.with_borrow_mut(|cached| {
        if cached.as_ref().is_none_or(|(t, _)| t.as_ptr().cast() != ty) {
            let Some(api) = ExchangeApi::from_object(x.as_borrowed())? else {
                return Err(PyTypeError::new_err(
                    "object has no DLPack C exchange API (__dlpack_c_exchange_api__)",
                ));
            };
            *cached = Some((x.get_type().unbind(), api));
        }
        let (_, api) = cached.as_ref().expect("set above");
        api.with_tensor_view_no_sync(x.as_borrowed(), |t, _stream| t.data as usize + t.byte_offset as usize)
    })
}

/// Export a float32 vector of shape `[len]` on the CPU whose data lives in (or is kept alive by)
/// `ctx`. dlpark's default and recommended ABI is the versioned one: `Fixed::initialize` builds a
/// `DLManagedTensorVersioned` (one allocation holding the header, shape and strides), and the
/// returned `versioned::Dlpack` converts to a `dltensor_versioned` capsule through dlpark's
/// `IntoPyObject` impl (which runs `validate_export`).
fn export<C: dlpark::OpaqueContext>(
    data: *const f32,
    len: usize,
    ctx: C,
) -> PyResult<versioned::Dlpack> {
    let mut init = Fixed::new([len], [1usize])
        .initialize(ctx)
        .map_err(value_error)?;
    init.set_data(data as *mut c_void)
        .set_dtype(DLDataType::F32)
        .set_device(DLDevice::CPU);
    // SAFETY: `data` points to `len` float32 owned by (or kept alive by) `ctx`, which the managed
    // tensor owns until its deleter runs; shape and strides were copied into the allocation.
    Ok(unsafe { init.finish() })
}

/// A fresh `vec![0f32; n]` exported as a versioned capsule owning the vector.
#[pyfunction]
fn export_fresh(n: usize) -> PyResult<versioned::Dlpack> {
    let v = Box::new(vec![0f32; n]);
    export(v.as_ptr(), n, v)
}

static SHARED: OnceLock<Mutex<HashMap<usize, Arc<Vec<f32>>>>> = OnceLock::new();

/// A shared Rust buffer of `n` float32 zeros (made once per size) exported again as a versioned
/// capsule that holds a clone of the `Arc` (an `OpaqueContext`): the timed export allocates no data.
#[pyfunction]
fn export_shared(n: usize) -> PyResult<versioned::Dlpack> {
    let data = {
        let mut cache = SHARED
            .get_or_init(Default::default)
            .lock()
            .expect("not poisoned");
        Arc::clone(cache.entry(n).or_insert_with(|| Arc::new(vec![0f32; n])))
    };
    export(data.as_ptr(), n, data)
}

/// The shim module.
#[pymodule]
fn shim_dlpark(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(noop, m)?)?;
    m.add_function(wrap_pyfunction!(import_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(import_capsule_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(view_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(export_fresh, m)?)?;
    m.add_function(wrap_pyfunction!(export_shared, m)?)?;
    Ok(())
}
