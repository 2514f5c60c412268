//! Borrowed, typed access to a [`ManagedTensor`]'s elements: slices of compact host tensors,
//! strided element reads, and copies into compact aligned buffers.
//!
//! The memory is shared with the producer. dlbridge guarantees the layout, type, alignment and
//! device are what a slice needs, that read-only tensors are never handed out mutably, and that
//! its own safe API never hands out a mutable slice or view while any other slice or view of the
//! same memory lives, whichever handle (or extension module) it came from: each guard holds a
//! lease in the process-wide registry of [`crate::borrow`]. It cannot stop another library that
//! still holds the same memory (numpy, torch) from writing to it while a slice is alive, so code
//! that shares a writable tensor must not write from both sides at once.
//!
//! ```
//! use dlbridge::ManagedTensor;
//! let mut t = ManagedTensor::from_vec(vec![1i32, 2, 3, 4], &[2, 2]).unwrap();
//! t.as_slice_mut::<i32>().unwrap()[0] = 10; // the guard (and its lease) ends with the statement
//! assert_eq!(t.get::<i32>(&[0, 0]).unwrap(), 10);
//! let err = t.as_slice::<f32>().unwrap_err().to_string();
//! assert_eq!(err, "expected float32 C-contiguous cpu tensor, got int32 (2, 2) on cpu");
//! ```

use std::fmt;
use std::ops::{Deref, DerefMut};

use crate::borrow::Lease;
use crate::dtype::{DataType, Element};
use crate::error::{Error, Result, tuple};
use crate::export::AlignedBuffer;
use crate::layout;
use crate::managed::ManagedTensor;
use crate::spec::{DeviceKind, Order, Spec};

/// A shared slice of a tensor's elements ([`ManagedTensor::as_slice`]): derefs to `[T]` and
/// holds a shared lease on the memory (see [`crate::borrow`]) until it drops.
pub struct SliceRef<'a, T> {
    slice: &'a [T],
    _lease: Lease,
}

/// A mutable slice of a tensor's elements ([`ManagedTensor::as_slice_mut`]): derefs to `[T]`
/// mutably and holds an exclusive lease on the memory until it drops, so no other handle over the
/// same memory can read or write it meanwhile.
pub struct SliceMut<'a, T> {
    slice: &'a mut [T],
    _lease: Lease,
}

impl<'a, T> SliceRef<'a, T> {
    /// A guard over `slice` holding `lease` (the XLA FFI views, [`crate::xla`], make theirs here).
    pub(crate) fn from_lease(slice: &'a [T], lease: Lease) -> Self {
        Self { slice, _lease: lease }
    }
}

impl<'a, T> SliceMut<'a, T> {
    /// A guard over `slice` holding `lease` (the XLA FFI views make theirs here).
    pub(crate) fn from_lease(slice: &'a mut [T], lease: Lease) -> Self {
        Self { slice, _lease: lease }
    }
}

impl<T> Deref for SliceRef<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.slice
    }
}

impl<T> Deref for SliceMut<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.slice
    }
}

impl<T> DerefMut for SliceMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.slice
    }
}

impl<T: fmt::Debug> fmt::Debug for SliceRef<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.slice.fmt(f)
    }
}

impl<T: fmt::Debug> fmt::Debug for SliceMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.slice.fmt(f)
    }
}

impl<T: PartialEq, R: AsRef<[T]> + ?Sized> PartialEq<R> for SliceRef<'_, T> {
    fn eq(&self, other: &R) -> bool {
        self.slice == other.as_ref()
    }
}

impl<T: PartialEq, R: AsRef<[T]> + ?Sized> PartialEq<R> for SliceMut<'_, T> {
    fn eq(&self, other: &R) -> bool {
        *self.slice == *other.as_ref()
    }
}

impl ManagedTensor {
    fn refuse(&self, expected: String) -> Error {
        Error::Incompatible { found: self.found(expected.starts_with("writable ")), expected }
    }

    /// Registers the byte range this tensor's elements span (nothing for an empty or non-host
    /// tensor), shared or exclusive; see [`crate::borrow`].
    pub(crate) fn lease(&self, exclusive: bool) -> Result<Lease> {
        if !self.is_host_accessible() {
            return Lease::acquire(0, 0, exclusive);
        }
        self.lease_span(exclusive)
    }

