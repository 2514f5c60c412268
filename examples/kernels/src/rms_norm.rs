//! `rms_norm` with an affine weight: a layer with a weight gradient and a saved residual (the
//! guide's chapter "A layer with a weight gradient").
//!
//! - `rms_norm(x, weight, eps)` has two results: `y = x * rstd * weight` and `rstd =
//!   1 / sqrt(mean(x**2, axis=-1) + eps)`, one per row, a residual: saved by the forward for the
//!   backward, never returned to the caller (who gets `y` alone);
//! - `rms_norm_backward(x, weight, rstd, grad)` has two results, `dx` and `dweight`;
//! - `rms_norm_inference(x, weight, eps)`, the same forward with `y` only (one result);
//! - `rms_norm_fm(x, weight, eps)`, `rms_norm` in forward mode too: its jvp `rms_norm_tangent`
//!   gives the tangents of `y` and `rstd` (the residual's included: the backward reads `rstd`, so
//!   a second derivative differentiates through it), and its backward `rms_norm_fm_backward`
//!   names the jvp `rms_norm_backward_tangent` (twice differentiable forward over reverse).
//!
//! Each body is written once, run by the eager `#[pyfunction]` and by an XLA FFI handler; the
//! shape of `rstd` is one rule in Rust ([`rows`]), read by jax's `ffi_call`, torch's fake and
//! native Meta kernels, and by the eager function as it allocates.

use dlbridge::python::{Attrs, KernelDef, ResultDType, ResultDef, add_kernel};
use dlbridge::spec::{C, Cpu, Rank};
use dlbridge::xla::{Call, FfiError, Result};
use dlbridge::{DataType, TensorRef, TensorView, argument_error};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::Real;

// --- the bodies ---

/// `y = x * rstd * w` and `rstd` per row, rows of `w.len()` elements.
fn forward_body<T: Real>(x: &[T], w: &[T], eps: f64, y: &mut [T], rstd: Option<&mut [T]>) {
    let cols = w.len();
    let mut rstd = rstd;
    if cols == 0 {
        // No columns: the mean of nothing is NaN (as torch's RMSNorm), and so is each rstd.
        if let Some(s) = rstd.as_deref_mut() {
            s.iter_mut().for_each(|v| *v = T::put(f64::NAN));
        }
        return;
    }
    for (r, (xr, yr)) in x.chunks(cols).zip(y.chunks_mut(cols)).enumerate() {
        let ms = xr.iter().map(|v| v.get() * v.get()).sum::<f64>() / cols as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), w) in yr.iter_mut().zip(xr).zip(w) {
            *o = T::put(v.get() * inv * w.get());
        }
        if let Some(s) = rstd.as_deref_mut() {
            s[r] = T::put(inv);
        }
    }
}

/// `dx = rstd * (g * w) - x * rstd**3 * mean(g * w * x)` per row, `dweight = sum(g * x * rstd)`
/// over the rows.
fn backward_body<T: Real>(x: &[T], w: &[T], rstd: &[T], g: &[T], dx: &mut [T], dw: &mut [T]) {
    let cols = w.len();
    let mut acc = vec![0.0f64; cols];
    if cols > 0 {
        for (((xr, gr), dxr), r) in x.chunks(cols).zip(g.chunks(cols)).zip(dx.chunks_mut(cols)).zip(rstd) {
            let r = r.get();
            let dot = xr.iter().zip(gr).zip(w).map(|((x, g), w)| g.get() * w.get() * x.get()).sum::<f64>()
                / cols as f64;
            for (j, ((o, x), g)) in dxr.iter_mut().zip(xr).zip(gr).enumerate() {
                let (x, g) = (x.get(), g.get());
                *o = T::put(r * g * w[j].get() - x * r * r * r * dot);
                acc[j] += g * x * r;
            }
        }
    }
    for (o, a) in dw.iter_mut().zip(acc) {
        *o = T::put(a);
    }
}

// --- the shape rule, one for every mode ---

/// `rstd`'s shape: `x`'s without its last axis (one value per row). `shapes` are the tensor
/// arguments' (`x`, `weight`, ...), in order.
pub(crate) fn rows(shapes: &[&[i64]], _attrs: &Attrs<'_>) -> std::result::Result<Vec<i64>, String> {
    match shapes.first() {
        Some(&[rows, _]) => Ok(vec![*rows]),
        Some(s) => Err(format!("x: expected 2 dimensions, got shape {s:?}")),
        None => Err("no x".into()),
    }
}

