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
//! that holds it, the descriptor number there, the inode, the token and the data length. A
//! receiver opens `/proc/<pid>/fd/<fd>` (the same user may, as for any of its processes), and
//! checks, before mapping anything, that the descriptor is a dlbridge memfd (its link name), a
//! regular file of the handle's inode with the size seals, of exactly the handle's size; after
//! mapping, that the header has the magic, the token and the length. Any mismatch is a
//! [`ShmError`] naming the handle's field. The handle is a *reference*: it can be opened while
//! the process that made it still holds the segment (any tensor over it); once it has let go,
//! opening is an error (stale handle), never a read of someone else's memory. The receiver then
//! holds its own descriptor and mapping, so it keeps the memory alive however long it needs,
//! whether or not the sender lives on.
//!
//! Each process keeps one [`Segment`] per memfd it maps (a registry of live segments, looked up
//! by identity when a handle is opened and by address when a tensor is asked whether its memory
//! is shared); it closes its descriptor and unmaps when the last `Arc<Segment>` drops.
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
//! [`Driver::ipc_open`](crate::cuda::Driver::ipc_open), pickled by `python/shared.rs`), opened
//! once per process, handle and device, and closed when the last tensor over the mapping drops. The
//! contract differs from segments on two points: CUDA IPC keeps nothing alive, so the sender must
//! keep its tensor until every receiver is done with it (for segments, a receiver's own mapping
//! keeps the memory); and device work is asynchronous, so pickling first waits for the work
//! queued on the device (`cuCtxSynchronize` in the primary context), and a receiver's writes
//! reach the sender once the receiver has synchronised and said so (the handle carries no event).

use std::ffi::c_void;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use crate::dtype::DataType;
use crate::error::Result as TensorResult;
use crate::flags::Flags;
use crate::managed::ManagedTensor;
use crate::{Device, layout};

/// Bytes before the data: the header, padded to dlpack.h's 256-byte alignment.
pub const HEADER_LEN: usize = 256;

/// The header's first eight bytes.
const MAGIC: [u8; 8] = *b"DLBRSHM1";

/// The memfd's name (Linux shows it as `/memfd:dlbridge-shm (deleted)` in `/proc/*/fd` and
/// `/proc/*/maps`).
pub const MEMFD_NAME: &str = "dlbridge-shm";

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
}

