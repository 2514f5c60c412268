//! Shared-memory segments that several processes map at once (feature `shm`, Linux only): the OS
//! half of `dlbridge.shared_empty` / `dlbridge.share` and of pickling a shared tensor.
//!
//! # Design
//!
//! A segment is an anonymous `memfd` (`memfd_create("dlbridge-shm")`), never a name in
//! `/dev/shm` or any file system: it exists while some process holds a descriptor or a mapping of
//! it, and the kernel frees it when the last one goes, however that process ends (normal exit,
//! an exception, `SIGKILL`). Its size is sealed (`F_SEAL_SHRINK | F_SEAL_GROW`), so no process
//! can truncate it under another's mapping (no `SIGBUS`), and it starts with a 256-byte header
//! (magic, random 128-bit token, data length); the data follows at byte 256, so it is 256-byte
//! aligned, as dlpack.h asks.
//!
//! A [`Handle`] names a segment for another process on the same machine: the pid of a process
//! that holds it, the descriptor number there, the inode, the token, the data length and a pin.
//! A receiver opens `/proc/<pid>/fd/<fd>` with `O_PATH` (Linux allows it under ptrace read access:
//! the same user and group ids, a dumpable sender, no capability the receiver lacks), checks
//! through that descriptor that it is a dlbridge memfd (its link name) and a regular file of the
//! handle's inode, then reopens *that* file read-write through `/proc/self/fd/<O_PATH fd>` (so a
//! sender swapping its descriptor meanwhile cannot make it open anything else: a FIFO, a device),
//! checks the size seals and the exact size, maps, and checks the header's magic, token and
//! length. Any mismatch is a [`ShmError`] naming the handle's field; a receiver out of
//! descriptors, or refused by the ptrace rule, is told so. The handle is a *reference*: it can be
//! opened while some process named by it holds the segment, and never reads someone else's memory.
//! The receiver then holds its own descriptor and mapping, so it keeps the memory alive however
//! long it needs, whether or not the sender lives on.
//!
//! **Pins.** A sender usually drops what it sent (a worker returning a result). Making a handle
//! for a pickle ([`Segment::pin`]) therefore pins the segment in the sending process (an `Arc` in a
//! process-wide list) and counts the pin in a header word this process owns (`tag << 32 | count`,
//! one of [`PIN_SLOTS`]); a receiver opening the handle decrements that count once, and the sender
//! drops its pin when the count reaches 0 (a sweeper thread, which runs only while pins exist, and
//! every pin and open). So the first receiver always gets the memory while the sender runs (and a
//! sender about to exit can wait for its recent pins: [`wait_for_recent_pins`]); a pickle never
//! loaded keeps its memory until the sender exits (as torch's descriptor sharer does); a pickle
//! loaded again after that gets it only while some holder still has it.
//!
//! Each process keeps one mapping per memfd (a registry of live segments shared by every copy of
//! the crate in the process, looked up by identity when a handle is opened and by address when a
//! tensor is asked whether its memory is shared); a new mapping is registered unless one appeared
//! meanwhile (checked under the registry's lock), so a segment has one mapping (one address,
//! which the borrow registry keys leases by) however many threads, and copies of the crate, open
//! it at once. Its owner closes the descriptor and unmaps when the last `Arc<Segment>` drops.
//!
//! [`Segment::create`] refuses a size the machine could never back ([`backing_limit`]: memory
//! plus swap, the process's memory cgroup, `RLIMIT_FSIZE`); pages are reserved only when touched.
//!
//! # What other processes may do
//!
//! Shared memory is written by other processes outside this process's borrow registry, as memory
//! another library in this process may be (see ARCHITECTURE.md, "What the memory rule cannot
//! cover"): a slice over a segment is only protected from this process's own dlbridge handles.
//!
//! # CUDA
//!
//! CUDA tensors do not use segments: they travel as CUDA IPC handles
//! ([`Driver::ipc_export`](crate::cuda::Driver::ipc_export) /
//! [`Driver::ipc_open`](crate::cuda::Driver::ipc_open), pickled by `python/processes/shared.rs`), opened
//! once per process, handle and device, and closed when the last tensor over the mapping drops. The
//! contract differs from segments on two points: CUDA IPC keeps nothing alive, so the sender must
//! keep its tensor until every receiver is done with it (for segments, a receiver's own mapping
//! keeps the memory); and device work is asynchronous, so pickling first waits for the work
//! queued on the device (`cuCtxSynchronize` in the primary context), and a receiver's writes
//! reach the sender once the receiver has synchronised and said so (the handle carries no event).

use std::ffi::{CString, c_void};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard, Weak};
use std::time::{Duration, Instant};

use crate::dtype::DataType;
use crate::error::Result as TensorResult;
use crate::flags::Flags;
use crate::fork::ForkSafeMutex;
use crate::managed::ManagedTensor;
use crate::shm_registry::{self, RawEntry, Retained};
use crate::{Device, layout};

/// Bytes before the data: the header, padded to dlpack.h's 256-byte alignment.
pub const HEADER_LEN: usize = 256;

/// The header's first eight bytes.
const MAGIC: [u8; 8] = *b"DLBRSHM1";

/// Where the header's pin slots start (after magic, token and length), and how many there are:
/// one 64-bit word each, `tag << 32 | count` (0: free), see [`Pin`].
const PIN_BASE: usize = 32;
/// The number of pin slots in a header.
pub const PIN_SLOTS: usize = (HEADER_LEN - PIN_BASE) / 8;

/// The memfd's name (Linux shows it as `/memfd:dlbridge-shm (deleted)` in `/proc/*/fd` and
/// `/proc/*/maps`).
pub const MEMFD_NAME: &str = "dlbridge-shm";

/// Segments at most this large are made without reading the machine's memory limits.
const UNCHECKED_SIZE: usize = 1 << 20;

/// What identifies one segment among all of the machine's: its inode and its random token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentId {
    /// The memfd's device number (`st_dev`).
    pub dev: u64,
    /// The memfd's inode number (`st_ino`).
    pub ino: u64,
    /// 128 random bits, also in the segment's header.
    pub token: [u8; 16],
}

/// A claim ticket: the sender keeps the segment mapped until a receiver has opened a handle that
/// carries it ([`Segment::pin`]). `slot` is one of the header's [`PIN_SLOTS`] words, `tag` the
/// sender's random tag in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pin {
    /// The header slot (below [`PIN_SLOTS`]).
    pub slot: u8,
    /// The tag the sender wrote there (never 0).
    pub tag: u32,
}

/// What another process needs to map a segment: where a holder keeps it and what it must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    /// A process holding the segment (the one that made the handle).
    pub pid: u32,
    /// Its descriptor of the segment.
    pub fd: i32,
    /// The segment's identity.
    pub id: SegmentId,
    /// Bytes of data after the header.
    pub data_len: u64,
    /// The sender's pin, which opening the handle claims (releases) once; `None`: the handle is
    /// valid only while some process named by it holds the segment.
    pub pin: Option<Pin>,
}

