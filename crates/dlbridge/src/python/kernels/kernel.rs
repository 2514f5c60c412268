//! One kernel, every mode: the Rust side of `dlbridge.kernels` (the Python registry that makes an
//! extension's function callable eagerly, inside `jax.jit` and inside `torch.compile`).
//!
//! [`xla_capsule`] wraps an XLA FFI handler ([`crate::xla_handler!`]) in the capsule
//! `jax.ffi.register_ffi_target(name, capsule, platform="cpu")` takes; [`add_kernel`] adds a
//! `#[pyfunction]` to a module as a `dlbridge.kernels.Kernel` declared by a [`KernelDef`] (its
//! output rule, scalar attributes, in-place arguments, handler and backward).
//!
//! A kernel with a handler is also a native torch op (`native.rs`).

use std::ffi::c_void;
use std::ptr::NonNull;

use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};

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
    /// kernel that only writes its `mutates` argument (it returns that argument).
    pub out: Option<&'a str>,
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
            attrs: &[],
            mutates: &[],
            ffi: None,
            vmap_method: "sequential",
        }
    }
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
    kw.set_item("out", def.out)?;
    kw.set_item("attrs", PyDict::from_sequence(&def.attrs.to_vec().into_pyobject(py)?)?)?;
    kw.set_item("mutates", PyTuple::new(py, def.mutates)?)?;
    #[cfg(all(feature = "torch-stable", unix))]
    let native = match def.ffi {
        Some(h) => {
            let capsule = xla_capsule(py, h)?;
            let register = super::native::registrar(py, def.out, def.attrs, def.mutates, h)?;
            kernels.getattr("_NATIVE_OPS")?.set_item(&capsule, register)?;
            kw.set_item("ffi", &capsule)?;
            Some(capsule)
        }
        None => None,
    };
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
