//! Rust-owned storage out as DLPack tensors, without copying.
//!
//! Everything exported here is a versioned (1.3) managed tensor that always carries strides when
//! `ndim > 0`, goes through the same validation as a foreign tensor, and frees its owner exactly
//! once from its deleter, on whatever thread the consumer calls it, without unwinding.
//!
//! ```
//! use dlbridge::{AlignedBuffer, ManagedTensor};
//! let mut buf = AlignedBuffer::<f64>::zeroed(6);
//! buf[5] = 2.5;
//! let t = ManagedTensor::from_host(buf, &[2, 3]).unwrap();
//! assert_eq!(t.data_ptr() as usize % 256, 0);
//! assert_eq!(t.as_slice::<f64>().unwrap()[5], 2.5);
//! ```

use std::alloc::{self, Layout};
use std::ffi::c_void;
use std::ops::{Deref, DerefMut};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::Device;
use crate::dims::Dims;
use crate::dtype::{DataType, Element};
use crate::error::{Error, Result, tuple};
use crate::ffi::{DLManagedTensor, DLManagedTensorVersioned, DLTensor};
use crate::flags::{Flags, Version};
use crate::layout;
use crate::managed::ManagedTensor;

/// Alignment of the buffers dlbridge allocates itself, as `dlpack.h` asks (jax imports host data
/// without copying only when it is at least 64-byte aligned).
pub const ALIGNMENT: usize = 256;

/// Host memory owned by Rust that can back an exported tensor.
///
/// # Safety
///
/// `as_mut_ptr` returns a pointer, valid for reads (and writes unless `is_read_only`) of
/// `elem_count` elements, that stays valid until the buffer is dropped or moved (dlbridge calls it
/// once the buffer is in its final place, and never moves it again while exported); nothing else
/// accesses that memory while the buffer is exported.
pub unsafe trait HostBuffer: Send + 'static {
    /// The element type.
    type Elem: Element;
    /// The first element.
    fn as_mut_ptr(&mut self) -> *mut Self::Elem;
    /// The number of elements.
    fn elem_count(&self) -> usize;
    /// Whether consumers must not write (shared storage such as `Arc<[T]>`).
    fn is_read_only(&self) -> bool {
        false
    }
}

// SAFETY: a Vec's heap buffer does not move when the Vec does and lives until it drops.
unsafe impl<T: Element> HostBuffer for Vec<T> {
    type Elem = T;
    fn as_mut_ptr(&mut self) -> *mut T {
        Vec::as_mut_ptr(self)
    }
    fn elem_count(&self) -> usize {
        self.len()
    }
}

// SAFETY: the box's heap buffer lives until it drops; the pointer is taken after the box is in
// its final place (a move retags a `Box`, so a pointer taken before one would be invalidated).
unsafe impl<T: Element> HostBuffer for Box<[T]> {
    type Elem = T;
    fn as_mut_ptr(&mut self) -> *mut T {
        <[T]>::as_mut_ptr(self)
    }
    fn elem_count(&self) -> usize {
        self.len()
    }
}

// SAFETY: the Arc's allocation is stable; the tensor is exported read-only because other Arc
// holders may read it, so the pointer is never written through.
unsafe impl<T: Element> HostBuffer for Arc<[T]> {
    type Elem = T;
    fn as_mut_ptr(&mut self) -> *mut T {
        <[T]>::as_ptr(self).cast_mut()
    }
    fn elem_count(&self) -> usize {
        self.len()
    }
    fn is_read_only(&self) -> bool {
        true
    }
}

/// A heap buffer aligned to [`ALIGNMENT`] (256) bytes: what dlbridge allocates for copies and new
/// tensors, so every consumer (jax included) can take it without copying.
///
/// The memory is a plain allocation `ALIGNMENT` bytes larger than the elements, which start at its
/// first 256-byte boundary. An aligned allocation
/// (`posix_memalign`) would split off and free the unused head of a larger block every time, and
/// glibc then sorts its small free lists before the next allocation of a page or more: that
/// bookkeeping was the largest single cost of a new 4 KB tensor.
pub struct AlignedBuffer<T> {
    ptr: NonNull<T>,
    len: usize,
    /// Bytes from the start of the allocation to `ptr` (below `ALIGNMENT`).
    head: usize,
}

