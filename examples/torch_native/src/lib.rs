//! Kernels as native torch ops through torch's stable C ABI (`dlbridge::torch_stable`), with no
//! link-time dependency on torch: `dlbridge_torch_native.register()` (after `import torch`) finds
//! the process's libtorch and registers, in namespace `dlbridge_native`:
//!
//! - `saxpy(Tensor x, Tensor y, float a) -> Tensor` (`a * x + y`, float32 or float64) and
//!   `saxpy_(Tensor x, Tensor(a!) y, float a) -> ()` (`y += a * x`, float32, bumping `y`'s
//!   version counter through `dlbridge::python::install_torch_version_hooks`): their CPU kernel
//!   is the XLA FFI handler `jax.jit` would call, run through the adapter; their Meta kernel the
//!   output rule;
//! - `increment_(Tensor(a!) x) -> ()` (`x += 1`, float32 or int16, any shape and strides);
//! - `empty(Tensor x) -> ()`: a kernel that does nothing (the cost of a call), and
//!   `empty_xla(Tensor x) -> ()`: the same through the XLA adapter;
//! - `fails(Tensor x, str why) -> Tensor`: a kernel that refuses with `why` (a `RuntimeError`).
//!
//! And `empty_like`, a `dlbridge.kernels` kernel made by `add_kernel` (an empty body returning a
//! new float32 tensor like `x`), which `dlbridge.kernels` makes a native op by itself (namespace
//! `dlbridge_kernels`): `bench_empty.py --kernels` compares it with the same kernel as a Python
//! custom op.

use dlbridge::DataType;
use dlbridge::spec::{AnyShape, Rank};
use dlbridge::torch_stable::xla::{AttrType, NativeOp, OutRule, XlaOp};
use dlbridge::torch_stable::{
    ArgKind, Args, KernelError, NativeKernel, OpSignature, Outputs, Torch, register_kernel,
};
use dlbridge::xla::{Call, FfiError, Result};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

const NS: &str = "dlbridge_native";

dlbridge::xla_handler! {
    /// `out = a * x + y` (float32 or float64 vectors).
    fn saxpy_xla(call, operands: 2, results: 1, attrs: ["a"]) {
        let a: f64 = call.attr("a")?;
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => saxpy::<f32>(call, a as f32),
            DataType::FLOAT64 => saxpy::<f64>(call, a),
            other => Err(FfiError::invalid_argument(format!("x: {other} (float32 or float64)"))),
        }
    }
}

fn saxpy<T: dlbridge::Element + Copy + std::ops::Mul<Output = T> + std::ops::Add<Output = T>>(
    call: &Call<'_>,
    a: T,
) -> Result<()> {
    let x = call.input::<T, Rank<1>>(0, "x")?;
    let y = call.input::<T, Rank<1>>(1, "y")?;
    let mut out = call.output::<T, Rank<1>>(0, "out")?;
    if x.shape() != y.shape() {
        return Err(FfiError::invalid_argument(format!(
            "x and y: shapes {:?} and {:?}",
            x.shape(),
            y.shape()
        )));
    }
    let (x, y) = (x.as_slice()?, y.as_slice()?);
    for ((o, &x), &y) in out.as_slice_mut()?.iter_mut().zip(x.iter()).zip(y.iter()) {
        *o = a * x + y;
    }
    Ok(())
}