/// Why a segment could not be made or opened: the handle's field (or the operation) and why.
#[derive(Debug)]
pub struct ShmError {
    /// The handle field (`pid`, `fd`, `inode`, `token`, `size`) or operation (`memfd_create`,
    /// `mmap`) that failed; `memory` when the size is more than the machine (memory plus swap,
    /// a cgroup's limit, `RLIMIT_FSIZE`) could ever back.
    pub field: &'static str,
    /// What was wrong, with the value.
    pub message: String,
}

impl std::fmt::Display for ShmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shared segment {}: {}", self.field, self.message)
    }
}

impl std::error::Error for ShmError {}

fn err(field: &'static str, message: impl Into<String>) -> ShmError {
    ShmError { field, message: message.into() }
}

/// A shared mapping, unmapped when dropped.
struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once; whoever owns the Mapping has no pointer into it
        // any more (a Segment drops it after its last Arc).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// One mapping of a segment in this process, with the descriptor that keeps it nameable.
pub struct Segment {
    /// The mapping's first byte (the header's).
    base: NonNull<u8>,
    /// The descriptor that names it in this process (`/proc/<pid>/fd/<fd>`).
    fd: libc::c_int,
    data_len: usize,
    id: SegmentId,
    backing: Backing,
}

/// What keeps a [`Segment`]'s mapping.
enum Backing {
    /// This copy of the crate's own mapping and descriptor (field order: Drop removes the registry
    /// entry first, then the mapping is unmapped, then the descriptor closes).
    Own { _map: Mapping, _file: File },
    /// Another copy's mapping of the same segment in this process (each Python extension module
    /// embeds its own copy of the crate), held by a strong reference: a segment has one mapping
    /// per process, whichever copy opens it.
    Other(#[allow(dead_code, reason = "held for its Drop")] Retained),
}

// SAFETY: the mapping is plain shared memory, valid from any thread until `Drop` unmaps it; the
// struct hands out only raw pointers (access goes through tensors, which carry their own rules)
// and touches the header's pin words only atomically.
unsafe impl Send for Segment {}
// SAFETY: as above; no interior state is mutated through `&Segment` except atomically.
unsafe impl Sync for Segment {}

// ---- the registry of live segments --------------------------------------------------------------
//
// One entry per segment this process maps, so that a segment has one mapping (one address) in the
// process: the borrow registry keys leases by address, and two mappings of one segment would let a
// `&mut` on one coexist with a `&` on the other. The list is the process's, shared by every copy of
// the crate (`shm_registry.rs`): a copy that opens a handle another copy has mapped uses that
// mapping. Opening a handle looks it up, opens and maps it if absent, and registers the new mapping
// unless one appeared meanwhile (the re-check and the insertion under the list's one lock), in
// which case the new mapping is dropped before anyone saw it and the registered one is used.

/// This copy's `retain` of a registry entry: a strong reference from the weak one it registered.
unsafe extern "C" fn retain_own(owner: *const c_void) -> *const c_void {
    // SAFETY: `owner` is the `Weak::into_raw` this copy registered, not yet freed (the segment
    // frees it in `Drop`, after removing the entry, and lookups run under the list's lock).
    let weak = std::mem::ManuallyDrop::new(unsafe { Weak::from_raw(owner.cast::<Segment>()) });
    weak.upgrade().map_or(std::ptr::null(), |a| Arc::into_raw(a).cast())
}

/// This copy's `release`: gives back a strong reference [`retain_own`] made.
unsafe extern "C" fn release_own(strong: *const c_void) {
    // SAFETY: an `Arc::into_raw` of `retain_own`, given back once (never under the list's lock).
    drop(unsafe { Arc::from_raw(strong.cast::<Segment>()) });
}

/// A registry entry made into this copy's `Arc<Segment>`: its own segment, or a wrapper that
/// keeps another copy's.
fn from_registry(r: Retained) -> Arc<Segment> {
    if r.entry.copy == shm_registry::this_copy() {
        let strong = r.strong.cast::<Segment>();
        std::mem::forget(r);
        // SAFETY: this copy's entry: `strong` is an `Arc::into_raw` of `retain_own`, whose
        // ownership moves here (the `Retained` is forgotten, not released).
        return unsafe { Arc::from_raw(strong) };
    }
    let e = r.entry;
    Arc::new(Segment {
        // SAFETY (of the address): the other copy's mapping starts HEADER_LEN bytes before its
        // data, and stays mapped while the retained reference lives.
        base: NonNull::new((e.data - HEADER_LEN) as *mut u8).expect("a mapping's address"),
        fd: e.fd,
        data_len: e.len,
        id: SegmentId { dev: e.dev, ino: e.ino, token: e.token },
        backing: Backing::Other(r),
    })
}

/// The live mapping of segment `id` in this process, whichever copy made it.
fn registry_find_id(id: &SegmentId) -> Option<Arc<Segment>> {
    shm_registry::find_id(id.dev, id.ino, id.token).map(from_registry)
}

/// Registers this copy's new mapping; if the segment has one already (another thread or copy won
/// the race), drops the new one and returns that.
fn registry_insert_own(map: Mapping, file: File, data_len: usize, id: SegmentId) -> Arc<Segment> {
    let seg = Arc::new(Segment {
        base: map.base,
        fd: file.as_raw_fd(),
        data_len,
        id,
        backing: Backing::Own { _map: map, _file: file },
    });
    let entry = RawEntry {
        data: seg.data() as usize,
        len: data_len,
        dev: id.dev,
        ino: id.ino,
        token: id.token,
        fd: seg.fd,
        copy: shm_registry::this_copy(),
        // Freed by the segment's Drop (see there).
        owner: Weak::into_raw(Arc::downgrade(&seg)).cast(),
        retain: retain_own,
        release: release_own,
    };
    // SAFETY: the entry describes this live mapping; `Drop` removes it before freeing the weak
    // reference and unmapping; `retain_own`/`release_own` behave as documented.
    match unsafe { shm_registry::insert_or_find(&entry) } {
        None => seg,
        Some(existing) => {
            drop(seg);
            from_registry(existing)
        }
    }
}

// ---- pins: the sender keeps a pickled segment until a receiver has it ---------------------------
//
// Pickling a shared tensor pins its segment in the pickling process (an `Arc` in `PINS`) and
// counts the pin in a word of the segment's header that this process owns (`tag << 32 | count`);
// a receiver that opens the handle decrements the count (compare-and-swap on its tag), and the
// sender drops its pin once the count is 0 (a sweeper thread, which exits when no pin is left and
// looks once a second when none was made for `SWEEPER_IDLE`, and every pin/open call). Other processes only ever decrement a count that matches the tag the
// handle carries, so a stray handle cannot release another process's pins.

/// One pinned segment: the `Arc` that keeps it, its header slot and our tag there.
struct Pinned {
    seg: Arc<Segment>,
    slot: usize,
    tag: u32,
    /// When it was last pinned (see [`wait_for_recent_pins`]).
    since: Instant,
}

/// This process's pins, the pid they belong to (a forked child inherits its parent's copy, which
/// it must neither read nor release), and whether a sweeper thread runs.
struct Pins {
    pid: u32,
    list: Vec<Pinned>,
    sweeper: bool,
}

/// A forked child finds it unlocked ([`crate::fork`]): the forking thread holds it across the fork.
static PINS: ForkSafeMutex<Pins> = ForkSafeMutex::new(Pins { pid: 0, list: Vec::new(), sweeper: false });

/// This process's pins, locked. In a forked child the parent's list is forgotten (its `Arc`s leak,
/// so the child keeps those mappings until it exits, as fork gave them to it anyway); the parent's
/// pins stay the parent's.
fn pins() -> MutexGuard<'static, Pins> {
    let mut g = PINS.lock();
    let me = std::process::id();
    if g.pid != me {
        // The parent's Arcs are forgotten (leaked), not dropped: the child keeps those mappings
        // until it exits, as fork gave them to it anyway, and never releases the parent's pins.
        let parents = std::mem::replace(&mut *g, Pins { pid: me, list: Vec::new(), sweeper: false });
        std::mem::forget(parents);
    }
    g
}

