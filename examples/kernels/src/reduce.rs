//! String and array attributes: `reduce(x, axes, mode="sum")`, a sum or mean over the axes an
//! `int64[]` attribute names, chosen by a `str` attribute, whose result's shape comes from a rule
//! written in Rust ([`reduced`]) reading both; `poly(x, coeffs)`, a polynomial whose
//! coefficients are a `float64[]` attribute; and `channel_affine(x, scale, shift, skip)`, a
//! per-channel affine map over the last axis with a `float32[]`, an `int32[]` and a `bool[]`
//! attribute (the handler reads them as `&[f32]`, `&[i32]`, `&[bool]`).
//!
//! Each body is written once, run by the eager `#[pyfunction]` (which gets `axes` as a
//! `Vec<i64>`, `mode` as a `&str`) and by an XLA FFI handler (which reads them as `&[i64]` and
//! `&str` from the call); the same handler is the native torch op's CPU kernel (schema
//! `reduce(Tensor x, int[] axes, str mode="sum") -> Tensor`).

use dlbridge::python::{Attrs, KernelDef, ResultDType, ResultDef, add_kernel};
use dlbridge::spec::{AnyShape, C, Cpu};
use dlbridge::xla::{Call, FfiError, Result};
use dlbridge::{DataType, TensorView, argument_error};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::Real;

// --- the shape rule, one for every mode ---

/// The reduced axes of a tensor of `rank` dimensions, in order (negative ones count from the
/// end), checked: each in range, none twice.
fn normalized(axes: &[i64], rank: usize) -> std::result::Result<Vec<usize>, String> {
    let mut out = Vec::with_capacity(axes.len());
    for &a in axes {
        let r = rank as i64;
        let n = if a < 0 { a + r } else { a };
        if !(0..r).contains(&n) {
            return Err(format!("axes: axis {a} is out of range for a {rank}-d x"));
        }
        if out.contains(&(n as usize)) {
            return Err(format!("axes: axis {a} is named twice in {axes:?}"));
        }
        out.push(n as usize);
    }
    out.sort_unstable();
    Ok(out)
}

fn mode_of(mode: &str) -> std::result::Result<bool, String> {
    match mode {
        "sum" => Ok(false),
        "mean" => Ok(true),
        other => Err(format!("mode: expected \"sum\" or \"mean\", got {other:?}")),
    }
}

/// The result's shape: `x`'s without the axes `axes` names; `mode` is checked here too, so a
/// wrong one is refused when the call is traced (under `jax.jit` and `torch.compile`), before
/// anything runs.
pub(crate) fn reduced(shapes: &[&[i64]], attrs: &Attrs<'_>) -> std::result::Result<Vec<i64>, String> {
    let x = shapes.first().ok_or("no x")?;
    mode_of(attrs.str("mode")?)?;
    let axes = normalized(attrs.i64s("axes")?, x.len())?;
    Ok(x.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, &d)| d).collect())
}

// --- the bodies ---

