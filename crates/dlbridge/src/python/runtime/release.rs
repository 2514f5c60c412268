//! Releasing Python resources from deleters and drops without ever blocking: a reference
//! ([`release_object`]), a buffer-protocol view ([`HeldBuffer`]) or a foreign producer's deleter
//! ([`gate_deleter`]) is released at once when this thread holds the GIL, and otherwise queued and
//! released by the next thread that does.
//!
//! A deleter may run on any thread: a consumer's worker, a rayon task, a thread the interpreter
//! never saw. Taking the GIL there (`PyGILState_Ensure`) can deadlock: the thread holding it may be
//! waiting for this one (a scoped worker joined by a caller that did not release the GIL). So a
//! drop without the GIL only pushes onto a short mutex-guarded queue (never held while calling
//! out) and asks CPython to drain it through `Py_AddPendingCall`, which the interpreter's main
//! thread runs at its next check; every entry point of dlbridge that holds the GIL also drains
//! it, as PyO3 does with its own deferred reference counts. After finalization nothing is queued:
//! the resource is leaked rather than touch a dead interpreter.

use std::ffi::{c_int, c_void};
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::ffi;
use pyo3::prelude::*;

use crate::fork::ForkSafeMutex;
use crate::managed::{ManagedTensor, PendingDeleter};

/// Something to release with the GIL.
enum Pending {
    Object(NonNull<ffi::PyObject>),
    Buffer(NonNull<ffi::Py_buffer>),
    /// A foreign producer's deleter (torch's, jax's, a capsule's): it may take the GIL.
    Deleter(PendingDeleter),
}

// SAFETY: the pointers are only dereferenced (released) by a thread holding the GIL.
unsafe impl Send for Pending {}

impl Pending {
    /// # Safety
    ///
    /// The GIL is held; the resource is released once.
    unsafe fn release(self) {
        match self {
            // SAFETY: the caller's promise; a strong reference owned by the queue.
            Pending::Object(p) => unsafe { ffi::Py_DECREF(p.as_ptr()) },
            // SAFETY: a filled view owned by the queue, released once, then its box freed.
            Pending::Buffer(p) => unsafe {
                ffi::PyBuffer_Release(p.as_ptr());
                drop(Box::from_raw(p.as_ptr()));
            },
            // With the GIL held here, a deleter that takes it again (PyGILState_Ensure) cannot
            // wait for another thread.
            Pending::Deleter(d) => d.run(),
        }
    }
}

/// Queued releases, and whether the interpreter has begun finalizing (set by an `atexit` hook
/// under this lock): from then on nothing is queued or scheduled, so `Py_AddPendingCall` is never
/// called on an interpreter being torn down.
/// A forked child finds it unlocked ([`crate::fork`]): a native thread may hold it at any time.
static QUEUE: ForkSafeMutex<Queue> = ForkSafeMutex::new(Queue { items: Vec::new(), finalizing: false });

struct Queue {
    items: Vec<Pending>,
    finalizing: bool,
}

fn queue() -> std::sync::MutexGuard<'static, Queue> {
    QUEUE.lock()
}
/// Whether the queue may be non-empty (checked without the lock on every entry point).
static QUEUED: AtomicBool = AtomicBool::new(false);
/// Whether a pending call to drain the queue is already scheduled.
static SCHEDULED: AtomicBool = AtomicBool::new(false);

/// Whether this thread holds the GIL, asked without taking it: the thread state CPython has current
/// is this thread's own. False when in doubt (no current thread state, or one this thread did not
/// get through `PyGILState`); then the resource is queued, which is always safe.
#[inline]
pub(crate) fn attached_here() -> bool {
    // SAFETY: reads CPython's current thread state, NULL when none (also after finalization).
    let current = unsafe { ffi::compat::PyThreadState_GetUnchecked() };
    // SAFETY: only reached with a live runtime (a current thread state exists); reads this
    // thread's own PyGILState slot.
    !current.is_null() && current == unsafe { ffi::PyGILState_GetThisThreadState() }
}