// SAFETY: AlignedBuffer owns its memory like a Vec does.
unsafe impl<T: Send> Send for AlignedBuffer<T> {}
// SAFETY: as for Vec: shared access only hands out `&[T]`.
unsafe impl<T: Sync> Sync for AlignedBuffer<T> {}

/// Allocations of at least this many bytes are zeroed by the allocator (`calloc`), smaller ones by
/// `AlignedBuffer` itself (see `try_alloc`).
const ZEROED_BY_ALLOCATOR: usize = 128 * 1024;

impl<T> AlignedBuffer<T> {
    /// The allocation behind `bytes` bytes of elements: `ALIGNMENT` bytes more, at `T`'s alignment
    /// (a plain `malloc`); `None` if the size overflows `isize`.
    fn allocation(bytes: usize) -> Option<Layout> {
        let size = bytes.checked_add(ALIGNMENT)?;
        Layout::from_size_align(size, align_of::<T>()).ok()
    }
}

impl<T: Element> AlignedBuffer<T> {
    /// `len` zeroed elements (all-zero bytes are a valid value of every [`Element`]). Panics if the
    /// size overflows, and aborts if the allocation fails, like `Vec`.
    pub fn zeroed(len: usize) -> Self {
        let bytes = len.checked_mul(size_of::<T>()).expect("AlignedBuffer: size overflows usize");
        let layout = Self::allocation(bytes).expect("AlignedBuffer: size overflows isize");
        Self::try_alloc(len, bytes, layout).unwrap_or_else(|| alloc::handle_alloc_error(layout))
    }

    /// [`AlignedBuffer::zeroed`] that reports a size that overflows or an allocation that fails
    /// ([`Error::BufferMismatch`] naming the size) instead of panicking or aborting: for sizes that
    /// come from outside (a caller's shape).
    #[inline]
    pub fn try_zeroed(len: usize) -> Result<Self> {
        let refuse = |what: &str| Error::BufferMismatch {
            expected: format!("{len} elements of {} bytes {what}", size_of::<T>()),
            found: "more than can be allocated".into(),
        };
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| refuse("(the size overflows)"))?;
        let layout = Self::allocation(bytes).ok_or_else(|| refuse("(the size overflows isize)"))?;
        Self::try_alloc(len, bytes, layout).ok_or_else(|| refuse("(the allocation failed)"))
    }

    /// `len` zeroed elements (`bytes` bytes) in a new `layout` allocation; `None` if it fails.
    #[inline]
    fn try_alloc(len: usize, bytes: usize, layout: Layout) -> Option<Self> {
        if bytes == 0 {
            // A non-NULL address that owns no memory, aligned to 256 bytes and to `T` (an
            // `Element` may be aligned to more).
            let ptr = std::ptr::without_provenance_mut::<T>(ALIGNMENT.max(align_of::<T>()));
            // SAFETY: the address is non-zero.
            return Some(Self { ptr: unsafe { NonNull::new_unchecked(ptr) }, len, head: 0 });
        }
        // Large buffers are zeroed by the allocator (`calloc`: the fresh pages of a large
        // allocation are not even touched); small ones are a `malloc` zeroed here, because a small
        // `calloc` bypasses glibc's per-thread cache, and freeing what it gave fills that cache
        // until frees spill into the fastbins, which the next large allocation must consolidate.
        let zeroed_by_allocator = layout.size() >= ZEROED_BY_ALLOCATOR;
        // SAFETY: the layout has a non-zero size (`bytes` + `ALIGNMENT`).
        let raw = NonNull::new(unsafe {
            if zeroed_by_allocator { alloc::alloc_zeroed(layout) } else { alloc::alloc(layout) }
        })?;
        // The first 256-byte boundary: fewer than `ALIGNMENT` bytes in, a multiple of `T`'s
        // alignment (the allocation's), so `bytes` more stay inside the allocation.
        let head = raw.as_ptr().addr().next_multiple_of(ALIGNMENT) - raw.as_ptr().addr();
        // SAFETY: `head + bytes <= layout.size()`, inside the allocation just made.
        let ptr = unsafe { raw.add(head) };
        if !zeroed_by_allocator {
            // SAFETY: `bytes` writable bytes from `ptr` (inside the allocation), reachable only here.
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        }
        Some(Self { ptr: ptr.cast(), len, head })
    }

    /// A copy of `src` in a new aligned buffer.
    pub fn from_slice(src: &[T]) -> Self {
        let mut b = Self::zeroed(src.len());
        b.copy_from_slice(src);
        b
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> Deref for AlignedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialised elements (zeroed on allocation) live at `ptr`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> DerefMut for AlignedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for deref, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for AlignedBuffer<T> {
    fn drop(&mut self) {
        let bytes = self.len * size_of::<T>();
        if bytes > 0 {
            let layout = Self::allocation(bytes).expect("layout was valid when allocated");
            // SAFETY: allocated in `try_alloc` with this very layout, `head` bytes before `ptr`.
            unsafe { alloc::dealloc(self.ptr.as_ptr().cast::<u8>().sub(self.head), layout) }
        }
    }
}

impl<T: Element + std::fmt::Debug> std::fmt::Debug for AlignedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

// SAFETY: the allocation is stable across moves and lives until drop.
unsafe impl<T: Element> HostBuffer for AlignedBuffer<T> {
    type Elem = T;
    fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr.as_ptr()
    }
    fn elem_count(&self) -> usize {
        self.len
    }
}