fn check_cols(x: &[i64], w: &[i64]) -> std::result::Result<(), String> {
    if w != [x[1]] {
        return Err(format!("weight: expected shape [{}] (x's row length), got {w:?}", x[1]));
    }
    Ok(())
}

// --- eager ---

/// RMS normalisation over the last axis with an affine weight: `(y, rstd)`, `y = x * rstd *
/// weight`, `rstd = 1 / sqrt(mean(x**2, -1) + eps)` (2-d C-contiguous `x`, 1-d `weight`, both
/// float32 or float64), new arrays of x's framework. As a kernel it returns `y` only (`rstd` is a
/// residual, for the backward).
#[pyfunction]
#[pyo3(signature = (x, weight, eps = 1e-6))]
fn rms_norm<'py>(
    py: Python<'py>,
    x: TensorView<'_>,
    weight: TensorView<'_>,
    eps: f64,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    match x.dtype() {
        DataType::FLOAT32 => forward_typed::<f32>(py, x, weight, eps, true).map(|(y, r)| (y, r.unwrap())),
        DataType::FLOAT64 => forward_typed::<f64>(py, x, weight, eps, true).map(|(y, r)| (y, r.unwrap())),
        other => Err(PyTypeError::new_err(format!("rms_norm: x: expected float32 or float64, got {other}"))),
    }
}

/// [`rms_norm`]'s `y` alone (one result): inference, where no backward needs `rstd`.
#[pyfunction]
#[pyo3(signature = (x, weight, eps = 1e-6))]
fn rms_norm_inference<'py>(
    py: Python<'py>,
    x: TensorView<'_>,
    weight: TensorView<'_>,
    eps: f64,
) -> PyResult<Bound<'py, PyAny>> {
    match x.dtype() {
        DataType::FLOAT32 => forward_typed::<f32>(py, x, weight, eps, false).map(|(y, _)| y),
        DataType::FLOAT64 => forward_typed::<f64>(py, x, weight, eps, false).map(|(y, _)| y),
        other => Err(PyTypeError::new_err(format!(
            "rms_norm_inference: x: expected float32 or float64, got {other}"
        ))),
    }
}

type Pair<'py> = (Bound<'py, PyAny>, Option<Bound<'py, PyAny>>);

fn typed2<'a, T: Real>(v: TensorView<'a>, name: &str) -> PyResult<TensorRef<'a, T, Rank<2>, C, Cpu>> {
    v.typed::<T, Rank<2>, C, Cpu>().map_err(|e| argument_error(name, e))
}

fn typed1<'a, T: Real>(v: TensorView<'a>, name: &str) -> PyResult<TensorRef<'a, T, Rank<1>, C, Cpu>> {
    v.typed::<T, Rank<1>, C, Cpu>().map_err(|e| argument_error(name, e))
}

fn forward_typed<'py, T: Real>(
    py: Python<'py>,
    x: TensorView<'_>,
    weight: TensorView<'_>,
    eps: f64,
    with_rstd: bool,
) -> PyResult<Pair<'py>> {
    let x = typed2::<T>(x, "x")?;
    let w = typed1::<T>(weight, "weight")?;
    check_cols(x.shape(), w.shape()).map_err(PyValueError::new_err)?;
    let mut y = x.empty_like::<T>(py)?;
    // rstd's shape by the kernel's own rule.
    let shape = rows(&[x.shape(), w.shape()], &Attrs::new()).map_err(PyValueError::new_err)?;
    let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    let mut rstd = if with_rstd { Some(x.framework(py)?.empty::<T>(py, &shape, x.device())?) } else { None };
    {
        let (xs, ws) = (x.as_slice()?, w.as_slice()?);
        let mut ys = y.as_slice_mut()?;
        let mut rs = rstd.as_mut().map(|r| r.as_slice_mut()).transpose()?;
        py.detach(|| forward_body(&xs, &ws, eps, &mut ys, rs.as_deref_mut()));
    }
    Ok((y.into_object(py)?, rstd.map(|r| r.into_object(py)).transpose()?))
}

