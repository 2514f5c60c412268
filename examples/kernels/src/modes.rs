//! Every mode: each kernel's body, written once, run by the eager `#[pyfunction]` (lib.rs) and by
//! an XLA FFI handler (here) that `jax.jit` calls; `add_kernels` makes each function a
//! `dlbridge.kernels.Kernel`, which also serves `torch.compile` through a torch custom op.

use dlbridge::python::{KernelDef, add_kernel};
use dlbridge::spec::{C, Cpu, Rank};
use dlbridge::xla::{Call, FfiError, Result};
use dlbridge::{DataType, TensorView, argument_error};
use half::bf16;
use ndarray::{ArrayView1, ArrayViewD, ArrayViewMutD, IxDyn};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use rayon::prelude::*;

use crate::Real;

// --- the bodies ---

/// `out = a * x + y`.
pub(crate) fn saxpy_body<T: Real>(a: f64, x: &[T], y: &[T], out: &mut [T]) {
    for ((o, &x), &y) in out.iter_mut().zip(x).zip(y) {
        *o = T::put(a * x.get() + y.get());
    }
}

/// `y += a * x`.
pub(crate) fn saxpy_inplace_body(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Row-wise softmax of rows of `cols` elements, rows in parallel (rayon).
pub(crate) fn softmax_body<T: Real>(x: &[T], out: &mut [T], cols: usize) {
    if cols == 0 {
        return;
    }
    out.par_chunks_mut(cols).zip(x.par_chunks(cols)).for_each(|(o, row)| {
        let max = row.iter().map(|v| v.get()).fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|v| (v.get() - max).exp()).sum();
        for (o, v) in o.iter_mut().zip(row) {
            *o = T::put((v.get() - max).exp() / sum);
        }
    });
}

/// Softmax's vector-Jacobian product: `out = y * (g - sum(g * y))` row by row, `y` the softmax.
pub(crate) fn softmax_backward_body<T: Real>(y: &[T], g: &[T], out: &mut [T], cols: usize) {
    if cols == 0 {
        return;
    }
    out.par_chunks_mut(cols).zip(y.par_chunks(cols).zip(g.par_chunks(cols))).for_each(|(o, (y, g))| {
        let dot: f64 = y.iter().zip(g).map(|(y, g)| y.get() * g.get()).sum();
        for ((o, y), g) in o.iter_mut().zip(y).zip(g) {
            *o = T::put(y.get() * (g.get() - dot));
        }
    });
}

/// Layer normalisation over the last axis (of 2-d `x` and `out`, 1-d `w` and `b`, any strides):
/// `(x - mean) / sqrt(var + eps) * w + b`.
pub(crate) fn layer_norm_body<T: Real>(
    x: ArrayViewD<'_, T>,
    w: ArrayViewD<'_, T>,
    b: ArrayViewD<'_, T>,
    eps: f64,
    mut out: ArrayViewMutD<'_, T>,
) {
    for (mut orow, xrow) in out.rows_mut().into_iter().zip(x.rows()) {
        let n = xrow.len().max(1) as f64;
        let mean = xrow.iter().map(|v| v.get()).sum::<f64>() / n;
        let var = xrow.iter().map(|v| (v.get() - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + eps).sqrt();
        for (((o, v), w), b) in orow.iter_mut().zip(xrow.iter()).zip(w.iter()).zip(b.iter()) {
            *o = T::put((v.get() - mean) * inv * w.get() + b.get());
        }
    }
}

// --- the eager backward of softmax ---

/// Softmax's backward: `y * (g - sum(g * y, axis=-1))` for a softmax `y` and its cotangent `g`
/// (2-d C-contiguous, one dtype: float32, float64 or bfloat16), as a new array of y's framework.
#[pyfunction]
fn softmax_backward<'py>(
    py: Python<'py>,
    y: TensorView<'_>,
    g: TensorView<'_>,
) -> PyResult<Bound<'py, PyAny>> {
    match y.dtype() {
        DataType::FLOAT32 => softmax_backward_typed::<f32>(py, y, g),
        DataType::FLOAT64 => softmax_backward_typed::<f64>(py, y, g),
        DataType::BFLOAT16 => softmax_backward_typed::<bf16>(py, y, g),
        other => Err(PyTypeError::new_err(format!(
            "softmax_backward: y: expected float32, float64 or bfloat16, got {other}"
        ))),
    }
}