/// One export: the managed struct first (so a pointer to it is a pointer to this), then the
/// dims it points into, then whatever keeps the data alive.
#[repr(C)]
struct Exported<H, O> {
    head: H,
    dims: Dims,
    owner: O,
}

/// Frees an [`Exported`] from its head pointer, swallowing a panic from the owner's drop (a
/// deleter must never unwind into C).
///
/// # Safety
///
/// `p` is NULL or came from `Box::into_raw` of an `Exported<H, O>` and is freed once.
unsafe fn free_exported<H, O>(p: *mut H) {
    if p.is_null() {
        return;
    }
    // SAFETY: the caller's promise; `head` is the first field of a repr(C) struct.
    let boxed = unsafe { Box::from_raw(p.cast::<Exported<H, O>>()) };
    let _ = catch_unwind(AssertUnwindSafe(move || drop(boxed)));
}

unsafe extern "C" fn delete_versioned<O>(p: *mut DLManagedTensorVersioned) {
    // SAFETY: this deleter is only installed on structs made by `export_versioned::<O>`.
    unsafe { free_exported::<DLManagedTensorVersioned, O>(p) }
}

unsafe extern "C" fn delete_legacy<O>(p: *mut DLManagedTensor) {
    // SAFETY: this deleter is only installed on structs made by `export_legacy::<O>`.
    unsafe { free_exported::<DLManagedTensor, O>(p) }
}

/// The metadata of a tensor about to be exported.
#[derive(Clone, Copy)]
pub(crate) struct Parts<'a> {
    pub data: *mut c_void,
    pub device: Device,
    pub dtype: DataType,
    pub shape: &'a [i64],
    pub strides: &'a [i64],
    pub byte_offset: u64,
}

impl Parts<'_> {
    fn dl_tensor(&self, shape: *mut i64, strides: *mut i64) -> DLTensor {
        DLTensor {
            data: self.data,
            device: self.device.to_raw(),
            ndim: self.shape.len() as i32,
            dtype: self.dtype.to_raw(),
            shape,
            strides,
            byte_offset: self.byte_offset,
        }
    }
}

