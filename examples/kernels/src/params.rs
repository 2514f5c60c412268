//! Optional tensors and lists of tensors, in every mode:
//! - `scale_shift(x, weight, bias=None)`: `out = x * weight (+ bias)` row by row, `bias` an
//!   optional tensor (torch schema `Tensor? bias=None`), with a backward giving `dx`, `dweight`
//!   and `dbias` (None where no bias was passed);
//! - `accumulate(x, xs, weights)`: `out = x + sum_i weights[i] * xs[i]`, `xs` a list of tensors
//!   (torch schema `Tensor[] xs`).
//!
//! The eager functions take `Option<TensorRef<..>>` and `TensorList<..>`; the XLA handlers declare
//! their parameters (`optional("bias")`, `list("xs")`) and read `Call::optional_input` and
//! `Call::input_list`.

use dlbridge::TensorRef;
use dlbridge::python::{KernelDef, Output, ResultDef, TensorList, add_kernel};
use dlbridge::spec::{C, Rank};
use dlbridge::xla::{FfiError, Result};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

type Matrix<'a> = TensorRef<'a, f32, Rank<2>, C>;
type Vector<'a> = TensorRef<'a, f32, Rank<1>, C>;

// --- the bodies ---

/// `out = x * weight (+ bias)`, row by row (`cols` = the rows' length).
fn scale_shift_body(x: &[f32], w: &[f32], b: Option<&[f32]>, out: &mut [f32], cols: usize) {
    for (o, row) in out.chunks_mut(cols.max(1)).zip(x.chunks(cols.max(1))) {
        for (j, (o, x)) in o.iter_mut().zip(row).enumerate() {
            *o = x * w[j] + b.map_or(0.0, |b| b[j]);
        }
    }
}

/// `scale_shift`'s vector-Jacobian product: `dx = g * weight`, `dweight = sum_rows(g * x)`,
/// `dbias = sum_rows(g)`.
fn scale_shift_backward_body(
    x: &[f32],
    w: &[f32],
    g: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
) {
    let cols = w.len().max(1);
    dw.fill(0.0);
    db.fill(0.0);
    for ((dx, x), g) in dx.chunks_mut(cols).zip(x.chunks(cols)).zip(g.chunks(cols)) {
        for j in 0..dx.len() {
            dx[j] = g[j] * w[j];
            dw[j] += g[j] * x[j];
            db[j] += g[j];
        }
    }
}

/// `out = x + sum_i weights[i] * xs[i]`.
fn accumulate_body(x: &[f32], xs: &[&[f32]], weights: &[f32], out: &mut [f32]) {
    out.copy_from_slice(x);
    for (xi, wi) in xs.iter().zip(weights) {
        for (o, v) in out.iter_mut().zip(xi.iter()) {
            *o += wi * v;
        }
    }
}

fn check_row(what: &str, cols: i64, v: &[i64]) -> std::result::Result<(), String> {
    if v != [cols] {
        return Err(format!("{what}: expected shape [{cols}] (x's row length), got {v:?}"));
    }
    Ok(())
}

fn check_terms(x: &[i64], xs: &[&[i64]], weights: &[i64]) -> std::result::Result<(), String> {
    if weights != [xs.len() as i64] {
        return Err(format!("weights: expected shape [{}] (one per item of xs), got {weights:?}", xs.len()));
    }
    if let Some((i, s)) = xs.iter().enumerate().find(|(_, s)| **s != x) {
        return Err(format!("xs[{i}]: expected x's shape {x:?}, got {s:?}"));
    }
    Ok(())
}

// --- eager ---

