//! Locks that survive `fork()`.
//!
//! A forked child has one thread: the one that called `fork`. A lock another thread held at that
//! moment stays locked in the child forever, and the child's first use of it hangs (torch's
//! `DataLoader` and `multiprocessing` fork by default, while native threads may be dropping
//! tensors or holding leases). So every lock of the crate that a thread may hold without the GIL
//! is a [`ForkSafeMutex`]: the forking thread takes it just before `fork` and lets it go just after,
//! in the parent and in the child (`pthread_atfork`), so the child starts with it free and its
//! data consistent.
//!
//! Each lock joins the list the handlers take at its first use. The handlers take the list's own
//! lock first, then every lock in the order they joined, so code must never hold two of these
//! locks at once (none does: each is held for a few instructions, never while calling code that
//! could take another), nor call `fork` while holding one.
//!
//! The handlers are installed when the library is loaded (a constructor in `.init_array`, or
//! `__mod_init_func` on Apple targets), before any code of this copy can take one of its locks.
//! Installing them at a lock's first use instead races with a fork already under way: glibc runs
//! only the handlers registered when `fork` began (it lets go of its handler list's lock while it
//! calls each earlier handler), so a native thread that registered them and then took the lock
//! meanwhile left the child a lock held forever. First use still installs them where no
//! constructor ran (a target without one).

use std::any::Any;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A mutex the fork handlers hold across `fork` (see the module docs). A poisoned lock is used as
/// is: nothing panics while holding one of these.
pub(crate) struct ForkSafeMutex<T> {
    mutex: Mutex<T>,
    /// Whether it is on the handlers' list (set under the list's lock).
    guarded: AtomicBool,
}

impl<T: Send + 'static> ForkSafeMutex<T> {
    /// A new, unlocked mutex.
    pub(crate) const fn new(value: T) -> Self {
        Self { mutex: Mutex::new(value), guarded: AtomicBool::new(false) }
    }

    /// Locks it (the first time, after putting it on the handlers' list).
    #[inline]
    pub(crate) fn lock(&'static self) -> MutexGuard<'static, T> {
        if !self.guarded.load(Ordering::Acquire) {
            self.guard();
        }
        self.mutex.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cold]
    fn guard(&'static self) {
        install_handlers();
        let mut list = guarded();
        // Checked again under the list's lock (which the handlers hold across a fork), so the
        // flag and the list agree in the child too.
        if !self.guarded.load(Ordering::Relaxed) {
            list.push(&self.mutex);
            self.guarded.store(true, Ordering::Release);
        }
    }
}