/// Releases every pin whose count receivers have brought to 0 (or whose slot another process
/// overwrote); returns the released `Arc`s, to be dropped once the lock is released.
fn take_claimed(p: &mut Pins) -> Vec<Arc<Segment>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < p.list.len() {
        let e = &p.list[i];
        let word = e.seg.pin_word(e.slot);
        let done = loop {
            let v = word.load(Ordering::Acquire);
            if (v >> 32) as u32 != e.tag {
                break true;
            }
            if v as u32 != 0 {
                break false;
            }
            if word.compare_exchange(v, 0, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                break true;
            }
        };
        if done {
            out.push(p.list.swap_remove(i).seg);
        } else {
            i += 1;
        }
    }
    out
}

/// Releases the pins receivers have claimed (the `Arc`s drop after the lock is released).
pub fn sweep_pins() {
    let released = take_claimed(&mut pins());
    drop(released);
}

/// Waits, at most `max`, until every pin made (or renewed) less than `recent` ago has been claimed:
/// what a process does before it exits, so that a worker that sends a shared tensor and exits at
/// once (a `Pool` with `maxtasksperchild`, a process that puts its result on a queue and returns)
/// does not take the memory with it before its receiver has opened it. Older pins (a pickle
/// nobody loaded) do not delay the exit.
pub fn wait_for_recent_pins(recent: Duration, max: Duration) {
    let start = Instant::now();
    loop {
        let (released, pending) = {
            let mut p = pins();
            let released = take_claimed(&mut p);
            let pending = p.list.iter().any(|e| e.since.elapsed() < recent);
            (released, pending)
        };
        drop(released);
        if !pending || start.elapsed() >= max {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Once no pin was made for this long, the sweeper thread looks once every [`SWEEPER_SLOW`]
/// instead of every 1 to 100 ms: a pickle claimed late (a consumer busy for minutes) is still
/// released within a second, and an idle process with a pickle nobody loaded costs one wake-up a
/// second. (Ending the thread instead, so that such a process is not multi-threaded at a later
/// `fork()`, left a late claim's memory with the sender until its next pin: review.)
const SWEEPER_IDLE: Duration = if cfg!(test) { Duration::from_millis(300) } else { Duration::from_secs(10) };
/// The sweeper's interval once idle (see [`SWEEPER_IDLE`]).
const SWEEPER_SLOW: Duration = if cfg!(test) { Duration::from_millis(100) } else { Duration::from_secs(1) };

/// Starts the sweeper thread of this process if none runs (called with the pins locked).
fn ensure_sweeper(p: &mut Pins) {
    if p.sweeper {
        return;
    }
    let spawned = std::thread::Builder::new().name("dlbridge-shm-pins".into()).spawn(|| {
        let mut wait = Duration::from_millis(1);
        loop {
            std::thread::sleep(wait);
            let (released, empty, idle) = {
                let mut p = pins();
                let released = take_claimed(&mut p);
                let empty = p.list.is_empty();
                if empty {
                    p.sweeper = false;
                }
                (released, empty, p.list.iter().all(|e| e.since.elapsed() >= SWEEPER_IDLE))
            };
            wait = if !released.is_empty() {
                Duration::from_millis(1)
            } else if idle {
                SWEEPER_SLOW
            } else {
                (wait * 2).min(Duration::from_millis(100))
            };
            drop(released);
            if empty {
                return;
            }
        }
    });
    // Without a thread (out of resources), pins are still released by the next pin or open.
    p.sweeper = spawned.is_ok();
}

fn random_token() -> Result<[u8; 16], ShmError> {
    let mut t = [0u8; 16];
    let mut got = 0;
    while got < t.len() {
        // SAFETY: writes at most `len - got` bytes into the array's tail.
        let n = unsafe { libc::getrandom(t[got..].as_mut_ptr().cast(), t.len() - got, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err("token", format!("getrandom failed: {e}")));
        }
        got += n as usize;
    }
    Ok(t)
}

fn map_len_for(data_len: u64, field: &'static str) -> Result<usize, ShmError> {
    usize::try_from(data_len)
        .ok()
        .and_then(|d| d.checked_add(HEADER_LEN))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| err(field, format!("{data_len} bytes is more than this process can map")))
}

/// `n` bytes in binary units (`1.5 GiB`).
fn human(n: u64) -> String {
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} bytes") } else { format!("{v:.1} {}", units[u]) }
}

/// A cgroup limit file's value: `None` for "max" (v2) or a file that cannot be read.
fn read_limit(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The most shared memory this process could ever have backed, and what sets it: the machine's
/// memory plus swap (`/proc/meminfo`), this process's memory cgroup (v2 `memory.max` plus swap, v1
/// `memory.limit_in_bytes` plus swap and `memory.memsw.limit_in_bytes`, at its own level and every
/// level above), and `RLIMIT_FSIZE` (a memfd is a file). `None` if nothing can be read.
pub fn backing_limit() -> Option<(u64, String)> {
    let mut best: Option<(u64, String)> = None;
    let mut consider = |n: u64, what: String| {
        if best.as_ref().is_none_or(|b| n < b.0) {
            best = Some((n, what));
        }
    };
    let kib = |info: &str, key: &str| -> Option<u64> {
        let line = info.lines().find(|l| l.starts_with(key))?;
        line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()
            .map(|k| k.saturating_mul(1024))
    };
    let mut swap = 0;
    if let Ok(info) = std::fs::read_to_string("/proc/meminfo") {
        swap = kib(&info, "SwapTotal:").unwrap_or(0);
        if let Some(mem) = kib(&info, "MemTotal:") {
            consider(mem.saturating_add(swap), "the machine's memory plus swap (/proc/meminfo)".into());
        }
    }
    if let Ok(cg) = std::fs::read_to_string("/proc/self/cgroup") {
        for line in cg.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(id), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
                continue;
            };
            let v2 = id == "0" && ctrls.is_empty();
            if !v2 && !ctrls.split(',').any(|c| c == "memory") {
                continue;
            }
            let root = std::path::PathBuf::from(if v2 { "/sys/fs/cgroup" } else { "/sys/fs/cgroup/memory" });
            let mut dir = root.join(path.trim_start_matches('/'));
            loop {
                let mut limits = Vec::new();
                if v2 {
                    if let Some(m) = read_limit(&dir.join("memory.max")) {
                        let s = read_limit(&dir.join("memory.swap.max")).map_or(swap, |s| s.min(swap));
                        limits.push((m.saturating_add(s), dir.join("memory.max"), " plus swap"));
                    }
                } else {
                    // Memory plus swap is at most memsw's limit and at most memory's limit plus swap.
                    if let Some(m) = read_limit(&dir.join("memory.limit_in_bytes")) {
                        limits.push((
                            m.saturating_add(swap),
                            dir.join("memory.limit_in_bytes"),
                            " plus swap",
                        ));
                    }
                    if let Some(ms) = read_limit(&dir.join("memory.memsw.limit_in_bytes")) {
                        limits.push((ms, dir.join("memory.memsw.limit_in_bytes"), ""));
                    }
                }
                for (n, file, plus) in limits {
                    consider(n, format!("this process's memory cgroup ({}{plus})", file.display()));
                }
                if dir == root || !dir.pop() || !dir.starts_with(&root) {
                    break;
                }
            }
        }
    }
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut r) } == 0 && r.rlim_cur != libc::RLIM_INFINITY {
        consider(r.rlim_cur, "RLIMIT_FSIZE (ulimit -f; a segment is a memfd file)".into());
    }
    best
}

