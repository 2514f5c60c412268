//! One kernel, every mode: the Rust side of `dlbridge.kernels` (the Python registry that makes an
//! extension's function callable eagerly, inside `jax.jit` and inside `torch.compile`).
//!
//! [`xla_capsule`] wraps an XLA FFI handler ([`crate::xla_handler!`]) in the capsule
//! `jax.ffi.register_ffi_target(name, capsule, platform="cpu")` takes; [`add_kernel`] adds a
//! `#[pyfunction]` to a module as a `dlbridge.kernels.Kernel` declared by a [`KernelDef`] (its
//! output rule, scalar attributes, in-place arguments, handler and backward).
//!
//! A kernel with a handler is also a native torch op (`native.rs`).
//!
//! Several results: [`KernelDef::results`] lists them ([`ResultDef`]), each shaped and typed by a
//! rule written in Rust (like a tensor parameter, or a [`ShapeFn`] over the tensor arguments'
//! shapes and the attributes, [`Attrs`]); jax's `ffi_call`, torch's fake (Meta) kernel and the
//! native op's result buffers all read the same rules. A result marked
//! [`residual`](ResultDef::residual) is saved by the forward for the backward and never returned
//! to the kernel's caller: the raw op underneath (the torch op, the XLA custom call) returns it
//! like any result, and `dlbridge.kernels` drops it from what the caller sees.

use std::ffi::c_void;
use std::ptr::NonNull;

use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};

use crate::DataType;
use crate::xla_ffi::XLA_FFI_Handler;

/// The capsule name jax's own helpers give handlers (jax reads the pointer whatever the name).
const XLA_CAPSULE_NAME: &std::ffi::CStr = c"xla._CUSTOM_CALL_TARGET";

/// `handler` in a capsule for `jax.ffi.register_ffi_target(name, capsule, platform="cpu")`.
pub fn xla_capsule(py: Python<'_>, handler: XLA_FFI_Handler) -> PyResult<Bound<'_, PyCapsule>> {
    let ptr = NonNull::new(handler as *mut c_void).expect("a function pointer is never NULL");
    // SAFETY: a function pointer is valid for the whole process; the capsule owns nothing.
    unsafe { PyCapsule::new_with_pointer(py, ptr, XLA_CAPSULE_NAME) }
}

/// How a kernel runs in every mode (see `dlbridge.kernels`): each field maps to the keyword of
/// `dlbridge.kernels.kernel` of the same name.
#[derive(Debug, Clone, Copy)]
pub struct KernelDef<'a> {
    /// The op's name: `torch.ops.<namespace>.<name>`, XLA FFI target `<namespace>.<name>`, and
    /// the module attribute the kernel is added as. `None`: the function's name. Letters, digits
    /// and underscores, a letter first.
    pub name: Option<&'a str>,
    /// The op's namespace. `None`: the top-level package of the function's module (`my_kernels`
    /// for a function of `my_kernels` or `my_kernels.my_kernels`). Named by the author, the op
    /// and target keep their names (a `jax.export` or a saved torch graph may name them), and a
    /// second kernel of the same names is refused.
    pub namespace: Option<&'a str>,
    /// The output rule: `Some("x")` (shape and dtype of tensor argument `x`); `None` for a
    /// kernel that only writes its `mutates` argument (it returns that argument), or one that
    /// declares [`results`](Self::results) instead.
    pub out: Option<&'a str>,
    /// Several results, in the order the function returns them (a tuple) and the handler
    /// writes them (result buffers 0, 1, ...), each with its shape and dtype rule; those marked
    /// residual are handed to the backward and never to the caller. Empty: the one result of
    /// [`out`](Self::out). Not with `out` or `mutates`.
    pub results: &'a [ResultDef<'a>],
    /// Scalar parameters (XLA attributes, static under `jax.jit`) and their numpy type names
    /// (`"float32"`, `"float64"`, `"int32"`, `"int64"`, `"bool"`); every other parameter is a tensor.
    pub attrs: &'a [(&'a str, &'a str)],
    /// Tensor parameters written in place.
    pub mutates: &'a [&'a str],
    /// The XLA FFI handler (CPU) that runs the kernel inside `jax.jit`. Its target is registered
    /// with jax when the kernel is made (or right after jax's own import), so a deserialized
    /// `jax.export` that calls it runs in any process that imported the extension.
    pub ffi: Option<XLA_FFI_Handler>,
    /// `jax.vmap`'s method for the FFI call (`"sequential"`, `"broadcast_all"`, ...).
    pub vmap_method: &'a str,
}