/// [`rms_norm`]'s backward: `(dx, dweight)` from `x`, `weight`, the forward's `rstd` and `y`'s
/// cotangent `grad` (x's shape), new arrays of x's framework.
#[pyfunction]
fn rms_norm_backward<'py>(
    py: Python<'py>,
    x: TensorView<'_>,
    weight: TensorView<'_>,
    rstd: TensorView<'_>,
    grad: TensorView<'_>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    match x.dtype() {
        DataType::FLOAT32 => backward_typed::<f32>(py, x, weight, rstd, grad),
        DataType::FLOAT64 => backward_typed::<f64>(py, x, weight, rstd, grad),
        other => Err(PyTypeError::new_err(format!(
            "rms_norm_backward: x: expected float32 or float64, got {other}"
        ))),
    }
}

fn backward_typed<'py, T: Real>(
    py: Python<'py>,
    x: TensorView<'_>,
    weight: TensorView<'_>,
    rstd: TensorView<'_>,
    grad: TensorView<'_>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let x = typed2::<T>(x, "x")?;
    let w = typed1::<T>(weight, "weight")?;
    let r = typed1::<T>(rstd, "rstd")?;
    let g = typed2::<T>(grad, "grad")?;
    check_cols(x.shape(), w.shape()).map_err(PyValueError::new_err)?;
    if r.shape() != [x.shape()[0]] || g.shape() != x.shape() {
        return Err(PyValueError::new_err(format!(
            "rms_norm_backward: rstd {:?} and grad {:?} do not match x {:?}",
            r.shape(),
            g.shape(),
            x.shape()
        )));
    }
    let mut dx = x.empty_like::<T>(py)?;
    let mut dw = w.empty_like::<T>(py)?;
    {
        let (xs, ws, rs, gs) = (x.as_slice()?, w.as_slice()?, r.as_slice()?, g.as_slice()?);
        let (mut dxs, mut dws) = (dx.as_slice_mut()?, dw.as_slice_mut()?);
        py.detach(|| backward_body(&xs, &ws, &rs, &gs, &mut dxs, &mut dws));
    }
    Ok((dx.into_object(py)?, dw.into_object(py)?))
}

// --- inside jax.jit (and the native torch op's CPU kernel) ---

fn invalid(e: String) -> FfiError {
    FfiError::invalid_argument(e)
}

dlbridge::xla_handler! {
    /// `rms_norm` inside `jax.jit`: results `y` and `rstd` (the residual).
    pub(crate) fn rms_norm_xla(call, operands: 2, results: 2, attrs: ["eps"]) {
        let eps: f64 = call.attr("eps")?;
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => forward_ffi::<f32>(call, eps, true),
            DataType::FLOAT64 => forward_ffi::<f64>(call, eps, true),
            other => Err(invalid(format!("x: expected float32 or float64, got {other}"))),
        }
    }
}

dlbridge::xla_handler! {
    /// `rms_norm_inference` inside `jax.jit`: result `y`.
    pub(crate) fn rms_norm_inference_xla(call, operands: 2, results: 1, attrs: ["eps"]) {
        let eps: f64 = call.attr("eps")?;
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => forward_ffi::<f32>(call, eps, false),
            DataType::FLOAT64 => forward_ffi::<f64>(call, eps, false),
            other => Err(invalid(format!("x: expected float32 or float64, got {other}"))),
        }
    }
}

fn forward_ffi<T: Real>(call: &Call<'_>, eps: f64, with_rstd: bool) -> Result<()> {
    let x = call.input::<T, Rank<2>>(0, "x")?;
    let w = call.input::<T, Rank<1>>(1, "weight")?;
    check_cols(x.shape(), w.shape()).map_err(invalid)?;
    let mut y = call.output::<T, Rank<2>>(0, "y")?;
    if y.shape() != x.shape() {
        return Err(invalid(format!("y: shape {:?}, x {:?}", y.shape(), x.shape())));
    }
    let (xs, ws) = (x.as_slice()?, w.as_slice()?);
    let mut ys = y.as_slice_mut()?;
    if with_rstd {
        let mut r = call.output::<T, Rank<1>>(1, "rstd")?;
        if r.shape() != [x.shape()[0]] {
            return Err(invalid(format!("rstd: shape {:?}, x {:?}", r.shape(), x.shape())));
        }
        forward_body(&xs, &ws, eps, &mut ys, Some(&mut r.as_slice_mut()?));
    } else {
        forward_body(&xs, &ws, eps, &mut ys, None);
    }
    Ok(())
}

