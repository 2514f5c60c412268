//! [`ManagedTensor`]: the owning handle through which every foreign tensor enters dlbridge.
//!
//! A raw `DLManagedTensor` or `DLManagedTensorVersioned` pointer becomes a `ManagedTensor` only
//! after every field has been checked; afterwards every accessor is safe. The producer's deleter
//! runs exactly once: when the handle is dropped, or at once when validation refuses the tensor
//! (including a versioned tensor of a major version this crate cannot read, whose deleter sits at
//! a position every major version keeps).

use std::ffi::c_void;
use std::fmt;
use std::ptr::NonNull;

use crate::device::Device;
use crate::dtype::DataType;
use crate::error::{Error, Result, tuple};
use crate::ffi::{DLManagedTensor, DLManagedTensorVersioned, DLTensor};
use crate::flags::{Flags, Version};
use crate::layout;
use crate::spec::{Field, Mismatch, Spec, first_failure_of};

/// The largest `ndim` a tensor may have (numpy's limit; DLPack itself sets none).
pub const MAX_NDIM: usize = 64;

/// Which managed struct a [`ManagedTensor`] owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Raw {
    Legacy(NonNull<DLManagedTensor>),
    Versioned(NonNull<DLManagedTensorVersioned>),
    /// A plain `DLTensor` owned by someone else for the duration of a borrow (a
    /// [`crate::python::TensorView`]); never deleted, never given out by value.
    #[cfg_attr(not(feature = "python"), allow(dead_code))]
    Borrowed(NonNull<DLTensor>),
}

impl Raw {
    /// Calls the producer's deleter, if any.
    ///
    /// # Safety
    ///
    /// The pointer must be a live managed tensor this code owns; it is dead afterwards.
    unsafe fn delete(self) {
        match self {
            Raw::Legacy(p) => {
                // SAFETY: the caller owns the live struct; the deleter field is read before the
                // call frees it.
                if let Some(d) = unsafe { (*p.as_ptr()).deleter } {
                    // SAFETY: called once, with the pointer the producer handed out.
                    unsafe { d(p.as_ptr()) }
                }
            }
            Raw::Versioned(p) => {
                // SAFETY: as above; `deleter` is in the prefix every major version keeps.
                if let Some(d) = unsafe { (*p.as_ptr()).deleter } {
                    // SAFETY: called once, with the pointer the producer handed out.
                    unsafe { d(p.as_ptr()) }
                }
            }
            Raw::Borrowed(_) => {}
        }
    }
}

/// A producer's deleter that a [`DeleterGate`] received instead of [`ManagedTensor`]'s drop
/// calling it: [`PendingDeleter::run`] calls it (once, since it consumes the value); dropping it
/// unrun leaks the producer's tensor, never frees it twice.
#[must_use = "dropping a PendingDeleter leaks the tensor; call run()"]
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) struct PendingDeleter(Raw);

// SAFETY: it owns the managed struct exclusively (moved out of a dropped ManagedTensor, which is
// Send), and DLPack deleters may be called from any thread.
unsafe impl Send for PendingDeleter {}

#[cfg_attr(not(feature = "python"), allow(dead_code))]
impl PendingDeleter {
    /// Calls the producer's deleter, on this thread.
    pub(crate) fn run(self) {
        // SAFETY: the struct came, live and owned, from a ManagedTensor being dropped; `self` is
        // consumed, so this is the one call.
        unsafe { self.0.delete() }
    }
}

/// Where a [`ManagedTensor`]'s foreign deleter runs when it is dropped: a function that either
/// runs the [`PendingDeleter`] (at once or later, on any thread) or leaks it. A layer that knows
/// when a producer's deleter may block installs one (the Python layer: deleters that may take
/// the GIL must not run on a thread without it while another thread may wait for this one).
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) type DeleterGate = fn(PendingDeleter);