fn release_or_queue(p: Pending) {
    if attached_here() {
        // SAFETY: this thread holds the GIL.
        unsafe { p.release() };
        return;
    }
    let mut q = queue();
    // SAFETY: reads a runtime flag; callable without the GIL.
    if q.finalizing || unsafe { ffi::Py_IsInitialized() } == 0 {
        // The interpreter is finalizing or gone: leak rather than crash (a `Pending` releases
        // nothing by itself).
        let _leaked = p;
        return;
    }
    q.items.push(p);
    QUEUED.store(true, Ordering::Release);
    if !SCHEDULED.swap(true, Ordering::AcqRel) {
        // SAFETY: Py_AddPendingCall may be called from any thread without the GIL; the callback
        // is a plain function that runs with the GIL held. The queue lock is held across the call
        // and `finalizing` is false, so the atexit hook (which takes the lock) has not run: the
        // interpreter is not being torn down.
        if unsafe { ffi::Py_AddPendingCall(Some(drain_pending), std::ptr::null_mut()) } != 0 {
            // CPython's pending-call queue is full: the next entry point drains ours instead.
            SCHEDULED.store(false, Ordering::Release);
        }
    }
    drop(q);
}

/// Registers (once per copy of the crate) the `atexit` hook that marks the interpreter as
/// finalizing and releases what is queued; false if it could not be registered (then the caller
/// tries again at its next entry).
pub(crate) fn register_atexit(py: Python<'_>) -> bool {
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    if REGISTERED.load(Ordering::Relaxed) {
        return true;
    }
    let hook = pyo3::types::PyCFunction::new_closure(py, None, None, |_args, _kwargs| {
        queue().finalizing = true;
        // SAFETY: the hook runs with the GIL held.
        unsafe { drain() };
    });
    let ok = hook.and_then(|h| py.import("atexit")?.call_method1("register", (h,))).is_ok();
    REGISTERED.store(ok, Ordering::Relaxed);
    ok
}

extern "C" fn drain_pending(_arg: *mut c_void) -> c_int {
    SCHEDULED.store(false, Ordering::Release);
    // SAFETY: CPython runs pending calls with the GIL held.
    unsafe { drain() };
    0
}

/// Releases everything queued.
///
/// # Safety
///
/// The GIL is held.
unsafe fn drain() {
    if !QUEUED.swap(false, Ordering::AcqRel) {
        return;
    }
    // Taken out first, so no lock is held while Python code (a __del__) runs.
    let mut items = std::mem::take(&mut queue().items);
    for p in items.drain(..) {
        // SAFETY: the caller's promise.
        unsafe { p.release() };
    }
    // The emptied Vec goes back, keeping its capacity: a steady trickle of drops without the GIL
    // (torch frees a tensor with the GIL released) then queues without allocating each time.
    let mut q = queue();
    if q.items.capacity() == 0 {
        q.items = items;
    }
}

/// Releases what drops on threads without the GIL left queued; one relaxed load when nothing is.
/// Called by dlbridge's entry points.
#[inline]
pub(crate) fn drain_queued(_py: Python<'_>) {
    if QUEUED.load(Ordering::Relaxed) {
        // SAFETY: `Python` proves the GIL is held.
        unsafe { drain() }
    }
}

/// Releases a strong reference: at once with the GIL, else queued (never blocks).
///
/// # Safety
///
/// `obj` is a strong reference the caller owns and gives up.
pub(crate) unsafe fn release_object(obj: NonNull<ffi::PyObject>) {
    release_or_queue(Pending::Object(obj));
}

/// Routes a foreign tensor's deleter through the queue: when the tensor is dropped on a thread
/// that holds the GIL the deleter runs at once; elsewhere it is queued and run by the next GIL
/// holder (the pending call, or any dlbridge entry point), never on the dropping thread. A
/// producer's deleter may take the GIL (torch's does: `PyGILState_Ensure`), which deadlocks on a
/// worker whose joining caller holds it; dlbridge cannot prove any foreign deleter free of that,
/// so every tensor a producer hands over through the Python layer (capsules, exchange tables) goes
/// through here. A tensor dlbridge hands on to a framework's exchange table leaves the gate
/// (`ExchangeApi::to_py_object`): the framework frees what it owns on its own threads, as it
/// does after its own `from_dlpack`.
#[inline]
pub(crate) fn gate_deleter(t: ManagedTensor) -> ManagedTensor {
    t.with_deleter_gate(defer_deleter)
}

fn defer_deleter(d: PendingDeleter) {
    release_or_queue(Pending::Deleter(d));
}