impl Default for KernelDef<'_> {
    fn default() -> Self {
        Self {
            name: None,
            namespace: None,
            out: None,
            results: &[],
            attrs: &[],
            mutates: &[],
            ffi: None,
            vmap_method: "sequential",
        }
    }
}

/// A scalar attribute's value, as a result's shape rule reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttrValue {
    /// A `float32` or `float64` attribute.
    Float(f64),
    /// An `int32` or `int64` attribute.
    Int(i64),
    /// A `bool` attribute.
    Bool(bool),
}

/// The kernel's scalar attributes by name, as a [`ShapeFn`] reads them (the values of the call
/// being traced or run).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Attrs<'a> {
    values: Vec<(&'a str, AttrValue)>,
}

impl<'a> Attrs<'a> {
    /// No attributes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds attribute `name` (a later value of the same name replaces it).
    pub fn insert(&mut self, name: &'a str, value: AttrValue) {
        match self.values.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.values.push((name, value)),
        }
    }

    /// Attribute `name`, if the kernel has it.
    pub fn get(&self, name: &str) -> Option<AttrValue> {
        self.values.iter().find(|(n, _)| *n == name).map(|&(_, v)| v)
    }

    fn missing(name: &str, want: &str) -> String {
        format!("attribute {name}: no {want} attribute of that name")
    }

    /// A float attribute (an int one converted).
    pub fn f64(&self, name: &str) -> Result<f64, String> {
        match self.get(name) {
            Some(AttrValue::Float(v)) => Ok(v),
            Some(AttrValue::Int(v)) => Ok(v as f64),
            _ => Err(Self::missing(name, "float")),
        }
    }

    /// An int attribute.
    pub fn i64(&self, name: &str) -> Result<i64, String> {
        match self.get(name) {
            Some(AttrValue::Int(v)) => Ok(v),
            _ => Err(Self::missing(name, "int")),
        }
    }

    /// A bool attribute.
    pub fn bool(&self, name: &str) -> Result<bool, String> {
        match self.get(name) {
            Some(AttrValue::Bool(v)) => Ok(v),
            _ => Err(Self::missing(name, "bool")),
        }
    }
}

/// A result's shape as a function of the tensor arguments' shapes (in parameter order, the
/// attributes left out) and the attributes; an `Err` names what is wrong (the caller sees it as
/// the kernel's error, under `jax.jit`, `torch.compile` and eagerly alike). Plain Rust, no
/// Python: the native torch op's Meta and CPU kernels call it too.
pub type ShapeFn = fn(&[&[i64]], &Attrs<'_>) -> Result<Vec<i64>, String>;

/// How a result's shape is found.
#[derive(Debug, Clone, Copy)]
pub enum ResultShape<'a> {
    /// The shape of tensor parameter `name`.
    Like(&'a str),
    /// A rule over the arguments' shapes and the attributes (a reduction, a matmul, ...).
    Rule(ShapeFn),
}

/// How a result's dtype is found.
#[derive(Debug, Clone, Copy)]
pub enum ResultDType<'a> {
    /// The dtype of tensor parameter `name`.
    Like(&'a str),
    /// Always this dtype.
    Is(DataType),
}

/// One result of a kernel with several ([`KernelDef::results`]).
#[derive(Debug, Clone, Copy)]
pub struct ResultDef<'a> {
    /// The result's name: what the backward reads it as (and `grad_<name>`, its cotangent).
    /// Letters, digits and underscores; not a parameter's name, nor `out` or `grad`.
    pub name: &'a str,
    /// Its shape.
    pub shape: ResultShape<'a>,
    /// Its dtype.
    pub dtype: ResultDType<'a>,
    /// A residual: computed by the forward, handed to the backward, never returned to the caller.
    pub residual: bool,
}