    /// [`ManagedTensor::lease`] for a tensor on any device whose `data` is an address in the
    /// process's one address space (host memory, and CUDA memory, which unified virtual addressing
    /// keeps apart from host addresses): the typed CUDA views lease device ranges through it.
    #[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
    pub(crate) fn lease_span(&self, exclusive: bool) -> Result<Lease> {
        if self.numel() == 0 {
            return Lease::acquire(0, 0, exclusive);
        }
        let bits = self.dtype().storage_bits(self.flags().is_subbyte_padded());
        // Validated on entry: the span fits the address space from the first element.
        let (lo, hi) = layout::byte_span(self.shape(), self.strides(), bits)?;
        let base = self.data_ptr() as usize;
        Lease::acquire(base.wrapping_add_signed(lo), base.wrapping_add_signed(hi), exclusive)
    }

    /// What a typed view of `T` over host memory needs, as the [`Spec`] a typed argument states:
    /// refusals of the untyped accessors and of typed arguments are worded by one formatter
    /// ([`crate::spec::Mismatch`]).
    fn typed_spec<T: Element>(order: Order, write: bool) -> Spec {
        Spec { dtype: Some(T::DTYPE), order, device: DeviceKind::Cpu, writable: write, ..Spec::ANY }
    }

    /// Checks what a typed view needs: host memory, dtype `T`, compact in `order` (C or F; none
    /// for [`Order::Any`]), writability (if `write`), alignment, and valid bytes for `T`.
    fn check_typed<T: Element>(&self, order: Order, write: bool) -> Result<()> {
        let spec = Self::typed_spec::<T>(order, write);
        let compact = match order {
            Order::C => self.is_c_contiguous(),
            Order::F => self.is_f_contiguous(),
            Order::Any => true,
        };
        let ok = self.is_host_accessible()
            && self.dtype() == T::DTYPE
            && compact
            && !(write && self.is_read_only());
        if !ok {
            // The first failed field, worded as a typed argument's refusal.
            return Err(self.check(&spec).err().unwrap_or_else(|| self.refuse(spec.to_string())));
        }
        if self.numel() > 0 && !self.data_ptr().cast::<T>().is_aligned() {
            return Err(Error::Incompatible {
                expected: format!("{spec} aligned to {} bytes", align_of::<T>()),
                found: format!("data at {:p}", self.data_ptr()),
            });
        }
        Ok(())
    }

