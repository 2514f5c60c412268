//! A kernel's native torch op (feature `torch-stable`, Unix): what [`super::add_kernel`] hands
//! `dlbridge.kernels` for a kernel with an XLA handler. When the kernel's torch op is made (at
//! once if torch is imported, else when torch is first used with the kernel: `_make_torch_op`),
//! `dlbridge.kernels` calls [`registrar`]'s function, which defines the op through torch's stable
//! C ABI ([`crate::torch_stable::xla::register_op`]) under the name the Python op would have: the
//! handler is its CPU kernel, the output rule (`out`: like a parameter) its Meta kernel, and an
//! in-place argument's version counter is checked and bumped through torch's C++ functions (import's
//! `torch_bits.rs`, [`install_torch_version_hooks`]). Where the process cannot host it
//! ([`Error::is_unsupported`]: no libtorch, a stable function missing, more than one argument
//! written in place, no verified version hooks for an in-place kernel, ...) the Python custom op stays,
//! as for a kernel without a handler.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyDict, PyTuple};

use super::results::{AttrValue, Attrs, ParamShape, Resolved, Shapes, result_shape};
use crate::python::import::install_native_version_hooks;
use crate::torch_stable::xla::{AttrType, OutRule, TensorInfo, XlaOp, register_op};
use crate::torch_stable::{ArgKind, Error, Torch};
use crate::xla_ffi::XLA_FFI_Handler;

/// Installs [`crate::torch_stable::set_version_hooks`]'s functions from torch's own C++ ones
/// (found and checked on probe tensors in the process's libtorch: the symbols dlbridge's torch
/// import uses), so a native op that writes a `Tensor(a!)` argument refuses an inference tensor
/// outside inference mode and bumps `_version` as torch's in-place operations do.
/// [`super::add_kernel`]'s native ops install them themselves; an extension registering ops
/// through [`crate::torch_stable`] by hand calls it once torch is imported. Returns whether
/// they are installed (`false`: torch is not imported, or its symbols were not found or did not
/// pass the checks; nothing is checked or bumped then).
pub fn install_torch_version_hooks(py: Python<'_>) -> bool {
    install_native_version_hooks(py)
}

/// What a kernel's declaration says of its native op (the parameters' order and defaults
/// come from the function, as `dlbridge.kernels` reads them, at registration).
#[derive(Debug, Clone)]
pub(super) struct NativeDecl {
    pub(super) out: Option<String>,
    /// Several results (`KernelDef.results`), their rules resolved; empty: `out`.
    pub(super) results: Vec<Resolved>,
    pub(super) attrs: Vec<(String, String)>,
    pub(super) mutates: Vec<String>,
    /// Optional tensor parameters (`Tensor?`).
    pub(super) optional: Vec<String>,
    /// List-of-tensors parameters (`Tensor[]`).
    pub(super) lists: Vec<String>,
    pub(super) handler: XLA_FFI_Handler,
}

/// An attribute parameter's default, as Python gave it.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum ScalarDefault {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Ints(Vec<i64>),
    Floats(Vec<f64>),
    Bools(Vec<bool>),
    /// An optional tensor's `None`.
    NoTensor,
}

/// A finite float as the schema writes it.
fn float_text(v: f64) -> Option<String> {
    v.is_finite().then(|| format!("{v:?}"))
}

fn bool_text(v: bool) -> &'static str {
    if v { "True" } else { "False" }
}

impl ScalarDefault {
    /// The value as the schema writes it (`None`: the schema cannot say it).
    fn text(&self) -> Option<String> {
        let list = |items: Vec<Option<String>>| -> Option<String> {
            Some(format!("[{}]", items.into_iter().collect::<Option<Vec<_>>>()?.join(", ")))
        };
        match self {
            Self::Int(v) => Some(v.to_string()),
            Self::Float(v) => float_text(*v),
            Self::Bool(v) => Some(bool_text(*v).to_owned()),
            Self::Str(v) => crate::torch_stable::string_literal(v),
            Self::Ints(v) => list(v.iter().map(|e| Some(e.to_string())).collect()),
            Self::Floats(v) => list(v.iter().map(|&e| float_text(e)).collect()),
            Self::Bools(v) => list(v.iter().map(|&e| Some(bool_text(e).to_owned())).collect()),
            Self::NoTensor => Some("None".to_owned()),
        }
    }
}