/// Refuses a segment of `map_len` bytes that the machine could never back (see [`backing_limit`]).
fn check_backing(map_len: usize) -> Result<(), ShmError> {
    if map_len <= UNCHECKED_SIZE {
        return Ok(());
    }
    match backing_limit() {
        Some((limit, what)) if map_len as u64 > limit => Err(err(
            "memory",
            format!(
                "cannot allocate {map_len} bytes ({}) of shared memory: more than {what} can ever back \
                 ({limit} bytes, {})",
                human(map_len as u64),
                human(limit)
            ),
        )),
        _ => Ok(()),
    }
}

/// Maps `len` bytes of `file` shared, readable and writable.
fn map(file: &File, len: usize) -> Result<Mapping, ShmError> {
    // SAFETY: a new shared mapping of an open descriptor chosen by the kernel; nothing is
    // overwritten (no MAP_FIXED).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(err("mmap", format!("{len} bytes: {}", io::Error::last_os_error())));
    }
    NonNull::new(p.cast::<u8>())
        .map(|base| Mapping { base, len })
        .ok_or_else(|| err("mmap", "the kernel mapped address 0"))
}

/// Whether an error means this process (EMFILE) or the system (ENFILE) is out of descriptors.
fn out_of_descriptors(field: &'static str, what: &str, e: &io::Error) -> Option<ShmError> {
    let who = match e.raw_os_error() {
        Some(libc::EMFILE) => "this process is",
        Some(libc::ENFILE) => "the system is",
        _ => return None,
    };
    Some(err(
        field,
        format!(
            "{what}: {who} out of file descriptors ({e}): each shared segment a process maps takes \
             one; close some, or raise the limit (resource.setrlimit(resource.RLIMIT_NOFILE, ...), \
             ulimit -n)"
        ),
    ))
}

