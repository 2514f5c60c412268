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
//! this crate, and all of them use the registry of the copy the process loaded first (its table,
//! a versioned C ABI, [`RegistryApi`], found through the loaded objects (`process_wide.rs`) before the first
//! lease). Rust programs without Python use the crate's own.
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

use crate::error::{Error, Result};
use crate::fork::ForkSafeMutex;
use crate::process_wide::Shared;

/// The registry's C ABI, shared between the copies of dlbridge in one process (each Python extension
/// module embeds one; see the module docs). A new layout gets a new `version`; a table of
/// another version is never used.
#[repr(C)]
pub struct RegistryApi {
    /// [`RegistryApi::VERSION`].
    pub version: u64,
    /// Registers `[lo, hi)`: returns 0 on success, 1 when it conflicts with a live lease (then
    /// nothing is registered).
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
/// nothing. The lock is never held while calling out.
/// A forked child finds it unlocked ([`crate::fork`]).
static LEASES: ForkSafeMutex<Vec<Entry>> = ForkSafeMutex::new(Vec::new());

fn leases() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    LEASES.lock()
}

unsafe extern "C" fn local_acquire(lo: usize, hi: usize, exclusive: c_int) -> c_int {
    let exclusive = exclusive != 0;
    let mut l = leases();
    if l.iter().any(|e| e.lo < hi && lo < e.hi && (exclusive || e.exclusive)) {
        return 1;
    }
    l.push(Entry { lo, hi, exclusive });
    0
}

unsafe extern "C" fn local_release(lo: usize, hi: usize, exclusive: c_int) {
    let want = Entry { lo, hi, exclusive: exclusive != 0 };
    let mut l = leases();
    if let Some(i) = l.iter().rposition(|e| *e == want) {
        l.swap_remove(i);
    }
}

/// This copy of the crate's own registry (the process's, when this copy was loaded first).
pub static LOCAL: RegistryApi =
    RegistryApi { version: RegistryApi::VERSION, acquire: local_acquire, release: local_release };

/// This copy's registry, exported under a fixed name so that every other copy in the process finds
/// it by walking the loaded objects; the same functions as [`LOCAL`].
#[cfg(all(feature = "python", target_os = "linux", not(miri)))]
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static dlbridge_borrow_registry_v1: RegistryApi = RegistryApi { ..LOCAL };

/// The registry every lease of this copy goes to: the process's (see the module docs).
#[inline]
fn active() -> &'static RegistryApi {
    static PROCESS: Shared<RegistryApi> = Shared::new();
    // SAFETY: only copies of this crate export this name, each a static `RegistryApi`; `usable`
    // reads the leading version field before anything else is used.
    unsafe {
        PROCESS.get(c"dlbridge_borrow_registry_v1", &LOCAL, |t| {
            // SAFETY: `version` is the first field of every version's table.
            std::ptr::addr_of!((*t).version).read() == RegistryApi::VERSION
        })
    }
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
        let api = active();
        // SAFETY: a registry table of the expected version, live for the process (`active`).
        if lo < hi && unsafe { (api.acquire)(lo, hi, c_int::from(exclusive)) } != 0 {
            return Err(Error::AlreadyBorrowed { start: lo, end: hi, exclusive });
        }
        Ok(Self { api, lo, hi, exclusive })
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

    #[test]
    fn empty_ranges_never_conflict() {
        let b = BASE + 4096;
        let _w = Lease::acquire(b, b + 8, true).unwrap();
        let _e = Lease::acquire(b + 4, b + 4, true).unwrap();
    }
}
