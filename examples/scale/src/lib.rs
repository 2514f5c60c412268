//! An example PyO3 extension built on dlbridge: functions that take tensors from any library
//! (numpy, torch, jax, tensorflow, ...) without copying, and hand Rust-made data back.

use dlbridge::python::TensorView;
use dlbridge::{AlignedBuffer, ManagedTensor};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Multiplies every element of a tensor from any library by `factor`, in place, whatever its
/// strides. Supports float32, float64, int32 and int64 host tensors.
#[pyfunction]
fn scale(mut t: ManagedTensor, factor: f64) -> PyResult<()> {
    match t.dtype().to_string().as_str() {
        "float32" => t.as_array_mut::<f32>()?.mapv_inplace(|x| x * factor as f32),
        "float64" => t.as_array_mut::<f64>()?.mapv_inplace(|x| x * factor),
        "int32" => t.as_array_mut::<i32>()?.mapv_inplace(|x| (x as f64 * factor) as i32),
        "int64" => t.as_array_mut::<i64>()?.mapv_inplace(|x| (x as f64 * factor) as i64),
        other => return Err(PyTypeError::new_err(format!("scale: unsupported dtype {other}"))),
    }
    Ok(())
}

/// Multiplies every float32 of a tensor from numpy, torch, jax, ... by `factor`, in place.
#[pyfunction]
fn scale_f32(mut t: ManagedTensor, factor: f32) -> PyResult<()> {
    t.as_array_mut::<f32>()?.mapv_inplace(|x| x * factor); // any strides; refuses read-only
    Ok(())
}

/// What Rust sees of a tensor from any library: data pointer, shape, strides, dtype, device.
#[pyfunction]
fn describe<'py>(py: Python<'py>, t: ManagedTensor) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("data_ptr", t.data_ptr() as usize)?;
    d.set_item("shape", t.shape().to_vec())?;
    d.set_item("strides", t.strides().to_vec())?;
    d.set_item("dtype", t.dtype().to_string())?;
    d.set_item("device", t.device().to_string())?;
    d.set_item("readonly", t.is_read_only())?;
    d.set_item("versioned", t.is_versioned())?;
    Ok(d)
}

/// The sum of a float32 or float64 host tensor of any strides, computed in Rust on the shared memory.
#[pyfunction]
fn total(t: ManagedTensor) -> PyResult<f64> {
    Ok(match t.dtype().to_string().as_str() {
        "float32" => t.as_array::<f32>()?.iter().map(|&x| f64::from(x)).sum(),
        "float64" => t.as_array::<f64>()?.sum(),
        other => return Err(PyTypeError::new_err(format!("total: unsupported dtype {other}"))),
    })
}

/// A Rust-made float32 buffer of `0, 1, ..., n-1` (256-byte aligned), handed to Python as a
/// `dlbridge.Tensor` that numpy, torch and jax take without copying.
#[pyfunction]
fn arange(n: usize) -> PyResult<ManagedTensor> {
    let mut buf = AlignedBuffer::<f32>::zeroed(n);
    for (i, x) in buf.iter_mut().enumerate() {
        *x = i as f32;
    }
    Ok(ManagedTensor::from_host(buf, &[n])?)
}

/// Sets every float64 of a borrowed tensor (any strides) to `value`: a view costs no capsule.
/// Refuses read-only memory, layouts whose elements overlap, and memory another view is using.
#[pyfunction]
fn fill(mut t: TensorView<'_>, value: f64) -> PyResult<()> {
    t.as_array_mut::<f64>()?.fill(value);
    Ok(())
}

/// Calls `f()` while holding a shared slice of the float64 tensor `t`, then returns `f`'s result:
/// whatever `f` does, no extension embedding dlbridge can write `t`'s memory meanwhile.
#[pyfunction]
fn while_reading(t: TensorView<'_>, f: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let held = t.as_slice::<f64>()?;
    let out = f.call0()?.unbind();
    drop(held);
    Ok(out)
}

/// The example module (it needs the GIL, as every module embedding dlbridge does).
#[pymodule(gil_used = true)]
fn dlbridge_scale(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(scale, m)?)?;
    m.add_function(wrap_pyfunction!(scale_f32, m)?)?;
    m.add_function(wrap_pyfunction!(describe, m)?)?;
    m.add_function(wrap_pyfunction!(arange, m)?)?;
    m.add_function(wrap_pyfunction!(total, m)?)?;
    m.add_function(wrap_pyfunction!(fill, m)?)?;
    m.add_function(wrap_pyfunction!(while_reading, m)?)?;
    Ok(())
}