/// `open(2)` of a path with flags (close-on-exec added), as an owned descriptor.
fn open_fd(path: &str, flags: libc::c_int) -> io::Result<OwnedFd> {
    let c = CString::new(path).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a NUL-terminated path and valid flags; returns a new descriptor or -1.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned to us, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Why `/proc/<pid>/fd/<fd>` could not be reached, as the receiver can act on it.
fn unreachable(h: &Handle, path: &str, e: io::Error) -> ShmError {
    if let Some(x) = out_of_descriptors("fd", &format!("cannot open {path}"), &e) {
        return x;
    }
    let pid = h.pid;
    match e.raw_os_error() {
        Some(libc::EACCES | libc::EPERM) => err(
            "fd",
            format!(
                "{path}: permission denied ({e}): Linux lets a process open another's \
                 /proc/<pid>/fd only with ptrace read access to it: the same user and group (real, \
                 effective and saved ids alike), a dumpable sender (not made non-dumpable by \
                 prctl(PR_SET_DUMPABLE, 0), a set-user-ID or set-group-ID program or a change of \
                 credentials), and no capability the receiver lacks (or CAP_SYS_PTRACE in the \
                 receiver). Make the sender dumpable (prctl(PR_SET_DUMPABLE, 1)) or send the data \
                 by value (dlbridge.from_dlpack(t, copy=True) pickles its bytes)"
            ),
        ),
        _ => {
            let exited = !std::path::Path::new(&format!("/proc/{pid}/fd")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .map(|s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
                    .unwrap_or(true);
            let what = if exited {
                format!(
                    "process {pid}, which pickled the tensor, has exited (or is on another machine or \
                     in another pid namespace)"
                )
            } else {
                format!(
                    "process {pid}, which pickled the tensor, no longer holds the segment (an earlier \
                     unpickling claimed the pickle's pin, or it had none, and it dropped the tensor)"
                )
            };
            err(
                "fd",
                format!(
                    "{path} cannot be opened ({e}): stale handle: {what}. A sender keeps a pickled \
                     shared tensor's memory until the first receiver has unpickled it, while the \
                     sender runs: keep the sending process (or a tensor over the memory there) alive \
                     until the receiver has it, or send the data by value \
                     (dlbridge.from_dlpack(t, copy=True) pickles its bytes)"
                ),
            )
        }
    }
}

/// Opens, checks and maps the segment a handle names, through one open file: the handle's
/// `/proc/<pid>/fd/<fd>` is opened `O_PATH` (which opens nothing for I/O: no FIFO or device
/// open), checked through that descriptor (its link name, type, device and inode), then reopened
/// read-write through `/proc/self/fd/<O_PATH descriptor>`, which is the same file whatever the
/// sender does to its descriptor meanwhile, and checked again (seals, size, header).
fn open_and_map(h: &Handle, map_len: usize) -> Result<(File, Mapping), ShmError> {
    let path = format!("/proc/{}/fd/{}", h.pid, h.fd);
    let opath = open_fd(&path, libc::O_PATH).map_err(|e| unreachable(h, &path, e))?;
    let me = format!("/proc/self/fd/{}", opath.as_raw_fd());
    let link = std::fs::read_link(&me).map_err(|e| err("fd", format!("{path}: {e}")))?;
    let link = link.to_string_lossy();
    if !link.starts_with(&format!("/memfd:{MEMFD_NAME}")) {
        return Err(err("fd", format!("{path} is {link:?}, not a dlbridge segment")));
    }
    let same_inode = |meta: &std::fs::Metadata| -> Result<(), ShmError> {
        let ft = meta.file_type();
        if !meta.is_file() || ft.is_fifo() || ft.is_socket() {
            return Err(err("fd", format!("{path} is not a regular memfd")));
        }
        if (meta.dev(), meta.ino()) != (h.id.dev, h.id.ino) {
            return Err(err(
                "inode",
                format!(
                    "{path} is inode {}:{}, the handle names {}:{} (stale handle: the descriptor was reused)",
                    meta.dev(),
                    meta.ino(),
                    h.id.dev,
                    h.id.ino
                ),
            ));
        }
        Ok(())
    };
    let opath = File::from(opath);
    same_inode(&opath.metadata().map_err(|e| err("fd", format!("{path}: {e}")))?)?;
    let file = File::from(open_fd(&me, libc::O_RDWR | libc::O_NONBLOCK | libc::O_NOCTTY).map_err(|e| {
        out_of_descriptors("fd", &format!("cannot reopen {path}"), &e)
            .unwrap_or_else(|| err("fd", format!("cannot reopen {path} read-write: {e}")))
    })?);
    drop(opath);
    let meta = file.metadata().map_err(|e| err("fd", format!("{path}: {e}")))?;
    same_inode(&meta)?;
    // SAFETY: fcntl on a descriptor we own; no argument.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    if seals < 0 || seals & need != need {
        return Err(err("fd", format!("{path} is not sealed against resizing (seals {seals})")));
    }
    if meta.len() != map_len as u64 {
        return Err(err(
            "size",
            format!(
                "{} bytes of data, but the segment has {}",
                h.data_len,
                meta.len().saturating_sub(HEADER_LEN as u64)
            ),
        ));
    }
    // An error from here unmaps (Mapping's Drop) before returning.
    let mapping = map(&file, map_len)?;
    let mut header = [0u8; 32];
    // SAFETY: the mapping has at least HEADER_LEN >= 32 readable bytes (size checked above,
    // sealed against shrinking).
    unsafe { std::ptr::copy_nonoverlapping(mapping.base.as_ptr(), header.as_mut_ptr(), 32) };
    if header[..8] != MAGIC {
        return Err(err("fd", format!("{path} has no dlbridge header")));
    }
    if header[8..24] != h.id.token {
        return Err(err("token", "the segment's token differs from the handle's (not the segment named)"));
    }
    let len = u64::from_le_bytes(header[24..32].try_into().expect("8 bytes"));
    if len != h.data_len {
        return Err(err("size", format!("{} bytes, but the segment's header says {len}", h.data_len)));
    }
    Ok((file, mapping))
}

impl Segment {
    /// A new zero-filled segment of `data_len` bytes of data, mapped in this process.
    ///
    /// Errors: field `memory` when the size is more than the machine could ever back (see
    /// [`backing_limit`]); `fd` when out of descriptors.
    pub fn create(data_len: usize) -> Result<Arc<Segment>, ShmError> {
        let map_len = map_len_for(data_len as u64, "size")?;
        check_backing(map_len)?;
        let token = random_token()?;
        let name = c"dlbridge-shm";
        // SAFETY: a NUL-terminated name and valid flags; returns a new descriptor or -1.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(out_of_descriptors("fd", "memfd_create", &e)
                .unwrap_or_else(|| err("memfd_create", e.to_string())));
        }
        // SAFETY: a descriptor just returned to us, owned by nothing else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(map_len as u64).map_err(|e| {
            if e.raw_os_error() == Some(libc::EFBIG) {
                err("memory", format!("cannot allocate {map_len} bytes of shared memory: {e} (RLIMIT_FSIZE)"))
            } else {
                err("size", format!("cannot size a segment to {map_len} bytes: {e}"))
            }
        })?;
        // SAFETY: fcntl on our own descriptor with an integer argument.
        if unsafe {
            libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL)
        } != 0
        {
            return Err(err("seals", io::Error::last_os_error().to_string()));
        }
        let meta = file.metadata().map_err(|e| err("inode", e.to_string()))?;
        let map = map(&file, map_len)?;
        // SAFETY: the mapping is `map_len >= HEADER_LEN` bytes, writable, and no other process
        // knows the segment yet.
        unsafe {
            let h = map.base.as_ptr();
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), h, 8);
            std::ptr::copy_nonoverlapping(token.as_ptr(), h.add(8), 16);
            std::ptr::copy_nonoverlapping((data_len as u64).to_le_bytes().as_ptr(), h.add(24), 8);
        }
        let id = SegmentId { dev: meta.dev(), ino: meta.ino(), token };
        Ok(registry_insert_own(map, file, data_len, id))
    }

    /// Maps the segment a handle names (the same `Arc` if this process maps it already), after
    /// checking that it is one of dlbridge's and that it is the one the handle describes, then
    /// claims the handle's pin (see [`Segment::pin`]).
    ///
    /// However many threads, and copies of the crate, open the same handle at once, the process
    /// keeps one mapping of the segment (one address: the borrow registry's leases, keyed by
    /// address, then cover every view of it): a mapping made while another was registered is
    /// dropped before it is used.
    pub fn open(h: &Handle) -> Result<Arc<Segment>, ShmError> {
        let seg = Self::open_once(h)?;
        if let Some(pin) = h.pin {
            seg.claim(pin);
            // The sender may be this process: release its pin now rather than at the next sweep.
            sweep_pins();
        }
        Ok(seg)
    }

    fn open_once(h: &Handle) -> Result<Arc<Segment>, ShmError> {
        let map_len = map_len_for(h.data_len, "size")?;
        let seg = match registry_find_id(&h.id) {
            Some(seg) => seg,
            None => {
                let (file, map) = open_and_map(h, map_len)?;
                registry_insert_own(map, file, map_len - HEADER_LEN, h.id)
            }
        };
        if seg.data_len as u64 == h.data_len {
            Ok(seg)
        } else {
            Err(err("size", format!("{} bytes, but the segment holds {}", h.data_len, seg.data_len)))
        }
    }

    /// The header's pin word `slot`.
    fn pin_word(&self, slot: usize) -> &AtomicU64 {
        assert!(slot < PIN_SLOTS);
        // SAFETY: bytes PIN_BASE + 8 * slot .. + 8 lie in the header (slot < PIN_SLOTS), which is
        // mapped while `self` lives; the mapping is page-aligned, so the word is 8-aligned;
        // AtomicU64 has u64's layout, and this process touches these words only atomically
        // (other processes' writes reach it as the hardware's, like any shared memory).
        unsafe { &*self.base.as_ptr().add(PIN_BASE + 8 * slot).cast::<AtomicU64>() }
    }

    /// Pins this segment for one receiver: this process keeps it mapped until a process opens a
    /// handle carrying the returned [`Pin`] (or this process exits); what a pickled shared tensor
    /// carries, so that a sender may drop the tensor right after sending it. `None` when every
    /// header slot is taken by other processes' pins (the handle is then valid only while a
    /// holder lives).
    pub fn pin(self: &Arc<Self>) -> Option<Pin> {
        let mut p = pins();
        let released = take_claimed(&mut p);
        let found = p.list.iter_mut().find(|e| Arc::ptr_eq(&e.seg, self)).map(|e| {
            e.since = Instant::now();
            (e.slot, e.tag)
        });
        let mut out = None;
        if let Some((slot, tag)) = found {
            let word = self.pin_word(slot);
            let mut v = word.load(Ordering::Acquire);
            // Receivers only decrement, and only this process (under the lock) increments or frees.
            while (v >> 32) as u32 == tag && (v as u32) < u32::MAX {
                match word.compare_exchange(v, v + 1, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        out = Some(Pin { slot: slot as u8, tag });
                        break;
                    }
                    Err(now) => v = now,
                }
            }
        }
        if out.is_none() {
            let tag = loop {
                let t = random_token().map(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]])).unwrap_or(1);
                if t != 0 {
                    break t;
                }
            };
            // A free slot, else one whose count receivers brought to 0 but whose process never
            // freed it (it exited or was killed between the claim and its sweep): every count it
            // gave out was claimed, so nothing waits on it, and its owner, if alive, finds its tag
            // gone and drops its pin (as after any claim). A slot with counts left is never taken.
            let new = (u64::from(tag) << 32) | 1;
            let taken = (0..PIN_SLOTS)
                .find(|&slot| {
                    self.pin_word(slot).compare_exchange(0, new, Ordering::AcqRel, Ordering::Acquire).is_ok()
                })
                .or_else(|| {
                    (0..PIN_SLOTS).find(|&slot| {
                        let word = self.pin_word(slot);
                        let v = word.load(Ordering::Acquire);
                        v as u32 == 0
                            && v != 0
                            && word.compare_exchange(v, new, Ordering::AcqRel, Ordering::Acquire).is_ok()
                    })
                });
            if let Some(slot) = taken {
                p.list.push(Pinned { seg: Arc::clone(self), slot, tag, since: Instant::now() });
                ensure_sweeper(&mut p);
                out = Some(Pin { slot: slot as u8, tag });
            }
        }
        drop(p);
        drop(released);
        out
    }

    /// Claims one count of a pin a handle carries (nothing if the slot no longer holds its tag or
    /// its count is 0: a handle opened more often than it was pickled).
    fn claim(&self, pin: Pin) {
        let slot = usize::from(pin.slot);
        if slot >= PIN_SLOTS {
            return;
        }
        let word = self.pin_word(slot);
        let mut v = word.load(Ordering::Acquire);
        while (v >> 32) as u32 == pin.tag && v as u32 != 0 {
            match word.compare_exchange(v, v - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(now) => v = now,
            }
        }
    }

    /// The segment that holds the `len` bytes from `addr` in this process, with the offset of
    /// `addr` from its data.
    pub fn containing(addr: usize, len: usize) -> Option<(Arc<Segment>, usize)> {
        let found = shm_registry::find_addr(addr, len)?;
        let start = found.entry.data;
        Some((from_registry(found), addr - start))
    }

    /// The handle by which another process on this machine maps this segment (valid while this
    /// process holds it).
    pub fn handle(&self) -> Handle {
        Handle {
            pid: std::process::id(),
            fd: self.fd,
            id: self.id,
            data_len: self.data_len as u64,
            pin: None,
        }
    }

    /// The first data byte (256-byte aligned).
    pub fn data(&self) -> *mut u8 {
        // SAFETY: the mapping is at least HEADER_LEN bytes.
        unsafe { self.base.as_ptr().add(HEADER_LEN) }
    }

    /// Bytes of data.
    pub fn data_len(&self) -> usize {
        self.data_len
    }

    /// The segment's identity.
    pub fn id(&self) -> SegmentId {
        self.id
    }

    /// A CPU tensor over this segment's data: its data pointer `data_offset` bytes into the data,
    /// the producer's `byte_offset` beyond, `strides` in elements (`None`: C order). Every element
    /// the layout reaches must lie in the data; the tensor keeps the segment mapped.
    pub fn tensor(
        self: &Arc<Self>,
        dtype: DataType,
        shape: &[i64],
        strides: Option<&[i64]>,
        data_offset: u64,
        byte_offset: u64,
        flags: Flags,
    ) -> TensorResult<ManagedTensor> {
        use crate::error::Error;
        dtype.validate()?;
        let c;
        let strides = match strides {
            Some(s) => s,
            None => {
                c = layout::c_strides(shape);
                &c
            }
        };
        let refuse = |found: String| Error::BufferMismatch {
            expected: format!(
                "shape {} strides {} of {dtype} from byte {data_offset} + {byte_offset} inside the segment",
                crate::error::tuple(shape),
                crate::error::tuple(strides)
            ),
            found,
        };
        if shape.len() != strides.len() {
            return Err(refuse(format!("{} strides for {} extents", strides.len(), shape.len())));
        }
        let first =
            data_offset.checked_add(byte_offset).ok_or_else(|| refuse("an offset overflow".into()))?;
        if !fits_in(dtype, shape, strides, flags, first, self.data_len as u64)? {
            return Err(refuse(format!("{} bytes of data", self.data_len)));
        }
        let data = self.data().wrapping_add(data_offset as usize).cast::<c_void>();
        // SAFETY: every element the layout reaches lies inside the mapping (checked above), which
        // the owner (a clone of the Arc) keeps mapped until the tensor's deleter drops it. Other
        // processes may write it: see the module docs.
        unsafe {
            ManagedTensor::from_raw_parts(
                data,
                Device::CPU,
                dtype,
                shape,
                Some(strides),
                byte_offset,
                flags,
                Arc::clone(self),
            )
        }
    }
}

