//! The process's one list of live shared-memory segments, shared by every copy of the crate.
//!
//! A segment must have one identity in a process: were one memfd mapped twice (two threads opening
//! one handle at once, or two copies of the crate each opening it), the borrow registry, keyed by
//! address, would let a `&mut [T]` on one mapping coexist with a `&[T]` on the other. So every copy
//! records its mappings in, and looks handles and addresses up in, the list of the first loaded
//! copy ([`crate::process_wide`]), through a small C table (`dlbridge_segments_v1`). Each entry
//! names its mapping and carries its owner's two functions: `retain` (a strong reference from a
//! weak one, NULL once the owner is dropping) and `release`. Lookups retain under the list's lock,
//! so an entry whose owner is being dropped is never revived; nothing is released under it.
//!
//! Opening a handle is: look it up; if absent, open and map it (no lock held), then insert it
//! unless an entry for the same segment appeared meanwhile ([`insert_or_find`]: the re-check and
//! the insertion under one lock), in which case the new mapping is dropped and the one entry used.

use std::ffi::{c_int, c_void};

use crate::fork::ForkSafeMutex;
use crate::process_wide::Shared;

/// One mapping of a segment, as every copy of the crate sees it (C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawEntry {
    /// The address of the first data byte.
    pub data: usize,
    /// Bytes of data.
    pub len: usize,
    /// The memfd's device number.
    pub dev: u64,
    /// The memfd's inode number.
    pub ino: u64,
    /// The segment's random token.
    pub token: [u8; 16],
    /// The descriptor that keeps it nameable (valid in this process while the owner lives).
    pub fd: c_int,
    /// Which copy of the crate owns the mapping ([`this_copy`] of that copy).
    pub copy: *const u8,
    /// The owner's weak reference, for `retain`.
    pub owner: *const c_void,
    /// A strong reference from `owner` (NULL when the owner is being dropped).
    pub retain: unsafe extern "C" fn(owner: *const c_void) -> *const c_void,
    /// Gives back a strong reference `retain` returned.
    pub release: unsafe extern "C" fn(strong: *const c_void),
}

// SAFETY: the pointers are opaque handles only the owner's functions dereference, and those work
// from any thread.
unsafe impl Send for RawEntry {}

/// The list's C ABI (a new layout gets a new version and symbol).
#[repr(C)]
pub(crate) struct SegmentsApi {
    /// [`SegmentsApi::VERSION`].
    pub version: u64,
    /// Finds the live entry of segment (dev, ino, token) and retains it: 1 and `*out` filled, or 0.
    pub find_id:
        unsafe extern "C" fn(dev: u64, ino: u64, token: *const [u8; 16], out: *mut Retained) -> c_int,
    /// Finds the live entry whose data holds `[addr, addr + len)` and retains it: 1 or 0.
    pub find_addr: unsafe extern "C" fn(addr: usize, len: usize, out: *mut Retained) -> c_int,
    /// Inserts `*entry` unless a live entry of the same segment exists: then retains that one,
    /// fills `*out` and returns 1 (nothing inserted); else returns 0.
    pub insert_or_find: unsafe extern "C" fn(entry: *const RawEntry, out: *mut Retained) -> c_int,
    /// Removes the entry whose data starts at `data` (its owner is being dropped).
    pub remove: unsafe extern "C" fn(data: usize),
}

impl SegmentsApi {
    const VERSION: u64 = 1;
}

/// A strong reference to some copy's mapping, given back on drop.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Retained {
    /// The entry it was found under.
    pub entry: RawEntry,
    /// What `entry.retain` returned.
    pub strong: *const c_void,
}

// SAFETY: a strong reference to a `Send + Sync` mapping owner, released by its own function, which
// works from any thread.
unsafe impl Send for Retained {}
// SAFETY: as above; shared access only reads the plain fields.
unsafe impl Sync for Retained {}

impl Drop for Retained {
    fn drop(&mut self) {
        // SAFETY: a strong reference `retain` returned, given back once.
        unsafe { (self.entry.release)(self.strong) }
    }
}

static LIST: ForkSafeMutex<Vec<RawEntry>> = ForkSafeMutex::new(Vec::new());

/// An address unique to this copy of the crate: an entry whose `copy` is this one is this copy's
/// own mapping (its `owner` is this copy's type).
pub(crate) fn this_copy() -> *const u8 {
    static MARK: u8 = 0;
    &MARK
}

