//! Optional tensors and lists of tensors, in every mode:
//! - `scale_shift(x, weight, bias=None)`: `out = x * weight (+ bias)` row by row, `bias` an
//!   optional tensor (torch schema `Tensor? bias=None`), with a backward giving `dx`, `dweight`
//!   and `dbias` (None where no bias was passed);
//! - `accumulate(x, xs, weights)`: `out = x + sum_i weights[i] * xs[i]`, `xs` a list of tensors
//!   (torch schema `Tensor[] xs`);
//! - `affine_rowsum(x, weight, bias=None)`: two results, `y = x * weight (+ bias)` and its row
//!   sums `total`, with a backward; `stack_sums(xs)`: two results, the items of a list stacked
//!   as rows and each row's sum. Their result rules are `ParamShapeFn`s: they read `bias` as
//!   absent when it is None and `xs` as a list of shapes.
//!
//! The eager functions take `Option<TensorRef<..>>` and `TensorList<..>`; the XLA handlers declare
//! their parameters (`optional("bias")`, `list("xs")`) and read `Call::optional_input` and
//! `Call::input_list`.

use dlbridge::TensorRef;
use dlbridge::python::{
    Attrs, KernelDef, Output, ParamShape, ResultDType, ResultDef, TensorList, add_kernel,
};
use dlbridge::spec::{C, Rank};
use dlbridge::xla::{FfiError, Result};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyCFunction, PyDict, PyTuple};

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
    add_result_kernels(m)
}

// --- several results with an optional tensor or a list: rules over each parameter's shape ---

/// `y = x * weight (+ bias)` and `total[i] = sum_j y[i, j]`, row by row.
fn affine_rowsum_body(x: &[f32], w: &[f32], b: Option<&[f32]>, y: &mut [f32], total: &mut [f32]) {
    let cols = w.len();
    scale_shift_body(x, w, b, y, cols);
    if cols == 0 {
        // Rows of no columns: y is empty, each row's sum 0 (the buffer is not zeroed for us).
        total.fill(0.0);
        return;
    }
    for (t, row) in total.iter_mut().zip(y.chunks(cols)) {
        *t = row.iter().sum();
    }
}

/// `affine_rowsum`'s vector-Jacobian product: with `g = grad_y + grad_total` (each row's total
/// cotangent added to the row), `dx = g * weight`, `dweight = sum_rows(g * x)`, `dbias =
/// sum_rows(g)`.
fn affine_rowsum_backward_body(
    x: &[f32],
    w: &[f32],
    gy: &[f32],
    gt: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
) {
    let cols = w.len().max(1);
    let g: Vec<f32> = gy.chunks(cols).zip(gt).flat_map(|(row, t)| row.iter().map(move |v| v + t)).collect();
    scale_shift_backward_body(x, w, &g, dx, dw, db);
}

/// `stacked[i] = xs[i]` and `sums[i] = sum_j xs[i][j]`.
fn stack_sums_body(xs: &[&[f32]], stacked: &mut [f32], sums: &mut [f32]) {
    let cols = xs.first().map_or(1, |x| x.len().max(1));
    for (row, x) in stacked.chunks_mut(cols).zip(xs) {
        row.copy_from_slice(x);
    }
    // Each sum from its item, not from a row: items of length 0 have no rows to drive the loop.
    for (s, x) in sums.iter_mut().zip(xs) {
        *s = x.iter().sum();
    }
}