/// Sums (or averages) `x` of extents `shape` (row-major) over `axes` (normalized, sorted) into
/// `out` (the remaining extents, row-major).
fn reduce_body<T: Real>(x: &[T], shape: &[i64], axes: &[usize], mean: bool, out: &mut [T]) {
    let mut acc = vec![0.0f64; out.len()];
    let rank = shape.len();
    let mut index = vec![0i64; rank];
    for v in x {
        // The output position: the row-major index over the kept axes.
        let mut o = 0usize;
        for (d, (&i, &n)) in index.iter().zip(shape).enumerate() {
            if !axes.contains(&d) {
                o = o * n as usize + i as usize;
            }
        }
        acc[o] += v.get();
        for d in (0..rank).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    let count: i64 = axes.iter().map(|&a| shape[a]).product();
    for (o, a) in out.iter_mut().zip(acc) {
        // (A mean over no elements is NaN, as numpy's.)
        *o = T::put(if mean { a / count as f64 } else { a });
    }
}

/// `out = sum(coeffs[k] * x**k)` elementwise (Horner).
fn poly_body<T: Real>(x: &[T], coeffs: &[f64], out: &mut [T]) {
    for (o, v) in out.iter_mut().zip(x) {
        let v = v.get();
        *o = T::put(coeffs.iter().rev().fold(0.0, |acc, c| acc * v + c));
    }
}

/// `out[..., j] = x[..., j]` where `skip[j]`, else `x[..., j] * scale[j] + shift[j]` (channels
/// of the last axis; one entry per channel in each array).
fn channel_affine_body<T: Real>(x: &[T], scale: &[f32], shift: &[i32], skip: &[bool], out: &mut [T]) {
    let c = scale.len();
    if c == 0 {
        return;
    }
    for (o, v) in out.chunks_mut(c).zip(x.chunks(c)) {
        for j in 0..c {
            let v = v[j].get();
            o[j] = T::put(if skip[j] { v } else { v * f64::from(scale[j]) + f64::from(shift[j]) });
        }
    }
}

/// The channel count the arrays must all have: x's last extent.
fn check_channels(x: &[i64], scale: usize, shift: usize, skip: usize) -> std::result::Result<(), String> {
    let c = x.last().copied().unwrap_or(1);
    if [scale, shift, skip].iter().any(|&n| n as i64 != c) {
        return Err(format!(
            "scale, shift and skip need one entry per channel (x's last extent, {c}), got {scale}, {shift} and {skip}"
        ));
    }
    Ok(())
}

// --- eager ---

/// The sum (`mode="sum"`) or mean (`mode="mean"`) of `x` (float32 or float64, C-contiguous, any
/// rank) over the axes `axes` (negative ones count from the end), as a new array of x's
/// framework, of x's shape without those axes. The function returns it as a 1-tuple (a kernel
/// declaring its `results` returns each, in a tuple); the kernel returns the array.
#[pyfunction]
#[pyo3(signature = (x, axes, mode = "sum"))]
fn reduce<'py>(
    py: Python<'py>,
    x: TensorView<'_>,
    axes: Vec<i64>,
    mode: &str,
) -> PyResult<(Bound<'py, PyAny>,)> {
    let total = match x.dtype() {
        DataType::FLOAT32 => reduce_typed::<f32>(py, x, &axes, mode),
        DataType::FLOAT64 => reduce_typed::<f64>(py, x, &axes, mode),
        other => Err(PyTypeError::new_err(format!("reduce: x: expected float32 or float64, got {other}"))),
    };
    Ok((total?,))
}

fn reduce_typed<'py, T: Real>(
    py: Python<'py>,
    x: TensorView<'_>,
    axes: &[i64],
    mode: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let x = x.typed::<T, AnyShape, C, Cpu>().map_err(|e| argument_error("x", e))?;
    let mean = mode_of(mode).map_err(PyValueError::new_err)?;
    let norm = normalized(axes, x.shape().len()).map_err(PyValueError::new_err)?;
    // The result's shape by the kernel's own rule.
    let mut attrs = Attrs::new();
    attrs.insert("axes", dlbridge::python::AttrValue::Ints(axes));
    attrs.insert("mode", dlbridge::python::AttrValue::Str(mode));
    let shape = reduced(&[x.shape()], &attrs).map_err(PyValueError::new_err)?;
    let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    let mut out = x.framework(py)?.empty::<T>(py, &shape, x.device())?;
    {
        let xs = x.as_slice()?;
        let mut os = out.as_slice_mut()?;
        let dims = x.shape().to_vec();
        py.detach(|| reduce_body(&xs, &dims, &norm, mean, &mut os));
    }
    out.into_object(py)
}

/// `sum(coeffs[k] * x**k)` elementwise for a float32 or float64 C-contiguous `x` (any rank), as
/// a new array of x's framework.
#[pyfunction]
fn poly<'py>(py: Python<'py>, x: TensorView<'_>, coeffs: Vec<f64>) -> PyResult<Bound<'py, PyAny>> {
    match x.dtype() {
        DataType::FLOAT32 => poly_typed::<f32>(py, x, &coeffs),
        DataType::FLOAT64 => poly_typed::<f64>(py, x, &coeffs),
        other => Err(PyTypeError::new_err(format!("poly: x: expected float32 or float64, got {other}"))),
    }
}