impl NativeDecl {
    /// The op `name` whose arguments are `params` in order (the function's), with the
    /// scalar defaults `defaults`: each parameter named in `attrs` a scalar of its type, each
    /// in `mutates` a `Tensor(a!)`, every other a `Tensor`; one fresh result like parameter
    /// `out`, or none for an in-place kernel. [`Error::Invalid`] (the Python op then) for a
    /// declaration the native op cannot express.
    pub(super) fn op(
        &self,
        name: &str,
        params: &[String],
        defaults: &[(String, ScalarDefault)],
    ) -> Result<XlaOp, Error> {
        let invalid = |m: String| Error::Invalid(format!("kernel {name}: {m}"));
        if self.mutates.len() > 1 {
            // XLA's call aliases one argument (input_output_aliases); the native frame would
            // alias each, so the handler would see other results than under jax.jit.
            return Err(invalid(format!("{} arguments written in place (one at most)", self.mutates.len())));
        }
        let mut attrs = Vec::with_capacity(self.attrs.len());
        for (n, t) in &self.attrs {
            let t =
                AttrType::from_numpy_name(t).ok_or_else(|| invalid(format!("attribute {n}: type {t:?}")))?;
            attrs.push((n.as_str(), t));
        }
        let mut args = Vec::with_capacity(params.len());
        for p in params {
            let kind = match attrs.iter().find(|(n, _)| n == p) {
                Some(&(_, t)) => t.arg_kind(),
                None if self.mutates.contains(p) => ArgKind::TensorMut,
                None if self.optional.contains(p) => ArgKind::OptTensor,
                None if self.lists.contains(p) => ArgKind::TensorList,
                None => ArgKind::Tensor,
            };
            args.push((p.as_str(), kind));
        }
        let attr_names = attrs.iter().map(|&(n, _)| n);
        if let Some(n) =
            self.mutates.iter().map(String::as_str).chain(attr_names).find(|n| !params.iter().any(|p| p == n))
        {
            return Err(invalid(format!("{n} is not a parameter of the function")));
        }
        let several = vec![ArgKind::Tensor; self.results.len()];
        let (rets, out): (&[ArgKind], _) = if !self.results.is_empty() {
            (&several, Some(OutRule::Dyn(self.results_rule(&attrs, params))))
        } else if self.mutates.is_empty() {
            let like = self.out.as_deref().ok_or_else(|| invalid("no output rule (out)".into()))?;
            let i = params
                .iter()
                .position(|p| p == like)
                .ok_or_else(|| invalid(format!("out={like:?} is not a parameter")))?;
            (&[ArgKind::Tensor], Some(OutRule::Like(i)))
        } else {
            (&[], None)
        };
        let mut texts = Vec::with_capacity(defaults.len());
        for (n, d) in defaults {
            let text = d.text().ok_or_else(|| match d {
                ScalarDefault::Float(v) => invalid(format!("default {n}={v} (a finite float)")),
                ScalarDefault::Str(v) => {
                    invalid(format!("default {n}={v:?} (a string without control characters)"))
                }
                _ => invalid(format!("default {n}={d:?} (finite floats)")),
            })?;
            texts.push((n.as_str(), text));
        }
        let texts: Vec<(&str, &str)> = texts.iter().map(|(n, t)| (*n, t.as_str())).collect();
        let mut op = XlaOp::leak(name, &args, rets, &attrs, out, self.handler);
        op.validate()?;
        op.signature.schema()?;
        if !texts.is_empty() {
            op.signature = op.signature.leak_defaults(&texts);
            op.signature.schema()?;
        }
        Ok(op)
    }
}