/// An owned, validated DLPack tensor (legacy or versioned), whose producer's deleter runs exactly
/// once, on drop.
///
/// It is made from a raw pointer ([`ManagedTensor::from_raw_versioned`],
/// [`ManagedTensor::from_raw_legacy`]), from Rust storage ([`ManagedTensor::from_vec`] and the
/// other constructors of the export module), or by the Python layer. All accessors are safe: the
/// fields were validated on entry.
///
/// ```
/// use dlbridge::{DataType, Device, ManagedTensor};
/// let t = ManagedTensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
/// assert_eq!(t.shape(), &[2, 3]);
/// assert_eq!(t.strides(), &[3, 1]);
/// assert_eq!((t.dtype(), t.device()), (DataType::FLOAT32, Device::CPU));
/// assert_eq!(t.as_slice::<f32>().unwrap()[4], 5.0);
/// ```
pub struct ManagedTensor {
    raw: Raw,
    /// Compact row-major strides materialised for producers that sent NULL strides.
    own_strides: Option<Box<[i64]>>,
    /// The flags in force for this handle (for legacy tensors, what this side decided).
    flags: Flags,
    numel: u64,
    /// Where the deleter runs on drop (`None`: at once, on the dropping thread).
    gate: Option<DeleterGate>,
}

// SAFETY: a ManagedTensor owns its struct exclusively; the metadata it reads is immutable after
// validation, and DLPack deleters may be called from any thread (a deleter that may block there,
// such as one taking the GIL, is routed through a gate by the layer that knows it: see
// `with_deleter_gate`). Writes through the data pointer need `&mut self` or `unsafe`.
unsafe impl Send for ManagedTensor {}
// SAFETY: `&self` methods only read immutable metadata and hand out shared slices.
unsafe impl Sync for ManagedTensor {}

impl ManagedTensor {
    /// Takes ownership of a versioned managed tensor after validating it.
    ///
    /// On any refusal the producer's deleter has been called (exactly once) before the error is
    /// returned; a NULL pointer is refused with [`Error::NullTensor`] and nothing to delete.
    ///
    /// # Safety
    ///
    /// `ptr` is NULL or points to a live `DLManagedTensorVersioned` (of any major version) whose
    /// ownership passes to this call. If its major version is 1, its `shape` and `strides`
    /// pointers are NULL or point to `ndim` readable `i64`s while the tensor lives.
    // Inlined into each caller, so the fast check's `Ok` is not returned through memory (the hot
    // paths go further and call `take_if_common` first, see there).
    #[inline(always)]
    pub unsafe fn from_raw_versioned(ptr: *mut DLManagedTensorVersioned) -> Result<Self> {
        let Some(p) = NonNull::new(ptr) else { return Err(Error::NullTensor) };
        let raw = Raw::Versioned(p);
        // SAFETY: the caller promises a live struct; `version` is in the frozen prefix.
        let (version, flags) = unsafe { ((*ptr).version, (*ptr).flags) };
        let checked = if version.major == 1 {
            // SAFETY: a major-1 struct has the 1.x layout, so `dl_tensor` is where we read it.
            unsafe { Self::validate(raw, &(*ptr).dl_tensor, Flags(flags)) }
        } else {
            Err(Error::UnsupportedVersion { major: version.major, minor: version.minor })
        };
        checked.inspect_err(|_| {
            // SAFETY: we own the struct and refuse it, so we delete it, once.
            unsafe { raw.delete() }
        })
    }

    /// [`ManagedTensor::from_raw_versioned`] for the common tensor only (see [`fast_accept`]):
    /// `Some` takes ownership; `None` takes nothing and the caller goes on with
    /// `from_raw_versioned`, which accepts or names the failure. The hot import paths call this
    /// first: an `Option<ManagedTensor>` stays in registers, while a `Result<ManagedTensor, Error>`
    /// merged from the fast and the general path was copied piecewise through the stack and read
    /// back whole (a store-forwarding stall, the largest cost perf showed in a torch import).
    ///
    /// # Safety
    ///
    /// As for [`ManagedTensor::from_raw_versioned`], with `ptr` non-NULL.
    #[inline(always)]
    pub(crate) unsafe fn take_if_common(ptr: NonNull<DLManagedTensorVersioned>) -> Option<Self> {
        let p = ptr.as_ptr();
        // SAFETY: the caller's promise: a live struct; `version` and `flags` are in the prefix.
        let (version, flags) = unsafe { ((*p).version, Flags((*p).flags)) };
        if version.major != 1 {
            return None;
        }
        // SAFETY: a major-1 struct has the 1.x layout; the caller's promise about shape/strides.
        let numel = unsafe { fast_accept(&(*p).dl_tensor, flags) }?;
        Some(Self { raw: Raw::Versioned(ptr), own_strides: None, flags, numel, gate: None })
    }

