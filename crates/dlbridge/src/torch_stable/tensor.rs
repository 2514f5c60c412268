//! [`Tensor`]: an owning `AtenTensorHandle`, read through the stable accessors.

use std::ffi::c_void;
use std::fmt;
use std::ptr::NonNull;

use super::sys::{AtenTensorHandle, BlobDeleter};
use super::{Error, Result, Torch};
use crate::DataType;
use crate::managed::MAX_NDIM;

/// A torch device type, as this module names the codes torch gave at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// `cpu`.
    Cpu,
    /// `cuda`.
    Cuda,
    /// `meta` (no memory: shapes only, what fake tensors and `torch.compile` trace with).
    Meta,
    /// Another torch device type code.
    Other(i32),
}

/// A torch device: its type and index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TorchDevice {
    /// The device type.
    pub kind: DeviceKind,
    /// The index (-1: none, as torch says of the CPU; or "the current one" where torch allows it).
    pub index: i32,
}

impl TorchDevice {
    /// The CPU.
    pub const CPU: Self = Self { kind: DeviceKind::Cpu, index: -1 };
    /// The meta device.
    pub const META: Self = Self { kind: DeviceKind::Meta, index: -1 };
}

/// An owning `AtenTensorHandle` (a new reference to a torch tensor), deleted exactly once when
/// dropped (`aoti_torch_delete_tensor_object`). What a kernel gets for a `Tensor` argument and
/// hands back as an output ([`Tensor::into_raw`]). `Send` (torch's reference count is atomic), not
/// `Sync`.
pub struct Tensor {
    handle: NonNull<super::sys::AtenTensorOpaque>,
    torch: &'static Torch,
    _not_sync: std::marker::PhantomData<std::cell::Cell<()>>,
}

// SAFETY: the handle is an `at::Tensor*` owned by this value alone; torch's TensorImpl reference
// count is atomic, so the handle may be used and deleted on any thread.
unsafe impl Send for Tensor {}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Tensor");
        d.field("handle", &self.handle);
        if let (Ok(shape), Ok(dtype)) = (self.sizes(), self.dtype_code()) {
            d.field("sizes", &shape).field("dtype_code", &dtype);
        }
        d.finish()
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        if let Some(delete) = self.torch.syms.aoti_torch_delete_tensor_object {
            // SAFETY: an owning handle (the type's invariant), deleted once, here. Its error code
            // cannot be acted on in a destructor (torch only fails it for a NULL handle).
            unsafe { delete(self.handle.as_ptr()) };
        }
    }
}

/// Calls accessor `$f` of `$t` into a fresh `$ty` and checks the error code.
macro_rules! get {
    ($t:expr, $f:ident, $ty:ty) => {{
        let t: &Tensor = $t;
        let f = t.torch.need(t.torch.syms.$f, stringify!($f))?;
        let mut out: $ty = Default::default();
        // SAFETY: a live owning handle (the type's invariant) and a place for the result.
        let code = unsafe { f(t.handle.as_ptr(), &mut out) };
        t.torch.check(code, stringify!($f))?;
        out
    }};
}

#[cold]
fn negative_extent(d: i64, sizes: &[i64]) -> Error {
    Error::Invalid(format!("sizes: negative extent {d} in {sizes:?}"))
}

impl Tensor {
    /// Takes ownership of `handle` (`None` for NULL).
    ///
    /// # Safety
    ///
    /// `handle` is NULL or an owning `AtenTensorHandle` of `torch`'s libtorch that nothing else
    /// will delete (a kernel's input, the result of a function returning a new reference).
    pub unsafe fn from_raw(torch: &'static Torch, handle: AtenTensorHandle) -> Option<Self> {
        NonNull::new(handle).map(|handle| Self { handle, torch, _not_sync: std::marker::PhantomData })
    }

    /// Gives the owning handle up (to torch: a kernel's output, a dispatcher argument).
    pub fn into_raw(self) -> AtenTensorHandle {
        let h = self.handle.as_ptr();
        std::mem::forget(self);
        h
    }

    /// The handle, still owned by this value (for a torch call that borrows it).
    pub fn as_raw(&self) -> AtenTensorHandle {
        self.handle.as_ptr()
    }

