//! What each Python type speaks, found once and cached per thread, so the import path makes no
//! failed attribute lookups (a raised-and-caught AttributeError costs more than a whole import).
//!
//! Entries are keyed by the type's address *and* its `tp_version_tag`. CPython gives a type a new
//! tag whenever the type is modified, and tags are never reused, so an entry can neither go stale
//! nor be hit by another type that later lands at the same address. No strong reference is held,
//! and the cache is thread-local: no lock on the hot path, nothing to release at shutdown, and
//! ready for free-threaded builds. A type without a valid tag (rare) is simply not cached.

use std::cell::RefCell;

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyType;

use super::exchange::ExchangeApi;

/// What a type speaks.
#[derive(Clone, Copy)]
pub struct TypeInfo {
    /// Its C exchange table, if it publishes a usable one.
    pub exchange: Option<ExchangeApi>,
    /// Whether the type defines `__dlpack__`.
    pub dlpack: bool,
    /// Whether it is `numpy.ndarray` or a subclass (read through the array struct when verified).
    pub numpy: bool,
    /// Whether its `__dlpack__` was seen to reject the 2023 keywords (a legacy producer).
    pub legacy: bool,
}

const CAPACITY: usize = 32;

thread_local! {
    static CACHE: RefCell<Vec<(usize, u32, TypeInfo)>> = const { RefCell::new(Vec::new()) };
}

fn key(ty: &Bound<'_, PyType>) -> (usize, u32) {
    let p = ty.as_type_ptr();
    // SAFETY: a live type object; reading its version tag field.
    let tag = unsafe { (*p).tp_version_tag };
    // SAFETY: as above.
    let valid = unsafe { ffi::PyType_HasFeature(p, ffi::Py_TPFLAGS_VALID_VERSION_TAG) } != 0;
    (p as usize, if valid { tag } else { 0 })
}

/// What `ty` speaks (looked up on a cache miss). The hit is inlined into the import paths, so
/// no `PyResult` is built and read back through memory on every call.
#[inline]
pub fn type_info(ty: &Bound<'_, PyType>) -> PyResult<TypeInfo> {
    let (addr, tag) = key(ty);
    if tag != 0 {
        let hit = CACHE.with_borrow(|c| c.iter().find(|(a, t, _)| *a == addr && *t == tag).map(|e| e.2));
        if let Some(info) = hit {
            return Ok(info);
        }
    }
    type_info_miss(ty)
}

#[inline(never)]
fn type_info_miss(ty: &Bound<'_, PyType>) -> PyResult<TypeInfo> {
    let py = ty.py();
    let dlpack = ty.getattr_opt(intern!(py, "__dlpack__"))?;
    let info = TypeInfo {
        exchange: match &dlpack {
            Some(d) if owns_protocol(ty, intern!(py, "__dlpack_c_exchange_api__"), d)? => {
                ExchangeApi::of_type(ty)?
            }
            _ => None,
        },
        numpy: match (&dlpack, super::numpy::ndarray_type(ty)) {
            (Some(d), Some(nd)) => nd.getattr_opt(intern!(py, "__dlpack__"))?.is_some_and(|own| own.is(d)),
            _ => false,
        },
        dlpack: dlpack.is_some(),
        legacy: false,
    };
    // The lookups above assign a version tag if the type had none yet.
    let (addr, tag) = key(ty);
    if tag != 0 {
        CACHE.with_borrow_mut(|c| {
            c.retain(|(a, _, _)| *a != addr);
            if c.len() == CAPACITY {
                c.remove(0);
            }
            c.push((addr, tag, info));
        });
    }
    Ok(info)
}

/// Whether the class that defines `attr` (the exchange table) in `ty`'s MRO has the very
/// `__dlpack__` that `ty` has (`dlpack`): a table serves only types whose protocol methods are its
/// publisher's own, so a subclass that overrides `__dlpack__` is served by its own method.
fn owns_protocol(
    ty: &Bound<'_, PyType>,
    attr: &Bound<'_, pyo3::types::PyString>,
    dlpack: &Bound<'_, PyAny>,
) -> PyResult<bool> {
    let py = ty.py();
    for base in ty.getattr(intern!(py, "__mro__"))?.try_iter()? {
        let base = base?;
        let dict = base.getattr(intern!(py, "__dict__"))?;
        if dict.contains(attr)? {
            return Ok(base.getattr_opt(intern!(py, "__dlpack__"))?.is_some_and(|own| own.is(dlpack)));
        }
    }
    Ok(false)
}

/// Records that `ty`'s `__dlpack__` takes no keywords, so later imports call it the legacy way.
pub fn mark_legacy(ty: &Bound<'_, PyType>) {
    let (addr, tag) = key(ty);
    CACHE.with_borrow_mut(|c| {
        if let Some(e) = c.iter_mut().find(|(a, t, _)| *a == addr && *t == tag) {
            e.2.legacy = true;
        }
    });
}
