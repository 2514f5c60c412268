//! What one process shares among the copies of this crate it has loaded.
//!
//! Each Python extension module that embeds dlbridge (the `dlbridge` wheel's own module, a user's
//! `#[pymodule]`) carries its own copy of the crate, with its own statics. Memory belongs to the
//! process, though: two copies may hand out slices of one array, so the aliasing rule needs one
//! borrow registry per process, not per copy.
//!
//! Each copy built with the `python` feature on Linux exports one C symbol,
//! `dlbridge_process_tables_v1`, a static table of its process-wide services (a versioned C ABI,
//! [`ProcessTables`]). The process's services are those of the first copy the dynamic loader
//! loaded: every copy finds it by walking the loaded objects in load order (`dl_iterate_phdr`)
//! and asking each one for the symbol (`dlsym` on an `RTLD_NOLOAD` handle), once, before it first
//! needs it. Nothing user code can reach from Python takes part (no attribute of `sys`, no
//! environment variable), and the answer never changes: extension modules are never unloaded,
//! and the first copy was loaded before any later one could run. A copy that finds no table
//! (Miri, another OS, a program that does not export its symbols) uses its own.

use crate::borrow::RegistryApi;

/// The process-wide services one copy of the crate offers every other copy in the process. A
/// table is read only up to its `size` (a newer copy may append fields; an older one's table is
/// shorter), and each service checks its own version.
#[repr(C)]
#[derive(Debug)]
pub struct ProcessTables {
    /// `size_of::<ProcessTables>()` in the copy that made the table.
    pub size: usize,
    /// The borrow registry (see [`crate::borrow`]).
    pub borrow: &'static RegistryApi,
}

/// This copy's table, exported under a fixed name so that every other copy in the process can find
/// it (see the module docs). Only the Python layer exports it: that is where several copies meet.
#[cfg(all(feature = "python", target_os = "linux", not(miri)))]
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static dlbridge_process_tables_v1: ProcessTables = OWN;

const OWN: ProcessTables =
    ProcessTables { size: std::mem::size_of::<ProcessTables>(), borrow: &crate::borrow::LOCAL };

/// This copy's own table (what [`tables`] answers where no copy exports one).
#[cfg(not(all(feature = "python", target_os = "linux", not(miri))))]
static OWN_TABLES: ProcessTables = OWN;

/// The process's services: the first loaded copy's table of a layout this copy understands, else
/// this copy's own. Found once; every later call is one atomic load.
pub fn tables() -> &'static ProcessTables {
    use std::sync::atomic::{AtomicPtr, Ordering};
    static FOUND: AtomicPtr<ProcessTables> = AtomicPtr::new(std::ptr::null_mut());
    let p = FOUND.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: only stored below, from a process-lifetime table.
        return unsafe { &*p };
    }
    let t = find();
    // Racing threads of this copy find the same table (the loaded objects before any copy that
    // runs never change), so whichever store lands is the answer.
    FOUND.store(std::ptr::from_ref(t).cast_mut(), Ordering::Release);
    t
}

#[cfg(not(all(feature = "python", target_os = "linux", not(miri))))]
fn find() -> &'static ProcessTables {
    &OWN_TABLES
}

#[cfg(all(feature = "python", target_os = "linux", not(miri)))]
fn find() -> &'static ProcessTables {
    first_loaded().unwrap_or(&dlbridge_process_tables_v1)
}

/// The first loaded object's table of a layout this copy understands.
#[cfg(all(feature = "python", target_os = "linux", not(miri)))]
fn first_loaded() -> Option<&'static ProcessTables> {
    use std::ffi::{CStr, CString, c_int, c_void};

    // Collect the names first: dlopen must not run inside dl_iterate_phdr's callback (it holds
    // the loader's lock there).
    unsafe extern "C" fn collect(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: `data` is the Vec passed below, for the duration of the walk; `info` is the
        // loader's description of one object, valid during the callback.
        let (names, info) = unsafe { (&mut *data.cast::<Vec<Option<CString>>>(), &*info) };
        let name = if info.dlpi_name.is_null() {
            None
        } else {
            // SAFETY: a NUL-terminated string the loader owns, copied out during the callback.
            let n = unsafe { CStr::from_ptr(info.dlpi_name) };
            if n.is_empty() { None } else { Some(n.to_owned()) }
        };
        names.push(name);
        0
    }
    let mut names: Vec<Option<CString>> = Vec::new();
    // SAFETY: a callback of the right type and a pointer to a live Vec it alone uses.
    unsafe { libc::dl_iterate_phdr(Some(collect), std::ptr::from_mut(&mut names).cast()) };

    names.iter().find_map(|name| {
        let path = name.as_ref().map_or(std::ptr::null(), |n| n.as_ptr());
        // SAFETY: RTLD_NOLOAD only finds an object already loaded (NULL: the main program); the
        // handle is closed below, which only drops the reference this call added.
        let handle = unsafe { libc::dlopen(path, libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if handle.is_null() {
            return None;
        }
        // SAFETY: a live handle and a static NUL-terminated name.
        let sym = unsafe { libc::dlsym(handle, c"dlbridge_process_tables_v1".as_ptr()) };
        // SAFETY: the handle from dlopen above. The object stays loaded (it was loaded before,
        // and extension modules are never unloaded), so the symbol stays valid.
        unsafe { libc::dlclose(handle) };
        let t = sym.cast::<ProcessTables>().cast_const();
        if t.is_null() {
            return None;
        }
        // SAFETY: an object exporting this symbol is a copy of this crate (the name is ours and
        // versioned): a `ProcessTables` whose `size` field comes first and says how many bytes
        // follow; nothing beyond `size` is read. The object is never unloaded.
        let size = unsafe { std::ptr::addr_of!((*t).size).read() };
        let borrow_end = std::mem::offset_of!(ProcessTables, borrow) + std::mem::size_of::<&RegistryApi>();
        if size < borrow_end {
            return None;
        }
        // SAFETY: within `size` (checked): a pointer to a static registry table.
        let borrow = unsafe { std::ptr::addr_of!((*t).borrow).read() };
        if borrow.version != RegistryApi::VERSION {
            return None;
        }
        // SAFETY: the table covers every field this copy reads (checked above), and lives as long
        // as the process.
        Some(unsafe { &*t })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_that_exports_no_table_uses_its_own() {
        // A test binary does not export its symbols (no -rdynamic), so no loaded object answers.
        let t = tables();
        assert!(std::ptr::eq(t.borrow, &crate::borrow::LOCAL));
        assert_eq!(t.size, std::mem::size_of::<ProcessTables>());
        assert!(std::ptr::eq(t, tables()));
    }
}
