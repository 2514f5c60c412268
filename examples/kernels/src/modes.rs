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

/// Softmax's Jacobian-vector product: `out = y * (t - sum(t * y))` row by row, `y` the softmax
/// and `t` the tangent of its argument. Softmax's Jacobian, `diag(y) - y yᵀ`, is symmetric, so
/// the jvp is the backward's formula with the tangent for the cotangent.
pub(crate) fn softmax_jvp_body<T: Real>(y: &[T], t: &[T], out: &mut [T], cols: usize) {
    softmax_backward_body(y, t, out, cols);
}

/// The jvp of `b(y, g) = y * (g - sum(g * y))` (softmax's backward, and its jvp, the same
/// function): `out = dy * (g - s) + y * (dg - ds)` row by row, with `s = sum(g * y)` and
/// `ds = sum(dg * y + g * dy)`.
pub(crate) fn softmax_backward_jvp_body<T: Real>(
    y: &[T],
    g: &[T],
    dy: &[T],
    dg: &[T],
    out: &mut [T],
    cols: usize,
) {
    if cols == 0 {
        return;
    }
    let rows = y.par_chunks(cols).zip(g.par_chunks(cols)).zip(dy.par_chunks(cols).zip(dg.par_chunks(cols)));
    out.par_chunks_mut(cols).zip(rows).for_each(|(o, ((y, g), (dy, dg)))| {
        let (mut s, mut ds) = (0.0, 0.0);
        for i in 0..y.len() {
            s += g[i].get() * y[i].get();
            ds += dg[i].get() * y[i].get() + g[i].get() * dy[i].get();
        }
        for i in 0..o.len() {
            o[i] = T::put(dy[i].get() * (g[i].get() - s) + y[i].get() * (dg[i].get() - ds));
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
    rows_of::<2>(py, Rows::Backward, ["y", "g"], [y, g])
}

/// Softmax's jvp: `y * (t - sum(t * y, axis=-1))` for a softmax `y` and the tangent `t` of its
/// argument (2-d C-contiguous, one dtype: float32, float64 or bfloat16), as a new array of y's
/// framework.
#[pyfunction]
fn softmax_jvp<'py>(py: Python<'py>, y: TensorView<'_>, t: TensorView<'_>) -> PyResult<Bound<'py, PyAny>> {
    rows_of::<2>(py, Rows::Jvp, ["y", "t"], [y, t])
}

/// The jvp of softmax's backward `y * (g - sum(g * y))` (and of softmax's jvp, the same function)
/// at `(y, g)` for tangents `(dy, dg)` (2-d C-contiguous, one shape and dtype), as a new array of
/// y's framework: what makes softmax twice differentiable in forward over reverse mode
/// (`jax.hessian`, `torch.func.hessian`) and forward over forward.
#[pyfunction]
fn softmax_backward_jvp<'py>(
    py: Python<'py>,
    y: TensorView<'_>,
    g: TensorView<'_>,
    dy: TensorView<'_>,
    dg: TensorView<'_>,
) -> PyResult<Bound<'py, PyAny>> {
    rows_of::<4>(py, Rows::BackwardJvp, ["y", "g", "dy", "dg"], [y, g, dy, dg])
}

/// Which of softmax's derivatives [`rows_of`] computes.
#[derive(Clone, Copy)]
enum Rows {
    /// `softmax_backward(y, g)`.
    Backward,
    /// `softmax_jvp(y, t)`.
    Jvp,
    /// `softmax_backward_jvp(y, g, dy, dg)`.
    BackwardJvp,
}

impl Rows {
    fn name(self) -> &'static str {
        match self {
            Rows::Backward => "softmax_backward",
            Rows::Jvp => "softmax_jvp",
            Rows::BackwardJvp => "softmax_backward_jvp",
        }
    }
}

/// One of softmax's derivatives (`kind`) over `N` 2-d C-contiguous arrays of one shape and dtype
/// (float32, float64 or bfloat16), as a new array of the first one's framework.
fn rows_of<'py, const N: usize>(
    py: Python<'py>,
    kind: Rows,
    names: [&str; N],
    args: [TensorView<'_>; N],
) -> PyResult<Bound<'py, PyAny>> {
    match args[0].dtype() {
        DataType::FLOAT32 => rows_typed::<f32, N>(py, kind, names, args),
        DataType::FLOAT64 => rows_typed::<f64, N>(py, kind, names, args),
        DataType::BFLOAT16 => rows_typed::<bf16, N>(py, kind, names, args),
        other => Err(PyTypeError::new_err(format!(
            "{}: {}: expected float32, float64 or bfloat16, got {other}",
            kind.name(),
            names[0]
        ))),
    }
}

