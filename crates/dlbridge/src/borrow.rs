//! Dynamic borrow checking of tensor memory: the aliasing rule of dlbridge's safe API.
//!
//! Two [`ManagedTensor`](crate::ManagedTensor)s (or `TensorView`s) can describe the same memory:
//! the same numpy array passed twice to one function, two exports of one Rust buffer, two
//! extensions that each imported the same torch tensor. Rust's borrow checker sees two unrelated
//! handles, so typed access registers what it hands out here, as rust-numpy does for numpy arrays:
//! every slice or ndarray view holds a [`Lease`] on the byte range its elements span, shared for
//! reading and exclusive for writing, and a lease that overlaps an exclusive one (or an exclusive
//! one that overlaps any) is refused with [`Error::AlreadyBorrowed`]. The lease ends when the
//! guard that holds it drops.
//!
//! Ranges are the tensor's whole byte span, so two interleaved views of one buffer (`a[::2]` and
//! `a[1::2]`) conflict although their elements do not: conservative, never unsound.
//!
//! The registry is process-wide. Each extension module that embeds dlbridge has its own copy of
//! this crate, so the Python layer shares one registry between them: the first to initialise
//! publishes its table (a versioned C ABI, [`RegistryApi`]) as a capsule on the `sys` module and
//! every later one uses that table (see `python::init_module`). Rust programs without Python use
//! the crate's own.
//!
//! ```
//! use std::sync::Arc;
//! use dlbridge::{Error, ManagedTensor};
//! let t = Arc::new(ManagedTensor::from_vec(vec![0.0f64; 4], &[4]).unwrap());
//! // Two handles over the same memory, as a function given the same array twice would get.
//! let mut a = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
//! let b = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
//! let mut w = a.as_slice_mut::<f64>().unwrap();
//! assert!(matches!(b.as_slice::<f64>(), Err(Error::AlreadyBorrowed { .. })));
//! w[0] = 1.0;
//! drop(w);
//! assert_eq!(b.as_slice::<f64>().unwrap()[0], 1.0);
//! ```

//!
//! Within one handle, Rust's borrow checker already does the work: a mutable guard cannot coexist
//! with any other borrow of the same tensor, and no guard outlives its tensor.
//!
//! ```compile_fail,E0502
//! let mut t = dlbridge::ManagedTensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
//! let r = t.as_slice::<f32>().unwrap();
//! let mut w = t.as_slice_mut::<f32>().unwrap(); // E0502: `t` is also borrowed as immutable
//! w[0] = r[1];
//! ```
//!
//! ```compile_fail,E0499
//! let mut t = dlbridge::ManagedTensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
//! let mut a = t.as_slice_mut::<f32>().unwrap();
//! let mut b = t.as_slice_mut::<f32>().unwrap(); // E0499: `t` borrowed as mutable twice
//! a[0] = b[1];
//! ```
//!
//! ```compile_fail,E0597
//! let s = {
//!     let t = dlbridge::ManagedTensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
//!     t.as_slice::<f32>().unwrap() // E0597: `t` does not live long enough
//! };
//! assert_eq!(s[0], 1.0);
//! ```

use std::ffi::c_int;
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::error::{Error, Result};

/// The registry's C ABI, shared between extension modules that each embed a copy of dlbridge.
/// A new layout gets a new `version` (and a new capsule name); a table of another version is never
/// used.
#[repr(C)]
pub struct RegistryApi {
    /// [`RegistryApi::VERSION`].
    pub version: u64,
    /// Registers `[lo, hi)`: returns 0 on success, 1 when it conflicts with a live lease, 2 when
    /// the caller should ask its active registry again (this copy just joined another's); nothing
    /// is registered unless it returns 0.
    pub acquire: unsafe extern "C" fn(lo: usize, hi: usize, exclusive: c_int) -> c_int,
    /// Removes one lease registered with exactly these arguments.
    pub release: unsafe extern "C" fn(lo: usize, hi: usize, exclusive: c_int),
}

impl RegistryApi {
    /// The layout version of this table.
    pub const VERSION: u64 = 1;
}

/// One live lease.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Entry {
    lo: usize,
    hi: usize,
    exclusive: bool,
}

/// The live leases of the crate's own registry. Few are live at once (one per guard), so a
/// vector scanned under a mutex beats any tree; it keeps its capacity, so steady state allocates
/// nothing. The lock is held while calling out only in [`use_shared`], into the registry of the
/// copy that published it, which never switches and so never calls back into this one: locks are
/// always taken own-then-shared, so they cannot deadlock.
static LEASES: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

