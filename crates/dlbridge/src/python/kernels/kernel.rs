//! One kernel, every mode: the Rust side of `dlbridge.kernels` (the Python registry that makes an
//! extension's function callable eagerly, inside `jax.jit` and inside `torch.compile`).
//!
//! [`xla_capsule`] wraps an XLA FFI handler ([`crate::xla_handler!`]) in the capsule
//! `jax.ffi.register_ffi_target(name, capsule, platform="cpu")` takes; [`add_kernel`] adds a
//! `#[pyfunction]` to a module as a `dlbridge.kernels.Kernel` declared by a [`KernelDef`] (its
//! output rule, attributes (scalars, strings, arrays), in-place arguments, handler and backward).
//!
//! A kernel with a handler is also a native torch op (`native.rs`).
//!
//! Several results: [`KernelDef::results`] lists them ([`ResultDef`]), each shaped and typed by a
//! rule written in Rust (like a tensor parameter, or a [`ShapeFn`] over the tensor arguments'
//! shapes and the attributes, [`Attrs`], or a [`ParamShapeFn`](super::ParamShapeFn) over each
//! tensor parameter's [`ParamShape`], an optional's absent when `None`, a list's one per item);
//! jax's `ffi_call`, torch's fake (Meta) kernel and the
//! native op's result buffers all read the same rules. A result marked
//! [`residual`](ResultDef::residual) is saved by the forward for the backward and never returned
//! to the kernel's caller: the raw op underneath (the torch op, the XLA custom call) returns it
//! like any result, and `dlbridge.kernels` drops it from what the caller sees.

use std::ffi::c_void;
use std::ptr::NonNull;

use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};

use super::results::{
    AttrKind, Attrs, OwnedAttr, ParamShape, Resolved, ResultDef, Shapes, resolve, result_shapes,
};
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
    /// Attribute parameters (XLA attributes, static under `jax.jit`) and their types: scalars by
    /// numpy type name (`"float32"`, `"float64"`, `"int32"`, `"int64"`, `"bool"`; torch schema
    /// `float`, `int`, `bool`), `"str"` (schema `str`; the handler reads `&str`), and arrays
    /// `"int64[]"`, `"int32[]"`, `"float32[]"`, `"float64[]"`, `"bool[]"` (schema `int[]`,
    /// `float[]`, `bool[]`; XLA array attributes, the handler reads `&[i64]`, `&[i32]`, `&[f32]`,
    /// `&[f64]`, `&[bool]`; a results rule reads an array as [`Attrs::i64s`], ...). Every other
    /// parameter is a tensor. The `#[pyfunction]` gets each value as the caller passed it (a
    /// `str`; a list or tuple for an array: take `Vec<i64>`, `Vec<f64>`, ...).
    pub attrs: &'a [(&'a str, &'a str)],
    /// Tensor parameters written in place.
    pub mutates: &'a [&'a str],
    /// Optional tensor parameters (torch schema `Tensor?`): the caller passes a tensor or `None`;
    /// the function takes an `Option<TensorRef<..>>`, the handler reads
    /// [`Call::optional_input`](crate::xla::Call::optional_input) (declared
    /// [`Operand::Optional`](crate::xla::Operand::Optional)). Not a result's `out` or "like" rule; with
    /// [`results`](Self::results), a [`ResultDef::param_rule`] reads it (absent when `None`).
    pub optional: &'a [&'a str],
    /// List-of-tensors parameters (torch schema `Tensor[]`): the caller passes a list or tuple of
    /// tensors; the function takes a [`TensorList`](crate::python::TensorList), the handler reads
    /// [`Call::input_list`](crate::xla::Call::input_list) (declared
    /// [`Operand::List`](crate::xla::Operand::List)). Not a result's `out` or "like" rule; with
    /// [`results`](Self::results), a [`ResultDef::param_rule`] reads each item's shape.
    pub lists: &'a [&'a str],
    /// The XLA FFI handler (CPU) that runs the kernel inside `jax.jit`. Its target is registered
    /// with jax when the kernel is made (or right after jax's own import), so a deserialized
    /// `jax.export` that calls it runs in any process that imported the extension. A handler
    /// with a state (`xla_handler!`'s `state:`) is registered for XLA's instantiate stage too.
    pub ffi: Option<XLA_FFI_Handler>,
    /// `jax.vmap`'s method for the FFI call (`"sequential"`, `"broadcast_all"`, ...).
    pub vmap_method: &'a str,
    /// The forward-mode rule (`jvp=` of `dlbridge.kernels.kernel`): a `(kernel, args)` tuple,
    /// `args` named among the parameters, `"out"` and `"tangent_<parameter>"`, whose kernel
    /// returns the result's tangent, linear in the tangents; or a callable
    /// `jvp(named: dict) -> tangent`. With it `jax.jvp`/`jacfwd` and torch's forward AD
    /// (`torch.func.jvp`, `jacfwd`, dual tensors) work, and with a backward whose kernel has a
    /// jvp of its own, `jax.hessian` and `torch.func.hessian`. `None`: forward mode is refused.
    /// Not for `mutates`. With `results`, one tangent per result, residuals included, in the
    /// declared order (a tuple; the jvp reads each result by name).
    pub jvp: Option<&'a Bound<'a, PyAny>>,
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
            optional: &[],
            lists: &[],
            ffi: None,
            vmap_method: "sequential",
            jvp: None,
        }
    }
}

