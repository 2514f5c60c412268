//! Methods and functions called with CPython's own `METH_FASTCALL | METH_KEYWORDS` convention,
//! for the few entry points every exchange goes through (`Tensor.__dlpack__`, `from_dlpack`,
//! `asdlpack`).
//!
//! PyO3's generic argument parser matches each keyword by converting its name to UTF-8 and
//! comparing strings: about 500 instructions per `__dlpack__(max_version=..., copy=...)` call,
//! more than the export itself. Here keyword names are matched by pointer against interned
//! strings (callers pass interned names: Python source literals, numpy's and torch's C code),
//! with a string comparison only as the fallback. Everything after parsing is ordinary PyO3 code.

use std::ffi::CStr;
use std::panic::AssertUnwindSafe;

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyString;

/// A `PyMethodDef` that lives for the process (CPython keeps a pointer to it and only reads it).
pub(crate) struct StaticDef(pub(crate) ffi::PyMethodDef);

// SAFETY: the definition is immutable after construction and only read, by any thread.
unsafe impl Sync for StaticDef {}

impl StaticDef {
    /// A fastcall-with-keywords definition. `doc` starts with the `__text_signature__` line
    /// (`name($self, /, ...)\n--\n\n`), so `inspect.signature` and stub checks see the parameters.
    pub(crate) const fn new(
        name: &'static CStr,
        f: ffi::PyCFunctionFastWithKeywords,
        doc: &'static CStr,
    ) -> Self {
        Self(ffi::PyMethodDef {
            ml_name: name.as_ptr(),
            ml_meth: ffi::PyMethodDefPointer { PyCFunctionFastWithKeywords: f },
            ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
            ml_doc: doc.as_ptr(),
        })
    }

    fn as_ptr(&'static self) -> *mut ffi::PyMethodDef {
        // CPython's API takes a mutable pointer but never writes through it.
        std::ptr::addr_of!(self.0).cast_mut()
    }

    /// A method descriptor of `ty` for this definition (what a class dictionary holds).
    pub(crate) fn method<'py>(
        &'static self,
        ty: &Bound<'py, pyo3::types::PyType>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // SAFETY: a live type object and a definition that outlives it.
        unsafe {
            Bound::from_owned_ptr_or_err(ty.py(), ffi::PyDescr_NewMethod(ty.as_ptr().cast(), self.as_ptr()))
        }
    }

    /// A module-level builtin function for this definition.
    pub(crate) fn function<'py>(&'static self, module: &Bound<'py, PyModule>) -> PyResult<Bound<'py, PyAny>> {
        let py = module.py();
        let name = module.name()?;
        // SAFETY: a definition that outlives the function; the module is passed as `self`.
        unsafe {
            Bound::from_owned_ptr_or_err(
                py,
                ffi::PyCFunction_NewEx(self.as_ptr(), module.as_ptr(), name.as_ptr()),
            )
        }
    }
}

/// Keyword-only arguments of a fastcall call, by position in `names`; `None` where not given.
pub(crate) type Keywords<'a, 'py, const N: usize> = [Option<Borrowed<'a, 'py, PyAny>>; N];