fn leases() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    // Nothing panics while the lock is held; a poisoned lock still holds consistent data.
    LEASES.lock().unwrap_or_else(|e| e.into_inner())
}

unsafe extern "C" fn local_acquire(lo: usize, hi: usize, exclusive: c_int) -> c_int {
    let exclusive = exclusive != 0;
    let mut l = leases();
    // This copy switched to another registry after the caller read `ACTIVE` (the switch happens
    // under this lock): register there instead, so no lease lands in a registry nobody checks.
    if switched().is_some() {
        return 2;
    }
    if l.iter().any(|e| e.lo < hi && lo < e.hi && (exclusive || e.exclusive)) {
        return 1;
    }
    l.push(Entry { lo, hi, exclusive });
    0
}

unsafe extern "C" fn local_release(lo: usize, hi: usize, exclusive: c_int) {
    let want = Entry { lo, hi, exclusive: exclusive != 0 };
    let (removed, shared) = {
        let mut l = leases();
        let removed = l.iter().rposition(|e| *e == want).map(|i| l.swap_remove(i)).is_some();
        // Read under the lock: `use_shared` switches under it, so a switch seen here happened
        // while this lease was live, and it was copied into the shared registry then.
        (removed, switched())
    };
    if let (true, Some(api)) = (removed, shared) {
        // SAFETY: the table `use_shared` was promised; the lease it holds for this one.
        unsafe { (api.release)(lo, hi, exclusive) }
    }
}

/// The other copy's registry this one joined, if it has.
fn switched() -> Option<&'static RegistryApi> {
    let active = ACTIVE.load(Ordering::Acquire);
    if active.is_null() || std::ptr::eq(active, &LOCAL) {
        None
    } else {
        // SAFETY: only `use_shared` stores here, and it stores a process-lifetime table.
        Some(unsafe { &*active })
    }
}

/// This copy of the crate's own registry.
pub static LOCAL: RegistryApi =
    RegistryApi { version: RegistryApi::VERSION, acquire: local_acquire, release: local_release };

/// The registry in use: [`LOCAL`] until [`use_shared`] points it at another module's.
static ACTIVE: AtomicPtr<RegistryApi> = AtomicPtr::new(std::ptr::null_mut());

fn active() -> &'static RegistryApi {
    let p = ACTIVE.load(Ordering::Acquire);
    if p.is_null() {
        &LOCAL
    } else {
        // SAFETY: only `use_shared` stores here, and it stores a process-lifetime table.
        unsafe { &*p }
    }
}

/// Makes this copy of the crate register its leases in `api` from now on; returns whether it
/// switched. Leases live in the own registry are copied into `api` first (each is then released in
/// both, see `local_release`), so every lease of this copy is checked against the shared ones from
/// the switch on; if one conflicts there, nothing is copied and the copy stays on its own registry.
/// It all happens under the own registry's lock, so no lease can slip in or out meanwhile.
///
/// # Safety
///
/// `api` is a table of [`RegistryApi::VERSION`] whose functions behave as documented and live for
/// the rest of the process (another copy of this crate's [`LOCAL`]).
pub unsafe fn use_shared(api: &'static RegistryApi) -> bool {
    if std::ptr::eq(api, &LOCAL) {
        // Our own table (published by this copy): nothing to join.
        return true;
    }
    let l = leases();
    let mut copied = 0;
    for e in l.iter() {
        // SAFETY: the caller's promise about `api`; a different registry (checked above), so its
        // lock is not the one held here.
        if unsafe { (api.acquire)(e.lo, e.hi, c_int::from(e.exclusive)) } != 0 {
            break;
        }
        copied += 1;
    }
    if copied < l.len() {
        for e in &l[..copied] {
            // SAFETY: as above; releasing exactly what was just registered.
            unsafe { (api.release)(e.lo, e.hi, c_int::from(e.exclusive)) }
        }
        return false;
    }
    ACTIVE.store(std::ptr::from_ref(api).cast_mut(), Ordering::Release);
    drop(l);
    true
}

/// A registered byte range; released on drop. Holding one is what makes a typed slice or view of
/// tensor memory sound against another handle over the same memory.
#[derive(Debug)]
#[must_use]
pub struct Lease {
    api: &'static RegistryApi,
    lo: usize,
    hi: usize,
    exclusive: bool,
}