impl<'a> ResultDef<'a> {
    /// A result of the shape and dtype of tensor parameter `param`.
    pub const fn like(name: &'a str, param: &'a str) -> Self {
        Self { name, shape: ResultShape::Like(param), dtype: ResultDType::Like(param), residual: false }
    }

    /// A result of the shape `shape` computes, its dtype `dtype`.
    pub const fn rule(name: &'a str, shape: ShapeFn, dtype: ResultDType<'a>) -> Self {
        Self { name, shape: ResultShape::Rule(shape), dtype, residual: false }
    }

    /// The same result, marked a residual.
    pub const fn residual(self) -> Self {
        Self { residual: true, ..self }
    }
}

/// A result's rule with its parameter names resolved: `Like` as the index among the tensor
/// parameters (owned, so the native op may keep it for the process).
#[derive(Debug, Clone)]
pub(super) struct Resolved {
    pub(super) name: String,
    pub(super) shape: Result<usize, ShapeFn>,
    pub(super) dtype: Result<usize, DataType>,
    pub(super) residual: bool,
}

/// `results` with their `Like` names resolved against `params` (the function's parameters)
/// less `attrs`; a clear error (the field and the value) for a declaration that cannot hold.
pub(super) fn resolve(
    kernel: &str,
    params: &[String],
    attrs: &[(&str, &str)],
    results: &[ResultDef<'_>],
) -> Result<Vec<Resolved>, String> {
    let tensors: Vec<&str> =
        params.iter().map(String::as_str).filter(|p| !attrs.iter().any(|(a, _)| a == p)).collect();
    let bad =
        |i: usize, r: &ResultDef<'_>, m: String| format!("kernel {kernel}: results[{i}] ({}): {m}", r.name);
    let like = |i: usize, r: &ResultDef<'_>, what: &str, p: &str| {
        tensors.iter().position(|t| *t == p).ok_or_else(|| {
            bad(
                i,
                r,
                format!("{what} like {p:?}, which is no tensor parameter (tensors: {})", tensors.join(", ")),
            )
        })
    };
    let mut out = Vec::with_capacity(results.len());
    for (i, r) in results.iter().enumerate() {
        let ident = r.name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && r.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ident {
            return Err(bad(
                i,
                r,
                "a result's name is letters, digits and underscores, a letter first".into(),
            ));
        }
        if params.iter().any(|p| p == r.name)
            || matches!(r.name, "out" | "grad")
            || r.name.starts_with("grad_")
        {
            return Err(bad(
                i,
                r,
                "the name is taken (a parameter, out, grad or grad_*): choose another".into(),
            ));
        }
        if results[..i].iter().any(|o| o.name == r.name) {
            return Err(bad(i, r, "a second result of that name".into()));
        }
        let shape = match r.shape {
            ResultShape::Like(p) => Ok(like(i, r, "shape", p)?),
            ResultShape::Rule(f) => Err(f),
        };
        let dtype = match r.dtype {
            ResultDType::Like(p) => Ok(like(i, r, "dtype", p)?),
            ResultDType::Is(d) => Err(d),
        };
        out.push(Resolved { name: r.name.to_owned(), shape, dtype, residual: r.residual });
    }
    if !out.is_empty() && out.iter().all(|r| r.residual) {
        return Err(format!("kernel {kernel}: results: every result is a residual; the caller needs one"));
    }
    Ok(out)
}