/// `x * weight + bias` row by row for a 2-d float32 `x`, 1-d `weight` and optional 1-d `bias`
/// (x's row length each); a new array of x's framework.
#[pyfunction]
#[pyo3(signature = (x, weight, bias = None))]
fn scale_shift(
    py: Python<'_>,
    x: Matrix<'_>,
    weight: Vector<'_>,
    bias: Option<Vector<'_>>,
) -> PyResult<Output<f32>> {
    let cols = x.shape()[1];
    check_row("weight", cols, weight.shape()).map_err(PyValueError::new_err)?;
    if let Some(b) = &bias {
        check_row("bias", cols, b.shape()).map_err(PyValueError::new_err)?;
    }
    let mut out = x.empty_like::<f32>(py)?;
    {
        let (xs, ws) = (x.as_slice()?, weight.as_slice()?);
        let bs = bias.as_ref().map(|b| b.as_slice()).transpose()?;
        let mut o = out.as_slice_mut()?;
        scale_shift_body(&xs, &ws, bs.as_deref(), &mut o, cols as usize);
    }
    Ok(out)
}

/// `scale_shift`'s backward: `(dx, dweight, dbias)` from `x`, `weight` and the result's
/// cotangent `grad`.
#[pyfunction]
fn scale_shift_backward(
    py: Python<'_>,
    x: Matrix<'_>,
    weight: Vector<'_>,
    grad: Matrix<'_>,
) -> PyResult<(Output<f32>, Output<f32>, Output<f32>)> {
    check_row("weight", x.shape()[1], weight.shape()).map_err(PyValueError::new_err)?;
    if grad.shape() != x.shape() {
        return Err(PyValueError::new_err(format!(
            "grad: expected x's shape {:?}, got {:?}",
            x.shape(),
            grad.shape()
        )));
    }
    let (mut dx, mut dw, mut db) =
        (x.empty_like::<f32>(py)?, weight.empty_like::<f32>(py)?, weight.empty_like::<f32>(py)?);
    {
        let (xs, ws, gs) = (x.as_slice()?, weight.as_slice()?, grad.as_slice()?);
        let (mut a, mut b, mut c) = (dx.as_slice_mut()?, dw.as_slice_mut()?, db.as_slice_mut()?);
        scale_shift_backward_body(&xs, &ws, &gs, &mut a, &mut b, &mut c);
    }
    Ok((dx, dw, db))
}

/// `x + sum_i weights[i] * xs[i]` for float32 arrays of one shape, `xs` a list (or tuple) of
/// them and `weights` a 1-d float32 array with one weight per item; a new array of x's framework.
#[pyfunction]
fn accumulate(
    py: Python<'_>,
    x: TensorRef<'_, f32, dlbridge::spec::AnyShape, C>,
    xs: TensorList<'_, f32, dlbridge::spec::AnyShape, C>,
    weights: Vector<'_>,
) -> PyResult<Output<f32>> {
    let shapes: Vec<&[i64]> = xs.iter().map(|t| t.shape()).collect();
    check_terms(x.shape(), &shapes, weights.shape()).map_err(PyValueError::new_err)?;
    let mut out = x.empty_like::<f32>(py)?;
    {
        let items = xs.iter().map(|t| t.as_slice()).collect::<dlbridge::Result<Vec<_>>>()?;
        let slices: Vec<&[f32]> = items.iter().map(|s| &**s).collect();
        let (xv, wv) = (x.as_slice()?, weights.as_slice()?);
        let mut o = out.as_slice_mut()?;
        accumulate_body(&xv, &slices, &wv, &mut o);
    }
    Ok(out)
}

// --- inside jax.jit (and the torch op): XLA FFI handlers over the same bodies ---

fn invalid(m: String) -> FfiError {
    FfiError::invalid_argument(m)
}