/// Attribute `name`'s Python value `v` as its declared `kind` says (a clear error naming the
/// attribute, its declared type and the value otherwise).
fn owned_attr(name: &str, declared: &str, kind: AttrKind, v: &Bound<'_, PyAny>) -> PyResult<OwnedAttr> {
    let is_bool = |v: &Bound<'_, PyAny>| -> PyResult<bool> {
        Ok(v.is_instance_of::<pyo3::types::PyBool>() || v.get_type().name()? == "bool")
    };
    let is_float = |v: &Bound<'_, PyAny>| v.is_instance_of::<pyo3::types::PyFloat>();
    let got = || -> PyResult<OwnedAttr> {
        Ok(match kind {
            AttrKind::Float => OwnedAttr::Float(v.extract()?),
            AttrKind::Bool => OwnedAttr::Bool(v.extract()?),
            AttrKind::Int if is_bool(v)? || is_float(v) => {
                return Err(pyo3::exceptions::PyTypeError::new_err(""));
            }
            AttrKind::Int => OwnedAttr::Int(v.extract()?),
            AttrKind::Str => OwnedAttr::Str(v.extract()?),
            AttrKind::Ints | AttrKind::Floats | AttrKind::Bools => {
                if v.is_instance_of::<pyo3::types::PyString>() {
                    return Err(pyo3::exceptions::PyTypeError::new_err(""));
                }
                let items: Vec<Bound<'_, PyAny>> = v.try_iter()?.collect::<PyResult<_>>()?;
                match kind {
                    AttrKind::Ints => {
                        let mut out = Vec::with_capacity(items.len());
                        for e in &items {
                            if is_bool(e)? || is_float(e) {
                                return Err(pyo3::exceptions::PyTypeError::new_err(""));
                            }
                            out.push(e.extract()?);
                        }
                        OwnedAttr::Ints(out)
                    }
                    AttrKind::Floats => {
                        OwnedAttr::Floats(items.iter().map(|e| e.extract()).collect::<PyResult<_>>()?)
                    }
                    _ => OwnedAttr::Bools(items.iter().map(|e| e.extract()).collect::<PyResult<_>>()?),
                }
            }
        })
    };
    got().map_err(|_| {
        let shown = v.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
        let tp = v.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
        pyo3::exceptions::PyTypeError::new_err(format!(
            "attribute {name:?} is declared {declared:?}, but the call passed a {tp} ({shown})"
        ))
    })
}