impl NativeDecl {
    /// The results' rules as the op's output rule (leaked: an op lives as long as the process):
    /// the tensor arguments' shapes and the scalar arguments, read off torch's stack, through the
    /// same [`result_shapes`] jax and the Python op use.
    fn results_rule(
        &self,
        attrs: &[(&str, AttrType)],
        params: &[String],
    ) -> &'static crate::torch_stable::xla::DynOutRule {
        let results = self.results.clone();
        // A kernel with optional or list parameters: (signature index, kind) of each tensor
        // parameter, read off the stack (the rule sees each parameter's ParamShape); empty for
        // another kernel, whose rule reads the plain tensors' infos as they come.
        let counted: Vec<(usize, ArgKind)> = if self.optional.is_empty() && self.lists.is_empty() {
            Vec::new()
        } else {
            params
                .iter()
                .enumerate()
                .filter(|(_, p)| !attrs.iter().any(|(n, _)| n == p))
                .map(|(i, p)| {
                    let kind = if self.optional.contains(p) {
                        ArgKind::OptTensor
                    } else if self.lists.contains(p) {
                        ArgKind::TensorList
                    } else {
                        ArgKind::Tensor
                    };
                    (i, kind)
                })
                .collect()
        };
        // (name, signature index, type) of each scalar argument.
        let scalars: Vec<(String, usize, AttrType)> = attrs
            .iter()
            .filter_map(|&(n, t)| params.iter().position(|p| p == n).map(|i| (n.to_owned(), i, t)))
            .collect();
        // Kept for the process (the op is), reachable, as the op's names are.
        crate::torch_stable::keep::<crate::torch_stable::xla::DynOutRule>(Box::new(
            move |infos: &[TensorInfo],
                  args: &crate::torch_stable::Args|
                  -> Result<Vec<TensorInfo>, crate::torch_stable::KernelError> {
                // Called at every call of the op (its CPU kernel makes its result buffers by it):
                // no allocation but the attributes' and the results' own.
                let mut a = Attrs::with_capacity(scalars.len());
                for (n, i, t) in &scalars {
                    let v = match t {
                        AttrType::F32 | AttrType::F64 => AttrValue::Float(args.float(*i)?),
                        AttrType::I32 | AttrType::I64 => AttrValue::Int(args.int(*i)?),
                        AttrType::Bool => AttrValue::Bool(args.bool(*i)?),
                        AttrType::Str => AttrValue::Str(args.str(*i)?),
                        AttrType::I64s | AttrType::I32s => AttrValue::Ints(args.int_list(*i)?),
                        AttrType::F32s | AttrType::F64s => AttrValue::Floats(args.float_list(*i)?),
                        AttrType::Bools => AttrValue::Bools(args.bool_list(*i)?),
                    };
                    a.insert(n, v);
                }
                if !counted.is_empty() {
                    return counted_infos(&results, &counted, args, &a);
                }
                const INLINE: usize = crate::torch_stable::xla::MAX_FRAME_ITEMS;
                let mut inline: [&[i64]; INLINE] = [&[]; INLINE];
                let heap: Vec<&[i64]>;
                let shapes: &[&[i64]] = if infos.len() <= INLINE {
                    for (s, t) in inline.iter_mut().zip(infos) {
                        *s = &t.shape;
                    }
                    &inline[..infos.len()]
                } else {
                    heap = infos.iter().map(|t| t.shape.as_slice()).collect();
                    &heap
                };
                let mut out = Vec::with_capacity(results.len());
                for r in &results {
                    // (torch's error carries the op's name: the rule's names the result.)
                    let shape = result_shape(r, Shapes::Plain(shapes), &a)?;
                    let dtype = match r.dtype {
                        Ok(k) => infos
                            .get(k)
                            .map(|t| t.dtype)
                            .ok_or_else(|| format!("result {}: no tensor argument {k}", r.name))?,
                        Err(d) => d,
                    };
                    out.push(TensorInfo { dtype, shape });
                }
                Ok(out)
            },
        ))
    }
}