    /// The elements as a slice, in row-major order, when the tensor is a C-contiguous host tensor
    /// of dtype `T` with aligned data. For `bool`, every byte is checked to be 0 or 1.
    ///
    /// The slice holds a shared lease on the memory while it lives: [`Error::AlreadyBorrowed`]
    /// if another handle over the same memory holds a mutable slice or view of it.
    pub fn as_slice<T: Element>(&self) -> Result<SliceRef<'_, T>> {
        self.slice_in::<T>(Order::C)
    }

    /// The elements as a mutable slice; as [`ManagedTensor::as_slice`], and refused for read-only
    /// tensors. The slice holds an exclusive lease on the memory: [`Error::AlreadyBorrowed`] while
    /// any slice or view of the same memory from another handle lives.
    pub fn as_slice_mut<T: Element>(&mut self) -> Result<SliceMut<'_, T>> {
        self.slice_mut_in::<T>(Order::C)
    }

    /// The elements in memory order, when the tensor is compact in `order` (C: row-major, F:
    /// column-major): the one path of every shared slice.
    pub(crate) fn slice_in<T: Element>(&self, order: Order) -> Result<SliceRef<'_, T>> {
        self.check_typed::<T>(order, false)?;
        let lease = self.lease(false)?;
        if self.numel() == 0 {
            return Ok(SliceRef { slice: &[], _lease: lease });
        }
        // SAFETY: host memory, compact (its first element is its lowest address), aligned, of
        // dtype T, numel elements, validated span; kept alive by self for the borrow; no mutable
        // access through dlbridge while the shared lease lives (and none through `self`, borrowed
        // shared).
        let bytes = unsafe {
            std::slice::from_raw_parts(self.data_ptr().cast::<u8>(), self.numel() * size_of::<T>())
        };
        if !T::ALL_BIT_PATTERNS_VALID && !T::is_valid_bytes(bytes) {
            return Err(self.refuse(format!("{} values only", T::DTYPE)));
        }
        // SAFETY: as above, and the bytes are valid values of T.
        let slice = unsafe { std::slice::from_raw_parts(self.data_ptr().cast::<T>(), self.numel()) };
        Ok(SliceRef { slice, _lease: lease })
    }

    /// [`ManagedTensor::slice_in`], mutable: the one path of every mutable slice.
    pub(crate) fn slice_mut_in<T: Element>(&mut self, order: Order) -> Result<SliceMut<'_, T>> {
        self.check_typed::<T>(order, true)?;
        let lease = self.lease(true)?;
        if self.numel() == 0 {
            return Ok(SliceMut { slice: &mut [], _lease: lease });
        }
        // SAFETY: as in slice_in; the exclusive lease and `&mut self` make this the only access
        // dlbridge hands out to these bytes, and the producer did not mark them read-only (a
        // compact layout has no overlapping elements).
        let bytes = unsafe {
            std::slice::from_raw_parts(self.data_ptr().cast::<u8>(), self.numel() * size_of::<T>())
        };
        if !T::ALL_BIT_PATTERNS_VALID && !T::is_valid_bytes(bytes) {
            return Err(self.refuse(format!("{} values only", T::DTYPE)));
        }
        // SAFETY: as above; the shared `bytes` is not used past this point.
        let slice = unsafe { std::slice::from_raw_parts_mut(self.data_ptr().cast::<T>(), self.numel()) };
        Ok(SliceMut { slice, _lease: lease })
    }

    /// The refusal of a typed strided view (ndarray, faer, nalgebra, ...): "expected writable
    /// float32 cpu tensor{what}, got ...", as a typed argument words it.
    #[cfg_attr(
        not(any(feature = "ndarray", feature = "faer", feature = "nalgebra", feature = "arrow")),
        allow(dead_code)
    )]
    pub(crate) fn refuse_view<T: Element>(&self, write: bool, what: &str) -> Error {
        let spec = Self::typed_spec::<T>(Order::Any, write);
        if what.is_empty() {
            // dtype, device or read-only: worded as a typed argument's refusal.
            if let Err(e) = self.check(&spec) {
                return e;
            }
        }
        self.refuse(format!("{spec}{what}"))
    }

    /// The one check-and-lease path of every typed strided view over this tensor (the ndarray,
    /// faer, nalgebra and arrow bridges): host memory of dtype `T`, writable (if `write`),
    /// aligned, elements that do not overlap (if `write`: a mutable view may not alias), valid
    /// bytes for `T`; then a shared (or, for `write`, exclusive) lease on the span, taken before
    /// any element is read. Returns the first element (index `0, ..., 0`; a dangling, aligned
    /// pointer for an empty tensor) and the lease, which the view must hold while it lives.
    #[cfg_attr(
        not(any(feature = "ndarray", feature = "faer", feature = "nalgebra", feature = "arrow")),
        allow(dead_code)
    )]
    pub(crate) fn strided_view<T: Element>(&self, write: bool) -> Result<(std::ptr::NonNull<T>, Lease)> {
        if !self.is_host_of(T::DTYPE) || (write && self.is_read_only()) {
            return Err(self.refuse_view::<T>(write, ""));
        }
        if self.numel() == 0 {
            return Ok((std::ptr::NonNull::dangling(), self.lease(write)?));
        }
        let first = self.data_ptr().cast::<T>();
        if !first.is_aligned() {
            return Err(self.refuse_view::<T>(write, " with aligned data"));
        }
        if write && layout::may_overlap(self.shape(), self.strides()) {
            return Err(
                self.refuse_view::<T>(write, " whose elements do not overlap (a mutable view may not alias)")
            );
        }
        let lease = self.lease(write)?;
        if !T::ALL_BIT_PATTERNS_VALID {
            for off in self.offsets() {
                // SAFETY: each offset addresses a whole element inside the validated span of host
                // memory, and the lease keeps dlbridge's mutable access away while it is read.
                let bytes = unsafe {
                    std::slice::from_raw_parts(first.offset(off as isize).cast::<u8>(), size_of::<T>())
                };
                if !T::is_valid_bytes(bytes) {
                    return Err(self.refuse_view::<T>(write, " of valid values"));
                }
            }
        }
        // SAFETY: numel > 0, so validation required non-NULL data.
        Ok((unsafe { std::ptr::NonNull::new_unchecked(first) }, lease))
    }

    /// Element offsets (in elements, from the first element) in row-major index order.
    pub(crate) fn offsets(&self) -> impl Iterator<Item = i64> + '_ {
        let shape = self.shape();
        let strides = self.strides();
        let n = self.numel();
        let mut index = vec![0i64; shape.len()];
        let mut off = 0i64;
        (0..n).map(move |k| {
            if k > 0 {
                // Advance the multi-index like an odometer, updating the offset incrementally.
                for ax in (0..shape.len()).rev() {
                    index[ax] += 1;
                    off += strides[ax];
                    if index[ax] < shape[ax] {
                        break;
                    }
                    off -= strides[ax] * shape[ax];
                    index[ax] = 0;
                }
            }
            off
        })
    }

    /// The element at `index` of a host tensor of dtype `T`, with any strides.
    pub fn get<T: Element>(&self, index: &[usize]) -> Result<T> {
        self.check_typed::<T>(Order::Any, false)?;
        let shape = self.shape();
        if index.len() != shape.len() || index.iter().zip(shape).any(|(&i, &d)| i as u64 >= d as u64) {
            return Err(Error::Incompatible {
                expected: format!("an index within shape {}", tuple(shape)),
                found: format!("index {}", tuple(index)),
            });
        }
        let off: i64 = index.iter().zip(self.strides()).map(|(&i, &s)| i as i64 * s).sum();
        let _lease = self.lease(false)?;
        self.read_at::<T>(off)
    }

    /// Reads one element; the caller holds a shared lease on the tensor's memory.
    fn read_at<T: Element>(&self, off: i64) -> Result<T> {
        // SAFETY: `off` is the offset of an element inside the validated span of host memory, and
        // the caller's lease keeps dlbridge's mutable access away while it reads.
        let p = unsafe { self.data_ptr().cast::<T>().offset(off as isize) };
        // SAFETY: as above; reading the bytes first to check them keeps bool sound.
        let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), size_of::<T>()) };
        if !T::ALL_BIT_PATTERNS_VALID && !T::is_valid_bytes(bytes) {
            return Err(self.refuse(format!("{} values only", T::DTYPE)));
        }
        // SAFETY: valid, aligned element of type T.
        Ok(unsafe { p.read() })
    }

    /// Every element in row-major index order, copied into a `Vec`, whatever the strides
    /// (negative, zero, Fortran order).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if self.check_typed::<T>(Order::C, false).is_ok() {
            return Ok(self.as_slice::<T>()?.to_vec());
        }
        self.check_typed::<T>(Order::Any, false)?;
        let _lease = self.lease(false)?;
        self.offsets().map(|off| self.read_at::<T>(off)).collect()
    }

    /// A C-contiguous copy of a host tensor of any whole-byte dtype, in a new 256-byte-aligned
    /// buffer, as a new writable tensor (flag IS_COPIED is left to the caller who hands it out).
    ///
    /// ```
    /// use dlbridge::ManagedTensor;
    /// let f = ManagedTensor::from_host_strided(vec![1u16, 2, 3, 4], &[2, 2], &[1, 2], 0).unwrap();
    /// let c = f.to_contiguous().unwrap();
    /// assert!(c.is_c_contiguous());
    /// assert_eq!(c.as_slice::<u16>().unwrap(), &[1, 3, 2, 4]);
    /// assert_eq!(c.data_ptr() as usize % 256, 0);
    /// ```
    pub fn to_contiguous(&self) -> Result<ManagedTensor> {
        let dtype = self.dtype();
        let itemsize = match dtype.itemsize() {
            Some(s) if self.is_host_accessible() => s,
            _ => return Err(self.refuse("a host tensor of a whole-byte dtype".into())),
        };
        let bytes = self.numel().checked_mul(itemsize).filter(|&b| b <= isize::MAX as usize);
        let Some(bytes) = bytes else {
            return Err(self.refuse("a tensor whose compact copy fits in memory".into()));
        };
        let mut buf = AlignedBuffer::<u8>::zeroed(bytes);
        let base = self.data_ptr().cast::<u8>();
        let lease = self.lease(false)?;
        if self.is_c_contiguous() {
            if self.numel() > 0 {
                // SAFETY: compact host memory of numel*itemsize bytes inside the validated span.
                let src = unsafe { std::slice::from_raw_parts(base, buf.len()) };
                buf.copy_from_slice(src);
            }
        } else {
            for (dst, off) in buf.chunks_exact_mut(itemsize).zip(self.offsets()) {
                // SAFETY: each offset addresses a whole element inside the validated span.
                let src = unsafe {
                    std::slice::from_raw_parts(base.offset(off as isize * itemsize as isize), itemsize)
                };
                dst.copy_from_slice(src);
            }
        }
        drop(lease);
        let shape: Vec<usize> = self.shape().iter().map(|&d| d as usize).collect();
        ManagedTensor::from_host_bytes(buf, dtype, &shape, None, 0)
    }

    /// Whether this is a host tensor whose dtype is `dtype` (a cheap check before typed access).
    pub fn is_host_of(&self, dtype: DataType) -> bool {
        self.is_host_accessible() && self.dtype() == dtype
    }
}