dlbridge::xla_handler! {
    /// `rms_norm_backward` inside `jax.jit`: results `dx` and `dweight`.
    pub(crate) fn rms_norm_backward_xla(call, operands: 4, results: 2) {
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => backward_ffi::<f32>(call),
            DataType::FLOAT64 => backward_ffi::<f64>(call),
            other => Err(invalid(format!("x: expected float32 or float64, got {other}"))),
        }
    }
}

fn backward_ffi<T: Real>(call: &Call<'_>) -> Result<()> {
    let x = call.input::<T, Rank<2>>(0, "x")?;
    let w = call.input::<T, Rank<1>>(1, "weight")?;
    let r = call.input::<T, Rank<1>>(2, "rstd")?;
    let g = call.input::<T, Rank<2>>(3, "grad")?;
    check_cols(x.shape(), w.shape()).map_err(invalid)?;
    if r.shape() != [x.shape()[0]] || g.shape() != x.shape() {
        return Err(invalid(format!(
            "rstd {:?} and grad {:?} do not match x {:?}",
            r.shape(),
            g.shape(),
            x.shape()
        )));
    }
    let mut dx = call.output::<T, Rank<2>>(0, "dx")?;
    let mut dw = call.output::<T, Rank<1>>(1, "dweight")?;
    if dx.shape() != x.shape() || dw.shape() != w.shape() {
        return Err(invalid("dx and dweight: shapes of x and weight expected".into()));
    }
    backward_body(
        &x.as_slice()?,
        &w.as_slice()?,
        &r.as_slice()?,
        &g.as_slice()?,
        &mut dx.as_slice_mut()?,
        &mut dw.as_slice_mut()?,
    );
    Ok(())
}

// --- registration ---