    /// Takes ownership of a legacy (pre-1.0) managed tensor after validating it. Its flags start
    /// empty: a legacy tensor cannot say whether it is read-only (see
    /// [`ManagedTensor::into_read_only`]).
    ///
    /// On any refusal the producer's deleter has been called (exactly once).
    ///
    /// # Safety
    ///
    /// `ptr` is NULL or points to a live `DLManagedTensor` whose ownership passes to this call,
    /// and whose `shape` and `strides` pointers are NULL or point to `ndim` readable `i64`s while
    /// the tensor lives. A legacy struct cannot say read-only, so the result is writable: the
    /// memory must be writable by this side, or the caller must call
    /// [`ManagedTensor::into_read_only`] on the result before any mutable access.
    pub unsafe fn from_raw_legacy(ptr: *mut DLManagedTensor) -> Result<Self> {
        let Some(p) = NonNull::new(ptr) else { return Err(Error::NullTensor) };
        let raw = Raw::Legacy(p);
        // SAFETY: the caller promises a live legacy struct.
        unsafe { Self::validate(raw, &(*ptr).dl_tensor, Flags::NONE) }.inspect_err(|_| {
            // SAFETY: we own the struct and refuse it, so we delete it, once.
            unsafe { raw.delete() }
        })
    }

    /// A non-owning handle over a plain `DLTensor` that someone else keeps alive, validated like
    /// any foreign tensor. Crate-private: only [`crate::python::TensorView`] makes one, and never
    /// lets it out by value.
    ///
    /// # Safety
    ///
    /// `t` and everything it points to stay valid and unmoved while the result lives.
    #[cfg(feature = "python")]
    pub(crate) unsafe fn borrowed(t: NonNull<DLTensor>, flags: Flags) -> Result<Self> {
        // SAFETY: the caller's promise; nothing to delete on refusal.
        unsafe { Self::validate(Raw::Borrowed(t), t.as_ref(), flags) }
    }

    /// [`ManagedTensor::borrowed`] for the common tensor only (see [`fast_accept`]): `None` when
    /// the general checks must decide. An `Option` stays in registers where the `Result` of
    /// `borrowed` is copied through the stack and read back whole (a store-forwarding stall perf
    /// showed on every view), as for [`ManagedTensor::take_if_common`].
    ///
    /// # Safety
    ///
    /// As for [`ManagedTensor::borrowed`].
    #[cfg(feature = "python")]
    #[inline(always)]
    pub(crate) unsafe fn borrowed_if_common(t: NonNull<DLTensor>, flags: Flags) -> Option<Self> {
        // SAFETY: the caller's promise.
        let numel = unsafe { fast_accept(t.as_ref(), flags) }?;
        Some(Self { raw: Raw::Borrowed(t), own_strides: None, flags, numel, gate: None })
    }

    /// Checks every field of `t`; the caller deletes `raw` on error.
    ///
    /// # Safety
    ///
    /// `t` belongs to `raw`, and its shape/strides pointers are NULL or point to `ndim` `i64`s.
    #[inline(always)]
    unsafe fn validate(raw: Raw, t: &DLTensor, flags: Flags) -> Result<Self> {
        // SAFETY: the caller's promise, passed on.
        if let Some(numel) = unsafe { fast_accept(t, flags) } {
            return Ok(Self { raw, own_strides: None, flags, numel, gate: None });
        }
        // SAFETY: the caller's promise, passed on.
        unsafe { Self::validate_general(raw, t, flags) }
    }