/// `total`'s shape: one value per row of `x`. It reads `bias` as the caller passed it (absent
/// for None) and checks it, and `weight`, against x's row length.
pub(crate) fn rowsum_shape(p: &[ParamShape<'_>], _: &Attrs<'_>) -> std::result::Result<Vec<i64>, String> {
    let (Some(x), Some(w)) = (p[0].tensor(), p[1].tensor()) else {
        return Err("x and weight: expected tensors".into());
    };
    let &[rows, cols] = x else { return Err(format!("x: expected 2 dimensions, got shape {x:?}")) };
    check_row("weight", cols, w)?;
    if let ParamShape::Optional(Some(b)) = p[2] {
        check_row("bias", cols, b)?;
    }
    Ok(vec![rows])
}

/// The items of `xs`: each 1-d, of one length `n`, at least one of them; `(count, n)`.
fn stack_dims(p: &[ParamShape<'_>]) -> std::result::Result<(i64, i64), String> {
    let xs = p[0].list().ok_or("xs: expected a list of tensors")?;
    let Some(&[n]) = xs.first().copied() else {
        return Err(format!("xs[0]: expected one 1-d tensor at least, got {:?}", xs.first()));
    };
    if let Some((i, s)) = xs.iter().enumerate().find(|(_, s)| **s != [n]) {
        return Err(format!("xs[{i}]: expected shape [{n}] (xs[0]'s), got {s:?}"));
    }
    Ok((xs.len() as i64, n))
}

/// `stacked`'s shape: one row per item of `xs`.
pub(crate) fn stacked_shape(p: &[ParamShape<'_>], _: &Attrs<'_>) -> std::result::Result<Vec<i64>, String> {
    stack_dims(p).map(|(k, n)| vec![k, n])
}

/// `sums`'s shape: one value per item of `xs`.
pub(crate) fn sums_shape(p: &[ParamShape<'_>], _: &Attrs<'_>) -> std::result::Result<Vec<i64>, String> {
    stack_dims(p).map(|(k, _)| vec![k])
}

/// `(y, total)`: `y = x * weight (+ bias)` row by row and `total`, each row's sum of `y`, for a
/// 2-d float32 `x`, 1-d `weight` and optional 1-d `bias`; new arrays of x's framework.
#[pyfunction]
#[pyo3(signature = (x, weight, bias = None))]
fn affine_rowsum(
    py: Python<'_>,
    x: Matrix<'_>,
    weight: Vector<'_>,
    bias: Option<Vector<'_>>,
) -> PyResult<(Output<f32>, Output<f32>)> {
    // total's shape by the kernel's own rule (which checks weight and bias).
    let params = [
        ParamShape::Tensor(x.shape()),
        ParamShape::Tensor(weight.shape()),
        ParamShape::Optional(bias.as_ref().map(|b| b.shape())),
    ];
    let shape = rowsum_shape(&params, &Attrs::new()).map_err(PyValueError::new_err)?;
    let mut y = x.empty_like::<f32>(py)?;
    let mut total = x.framework(py)?.empty::<f32>(py, &[shape[0] as usize], x.device())?;
    {
        let (xs, ws) = (x.as_slice()?, weight.as_slice()?);
        let bs = bias.as_ref().map(|b| b.as_slice()).transpose()?;
        let (mut ys, mut ts) = (y.as_slice_mut()?, total.as_slice_mut()?);
        affine_rowsum_body(&xs, &ws, bs.as_deref(), &mut ys, &mut ts);
    }
    Ok((y, total))
}

/// `affine_rowsum`'s backward: `(dx, dweight, dbias)` from `x`, `weight` and the cotangents of
/// both results, `grad_y` (x's shape) and `grad_total` (one per row).
#[pyfunction]
fn affine_rowsum_backward(
    py: Python<'_>,
    x: Matrix<'_>,
    weight: Vector<'_>,
    grad_y: Matrix<'_>,
    grad_total: Vector<'_>,
) -> PyResult<(Output<f32>, Output<f32>, Output<f32>)> {
    check_row("weight", x.shape()[1], weight.shape()).map_err(PyValueError::new_err)?;
    if grad_y.shape() != x.shape() || grad_total.shape() != [x.shape()[0]] {
        return Err(PyValueError::new_err(format!(
            "grad_y {:?} and grad_total {:?} do not match x {:?}",
            grad_y.shape(),
            grad_total.shape(),
            x.shape()
        )));
    }
    let (mut dx, mut dw, mut db) =
        (x.empty_like::<f32>(py)?, weight.empty_like::<f32>(py)?, weight.empty_like::<f32>(py)?);
    {
        let (xs, ws, gy, gt) =
            (x.as_slice()?, weight.as_slice()?, grad_y.as_slice()?, grad_total.as_slice()?);
        let (mut a, mut b, mut c) = (dx.as_slice_mut()?, dw.as_slice_mut()?, db.as_slice_mut()?);
        affine_rowsum_backward_body(&xs, &ws, &gy, &gt, &mut a, &mut b, &mut c);
    }
    Ok((dx, dw, db))
}

/// `(stacked, sums)`: the items of `xs` (1-d float32 tensors of one length, at least one) as the
/// rows of `stacked`, and each row's sum; new arrays of the first item's framework.
#[pyfunction]
fn stack_sums(py: Python<'_>, xs: TensorList<'_, f32, Rank<1>, C>) -> PyResult<(Output<f32>, Output<f32>)> {
    let shapes: Vec<&[i64]> = xs.iter().map(|t| t.shape()).collect();
    let params = [ParamShape::List(&shapes)];
    let (k, n) = stack_dims(&params).map_err(PyValueError::new_err)?;
    let first = xs.get(0).expect("stack_dims: one item at least");
    let fw = first.framework(py)?;
    let mut stacked = fw.empty::<f32>(py, &[k as usize, n as usize], first.device())?;
    let mut sums = fw.empty::<f32>(py, &[k as usize], first.device())?;
    {
        let items = xs.iter().map(|t| t.as_slice()).collect::<dlbridge::Result<Vec<_>>>()?;
        let slices: Vec<&[f32]> = items.iter().map(|s| &**s).collect();
        let (mut st, mut su) = (stacked.as_slice_mut()?, sums.as_slice_mut()?);
        stack_sums_body(&slices, &mut st, &mut su);
    }
    Ok((stacked, sums))
}

dlbridge::xla_handler! {
    /// `affine_rowsum` inside `jax.jit`: results `y` and `total`; `bias` is optional.
    pub(crate) fn affine_rowsum_xla(call, operands: [tensor("x"), tensor("weight"), optional("bias")], results: 2) {
        let x = call.input::<f32, Rank<2>>(0, "x")?;
        let w = call.input::<f32, Rank<1>>(1, "weight")?;
        let b = call.optional_input::<f32, Rank<1>>(2, "bias")?;
        let params = [ParamShape::Tensor(x.shape()), ParamShape::Tensor(w.shape()), ParamShape::Optional(b.as_ref().map(|b| b.shape()))];
        rowsum_shape(&params, &Attrs::new()).map_err(invalid)?;
        let mut y = call.output::<f32, Rank<2>>(0, "y")?;
        let mut total = call.output::<f32, Rank<1>>(1, "total")?;
        let (xs, ws) = (x.as_slice()?, w.as_slice()?);
        let bs = b.as_ref().map(|b| b.as_slice()).transpose()?;
        affine_rowsum_body(&xs, &ws, bs.as_deref(), &mut y.as_slice_mut()?, &mut total.as_slice_mut()?);
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// `affine_rowsum_backward` inside `jax.jit`: results `dx`, `dweight`, `dbias`.
    pub(crate) fn affine_rowsum_backward_xla(call, operands: 4, results: 3) {
        let x = call.input::<f32, Rank<2>>(0, "x")?;
        let w = call.input::<f32, Rank<1>>(1, "weight")?;
        let gy = call.input::<f32, Rank<2>>(2, "grad_y")?;
        let gt = call.input::<f32, Rank<1>>(3, "grad_total")?;
        check_row("weight", x.shape()[1], w.shape()).map_err(invalid)?;
        let mut dx = call.output::<f32, Rank<2>>(0, "dx")?;
        let mut dw = call.output::<f32, Rank<1>>(1, "dweight")?;
        let mut db = call.output::<f32, Rank<1>>(2, "dbias")?;
        let (xs, ws, gys, gts) = (x.as_slice()?, w.as_slice()?, gy.as_slice()?, gt.as_slice()?);
        affine_rowsum_backward_body(&xs, &ws, &gys, &gts, &mut dx.as_slice_mut()?, &mut dw.as_slice_mut()?, &mut db.as_slice_mut()?);
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// `stack_sums` inside `jax.jit`: results `stacked` and `sums`; `xs` is a list.
    pub(crate) fn stack_sums_xla(call, operands: [list("xs")], results: 2) {
        let xs = call.input_list::<f32, Rank<1>>(0, "xs")?;
        let shapes: Vec<&[i64]> = xs.iter().map(|t| t.shape()).collect();
        stack_dims(&[ParamShape::List(&shapes)]).map_err(invalid)?;
        let mut stacked = call.output::<f32, Rank<2>>(0, "stacked")?;
        let mut sums = call.output::<f32, Rank<1>>(1, "sums")?;
        let items = xs.iter().map(|t| t.as_slice()).collect::<Result<Vec<_>>>()?;
        let slices: Vec<&[f32]> = items.iter().map(|s| &**s).collect();
        stack_sums_body(&slices, &mut stacked.as_slice_mut()?, &mut sums.as_slice_mut()?);
        Ok(())
    }
}

/// `affine_rowsum`'s results: `y` like `x`, `total` by [`rowsum_shape`] (x's dtype).
const AFFINE_ROWSUM_RESULTS: &[ResultDef<'static>] =
    &[ResultDef::like("y", "x"), ResultDef::param_rule("total", rowsum_shape, ResultDType::Like("x"))];

/// `stack_sums`'s results, each by its rule over the list's shapes (float32: a list has no
/// dtype to be "like").
const STACK_SUMS_RESULTS: &[ResultDef<'static>] = &[
    ResultDef::param_rule("stacked", stacked_shape, ResultDType::Is(dlbridge::DataType::FLOAT32)),
    ResultDef::param_rule("sums", sums_shape, ResultDType::Is(dlbridge::DataType::FLOAT32)),
];

/// `stack_sums`'s backward's one result: each item's gradient as a row, `grad_stacked[i] +
/// grad_sums[i]`, a float32 `(k, n)` array of `grad_stacked`'s framework.
#[pyfunction]
fn stack_sums_backward(
    py: Python<'_>,
    grad_stacked: Matrix<'_>,
    grad_sums: Vector<'_>,
) -> PyResult<Output<f32>> {
    if grad_sums.shape() != [grad_stacked.shape()[0]] {
        return Err(PyValueError::new_err(format!(
            "grad_sums: expected shape [{}] (one per row of grad_stacked), got {:?}",
            grad_stacked.shape()[0],
            grad_sums.shape()
        )));
    }
    let mut d = grad_stacked.empty_like::<f32>(py)?;
    {
        let (g, s) = (grad_stacked.as_slice()?, grad_sums.as_slice()?);
        stack_sums_backward_body(&g, &s, &mut d.as_slice_mut()?);
    }
    Ok(d)
}

/// `d[i, j] = grad_stacked[i, j] + grad_sums[i]`.
fn stack_sums_backward_body(g: &[f32], s: &[f32], d: &mut [f32]) {
    let cols = (g.len() / s.len().max(1)).max(1);
    for ((row, grow), si) in d.chunks_mut(cols).zip(g.chunks(cols)).zip(s) {
        for (o, v) in row.iter_mut().zip(grow) {
            *o = v + si;
        }
    }
}

dlbridge::xla_handler! {
    /// `stack_sums_backward` inside `jax.jit`.
    pub(crate) fn stack_sums_backward_xla(call, operands: 2, results: 1) {
        let g = call.input::<f32, Rank<2>>(0, "grad_stacked")?;
        let s = call.input::<f32, Rank<1>>(1, "grad_sums")?;
        if s.shape() != [g.shape()[0]] {
            return Err(invalid(format!("grad_sums: expected shape [{}], got {:?}", g.shape()[0], s.shape())));
        }
        let mut d = call.output::<f32, Rank<2>>(0, "dxs")?;
        stack_sums_backward_body(&g.as_slice()?, &s.as_slice()?, &mut d.as_slice_mut()?);
        Ok(())
    }
}

/// `stack_sums`'s backward, a callable: each item of `xs` gets its row of the backward
/// kernel's result (a list's gradient is a list, one per item).
fn stack_sums_grad<'py>(py: Python<'py>, backward: Py<PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let grad = move |args: &Bound<'_, PyTuple>, _kw: Option<&Bound<'_, PyDict>>| -> PyResult<Py<PyAny>> {
        let py = args.py();
        let named = args.get_item(0)?;
        let d = backward.bind(py).call1((named.get_item("grad_stacked")?, named.get_item("grad_sums")?))?;
        let n = named.get_item("xs")?.len()?;
        let rows = (0..n).map(|i| d.get_item(i)).collect::<PyResult<Vec<_>>>()?;
        Ok([("xs", rows)].into_py_dict(py)?.into_any().unbind())
    };
    Ok(PyCFunction::new_closure(py, Some(c"stack_sums_grad"), None, grad)?.into_any())
}

/// Adds `affine_rowsum` (with its backward), `affine_rowsum_backward`, `stack_sums` (with its
/// backward) and `stack_sums_backward` to `m`.
fn add_result_kernels(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let backward = add_kernel(
        m,
        wrap_pyfunction!(affine_rowsum_backward, m)?.into_any(),
        &KernelDef {
            results: SCALE_SHIFT_BACKWARD_RESULTS,
            ffi: Some(affine_rowsum_backward_xla),
            ..KernelDef::default()
        },
        None,
    )?;
    // The backward reads both results' cotangents by name; dbias goes nowhere without a bias.
    let grad = (backward, ("x", "weight", "grad_y", "grad_total"), ("x", "weight", "bias"))
        .into_pyobject(py)?
        .into_any();
    add_kernel(
        m,
        wrap_pyfunction!(affine_rowsum, m)?.into_any(),
        &KernelDef {
            results: AFFINE_ROWSUM_RESULTS,
            optional: &["bias"],
            ffi: Some(affine_rowsum_xla),
            ..KernelDef::default()
        },
        Some(grad),
    )?;
    let backward = add_kernel(
        m,
        wrap_pyfunction!(stack_sums_backward, m)?.into_any(),
        &KernelDef { out: Some("grad_stacked"), ffi: Some(stack_sums_backward_xla), ..KernelDef::default() },
        None,
    )?;
    add_kernel(
        m,
        wrap_pyfunction!(stack_sums, m)?.into_any(),
        &KernelDef {
            results: STACK_SUMS_RESULTS,
            lists: &["xs"],
            ffi: Some(stack_sums_xla),
            ..KernelDef::default()
        },
        Some(stack_sums_grad(py, backward.unbind())?),
    )?;
    Ok(())
}