/// The forward's results: `y` like `x`, and the residual `rstd`, shaped by [`rows`], x's dtype.
const RMS_NORM_RESULTS: &[ResultDef<'static>] =
    &[ResultDef::like("y", "x"), ResultDef::rule("rstd", rows, ResultDType::Like("x")).residual()];

/// The backward's results: `dx` like `x`, `dweight` like `weight`.
const RMS_NORM_BACKWARD_RESULTS: &[ResultDef<'static>] =
    &[ResultDef::like("dx", "x"), ResultDef::like("dweight", "weight")];

/// Adds `rms_norm` (with its backward), `rms_norm_backward` and `rms_norm_inference` to `m` as
/// kernels of every mode, and the forward-mode kernels below.
pub(crate) fn add_kernels(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let backward = add_kernel(
        m,
        wrap_pyfunction!(rms_norm_backward, m)?.into_any(),
        &KernelDef {
            results: RMS_NORM_BACKWARD_RESULTS,
            ffi: Some(rms_norm_backward_xla),
            ..KernelDef::default()
        },
        None,
    )?;
    // The backward reads the residual by its name, and y's cotangent as `grad`; it returns the
    // gradients of x and weight, in that order.
    let grad = (backward, ("x", "weight", "rstd", "grad"), ("x", "weight")).into_pyobject(py)?.into_any();
    add_kernel(
        m,
        wrap_pyfunction!(rms_norm, m)?.into_any(),
        &KernelDef {
            results: RMS_NORM_RESULTS,
            attrs: &[("eps", "float64")],
            ffi: Some(rms_norm_xla),
            ..KernelDef::default()
        },
        Some(grad),
    )?;
    add_kernel(
        m,
        wrap_pyfunction!(rms_norm_inference, m)?.into_any(),
        &KernelDef {
            out: Some("x"),
            attrs: &[("eps", "float64")],
            ffi: Some(rms_norm_inference_xla),
            ..KernelDef::default()
        },
        None,
    )?;
    add_forward_mode_kernels(m)
}

// --- forward mode: rms_norm_fm, its jvp, and its backward's jvp ---

/// The tangents of `y = x * r * w` and `r = 1 / sqrt(mean(x**2) + eps)` per row: `dr = -r**3 *
/// mean(x * tx)`, `dy = (tx * r + x * dr) * w + x * r * tw`.
fn tangent_body<T: Real>(x: &[T], w: &[T], r: &[T], tx: &[T], tw: &[T], dy: &mut [T], dr: &mut [T]) {
    let cols = w.len();
    if cols == 0 {
        // No columns: rstd is NaN (the mean of nothing), and so is its tangent.
        dr.iter_mut().for_each(|v| *v = T::put(f64::NAN));
        return;
    }
    for (i, ((xr, txr), dyr)) in x.chunks(cols).zip(tx.chunks(cols)).zip(dy.chunks_mut(cols)).enumerate() {
        let ri = r[i].get();
        let m = xr.iter().zip(txr).map(|(a, b)| a.get() * b.get()).sum::<f64>() / cols as f64;
        let dri = -ri * ri * ri * m;
        dr[i] = T::put(dri);
        for (j, o) in dyr.iter_mut().enumerate() {
            let (xj, txj) = (xr[j].get(), txr[j].get());
            *o = T::put((txj * ri + xj * dri) * w[j].get() + xj * ri * tw[j].get());
        }
    }
}

/// The tangents of the backward `dx = r * g * w - x * r**3 * D`, `D = mean(g * w * x)` per row,
/// and `dweight = sum(g * x * r)` over the rows, given the tangents `tx`, `tw`, `tr`, `tg` of
/// its four arguments.
fn backward_tangent_body<T: Real>(
    (x, w, r, g): (&[T], &[T], &[T], &[T]),
    (tx, tw, tr, tg): (&[T], &[T], &[T], &[T]),
    ddx: &mut [T],
    ddw: &mut [T],
) {
    let cols = w.len();
    let mut acc = vec![0.0f64; cols];
    if cols > 0 {
        let rows = x.chunks(cols).zip(g.chunks(cols)).zip(tx.chunks(cols)).zip(tg.chunks(cols));
        for (i, ((((xr, gr), txr), tgr), o)) in rows.zip(ddx.chunks_mut(cols)).enumerate() {
            let (ri, tri) = (r[i].get(), tr[i].get());
            let (mut d, mut td) = (0.0f64, 0.0f64);
            for j in 0..cols {
                let (xj, gj, wj) = (xr[j].get(), gr[j].get(), w[j].get());
                d += gj * wj * xj;
                td += tgr[j].get() * wj * xj + gj * tw[j].get() * xj + gj * wj * txr[j].get();
            }
            let (d, td) = (d / cols as f64, td / cols as f64);
            let r3 = ri * ri * ri;
            for j in 0..cols {
                let (xj, gj, wj) = (xr[j].get(), gr[j].get(), w[j].get());
                let (txj, tgj, twj) = (txr[j].get(), tgr[j].get(), tw[j].get());
                o[j] = T::put(
                    tri * gj * wj + ri * tgj * wj + ri * gj * twj
                        - txj * r3 * d
                        - xj * 3.0 * ri * ri * tri * d
                        - xj * r3 * td,
                );
                acc[j] += tgj * xj * ri + gj * txj * ri + gj * xj * tri;
            }
        }
    }
    for (o, a) in ddw.iter_mut().zip(acc) {
        *o = T::put(a);
    }
}

/// Checks that `weight` has one value per column of `x`, and that each `(name, shape, expected)`
/// of `like` has its expected shape.
fn check_like(x: &[i64], w: &[i64], like: &[(&str, &[i64], &[i64])]) -> std::result::Result<(), String> {
    if w != [x[1]] {
        return Err(format!("weight: expected shape [{}] (x's row length), got {w:?}", x[1]));
    }
    for (name, got, want) in like {
        if got != want {
            return Err(format!("{name}: expected shape {want:?}, got {got:?}"));
        }
    }
    Ok(())
}

/// `rms_norm`'s jvp: `(dy, drstd)`, the tangents of its results `y` and `rstd` (the residual),
/// from `x`, `weight`, the forward's `rstd` and the tangents of `x` and `weight` (2-d
/// C-contiguous `x` and `tangent_x`, 1-d `weight`, `tangent_weight` and `rstd`, all float32 or
/// all float64), new arrays of x's framework.
#[pyfunction]
fn rms_norm_tangent<'py>(
    py: Python<'py>,
    x: TensorView<'_>,
    weight: TensorView<'_>,
    rstd: TensorView<'_>,
    tangent_x: TensorView<'_>,
    tangent_weight: TensorView<'_>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    match x.dtype() {
        DataType::FLOAT32 => tangent_typed::<f32>(py, [x, weight, rstd, tangent_x, tangent_weight]),
        DataType::FLOAT64 => tangent_typed::<f64>(py, [x, weight, rstd, tangent_x, tangent_weight]),
        other => Err(PyTypeError::new_err(format!(
            "rms_norm_tangent: x: expected float32 or float64, got {other}"
        ))),
    }
}