/// Allocates one [`Exported`] and fills it in place (a 200-byte struct built on the stack and
/// then moved into its box costs a `memcpy` per export): dims first, then the owner, then the head
/// made by `head(dl_tensor, manager_ctx)` pointing into the dims, its data taken from the placed
/// owner by `data`.
///
/// The box becomes a raw pointer before anything points into it, and every later access goes
/// through that pointer: `Box::into_raw` after the dims pointers were taken would retag the whole
/// allocation as unique and invalidate them (undefined behaviour under Stacked Borrows).
fn new_exported<H, O>(
    parts: &Parts<'_>,
    owner: O,
    data: impl FnOnce(&mut O) -> *mut c_void,
    head: impl FnOnce(DLTensor, *mut c_void) -> H,
) -> NonNull<H> {
    let p: *mut Exported<H, O> = Box::into_raw(Box::<Exported<H, O>>::new_uninit()).cast();
    // SAFETY: `p` is a fresh, exclusively owned allocation for an `Exported<H, O>`; each field is
    // written exactly once through it (dims before anything points into them), and nothing else
    // touches the allocation until it is handed out. `free_exported` turns it back into a box.
    unsafe {
        let dims = std::ptr::addr_of_mut!((*p).dims);
        dims.write(Dims::new());
        (*dims).set(parts.shape, parts.strides);
        let (shape, strides) = Dims::pointers(dims);
        // The owner is moved to its final place before the data pointer is taken from it: moving
        // a `Box<[T]>` retags it, which would invalidate a pointer taken before the move.
        let owner_at = std::ptr::addr_of_mut!((*p).owner);
        owner_at.write(owner);
        let t = DLTensor { data: data(&mut *owner_at), ..parts.dl_tensor(shape, strides) };
        std::ptr::addr_of_mut!((*p).head).write(head(t, p.cast()));
        NonNull::new_unchecked(p.cast::<H>())
    }
}

/// A new versioned managed tensor owning `owner`; the caller owns the result.
pub(crate) fn export_versioned<O: Send + 'static>(
    parts: Parts<'_>,
    flags: Flags,
    owner: O,
) -> NonNull<DLManagedTensorVersioned> {
    export_versioned_from(parts, flags, owner, |_| parts.data)
}

/// [`export_versioned`] whose data pointer is taken from the owner once it is in place.
fn export_versioned_from<O: Send + 'static>(
    parts: Parts<'_>,
    flags: Flags,
    owner: O,
    data: impl FnOnce(&mut O) -> *mut c_void,
) -> NonNull<DLManagedTensorVersioned> {
    new_exported(&parts, owner, data, |dl_tensor, manager_ctx| DLManagedTensorVersioned {
        version: Version::CURRENT.to_raw(),
        manager_ctx,
        deleter: Some(delete_versioned::<O>),
        flags: flags.0,
        dl_tensor,
    })
}

/// A new legacy managed tensor owning `owner`; the caller owns the result.
pub(crate) fn export_legacy<O: Send + 'static>(parts: Parts<'_>, owner: O) -> NonNull<DLManagedTensor> {
    new_exported(
        &parts,
        owner,
        |_| parts.data,
        |dl_tensor, manager_ctx| DLManagedTensor {
            dl_tensor,
            manager_ctx,
            deleter: Some(delete_legacy::<O>),
        },
    )
}

fn to_i64(v: &[usize], field: &str) -> Result<Vec<i64>> {
    v.iter().map(|&x| i64::try_from(x)).collect::<Result<_, _>>().map_err(|_| Error::BufferMismatch {
        expected: format!("{field} {} within int64", tuple(v)),
        found: "larger values".into(),
    })
}

impl ManagedTensor {
    /// A C-contiguous CPU tensor over a `Vec`, without copying. `shape`'s product must equal the
    /// length.
    pub fn from_vec<T: Element>(v: Vec<T>, shape: &[usize]) -> Result<Self> {
        Self::from_host(v, shape)
    }

    /// A C-contiguous CPU tensor over any [`HostBuffer`] (`Vec`, `Box<[T]>`, `Arc<[T]>` read-only,
    /// [`AlignedBuffer`]), without copying. `shape`'s product must equal the buffer length.
    #[inline]
    pub fn from_host<B: HostBuffer>(buf: B, shape: &[usize]) -> Result<Self> {
        // Shape and strides on the stack (for the usual ranks): a new tensor makes no allocation
        // but its export.
        let mut dims = Dims::new();
        let (s, t) = dims.resize(shape.len());
        for (out, &d) in s.iter_mut().zip(shape) {
            *out =
                i64::try_from(d).map_err(|_| to_i64(shape, "shape").expect_err("a value exceeds int64"))?;
        }
        layout::c_strides_into(s, t);
        let numel = layout::element_count(dims.shape())?;
        if numel != buf.elem_count() as u64 {
            return Err(Error::BufferMismatch {
                expected: format!("{numel} elements for shape {}", tuple(dims.shape())),
                found: format!("{} elements", buf.elem_count()),
            });
        }
        // C strides over exactly `numel` elements from the first: inside the buffer, and no two
        // elements share memory, so the layout check is known to pass (asserted in debug builds,
        // which every test of a `from_host` caller runs).
        let (dtype, shape, strides) = (<B::Elem as Element>::DTYPE, dims.shape(), dims.strides());
        debug_assert_eq!(Self::check_host_layout(&buf, dtype, shape, strides, 0).ok(), Some(false));
        Self::export_host_checked(buf, dtype, shape, strides, 0, false)
    }