impl std::fmt::Debug for RegistryApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryApi").field("version", &self.version).finish_non_exhaustive()
    }
}

impl Lease {
    /// Registers the byte range `[lo, hi)`, shared or exclusive. An empty range registers nothing
    /// and always succeeds (no memory is reached).
    pub(crate) fn acquire(lo: usize, hi: usize, exclusive: bool) -> Result<Self> {
        // A copy embedded in a Python extension joins the process's shared registry the first
        // time it runs with the GIL (every entry point from Python also does).
        #[cfg(feature = "python")]
        crate::python::join_if_attached();
        loop {
            let api = active();
            if lo < hi {
                // SAFETY: a table of the expected version (LOCAL, or one `use_shared` was promised).
                match unsafe { (api.acquire)(lo, hi, c_int::from(exclusive)) } {
                    0 => {}
                    2 => continue,
                    _ => return Err(Error::AlreadyBorrowed { start: lo, end: hi, exclusive }),
                }
            }
            return Ok(Self { api, lo, hi, exclusive });
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.lo < self.hi {
            // SAFETY: the table this lease was registered in, with the same arguments.
            unsafe { (self.api.release)(self.lo, self.hi, c_int::from(self.exclusive)) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Addresses far from any real allocation, distinct per test (tests run in parallel and
    // share the registry).
    const BASE: usize = usize::MAX / 2;

    #[test]
    fn shared_leases_coexist_and_exclusive_ones_do_not() {
        let b = BASE;
        let r1 = Lease::acquire(b, b + 16, false).unwrap();
        let r2 = Lease::acquire(b + 8, b + 24, false).unwrap();
        assert_eq!(
            Lease::acquire(b + 20, b + 21, true).unwrap_err(),
            Error::AlreadyBorrowed { start: b + 20, end: b + 21, exclusive: true }
        );
        drop(r2);
        let w = Lease::acquire(b + 20, b + 21, true).unwrap();
        assert!(Lease::acquire(b + 16, b + 24, false).is_err());
        // Touching ranges do not overlap.
        let _next = Lease::acquire(b + 21, b + 22, true).unwrap();
        drop((r1, w));
        let _all = Lease::acquire(b, b + 21, true).unwrap();
    }

    /// Another copy's registry, as a second extension module would publish it.
    static OTHER: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

    unsafe extern "C" fn other_acquire(lo: usize, hi: usize, exclusive: c_int) -> c_int {
        let exclusive = exclusive != 0;
        let mut l = OTHER.lock().unwrap();
        if l.iter().any(|e| e.lo < hi && lo < e.hi && (exclusive || e.exclusive)) {
            return 1;
        }
        l.push(Entry { lo, hi, exclusive });
        0
    }

    unsafe extern "C" fn other_release(lo: usize, hi: usize, exclusive: c_int) {
        let want = Entry { lo, hi, exclusive: exclusive != 0 };
        let mut l = OTHER.lock().unwrap();
        if let Some(i) = l.iter().rposition(|e| *e == want) {
            l.swap_remove(i);
        }
    }

    static OTHER_API: RegistryApi =
        RegistryApi { version: RegistryApi::VERSION, acquire: other_acquire, release: other_release };

    #[test]
    fn joining_another_registry_carries_live_leases_over() {
        let b = BASE + 8192;
        // Held in this copy's own registry before it joins (other tests may hold some too).
        let held = Lease::acquire(b, b + 8, true).unwrap();
        // Another copy already holds a lease elsewhere.
        // SAFETY: a live table of this version.
        assert_eq!(unsafe { other_acquire(b + 100, b + 108, 1) }, 0);
        // SAFETY: a process-lifetime table of this version that behaves as documented.
        assert!(unsafe { use_shared(&OTHER_API) });
        // The carried-over lease conflicts with new ones, now checked in the shared registry...
        assert!(Lease::acquire(b + 4, b + 5, false).is_err());
        assert!(Lease::acquire(b + 100, b + 101, false).is_err());
        // ...and releasing it frees it in both.
        drop(held);
        assert!(OTHER.lock().unwrap().iter().all(|e| e.lo != b));
        let _again = Lease::acquire(b, b + 8, true).unwrap();
    }

    #[test]
    fn empty_ranges_never_conflict() {
        let b = BASE + 4096;
        let _w = Lease::acquire(b, b + 8, true).unwrap();
        let _e = Lease::acquire(b + 4, b + 4, true).unwrap();
    }
}
