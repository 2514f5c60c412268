//! DLPack capsules: the four names, making a capsule that owns an exported struct, and consuming
//! a capsule (check name, read pointer, rename) exactly once.
//!
//! Consumption is atomic with respect to other Python threads: the name check, the pointer read
//! and the rename are three C-API calls that run no Python code, so no other thread can run
//! between them while this thread holds the GIL; on a free-threaded build they run inside a
//! per-capsule critical section.

use std::ffi::CStr;
use std::ptr::NonNull;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::ffi::{DLManagedTensor, DLManagedTensorVersioned};
use crate::managed::ManagedTensor;

/// Name of a capsule holding a legacy `DLManagedTensor`.
pub const DLTENSOR: &CStr = c"dltensor";
/// The name a consumer gives a legacy capsule it took ownership from.
pub const USED_DLTENSOR: &CStr = c"used_dltensor";
/// Name of a capsule holding a `DLManagedTensorVersioned`.
pub const DLTENSOR_VERSIONED: &CStr = c"dltensor_versioned";
/// The name a consumer gives a versioned capsule it took ownership from.
pub const USED_DLTENSOR_VERSIONED: &CStr = c"used_dltensor_versioned";

/// Runs `f` (a deleter, which may run Python code: a `__del__`, a buffer release) with any
/// exception already set saved and restored around it: a capsule may be destroyed while an
/// exception propagates, and Python code run with one set can fail or clear it.
///
/// # Safety
///
/// The GIL is held.
unsafe fn keeping_exception(f: impl FnOnce()) {
    let (mut t, mut v, mut tb) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: the caller's promise (GIL held); moves the current exception, if any, into locals.
    #[allow(deprecated)]
    unsafe {
        ffi::PyErr_Fetch(&mut t, &mut v, &mut tb)
    };
    f();
    // SAFETY: as above; puts the saved exception (or none) back, dropping any `f` left behind
    // (a deleter has no way to report one).
    #[allow(deprecated)]
    unsafe {
        ffi::PyErr_Restore(t, v, tb)
    };
}

/// Capsule destructor for versioned capsules: runs the deleter unless a consumer renamed the
/// capsule (and so took ownership). CPython calls it with the GIL held.
unsafe extern "C" fn destroy_versioned(cap: *mut ffi::PyObject) {
    // SAFETY: `cap` is the capsule being destroyed; IsValid sets no exception.
    if unsafe { ffi::PyCapsule_IsValid(cap, DLTENSOR_VERSIONED.as_ptr()) } == 1 {
        // SAFETY: valid under this name, so GetPointer succeeds without setting an exception.
        let p = unsafe { ffi::PyCapsule_GetPointer(cap, DLTENSOR_VERSIONED.as_ptr()) }
            .cast::<DLManagedTensorVersioned>();
        // SAFETY: the capsule still owns the struct; call its deleter once.
        if let Some(d) = unsafe { (*p).deleter } {
            // SAFETY: as above; CPython calls capsule destructors with the GIL held.
            unsafe { keeping_exception(|| d(p)) }
        }
    }
}

/// Capsule destructor for legacy capsules; see [`destroy_versioned`].
unsafe extern "C" fn destroy_legacy(cap: *mut ffi::PyObject) {
    // SAFETY: as in destroy_versioned.
    if unsafe { ffi::PyCapsule_IsValid(cap, DLTENSOR.as_ptr()) } == 1 {
        // SAFETY: valid under this name.
        let p = unsafe { ffi::PyCapsule_GetPointer(cap, DLTENSOR.as_ptr()) }.cast::<DLManagedTensor>();
        // SAFETY: the capsule still owns the struct.
        if let Some(d) = unsafe { (*p).deleter } {
            // SAFETY: as above.
            unsafe { keeping_exception(|| d(p)) }
        }
    }
}