fn softmax_backward_typed<'py, T: Real>(
    py: Python<'py>,
    y: TensorView<'_>,
    g: TensorView<'_>,
) -> PyResult<Bound<'py, PyAny>> {
    let y = y.typed::<T, Rank<2>, C, Cpu>().map_err(|e| argument_error("y", e))?;
    let g = g.typed::<T, Rank<2>, C, Cpu>().map_err(|e| argument_error("g", e))?;
    if y.shape() != g.shape() {
        return Err(PyValueError::new_err(format!(
            "softmax_backward: y and g have shapes {:?} and {:?}",
            y.shape(),
            g.shape()
        )));
    }
    let cols = y.shape()[1] as usize;
    let mut out = y.empty_like::<T>(py)?;
    {
        let (ys, gs) = (y.as_slice()?, g.as_slice()?);
        let mut os = out.as_slice_mut()?;
        py.detach(|| softmax_backward_body(&ys, &gs, &mut os, cols));
    }
    out.into_object(py)
}

// --- the XLA FFI handlers (inside jax.jit) ---

fn same_shape(what: &str, a: &[i64], b: &[i64]) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(FfiError::invalid_argument(format!("{what}: shapes {a:?} and {b:?} differ")))
    }
}

fn unsupported(name: &str, dtype: DataType, allowed: &str) -> FfiError {
    FfiError::invalid_argument(format!("{name}: expected {allowed}, got {dtype}"))
}

dlbridge::xla_handler! {
    /// `saxpy` inside `jax.jit`: `out = a * x + y` (float32 or float64).
    pub(crate) fn saxpy_xla(call, operands: 2, results: 1, attrs: ["a"]) {
        let a: f64 = call.attr("a")?;
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => saxpy_ffi::<f32>(call, a),
            DataType::FLOAT64 => saxpy_ffi::<f64>(call, a),
            other => Err(unsupported("x", other, "float32 or float64")),
        }
    }
}

fn saxpy_ffi<T: Real>(call: &Call<'_>, a: f64) -> Result<()> {
    let x = call.input::<T, Rank<1>>(0, "x")?;
    let y = call.input::<T, Rank<1>>(1, "y")?;
    let mut out = call.output::<T, Rank<1>>(0, "out")?;
    same_shape("x and y", x.shape(), y.shape())?;
    same_shape("x and out", x.shape(), out.shape())?;
    saxpy_body(a, &x.as_slice()?, &y.as_slice()?, &mut out.as_slice_mut()?);
    Ok(())
}

dlbridge::xla_handler! {
    /// `saxpy_` inside `jax.jit`: result 0 is operand `y`'s memory (input_output_aliases), so
    /// the body reads `x` and reads and writes the result.
    pub(crate) fn saxpy_inplace_xla(call, operands: 2, results: 1, attrs: ["a"]) {
        let a: f32 = call.attr("a")?;
        let x = call.input::<f32, Rank<1>>(0, "x")?;
        let mut y = call.output::<f32, Rank<1>>(0, "y")?;
        same_shape("x and y", x.shape(), y.shape())?;
        // The result must be operand y's own memory (input_output_aliases={1: 0}), else the body
        // would read a result buffer XLA never filled.
        if call.input_any(1, "y")?.data_ptr().cast::<f32>() != y.as_mut_ptr() {
            return Err(FfiError::invalid_argument("y: result 0 must alias operand 1 (input_output_aliases={1: 0})"));
        }
        saxpy_inplace_body(a, &x.as_slice()?, &mut y.as_slice_mut()?);
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// `softmax` inside `jax.jit` (float32, float64, bfloat16).
    pub(crate) fn softmax_xla(call, operands: 1, results: 1) {
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => softmax_ffi::<f32>(call),
            DataType::FLOAT64 => softmax_ffi::<f64>(call),
            DataType::BFLOAT16 => softmax_ffi::<bf16>(call),
            other => Err(unsupported("x", other, "float32, float64 or bfloat16")),
        }
    }
}

fn softmax_ffi<T: Real>(call: &Call<'_>) -> Result<()> {
    let x = call.input::<T, Rank<2>>(0, "x")?;
    let mut out = call.output::<T, Rank<2>>(0, "out")?;
    same_shape("x and out", x.shape(), out.shape())?;
    softmax_body(&x.as_slice()?, &mut out.as_slice_mut()?, x.shape()[1] as usize);
    Ok(())
}

dlbridge::xla_handler! {
    /// `softmax_backward` inside `jax.jit`.
    pub(crate) fn softmax_backward_xla(call, operands: 2, results: 1) {
        match call.input_any(0, "y")?.dtype() {
            DataType::FLOAT32 => softmax_backward_ffi::<f32>(call),
            DataType::FLOAT64 => softmax_backward_ffi::<f64>(call),
            DataType::BFLOAT16 => softmax_backward_ffi::<bf16>(call),
            other => Err(unsupported("y", other, "float32, float64 or bfloat16")),
        }
    }
}