/// Splits a fastcall call into its `positional` leading arguments (exactly that many) and the
/// keyword arguments named in `names` (each at most once; any other name is a TypeError).
///
/// # Safety
///
/// `args`, `nargs` and `kwnames` are what CPython passed to a `METH_FASTCALL | METH_KEYWORDS`
/// function: `nargs` positional pointers then one per name in `kwnames` (a tuple or NULL), all
/// alive for `'a`.
pub(crate) unsafe fn parse<'a, 'py, const P: usize, const N: usize>(
    py: Python<'py>,
    fname: &str,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
    names: [&Bound<'py, PyString>; N],
) -> PyResult<([Borrowed<'a, 'py, PyAny>; P], Keywords<'a, 'py, N>)> {
    if nargs != P as ffi::Py_ssize_t {
        return Err(PyTypeError::new_err(format!(
            "{fname}() takes {P} positional argument{} but {nargs} were given",
            if P == 1 { "" } else { "s" }
        )));
    }
    // SAFETY: the caller's promise: P positional pointers at `args`.
    let positional = std::array::from_fn(|i| unsafe { Borrowed::from_ptr(py, *args.add(i)) });
    let mut found: Keywords<'a, 'py, N> = [None; N];
    if kwnames.is_null() {
        return Ok((positional, found));
    }
    // SAFETY: kwnames is a tuple of str (CPython's calling convention).
    let nkw = unsafe { ffi::PyTuple_GET_SIZE(kwnames) };
    for k in 0..nkw {
        // SAFETY: k is in range; the tuple holds its items.
        let name = unsafe { ffi::PyTuple_GET_ITEM(kwnames, k) };
        let slot = match names.iter().position(|n| n.as_ptr() == name) {
            Some(i) => Some(i),
            // Not interned: compare the text (the slow path).
            // SAFETY: `name` is a live str owned by the tuple.
            None => names.iter().position(|n| unsafe { ffi::PyUnicode_Compare(n.as_ptr(), name) } == 0),
        };
        // SAFETY: `name` is a live str owned by the tuple.
        let shown = || unsafe { Borrowed::from_ptr(py, name) }.to_string();
        let Some(i) = slot else {
            return Err(PyTypeError::new_err(format!(
                "{fname}() got an unexpected keyword argument '{}'",
                shown()
            )));
        };
        if found[i].is_some() {
            return Err(PyTypeError::new_err(format!(
                "{fname}() got multiple values for argument '{}'",
                shown()
            )));
        }
        // SAFETY: keyword values follow the positional ones, one per name.
        found[i] = Some(unsafe { Borrowed::from_ptr(py, *args.add(P + k as usize)) });
    }
    Ok((positional, found))
}

/// Sets `e` as the current Python exception, through PyO3's attach guard. Entry points called by
/// CPython start from `Python::assume_attached`, which does not tell PyO3 the thread is attached:
/// the type and value objects an error drops while being raised would then be parked in PyO3's
/// deferred-decref pool until some later attach (about 170 bytes per error, without bound in a
/// loop of failing calls). Only the error path pays for the guard.
///
/// The guard is only taken where that cannot go wrong: on a thread whose current thread state is
/// its own `PyGILState` one (a recursive `PyGILState_Ensure`), and through `try_attach`, which
/// declines during finalization. Otherwise (interpreter shutting down, a foreign thread state) the
/// error is restored directly: correct, at worst a few objects left in PyO3's pool.
pub(crate) fn raise(e: PyErr) {
    let mut e = Some(e);
    if super::release::attached_here() {
        let _ = Python::try_attach(|py| {
            if let Some(e) = e.take() {
                e.restore(py);
            }
        });
    }
    if let Some(e) = e {
        // SAFETY: every caller runs with the GIL held (a CPython entry point or exchange function).
        e.restore(unsafe { Python::assume_attached() });
    }
}

/// Runs `f` as the body of a fastcall function: its object is returned as a new reference, its
/// error is raised (NULL returned), and a panic becomes a RuntimeError instead of unwinding into C.
pub(crate) fn run<'py>(
    _py: Python<'py>,
    f: impl FnOnce() -> PyResult<Bound<'py, PyAny>>,
) -> *mut ffi::PyObject {
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| match f() {
        Ok(obj) => obj.into_ptr(),
        Err(e) => {
            raise(e);
            std::ptr::null_mut()
        }
    }));
    outcome.unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        // Restored directly (not through `raise`, which could itself have panicked).
        // SAFETY: called with the GIL held (CPython's calling convention).
        PyRuntimeError::new_err(format!("dlbridge: internal error (panic): {what}"))
            .restore(unsafe { Python::assume_attached() });
        std::ptr::null_mut()
    })
}