    /// Every check, each failure named: the path for whatever [`fast_accept`] does not accept.
    ///
    /// # Safety
    ///
    /// As for [`ManagedTensor::validate`].
    #[inline(never)]
    unsafe fn validate_general(raw: Raw, t: &DLTensor, flags: Flags) -> Result<Self> {
        // SAFETY: the caller's promise about the shape and strides pointers.
        let (shape, given_strides) = unsafe { dims_of(t) }?;
        let dtype = DataType::from(t.dtype);
        dtype.validate()?;
        if !t.device.device_type.is_known() {
            return Err(Error::UnknownDeviceType { device_type: t.device.device_type.0 });
        }
        let numel = layout::element_count(shape)?;
        let own_strides = match given_strides {
            None if !shape.is_empty() => Some(layout::c_strides(shape).into_boxed_slice()),
            _ => None,
        };
        let strides = match (&own_strides, given_strides) {
            (Some(s), _) => s,
            (None, s) => s.unwrap_or(&[]),
        };
        let data = t.data as usize;
        // (let-else rather than ok_or: an Error built eagerly is also dropped on the hot path.)
        let Some(start) = usize::try_from(t.byte_offset).ok().and_then(|off| data.checked_add(off)) else {
            return Err(Error::ByteOffsetOverflow { data, byte_offset: t.byte_offset });
        };
        if numel > 0 {
            if t.data.is_null() {
                return Err(Error::NullData { numel });
            }
            let bits = dtype.storage_bits(flags.is_subbyte_padded());
            let (lo, hi) = layout::byte_span(shape, strides, bits)?;
            let in_space = start.checked_add_signed(lo).is_some() && start.checked_add_signed(hi).is_some();
            if !in_space {
                return Err(Error::SpanOverflow { shape: shape.to_vec(), strides: strides.to_vec() });
            }
        }
        Ok(Self { raw, own_strides, flags, numel, gate: None })
    }

    /// The plain tensor description.
    #[inline]
    pub fn dl_tensor(&self) -> &DLTensor {
        // SAFETY: the struct is live and owned by self until drop.
        unsafe {
            match self.raw {
                Raw::Legacy(p) => &(*p.as_ptr()).dl_tensor,
                Raw::Versioned(p) => &(*p.as_ptr()).dl_tensor,
                Raw::Borrowed(p) => p.as_ref(),
            }
        }
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.dl_tensor().ndim as usize
    }

    /// The extents.
    #[inline]
    pub fn shape(&self) -> &[i64] {
        let t = self.dl_tensor();
        // SAFETY: validated on entry: `ndim` entries, non-NULL when ndim > 0.
        unsafe { dims(t.shape, t.ndim as usize) }
    }

    /// The strides, in elements; materialised as compact row-major when the producer sent NULL.
    pub fn strides(&self) -> &[i64] {
        if let Some(s) = &self.own_strides {
            return s;
        }
        let t = self.dl_tensor();
        // SAFETY: validated on entry: `ndim` entries, non-NULL when ndim > 0 (else own_strides).
        unsafe { dims(t.strides, t.ndim as usize) }
    }

    /// Whether the producer sent NULL strides (compact row-major, allowed before DLPack 1.2).
    pub fn had_null_strides(&self) -> bool {
        self.own_strides.is_some()
    }

    /// The element type.
    #[inline]
    pub fn dtype(&self) -> DataType {
        DataType::from(self.dl_tensor().dtype)
    }

    /// The device.
    #[inline]
    pub fn device(&self) -> Device {
        Device::from(self.dl_tensor().device)
    }

    /// The flags in force: the producer's for versioned tensors, plus read-only if this side set
    /// it with [`ManagedTensor::into_read_only`].
    pub fn flags(&self) -> Flags {
        self.flags
    }

    /// Whether writing through the data is forbidden.
    pub fn is_read_only(&self) -> bool {
        self.flags.is_read_only()
    }

    /// The producer's ABI version, `None` for a legacy tensor.
    pub fn version(&self) -> Option<Version> {
        match self.raw {
            Raw::Legacy(_) | Raw::Borrowed(_) => None,
            // SAFETY: the struct is live.
            Raw::Versioned(p) => Some(Version::from(unsafe { (*p.as_ptr()).version })),
        }
    }

    /// Whether this handle owns a versioned (1.x) struct.
    pub fn is_versioned(&self) -> bool {
        matches!(self.raw, Raw::Versioned(_))
    }

    /// The byte offset the producer put between `data` and the first element.
    pub fn byte_offset(&self) -> u64 {
        self.dl_tensor().byte_offset
    }

    /// The address of the first element: `data + byte_offset`. For non-host devices this is a
    /// device address (or handle) and must not be dereferenced on the CPU.
    #[inline]
    pub fn data_ptr(&self) -> *mut c_void {
        let t = self.dl_tensor();
        // Validated not to overflow; wrapping_add because the pointer may not be a Rust allocation.
        t.data.cast::<u8>().wrapping_add(t.byte_offset as usize).cast()
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.numel as usize
    }