/// The name of the capsules that keep a tensor alive for an object made over its memory (the
/// `base` of a numpy array dlbridge made): private, so no DLPack consumer can take the tensor out
/// from under that object.
pub const OWNER: &CStr = c"dlbridge.tensor_owner";

/// Deletes the versioned struct an owner capsule holds (the producer's deleter runs, once).
unsafe extern "C" fn destroy_owner(cap: *mut ffi::PyObject) {
    // SAFETY: `cap` is the capsule being destroyed; IsValid sets no exception.
    if unsafe { ffi::PyCapsule_IsValid(cap, OWNER.as_ptr()) } == 1 {
        // SAFETY: valid under this name; the pointer is the owning struct `owner_capsule` stored,
        // owned by this capsule alone (no consumer can take a capsule of this name).
        let p = unsafe { ffi::PyCapsule_GetPointer(cap, OWNER.as_ptr()) }.cast::<DLManagedTensorVersioned>();
        // SAFETY: as above: the struct is live until its deleter runs.
        if let Some(d) = unsafe { (*p).deleter } {
            // SAFETY: called once, with the GIL held (CPython destroys capsules with it).
            unsafe { keeping_exception(|| d(p)) }
        }
    }
}

/// A private capsule (named [`OWNER`]) that owns `t` until it is destroyed.
pub fn owner_capsule(py: Python<'_>, t: ManagedTensor) -> PyResult<Bound<'_, PyAny>> {
    let p = t.into_versioned_raw();
    // SAFETY: a live owning struct, a static name, the destructor that matches the name.
    let cap = unsafe { ffi::PyCapsule_New(p.as_ptr().cast(), OWNER.as_ptr(), Some(destroy_owner)) };
    // SAFETY: a new reference or NULL with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, cap) }.inspect_err(|_| {
        // SAFETY: the capsule was not made, so the struct is still ours and live.
        if let Some(d) = unsafe { (*p.as_ptr()).deleter } {
            // SAFETY: as above; deleted once.
            unsafe { d(p.as_ptr()) }
        }
    })
}

/// A `"dltensor_versioned"` capsule owning `p` (its deleter runs if nobody consumes it). If the
/// capsule cannot be made, the struct is deleted and the Python error returned.
pub fn versioned_capsule(py: Python<'_>, p: NonNull<DLManagedTensorVersioned>) -> PyResult<Bound<'_, PyAny>> {
    // SAFETY: a live struct we own; the name is static; the destructor matches the name.
    let cap = unsafe {
        ffi::PyCapsule_New(p.as_ptr().cast(), DLTENSOR_VERSIONED.as_ptr(), Some(destroy_versioned))
    };
    // SAFETY: a new reference or NULL with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, cap) }.inspect_err(|_| {
        // SAFETY: the capsule was not made, so we still own the struct.
        if let Some(d) = unsafe { (*p.as_ptr()).deleter } {
            // SAFETY: called once.
            unsafe { d(p.as_ptr()) }
        }
    })
}

/// A `"dltensor"` capsule owning `p`; see [`versioned_capsule`].
pub fn legacy_capsule(py: Python<'_>, p: NonNull<DLManagedTensor>) -> PyResult<Bound<'_, PyAny>> {
    // SAFETY: as in versioned_capsule.
    let cap = unsafe { ffi::PyCapsule_New(p.as_ptr().cast(), DLTENSOR.as_ptr(), Some(destroy_legacy)) };
    // SAFETY: a new reference or NULL with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, cap) }.inspect_err(|_| {
        // SAFETY: the capsule was not made, so we still own the struct.
        if let Some(d) = unsafe { (*p.as_ptr()).deleter } {
            // SAFETY: called once.
            unsafe { d(p.as_ptr()) }
        }
    })
}

/// Whether `obj` is a capsule (of any name).
pub fn is_capsule(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: a type check on a live object.
    unsafe { ffi::PyCapsule_CheckExact(obj.as_ptr()) == 1 }
}