    /// A CPU tensor over any [`HostBuffer`] with explicit strides (in elements, may be negative or
    /// zero) and the index of the first element in the buffer, without copying. Every element the
    /// layout reaches must lie inside the buffer. A layout whose elements may overlap (zero
    /// strides, or strides such as `[1, 1]` over `[2, 2]`; see [`layout::may_overlap`]) makes the
    /// tensor read-only.
    ///
    /// ```
    /// use dlbridge::ManagedTensor;
    /// // A 2x3 row-major buffer seen as its 3x2 transpose, Fortran order...
    /// let t = ManagedTensor::from_host_strided((0..6).collect::<Vec<i32>>(), &[3, 2], &[1, 3], 0).unwrap();
    /// assert!(t.is_f_contiguous() && !t.is_c_contiguous());
    /// assert_eq!(t.to_vec::<i32>().unwrap(), [0, 3, 1, 4, 2, 5]);
    /// // ...and reversed along its first axis (negative stride, first element at index 2).
    /// let r = ManagedTensor::from_host_strided((0..6).collect::<Vec<i32>>(), &[3, 2], &[-1, 3], 2).unwrap();
    /// assert_eq!(r.to_vec::<i32>().unwrap(), [2, 5, 1, 4, 0, 3]);
    /// ```
    pub fn from_host_strided<B: HostBuffer>(
        buf: B,
        shape: &[usize],
        strides: &[isize],
        first: usize,
    ) -> Result<Self> {
        let shape = to_i64(shape, "shape")?;
        let strides: Vec<i64> = strides.iter().map(|&s| s as i64).collect();
        let size = size_of::<B::Elem>() as u64;
        let first = (first as u64).checked_mul(size).ok_or_else(|| Error::BufferMismatch {
            expected: format!("first element {first}"),
            found: format!("{} elements", buf.elem_count()),
        })?;
        Self::export_host(buf, <B::Elem as Element>::DTYPE, &shape, &strides, first)
    }

    /// A CPU tensor of any dtype (including those with no Rust type: float8, packed float4, ...)
    /// over the bytes of a [`HostBuffer`], with `strides` in elements (`None`: C order) and the
    /// first element `byte_offset` bytes into the buffer. The layout must stay inside the buffer.
    ///
    /// ```
    /// use dlbridge::{AlignedBuffer, DataType, ManagedTensor};
    /// let t = ManagedTensor::from_host_bytes(AlignedBuffer::<u8>::zeroed(8), DataType::FLOAT8_E4M3FN, &[2, 4], None, 0).unwrap();
    /// assert_eq!((t.dtype().to_string(), t.nbytes()), ("float8_e4m3fn".to_string(), 8));
    /// ```
    pub fn from_host_bytes<B: HostBuffer>(
        buf: B,
        dtype: DataType,
        shape: &[usize],
        strides: Option<&[isize]>,
        byte_offset: usize,
    ) -> Result<Self> {
        dtype.validate()?;
        let shape = to_i64(shape, "shape")?;
        let strides = match strides {
            Some(s) => s.iter().map(|&s| s as i64).collect(),
            None => layout::c_strides(&shape),
        };
        Self::export_host(buf, dtype, &shape, &strides, byte_offset as u64)
    }

    /// Checks that `shape`/`strides` starting `first_byte` bytes into `buf` stay inside it, then
    /// exports. Data pointer = first element, byte_offset 0 (old consumers ignored byte_offset).
    fn export_host<B: HostBuffer>(
        buf: B,
        dtype: DataType,
        shape: &[i64],
        strides: &[i64],
        first_byte: u64,
    ) -> Result<Self> {
        let overlapping = Self::check_host_layout(&buf, dtype, shape, strides, first_byte)?;
        Self::export_host_checked(buf, dtype, shape, strides, first_byte, overlapping)
    }