    /// Bytes the elements would take if compact (packed sub-byte types share bytes): exact, as a
    /// `u128`, since a tensor with zero strides may have more elements than its memory could hold
    /// compact (2^62 broadcast float64s take 2^65 bytes).
    pub fn nbytes(&self) -> u128 {
        let bits = self.dtype().storage_bits(self.flags.is_subbyte_padded());
        (u128::from(self.numel) * u128::from(bits)).div_ceil(8)
    }

    /// Whether the elements are compact in row-major order.
    pub fn is_c_contiguous(&self) -> bool {
        layout::is_c_contiguous(self.shape(), self.strides())
    }

    /// Whether the elements are compact in column-major order.
    pub fn is_f_contiguous(&self) -> bool {
        layout::is_f_contiguous(self.shape(), self.strides())
    }

    /// This tensor, marked read-only (for a legacy tensor whose writability is unknown, or to hand
    /// out a view that must not be written). Nothing safe makes it writable again (a legacy tensor
    /// given up by [`ManagedTensor::into_raw`] loses the mark, since the struct cannot carry it:
    /// taking it back in is `unsafe` and says so).
    pub fn into_read_only(mut self) -> Self {
        self.flags |= Flags::READ_ONLY;
        self
    }

    /// This tensor with `extra` flags set too (IS_COPIED for a copy made on this side).
    #[cfg(feature = "python")]
    pub(crate) fn with_flags(mut self, extra: Flags) -> Self {
        self.flags |= extra;
        self
    }

    /// This tensor with its deleter routed through `gate` when it is dropped (refusals during
    /// validation happened before, on the importing thread).
    #[cfg_attr(not(feature = "python"), allow(dead_code))]
    #[inline]
    pub(crate) fn with_deleter_gate(mut self, gate: DeleterGate) -> Self {
        self.gate = Some(gate);
        self
    }

    /// This tensor with its deleter run on the dropping thread again, whichever it is (for a
    /// tensor handed to a consumer, which decides where it frees what it owns).
    #[cfg_attr(not(feature = "python"), allow(dead_code))]
    #[inline]
    pub(crate) fn without_deleter_gate(mut self) -> Self {
        self.gate = None;
        self
    }

    /// Gives up ownership without calling the deleter, returning the raw pointer. The caller
    /// becomes responsible for calling the deleter exactly once. For a versioned tensor, flags
    /// set on this side (read-only) are written into the struct first.
    pub fn into_raw(mut self) -> RawManagedTensor {
        // Strides materialised on this side are only a cache: the struct still says NULL.
        drop(self.own_strides.take());
        let out = match self.raw {
            Raw::Legacy(p) => RawManagedTensor::Legacy(p.as_ptr()),
            Raw::Borrowed(_) => unreachable!("a borrowed tensor is never held by value outside TensorView"),
            Raw::Versioned(p) => {
                // SAFETY: we own the live struct until this very moment.
                unsafe { (*p.as_ptr()).flags = self.flags.0 };
                RawManagedTensor::Versioned(p.as_ptr())
            }
        };
        std::mem::forget(self);
        out
    }

    /// A description for error messages: `float64 shape (3, 4) strides (1, 3) on cuda:0`.
    pub fn describe(&self) -> String {
        let ro = if self.is_read_only() { " (read-only)" } else { "" };
        format!(
            "{} shape {} strides {} on {}{ro}",
            self.dtype(),
            tuple(self.shape()),
            tuple(self.strides()),
            self.device()
        )
    }

    /// Whether the CPU may read this tensor's memory.
    pub fn is_host_accessible(&self) -> bool {
        self.device().device_type().is_host_accessible()
    }
}

impl Drop for ManagedTensor {
    fn drop(&mut self) {
        match self.gate {
            // The gate runs or leaks it; either way this handle never touches it again.
            Some(gate) => gate(PendingDeleter(self.raw)),
            // SAFETY: we own the live struct; drop runs once.
            None => unsafe { self.raw.delete() },
        }
    }
}

