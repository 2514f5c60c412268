//! `dlbridge_kernels`: Rust CPU kernels that numpy, torch and jax users call as if they were
//! native. Each function states what it needs of its tensors (typed arguments, checked once at
//! conversion), borrows them without copying, and returns its result as the caller's own kind of
//! array (torch in, `torch.Tensor` out), allocated by the caller's framework where it can.
//! The Python contract of every function is in this crate's README.

use dlbridge::spec::{AnyOrder, C, Cpu, Rank};
use dlbridge::{DataType, TensorMut, TensorRef, TensorView, argument_error};
use half::bf16;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
// The bodies shared with the XLA FFI handlers, and the registration that makes every function
// callable eagerly, inside jax.jit and inside torch.compile (the guide's last chapter).
mod modes;
// rms_norm: two results, a residual, a weight gradient (the guide's chapter on layers).
mod rms_norm;
// reduce, poly, channel_affine: string and array attributes (a result shaped by a rule reading them).
mod reduce;
// center_rows: a handler with scratch memory, a state made once, and XLA's thread pool.
mod context;
// Optional tensors and lists of tensors: scale_shift(x, weight, bias=None), accumulate(x, xs, weights).
mod params;

/// The element types the kernels compute with: each is read and written through `f64`.
/// (A helper of this example, not part of dlbridge.)
trait Real: dlbridge::Element + Copy + Send + Sync {
    /// The value as an `f64`.
    fn get(self) -> f64;
    /// `v` rounded to this type.
    fn put(v: f64) -> Self;
}

impl Real for f32 {
    fn get(self) -> f64 {
        f64::from(self)
    }
    fn put(v: f64) -> Self {
        v as f32
    }
}

impl Real for f64 {
    fn get(self) -> f64 {
        self
    }
    fn put(v: f64) -> Self {
        v
    }
}

impl Real for bf16 {
    fn get(self) -> f64 {
        self.to_f64()
    }
    fn put(v: f64) -> Self {
        bf16::from_f64(v)
    }
}

// --- saxpy_: typed arguments in the signature, in place ---

/// `y += a * x` in place, for float32 vectors of one length; returns `y` itself (the caller's
/// own object). The argument types state the contract: PyO3 converts and checks them before the
/// body runs, and a mismatch is a TypeError naming the argument.
#[pyfunction]
fn saxpy_<'py>(
    py: Python<'py>,
    a: f32,
    x: TensorRef<'_, f32, Rank<1>, C>,
    mut y: TensorMut<'_, f32, Rank<1>, C>,
) -> PyResult<Bound<'py, PyAny>> {
    if x.shape() != y.shape() {
        return Err(PyValueError::new_err(format!(
            "saxpy_: x and y have lengths {} and {}",
            x.shape()[0],
            y.shape()[0]
        )));
    }
    {
        let x = x.as_slice()?;
        let mut y = y.as_slice_mut()?; // refused while x's slice lives if x and y share memory
        modes::saxpy_inplace_body(a, &x, &mut y);
    }
    Ok(y.object(py).to_owned())
}

// --- saxpy: one entry point, the dtype dispatched at run time, a new result ---

/// `a * x + y` for 1-d C-contiguous float32 or float64 vectors of one dtype and length, as a new
/// array of the caller's framework (x's).
#[pyfunction]
fn saxpy<'py>(py: Python<'py>, a: f64, x: TensorView<'_>, y: TensorView<'_>) -> PyResult<Bound<'py, PyAny>> {
    match x.dtype() {
        DataType::FLOAT32 => saxpy_typed::<f32>(py, a, x, y),
        DataType::FLOAT64 => saxpy_typed::<f64>(py, a, x, y),
        other => Err(PyTypeError::new_err(format!("saxpy: x: expected float32 or float64, got {other}"))),
    }
}

fn saxpy_typed<'py, T: Real>(
    py: Python<'py>,
    a: f64,
    x: TensorView<'_>,
    y: TensorView<'_>,
) -> PyResult<Bound<'py, PyAny>> {
    let x = x.typed::<T, Rank<1>, C, Cpu>().map_err(|e| argument_error("x", e))?;
    let y = y.typed::<T, Rank<1>, C, Cpu>().map_err(|e| argument_error("y", e))?;
    if x.shape() != y.shape() {
        return Err(PyValueError::new_err(format!(
            "saxpy: x and y have lengths {} and {}",
            x.shape()[0],
            y.shape()[0]
        )));
    }
    let mut out = x.empty_like::<T>(py)?; // allocated by the caller's framework
    {
        let (xs, ys) = (x.as_slice()?, y.as_slice()?);
        let mut o = out.as_slice_mut()?;
        modes::saxpy_body(a, &xs, &ys, &mut o);
    }
    out.into_object(py)
}

// --- softmax: the GIL released, rows in parallel on rayon's threads ---

/// Row-wise softmax of a 2-d C-contiguous float32, float64 or bfloat16 matrix, as a new array of
/// the caller's framework. The rows are computed in parallel without the GIL.
#[pyfunction]
fn softmax<'py>(py: Python<'py>, x: TensorView<'_>) -> PyResult<Bound<'py, PyAny>> {
    match x.dtype() {
        DataType::FLOAT32 => softmax_typed::<f32>(py, x),
        DataType::FLOAT64 => softmax_typed::<f64>(py, x),
        DataType::BFLOAT16 => softmax_typed::<bf16>(py, x),
        other => Err(PyTypeError::new_err(format!(
            "softmax: x: expected float32, float64 or bfloat16, got {other}"
        ))),
    }
}