/// Retains `e` if its owner lives.
fn retain(e: &RawEntry) -> Option<Retained> {
    // SAFETY: the owner's own function on its own weak reference (the entry is live: its owner
    // removes it under this lock before the weak reference is freed).
    let strong = unsafe { (e.retain)(e.owner) };
    // Made only when retained: a `Retained` gives its reference back when dropped.
    if strong.is_null() { None } else { Some(Retained { entry: *e, strong }) }
}

fn found(r: Option<Retained>, out: *mut Retained) -> c_int {
    match r {
        Some(r) => {
            // SAFETY: the caller's out slot, written once (it is uninitialised memory).
            unsafe { out.write(r) };
            1
        }
        None => 0,
    }
}

unsafe extern "C" fn local_find_id(dev: u64, ino: u64, token: *const [u8; 16], out: *mut Retained) -> c_int {
    // SAFETY: the caller's 16 bytes.
    let token = unsafe { *token };
    let list = LIST.lock();
    let r = list.iter().filter(|e| (e.dev, e.ino, e.token) == (dev, ino, token)).find_map(retain);
    drop(list);
    found(r, out)
}

unsafe extern "C" fn local_find_addr(addr: usize, len: usize, out: *mut Retained) -> c_int {
    let Some(end) = addr.checked_add(len) else { return 0 };
    let list = LIST.lock();
    let r = list.iter().filter(|e| addr >= e.data && end <= e.data + e.len).find_map(retain);
    drop(list);
    found(r, out)
}

unsafe extern "C" fn local_insert_or_find(entry: *const RawEntry, out: *mut Retained) -> c_int {
    // SAFETY: the caller's entry.
    let entry = unsafe { *entry };
    let mut list = LIST.lock();
    let same = |e: &&RawEntry| (e.dev, e.ino, e.token) == (entry.dev, entry.ino, entry.token);
    if let Some(r) = list.iter().filter(same).find_map(retain) {
        drop(list);
        return found(Some(r), out);
    }
    list.push(entry);
    0
}

unsafe extern "C" fn local_remove(data: usize) {
    LIST.lock().retain(|e| e.data != data);
}

/// This copy's list (the process's, when this copy was loaded first).
static LOCAL: SegmentsApi = SegmentsApi {
    version: SegmentsApi::VERSION,
    find_id: local_find_id,
    find_addr: local_find_addr,
    insert_or_find: local_insert_or_find,
    remove: local_remove,
};

/// This copy's list, exported for the other copies in the process ([`crate::process_wide`]).
#[cfg(all(feature = "python", target_os = "linux", not(miri)))]
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static dlbridge_segments_v1: SegmentsApi = SegmentsApi { ..LOCAL };

fn process() -> &'static SegmentsApi {
    static PROCESS: Shared<SegmentsApi> = Shared::new();
    // SAFETY: only copies of this crate export this name, each a static `SegmentsApi`; `usable`
    // reads the leading version field only.
    unsafe {
        PROCESS.get(c"dlbridge_segments_v1", &LOCAL, |t| {
            // SAFETY: `version` is the first field of every version's table.
            std::ptr::addr_of!((*t).version).read() == SegmentsApi::VERSION
        })
    }
}

fn call(f: impl FnOnce(*mut Retained) -> c_int) -> Option<Retained> {
    let mut out = std::mem::MaybeUninit::<Retained>::uninit();
    (f(out.as_mut_ptr()) == 1).then(|| {
        // SAFETY: the table filled it (it returned 1).
        unsafe { out.assume_init() }
    })
}

/// The live mapping of segment (dev, ino, token) in this process, retained.
pub(crate) fn find_id(dev: u64, ino: u64, token: [u8; 16]) -> Option<Retained> {
    // SAFETY: the process's table; a live token and out slot.
    call(|out| unsafe { (process().find_id)(dev, ino, &token, out) })
}

/// The live mapping whose data holds `[addr, addr + len)`, retained.
pub(crate) fn find_addr(addr: usize, len: usize) -> Option<Retained> {
    // SAFETY: the process's table; a live out slot.
    call(|out| unsafe { (process().find_addr)(addr, len, out) })
}