    /// The torch this tensor belongs to.
    pub fn torch(&self) -> &'static Torch {
        self.torch
    }

    /// A new owning handle to the same tensor (`aoti_torch_new_tensor_handle`): how a kernel
    /// returns an alias of an input.
    pub fn new_handle(&self) -> Result<Tensor> {
        let f =
            self.torch.need(self.torch.syms.aoti_torch_new_tensor_handle, "aoti_torch_new_tensor_handle")?;
        let mut out: AtenTensorHandle = std::ptr::null_mut();
        // SAFETY: a live handle and a place for the new one.
        let code = unsafe { f(self.handle.as_ptr(), &mut out) };
        self.torch.check(code, "aoti_torch_new_tensor_handle")?;
        // SAFETY: a new owning handle from torch (or NULL, refused below).
        unsafe { Tensor::from_raw(self.torch, out) }.ok_or_else(|| null("aoti_torch_new_tensor_handle"))
    }

    /// The first element's address (storage offset applied; NULL for an empty or meta tensor).
    /// Reading or writing through it is the caller's `unsafe`.
    pub fn data_ptr(&self) -> Result<*mut c_void> {
        Ok(get!(self, aoti_torch_get_data_ptr, *mut c_void))
    }

    /// The number of dimensions.
    pub fn dim(&self) -> Result<usize> {
        let d = get!(self, aoti_torch_get_dim, i64);
        usize::try_from(d).map_err(|_| Error::Invalid(format!("dim: torch reported {d}")))
    }

    /// The number of elements.
    pub fn numel(&self) -> Result<i64> {
        Ok(get!(self, aoti_torch_get_numel, i64))
    }

    /// The extents, copied.
    pub fn sizes(&self) -> Result<Vec<i64>> {
        // SAFETY: copied at once, before anything else runs on this thread.
        Ok(unsafe { self.sizes_borrowed() }?.to_vec())
    }

    /// The strides in elements, copied.
    pub fn strides(&self) -> Result<Vec<i64>> {
        // SAFETY: as in sizes().
        Ok(unsafe { self.strides_borrowed() }?.to_vec())
    }

    /// The extents, borrowed from the tensor (no copy).
    ///
    /// # Safety
    ///
    /// Nothing changes this tensor's metadata (`resize_`, `as_strided_`, `set_`, ...) through
    /// any handle while the slice lives: a kernel's arguments during the call, by torch's own rule
    /// (an op holds its arguments' metadata for the call; a `resize_` from another thread meanwhile
    /// is a data race inside torch itself, whatever dlbridge does).
    pub unsafe fn sizes_borrowed(&self) -> Result<&[i64]> {
        let p = get!(self, aoti_torch_get_sizes, *mut i64);
        // SAFETY: torch's array of dim() extents, alive while the metadata is unchanged (the
        // caller's contract).
        unsafe { self.array(p, "aoti_torch_get_sizes") }
    }

    /// The strides in elements, borrowed from the tensor.
    ///
    /// # Safety
    ///
    /// As [`sizes_borrowed`](Self::sizes_borrowed).
    pub unsafe fn strides_borrowed(&self) -> Result<&[i64]> {
        let p = get!(self, aoti_torch_get_strides, *mut i64);
        // SAFETY: as in sizes_borrowed().
        unsafe { self.array(p, "aoti_torch_get_strides") }
    }

    /// # Safety
    ///
    /// `p` is torch's array of `dim()` entries for this tensor, alive for the borrow.
    unsafe fn array(&self, p: *mut i64, what: &'static str) -> Result<&[i64]> {
        let n = self.dim()?;
        if n > MAX_NDIM {
            return Err(Error::Invalid(format!("{what}: {n} dimensions (at most {MAX_NDIM})")));
        }
        if n == 0 {
            return Ok(&[]);
        }
        if p.is_null() || !p.is_aligned() {
            return Err(null(what));
        }
        // SAFETY: non-NULL, aligned, `n` entries (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts(p, n) })
    }

    /// The storage offset, in elements.
    pub fn storage_offset(&self) -> Result<i64> {
        Ok(get!(self, aoti_torch_get_storage_offset, i64))
    }

    /// torch's dtype code.
    pub fn dtype_code(&self) -> Result<i32> {
        Ok(get!(self, aoti_torch_get_dtype, i32))
    }

    /// The element type ([`Error::Invalid`] naming the code for one DLPack lacks).
    pub fn dtype(&self) -> Result<DataType> {
        let code = self.dtype_code()?;
        self.torch
            .data_type(code)
            .ok_or_else(|| Error::Invalid(format!("dtype: torch dtype code {code} has no DLPack equivalent")))
    }

    /// The device.
    pub fn device(&self) -> Result<TorchDevice> {
        let kind = self.torch.device_kind(get!(self, aoti_torch_get_device_type, i32));
        Ok(TorchDevice { kind, index: get!(self, aoti_torch_get_device_index, i32) })
    }

    /// The device's kind (one call into torch; [`device`](Self::device) also reads the index).
    pub fn device_kind(&self) -> Result<DeviceKind> {
        Ok(self.torch.device_kind(get!(self, aoti_torch_get_device_type, i32)))
    }

    /// Whether the tensor is C-contiguous.
    pub fn is_contiguous(&self) -> Result<bool> {
        Ok(get!(self, aoti_torch_is_contiguous, bool))
    }

    /// Copies `src` into this tensor (`self.copy_(src)`: broadcasting and casting as torch does).
    /// torch writes the memory through its own op, as `x.copy_(src)` from Python would: like any
    /// torch operation, it is not seen by dlbridge's borrow registry (another library's write:
    /// ARCHITECTURE.md, "What the memory rule cannot cover"), so do not copy into a tensor whose
    /// memory a handler on another thread holds as a slice.
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        let f = self.torch.need(self.torch.syms.aoti_torch_copy_, "aoti_torch_copy_")?;
        // SAFETY: two live handles.
        let code = unsafe { f(self.handle.as_ptr(), src.handle.as_ptr(), 0) };
        self.torch.check(code, "aoti_torch_copy_")
    }
}