fn tangent_typed<'py, T: Real>(
    py: Python<'py>,
    [x, w, r, tx, tw]: [TensorView<'_>; 5],
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let (x, w, r) = (typed2::<T>(x, "x")?, typed1::<T>(w, "weight")?, typed1::<T>(r, "rstd")?);
    let (tx, tw) = (typed2::<T>(tx, "tangent_x")?, typed1::<T>(tw, "tangent_weight")?);
    let rows_shape = [x.shape()[0]];
    check_like(
        x.shape(),
        w.shape(),
        &[
            ("rstd", r.shape(), &rows_shape),
            ("tangent_x", tx.shape(), x.shape()),
            ("tangent_weight", tw.shape(), w.shape()),
        ],
    )
    .map_err(|e| PyValueError::new_err(format!("rms_norm_tangent: {e}")))?;
    let mut dy = x.empty_like::<T>(py)?;
    let mut dr = r.empty_like::<T>(py)?;
    {
        let (xs, ws, rs, txs, tws) =
            (x.as_slice()?, w.as_slice()?, r.as_slice()?, tx.as_slice()?, tw.as_slice()?);
        let (mut dys, mut drs) = (dy.as_slice_mut()?, dr.as_slice_mut()?);
        py.detach(|| tangent_body(&xs, &ws, &rs, &txs, &tws, &mut dys, &mut drs));
    }
    Ok((dy.into_object(py)?, dr.into_object(py)?))
}

/// The jvp of `rms_norm`'s backward: `(ddx, ddweight)`, the tangents of its results `dx` and
/// `dweight`, from its arguments `x`, `weight`, `rstd`, `grad` and their tangents (shapes as
/// the backward's, one dtype), new arrays of x's framework.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn rms_norm_backward_tangent<'py>(
    py: Python<'py>,
    x: TensorView<'_>,
    weight: TensorView<'_>,
    rstd: TensorView<'_>,
    grad: TensorView<'_>,
    tangent_x: TensorView<'_>,
    tangent_weight: TensorView<'_>,
    tangent_rstd: TensorView<'_>,
    tangent_grad: TensorView<'_>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let all = [x, weight, rstd, grad, tangent_x, tangent_weight, tangent_rstd, tangent_grad];
    match all[0].dtype() {
        DataType::FLOAT32 => backward_tangent_typed::<f32>(py, all),
        DataType::FLOAT64 => backward_tangent_typed::<f64>(py, all),
        other => Err(PyTypeError::new_err(format!(
            "rms_norm_backward_tangent: x: expected float32 or float64, got {other}"
        ))),
    }
}