impl fmt::Debug for ManagedTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManagedTensor")
            .field("dtype", &self.dtype())
            .field("shape", &self.shape())
            .field("strides", &self.strides())
            .field("device", &self.device())
            .field("data_ptr", &self.data_ptr())
            .field("flags", &self.flags)
            .field("version", &self.version())
            .finish()
    }
}

/// A raw managed-tensor pointer given up by [`ManagedTensor::into_raw`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawManagedTensor {
    /// A legacy `DLManagedTensor` (for `"dltensor"` capsules).
    Legacy(*mut DLManagedTensor),
    /// A `DLManagedTensorVersioned` (for `"dltensor_versioned"` capsules).
    Versioned(*mut DLManagedTensorVersioned),
}

/// The common case, accepted in one pass over the dims: 1 to 8 dimensions, every extent positive,
/// explicit aligned strides, a known device, a valid dtype of whole bytes, non-NULL data, and a
/// byte range that fits the address space. Returns the element count; `None` means "not shown
/// valid here", and the caller runs the general checks, which accept or name the failure. It
/// never accepts what the general path refuses (property-tested below), and it saves about half
/// of the validation cost of a typical import.
///
/// # Safety
///
/// As for [`ManagedTensor::validate`]: shape and strides are NULL or point to `ndim` `i64`s.
#[inline(always)]
unsafe fn fast_accept(t: &DLTensor, flags: Flags) -> Option<u64> {
    if !(1..=8).contains(&t.ndim)
        || t.shape.is_null()
        || t.strides.is_null()
        || !t.shape.is_aligned()
        || !t.strides.is_aligned()
        || t.data.is_null()
        || !t.device.device_type.is_known()
    {
        return None;
    }
    let dtype = DataType::from(t.dtype);
    if !dtype.is_valid() {
        return None;
    }
    let bits = dtype.storage_bits(flags.is_subbyte_padded());
    if bits == 0 || bits % 8 != 0 {
        return None;
    }
    let item = i64::try_from(bits / 8).ok()?;
    let n = t.ndim as usize;
    // SAFETY: non-NULL and aligned (checked), `ndim` entries (the caller's promise).
    let (shape, strides) =
        unsafe { (std::slice::from_raw_parts(t.shape, n), std::slice::from_raw_parts(t.strides, n)) };
    let (mut numel, mut lo, mut hi) = (1i64, 0i64, 0i64);
    for (&d, &s) in shape.iter().zip(strides) {
        if d <= 0 {
            return None;
        }
        numel = numel.checked_mul(d)?;
        let reach = (d - 1).checked_mul(s)?;
        if reach < 0 {
            lo = lo.checked_add(reach)?;
        } else {
            hi = hi.checked_add(reach)?;
        }
    }
    let numel = isize::try_from(numel).ok()?;
    let start_byte = isize::try_from(lo.checked_mul(item)?).ok()?;
    let end_byte = isize::try_from(hi.checked_add(1)?.checked_mul(item)?).ok()?;
    end_byte.checked_sub(start_byte)?;
    let start = (t.data as usize).checked_add(usize::try_from(t.byte_offset).ok()?)?;
    start.checked_add_signed(start_byte)?;
    start.checked_add_signed(end_byte)?;
    Some(numel as u64)
}

/// The shape and strides of `t` (strides `None` when NULL, meaning C order), after the checks that
/// make reading them sound: `ndim` in range, shape non-NULL, both pointers aligned.
///
/// # Safety
///
/// `t`'s shape and strides pointers are NULL or point to `ndim` `i64`s that outlive the result.
pub(crate) unsafe fn dims_of(t: &DLTensor) -> Result<(&[i64], Option<&[i64]>)> {
    let ndim = usize::try_from(t.ndim)
        .ok()
        .filter(|&n| n <= MAX_NDIM)
        .ok_or_else(|| Error::InvalidNdim { ndim: i64::from(t.ndim), max: MAX_NDIM })?;
    if ndim == 0 {
        return Ok((&[], None));
    }
    if t.shape.is_null() {
        return Err(Error::NullShape { ndim: t.ndim });
    }
    // (Both at once: a NULL strides is aligned.)
    if (t.shape as usize | t.strides as usize) % std::mem::align_of::<i64>() != 0 {
        let (field, p) = if t.shape.is_aligned() { ("strides", t.strides) } else { ("shape", t.shape) };
        return Err(Error::MisalignedPointer { field, address: p as usize });
    }
    // SAFETY: non-NULL and aligned (checked), `ndim` entries long (the caller's promise).
    let shape = unsafe { dims(t.shape, ndim) };
    // SAFETY: as for shape when non-NULL.
    let strides = (!t.strides.is_null()).then(|| unsafe { dims(t.strides, ndim) });
    Ok((shape, strides))
}