/// Whether every element of a layout whose first element is `first` bytes into a buffer of `len`
/// bytes lies inside it (an empty tensor: `first <= len`). Errors: shape or span overflow.
pub fn fits_in(
    dtype: DataType,
    shape: &[i64],
    strides: &[i64],
    flags: Flags,
    first: u64,
    len: u64,
) -> TensorResult<bool> {
    if shape.len() != strides.len() {
        return Ok(false);
    }
    if layout::element_count(shape)? == 0 {
        return Ok(first <= len);
    }
    let bits = dtype.storage_bits(flags.is_subbyte_padded());
    let (lo, hi) = layout::byte_span(shape, strides, bits)?;
    let lo = first as i128 + lo as i128;
    let hi = first as i128 + hi as i128;
    Ok(lo >= 0 && hi <= len as i128)
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Backing::Own { .. } = self.backing {
            // Out of the registry before the address range can be reused (the mapping is unmapped,
            // and the descriptor closed, when the fields drop after this); a mapping that lost the
            // race to register has no entry, and removing it is a no-op.
            shm_registry::remove(self.data() as usize);
            // SAFETY: the `Weak::into_raw` made at registration (`Arc::as_ptr` of this segment,
            // which `self` is), freed once; no lookup can reach it any more (the entry is gone, and
            // lookups retain under the list's lock). The Arc's own weak reference keeps the
            // allocation until this Drop returns.
            drop(unsafe { Weak::from_raw(std::ptr::from_ref::<Segment>(self)) });
        }
        // An `Other` segment gives its strong reference back (Retained's Drop).
    }
}

#[cfg(all(test, not(miri)))]
mod tests {
    use super::*;