fn backward_tangent_typed<'py, T: Real>(
    py: Python<'py>,
    [x, w, r, g, tx, tw, tr, tg]: [TensorView<'_>; 8],
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let (x, w, r, g) =
        (typed2::<T>(x, "x")?, typed1::<T>(w, "weight")?, typed1::<T>(r, "rstd")?, typed2::<T>(g, "grad")?);
    let (tx, tw) = (typed2::<T>(tx, "tangent_x")?, typed1::<T>(tw, "tangent_weight")?);
    let (tr, tg) = (typed1::<T>(tr, "tangent_rstd")?, typed2::<T>(tg, "tangent_grad")?);
    let rows_shape = [x.shape()[0]];
    check_like(
        x.shape(),
        w.shape(),
        &[
            ("rstd", r.shape(), &rows_shape),
            ("grad", g.shape(), x.shape()),
            ("tangent_x", tx.shape(), x.shape()),
            ("tangent_weight", tw.shape(), w.shape()),
            ("tangent_rstd", tr.shape(), &rows_shape),
            ("tangent_grad", tg.shape(), x.shape()),
        ],
    )
    .map_err(|e| PyValueError::new_err(format!("rms_norm_backward_tangent: {e}")))?;
    let mut ddx = x.empty_like::<T>(py)?;
    let mut ddw = w.empty_like::<T>(py)?;
    {
        let (xs, ws, rs, gs) = (x.as_slice()?, w.as_slice()?, r.as_slice()?, g.as_slice()?);
        let (txs, tws, trs, tgs) = (tx.as_slice()?, tw.as_slice()?, tr.as_slice()?, tg.as_slice()?);
        let (mut ddxs, mut ddws) = (ddx.as_slice_mut()?, ddw.as_slice_mut()?);
        py.detach(|| {
            backward_tangent_body((&xs, &ws, &rs, &gs), (&txs, &tws, &trs, &tgs), &mut ddxs, &mut ddws)
        });
    }
    Ok((ddx.into_object(py)?, ddw.into_object(py)?))
}

dlbridge::xla_handler! {
    /// `rms_norm_tangent` inside `jax.jit`: results `dy` and `drstd`.
    pub(crate) fn rms_norm_tangent_xla(call, operands: 5, results: 2) {
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => tangent_ffi::<f32>(call),
            DataType::FLOAT64 => tangent_ffi::<f64>(call),
            other => Err(invalid(format!("x: expected float32 or float64, got {other}"))),
        }
    }
}

fn tangent_ffi<T: Real>(call: &Call<'_>) -> Result<()> {
    let x = call.input::<T, Rank<2>>(0, "x")?;
    let w = call.input::<T, Rank<1>>(1, "weight")?;
    let r = call.input::<T, Rank<1>>(2, "rstd")?;
    let tx = call.input::<T, Rank<2>>(3, "tangent_x")?;
    let tw = call.input::<T, Rank<1>>(4, "tangent_weight")?;
    let mut dy = call.output::<T, Rank<2>>(0, "dy")?;
    let mut dr = call.output::<T, Rank<1>>(1, "drstd")?;
    let rows_shape = [x.shape()[0]];
    check_like(
        x.shape(),
        w.shape(),
        &[
            ("rstd", r.shape(), &rows_shape),
            ("tangent_x", tx.shape(), x.shape()),
            ("tangent_weight", tw.shape(), w.shape()),
            ("dy", dy.shape(), x.shape()),
            ("drstd", dr.shape(), &rows_shape),
        ],
    )
    .map_err(invalid)?;
    tangent_body(
        &x.as_slice()?,
        &w.as_slice()?,
        &r.as_slice()?,
        &tx.as_slice()?,
        &tw.as_slice()?,
        &mut dy.as_slice_mut()?,
        &mut dr.as_slice_mut()?,
    );
    Ok(())
}

dlbridge::xla_handler! {
    /// `rms_norm_backward_tangent` inside `jax.jit`: results `ddx` and `ddweight`.
    pub(crate) fn rms_norm_backward_tangent_xla(call, operands: 8, results: 2) {
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => backward_tangent_ffi::<f32>(call),
            DataType::FLOAT64 => backward_tangent_ffi::<f64>(call),
            other => Err(invalid(format!("x: expected float32 or float64, got {other}"))),
        }
    }
}

