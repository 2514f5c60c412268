//! XLA's intra-op thread pool, for a parallel loop in a handler ([`Call::thread_pool`](super::Call::thread_pool)).
//!
//! A loop of `n` items is shared among the calling thread and up to `threads - 1` tasks scheduled
//! on XLA's pool (`XLA_FFI_ThreadPool_Schedule`): each claims the next item from one counter
//! until none is left, so the caller alone finishes the loop when the pool runs nothing (XLA
//! warns that a scheduled task may run late, in the caller's thread, or on a pool of one thread).
//! The loop returns once every item has *finished*; a task that starts later claims nothing and
//! never touches the loop's closure, which is why the shared counter lives in an `Arc` of its
//! own and the closure is reached only through an item claimed before the loop ended. A panic in
//! an item is caught, the items not yet started are skipped, and the loop returns it as an error.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::api::{Api, FfiError, Result, drop_payload, panic_message};
use crate::xla_ffi::*;

/// XLA's intra-op thread pool for the call, or the calling thread alone where XLA lends none
/// (no pool in the context, an API table without the functions, a torch op): see
/// [`Call::thread_pool`](super::Call::thread_pool). Not `Send`: it is the call's.
pub struct ThreadPool<'c> {
    api: Api<'c>,
    ctx: *mut XLA_FFI_ExecutionContext,
    schedule: Option<XLA_FFI_ThreadPool_Schedule>,
    threads: usize,
    _call: PhantomData<&'c ()>,
}

impl std::fmt::Debug for ThreadPool<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool").field("threads", &self.threads).finish()
    }
}

impl<'c> ThreadPool<'c> {
    /// The pool `api` lends for the call of context `ctx` (the calling thread alone without one).
    pub(super) fn new(api: Api<'c>, ctx: *mut XLA_FFI_ExecutionContext) -> Self {
        let serial = Self { api, ctx, schedule: None, threads: 1, _call: PhantomData };
        let (Some(schedule), Some(num_threads)) =
            (api_field!(api, XLA_FFI_ThreadPool_Schedule), api_field!(api, XLA_FFI_ThreadPool_NumThreads))
        else {
            return serial;
        };
        let mut n: i64 = 0;
        let mut args = XLA_FFI_ThreadPool_NumThreads_Args {
            struct_size: XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            ctx,
            num_threads: &mut n,
        };
        // SAFETY: XLA's function with the call's context and arguments of the declared size.
        let err = unsafe { num_threads(&mut args) };
        if api.check(err, "thread pool").is_err() || n < 2 {
            // No pool here (XLA: "No intra-op thread pool available"), or one thread: the caller's.
            return serial;
        }
        Self { schedule: Some(schedule), threads: usize::try_from(n).unwrap_or(1), ..serial }
    }

    /// The number of threads a loop may run on (the pool's; 1 when the caller runs it alone).
    pub fn num_threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(i)` for every `i` in `0..n`, in parallel on the pool and the calling thread, and
    /// returns when all have finished. A panic in `f` is caught: the items not yet started are
    /// skipped and the panic is returned as an `INTERNAL` error.
    ///
    /// `f` runs on several threads at once: it is `Sync`, so it cannot reach the call (a `Call`
    /// is the calling thread's).
    ///
    /// ```compile_fail,E0277
    /// dlbridge::xla_handler! {
    ///     fn h(call, operands: 0, results: 0) {
    ///         let pool = call.thread_pool();
    ///         pool.parallel_for(4, |_| {
    ///             let _ = call.scratch::<u8>(1); // E0277: Call is not Sync
    ///         })
    ///     }
    /// }
    /// ```
    pub fn parallel_for<F: Fn(usize) + Sync>(&self, n: usize, f: F) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if n > isize::MAX as usize {
            // The claim counter passes n by at most one per thread: it must never wrap (an item
            // claimed twice would lend one chunk twice).
            return Err(FfiError::invalid_argument(format!("thread pool: a loop of {n} items")));
        }
        let job = Arc::new(Job::new(n, &f));
        let helpers = if self.schedule.is_some() { self.threads.min(n) - 1 } else { 0 };
        if let Some(schedule) = self.schedule {
            for _ in 0..helpers {
                let data = Arc::into_raw(Arc::clone(&job)).cast_mut().cast::<c_void>();
                let mut args = XLA_FFI_ThreadPool_Schedule_Args {
                    struct_size: XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE,
                    extension_start: std::ptr::null_mut(),
                    ctx: self.ctx,
                    task: Some(task),
                    data,
                };
                // SAFETY: XLA's function with the call's context and arguments of the declared
                // size; on success the task runs once with `data` (one reference of the job).
                let err = unsafe { schedule(&mut args) };
                if !err.is_null() {
                    // Not scheduled: its reference is released here, and the rest run serially.
                    // SAFETY: the reference made by into_raw just above, not handed over.
                    drop(unsafe { Arc::from_raw(data.cast_const().cast::<Job>()) });
                    let _ = self.api.check(err, "thread pool");
                    break;
                }
            }
        }
        // SAFETY: `f`, which the job points to, lives until this function returns, after wait():
        // after every item has finished.
        unsafe { job.run_items() };
        job.wait();
        job.result()
    }

    /// Runs `f(i, chunk)` over `data` cut into chunks of `chunk_len` elements (the last one
    /// shorter), chunk `i` in parallel with the others ([`parallel_for`](Self::parallel_for)):
    /// each chunk is lent to exactly one call, so `f` writes it freely. `chunk_len` 0 is an error.
    ///
    /// A chunk is lent for its call only: kept past it, it does not compile.
    ///
    /// ```compile_fail,E0521
    /// dlbridge::xla_handler! {
    ///     fn h(call, operands: 0, results: 0) {
    ///         let data = call.scratch::<f32>(8)?;
    ///         let kept = std::sync::Mutex::new(Vec::new());
    ///         call.thread_pool().for_each_chunk_mut(data, 2, |_, chunk| kept.lock().unwrap().push(chunk))?;
    ///         Ok(())
    ///     }
    /// }
    /// ```
    pub fn for_each_chunk_mut<T: Send, F: Fn(usize, &mut [T]) + Sync>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        f: F,
    ) -> Result<()> {
        if chunk_len == 0 {
            return Err(FfiError::invalid_argument("thread pool: chunks of 0 elements"));
        }
        let len = data.len();
        let base = SharedMut(data.as_mut_ptr());
        let base = &base;
        self.parallel_for(len.div_ceil(chunk_len), move |i| {
            let start = i * chunk_len;
            let n = chunk_len.min(len - start);
            // SAFETY: item i is claimed once (parallel_for), so chunk i is lent to this call
            // only; it lies within `data`, borrowed mutably for the whole loop.
            let chunk = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), n) };
            f(i, chunk)
        })
    }
}