    #[test]
    fn create_write_open_same_segment() {
        let s = Segment::create(1000).unwrap();
        assert_eq!(s.data() as usize % 256, 0);
        // SAFETY: 1000 bytes of data, zero-filled.
        unsafe {
            assert_eq!(*s.data().add(999), 0);
            *s.data().add(5) = 7;
        }
        // In the same process the registry gives the same mapping back.
        let again = Segment::open(&s.handle()).unwrap();
        assert!(Arc::ptr_eq(&s, &again));
        let (found, off) = Segment::containing(s.data() as usize + 5, 10).unwrap();
        assert!(Arc::ptr_eq(&s, &found));
        assert_eq!(off, 5);
        assert!(Segment::containing(s.data() as usize + 995, 10).is_none());
    }

    #[test]
    fn open_maps_a_second_time_through_proc() {
        let s = Segment::create(64).unwrap();
        let h = s.handle();
        // A second, independent mapping (as another process would make) of the same memory.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", h.fd))
            .unwrap();
        let m = map(&file, HEADER_LEN + 64).unwrap();
        // SAFETY: both mappings are HEADER_LEN + 64 bytes of the same memfd.
        unsafe {
            *m.base.as_ptr().add(HEADER_LEN + 3) = 9;
            assert_eq!(*s.data().add(3), 9);
        }
    }

    #[test]
    fn handles_that_do_not_fit_are_refused() {
        let s = Segment::create(64).unwrap();
        let h = s.handle();
        let field = |h: Handle| Segment::open(&h).err().map(|e| e.field);
        // A descriptor that is not a dlbridge segment.
        let other = File::open("/proc/self/stat").unwrap();
        assert_eq!(
            field(Handle { fd: other.as_raw_fd(), id: SegmentId { ino: 1, ..h.id }, ..h }),
            Some("fd")
        );
        // A descriptor that is not open (stale).
        assert_eq!(field(Handle { fd: 100_000, id: SegmentId { ino: 1, ..h.id }, ..h }), Some("fd"));
        // Another segment's descriptor under this one's identity... (inode differs)
        let t = Segment::create(64).unwrap();
        assert_eq!(
            field(Handle { fd: t.handle().fd, id: SegmentId { ino: h.id.ino, ..t.handle().id }, ..h }),
            Some("inode")
        );
        // ...the right inode with the wrong token, and the wrong size.
        let th = t.handle();
        assert_eq!(field(Handle { id: SegmentId { token: [0; 16], ..th.id }, ..th }), Some("token"));
        assert_eq!(
            field(Handle { data_len: 65, id: SegmentId { token: [1; 16], ..th.id }, ..th }),
            Some("size")
        );
        // A process that does not exist.
        assert_eq!(
            field(Handle { pid: u32::MAX, id: SegmentId { token: [2; 16], ..h.id }, ..h }),
            Some("fd")
        );
    }

    #[test]
    fn tensors_stay_inside_the_segment() {
        let s = Segment::create(64).unwrap();
        let t = s.tensor(DataType::FLOAT32, &[4, 4], None, 0, 0, Flags::NONE).unwrap();
        assert_eq!(t.data_ptr() as usize, s.data() as usize);
        assert!(s.tensor(DataType::FLOAT32, &[4, 4], None, 4, 0, Flags::NONE).is_err());
        assert!(s.tensor(DataType::FLOAT32, &[4, 4], None, 0, 4, Flags::NONE).is_err());
        assert!(s.tensor(DataType::FLOAT32, &[17], None, 0, 0, Flags::NONE).is_err());
        assert!(s.tensor(DataType::FLOAT32, &[4], Some(&[-1]), 0, 0, Flags::NONE).is_err());
        let r = s.tensor(DataType::FLOAT32, &[4], Some(&[-1]), 12, 0, Flags::READ_ONLY).unwrap();
        assert!(r.is_read_only());
        assert!(s.tensor(DataType::FLOAT32, &[0, 4], None, 64, 0, Flags::NONE).is_ok());
        // The tensor keeps the segment mapped after the creator's Arc drops.
        let weak = Arc::downgrade(&s);
        drop((s, r));
        assert!(weak.upgrade().is_some());
        drop(t);
        assert!(weak.upgrade().is_none());
    }

    /// Many threads opening one handle at once (the segment not mapped in this process yet) get
    /// one mapping: one Arc, one address. Before, each could map it, and the borrow registry
    /// (keyed by address) then let a `&mut` on one mapping coexist with a `&` on another.
    #[test]
    fn concurrent_opens_map_a_segment_once() {
        use std::sync::Barrier;
        const THREADS: usize = 8;
        for _ in 0..200 {
            let s = Segment::create(64).unwrap();
            // A second descriptor of the memfd names it while the creator's mapping is gone.
            // SAFETY: dup of our own open descriptor.
            let keep = unsafe { OwnedFd::from_raw_fd(libc::dup(s.fd)) };
            let h = Handle { fd: keep.as_raw_fd(), ..s.handle() };
            drop(s);
            assert!(registry_find_id(&h.id).is_none());
            let barrier = Barrier::new(THREADS);
            let got: Vec<Arc<Segment>> = std::thread::scope(|sc| {
                let hs: Vec<_> = (0..THREADS)
                    .map(|_| {
                        sc.spawn(|| {
                            barrier.wait();
                            Segment::open(&h).unwrap()
                        })
                    })
                    .collect();
                hs.into_iter().map(|j| j.join().unwrap()).collect()
            });
            for g in &got {
                assert!(Arc::ptr_eq(g, &got[0]), "one segment mapped twice in one process");
            }
            assert_eq!(shm_registry::entries(h.id.dev, h.id.ino, h.id.token), 1);
        }
    }

    /// A pin keeps the segment after the sender drops it, until a receiver opens the handle that
    /// carries it; a second pickle of the same segment counts in the same slot.
    #[test]
    fn a_pin_keeps_the_segment_until_claimed() {
        let s = Segment::create(64).unwrap();
        let w = Arc::downgrade(&s);
        let p1 = s.pin().unwrap();
        let p2 = s.pin().unwrap();
        assert_eq!(p1, p2);
        let h = Handle { pin: Some(p1), ..s.handle() };
        drop(s);
        sweep_pins();
        assert!(w.upgrade().is_some(), "pinned: still mapped");
        let a = Segment::open(&h).unwrap();
        drop(a);
        sweep_pins();
        assert!(w.upgrade().is_some(), "one pin left");
        // A handle whose tag is not the slot's claims nothing.
        let wrong = Handle { pin: Some(Pin { tag: p1.tag ^ 1, ..p1 }), ..h };
        drop(Segment::open(&wrong).unwrap());
        sweep_pins();
        assert!(w.upgrade().is_some());
        drop(Segment::open(&h).unwrap());
        sweep_pins();
        assert!(w.upgrade().is_none(), "both pins claimed: freed");
    }