/// A tensor parameter's kind, as the Python rule receives its shape: 0 a tensor (a tuple), 1
/// an optional one (a tuple or None), 2 a list (a list of tuples).
type Kinds = Vec<u8>;

/// The Python face of the rules, `rule(shapes, dtypes, attrs) -> [(shape, dtype), ...]`
/// (one entry per tensor parameter: a shape as a tuple, a dtype as a numpy name; an optional
/// parameter's None when absent, a list parameter's a list of them; each attribute as its
/// declared type reads it: a number, a `str`, a sequence of numbers for an array), called by
/// `dlbridge.kernels` when it makes jax's result types and torch's fake results.
fn result_rule<'py>(
    py: Python<'py>,
    kernel: String,
    results: Vec<Resolved>,
    declared: Vec<(String, String)>,
    kinds: Kinds,
) -> PyResult<Bound<'py, PyAny>> {
    let counted = kinds.iter().any(|&k| k != 0);
    let call = move |args: &Bound<'_, PyTuple>,
                     _kw: Option<&Bound<'_, PyDict>>|
          -> PyResult<Vec<(Vec<i64>, String)>> {
        let (shapes, dtypes, attrs): (Vec<Bound<'_, PyAny>>, Vec<Bound<'_, PyAny>>, Bound<'_, PyDict>) =
            args.extract()?;
        let mut owned = Vec::with_capacity(attrs.len());
        for (n, v) in attrs.iter() {
            let n: String = n.extract()?;
            // Only the declared attributes (with their declared types) reach a rule.
            let Some((_, t)) = declared.iter().find(|(d, _)| *d == n) else { continue };
            let Some(kind) = AttrKind::of(t) else { continue };
            let value = owned_attr(&n, t, kind, &v)?;
            owned.push((n, value));
        }
        let mut a = Attrs::with_capacity(owned.len());
        for (n, v) in &owned {
            a.insert(n, v.value());
        }
        if shapes.len() != kinds.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "{kernel}: the result rule got {} shapes for {} tensor parameters",
                shapes.len(),
                kinds.len()
            )));
        }
        // Each parameter's shapes, flat (an absent optional none, a list one per item), and
        // where each parameter's start in that list.
        let mut flat: Vec<Vec<i64>> = Vec::with_capacity(shapes.len());
        let mut spans: Vec<(usize, usize)> = Vec::with_capacity(shapes.len());
        for (s, &k) in shapes.iter().zip(&kinds) {
            let at = flat.len();
            match k {
                1 if s.is_none() => {}
                2 => {
                    for item in s.try_iter()? {
                        flat.push(item?.extract()?);
                    }
                }
                _ => flat.push(s.extract()?),
            }
            spans.push((at, flat.len()));
        }
        let views: Vec<&[i64]> = flat.iter().map(Vec::as_slice).collect();
        let made = if counted {
            let params: Vec<ParamShape<'_>> = kinds
                .iter()
                .zip(&spans)
                .map(|(&k, &(at, end))| match k {
                    0 => ParamShape::Tensor(views[at]),
                    1 => ParamShape::Optional((end > at).then(|| views[at])),
                    _ => ParamShape::List(&views[at..end]),
                })
                .collect();
            result_shapes(&kernel, &results, Shapes::Params(&params), &a)
        } else {
            result_shapes(&kernel, &results, Shapes::Plain(&views), &a)
        }
        .map_err(pyo3::exceptions::PyValueError::new_err)?;
        let mut out = Vec::with_capacity(made.len());
        for (r, shape) in results.iter().zip(made) {
            let dtype = match r.dtype {
                // (resolve: a `Like` dtype names a tensor parameter, whose dtype is a name.)
                Ok(k) => dtypes.get(k).map(|d| d.extract::<String>()).transpose()?.ok_or_else(|| {
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
        let resolved = resolve(&kname, &params, def.attrs, (def.optional, def.lists), def.results)
            .map_err(pyo3::exceptions::PyValueError::new_err)?;
        let kinds: Kinds = params
            .iter()
            .filter(|p| !def.attrs.iter().any(|(a, _)| a == p))
            .map(|p| {
                if def.optional.contains(&p.as_str()) {
                    1
                } else if def.lists.contains(&p.as_str()) {
                    2
                } else {
                    0
                }
            })
            .collect();
        let names: Vec<&str> = resolved.iter().map(|r| r.name.as_str()).collect();
        let residuals: Vec<&str> = resolved.iter().filter(|r| r.residual).map(|r| r.name.as_str()).collect();
        kw.set_item("results", PyTuple::new(py, names)?)?;
        kw.set_item("residuals", PyTuple::new(py, residuals)?)?;
        let declared = def.attrs.iter().map(|&(n, t)| (n.to_owned(), t.to_owned())).collect();
        kw.set_item("result_rule", result_rule(py, kname, resolved.clone(), declared, kinds)?)?;
        resolved
    };
    kw.set_item("attrs", PyDict::from_sequence(&def.attrs.to_vec().into_pyobject(py)?)?)?;
    kw.set_item("mutates", PyTuple::new(py, def.mutates)?)?;
    kw.set_item("optional", PyTuple::new(py, def.optional)?)?;
    kw.set_item("lists", PyTuple::new(py, def.lists)?)?;
    #[cfg(all(feature = "torch-stable", unix))]
    let native = match def.ffi {
        Some(h) => {
            let capsule = xla_capsule(py, h)?;
            let register = super::native::registrar(
                py,
                def.out,
                &resolved,
                def.attrs,
                def.mutates,
                (def.optional, def.lists),
                h,
            )?;
            kernels.getattr("_NATIVE_OPS")?.set_item(&capsule, register)?;
            kw.set_item("ffi", &capsule)?;
            Some(capsule)
        }
        None => None,
    };
    #[cfg(not(all(feature = "torch-stable", unix)))]
    let _ = &resolved;
    #[cfg(not(all(feature = "torch-stable", unix)))]
    let native = match def.ffi {
        Some(h) => {
            let capsule = xla_capsule(py, h)?;
            kw.set_item("ffi", &capsule)?;
            Some(capsule)
        }
        None => None,
    };
    if let (Some(h), Some(capsule)) = (def.ffi, &native)
        // SAFETY: `ffi` is an XLA FFI handler (its documented contract), which answers XLA's
        // metadata query as jax's registration makes it do.
        && unsafe { crate::xla::needs_instantiate(h) }
    {
        // Its state is made at XLA's instantiate stage: registered for that stage too.
        let bundle = PyDict::new(py);
        bundle.set_item("instantiate", capsule)?;
        bundle.set_item("execute", capsule)?;
        kernels.getattr("_FFI_BUNDLES")?.set_item(capsule, bundle)?;
    }
    kw.set_item("backward", backward)?;
    kw.set_item("jvp", def.jvp)?;
    kw.set_item("vmap_method", def.vmap_method)?;
    kw.set_item("name", def.name)?;
    kw.set_item("namespace", def.namespace)?;
    let kernel = kernels.getattr("kernel")?.call((function,), Some(&kw));
    #[cfg(all(feature = "torch-stable", unix))]
    if let (Err(_), Some(capsule)) = (&kernel, &native) {
        // The declaration was refused: its registrar goes too.
        kernels.getattr("_NATIVE_OPS")?.call_method1("pop", (capsule, py.None()))?;
    }
    if let (Err(_), Some(capsule)) = (&kernel, &native) {
        kernels.getattr("_FFI_BUNDLES")?.call_method1("pop", (capsule, py.None()))?;
    }
    let kernel = kernel?;
    let name: String = kernel.getattr("__name__")?.extract()?;
    module.add(name.as_str(), &kernel)?;
    Ok(kernel)
}