/// A lock the fork handlers hold across `fork`.
#[cfg_attr(miri, allow(dead_code))]
trait Hold: Sync {
    /// Locks it and returns the guard, boxed.
    fn hold(&'static self) -> Box<dyn Any>;
}

impl<T: Send + 'static> Hold for Mutex<T> {
    fn hold(&'static self) -> Box<dyn Any> {
        Box::new(self.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The locks the handlers take, in the order they joined.
static GUARDED: Mutex<Vec<&'static dyn Hold>> = Mutex::new(Vec::new());

fn guarded() -> MutexGuard<'static, Vec<&'static dyn Hold>> {
    GUARDED.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// The guards the forking thread holds between the handlers (all three run on the thread that
    /// calls `fork`), the list's own guard first.
    static HELD: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

#[cfg_attr(miri, allow(dead_code))]
extern "C" fn before_fork() {
    let list = guarded();
    let mut guards: Vec<Box<dyn Any>> = Vec::with_capacity(list.len() + 1);
    let locks: Vec<&'static dyn Hold> = list.clone();
    guards.push(Box::new(list));
    for lock in locks {
        guards.push(lock.hold());
    }
    HELD.with(|held| *held.borrow_mut() = guards);
}

#[cfg_attr(miri, allow(dead_code))]
extern "C" fn after_fork() {
    // In the parent and in the child alike: let go in the reverse order.
    let mut guards = HELD.with(|held| std::mem::take(&mut *held.borrow_mut()));
    while let Some(guard) = guards.pop() {
        drop(guard);
    }
}

/// Installs this copy's handlers when the library is loaded, before any of its code runs (see the
/// module docs): no lock of this copy can be held by then, so a fork under way that misses them
/// leaves nothing held in its child.
#[cfg(all(unix, not(miri)))]
#[used]
#[cfg_attr(target_vendor = "apple", unsafe(link_section = "__DATA,__mod_init_func"))]
#[cfg_attr(not(target_vendor = "apple"), unsafe(link_section = ".init_array"))]
static INSTALL_AT_LOAD: extern "C" fn() = install_at_load;

#[cfg(all(unix, not(miri)))]
extern "C" fn install_at_load() {
    install_handlers();
}

/// Installs this copy's fork handlers, once: at load (above), else at a lock's first use. Never
/// called with one of the locks held: glibc runs the handlers under its own lock, which
/// `pthread_atfork` takes too.
fn install_handlers() {
    if HANDLERS.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return;
    }
    #[cfg(all(unix, not(miri)))]
    {
        unsafe extern "C" {
            fn pthread_atfork(
                prepare: Option<extern "C" fn()>,
                parent: Option<extern "C" fn()>,
                child: Option<extern "C" fn()>,
            ) -> std::ffi::c_int;
        }
        // SAFETY: three plain functions that live for the process (a copy of the crate is never
        // unloaded). Only ENOMEM can fail it; forks then stay unguarded, as before.
        unsafe { pthread_atfork(Some(before_fork), Some(after_fork), Some(after_fork)) };
    }
    HANDLERS.store(2, Ordering::Release);
}

/// Whether this copy's handlers are installed: 0 not yet, 1 being installed (by another thread:
/// go on), 2 installed. Not a `Once`: a fork while another thread ran it would leave a `Once`
/// running forever in the child. Installed at load, the other two states are only seen where no
/// constructor ran.
static HANDLERS: AtomicU8 = AtomicU8::new(0);

#[cfg(all(test, unix, not(miri)))]
mod tests {
    use super::*;

    static LOCK: ForkSafeMutex<u32> = ForkSafeMutex::new(0);

    /// The handlers are in place before any lock is used: checked in a fresh process (this test
    /// binary again, running only this test), where nothing has taken a lock yet. Installed at a
    /// lock's first use instead, a fork already under way missed them (see the module docs).
    #[test]
    fn the_handlers_are_installed_at_load_before_any_lock_is_used() {
        const PROBE: &str = "DLBRIDGE_FORK_HANDLERS_PROBE";
        if std::env::var_os(PROBE).is_some() {
            // The fresh process: nothing of this crate has run but the constructor.
            assert_eq!(HANDLERS.load(Ordering::Acquire), 2, "no fork handlers before the first lock");
            assert!(guarded().is_empty(), "a lock was used before the check");
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "fork::tests::the_handlers_are_installed_at_load_before_any_lock_is_used"])
            .args(["--test-threads", "1", "--nocapture"])
            .env(PROBE, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        // The fresh process ran exactly this test (not zero tests, which would also succeed).
        assert!(text.contains("1 passed"), "{text}");
    }

    #[test]
    fn a_child_forked_while_another_thread_holds_the_lock_can_take_it() {
        *LOCK.lock() += 1;
        let (locked_tx, locked_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let mut g = LOCK.lock();
            *g += 1;
            locked_tx.send(()).unwrap();
            // Keep it until the parent has called fork (fork waits for it in the handler).
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(g);
            let _ = done_rx.recv();
        });
        locked_rx.recv().unwrap();
        // The child's verdict travels through a pipe, not its exit status (valgrind's leak check
        // of a forked child, whose parent's other threads' memory it cannot reach, sets that).
        let mut fds = [0i32; 2];
        // SAFETY: a two-int array for pipe(2).
        assert_eq!(unsafe { libc_pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only takes the lock, reads it, writes one byte and exits.
        let pid = unsafe { libc_fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let v = *LOCK.lock();
            let verdict = [if v == 2 { b'y' } else { b'n' }];
            // SAFETY: one byte to the pipe's write end; then the child leaves at once.
            unsafe {
                libc_write(fds[1], verdict.as_ptr(), 1);
                libc_exit(0)
            };
        }
        done_tx.send(()).unwrap();
        holder.join().unwrap();
        let mut status = 0;
        // A hung child would hang the test: wait at most ~10 s.
        let mut waited = 0;
        loop {
            // SAFETY: our own child; WNOHANG.
            let r = unsafe { libc_waitpid(pid, &mut status, 1) };
            if r == pid {
                break;
            }
            if waited == 1000 {
                // SAFETY: our own child, killed and reaped so no hung process outlives the test.
                unsafe {
                    libc_kill(pid, 9);
                    libc_waitpid(pid, &mut status, 0);
                }
                panic!("the forked child hung on the lock");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            waited += 1;
        }
        let mut verdict = [0u8];
        // SAFETY: our pipe's read end; the child wrote before exiting (or nothing: 0 bytes read).
        let n = unsafe { libc_read(fds[0], verdict.as_mut_ptr(), 1) };
        // SAFETY: our own descriptors, closed once.
        unsafe {
            libc_close(fds[0]);
            libc_close(fds[1]);
        }
        assert_eq!((n, verdict[0]), (1, b'y'), "the child saw the lock's data inconsistent");
    }

    unsafe extern "C" {
        #[link_name = "fork"]
        fn libc_fork() -> i32;
        #[link_name = "_exit"]
        fn libc_exit(code: i32) -> !;
        #[link_name = "kill"]
        fn libc_kill(pid: i32, sig: i32) -> i32;
        #[link_name = "waitpid"]
        fn libc_waitpid(pid: i32, status: *mut i32, options: i32) -> i32;
        #[link_name = "pipe"]
        fn libc_pipe(fds: *mut i32) -> i32;
        #[link_name = "write"]
        fn libc_write(fd: i32, buf: *const u8, n: usize) -> isize;
        #[link_name = "read"]
        fn libc_read(fd: i32, buf: *mut u8, n: usize) -> isize;
        #[link_name = "close"]
        fn libc_close(fd: i32) -> i32;
    }
}
