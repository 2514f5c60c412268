//! Benchmark shim: the operations the Python benchmark times, done with the `pyo3-dlpack` crate
//! (0.3, on pyo3 0.28) through its public API only. It mirrors bench/shim-dlbridge and
//! bench/shim-dlpark.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use pyo3::prelude::*;
use pyo3::types::PyCapsule;
use pyo3_dlpack::{cpu_device, dtype_f32, IntoDLPack, PyTensor, TensorInfo};

/// The floor: a trivial function taking one object.
#[pyfunction]
fn noop(_x: &Bound<'_, PyAny>) -> usize {
    0
}

/// Owned import of any `__dlpack__` producer (`PyTensor::from_pyany`: calls
/// `__dlpack__(max_version=(1, x))`, consumes the capsule), read the data pointer (byte offset
/// applied), drop (the producer's deleter runs here, inside the call).
#[pyfunction]
fn import_ptr(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<usize> {
    let t = PyTensor::from_pyany(py, x)?;
    Ok(t.data_ptr() as usize)
}

/// Owned import of a bare DLPack capsule (`PyTensor::from_capsule`; legacy or versioned), read
/// the data pointer, drop.
#[pyfunction]
fn import_capsule_ptr(capsule: &Bound<'_, PyCapsule>) -> PyResult<usize> {
    let t = PyTensor::from_capsule(capsule)?;
    Ok(t.data_ptr() as usize)
}

/// A Rust-owned float32 vector of shape `[len]` on the CPU.
struct FreshVec(Vec<f32>);

impl IntoDLPack for FreshVec {
    fn tensor_info(&self) -> TensorInfo {
        TensorInfo::contiguous(
            self.0.as_ptr() as *mut c_void,
            cpu_device(),
            dtype_f32(),
            vec![self.0.len() as i64],
        )
    }
}

/// A shared float32 buffer of shape `[len]` on the CPU; the capsule keeps the `Arc` alive.
struct SharedVec(Arc<Vec<f32>>);

impl IntoDLPack for SharedVec {
    fn tensor_info(&self) -> TensorInfo {
        TensorInfo::contiguous(
            self.0.as_ptr() as *mut c_void,
            cpu_device(),
            dtype_f32(),
            vec![self.0.len() as i64],
        )
    }
}

/// A fresh `vec![0f32; n]` exported with `IntoDLPack::into_dlpack`: a legacy (`dltensor`),
/// writable capsule, the crate's default export.
#[pyfunction]
fn export_fresh(py: Python<'_>, n: usize) -> PyResult<Py<PyAny>> {
    FreshVec(vec![0f32; n]).into_dlpack(py)
}

static SHARED: OnceLock<Mutex<HashMap<usize, Arc<Vec<f32>>>>> = OnceLock::new();

/// A shared Rust buffer of `n` float32 zeros (made once per size) exported again with
/// `into_dlpack` (legacy capsule): the timed export allocates no data.
#[pyfunction]
fn export_shared(py: Python<'_>, n: usize) -> PyResult<Py<PyAny>> {
    let data = {
        let mut cache = SHARED
            .get_or_init(Default::default)
            .lock()
            .expect("not poisoned");
        Arc::clone(cache.entry(n).or_insert_with(|| Arc::new(vec![0f32; n])))
    };
    SharedVec(data).into_dlpack(py)
}

/// The shim module.
#[pymodule]
fn shim_pyo3_dlpack(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(noop, m)?)?;
    m.add_function(wrap_pyfunction!(import_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(import_capsule_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(export_fresh, m)?)?;
    m.add_function(wrap_pyfunction!(export_shared, m)?)?;
    Ok(())
}