/// Each result's shape (and, `Like`, the tensor index its dtype follows): what jax's `ffi_call`,
/// the fake kernel and the native op's buffers are made from.
pub(super) fn result_shapes(
    kernel: &str,
    results: &[Resolved],
    shapes: &[&[i64]],
    attrs: &Attrs<'_>,
) -> Result<Vec<Vec<i64>>, String> {
    let mut out = Vec::with_capacity(results.len());
    for r in results {
        let shape = match r.shape {
            Ok(k) => shapes
                .get(k)
                .ok_or_else(|| format!("{kernel}: result {}: no tensor argument {k}", r.name))?
                .to_vec(),
            Err(f) => f(shapes, attrs).map_err(|e| format!("{kernel}: result {}: {e}", r.name))?,
        };
        if let Some(d) = shape.iter().find(|&&d| d < 0) {
            return Err(format!("{kernel}: result {}: the shape rule gave extent {d} in {shape:?}", r.name));
        }
        out.push(shape);
    }
    Ok(out)
}

/// The Python face of the rules, `rule(shapes, dtypes, attrs) -> [(shape, dtype), ...]`
/// (shapes as tuples, dtypes as numpy names), called by `dlbridge.kernels` when it makes jax's
/// result types and torch's fake results.
fn result_rule<'py>(py: Python<'py>, kernel: String, results: Vec<Resolved>) -> PyResult<Bound<'py, PyAny>> {
    let call = move |args: &Bound<'_, PyTuple>,
                     _kw: Option<&Bound<'_, PyDict>>|
          -> PyResult<Vec<(Vec<i64>, String)>> {
        let (shapes, dtypes, attrs): (Vec<Vec<i64>>, Vec<String>, Bound<'_, PyDict>) = args.extract()?;
        let names: Vec<String> = attrs.keys().iter().map(|n| n.extract()).collect::<PyResult<_>>()?;
        let mut a = Attrs::new();
        for (n, v) in names.iter().zip(attrs.values().iter()) {
            // bool before int (a Python bool is an int); numpy scalars convert too.
            let value = if v.is_instance_of::<pyo3::types::PyBool>() || v.get_type().name()? == "bool" {
                AttrValue::Bool(v.extract()?)
            } else if let Ok(i) = v.extract::<i64>() {
                if v.is_instance_of::<pyo3::types::PyFloat>() {
                    AttrValue::Float(i as f64)
                } else {
                    AttrValue::Int(i)
                }
            } else {
                AttrValue::Float(v.extract()?)
            };
            a.insert(n, value);
        }
        let views: Vec<&[i64]> = shapes.iter().map(Vec::as_slice).collect();
        let made =
            result_shapes(&kernel, &results, &views, &a).map_err(pyo3::exceptions::PyValueError::new_err)?;
        let mut out = Vec::with_capacity(made.len());
        for (r, shape) in results.iter().zip(made) {
            let dtype = match r.dtype {
                Ok(k) => dtypes.get(k).cloned().ok_or_else(|| {
                    pyo3::exceptions::PyValueError::new_err(format!(
                        "{kernel}: result {}: no tensor argument {k}",
                        r.name
                    ))
                })?,
                Err(d) => d.to_string(),
            };
            out.push((shape, dtype));
        }
        Ok(out)
    };
    Ok(pyo3::types::PyCFunction::new_closure(py, Some(c"result_rule"), None, call)?.into_any())
}