    /// A pin claimed long after it was made (past the sweeper's idle time) is still released by
    /// the sweeper, within its slow interval, with no other pin or open in between (review: when
    /// the thread ended after the idle time instead, such memory stayed with the sender).
    #[test]
    fn a_late_claim_is_swept_without_another_pin() {
        let s = Segment::create(64).unwrap();
        let w = Arc::downgrade(&s);
        let p = s.pin().unwrap();
        drop(s);
        std::thread::sleep(SWEEPER_IDLE + SWEEPER_SLOW);
        assert!(w.upgrade().is_some(), "unclaimed: kept");
        // Claim it without `Segment::open` (whose own sweep would hide the sweeper's): as a
        // receiver in another process does, through the header word.
        let seg = w.upgrade().unwrap();
        seg.claim(p);
        drop(seg);
        let deadline = Instant::now() + Duration::from_secs(20);
        while w.upgrade().is_some() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(w.upgrade().is_none(), "claimed late: released by the sweeper");
    }

    /// Slots other processes left claimed but never freed (they exited between a receiver's claim
    /// and their sweep) are taken again once every slot is used; slots with counts left are not.
    /// Before, 28 such slots made every later pickle of the segment unpinned (review).
    #[test]
    fn claimed_slots_of_gone_processes_are_reused() {
        let s = Segment::create(64).unwrap();
        // Every slot: another process's pin, claimed (count 0) but never freed.
        for slot in 0..PIN_SLOTS {
            s.pin_word(slot).store((0xdead_0000_u64 + slot as u64) << 32, Ordering::Release);
        }
        let p = s.pin().expect("a claimed slot is reused");
        assert_eq!(s.pin_word(usize::from(p.slot)).load(Ordering::Acquire), (u64::from(p.tag) << 32) | 1);
        let h = Handle { pin: Some(p), ..s.handle() };
        drop(Segment::open(&h).unwrap());
        sweep_pins();
        // Every slot: an unclaimed pin of another process (a pickle not loaded yet): none is taken.
        for slot in 0..PIN_SLOTS {
            s.pin_word(slot).store(((0xbeef_0000_u64 + slot as u64) << 32) | 1, Ordering::Release);
        }
        assert_eq!(s.pin(), None, "a slot with counts left is never taken");
        for slot in 0..PIN_SLOTS {
            assert_eq!(s.pin_word(slot).load(Ordering::Acquire) as u32, 1);
        }
    }

    /// The descriptor a handle names is swapped between a dlbridge memfd and a FIFO, as fast as
    /// a thread can, while another opens the handle: the FIFO is never opened (inotify counts
    /// the opens of its inode; an O_PATH descriptor is not an open). Before, the link was read,
    /// then the path opened again: the FIFO got opened in the window.
    #[test]
    fn a_swapped_descriptor_is_never_opened() {
        use std::sync::atomic::AtomicBool;
        let s = Segment::create(64).unwrap();
        let dir = std::env::temp_dir().join(format!("dlbridge-fifo-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let cpath = CString::new(dir.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(cpath.as_ptr(), 0o600) }, 0);
        let fifo = open_fd(dir.to_str().unwrap(), libc::O_RDWR | libc::O_NONBLOCK).unwrap();
        // SAFETY: inotify on a path we made; the descriptor is ours.
        let ino = unsafe { OwnedFd::from_raw_fd(libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC)) };
        // SAFETY: as above.
        assert!(unsafe { libc::inotify_add_watch(ino.as_raw_fd(), cpath.as_ptr(), libc::IN_OPEN) } >= 0);
        // The number that alternates (`slot`), and the memfd kept open by a second descriptor.
        // SAFETY: dups of our own descriptor.
        let (mem, slot) =
            unsafe { (OwnedFd::from_raw_fd(libc::dup(s.fd)), OwnedFd::from_raw_fd(libc::dup(s.fd))) };
        let h = Handle { fd: slot.as_raw_fd(), ..s.handle() };
        drop(s); // not in the registry: every open goes through /proc
        let stop = AtomicBool::new(false);
        let (mut ok, mut refused) = (0, 0);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let mut flip = false;
                while !stop.load(Ordering::Relaxed) {
                    flip = !flip;
                    let from = if flip { fifo.as_raw_fd() } else { mem.as_raw_fd() };
                    // SAFETY: dup2 onto a descriptor number this test owns (`slot`).
                    unsafe { libc::dup2(from, slot.as_raw_fd()) };
                }
            });
            // At least 50,000 tries, and until both states were seen often (a busy machine may
            // schedule the swapping thread late), at most 500,000.
            for i in 0..500_000 {
                if i >= 50_000 && ok >= 1000 && refused >= 1000 {
                    break;
                }
                match Segment::open(&h) {
                    Ok(_) => ok += 1,
                    Err(_) => refused += 1,
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
        let mut buf = [0u8; 4096];
        let mut opens = 0;
        loop {
            // SAFETY: reads into our buffer from our descriptor.
            let n = unsafe { libc::read(ino.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
            let mut off = 0;
            while off < n as usize {
                // SAFETY: the kernel wrote whole inotify_event records into the first n bytes.
                let ev =
                    unsafe { std::ptr::read_unaligned(buf.as_ptr().add(off).cast::<libc::inotify_event>()) };
                if ev.mask & libc::IN_OPEN != 0 {
                    opens += 1;
                }
                off += std::mem::size_of::<libc::inotify_event>() + ev.len as usize;
            }
        }
        let _ = std::fs::remove_file(&dir);
        assert!(ok >= 1000 && refused >= 1000, "the race ran: {ok} opened, {refused} refused");
        assert_eq!(opens, 0, "the FIFO was opened {opens} times");
    }

    /// A child forked while another thread of its parent holds the pin list's lock finds it free
    /// (the fork waits for it: `crate::fork`) instead of waiting forever for a thread it lacks.
    #[test]
    fn the_pin_list_survives_a_fork_while_locked() {
        let s = Segment::create(64).unwrap();
        let (locked, unlock) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
        let holder = std::thread::spawn(move || {
            let g = pins();
            locked.0.send(()).unwrap();
            // Held while the parent calls fork (which waits for it in the fork handler).
            std::thread::sleep(Duration::from_millis(200));
            drop(g);
            unlock.1.recv().unwrap();
        });
        locked.1.recv().unwrap();
        // The child's verdict travels through a pipe, not its exit status (valgrind's leak check
        // of a forked child, whose parent's other threads' memory it cannot reach, sets that).
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: a two-int array for pipe(2).
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only pins (the lock, a Vec, a header word, a thread), writes one byte
        // and _exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let verdict = [if s.pin().is_some() { b'y' } else { b'n' }];
            // SAFETY: one byte to the pipe's write end; then the child leaves at once, running
            // nothing of the parent's.
            unsafe {
                libc::write(fds[1], verdict.as_ptr().cast(), 1);
                libc::_exit(0)
            };
        }
        unlock.0.send(()).unwrap();
        holder.join().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut status = 0;
        loop {
            // SAFETY: waits for our own child without blocking.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                break;
            }
            if std::time::Instant::now() > deadline {
                // SAFETY: our own child.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                panic!("the child hung on the pin list's lock");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut verdict = [0u8];
        // SAFETY: our pipe's read end; the child wrote before exiting (or nothing: 0 bytes read).
        let n = unsafe { libc::read(fds[0], verdict.as_mut_ptr().cast(), 1) };
        // SAFETY: our own descriptors, closed once.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        assert_eq!((n, verdict[0]), (1, b'y'), "the child could not pin (status {status})");
    }
}