/// `ndim` entries at `p`, or an empty slice when `ndim == 0` (where `p` may be NULL).
///
/// # Safety
///
/// When `ndim > 0`, `p` is non-NULL, aligned and points to `ndim` `i64`s that outlive the result.
unsafe fn dims<'a>(p: *const i64, ndim: usize) -> &'a [i64] {
    if ndim == 0 {
        &[]
    } else {
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts(p, ndim) }
    }
}

// What a kernel's stated requirements ([`crate::spec`]) ask of a tensor, and how a refusal reads.

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "expected {}, got ", self.expected)?;
        write_found(
            f,
            (self.dtype, &self.shape, &self.strides, self.device),
            self.read_only && self.expected.writable,
            self.field == Field::Writable && !self.read_only,
        )
    }
}

/// What a refusal says it got: `read-only float32 (3, 4) strides (1, 3) on cpu` (the read-only
/// mark where writing was asked; strides only where they are not the compact row-major ones). The
/// one wording of every typed refusal: typed arguments, the untyped accessors, the bridges' views.
fn write_found(
    f: &mut fmt::Formatter<'_>,
    (dtype, shape, strides, device): (DataType, &[i64], &[i64], Device),
    read_only: bool,
    overlap: bool,
) -> fmt::Result {
    if read_only {
        f.write_str("read-only ")?;
    }
    write!(f, "{dtype} {}", tuple(shape))?;
    if !crate::layout::is_c_contiguous(shape, strides) {
        write!(f, " strides {}", tuple(strides))?;
        if overlap {
            f.write_str(" (elements overlap)")?;
        }
    }
    write!(f, " on {device}")
}

impl ManagedTensor {
    /// This tensor as a refusal words what it got ([`Mismatch`]'s words), the read-only mark
    /// shown where `writing` was asked.
    pub(crate) fn found(&self, writing: bool) -> String {
        struct Found<'a>(&'a ManagedTensor, bool);
        impl fmt::Display for Found<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let t = self.0;
                write_found(
                    f,
                    (t.dtype(), t.shape(), t.strides(), t.device()),
                    self.1 && t.is_read_only(),
                    false,
                )
            }
        }
        Found(self, writing).to_string()
    }
}

impl ManagedTensor {
    /// Checks this tensor against `spec` in one pass: [`Error::Mismatch`] names the first field
    /// that failed (dtype, rank, extents, device, order, writability, in that order).
    #[inline]
    pub fn check(&self, spec: &Spec) -> Result<()> {
        match self.first_failure(spec) {
            None => Ok(()),
            Some(field) => Err(self.mismatch(spec, field)),
        }
    }

    /// The first field of `spec` this tensor fails, if any (no allocation).
    #[inline(always)]
    pub(crate) fn first_failure(&self, spec: &Spec) -> Option<Field> {
        first_failure_of(
            spec,
            self.dtype(),
            self.shape(),
            self.device(),
            || self.is_c_contiguous(),
            || self.is_f_contiguous(),
            || self.is_writable(),
        )
    }

    /// Whether typed mutable access may be given: not read-only, and no two elements may share
    /// memory.
    pub(crate) fn is_writable(&self) -> bool {
        !self.is_read_only()
            && (self.numel() <= 1 || !crate::layout::may_overlap(self.shape(), self.strides()))
    }