/// `data`'s first element, shared with the loop's items, each of which makes its own disjoint
/// chunk of it.
struct SharedMut<T>(*mut T);
// SAFETY: the items reach disjoint chunks only, each from one thread: as sending `&mut [T]`
// chunks to those threads, which T: Send allows.
unsafe impl<T: Send> Sync for SharedMut<T> {}

/// One loop: its counters, the closure (as an untyped pointer: a task that starts after the loop
/// ended holds the job but never reads it), and how it ended.
struct Job {
    n: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    failed: AtomicBool,
    f: *const (),
    run: unsafe fn(*const (), usize),
    panic: Mutex<Option<String>>,
    finished: Mutex<bool>,
    all_done: Condvar,
}

// SAFETY: `f` points to an `F: Sync` (Job::new), which several threads may call at once; it is
// read only while an item is unfinished (run_items), the rest are atomics and locks.
unsafe impl Send for Job {}
// SAFETY: as Send.
unsafe impl Sync for Job {}

/// Calls the closure `f` points to (an `F`) with `i`.
///
/// # Safety
///
/// `f` points to a live `F`.
unsafe fn call<F: Fn(usize)>(f: *const (), i: usize) {
    // SAFETY: the caller's contract.
    unsafe { (*f.cast::<F>())(i) }
}

impl Job {
    fn new<F: Fn(usize) + Sync>(n: usize, f: &F) -> Self {
        Self {
            n,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            f: (f as *const F).cast(),
            run: call::<F>,
            panic: Mutex::new(None),
            finished: Mutex::new(false),
            all_done: Condvar::new(),
        }
    }

    /// Claims and runs items until none is left.
    ///
    /// # Safety
    ///
    /// Until the job's last item finishes, `self.f` points to a live `F` (the loop waits for
    /// that before its closure goes); once every item is claimed the closure is never read.
    unsafe fn run_items(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            if !self.failed.load(Ordering::Relaxed) {
                // SAFETY: item i is unfinished, so the loop still waits and `f` is alive.
                let r = catch_unwind(AssertUnwindSafe(|| unsafe { (self.run)(self.f, i) }));
                if let Err(p) = r {
                    self.failed.store(true, Ordering::Relaxed);
                    let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                    if slot.is_none() {
                        *slot = Some(panic_message(&*p).to_owned());
                    }
                    drop(slot);
                    // Never unwinds: a payload whose Drop panics would otherwise leave this
                    // loop (and parallel_for, whose closure goes) while other items still run.
                    drop_payload(p);
                }
            }
            // The last item to finish wakes the loop; AcqRel chains every item's writes to it.
            if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
                *self.finished.lock().unwrap_or_else(|e| e.into_inner()) = true;
                self.all_done.notify_all();
            }
        }
    }

    /// Blocks until every item has finished.
    fn wait(&self) {
        let mut finished = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        while !*finished {
            finished = self.all_done.wait(finished).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn result(&self) -> Result<()> {
        match self.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            None => Ok(()),
            Some(m) => {
                Err(FfiError::new(XLA_FFI_Error_Code::INTERNAL, format!("a thread pool task panicked: {m}")))
            }
        }
    }
}

/// The task XLA runs: one reference of a job, whose items it helps run.
unsafe extern "C" fn task(data: *mut c_void) {
    // SAFETY: a reference parallel_for made with Arc::into_raw for this task, taken back once.
    let job = unsafe { Arc::from_raw(data.cast_const().cast::<Job>()) };
    // SAFETY: the job's contract: an unfinished item keeps its loop (and closure) alive.
    unsafe { job.run_items() };
}
