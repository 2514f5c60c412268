//! What each Python type speaks, found once and cached per thread, so the import path makes no
//! failed attribute lookups (a raised-and-caught AttributeError costs more than a whole import).
//!
//! Entries are keyed by the type's address and its `tp_version_tag`, and hold a strong reference
//! to the type. CPython gives a type a new tag whenever the type is modified, so a modified type
//! misses; the reference keeps the type alive while cached, so no other type can land at its
//! address (on 3.9 and 3.10 `sys._clear_type_cache()` restarts the tag counter, so an address and
//! a tag alone could match another type). A tag is valid when CPython says so: the
//! `Py_TPFLAGS_VALID_VERSION_TAG` flag before 3.12, a non-zero tag from 3.12 on (3.13 no longer
//! sets the flag). The cache is thread-local: no lock on the hot path. A type without a valid tag
//! (rare) is simply not cached.

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
    /// torch's state accessors, if the type has them (checked on every path, the protocol too).
    pub torch: Option<&'static super::exchange::TorchState>,
}

const CAPACITY: usize = 32;

/// One cached type: its address, its tag, what it speaks, and a strong reference that keeps the
/// address from being reused while the entry lives.
struct Entry {
    addr: usize,
    tag: u32,
    info: TypeInfo,
    /// What results for callers of this type are returned as, once asked.
    framework: Option<Framework>,
    _keep: Py<PyType>,
}

thread_local! {
    static CACHE: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

/// Whether this interpreter marks valid tags by a non-zero value alone (3.12 on) rather than with
/// `Py_TPFLAGS_VALID_VERSION_TAG`.
fn tag_alone_is_valid(py: Python<'_>) -> bool {
    static NEW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NEW.get_or_init(|| py.version_info() >= (3, 12))
}

fn key(ty: &Bound<'_, PyType>) -> (usize, u32) {
    let p = ty.as_type_ptr();
    // SAFETY: a live type object; reading its version tag field.
    let tag = unsafe { (*p).tp_version_tag };
    // SAFETY: as above.
    let valid = tag_alone_is_valid(ty.py())
        || unsafe { ffi::PyType_HasFeature(p, ffi::Py_TPFLAGS_VALID_VERSION_TAG) } != 0;
    (p as usize, if valid { tag } else { 0 })
}

/// Type-level lookups made so far on this thread (the cache's misses), for the hit-rate tests.
#[cfg(feature = "test-hooks")]
pub(crate) static MISSES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// What `ty` speaks (looked up on a cache miss). The hit is inlined into the import paths, so
/// no `PyResult` is built and read back through memory on every call.
#[inline]
pub fn type_info(ty: &Bound<'_, PyType>) -> PyResult<TypeInfo> {
    let (addr, tag) = key(ty);
    if tag != 0 {
        let hit = CACHE.with_borrow(|c| c.iter().find(|e| e.addr == addr && e.tag == tag).map(|e| e.info));
        if let Some(info) = hit {
            return Ok(info);
        }
    }
    type_info_miss(ty)
}

#[inline(never)]
fn type_info_miss(ty: &Bound<'_, PyType>) -> PyResult<TypeInfo> {
    let py = ty.py();
    #[cfg(feature = "test-hooks")]
    MISSES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
        torch: super::exchange::TorchState::of(ty),
    };
    // The lookups above assign a version tag if the type had none yet.
    let (addr, tag) = key(ty);
    if tag != 0 {
        let evicted = CACHE.with_borrow_mut(|c| {
            let mut out: Vec<Entry> = Vec::new();
            if let Some(i) = c.iter().position(|e| e.addr == addr) {
                out.push(c.remove(i));
            }
            if c.len() == CAPACITY {
                out.push(c.remove(0));
            }
            c.push(Entry { addr, tag, info, framework: None, _keep: ty.clone().unbind() });
            out
        });
        // Dropped outside the borrow: releasing a type may run Python code that imports again.
        drop(evicted);
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
        if let Some(e) = c.iter_mut().find(|e| e.addr == addr && e.tag == tag) {
            e.info.legacy = true;
        }
    });
}

/// The framework of `ty` (see `export/framework.rs`), found by `find` on the first call for the
/// type and cached with the type's entry.
#[inline]
pub fn framework(
    ty: &Bound<'_, PyType>,
    find: fn(&Bound<'_, PyType>) -> PyResult<Framework>,
) -> PyResult<Framework> {
    let (addr, tag) = key(ty);
    if tag != 0 {
        let hit = CACHE
            .with_borrow(|c| c.iter().find(|e| e.addr == addr && e.tag == tag).and_then(|e| e.framework));
        if let Some(f) = hit {
            return Ok(f);
        }
    }
    let found = find(ty)?;
    // `find` made the type's entry (through `type_info`), unless the type cannot be cached.
    let (addr, tag) = key(ty);
    CACHE.with_borrow_mut(|c| {
        if let Some(e) = c.iter_mut().find(|e| e.addr == addr && e.tag == tag) {
            e.framework = Some(found);
        }
    });
    Ok(found)
}

/// A framework that results can be returned as (see `export/framework.rs`, which makes them and
/// says how; the value is defined here because the per-type cache holds it): found from an input
/// ([`Framework::of`]) or named ([`Framework::numpy`], [`Framework::torch`],
/// [`Framework::dlbridge`]). Cheap to copy.
#[derive(Clone, Copy)]
pub struct Framework {
    pub(in crate::python) kind: Kind,
}

/// How a [`Framework`] makes its results (see `export/framework.rs`).
#[derive(Clone, Copy)]
pub(in crate::python) enum Kind {
    Dlbridge,
    Numpy,
    Table(ExchangeApi),
    Function(&'static Importer),
}

/// A framework's own `from_dlpack`, found once per type.
pub(in crate::python) struct Importer {
    pub(in crate::python) func: Py<PyAny>,
    /// Whether it takes a DLPack capsule rather than an object with `__dlpack__` (tensorflow).
    pub(in crate::python) capsule: bool,
    /// Where it was found (`"jax.dlpack.from_dlpack"`), for `repr` and errors.
    pub(in crate::python) name: String,
}