dlbridge::xla_handler! {
    /// `scale_shift` inside `jax.jit`: `bias` is optional (None passes no operand).
    pub(crate) fn scale_shift_xla(call, operands: [tensor("x"), tensor("weight"), optional("bias")], results: 1) {
        let x = call.input::<f32, Rank<2>>(0, "x")?;
        let w = call.input::<f32, Rank<1>>(1, "weight")?;
        let b = call.optional_input::<f32, Rank<1>>(2, "bias")?;
        let cols = x.shape()[1];
        check_row("weight", cols, w.shape()).map_err(invalid)?;
        if let Some(b) = &b {
            check_row("bias", cols, b.shape()).map_err(invalid)?;
        }
        let mut out = call.output::<f32, Rank<2>>(0, "out")?;
        let (xs, ws) = (x.as_slice()?, w.as_slice()?);
        let bs = b.as_ref().map(|b| b.as_slice()).transpose()?;
        scale_shift_body(&xs, &ws, bs.as_deref(), &mut out.as_slice_mut()?, cols as usize);
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// `scale_shift_backward` inside `jax.jit`: results `dx`, `dweight`, `dbias`.
    pub(crate) fn scale_shift_backward_xla(call, operands: 3, results: 3) {
        let x = call.input::<f32, Rank<2>>(0, "x")?;
        let w = call.input::<f32, Rank<1>>(1, "weight")?;
        let g = call.input::<f32, Rank<2>>(2, "grad")?;
        check_row("weight", x.shape()[1], w.shape()).map_err(invalid)?;
        let mut dx = call.output::<f32, Rank<2>>(0, "dx")?;
        let mut dw = call.output::<f32, Rank<1>>(1, "dweight")?;
        let mut db = call.output::<f32, Rank<1>>(2, "dbias")?;
        let (xs, ws, gs) = (x.as_slice()?, w.as_slice()?, g.as_slice()?);
        scale_shift_backward_body(&xs, &ws, &gs, &mut dx.as_slice_mut()?, &mut dw.as_slice_mut()?, &mut db.as_slice_mut()?);
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// `accumulate` inside `jax.jit`: `xs` is a list (its items are the operands between x and
    /// weights).
    pub(crate) fn accumulate_xla(call, operands: [tensor("x"), list("xs"), tensor("weights")], results: 1) {
        let x = call.input::<f32, dlbridge::spec::AnyShape>(0, "x")?;
        let xs = call.input_list::<f32, dlbridge::spec::AnyShape>(1, "xs")?;
        let w = call.input::<f32, Rank<1>>(2, "weights")?;
        let shapes: Vec<&[i64]> = xs.iter().map(|t| t.shape()).collect();
        check_terms(x.shape(), &shapes, w.shape()).map_err(invalid)?;
        let mut out = call.output::<f32, dlbridge::spec::AnyShape>(0, "out")?;
        let items = xs.iter().map(|t| t.as_slice()).collect::<Result<Vec<_>>>()?;
        let slices: Vec<&[f32]> = items.iter().map(|s| &**s).collect();
        let (xv, wv) = (x.as_slice()?, w.as_slice()?);
        accumulate_body(&xv, &slices, &wv, &mut out.as_slice_mut()?);
        Ok(())
    }
}

/// `scale_shift`'s backward's results: `dx` like `x`, `dweight` and `dbias` like `weight`.
const SCALE_SHIFT_BACKWARD_RESULTS: &[ResultDef<'static>] =
    &[ResultDef::like("dx", "x"), ResultDef::like("dweight", "weight"), ResultDef::like("dbias", "weight")];

/// Adds `scale_shift` (with its backward), `scale_shift_backward` and `accumulate` to `m` as
/// kernels of every mode.
pub(crate) fn add_kernels(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let backward = add_kernel(
        m,
        wrap_pyfunction!(scale_shift_backward, m)?.into_any(),
        &KernelDef {
            results: SCALE_SHIFT_BACKWARD_RESULTS,
            ffi: Some(scale_shift_backward_xla),
            ..KernelDef::default()
        },
        None,
    )?;
    // The backward gives dbias whether or not a bias was passed: where none was, its gradient
    // is None (torch) or absent (jax), as for any optional argument left out.
    let grad = (backward, ("x", "weight", "grad"), ("x", "weight", "bias")).into_pyobject(py)?.into_any();
    add_kernel(
        m,
        wrap_pyfunction!(scale_shift, m)?.into_any(),
        &KernelDef {
            out: Some("x"),
            optional: &["bias"],
            ffi: Some(scale_shift_xla),
            ..KernelDef::default()
        },
        Some(grad),
    )?;
    add_kernel(
        m,
        wrap_pyfunction!(accumulate, m)?.into_any(),
        &KernelDef { out: Some("x"), lists: &["xs"], ffi: Some(accumulate_xla), ..KernelDef::default() },
        None,
    )?;
    Ok(())
}