fn rows_typed<'py, T: Real, const N: usize>(
    py: Python<'py>,
    kind: Rows,
    names: [&str; N],
    args: [TensorView<'_>; N],
) -> PyResult<Bound<'py, PyAny>> {
    let mut typed = Vec::with_capacity(N);
    for (a, n) in args.into_iter().zip(names) {
        typed.push(a.typed::<T, Rank<2>, C, Cpu>().map_err(|e| argument_error(n, e))?);
    }
    for (t, n) in typed.iter().zip(names).skip(1) {
        if t.shape() != typed[0].shape() {
            return Err(PyValueError::new_err(format!(
                "{}: {} and {n} have shapes {:?} and {:?}",
                kind.name(),
                names[0],
                typed[0].shape(),
                t.shape()
            )));
        }
    }
    let cols = typed[0].shape()[1] as usize;
    let mut out = typed[0].empty_like::<T>(py)?;
    {
        let slices = typed.iter().map(|t| t.as_slice()).collect::<Result<Vec<_>, _>>()?;
        let mut os = out.as_slice_mut()?;
        let s: Vec<&[T]> = slices.iter().map(|s| &**s).collect();
        py.detach(|| match (kind, s.as_slice()) {
            (Rows::Backward, [y, g]) => softmax_backward_body(y, g, &mut os, cols),
            (Rows::Jvp, [y, t]) => softmax_jvp_body(y, t, &mut os, cols),
            (Rows::BackwardJvp, [y, g, dy, dg]) => softmax_backward_jvp_body(y, g, dy, dg, &mut os, cols),
            _ => unreachable!("each kind is called with its number of arrays"),
        });
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
    /// `softmax_jvp` inside `jax.jit`.
    pub(crate) fn softmax_jvp_xla(call, operands: 2, results: 1) {
        match call.input_any(0, "y")?.dtype() {
            DataType::FLOAT32 => rows_ffi::<f32, 2>(call, Rows::Jvp, ["y", "t"]),
            DataType::FLOAT64 => rows_ffi::<f64, 2>(call, Rows::Jvp, ["y", "t"]),
            DataType::BFLOAT16 => rows_ffi::<bf16, 2>(call, Rows::Jvp, ["y", "t"]),
            other => Err(unsupported("y", other, "float32, float64 or bfloat16")),
        }
    }
}

dlbridge::xla_handler! {
    /// `softmax_backward_jvp` inside `jax.jit`.
    pub(crate) fn softmax_backward_jvp_xla(call, operands: 4, results: 1) {
        let names = ["y", "g", "dy", "dg"];
        match call.input_any(0, "y")?.dtype() {
            DataType::FLOAT32 => rows_ffi::<f32, 4>(call, Rows::BackwardJvp, names),
            DataType::FLOAT64 => rows_ffi::<f64, 4>(call, Rows::BackwardJvp, names),
            DataType::BFLOAT16 => rows_ffi::<bf16, 4>(call, Rows::BackwardJvp, names),
            other => Err(unsupported("y", other, "float32, float64 or bfloat16")),
        }
    }
}

/// [`rows_of`] inside `jax.jit`: operands `0..N` of one shape, result 0 of that shape.
fn rows_ffi<T: Real, const N: usize>(call: &Call<'_>, kind: Rows, names: [&'static str; N]) -> Result<()> {
    let mut inputs = Vec::with_capacity(N);
    for (i, n) in names.iter().enumerate() {
        inputs.push(call.input::<T, Rank<2>>(i, n)?);
    }
    let mut out = call.output::<T, Rank<2>>(0, "out")?;
    for (t, n) in inputs.iter().zip(names).skip(1) {
        same_shape(&format!("{} and {n}", names[0]), inputs[0].shape(), t.shape())?;
    }
    same_shape(&format!("{} and out", names[0]), inputs[0].shape(), out.shape())?;
    let cols = inputs[0].shape()[1] as usize;
    let slices = inputs.iter().map(|t| t.as_slice()).collect::<Result<Vec<_>>>()?;
    let s: Vec<&[T]> = slices.iter().map(|s| &**s).collect();
    let mut os = out.as_slice_mut()?;
    match (kind, s.as_slice()) {
        (Rows::Backward, [y, g]) => softmax_backward_body(y, g, &mut os, cols),
        (Rows::Jvp, [y, t]) => softmax_jvp_body(y, t, &mut os, cols),
        (Rows::BackwardJvp, [y, g, dy, dg]) => softmax_backward_jvp_body(y, g, dy, dg, &mut os, cols),
        _ => return Err(FfiError::invalid_argument(format!("{}: wrong number of operands", kind.name()))),
    }
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
/// `torch.compile`), and adds softmax's derivatives: `softmax_backward`, `softmax_jvp` and
/// `softmax_backward_jvp`.
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
    // softmax's derivatives, each a kernel: its backward and its jvp (the tangent of its result),
    // and the jvp of those two, which makes softmax twice differentiable (hessian: forward over
    // reverse; jacfwd of jacfwd). The backward names no backward: double backward is refused.
    let second = add_kernel(
        m,
        wrap_pyfunction!(softmax_backward_jvp, m)?.into_any(),
        &KernelDef { out: Some("y"), ffi: Some(softmax_backward_jvp_xla), ..KernelDef::default() },
        None,
    )?;
    let backward_jvp = (&second, ("y", "g", "tangent_y", "tangent_g")).into_pyobject(py)?.into_any();
    let backward = add_kernel(
        m,
        wrap_pyfunction!(softmax_backward, m)?.into_any(),
        &KernelDef {
            out: Some("y"),
            ffi: Some(softmax_backward_xla),
            jvp: Some(&backward_jvp),
            ..KernelDef::default()
        },
        None,
    )?;
    let jvp_jvp = (&second, ("y", "t", "tangent_y", "tangent_t")).into_pyobject(py)?.into_any();
    let jvp = add_kernel(
        m,
        wrap_pyfunction!(softmax_jvp, m)?.into_any(),
        &KernelDef {
            out: Some("y"),
            ffi: Some(softmax_jvp_xla),
            jvp: Some(&jvp_jvp),
            ..KernelDef::default()
        },
        None,
    )?;
    let softmax_grad = (backward, ("out", "grad"), ("x",)).into_pyobject(py)?.into_any();
    let softmax_jvp_rule = (jvp, ("out", "tangent_x")).into_pyobject(py)?.into_any();
    add_kernel(
        m,
        f("softmax")?,
        &KernelDef {
            out: Some("x"),
            ffi: Some(softmax_xla),
            jvp: Some(&softmax_jvp_rule),
            ..KernelDef::default()
        },
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