fn softmax_backward_ffi<T: Real>(call: &Call<'_>) -> Result<()> {
    let y = call.input::<T, Rank<2>>(0, "y")?;
    let g = call.input::<T, Rank<2>>(1, "g")?;
    let mut out = call.output::<T, Rank<2>>(0, "out")?;
    same_shape("y and g", y.shape(), g.shape())?;
    same_shape("y and out", y.shape(), out.shape())?;
    let cols = y.shape()[1] as usize;
    softmax_backward_body(&y.as_slice()?, &g.as_slice()?, &mut out.as_slice_mut()?, cols);
    Ok(())
}

dlbridge::xla_handler! {
    /// `layer_norm` inside `jax.jit` (float32 or float64).
    pub(crate) fn layer_norm_xla(call, operands: 3, results: 1, attrs: ["eps"]) {
        let eps: f64 = call.attr("eps")?;
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => layer_norm_ffi::<f32>(call, eps),
            DataType::FLOAT64 => layer_norm_ffi::<f64>(call, eps),
            other => Err(unsupported("x", other, "float32 or float64")),
        }
    }
}

fn layer_norm_ffi<T: Real>(call: &Call<'_>, eps: f64) -> Result<()> {
    let x = call.input::<T, Rank<2>>(0, "x")?;
    let w = call.input::<T, Rank<1>>(1, "weight")?;
    let b = call.input::<T, Rank<1>>(2, "bias")?;
    let mut out = call.output::<T, Rank<2>>(0, "out")?;
    same_shape("x and out", x.shape(), out.shape())?;
    let (rows, cols) = (x.shape()[0] as usize, x.shape()[1] as usize);
    if w.shape() != [cols as i64] || b.shape() != [cols as i64] {
        return Err(FfiError::invalid_argument(format!(
            "weight and bias need length {cols} (x's rows), got {} and {}",
            w.shape()[0],
            b.shape()[0]
        )));
    }
    let (xs, ws, bs) = (x.as_slice()?, w.as_slice()?, b.as_slice()?);
    let mut os = out.as_slice_mut()?;
    let shape_error = |e: ndarray::ShapeError| FfiError::invalid_argument(e.to_string());
    layer_norm_body(
        ArrayViewD::from_shape(IxDyn(&[rows, cols]), &xs).map_err(shape_error)?,
        ArrayView1::from(&*ws).into_dyn(),
        ArrayView1::from(&*bs).into_dyn(),
        eps,
        ArrayViewMutD::from_shape(IxDyn(&[rows, cols]), &mut os).map_err(shape_error)?,
    );
    Ok(())
}

// --- registration: every function a kernel of every mode ---

/// Replaces the module's eager functions by `dlbridge.kernels.Kernel`s of the same name (they call
/// the eager function on arrays, the handler inside `jax.jit`, a torch custom op inside
/// `torch.compile`), and adds `softmax_backward`, softmax's backward.
pub(crate) fn add_kernels(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let f = |name: &str| m.getattr(name);
    add_kernel(
        m,
        f("saxpy")?,
        &KernelDef {
            out: Some("x"),
            attrs: &[("a", "float64")],
            ffi: Some(saxpy_xla),
            ..KernelDef::default()
        },
        None,
    )?;
    add_kernel(
        m,
        f("saxpy_")?,
        &KernelDef {
            attrs: &[("a", "float32")],
            mutates: &["y"],
            ffi: Some(saxpy_inplace_xla),
            ..KernelDef::default()
        },
        None,
    )?;
    let backward = add_kernel(
        m,
        wrap_pyfunction!(softmax_backward, m)?.into_any(),
        &KernelDef { out: Some("y"), ffi: Some(softmax_backward_xla), ..KernelDef::default() },
        None,
    )?;
    let softmax_grad = (backward, ("out", "grad"), ("x",)).into_pyobject(py)?.into_any();
    add_kernel(
        m,
        f("softmax")?,
        &KernelDef { out: Some("x"), ffi: Some(softmax_xla), ..KernelDef::default() },
        Some(softmax_grad),
    )?;
    add_kernel(
        m,
        f("layer_norm")?,
        &KernelDef {
            // The op's names (torch.ops.dlbridge_examples.layer_norm, XLA target
            // dlbridge_examples.layer_norm); the others take the defaults: the function's name
            // in the module's package (torch.ops.dlbridge_kernels.softmax).
            namespace: Some("dlbridge_examples"),
            out: Some("x"),
            attrs: &[("eps", "float64")],
            ffi: Some(layer_norm_xla),
            ..KernelDef::default()
        },
        None,
    )?;
    Ok(())
}