    /// What [`ManagedTensor::export_host`] checks: the layout stays inside `buf`; `Ok(true)` if
    /// its elements may overlap.
    fn check_host_layout<B: HostBuffer>(
        buf: &B,
        dtype: DataType,
        shape: &[i64],
        strides: &[i64],
        first_byte: u64,
    ) -> Result<bool> {
        if shape.len() != strides.len() {
            return Err(Error::BufferMismatch {
                expected: format!("{} strides for shape {}", shape.len(), tuple(shape)),
                found: format!("strides {}", tuple(strides)),
            });
        }
        let buf_bytes = (buf.elem_count() as u64) * size_of::<B::Elem>() as u64;
        let numel = layout::element_count(shape)?;
        let within = if numel == 0 {
            first_byte <= buf_bytes
        } else {
            let (lo, hi) = layout::byte_span(shape, strides, dtype.storage_bits(false))?;
            let lo = first_byte as i128 + lo as i128;
            let hi = first_byte as i128 + hi as i128;
            lo >= 0 && hi <= buf_bytes as i128
        };
        if !within {
            return Err(Error::BufferMismatch {
                expected: format!(
                    "shape {} strides {} from byte {first_byte} of {dtype}",
                    tuple(shape),
                    tuple(strides)
                ),
                found: format!("{buf_bytes} bytes"),
            });
        }
        // Elements that may share memory cannot be written soundly through a Rust reference.
        Ok(numel > 1 && layout::may_overlap(shape, strides))
    }

    /// The export of a host layout already checked ([`ManagedTensor::check_host_layout`], or
    /// known to pass it), `overlapping` what the check said.
    fn export_host_checked<B: HostBuffer>(
        buf: B,
        dtype: DataType,
        shape: &[i64],
        strides: &[i64],
        first_byte: u64,
        overlapping: bool,
    ) -> Result<Self> {
        let flags = Flags::NONE.with(Flags::READ_ONLY, buf.is_read_only() || overlapping);
        let parts =
            Parts { data: std::ptr::null_mut(), device: Device::CPU, dtype, shape, strides, byte_offset: 0 };
        let raw = export_versioned_from(parts, flags, buf, |b: &mut B| {
            b.as_mut_ptr().cast::<u8>().wrapping_add(first_byte as usize).cast::<c_void>()
        });
        // SAFETY: a versioned struct just made, owned here, with shape/strides inside it.
        unsafe { Self::from_raw_versioned(raw.as_ptr()) }
    }