fn softmax_typed<'py, T: Real>(py: Python<'py>, x: TensorView<'_>) -> PyResult<Bound<'py, PyAny>> {
    let x = x.typed::<T, Rank<2>, C, Cpu>().map_err(|e| argument_error("x", e))?;
    let cols = x.shape()[1] as usize;
    let mut out = x.empty_like::<T>(py)?;
    {
        // The guards are Send and Sync: take them with the GIL, then let it go.
        let xs = x.as_slice()?;
        let mut os = out.as_slice_mut()?;
        py.detach(|| modes::softmax_body(&xs, &mut os, cols));
    }
    out.into_object(py)
}

// --- layer_norm: any strides, through ndarray ---

/// Layer normalisation over the last axis of a 2-d float32 or float64 matrix of any strides:
/// `(x - mean) / sqrt(var + eps) * weight + bias`, with `weight` and `bias` 1-d of the row length
/// (any strides, x's dtype). A new C-contiguous array of the caller's framework.
#[pyfunction]
#[pyo3(signature = (x, weight, bias, eps = 1e-5))]
fn layer_norm<'py>(
    py: Python<'py>,
    x: TensorView<'_>,
    weight: TensorView<'_>,
    bias: TensorView<'_>,
    eps: f64,
) -> PyResult<Bound<'py, PyAny>> {
    match x.dtype() {
        DataType::FLOAT32 => layer_norm_typed::<f32>(py, x, weight, bias, eps),
        DataType::FLOAT64 => layer_norm_typed::<f64>(py, x, weight, bias, eps),
        other => {
            Err(PyTypeError::new_err(format!("layer_norm: x: expected float32 or float64, got {other}")))
        }
    }
}

fn layer_norm_typed<'py, T: Real>(
    py: Python<'py>,
    x: TensorView<'_>,
    weight: TensorView<'_>,
    bias: TensorView<'_>,
    eps: f64,
) -> PyResult<Bound<'py, PyAny>> {
    let x = x.typed::<T, Rank<2>, AnyOrder, Cpu>().map_err(|e| argument_error("x", e))?;
    let w = weight.typed::<T, Rank<1>, AnyOrder, Cpu>().map_err(|e| argument_error("weight", e))?;
    let b = bias.typed::<T, Rank<1>, AnyOrder, Cpu>().map_err(|e| argument_error("bias", e))?;
    let cols = x.shape()[1];
    if w.shape()[0] != cols || b.shape()[0] != cols {
        return Err(PyValueError::new_err(format!(
            "layer_norm: weight and bias need length {cols} (x's rows), got {} and {}",
            w.shape()[0],
            b.shape()[0]
        )));
    }
    let mut out = x.empty_like::<T>(py)?;
    {
        let (xa, wa, ba) = (x.as_array()?, w.as_array()?, b.as_array()?);
        let mut oa = out.as_array_mut()?;
        modes::layer_norm_body(xa.view(), wa.view(), ba.view(), eps, oa.view_mut());
    }
    out.into_object(py)
}

// --- add_transposed: a strided 2-d op ---

/// `a + b.T` for float64 matrices of shapes `(m, n)` and `(n, m)`, any strides (transposed,
/// sliced, reversed views included), as a new array of the caller's framework (a's).
#[pyfunction]
fn add_transposed<'py>(
    py: Python<'py>,
    a: TensorRef<'_, f64, Rank<2>>,
    b: TensorRef<'_, f64, Rank<2>>,
) -> PyResult<Bound<'py, PyAny>> {
    let (sa, sb) = (a.shape(), b.shape());
    if sa[0] != sb[1] || sa[1] != sb[0] {
        return Err(PyValueError::new_err(format!(
            "add_transposed: b must have shape ({}, {}) for a of shape ({}, {}), got ({}, {})",
            sa[1], sa[0], sa[0], sa[1], sb[0], sb[1]
        )));
    }
    let mut out = a.empty_like::<f64>(py)?;
    {
        let (av, bv) = (a.as_array()?, b.as_array()?);
        let mut o = out.as_array_mut()?;
        ndarray::Zip::from(&mut *o).and(&*av).and(&bv.t()).for_each(|o, &x, &y| *o = x + y);
    }
    out.into_object(py)
}

/// The example module (it needs the GIL, as every module embedding dlbridge does).
#[pymodule(gil_used = true)]
fn dlbridge_kernels(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(saxpy_, m)?)?;
    m.add_function(wrap_pyfunction!(saxpy, m)?)?;
    m.add_function(wrap_pyfunction!(softmax, m)?)?;
    m.add_function(wrap_pyfunction!(layer_norm, m)?)?;
    m.add_function(wrap_pyfunction!(add_transposed, m)?)?;
    // Each kernel also inside jax.jit and torch.compile (needs the dlbridge Python package).
    modes::add_kernels(m)?;
    rms_norm::add_kernels(m)?;
    reduce::add_kernels(m)?;
    context::add_kernels(m)?;
    params::add_kernels(m)?;
    Ok(())
}
