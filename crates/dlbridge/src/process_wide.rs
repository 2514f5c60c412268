//! What one process shares among the copies of this crate it has loaded.
//!
//! Each Python extension module that embeds dlbridge (the `dlbridge` wheel's own module, a user's
//! `#[pymodule]`) carries its own copy of the crate, with its own statics. Memory belongs to the
//! process, though: two copies may hand out slices of one array, so the aliasing rule needs one
//! borrow registry per process, not per copy.
//!
//! A service shared this way is a static C table each copy built with the `python` feature on
//! Linux exports under a fixed, versioned symbol name (the borrow registry's is
//! `dlbridge_borrow_registry_v1`). The process's table is the first loaded copy's: every copy finds
//! it by walking the loaded objects in load order (`dl_iterate_phdr`) and asking each one for the
//! symbol (`dlsym` on an `RTLD_NOLOAD` handle), once, before it first needs it ([`Shared`]).
//! Nothing user code can reach from Python takes part (no attribute of `sys`, no environment
//! variable), and the answer never changes: extension modules are never unloaded, and the first
//! copy was loaded before any later one could run. A copy that finds no table (Miri, another OS, a
//! program that does not export its symbols) uses its own.

use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, Ordering};

/// One process-wide service: the table of type `T` the first loaded copy exports under a symbol,
/// found once (then one atomic load per use).
pub(crate) struct Shared<T: 'static> {
    found: AtomicPtr<T>,
}

impl<T: Sync + 'static> Shared<T> {
    /// Not looked up yet.
    pub(crate) const fn new() -> Self {
        Self { found: AtomicPtr::new(std::ptr::null_mut()) }
    }

    /// The process's table: the first loaded object's `symbol` that `usable` accepts, else `own`.
    ///
    /// # Safety
    ///
    /// Every object that exports `symbol` exports a `T` under it that lives as long as the process
    /// (a name only this crate's copies export, versioned with `T`'s layout), except for fields
    /// `usable` checks before accepting it (it may read a leading size or version field only).
    pub(crate) unsafe fn get(
        &self,
        symbol: &CStr,
        own: &'static T,
        usable: fn(*const T) -> bool,
    ) -> &'static T {
        let p = self.found.load(Ordering::Acquire);
        if !p.is_null() {
            // SAFETY: only stored below, from a process-lifetime table.
            return unsafe { &*p };
        }
        // SAFETY: the caller's promise about `symbol`.
        let t = unsafe { first_loaded(symbol, usable) }.unwrap_or(own);
        // Racing threads of this copy find the same table (the objects loaded before any copy
        // that runs never change), so whichever store lands is the answer.
        self.found.store(std::ptr::from_ref(t).cast_mut(), Ordering::Release);
        t
    }
}

/// The first loaded object's `symbol` that `usable` accepts.
///
/// # Safety
///
/// As [`Shared::get`].
#[cfg(all(feature = "python", target_os = "linux", not(miri)))]
unsafe fn first_loaded<T: 'static>(symbol: &CStr, usable: fn(*const T) -> bool) -> Option<&'static T> {
    use std::ffi::{CString, c_int, c_void};

    /// One loaded object: its name (`None`: the main program) and the address ranges of its
    /// loaded segments.
    struct Object {
        name: Option<CString>,
        ranges: Vec<(usize, usize)>,
    }

    // Collect the objects first: dlopen must not run inside dl_iterate_phdr's callback (the
    // loader's lock is held there).
    unsafe extern "C" fn collect(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: `data` is the Vec passed below, for the duration of the walk; `info` is the
        // loader's description of one object, valid during the callback.
        let (objects, info) = unsafe { (&mut *data.cast::<Vec<Object>>(), &*info) };
        let name = if info.dlpi_name.is_null() {
            None
        } else {
            // SAFETY: a NUL-terminated string the loader owns, copied out during the callback.
            let n = unsafe { CStr::from_ptr(info.dlpi_name) };
            if n.is_empty() { None } else { Some(n.to_owned()) }
        };
        let headers = if info.dlpi_phdr.is_null() {
            &[][..]
        } else {
            // SAFETY: the loader's `dlpi_phnum` program headers of this object.
            unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) }
        };
        let ranges = headers
            .iter()
            .filter(|h| h.p_type == libc::PT_LOAD)
            .map(|h| {
                let lo = (info.dlpi_addr as usize).wrapping_add(h.p_vaddr as usize);
                (lo, lo.wrapping_add(h.p_memsz as usize))
            })
            .collect();
        objects.push(Object { name, ranges });
        0
    }
    let mut objects: Vec<Object> = Vec::new();
    // SAFETY: a callback of the right type and a pointer to a live Vec only it uses.
    unsafe { libc::dl_iterate_phdr(Some(collect), std::ptr::from_mut(&mut objects).cast()) };

    objects.iter().find_map(|object| {
        let path = object.name.as_ref().map_or(std::ptr::null(), |n| n.as_ptr());
        // SAFETY: RTLD_NOLOAD only finds an object already loaded (NULL: the main program); the
        // handle is closed below, which only drops the reference this call added.
        let handle = unsafe { libc::dlopen(path, libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if handle.is_null() {
            return None;
        }
        // SAFETY: a live handle and a NUL-terminated name.
        let sym = unsafe { libc::dlsym(handle, symbol.as_ptr()) };
        // SAFETY: the handle from dlopen above. The object stays loaded (it was loaded before this
        // call, and extension modules are never unloaded), so the symbol stays valid.
        unsafe { libc::dlclose(handle) };
        // Only the object's own definition counts: dlsym on the main program's handle searches
        // the whole global scope (a copy loaded later with RTLD_GLOBAL answered there first, and
        // copies that looked at different times found different tables), and on a library's
        // handle its dependencies too. Each copy is asked in its own turn, in load order.
        let at = sym as usize;
        if sym.is_null() || !object.ranges.iter().any(|&(lo, hi)| lo <= at && at < hi) {
            return None;
        }
        let t = sym.cast::<T>().cast_const();
        if !usable(t) {
            return None;
        }
        // SAFETY: the caller's promise: a process-lifetime `T` once `usable` accepted it.
        Some(unsafe { &*t })
    })
}

#[cfg(not(all(feature = "python", target_os = "linux", not(miri))))]
unsafe fn first_loaded<T: 'static>(_symbol: &CStr, _usable: fn(*const T) -> bool) -> Option<&'static T> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    static OWN: u64 = 7;

    #[test]
    fn a_program_that_exports_no_table_uses_its_own() {
        // A test binary exports no symbols (no -rdynamic), so no loaded object answers.
        static S: Shared<u64> = Shared::new();
        // SAFETY: no object exports this name.
        let t = unsafe { S.get(c"dlbridge_no_such_table_v1", &OWN, |_| true) };
        assert!(std::ptr::eq(t, &OWN));
        // SAFETY: as above.
        assert!(std::ptr::eq(unsafe { S.get(c"dlbridge_no_such_table_v1", &OWN, |_| false) }, &OWN));
    }
}