dlbridge::xla_handler! {
    /// `y += a * x` in place (float32): result 0 is operand `y`'s memory.
    fn saxpy_inplace_xla(call, operands: 2, results: 1, attrs: ["a"]) {
        let a: f32 = call.attr("a")?;
        let x = call.input::<f32, Rank<1>>(0, "x")?;
        let mut y = call.output::<f32, Rank<1>>(0, "y")?;
        if call.input_any(1, "y")?.data_ptr().cast::<f32>() != y.as_mut_ptr() {
            return Err(FfiError::invalid_argument("y: result 0 must alias operand 1"));
        }
        if x.shape() != y.shape() {
            return Err(FfiError::invalid_argument(format!("x and y: shapes {:?} and {:?}", x.shape(), y.shape())));
        }
        let x = x.as_slice()?;
        for (y, &x) in y.as_slice_mut()?.iter_mut().zip(x.iter()) {
            *y += a * x;
        }
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// `x += 1` in place, for float32 or int16 of any shape: result 0 is operand 0's memory.
    fn increment_inplace_xla(call, operands: 1, results: 1) {
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => call.output::<f32, AnyShape>(0, "x")?.as_slice_mut()?.iter_mut().for_each(|v| *v += 1.0),
            DataType::INT16 => call.output::<i16, AnyShape>(0, "x")?.as_slice_mut()?.iter_mut().for_each(|v| *v = v.wrapping_add(1)),
            other => return Err(FfiError::invalid_argument(format!("x: {other} (float32 or int16)"))),
        }
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// `empty_like`'s handler: its operand and result decoded, nothing computed.
    fn empty_like_xla(call, operands: 1, results: 1) {
        call.input_any(0, "x")?;
        call.output_any(0, "out")?;
        Ok(())
    }
}

/// `empty_like(x)`: a new uninitialised float32 tensor like `x`, of x's framework (the eager
/// body of an empty kernel).
#[pyfunction]
fn empty_like(
    py: Python<'_>,
    x: dlbridge::python::TensorRef<'_, f32>,
) -> PyResult<dlbridge::python::Output<f32>> {
    x.empty_like::<f32>(py)
}

dlbridge::xla_handler! {
    /// Does nothing with one operand: the cost of a call through the adapter.
    fn empty_xla(call, operands: 1, results: 0) {
        call.input_any(0, "x")?;
        Ok(())
    }
}

struct Saxpy;
impl NativeOp for Saxpy {
    const OP: XlaOp = XlaOp {
        signature: OpSignature::new(
            "saxpy",
            &[("x", ArgKind::Tensor), ("y", ArgKind::Tensor), ("a", ArgKind::Float)],
            &[ArgKind::Tensor],
        ),
        attrs: &[("a", AttrType::F64)],
        out: Some(OutRule::Like(0)),
        handler: saxpy_xla,
    };
}

struct SaxpyInPlace;
impl NativeOp for SaxpyInPlace {
    const OP: XlaOp = XlaOp {
        signature: OpSignature::new(
            "saxpy_",
            &[("x", ArgKind::Tensor), ("y", ArgKind::TensorMut), ("a", ArgKind::Float)],
            &[],
        ),
        attrs: &[("a", AttrType::F32)],
        out: None,
        handler: saxpy_inplace_xla,
    };
}

struct IncrementInPlace;
impl NativeOp for IncrementInPlace {
    const OP: XlaOp = XlaOp {
        signature: OpSignature::new("increment_", &[("x", ArgKind::TensorMut)], &[]),
        attrs: &[],
        out: None,
        handler: increment_inplace_xla,
    };
}

struct EmptyXla;
impl NativeOp for EmptyXla {
    const OP: XlaOp = XlaOp {
        signature: OpSignature::new("empty_xla", &[("x", ArgKind::Tensor)], &[]),
        attrs: &[],
        out: None,
        handler: empty_xla,
    };
}

/// `empty(Tensor x) -> ()`: does nothing.
struct Empty;
impl NativeKernel for Empty {
    const SIGNATURE: OpSignature = OpSignature::new("empty", &[("x", ArgKind::Tensor)], &[]);
    fn run(_args: &mut Args, _out: &mut Outputs) -> std::result::Result<(), KernelError> {
        Ok(())
    }
}

/// `fails(Tensor x, str why) -> Tensor`: refuses with `why`.
struct Fails;
impl NativeKernel for Fails {
    const SIGNATURE: OpSignature =
        OpSignature::new("fails", &[("x", ArgKind::Tensor), ("why", ArgKind::Str)], &[ArgKind::Tensor]);
    fn run(args: &mut Args, _out: &mut Outputs) -> std::result::Result<(), KernelError> {
        Err(KernelError(format!("refused: {}", args.str(1)?)))
    }
}

fn registered(torch: &'static Torch) -> dlbridge::torch_stable::Result<()> {
    dlbridge::torch_stable::xla::register::<Saxpy>(torch, NS)?;
    dlbridge::torch_stable::xla::register::<SaxpyInPlace>(torch, NS)?;
    dlbridge::torch_stable::xla::register::<IncrementInPlace>(torch, NS)?;
    dlbridge::torch_stable::xla::register::<EmptyXla>(torch, NS)?;
    // The same nothing on the meta device (for fake tensors).
    register_kernel::<Empty>(torch, NS, &["CPU", "Meta"])?;
    register_kernel::<Fails>(torch, NS, &["CPU"])
}

/// Registers the ops once per process (`import torch` first) and returns the torch version
/// found. A torch without the stable functions raises `RuntimeError` naming what is missing.
#[pyfunction]
fn register(py: Python<'_>) -> PyResult<String> {
    static DONE: std::sync::OnceLock<std::result::Result<String, String>> = std::sync::OnceLock::new();
    // saxpy_ writes y in place: its version counter is bumped through torch's C++ bump (the
    // stable ABI has none), found by dlbridge's Python layer. Outside the OnceLock: it runs
    // Python (its probes), and another thread may wait on the lock holding the GIL.
    dlbridge::python::install_torch_version_hooks(py);
    let r = DONE.get_or_init(|| {
        let torch = Torch::attach().map_err(|e| e.to_string())?;
        registered(torch).map_err(|e| e.to_string())?;
        Ok(torch.version())
    });
    r.clone().map_err(PyRuntimeError::new_err)
}

#[pymodule]
fn dlbridge_torch_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(register, m)?)?;
    m.add_function(wrap_pyfunction!(empty_like, m)?)?;
    let def = dlbridge::python::KernelDef {
        out: Some("x"),
        ffi: Some(empty_like_xla),
        ..dlbridge::python::KernelDef::default()
    };
    dlbridge::python::add_kernel(m, m.getattr("empty_like")?, &def, None)?;
    Ok(())
}