    /// A tensor over memory anywhere (device memory, a foreign allocation), kept alive by `owner`,
    /// which is dropped exactly once when the last consumer releases the tensor. `strides` `None`
    /// means C order. The metadata is validated like any foreign tensor's; on refusal `owner` is
    /// dropped.
    ///
    /// ```
    /// use dlbridge::{DataType, Device, Flags, ManagedTensor};
    /// // A pretend CUDA allocation: the address is recorded, never dereferenced.
    /// struct CudaAlloc(usize);
    /// let t = unsafe {
    ///     ManagedTensor::from_raw_parts(0x7f00_0000_0000 as *mut _, Device::cuda(1), DataType::FLOAT16,
    ///         &[4, 4], None, 0, Flags::NONE, CudaAlloc(0x7f00_0000_0000))
    /// }.unwrap();
    /// assert_eq!(t.device().to_string(), "cuda:1");
    /// assert!(t.as_slice::<half::f16>().is_err());
    /// ```
    ///
    /// # Safety
    ///
    /// `data + byte_offset` is the first element of memory on `device` that `owner` keeps valid
    /// for every element the layout reaches, and (unless `flags` says read-only) writable by
    /// consumers; for host devices, nothing else accesses it in ways that conflict with that.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn from_raw_parts<O: Send + 'static>(
        data: *mut c_void,
        device: Device,
        dtype: DataType,
        shape: &[i64],
        strides: Option<&[i64]>,
        byte_offset: u64,
        flags: Flags,
        owner: O,
    ) -> Result<Self> {
        let c;
        let strides = match strides {
            Some(s) => s,
            None => {
                c = layout::c_strides(shape);
                &c
            }
        };
        if shape.len() != strides.len() || shape.len() > crate::MAX_NDIM {
            drop(owner);
            return Err(Error::InvalidNdim {
                ndim: shape.len().max(strides.len()) as i64,
                max: crate::MAX_NDIM,
            });
        }
        let parts = Parts { data, device, dtype, shape, strides, byte_offset };
        let raw = export_versioned(parts, flags, owner);
        // SAFETY: a versioned struct just made and owned here (the common case taken first);
        // validation frees it on refusal.
        match unsafe { Self::take_if_common(raw) } {
            Some(t) => Ok(t),
            // SAFETY: as above; nothing was taken.
            None => unsafe { Self::from_raw_versioned(raw.as_ptr()) },
        }
    }

    /// This tensor's description for a re-export: the first element in `data` with `byte_offset`
    /// 0 where `data` is an address (host and CUDA/ROCm memory; older consumers ignored
    /// `byte_offset`), the producer's pair as it was where `data` is an opaque handle (OpenCL,
    /// Vulkan, Metal buffers, on which pointer arithmetic means nothing).
    fn parts(&self) -> Parts<'_> {
        let t = self.dl_tensor();
        let address = self.is_host_accessible()
            || matches!(self.device().device_type(), crate::DeviceType::CUDA | crate::DeviceType::ROCM);
        let (data, byte_offset) = if address { (self.data_ptr(), 0) } else { (t.data, t.byte_offset) };
        Parts {
            data,
            device: self.device(),
            dtype: self.dtype(),
            shape: self.shape(),
            strides: self.strides(),
            byte_offset,
        }
    }

    /// A new versioned managed tensor that shares this tensor's data and keeps it alive (a clone
    /// of the `Arc`), with this tensor's flags. Each call gives a new struct; the caller owns it
    /// and must call its deleter exactly once (a consumer does, or wrap it back with
    /// [`ManagedTensor::from_raw_versioned`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use dlbridge::ManagedTensor;
    /// let t = Arc::new(ManagedTensor::from_vec(vec![1u8, 2, 3], &[3]).unwrap());
    /// let again = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    /// assert_eq!(again.data_ptr(), t.data_ptr());
    /// ```
    pub fn export_versioned(self: &Arc<Self>) -> NonNull<DLManagedTensorVersioned> {
        export_versioned(self.parts(), self.flags(), Arc::clone(self))
    }

    /// [`ManagedTensor::export_versioned`] with the device the consumer asked for (a host-accessible
    /// alias such as cpu for cuda_host memory) and explicit flags.
    #[cfg(feature = "python")]
    pub(crate) fn export_versioned_as(
        self: &Arc<Self>,
        device: Device,
        flags: Flags,
    ) -> NonNull<DLManagedTensorVersioned> {
        export_versioned(Parts { device, ..self.parts() }, flags, Arc::clone(self))
    }

    /// This tensor as an owning versioned struct: its own struct when it has one (no allocation),
    /// else a versioned struct over it (a legacy import). The caller owns the result.
    #[cfg(feature = "python")]
    pub(crate) fn into_versioned_raw(self) -> NonNull<DLManagedTensorVersioned> {
        if !self.is_versioned() {
            return Arc::new(self).export_versioned();
        }
        match self.into_raw() {
            // SAFETY: into_raw hands out the live, non-NULL struct it owned.
            crate::RawManagedTensor::Versioned(p) => unsafe { NonNull::new_unchecked(p) },
            crate::RawManagedTensor::Legacy(_) => unreachable!("checked versioned"),
        }
    }

    /// [`ManagedTensor::export_legacy`] with the device the consumer asked for.
    #[cfg(feature = "python")]
    pub(crate) fn export_legacy_as(self: &Arc<Self>, device: Device) -> NonNull<DLManagedTensor> {
        export_legacy(Parts { device, ..self.parts() }, Arc::clone(self))
    }

    /// A new legacy managed tensor sharing this tensor's data; see
    /// [`ManagedTensor::export_versioned`]. A legacy struct cannot carry flags, so a read-only
    /// tensor is refused ([`Error::Incompatible`]): its consumer would take the memory as writable.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use dlbridge::ManagedTensor;
    /// let shared: Arc<[u8]> = Arc::from(vec![1u8, 2, 3]);
    /// let t = Arc::new(ManagedTensor::from_host(shared, &[3]).unwrap());
    /// assert!(t.is_read_only() && t.export_legacy().is_err());
    /// ```
    pub fn export_legacy(self: &Arc<Self>) -> Result<NonNull<DLManagedTensor>> {
        if self.is_read_only() {
            return Err(Error::Incompatible {
                expected: "a writable tensor (a legacy DLManagedTensor cannot say read-only)".into(),
                found: self.describe(),
            });
        }
        Ok(export_legacy(self.parts(), Arc::clone(self)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffers_are_256_byte_aligned_even_when_empty() {
        for len in [0usize, 1, 7, 1000] {
            let b = AlignedBuffer::<u16>::zeroed(len);
            assert_eq!(b.as_ptr() as usize % ALIGNMENT, 0, "len {len}");
            assert!(b.iter().all(|&x| x == 0));
            assert_eq!(b.len(), len);
        }
        assert_eq!(&*AlignedBuffer::from_slice(&[1.5f32, 2.5]), &[1.5, 2.5]);
    }

    /// The elements start at a 256-byte boundary inside a plain allocation (see `AlignedBuffer`):
    /// for every element size and many lengths, so the start lands at many offsets into it, each
    /// element is zero, writable to the last one, and freed with the layout it was made with
    /// (Miri checks both).
    #[test]
    fn aligned_buffers_start_at_a_boundary_inside_their_allocation() {
        fn check<T: Element + PartialEq + Default + std::fmt::Debug>(one: T) {
            let bufs: Vec<AlignedBuffer<T>> =
                (0..40).map(|len| AlignedBuffer::<T>::zeroed(len * 3 + 1)).collect();
            for mut b in bufs {
                assert_eq!(b.as_ptr().addr() % ALIGNMENT, 0);
                assert!(b.iter().all(|x| *x == T::default()));
                let last = b.len() - 1;
                b[last] = one;
                b[0] = one;
                assert_eq!((b[0], b[last]), (one, one));
            }
        }
        check(1u8);
        check(1u16);
        check(1.0f32);
        check(1.0f64);
        check(num_complex::Complex::new(1.0f64, -1.0));
        check(true);
        // An element type aligned to more than 256 bytes (a vector of 128 float32 lanes), empty
        // and not.
        #[derive(Clone, Copy, PartialEq, Debug)]
        #[repr(C, align(512))]
        struct Wide([f32; 128]);
        impl Default for Wide {
            fn default() -> Self {
                Wide([0.0; 128])
            }
        }
        // SAFETY: 512 bytes of float32 lanes, no padding, every bit pattern a value.
        unsafe impl Element for Wide {
            const DTYPE: DataType = DataType::new(crate::dtype::TypeCode::FLOAT, 32, 128);
        }
        for len in [0, 1, 3] {
            let b = AlignedBuffer::<Wide>::zeroed(len);
            assert_eq!((b.as_ptr().addr() % 512, b.len()), (0, len));
            assert!(b.iter().all(|w| *w == Wide::default()));
        }
        check(Wide([1.0; 128]));
        // Large enough to be zeroed by the allocator instead.
        let big = AlignedBuffer::<u64>::zeroed(ZEROED_BY_ALLOCATOR / 8);
        assert_eq!(big.as_ptr().addr() % ALIGNMENT, 0);
        assert!(big.iter().step_by(61).all(|&x| x == 0) && big[big.len() - 1] == 0);
    }

    #[test]
    fn try_zeroed_reports_sizes_it_cannot_allocate() {
        assert!(AlignedBuffer::<u64>::try_zeroed(usize::MAX / 4).is_err());
        assert!(AlignedBuffer::<u8>::try_zeroed(isize::MAX as usize).is_err());
        assert_eq!(AlignedBuffer::<u16>::try_zeroed(3).unwrap().len(), 3);
        assert_eq!(AlignedBuffer::<u16>::try_zeroed(0).unwrap().len(), 0);
    }

    #[test]
    fn many_dims_spill_to_the_heap() {
        let shape = vec![1usize; 10];
        let t = ManagedTensor::from_vec(vec![7i64], &shape).unwrap();
        assert_eq!(t.ndim(), 10);
        assert_eq!(t.strides(), &[1; 10]);
    }
}