/// The results' infos of a kernel with optional or list parameters: each tensor parameter
/// (`counted`: its signature index and kind) read off the stack as its [`ParamShape`] (an absent
/// optional's `None`, a list's items), as jax's `ffi_call` and the Python op's rule see them.
fn counted_infos(
    results: &[Resolved],
    counted: &[(usize, ArgKind)],
    args: &crate::torch_stable::Args,
    attrs: &Attrs<'_>,
) -> Result<Vec<TensorInfo>, crate::torch_stable::KernelError> {
    // Each parameter's tensors, flat, and where each parameter's start and end there.
    let mut flat: Vec<Vec<i64>> = Vec::new();
    let mut dtypes = Vec::with_capacity(counted.len());
    let mut spans = Vec::with_capacity(counted.len());
    for &(i, kind) in counted {
        let at = flat.len();
        let tensors = match kind {
            ArgKind::OptTensor => args.opt_tensor(i)?.map_or(&[][..], std::slice::from_ref),
            ArgKind::TensorList => args.tensor_list(i)?,
            _ => std::slice::from_ref(args.tensor(i)?),
        };
        for t in tensors {
            flat.push(t.sizes()?);
        }
        // (A `Like` dtype names a tensor parameter: one tensor.)
        dtypes.push(match (kind, tensors) {
            (ArgKind::Tensor, [t]) => Some(t.dtype()?),
            _ => None,
        });
        spans.push((kind, at, flat.len()));
    }
    let views: Vec<&[i64]> = flat.iter().map(Vec::as_slice).collect();
    let params: Vec<ParamShape<'_>> = spans
        .iter()
        .map(|&(kind, at, end)| match kind {
            ArgKind::OptTensor => ParamShape::Optional((end > at).then(|| views[at])),
            ArgKind::TensorList => ParamShape::List(&views[at..end]),
            _ => ParamShape::Tensor(views[at]),
        })
        .collect();
    let mut out = Vec::with_capacity(results.len());
    for r in results {
        let shape = result_shape(r, Shapes::Params(&params), attrs)?;
        let dtype = match r.dtype {
            Ok(k) => dtypes
                .get(k)
                .copied()
                .flatten()
                .ok_or_else(|| format!("result {}: no tensor argument {k}", r.name))?,
            Err(d) => d,
        };
        out.push(TensorInfo { dtype, shape });
    }
    Ok(out)
}

/// Defines `op` in `ns` as a native op of the process's torch, with the version bump for
/// its in-place argument. `Ok(Some(why))`: not hosted here ([`Error::is_unsupported`]), the
/// Python op stays; `Err`: torch refused the op.
pub(super) fn register(py: Python<'_>, ns: &str, op: Result<XlaOp, Error>) -> Result<Option<String>, Error> {
    let attempt = || -> Result<(), Error> {
        let op = op?;
        let torch = Torch::attach()?;
        if op.signature.args().iter().any(|(_, k)| *k == ArgKind::TensorMut)
            && !install_native_version_hooks(py)
        {
            return Err(Error::Invalid(format!(
                "{}: writes an argument in place, but this torch's version hooks were not found",
                op.signature.name()
            )));
        }
        register_op(torch, ns, op)
    };
    outcome(attempt())
}

/// What a registration attempt means for `dlbridge.kernels`: `None`, the native op is defined;
/// `Some(why)`, this process cannot host it ([`Error::is_unsupported`]: a torch without a stable
/// function, no libtorch, an op the module cannot express) and the Python op is made instead;
/// `Err`, torch refused the op (raised).
fn outcome(attempt: Result<(), Error>) -> Result<Option<String>, Error> {
    match attempt {
        Ok(()) => Ok(None),
        Err(e) if e.is_unsupported() => Ok(Some(e.to_string())),
        Err(e) => Err(e),
    }
}