#[cold]
fn null(what: &'static str) -> Error {
    Error::Call { function: what, message: "returned NULL".into() }
}

impl Torch {
    /// A new uninitialised tensor (`aoti_torch_empty_strided`): extents `sizes`, strides
    /// `strides` (in elements), on `device`. On the meta device nothing is allocated.
    pub fn empty_strided(
        &'static self,
        sizes: &[i64],
        strides: &[i64],
        dtype: DataType,
        device: TorchDevice,
    ) -> Result<Tensor> {
        if sizes.len() != strides.len() {
            return Err(Error::Invalid(format!(
                "strides: {} strides for {} extents ({sizes:?}, {strides:?})",
                strides.len(),
                sizes.len()
            )));
        }
        if let Some(&d) = sizes.iter().find(|&&d| d < 0) {
            return Err(negative_extent(d, sizes));
        }
        self.empty_strided_checked(sizes, strides, dtype, device)
    }

    /// [`empty_strided`](Self::empty_strided) once its extents are known non-negative and its
    /// strides as many.
    fn empty_strided_checked(
        &'static self,
        sizes: &[i64],
        strides: &[i64],
        dtype: DataType,
        device: TorchDevice,
    ) -> Result<Tensor> {
        debug_assert!(sizes.len() == strides.len() && sizes.iter().all(|&d| d >= 0));
        let f = self.need(self.syms.aoti_torch_empty_strided, "aoti_torch_empty_strided")?;
        let (dtype, device_type) = (self.dtype_code(dtype)?, self.device_code(device.kind)?);
        let mut out: AtenTensorHandle = std::ptr::null_mut();
        // SAFETY: `sizes.len()` extents and strides (checked equal), codes torch gave, a place for
        // the new handle.
        let code = unsafe {
            f(
                sizes.len() as i64,
                sizes.as_ptr(),
                strides.as_ptr(),
                dtype,
                device_type,
                device.index,
                &mut out,
            )
        };
        self.check(code, "aoti_torch_empty_strided")?;
        // SAFETY: a new owning handle (torch's contract for empty_strided), NULL refused.
        unsafe { Tensor::from_raw(self, out) }.ok_or_else(|| null("aoti_torch_empty_strided"))
    }

    /// A new uninitialised C-contiguous tensor of `sizes`.
    pub fn empty(&'static self, sizes: &[i64], dtype: DataType, device: TorchDevice) -> Result<Tensor> {
        // Strides on the stack for the usual ranks (no allocation on a kernel's output path).
        let mut small = [0i64; 16];
        let mut big = Vec::new();
        let strides: &mut [i64] = if sizes.len() <= small.len() {
            &mut small[..sizes.len()]
        } else {
            big.resize(sizes.len(), 0);
            &mut big
        };
        if let Some(&d) = sizes.iter().find(|&&d| d < 0) {
            return Err(negative_extent(d, sizes));
        }
        crate::layout::c_strides_into(sizes, strides);
        self.empty_strided_checked(sizes, strides, dtype, device)
    }