/// Takes ownership of the tensor in a fresh DLPack capsule: checks the name, reads the pointer,
/// renames the capsule to its `used_` name (so its destructor no longer frees the tensor), then
/// validates. If validation refuses the tensor, its deleter has already run, exactly once.
///
/// `what` names the source in error messages ("the capsule returned by numpy.ndarray.__dlpack__").
pub fn consume(obj: &Bound<'_, PyAny>, what: &dyn Fn() -> String) -> PyResult<ManagedTensor> {
    let cap = obj.as_ptr();
    if !is_capsule(obj) {
        return Err(PyTypeError::new_err(format!(
            "{}: expected a DLPack capsule, got {}",
            what(),
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
        )));
    }
    // Check, read and rename with no Python code in between: atomic under the GIL, and inside a
    // per-capsule critical section on free-threaded builds (a no-op otherwise).
    let taken = pyo3::sync::critical_section::with_critical_section(obj, || {
        // SAFETY: `cap` is a live capsule; IsValid sets no exception.
        if unsafe { ffi::PyCapsule_IsValid(cap, DLTENSOR_VERSIONED.as_ptr()) } == 1 {
            // SAFETY: valid under this name.
            let p = unsafe { ffi::PyCapsule_GetPointer(cap, DLTENSOR_VERSIONED.as_ptr()) };
            rename(cap, USED_DLTENSOR_VERSIONED);
            return Some((p, true));
        }
        // SAFETY: as above.
        if unsafe { ffi::PyCapsule_IsValid(cap, DLTENSOR.as_ptr()) } == 1 {
            // SAFETY: valid under this name.
            let p = unsafe { ffi::PyCapsule_GetPointer(cap, DLTENSOR.as_ptr()) };
            rename(cap, USED_DLTENSOR);
            return Some((p, false));
        }
        None
    });
    if let Some((p, versioned)) = taken {
        let t = if versioned {
            // SAFETY: the capsule handed us ownership of a producer's versioned struct.
            unsafe { ManagedTensor::from_raw_versioned(p.cast::<DLManagedTensorVersioned>()) }
        } else {
            // SAFETY: the capsule handed us ownership of a producer's legacy struct.
            unsafe { ManagedTensor::from_raw_legacy(p.cast::<DLManagedTensor>()) }
        };
        // The producer's deleter may take the GIL: never run on a thread without it.
        return Ok(super::release::gate_deleter(t?));
    }
    let name = capsule_name(obj);
    if name.starts_with("used_") {
        Err(PyValueError::new_err(format!(
            "{}: the DLPack capsule was already consumed (it is named {name:?}); a capsule can be consumed once",
            what()
        )))
    } else {
        Err(PyTypeError::new_err(format!(
            "{}: capsule named {name:?} is not a DLPack tensor (expected \"dltensor\" or \"dltensor_versioned\")",
            what()
        )))
    }
}

/// The name of a capsule, lossily, for messages.
pub fn capsule_name(obj: &Bound<'_, PyAny>) -> String {
    // SAFETY: a live capsule; GetName returns the stored pointer (possibly NULL) and for a real
    // capsule sets no exception.
    let n = unsafe { ffi::PyCapsule_GetName(obj.as_ptr()) };
    if n.is_null() {
        // SAFETY: clears an exception GetName may have set for a non-capsule.
        unsafe { ffi::PyErr_Clear() };
        return "<NULL>".into();
    }
    // SAFETY: capsule names are NUL-terminated C strings.
    unsafe { CStr::from_ptr(n) }.to_string_lossy().into_owned()
}

fn rename(cap: *mut ffi::PyObject, name: &'static CStr) {
    // SAFETY: a live capsule and a static name; SetName only fails for non-capsules.
    let rc = unsafe { ffi::PyCapsule_SetName(cap, name.as_ptr()) };
    debug_assert_eq!(rc, 0);
}