fn backward_tangent_ffi<T: Real>(call: &Call<'_>) -> Result<()> {
    let x = call.input::<T, Rank<2>>(0, "x")?;
    let w = call.input::<T, Rank<1>>(1, "weight")?;
    let r = call.input::<T, Rank<1>>(2, "rstd")?;
    let g = call.input::<T, Rank<2>>(3, "grad")?;
    let tx = call.input::<T, Rank<2>>(4, "tangent_x")?;
    let tw = call.input::<T, Rank<1>>(5, "tangent_weight")?;
    let tr = call.input::<T, Rank<1>>(6, "tangent_rstd")?;
    let tg = call.input::<T, Rank<2>>(7, "tangent_grad")?;
    let mut ddx = call.output::<T, Rank<2>>(0, "ddx")?;
    let mut ddw = call.output::<T, Rank<1>>(1, "ddweight")?;
    let rows_shape = [x.shape()[0]];
    check_like(
        x.shape(),
        w.shape(),
        &[
            ("rstd", r.shape(), &rows_shape),
            ("grad", g.shape(), x.shape()),
            ("tangent_x", tx.shape(), x.shape()),
            ("tangent_weight", tw.shape(), w.shape()),
            ("tangent_rstd", tr.shape(), &rows_shape),
            ("tangent_grad", tg.shape(), x.shape()),
            ("ddx", ddx.shape(), x.shape()),
            ("ddweight", ddw.shape(), w.shape()),
        ],
    )
    .map_err(invalid)?;
    backward_tangent_body(
        (&x.as_slice()?, &w.as_slice()?, &r.as_slice()?, &g.as_slice()?),
        (&tx.as_slice()?, &tw.as_slice()?, &tr.as_slice()?, &tg.as_slice()?),
        &mut ddx.as_slice_mut()?,
        &mut ddw.as_slice_mut()?,
    );
    Ok(())
}

/// The jvp's results, one tangent per result of `rms_norm`: `dy` like `x`, `drstd` shaped by
/// [`rows`] (the residual's tangent).
const TANGENT_RESULTS: &[ResultDef<'static>] =
    &[ResultDef::like("dy", "x"), ResultDef::rule("drstd", rows, ResultDType::Like("x"))];

/// The results of the backward's jvp: `ddx` like `x`, `ddweight` like `weight`.
const BACKWARD_TANGENT_RESULTS: &[ResultDef<'static>] =
    &[ResultDef::like("ddx", "x"), ResultDef::like("ddweight", "weight")];

/// Adds `rms_norm_fm` (with its backward and jvp), `rms_norm_fm_backward` (with its jvp),
/// `rms_norm_tangent` and `rms_norm_backward_tangent` to `m` as kernels of every mode.
fn add_forward_mode_kernels(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // The backward's jvp, and the backward naming it (twice differentiable forward over reverse).
    let backward_tangent = add_kernel(
        m,
        wrap_pyfunction!(rms_norm_backward_tangent, m)?.into_any(),
        &KernelDef {
            results: BACKWARD_TANGENT_RESULTS,
            ffi: Some(rms_norm_backward_tangent_xla),
            ..KernelDef::default()
        },
        None,
    )?;
    let args = ("x", "weight", "rstd", "grad", "tangent_x", "tangent_weight", "tangent_rstd", "tangent_grad");
    let backward_jvp = (backward_tangent, args).into_pyobject(py)?.into_any();
    let backward = add_kernel(
        m,
        wrap_pyfunction!(rms_norm_backward, m)?.into_any(),
        &KernelDef {
            name: Some("rms_norm_fm_backward"),
            results: RMS_NORM_BACKWARD_RESULTS,
            ffi: Some(rms_norm_backward_xla),
            jvp: Some(&backward_jvp),
            ..KernelDef::default()
        },
        None,
    )?;
    let grad = (backward, ("x", "weight", "rstd", "grad"), ("x", "weight")).into_pyobject(py)?.into_any();
    // The forward's jvp: a kernel with a result per result of rms_norm, the residual's included.
    let tangent = add_kernel(
        m,
        wrap_pyfunction!(rms_norm_tangent, m)?.into_any(),
        &KernelDef { results: TANGENT_RESULTS, ffi: Some(rms_norm_tangent_xla), ..KernelDef::default() },
        None,
    )?;
    // It reads the residual by its name, and the tangents of the tensor parameters.
    let jvp = (tangent, ("x", "weight", "rstd", "tangent_x", "tangent_weight")).into_pyobject(py)?.into_any();
    add_kernel(
        m,
        wrap_pyfunction!(rms_norm, m)?.into_any(),
        &KernelDef {
            name: Some("rms_norm_fm"),
            results: RMS_NORM_RESULTS,
            attrs: &[("eps", "float64")],
            ffi: Some(rms_norm_xla),
            jvp: Some(&jvp),
            ..KernelDef::default()
        },
        Some(grad),
    )?;
    Ok(())
}