/// Records `entry` (a new mapping), unless the segment has a live mapping already: then that one,
/// retained (the caller drops its new mapping and uses it).
///
/// # Safety
///
/// `entry` describes a live mapping whose owner removes it ([`remove`]) before its weak reference
/// is freed or the memory unmapped; `retain`/`release` behave as documented.
pub(crate) unsafe fn insert_or_find(entry: &RawEntry) -> Option<Retained> {
    // SAFETY: the process's table; the caller's promise about the entry.
    call(|out| unsafe { (process().insert_or_find)(entry, out) })
}

/// Forgets the mapping whose data starts at `data` (its owner is being dropped).
pub(crate) fn remove(data: usize) {
    // SAFETY: the process's table.
    unsafe { (process().remove)(data) }
}

/// How many mappings of segment (dev, ino, token) the process's list holds (tests).
#[cfg(all(test, not(miri)))]
pub(crate) fn entries(dev: u64, ino: u64, token: [u8; 16]) -> usize {
    if !std::ptr::eq(process(), &LOCAL) {
        return usize::MAX;
    }
    LIST.lock().iter().filter(|e| (e.dev, e.ino, e.token) == (dev, ino, token)).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fake owner: a live flag and a count of strong references handed out.
    struct Owner {
        live: std::sync::atomic::AtomicBool,
        strong: AtomicUsize,
    }

    unsafe extern "C" fn fake_retain(owner: *const c_void) -> *const c_void {
        // SAFETY: the tests pass a pointer to a live `Owner`.
        let o = unsafe { &*owner.cast::<Owner>() };
        if !o.live.load(Ordering::SeqCst) {
            return std::ptr::null();
        }
        o.strong.fetch_add(1, Ordering::SeqCst);
        owner
    }

    unsafe extern "C" fn fake_release(strong: *const c_void) {
        // SAFETY: as above.
        unsafe { &*strong.cast::<Owner>() }.strong.fetch_sub(1, Ordering::SeqCst);
    }

    fn entry(data: usize, ino: u64, owner: &Owner) -> RawEntry {
        RawEntry {
            data,
            len: 64,
            dev: 1,
            ino,
            token: [7; 16],
            fd: -1,
            copy: std::ptr::null(),
            owner: std::ptr::from_ref(owner).cast(),
            retain: fake_retain,
            release: fake_release,
        }
    }

    #[test]
    fn the_first_registered_mapping_wins_and_lookups_retain_it() {
        let (a, b) =
            (Owner { live: true.into(), strong: 0.into() }, Owner { live: true.into(), strong: 0.into() });
        // Addresses and inodes no real segment has (tests share the list).
        let ino = u64::MAX - 1;
        // SAFETY: fake owners that outlive their entries (removed below).
        assert!(unsafe { insert_or_find(&entry(0x1000, ino, &a)) }.is_none());
        // A second mapping of the same segment finds the first, retained, and is not inserted.
        // SAFETY: as above.
        let won = unsafe { insert_or_find(&entry(0x9000, ino, &b)) }.expect("the first mapping");
        assert_eq!((won.entry.data, a.strong.load(Ordering::SeqCst)), (0x1000, 1));
        drop(won);
        assert_eq!(a.strong.load(Ordering::SeqCst), 0);
        assert!(find_addr(0x9000, 8).is_none(), "the loser was not registered");
        let by_addr = find_addr(0x1000 + 60, 4).expect("inside the data");
        assert!(find_addr(0x1000 + 60, 8).is_none(), "past the data");
        let by_id = find_id(1, ino, [7; 16]).expect("registered");
        assert_eq!(a.strong.load(Ordering::SeqCst), 2);
        drop((by_addr, by_id));
        // An owner being dropped is never revived: its entry is skipped, and another mapping of
        // the segment may register meanwhile.
        a.live.store(false, Ordering::SeqCst);
        assert!(find_id(1, ino, [7; 16]).is_none());
        // SAFETY: as above.
        assert!(unsafe { insert_or_find(&entry(0x9000, ino, &b)) }.is_none());
        remove(0x1000);
        assert_eq!(find_id(1, ino, [7; 16]).map(|r| r.entry.data), Some(0x9000));
        remove(0x9000);
        assert!(find_id(1, ino, [7; 16]).is_none());
        assert_eq!(b.strong.load(Ordering::SeqCst), 0);
    }
}