/// The private function `dlbridge.kernels` calls when it makes the kernel's torch op:
/// `register(namespace, opname, params, defaults) -> None | str` (None: the native op is
/// defined; a string: why not, and the Python op is made instead).
pub(super) fn registrar<'py>(
    py: Python<'py>,
    out: Option<&str>,
    results: &[Resolved],
    attrs: &[(&str, &str)],
    mutates: &[&str],
    tensors: (&[&str], &[&str]),
    handler: XLA_FFI_Handler,
) -> PyResult<Bound<'py, PyCFunction>> {
    let owned = |v: &[&str]| v.iter().map(|&m| m.to_owned()).collect();
    let decl = NativeDecl {
        out: out.map(str::to_owned),
        results: results.to_vec(),
        attrs: attrs.iter().map(|&(n, t)| (n.to_owned(), t.to_owned())).collect(),
        mutates: owned(mutates),
        optional: owned(tensors.0),
        lists: owned(tensors.1),
        handler,
    };
    let call = move |args: &Bound<'_, PyTuple>,
                     _kw: Option<&Bound<'_, PyDict>>|
          -> PyResult<Option<String>> {
        let py = args.py();
        let (ns, name, params, defaults): (String, String, Vec<String>, Bound<'_, PyDict>) =
            args.extract()?;
        let mut ds = Vec::with_capacity(defaults.len());
        for (n, v) in defaults.iter() {
            let n: String = n.extract()?;
            if decl.optional.contains(&n) && v.is_none() {
                ds.push((n, ScalarDefault::NoTensor));
                continue;
            }
            let Some(t) =
                decl.attrs.iter().find(|(a, _)| *a == n).and_then(|(_, t)| AttrType::from_numpy_name(t))
            else {
                return Ok(Some(format!("default of {n}: not a scalar attribute")));
            };
            // (A str is no sequence of str here: extract::<Vec<_>> refuses a str.)
            let d = match t {
                AttrType::F32 | AttrType::F64 => v.extract::<f64>().map(ScalarDefault::Float),
                AttrType::I32 | AttrType::I64 => v.extract::<i64>().map(ScalarDefault::Int),
                AttrType::Bool => v.extract::<bool>().map(ScalarDefault::Bool),
                AttrType::Str => v.extract::<String>().map(ScalarDefault::Str),
                AttrType::I64s | AttrType::I32s => v.extract::<Vec<i64>>().map(ScalarDefault::Ints),
                AttrType::F32s | AttrType::F64s => v.extract::<Vec<f64>>().map(ScalarDefault::Floats),
                AttrType::Bools => v.extract::<Vec<bool>>().map(ScalarDefault::Bools),
            };
            match d {
                Ok(d) => ds.push((n, d)),
                // The Python op gets it, and says what torch thinks of it.
                Err(_) => return Ok(Some(format!("default of {n}: {} is not a {t:?}", v.repr()?))),
            }
        }
        register(py, &ns, decl.op(&name, &params, &ds)).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    };
    PyCFunction::new_closure(py, Some(c"register_native_op"), None, call)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handler never called here (the op is only built).
    unsafe extern "C" fn nothing(
        _frame: *mut crate::xla_ffi::XLA_FFI_CallFrame,
    ) -> *mut crate::xla_ffi::XLA_FFI_Error {
        std::ptr::null_mut()
    }

    fn decl(out: Option<&str>, attrs: &[(&str, &str)], mutates: &[&str]) -> NativeDecl {
        NativeDecl {
            out: out.map(str::to_owned),
            results: Vec::new(),
            attrs: attrs.iter().map(|&(n, t)| (n.to_owned(), t.to_owned())).collect(),
            mutates: mutates.iter().map(|&m| m.to_owned()).collect(),
            optional: Vec::new(),
            lists: Vec::new(),
            handler: nothing,
        }
    }

    fn params(p: &[&str]) -> Vec<String> {
        p.iter().map(|&p| p.to_owned()).collect()
    }

    #[test]
    fn a_torch_without_a_stable_function_keeps_the_python_op() {
        let missing = Error::Missing { symbol: "torch_library_impl", torch: "2.9.0".into() };
        let why = outcome(Err(missing)).unwrap().unwrap();
        assert!(why.contains("torch 2.9.0 does not export torch_library_impl"), "{why}");
        let absent =
            Error::NotLoaded { library: "libtorch_cpu.so".into(), reason: "import torch first".into() };
        assert!(outcome(Err(absent)).unwrap().unwrap().contains("import torch first"));
        assert!(outcome(Err(Error::Invalid("too many".into()))).unwrap().is_some());
        assert_eq!(outcome(Ok(())).unwrap(), None);
        // torch refusing the op is raised, not hidden behind a second op.
        let call = Error::Call { function: "aoti_torch_library_def", message: "no".into() };
        assert!(outcome(Err(call)).is_err());
    }

    #[test]
    fn the_op_follows_the_functions_parameters() {
        let d = decl(Some("x"), &[("a", "float64")], &[]);
        let op =
            d.op("k_saxpy", &params(&["a", "x", "y"]), &[("a".into(), ScalarDefault::Float(1e-5))]).unwrap();
        assert_eq!(op.signature.schema().unwrap(), "k_saxpy(float a=1e-5, Tensor x, Tensor y) -> Tensor");
        assert!(matches!(op.out, Some(OutRule::Like(1))));
        let d = decl(None, &[("a", "float32"), ("n", "int32"), ("b", "bool")], &["y"]);
        let defaults =
            [("n".to_owned(), ScalarDefault::Int(-3)), ("b".to_owned(), ScalarDefault::Bool(true))];
        let op = d.op("k_in_place", &params(&["a", "x", "y", "n", "b"]), &defaults).unwrap();
        assert_eq!(
            op.signature.schema().unwrap(),
            "k_in_place(float a, Tensor x, Tensor(a!) y, int n=-3, bool b=True) -> ()"
        );
        assert!(op.out.is_none());
    }

    #[test]
    fn string_and_array_attributes_and_their_defaults_make_the_schema() {
        let d = decl(
            Some("x"),
            &[
                ("mode", "str"),
                ("axes", "int64[]"),
                ("narrow", "int32[]"),
                ("w", "float32[]"),
                ("m", "bool[]"),
            ],
            &[],
        );
        let defaults = [
            ("mode".to_owned(), ScalarDefault::Str("s\"u\\m".into())),
            ("axes".to_owned(), ScalarDefault::Ints(vec![0, -1])),
            ("w".to_owned(), ScalarDefault::Floats(vec![0.5, 2.0])),
            ("m".to_owned(), ScalarDefault::Bools(vec![])),
        ];
        let op = d.op("k", &params(&["x", "mode", "axes", "narrow", "w", "m"]), &defaults).unwrap();
        assert_eq!(
            op.signature.schema().unwrap(),
            "k(Tensor x, str mode=\"s\\\"u\\\\m\", int[] axes=[0, -1], int[] narrow, float[] w=[0.5, 2.0], bool[] m=[]) -> Tensor"
        );
        assert_eq!(
            op.attrs,
            &[
                ("mode", AttrType::Str),
                ("axes", AttrType::I64s),
                ("narrow", AttrType::I32s),
                ("w", AttrType::F32s),
                ("m", AttrType::Bools)
            ]
        );
    }

    #[test]
    fn optional_and_list_parameters_are_tensor_and_tensor_list_arguments() {
        let mut d = decl(Some("x"), &[("eps", "float64")], &[]);
        d.optional = vec!["bias".into()];
        d.lists = vec!["xs".into()];
        let defaults = [("bias".to_owned(), ScalarDefault::NoTensor)];
        let op = d.op("k", &params(&["x", "xs", "bias", "eps"]), &defaults).unwrap();
        assert_eq!(
            op.signature.schema().unwrap(),
            "k(Tensor x, Tensor[] xs, Tensor? bias=None, float eps) -> Tensor"
        );
        // A default of None for a tensor that is not optional is refused.
        let e = d.op("k", &params(&["x", "xs", "bias", "eps"]), &[("x".to_owned(), ScalarDefault::NoTensor)]);
        assert!(e.unwrap_err().to_string().contains("default x=\"None\""));
    }

    #[test]
    fn several_results_make_a_tuple_schema_and_a_rule_output() {
        use super::super::results::{ResultDType, ResultDef, resolve};
        fn rows(s: &[&[i64]], _: &Attrs<'_>) -> Result<Vec<i64>, String> {
            Ok(vec![s[0][0]])
        }
        let p = params(&["x", "w", "eps"]);
        let results =
            [ResultDef::like("y", "x"), ResultDef::rule("r", rows, ResultDType::Like("w")).residual()];
        let mut d = decl(None, &[("eps", "float64")], &[]);
        d.results = resolve("k", &p, &[("eps", "float64")], (&[], &[]), &results).unwrap();
        let op = d.op("k", &p, &[]).unwrap();
        assert_eq!(op.signature.schema().unwrap(), "k(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)");
        assert!(matches!(op.out, Some(OutRule::Dyn(_))));
    }

    #[test]
    fn several_results_with_optional_and_list_parameters_make_a_tuple_schema() {
        use super::super::results::{ParamShape, ResultDType, ResultDef, resolve};
        fn count(p: &[ParamShape<'_>], _: &Attrs<'_>) -> Result<Vec<i64>, String> {
            Ok(vec![p[1].list().map_or(0, <[_]>::len) as i64])
        }
        let p = params(&["x", "xs", "bias"]);
        let results = [ResultDef::like("y", "x"), ResultDef::param_rule("n", count, ResultDType::Like("x"))];
        let mut d = decl(None, &[], &[]);
        d.optional = vec!["bias".into()];
        d.lists = vec!["xs".into()];
        d.results = resolve("k", &p, &[], (&["bias"], &["xs"]), &results).unwrap();
        let op = d.op("k", &p, &[("bias".to_owned(), ScalarDefault::NoTensor)]).unwrap();
        assert_eq!(
            op.signature.schema().unwrap(),
            "k(Tensor x, Tensor[] xs, Tensor? bias=None) -> (Tensor, Tensor)"
        );
        assert!(matches!(op.out, Some(OutRule::Dyn(_))));
    }

    #[test]
    fn what_the_native_op_cannot_say_is_unsupported() {
        let two = decl(None, &[], &["x", "y"]);
        let e = two.op("k", &params(&["x", "y"]), &[]).unwrap_err();
        assert!(e.is_unsupported() && e.to_string().contains("2 arguments written in place"), "{e}");
        let d = decl(Some("x"), &[("a", "float64")], &[]);
        let e = d
            .op("k", &params(&["a", "x"]), &[("a".into(), ScalarDefault::Float(f64::INFINITY))])
            .unwrap_err();
        assert!(e.is_unsupported() && e.to_string().contains("default a=inf"), "{e}");
        let e = d.op("k", &params(&["x"]), &[]).unwrap_err();
        assert!(e.to_string().contains("a is not a parameter"), "{e}");
        let d = decl(Some("x"), &[("m", "str"), ("s", "float64[]")], &[]);
        let e = d
            .op("k", &params(&["x", "m", "s"]), &[("m".into(), ScalarDefault::Str("a\nb".into()))])
            .unwrap_err();
        assert!(e.is_unsupported() && e.to_string().contains("without control characters"), "{e}");
        let e = d
            .op("k", &params(&["x", "m", "s"]), &[("s".into(), ScalarDefault::Floats(vec![1.0, f64::NAN]))])
            .unwrap_err();
        assert!(e.is_unsupported() && e.to_string().contains("finite floats"), "{e}");
        let e = decl(Some("z"), &[], &[]).op("k", &params(&["x"]), &[]).unwrap_err();
        assert!(e.to_string().contains("out=\"z\" is not a parameter"), "{e}");
    }
}