fn poly_typed<'py, T: Real>(
    py: Python<'py>,
    x: TensorView<'_>,
    coeffs: &[f64],
) -> PyResult<Bound<'py, PyAny>> {
    let x = x.typed::<T, AnyShape, C, Cpu>().map_err(|e| argument_error("x", e))?;
    let mut out = x.empty_like::<T>(py)?;
    {
        let xs = x.as_slice()?;
        let mut os = out.as_slice_mut()?;
        py.detach(|| poly_body(&xs, coeffs, &mut os));
    }
    out.into_object(py)
}

/// `x * scale + shift` per channel of the last axis of a float32 or float64 C-contiguous `x` (at
/// least 1-d), channels where `skip` is true left as they are; `scale`, `shift` and `skip` one
/// entry per channel (float32, int32 and bool values). A new array of x's framework.
#[pyfunction]
fn channel_affine<'py>(
    py: Python<'py>,
    x: TensorView<'_>,
    scale: Vec<f32>,
    shift: Vec<i32>,
    skip: Vec<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    match x.dtype() {
        DataType::FLOAT32 => channel_affine_typed::<f32>(py, x, &scale, &shift, &skip),
        DataType::FLOAT64 => channel_affine_typed::<f64>(py, x, &scale, &shift, &skip),
        other => {
            Err(PyTypeError::new_err(format!("channel_affine: x: expected float32 or float64, got {other}")))
        }
    }
}

fn channel_affine_typed<'py, T: Real>(
    py: Python<'py>,
    x: TensorView<'_>,
    scale: &[f32],
    shift: &[i32],
    skip: &[bool],
) -> PyResult<Bound<'py, PyAny>> {
    let x = x.typed::<T, AnyShape, C, Cpu>().map_err(|e| argument_error("x", e))?;
    check_channels(x.shape(), scale.len(), shift.len(), skip.len()).map_err(PyValueError::new_err)?;
    let mut out = x.empty_like::<T>(py)?;
    {
        let xs = x.as_slice()?;
        let mut os = out.as_slice_mut()?;
        channel_affine_body(&xs, scale, shift, skip, &mut os);
    }
    out.into_object(py)
}

// --- inside jax.jit (and the native torch op's CPU kernel) ---

fn invalid(e: String) -> FfiError {
    FfiError::invalid_argument(e)
}

dlbridge::xla_handler! {
    /// `reduce` inside `jax.jit`: `axes` an array attribute, `mode` a string attribute.
    pub(crate) fn reduce_xla(call, operands: 1, results: 1, attrs: ["axes", "mode"]) {
        let axes: &[i64] = call.attr("axes")?;
        let mode: &str = call.attr("mode")?;
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => reduce_ffi::<f32>(call, axes, mode),
            DataType::FLOAT64 => reduce_ffi::<f64>(call, axes, mode),
            other => Err(invalid(format!("x: expected float32 or float64, got {other}"))),
        }
    }
}

fn reduce_ffi<T: Real>(call: &Call<'_>, axes: &[i64], mode: &str) -> Result<()> {
    let x = call.input::<T, AnyShape>(0, "x")?;
    let mean = mode_of(mode).map_err(invalid)?;
    let norm = normalized(axes, x.shape().len()).map_err(invalid)?;
    let mut attrs = Attrs::new();
    attrs.insert("axes", dlbridge::python::AttrValue::Ints(axes));
    attrs.insert("mode", dlbridge::python::AttrValue::Str(mode));
    let want = reduced(&[x.shape()], &attrs).map_err(invalid)?;
    let mut out = call.output::<T, AnyShape>(0, "out")?;
    if out.shape() != want.as_slice() {
        return Err(invalid(format!("out: shape {:?}, the rule says {want:?}", out.shape())));
    }
    reduce_body(&x.as_slice()?, x.shape(), &norm, mean, &mut out.as_slice_mut()?);
    Ok(())
}