/// A buffer-protocol view held until drop: filled in place on the heap, so exporters that point
/// `shape` or `strides` into the `Py_buffer` itself (`PyBuffer_FillInfo` sets `shape = &len`) stay
/// valid for as long as it is held; released with [`PyBuffer_Release`](ffi::PyBuffer_Release) at
/// once with the GIL, else queued (never blocks). The one way dlbridge takes a buffer view.
pub(crate) struct HeldBuffer(NonNull<ffi::Py_buffer>);

// SAFETY: the view is only read (plain fields) and released with the GIL (queued otherwise).
unsafe impl Send for HeldBuffer {}
// SAFETY: shared access only reads the plain fields of the filled view.
unsafe impl Sync for HeldBuffer {}

impl HeldBuffer {
    /// `PyObject_GetBuffer(obj, flags)` into a new heap view; the exporter's error on failure.
    pub(crate) fn get(obj: &Bound<'_, PyAny>, flags: c_int) -> PyResult<Self> {
        join_process(obj.py());
        let view = Box::into_raw(Box::new(MaybeUninit::<ffi::Py_buffer>::zeroed())).cast::<ffi::Py_buffer>();
        // SAFETY: a zeroed view for the exporter to fill, at its final address.
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view, flags) } != 0 {
            // SAFETY: not filled, so nothing to release: just the box.
            drop(unsafe { Box::from_raw(view.cast::<MaybeUninit<ffi::Py_buffer>>()) });
            return Err(PyErr::fetch(obj.py()));
        }
        // SAFETY: non-NULL (a box).
        Ok(Self(unsafe { NonNull::new_unchecked(view) }))
    }

    /// The filled view.
    pub(crate) fn view(&self) -> &ffi::Py_buffer {
        // SAFETY: filled by a successful GetBuffer and not released before drop.
        unsafe { self.0.as_ref() }
    }
}

impl Drop for HeldBuffer {
    fn drop(&mut self) {
        release_or_queue(Pending::Buffer(self.0));
    }
}

/// Keeps a Python object alive for as long as a tensor uses its memory. Dropped with the GIL it
/// releases the reference at once; dropped without (a consumer's worker thread) it never waits for
/// the GIL, which could deadlock, but queues the release (see `release.rs`); after finalization
/// it leaks the reference rather than touch a dead interpreter.
pub struct PyOwner(NonNull<ffi::PyObject>);

// SAFETY: the reference is only released with the GIL held (queued otherwise); nothing else
// dereferences it.
unsafe impl Send for PyOwner {}
// SAFETY: shared access does nothing with the pointer.
unsafe impl Sync for PyOwner {}

impl PyOwner {
    /// Owns a reference to `obj`.
    pub fn new(obj: &Bound<'_, PyAny>) -> Self {
        // Registers the atexit hook that keeps a late release off a finalizing interpreter.
        join_process(obj.py());
        // SAFETY: a live object's pointer, never NULL.
        Self(unsafe { NonNull::new_unchecked(obj.clone().into_ptr()) })
    }
}

impl Drop for PyOwner {
    fn drop(&mut self) {
        // SAFETY: the strong reference `new` took, given up once.
        unsafe { release_object(self.0) }
    }
}

/// Whether this copy of the crate has joined the process: registered the `atexit` hook that stops
/// deferred releases before the interpreter is torn down. (The borrow registry needs no joining:
/// every copy finds the process's through `crate::process_wide`.)
static JOINED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Joins the process (see [`JOINED`]) once: every entry point from Python calls it (one relaxed load
/// after the first time), so a downstream extension that never calls [`crate::python::init_module`] joins too.
#[inline]
pub(crate) fn join_process(py: Python<'_>) {
    if !JOINED.load(std::sync::atomic::Ordering::Relaxed) {
        join(py);
    }
}

/// What every import entry point does first, with the GIL: release what drops on threads without
/// the GIL queued, and join the process (both one relaxed load when there is nothing to do).
#[inline]
pub(crate) fn enter(py: Python<'_>) {
    drain_queued(py);
    join_process(py);
}

#[cold]
fn join(py: Python<'_>) {
    // Under the GIL, so two threads of this module never race here; not joined until the hook is
    // registered (then the caller tries again at its next entry).
    if register_atexit(py) {
        JOINED.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