/// Makes `function` (a `#[pyfunction]` of this module) a `dlbridge.kernels.Kernel` as `def` says,
/// with `backward` (a `(kernel, args, grads)` tuple or a callable, as `dlbridge.kernels` reads
/// it), and adds it to `module` under its name (`def.name`, else the function's). Returns the
/// kernel; `help(kernel)` shows its signature (tensors, attributes with their types and
/// defaults), the function's docs, its torch op and XLA target.
///
/// Without a backward, gradients through the kernel are refused, never cut off silently: torch
/// autograd raises at backward ("no autograd formula"), `jax.grad` raises that the FFI call
/// cannot be differentiated, and an in-place kernel refuses torch arguments that require grad.
///
/// Needs the `dlbridge` Python package (`dlbridge.kernels`); without it the error says so.
pub fn add_kernel<'py>(
    module: &Bound<'py, PyModule>,
    function: Bound<'py, PyAny>,
    def: &KernelDef<'_>,
    backward: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = module.py();
    let kernels = py.import("dlbridge.kernels")?;
    let kw = PyDict::new(py);
    let resolved = if def.results.is_empty() {
        kw.set_item("out", def.out)?;
        Vec::new()
    } else {
        let fname: String = function.getattr("__name__")?.extract()?;
        let kname = def.name.unwrap_or(&fname).to_owned();
        let refuse = |m: &str| pyo3::exceptions::PyValueError::new_err(format!("kernel {kname}: {m}"));
        if let Some(o) = def.out {
            return Err(refuse(&format!("out={o:?} and results: declare the results in one of them")));
        }
        if !def.mutates.is_empty() {
            return Err(refuse(
                "results with mutates: a kernel with several results writes no argument in place",
            ));
        }
        let params: Vec<String> = py
            .import("inspect")?
            .call_method1("signature", (&function,))?
            .getattr("parameters")?
            .call_method0("keys")?
            .try_iter()?
            .map(|p| p?.extract())
            .collect::<PyResult<_>>()?;
        let resolved = resolve(&kname, &params, def.attrs, def.results)
            .map_err(pyo3::exceptions::PyValueError::new_err)?;
        let names: Vec<&str> = resolved.iter().map(|r| r.name.as_str()).collect();
        let residuals: Vec<&str> = resolved.iter().filter(|r| r.residual).map(|r| r.name.as_str()).collect();
        kw.set_item("results", PyTuple::new(py, names)?)?;
        kw.set_item("residuals", PyTuple::new(py, residuals)?)?;
        kw.set_item("result_rule", result_rule(py, kname, resolved.clone())?)?;
        resolved
    };
    kw.set_item("attrs", PyDict::from_sequence(&def.attrs.to_vec().into_pyobject(py)?)?)?;
    kw.set_item("mutates", PyTuple::new(py, def.mutates)?)?;
    #[cfg(all(feature = "torch-stable", unix))]
    let native = match def.ffi {
        Some(h) => {
            let capsule = xla_capsule(py, h)?;
            let register = super::native::registrar(py, def.out, &resolved, def.attrs, def.mutates, h)?;
            kernels.getattr("_NATIVE_OPS")?.set_item(&capsule, register)?;
            kw.set_item("ffi", &capsule)?;
            Some(capsule)
        }
        None => None,
    };
    #[cfg(not(all(feature = "torch-stable", unix)))]
    let _ = &resolved;
    #[cfg(not(all(feature = "torch-stable", unix)))]
    if let Some(h) = def.ffi {
        kw.set_item("ffi", xla_capsule(py, h)?)?;
    }
    kw.set_item("backward", backward)?;
    kw.set_item("vmap_method", def.vmap_method)?;
    kw.set_item("name", def.name)?;
    kw.set_item("namespace", def.namespace)?;
    let kernel = kernels.getattr("kernel")?.call((function,), Some(&kw));
    #[cfg(all(feature = "torch-stable", unix))]
    if let (Err(_), Some(capsule)) = (&kernel, &native) {
        // The declaration was refused: its registrar goes too.
        kernels.getattr("_NATIVE_OPS")?.call_method1("pop", (capsule, py.None()))?;
    }
    let kernel = kernel?;
    let name: String = kernel.getattr("__name__")?.extract()?;
    module.add(name.as_str(), &kernel)?;
    Ok(kernel)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(shapes: &[&[i64]], attrs: &Attrs<'_>) -> Result<Vec<i64>, String> {
        let k = attrs.i64("k").unwrap_or(1);
        match shapes.first() {
            Some(&[r, _]) => Ok(vec![r * k]),
            s => Err(format!("x: expected 2 dimensions, got {s:?}")),
        }
    }

    fn params(p: &[&str]) -> Vec<String> {
        p.iter().map(|&p| p.to_owned()).collect()
    }

    #[test]
    fn like_names_resolve_to_tensor_positions_and_rules_run() {
        let results = [
            ResultDef::like("y", "w"),
            ResultDef::rule("r", rows, ResultDType::Is(DataType::INT32)).residual(),
        ];
        let r = resolve("k", &params(&["x", "eps", "w"]), &[("eps", "float64")], &results).unwrap();
        // w is tensor 1 (eps is an attribute).
        assert_eq!(r[0].shape, Ok(1));
        assert_eq!(r[0].dtype, Ok(1));
        assert!(r[1].residual && r[1].dtype == Err(DataType::INT32));
        let mut a = Attrs::new();
        a.insert("k", AttrValue::Int(3));
        let shapes = result_shapes("k", &r, &[&[4, 5], &[5]], &a).unwrap();
        assert_eq!(shapes, vec![vec![5], vec![12]]);
        let e = result_shapes("k", &r, &[&[4, 5, 6], &[5]], &a).unwrap_err();
        assert_eq!(e, "k: result r: x: expected 2 dimensions, got Some([4, 5, 6])");
    }

    #[test]
    fn a_bad_declaration_names_the_result_and_the_value() {
        let p = params(&["x", "eps"]);
        let attrs = [("eps", "float64")];
        let e = resolve("k", &p, &attrs, &[ResultDef::like("y", "eps")]).unwrap_err();
        assert_eq!(
            e,
            "kernel k: results[0] (y): shape like \"eps\", which is no tensor parameter (tensors: x)"
        );
        let e = resolve("k", &p, &attrs, &[ResultDef::like("x", "x")]).unwrap_err();
        assert!(e.contains("results[0] (x): the name is taken"), "{e}");
        let e =
            resolve("k", &p, &attrs, &[ResultDef::like("y", "x"), ResultDef::like("y", "x")]).unwrap_err();
        assert!(e.contains("results[1] (y): a second result"), "{e}");
        let e = resolve("k", &p, &attrs, &[ResultDef::like("9y", "x")]).unwrap_err();
        assert!(e.contains("letters, digits and underscores"), "{e}");
        let e = resolve("k", &p, &attrs, &[ResultDef::like("y", "x").residual()]).unwrap_err();
        assert!(e.contains("every result is a residual"), "{e}");
        fn negative(_: &[&[i64]], _: &Attrs<'_>) -> Result<Vec<i64>, String> {
            Ok(vec![-1])
        }
        let r = resolve("k", &p, &attrs, &[ResultDef::rule("y", negative, ResultDType::Like("x"))]).unwrap();
        let e = result_shapes("k", &r, &[&[2]], &Attrs::new()).unwrap_err();
        assert_eq!(e, "k: result y: the shape rule gave extent -1 in [-1]");
    }

    #[test]
    fn attrs_read_by_type() {
        let mut a = Attrs::new();
        a.insert("f", AttrValue::Float(0.5));
        a.insert("n", AttrValue::Int(2));
        a.insert("b", AttrValue::Bool(true));
        a.insert("n", AttrValue::Int(3));
        assert_eq!((a.f64("f"), a.f64("n"), a.i64("n"), a.bool("b")), (Ok(0.5), Ok(3.0), Ok(3), Ok(true)));
        assert_eq!(a.i64("f").unwrap_err(), "attribute f: no int attribute of that name");
        assert_eq!(a.get("zz"), None);
    }
}