dlbridge::xla_handler! {
    /// `poly` inside `jax.jit`: `coeffs` an array attribute of float64.
    pub(crate) fn poly_xla(call, operands: 1, results: 1, attrs: ["coeffs"]) {
        let coeffs: &[f64] = call.attr("coeffs")?;
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => poly_ffi::<f32>(call, coeffs),
            DataType::FLOAT64 => poly_ffi::<f64>(call, coeffs),
            other => Err(invalid(format!("x: expected float32 or float64, got {other}"))),
        }
    }
}

fn poly_ffi<T: Real>(call: &Call<'_>, coeffs: &[f64]) -> Result<()> {
    let x = call.input::<T, AnyShape>(0, "x")?;
    let mut out = call.output::<T, AnyShape>(0, "out")?;
    if out.shape() != x.shape() {
        return Err(invalid(format!("out: shape {:?}, x {:?}", out.shape(), x.shape())));
    }
    poly_body(&x.as_slice()?, coeffs, &mut out.as_slice_mut()?);
    Ok(())
}

dlbridge::xla_handler! {
    /// `channel_affine` inside `jax.jit`: array attributes of float32, int32 and bool.
    pub(crate) fn channel_affine_xla(call, operands: 1, results: 1, attrs: ["scale", "shift", "skip"]) {
        let scale: &[f32] = call.attr("scale")?;
        let shift: &[i32] = call.attr("shift")?;
        let skip: &[bool] = call.attr("skip")?;
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => channel_affine_ffi::<f32>(call, scale, shift, skip),
            DataType::FLOAT64 => channel_affine_ffi::<f64>(call, scale, shift, skip),
            other => Err(invalid(format!("x: expected float32 or float64, got {other}"))),
        }
    }
}

fn channel_affine_ffi<T: Real>(call: &Call<'_>, scale: &[f32], shift: &[i32], skip: &[bool]) -> Result<()> {
    let x = call.input::<T, AnyShape>(0, "x")?;
    check_channels(x.shape(), scale.len(), shift.len(), skip.len()).map_err(invalid)?;
    let mut out = call.output::<T, AnyShape>(0, "out")?;
    if out.shape() != x.shape() {
        return Err(invalid(format!("out: shape {:?}, x {:?}", out.shape(), x.shape())));
    }
    channel_affine_body(&x.as_slice()?, scale, shift, skip, &mut out.as_slice_mut()?);
    Ok(())
}

// --- registration ---

/// `reduce`'s result, `total`: shaped by [`reduced`], x's dtype.
const REDUCE_RESULTS: &[ResultDef<'static>] = &[ResultDef::rule("total", reduced, ResultDType::Like("x"))];

/// Adds `reduce`, `poly` and `channel_affine` to `m` as kernels of every mode.
pub(crate) fn add_kernels(m: &Bound<'_, PyModule>) -> PyResult<()> {
    add_kernel(
        m,
        wrap_pyfunction!(reduce, m)?.into_any(),
        &KernelDef {
            results: REDUCE_RESULTS,
            attrs: &[("axes", "int64[]"), ("mode", "str")],
            ffi: Some(reduce_xla),
            ..KernelDef::default()
        },
        None,
    )?;
    add_kernel(
        m,
        wrap_pyfunction!(poly, m)?.into_any(),
        &KernelDef {
            out: Some("x"),
            attrs: &[("coeffs", "float64[]")],
            ffi: Some(poly_xla),
            ..KernelDef::default()
        },
        None,
    )?;
    add_kernel(
        m,
        wrap_pyfunction!(channel_affine, m)?.into_any(),
        &KernelDef {
            out: Some("x"),
            attrs: &[("scale", "float32[]"), ("shift", "int32[]"), ("skip", "bool[]")],
            ffi: Some(channel_affine_xla),
            ..KernelDef::default()
        },
        None,
    )?;
    Ok(())
}