/// Why a segment could not be made or opened: the handle's field (or the operation) and why.
#[derive(Debug)]
pub struct ShmError {
    /// The handle field (`pid`, `fd`, `inode`, `token`, `size`) or operation (`memfd_create`,
    /// `mmap`) that failed.
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

/// One mapping of a segment in this process, with the descriptor that keeps it nameable.
pub struct Segment {
    file: File,
    base: NonNull<u8>,
    map_len: usize,
    data_len: usize,
    id: SegmentId,
}

// SAFETY: the mapping is plain shared memory, valid from any thread until `Drop` unmaps it; the
// struct hands out only raw pointers (access goes through tensors, which carry their own rules).
unsafe impl Send for Segment {}
// SAFETY: as above; no interior state is mutated through `&Segment`.
unsafe impl Sync for Segment {}

/// The segments this process maps: (start of data, data length, the segment).
static LIVE: Mutex<Vec<Live>> = Mutex::new(Vec::new());

/// A registry entry: where the data starts, its length, the segment's identity, the segment.
/// (Nothing is upgraded and dropped under the lock: the last `Arc` dropping there would deadlock
/// on it in `Drop`.)
type Live = (usize, usize, SegmentId, Weak<Segment>);

fn live() -> std::sync::MutexGuard<'static, Vec<Live>> {
    // A panic while holding the lock leaves the list consistent (every change is one push/remove).
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
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

/// Maps `len` bytes of `file` shared, readable and writable.
fn map(file: &File, len: usize) -> Result<NonNull<u8>, ShmError> {
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
    NonNull::new(p.cast::<u8>()).ok_or_else(|| err("mmap", "the kernel mapped address 0"))
}

impl Segment {
    /// A new zero-filled segment of `data_len` bytes of data, mapped in this process.
    pub fn create(data_len: usize) -> Result<Arc<Segment>, ShmError> {
        let map_len = map_len_for(data_len as u64, "size")?;
        let token = random_token()?;
        let name = c"dlbridge-shm";
        // SAFETY: a NUL-terminated name and valid flags; returns a new descriptor or -1.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(err("memfd_create", io::Error::last_os_error().to_string()));
        }
        // SAFETY: a descriptor just returned to us, owned by nothing else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(map_len as u64)
            .map_err(|e| err("size", format!("cannot size a segment to {map_len} bytes: {e}")))?;
        // SAFETY: fcntl on our own descriptor with an integer argument.
        if unsafe {
            libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL)
        } != 0
        {
            return Err(err("seals", io::Error::last_os_error().to_string()));
        }
        let meta = file.metadata().map_err(|e| err("inode", e.to_string()))?;
        let base = map(&file, map_len)?;
        // SAFETY: the mapping is `map_len >= HEADER_LEN` bytes, writable, and no other process
        // knows the segment yet.
        unsafe {
            let h = base.as_ptr();
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), h, 8);
            std::ptr::copy_nonoverlapping(token.as_ptr(), h.add(8), 16);
            std::ptr::copy_nonoverlapping((data_len as u64).to_le_bytes().as_ptr(), h.add(24), 8);
        }
        let id = SegmentId { dev: meta.dev(), ino: meta.ino(), token };
        Ok(Self::register(Segment { file, base, map_len, data_len, id }))
    }

    fn register(seg: Segment) -> Arc<Segment> {
        let seg = Arc::new(seg);
        live().push((seg.data() as usize, seg.data_len, seg.id, Arc::downgrade(&seg)));
        seg
    }

    /// Maps the segment a handle names (the same `Arc` if this process maps it already), after
    /// checking that it is one of dlbridge's and that it is the one the handle describes.
    pub fn open(h: &Handle) -> Result<Arc<Segment>, ShmError> {
        let mapped = live().iter().find(|e| e.2 == h.id).map(|e| e.3.clone());
        if let Some(seg) = mapped.and_then(|w| w.upgrade()) {
            return if seg.data_len as u64 == h.data_len {
                Ok(seg)
            } else {
                Err(err("size", format!("{} bytes, but the segment holds {}", h.data_len, seg.data_len)))
            };
        }
        let map_len = map_len_for(h.data_len, "size")?;
        let path = format!("/proc/{}/fd/{}", h.pid, h.fd);
        let stale = |e: io::Error| {
            err(
                "fd",
                format!(
                    "{path} cannot be read ({e}): the segment is gone (stale handle: the process that \
                     pickled the tensor no longer holds it; keep a reference there until the receiver \
                     has unpickled it) or the process belongs to another user"
                ),
            )
        };
        // Before opening anything: the link must name a dlbridge memfd (opening a FIFO, a device or
        // a socket of the named process could block or have effects).
        let link = std::fs::read_link(&path).map_err(stale)?;
        let link = link.to_string_lossy();
        if !link.starts_with(&format!("/memfd:{MEMFD_NAME}")) {
            return Err(err("fd", format!("{path} is {link:?}, not a dlbridge segment")));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(&path)
            .map_err(stale)?;
        let meta = file.metadata().map_err(|e| err("fd", format!("{path}: {e}")))?;
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
        let base = map(&file, map_len)?;
        // The segment is ours from here: an error unmaps it (Drop) before returning.
        let seg = Segment { file, base, map_len, data_len: map_len - HEADER_LEN, id: h.id };
        let mut header = [0u8; 32];
        // SAFETY: the mapping has at least HEADER_LEN >= 32 readable bytes (size checked above,
        // sealed against shrinking).
        unsafe { std::ptr::copy_nonoverlapping(base.as_ptr(), header.as_mut_ptr(), 32) };
        if header[..8] != MAGIC {
            return Err(err("fd", format!("{path} has no dlbridge header")));
        }
        if header[8..24] != h.id.token {
            return Err(err(
                "token",
                "the segment's token differs from the handle's (not the segment named)",
            ));
        }
        let len = u64::from_le_bytes(header[24..32].try_into().expect("8 bytes"));
        if len != h.data_len {
            return Err(err("size", format!("{} bytes, but the segment's header says {len}", h.data_len)));
        }
        Ok(Self::register(seg))
    }

    /// The segment that holds the `len` bytes from `addr` in this process, with the offset of
    /// `addr` from its data.
    pub fn containing(addr: usize, len: usize) -> Option<(Arc<Segment>, usize)> {
        let end = addr.checked_add(len)?;
        let (start, weak) =
            live().iter().find(|(s, l, _, _)| addr >= *s && end <= s + l).map(|e| (e.0, e.3.clone()))?;
        Some((weak.upgrade()?, addr - start))
    }

    /// The handle by which another process on this machine maps this segment (valid while this
    /// process holds it).
    pub fn handle(&self) -> Handle {
        Handle {
            pid: std::process::id(),
            fd: self.file.as_raw_fd(),
            id: self.id,
            data_len: self.data_len as u64,
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
        let me = self.data() as usize;
        // Out of the registry before the address range can be reused.
        live().retain(|(s, _, _, w)| *s != me && w.strong_count() > 0);
        // SAFETY: our own mapping, unmapped once; nothing points into it (every tensor over it
        // held an Arc, and this is the last). The descriptor closes when `file` drops.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.map_len) };
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
        let base = map(&file, HEADER_LEN + 64).unwrap();
        // SAFETY: both mappings are HEADER_LEN + 64 bytes of the same memfd.
        unsafe {
            *base.as_ptr().add(HEADER_LEN + 3) = 9;
            assert_eq!(*s.data().add(3), 9);
            libc::munmap(base.as_ptr().cast(), HEADER_LEN + 64);
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
}