    /// A new uninitialised C-contiguous tensor of `like`'s extents, dtype and device.
    pub fn empty_like_contiguous(&'static self, like: &Tensor) -> Result<Tensor> {
        // SAFETY: the sizes are read and copied at once, while the caller holds `like`; nothing
        // changes a tensor's metadata during an op that holds it (torch's rule: see
        // `sizes_borrowed`).
        let sizes = unsafe { like.sizes_borrowed() }?;
        self.empty(sizes, like.dtype()?, like.device()?)
    }

    /// A C-contiguous tensor equal to `t`: a new handle to `t` itself when it already is one,
    /// else a copy.
    pub fn contiguous(&'static self, t: &Tensor) -> Result<Tensor> {
        if t.is_contiguous()? {
            return t.new_handle();
        }
        let out = self.empty_like_contiguous(t)?;
        out.copy_from(t)?;
        Ok(out)
    }

    /// A tensor over foreign memory (`torch_from_blob`, torch 2.11+): `data` with extents `sizes`
    /// and `strides` (in elements) and `storage_offset`, on `device`; `deleter(data, ctx)` runs once
    /// when torch frees the last reference to the storage (any thread).
    ///
    /// # Safety
    ///
    /// `data` points to memory of that layout on `device`, valid (and not freed by anyone else)
    /// until the deleter runs; with no deleter, until the last reference goes. `deleter` may be
    /// called on any thread and must not unwind.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn from_blob(
        &'static self,
        data: *mut c_void,
        sizes: &[i64],
        strides: &[i64],
        storage_offset: i64,
        dtype: DataType,
        device: TorchDevice,
        deleter: Option<BlobDeleter>,
        ctx: *mut c_void,
    ) -> Result<Tensor> {
        if sizes.len() != strides.len() {
            return Err(Error::Invalid(format!(
                "strides: {} strides for {} extents",
                strides.len(),
                sizes.len()
            )));
        }
        let f = self.need(self.syms.torch_from_blob, "torch_from_blob")?;
        let (dtype, device_type) = (self.dtype_code(dtype)?, self.device_code(device.kind)?);
        let strided = self.need(self.syms.aoti_torch_layout_strided, "aoti_torch_layout_strided")?;
        // SAFETY: a getter of torch's stable ABI taking nothing.
        let strided = unsafe { strided() };
        let mut out: AtenTensorHandle = std::ptr::null_mut();
        // SAFETY: the layout arrays (checked equal lengths), codes torch gave, the strided layout,
        // no opaque metadata; the memory is the caller's contract.
        let code = unsafe {
            f(
                data,
                sizes.len() as i64,
                sizes.as_ptr(),
                strides.as_ptr(),
                storage_offset,
                dtype,
                device_type,
                device.index,
                &mut out,
                strided,
                std::ptr::null(),
                0,
                deleter,
                ctx,
            )
        };
        self.check(code, "torch_from_blob")?;
        // SAFETY: a new owning handle, NULL refused.
        unsafe { Tensor::from_raw(self, out) }.ok_or_else(|| null("torch_from_blob"))
    }
}

/// How a device is told between this module and torch (torch's codes, read at load).
impl Torch {
    fn device_kind(&self, code: i32) -> DeviceKind {
        if code == self.codes.cpu {
            DeviceKind::Cpu
        } else if Some(code) == self.codes.cuda {
            DeviceKind::Cuda
        } else if Some(code) == self.codes.meta {
            DeviceKind::Meta
        } else {
            DeviceKind::Other(code)
        }
    }

    fn device_code(&self, kind: DeviceKind) -> Result<i32> {
        match kind {
            DeviceKind::Cpu => Ok(self.codes.cpu),
            DeviceKind::Cuda => self.codes.cuda.ok_or_else(|| self.missing("aoti_torch_device_type_cuda")),
            DeviceKind::Meta => self.codes.meta.ok_or_else(|| self.missing("aoti_torch_device_type_meta")),
            DeviceKind::Other(c) => Ok(c),
        }
    }
}