    #[cold]
    #[inline(never)]
    fn mismatch(&self, spec: &Spec, field: Field) -> Error {
        Error::Mismatch(Box::new(Mismatch {
            field,
            expected: *spec,
            dtype: self.dtype(),
            shape: self.shape().to_vec(),
            strides: self.strides().to_vec(),
            device: self.device(),
            read_only: self.is_read_only(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::{DLDataType, DLDevice, DLDeviceType};
    use proptest::prelude::*;

    fn tensor(
        data: usize,
        offset: u64,
        dtype: (u8, u8, u16),
        shape: &mut [i64],
        strides: &mut [i64],
    ) -> DLTensor {
        DLTensor {
            data: data as *mut std::ffi::c_void,
            device: DLDevice { device_type: DLDeviceType::CPU, device_id: 0 },
            ndim: shape.len() as i32,
            dtype: DLDataType { code: crate::ffi::DLDataTypeCode(dtype.0), bits: dtype.1, lanes: dtype.2 },
            shape: shape.as_mut_ptr(),
            strides: strides.as_mut_ptr(),
            byte_offset: offset,
        }
    }

    proptest! {
        /// Whatever the one-pass check accepts, the general checks accept too, with the same count.
        #[test]
        fn fast_accept_never_accepts_what_the_general_path_refuses(
            data in prop_oneof![Just(0usize), Just(64usize), Just(usize::MAX - 64), any::<usize>()],
            offset in prop_oneof![Just(0u64), any::<u64>()],
            dtype in prop_oneof![Just((2u8, 32u8, 1u16)), Just((0u8, 8u8, 1u16)), Just((5u8, 64u8, 1u16)), (0u8..=20, any::<u8>(), 0u16..=4)],
            dims in proptest::collection::vec(
                (prop_oneof![-2i64..=5, Just(i64::MAX), Just(1i64 << 40)], prop_oneof![-8i64..=8, Just(i64::MAX), Just(i64::MIN)]),
                0..=9,
            ),
        ) {
            let (mut shape, mut strides): (Vec<i64>, Vec<i64>) = dims.into_iter().unzip();
            let t = tensor(data, offset, dtype, &mut shape, &mut strides);
            // SAFETY: shape and strides point to ndim entries that outlive the calls.
            let fast = unsafe { fast_accept(&t, Flags::NONE) };
            if let Some(numel) = fast {
                let p = NonNull::from(&t);
                // SAFETY: as above; a borrowed tensor deletes nothing.
                let general = unsafe { ManagedTensor::validate_general(Raw::Borrowed(p), &t, Flags::NONE) };
                prop_assert_eq!(general.map(|m| m.numel).ok(), Some(numel));
            }
        }
    }

    /// Deleters handed to [`queue_gate`], run by the test.
    static GATED: std::sync::Mutex<Vec<PendingDeleter>> = std::sync::Mutex::new(Vec::new());

    fn queue_gate(d: PendingDeleter) {
        GATED.lock().unwrap().push(d);
    }

    #[test]
    fn a_gated_deleter_runs_when_the_gate_runs_it_and_only_then() {
        let data: std::sync::Arc<[f32]> = vec![1.0f32, 2.0, 3.0].into();
        let t = ManagedTensor::from_host(data.clone(), &[3]).unwrap().with_deleter_gate(queue_gate);
        assert_eq!(std::sync::Arc::strong_count(&data), 2);
        // Dropped on another thread: the gate takes the deleter; nothing is freed yet.
        std::thread::spawn(move || drop(t)).join().unwrap();
        assert_eq!(std::sync::Arc::strong_count(&data), 2);
        let pending = std::mem::take(&mut *GATED.lock().unwrap());
        assert_eq!(pending.len(), 1);
        for d in pending {
            d.run();
        }
        assert_eq!(std::sync::Arc::strong_count(&data), 1);
        // Without a gate the deleter runs on drop, as before.
        drop(ManagedTensor::from_host(data.clone(), &[3]).unwrap());
        assert_eq!(std::sync::Arc::strong_count(&data), 1);
    }

    #[test]
    fn fast_accept_takes_the_common_case() {
        let (mut shape, mut strides) = (vec![2i64, 3], vec![3i64, 1]);
        let t = tensor(4096, 0, (2, 32, 1), &mut shape, &mut strides);
        // SAFETY: shape and strides point to ndim entries that outlive the call.
        assert_eq!(unsafe { fast_accept(&t, Flags::NONE) }, Some(6));
        let (mut shape, mut strides) = (vec![2i64, 0], vec![3i64, 1]);
        let t = tensor(4096, 0, (2, 32, 1), &mut shape, &mut strides);
        // SAFETY: as above. An empty tensor goes the general way.
        assert_eq!(unsafe { fast_accept(&t, Flags::NONE) }, None);
    }
}
