//! [`TensorView`]: a borrowed, non-owning view of a Python array for the duration of a call, with
//! no capsule and (for compact layouts of up to 8 dimensions) no allocation.
//!
//! Sources, fastest first: a `dlbridge.Tensor` (its own metadata), a type with the exchange API's
//! `dltensor_from_py_object_no_sync` (torch), the buffer protocol (numpy and every buffer
//! exporter), and otherwise an ordinary owned import.

use std::marker::PhantomData;
use std::ops::Deref;
use std::ptr::NonNull;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::device::Device;
use crate::dims::Dims;
use crate::ffi::DLTensor;
use crate::flags::Flags;
use crate::managed::ManagedTensor;
use crate::python::import::{ImportOptions, from_dlpack_with};
use crate::python::runtime::HeldBuffer;
use crate::python::runtime::Tensor;
use crate::spec::Spec;

/// Where a view's tensor, the borrowed `DLTensor` it describes and the dims that points into live
/// while the view exists: one heap block, so the addresses stay put when the view moves, and the
/// view itself is two pointers (a view returned through a `#[pyfunction]`'s argument conversion
/// is copied out of each result on the way: a larger one was written piecewise and read back
/// whole, a store-forwarding stall per hop). The view holds it as a raw pointer (a `Box` moved
/// after the `DLTensor` pointed into it would be retagged as unique).
struct Borrow {
    /// The view's tensor: `Some` from the view's construction to its drop (a borrowed one points
    /// at `tensor` below; an owned import holds its own export), `None` in a spare block.
    managed: Option<ManagedTensor>,
    tensor: DLTensor,
    dims: Dims,
    buffer: Option<HeldBuffer>,
    /// torch's state accessors when the view came through torch's exchange table: its rule on
    /// in-place writes is checked when mutable access is asked for. (Here rather than in the
    /// view, which every numpy argument builds and returns: one field fewer to move.)
    torch: Option<&'static crate::python::import::TorchState>,
    /// The hold on a torch tensor's memory (see `torch_bits::Keep`): whatever Python code the
    /// kernel runs (`x.set_()`, `x.resize_()`, `x.share_memory_()`), the memory stays valid while
    /// the view lives.
    kept: Option<crate::python::import::Kept>,
    /// A keeper's allocation for `kept`, kept with the block for its next view.
    spare: crate::python::import::SpareKeeper,
}

thread_local! {
    /// Spare storage blocks, so a view costs no allocation in steady state.
    #[allow(clippy::vec_box)]
    static POOL: std::cell::RefCell<Vec<Box<Borrow>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A tensor borrowed from a Python object for the duration of a call: a `#[pyfunction]` argument
/// type that costs no capsule and no DLPack round trip. It derefs to [`ManagedTensor`], so every
/// accessor and typed view works; mutable access is through [`TensorView::as_slice_mut`] and
/// (feature `ndarray`) `TensorView::as_array_mut`.
///
/// ```no_run
/// use dlbridge::python::TensorView;
/// use pyo3::prelude::*;
///
/// /// The sum of a float64 array from numpy, torch, or any buffer exporter, without a copy.
/// #[pyfunction]
/// fn total(t: TensorView<'_>) -> PyResult<f64> {
///     Ok(t.as_slice::<f64>()?.iter().sum())
/// }
/// ```
pub struct TensorView<'a> {
    /// The block holding the view's tensor (from `Box::into_raw`), owned by this view alone.
    block: NonNull<Borrow>,
    /// The object viewed, alive for 'a (borrowed, no reference count).
    source: NonNull<ffi::PyObject>,
    _source: PhantomData<&'a ()>,
    _not_send: PhantomData<*const ()>,
}

impl Deref for TensorView<'_> {
    type Target = ManagedTensor;
    #[inline]
    fn deref(&self) -> &ManagedTensor {
        // SAFETY: the block is owned by this view and holds its tensor from construction to drop.
        unsafe { (*self.block.as_ptr()).managed.as_ref().unwrap_unchecked() }
    }
}

impl TensorView<'_> {
    /// The elements as a mutable slice (see [`ManagedTensor::as_slice_mut`]). A torch leaf tensor
    /// that requires grad is refused while grad mode is on, as torch refuses an in-place write
    /// ([`crate::Error::WriteRefused`]); reading it is fine.
    pub fn as_slice_mut<T: crate::Element>(&mut self) -> crate::Result<crate::SliceMut<'_, T>> {
        self.prepare_producer_write()?;
        self.tensor_mut().as_slice_mut()
    }

    /// What a mutable access to a torch tensor's view needs (nothing for other producers):
    /// - torch's own rules on in-place writes (`TorchState::refuse_write`: no write into a leaf
    ///   that requires grad while grad mode is on, nor into an inference tensor outside inference
    ///   mode);
    /// - the version counter bumped, as torch's in-place operations do (so a backward through a
    ///   value saved before the write fails instead of computing a wrong gradient);
    /// - the view still describing the tensor's memory: those rules are read through getters that
    ///   a torch function mode or a subclass may route to Python, and the bump may be torch's
    ///   Python function; that Python may replace the storage (`x.set_()`, `x.data = ...`). The
    ///   table's description is read again after them (no Python) and must be the view's, else the
    ///   access is refused rather than write freed memory.
    pub(super) fn prepare_producer_write(&self) -> crate::Result<()> {
        let Some((state, py)) = self.torch_attached()? else { return Ok(()) };
        let obj = self.object(py);
        state.refuse_write(&obj)?;
        // The bump before the check below: where torch's Python function bumps (not exactly
        // `torch.Tensor`, or ATen not verified), that Python may replace the storage too.
        bump_version(&obj).map_err(|e| crate::Error::WriteRefused {
            field: "_version",
            reason: format!("could not be bumped: {e}"),
        })?;
        let moved = |reason: &str| crate::Error::WriteRefused { field: "data", reason: reason.into() };
        let api = crate::python::import::type_info(&obj.get_type())
            .ok()
            .and_then(|info| info.exchange)
            .ok_or_else(|| moved("the tensor's type lost its exchange table"))?;
        let now = match api.dltensor_unchecked(&obj) {
            Ok(Some(t)) => t,
            _ => return Err(moved("the tensor can no longer be described by its exchange table")),
        };
        // SAFETY: the table's description, read at once: ndim entries each (checked).
        let same = match unsafe { crate::managed::dims_of(&now) } {
            Ok((shape, strides)) => {
                let view = self.dl_tensor();
                now.data == view.data
                    && now.byte_offset == view.byte_offset
                    && crate::DataType::from(now.dtype) == self.dtype()
                    && shape == self.shape()
                    && strides.map_or_else(
                        || crate::layout::c_strides(shape) == self.strides(),
                        |s| s == self.strides(),
                    )
            }
            Err(_) => false,
        };
        if !same {
            return Err(moved(
                "the tensor's memory was replaced while torch's write rules were read or its version \
                 bumped (by Python code they ran: a torch function mode, a subclass, torch's Python \
                 functions); the view no longer describes it",
            ));
        }
        Ok(())
    }

    /// The torch state of a torch tensor's view, with the GIL this thread must hold to use it.
    fn torch_attached(
        &self,
    ) -> crate::Result<Option<(&'static crate::python::import::TorchState, Python<'_>)>> {
        // SAFETY: the block is owned by this view and alive until it drops.
        let torch = unsafe { self.block.as_ref() }.torch;
        let Some(state) = torch else { return Ok(None) };
        if !crate::python::runtime::attached_here() {
            return Err(crate::Error::WriteRefused {
                field: "requires_grad",
                reason: "mutable access to a torch tensor needs this thread to hold the GIL (it reads \
                         requires_grad)"
                    .into(),
            });
        }
        // SAFETY: this thread holds the GIL (checked just above).
        Ok(Some((state, unsafe { Python::assume_attached() })))
    }

    /// The tensor, mutably, for the typed guards (never handed out: a borrowed tensor moved out
    /// of its view would outlive the block it points into).
    pub(crate) fn tensor_mut(&mut self) -> &mut ManagedTensor {
        // SAFETY: as in `deref`, and `&mut self` is the only way to the block.
        unsafe { (*self.block.as_ptr()).managed.as_mut().unwrap_unchecked() }
    }

    /// A mutable ndarray view (see [`ManagedTensor::as_array_mut`]).
    #[cfg(feature = "ndarray")]
    pub fn as_array_mut<T: crate::Element>(&mut self) -> crate::Result<crate::ndarray::ArrayGuardMut<'_, T>> {
        self.prepare_producer_write()?;
        self.tensor_mut().as_array_mut()
    }
}

impl<'a> TensorView<'a> {
    /// The object this view borrows (the caller's own array), for as long as the view's borrow.
    pub fn object<'py>(&self, py: Python<'py>) -> Borrowed<'a, 'py, PyAny> {
        // SAFETY: `source` is the object borrowed for 'a (see `borrow`), and the GIL is held.
        unsafe { Borrowed::from_ptr(py, self.source.as_ptr()) }
    }

    /// The framework the viewed object belongs to: what results should be returned as
    /// (see [`crate::python::Framework`]).
    pub fn framework(&self, py: Python<'_>) -> PyResult<crate::python::Framework> {
        crate::python::Framework::of(&self.object(py))
    }

    /// Borrows `obj` for as long as the reference to it lives: the view cannot outlive the object.
    ///
    /// ```compile_fail,E0597
    /// use dlbridge::python::TensorView;
    /// use pyo3::prelude::*;
    /// Python::attach(|py| {
    ///     let v: TensorView<'_> = {
    ///         let a = pyo3::types::PyBytes::new(py, b"abc").into_any();
    ///         TensorView::borrow(&a).unwrap() // E0597: `a` does not live long enough
    ///     };
    ///     v.shape().len()
    /// });
    /// ```
    #[inline(always)]
    pub fn borrow(obj: &'a Bound<'_, PyAny>) -> PyResult<Self> {
        // SAFETY: `obj` is borrowed for 'a, so the object lives at least that long.
        unsafe { Self::borrow_for(obj) }
    }

    /// [`TensorView::borrow`] for a lifetime the caller vouches for.
    ///
    /// # Safety
    ///
    /// The object `obj` refers to lives for `'a`.
    #[inline(always)]
    pub(crate) unsafe fn borrow_for(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        // SAFETY: the caller's promise.
        unsafe { Self::borrow_checked(obj, &Spec::ANY) }
    }

    /// [`TensorView::borrow_for`], refusing a tensor that fails `spec` ([`crate::Error::Mismatch`]
    /// names the field): the check is made where the view is built, so the accepted view is
    /// written once, where it is returned (the one conversion of views and typed arguments).
    ///
    /// # Safety
    ///
    /// The object `obj` refers to lives for `'a`.
    #[inline(always)]
    pub(crate) unsafe fn borrow_checked(obj: &Bound<'_, PyAny>, spec: &Spec) -> PyResult<Self> {
        // SAFETY: the caller's promise.
        unsafe { Self::borrow_checked_into(obj, spec, |view| view) }
    }

    /// [`TensorView::borrow_checked`], handing the accepted view to `wrap` on each path (a typed
    /// argument's wrapper): the common one then writes the wrapper once, where it is returned
    /// (mapped after both paths joined, the view was written to the stack and copied twice: a
    /// tenth of a typed numpy argument's time).
    ///
    /// # Safety
    ///
    /// The object `obj` refers to lives for `'a`.
    #[inline(always)]
    pub(crate) unsafe fn borrow_checked_into<W>(
        obj: &Bound<'_, PyAny>,
        spec: &Spec,
        wrap: impl FnOnce(Self) -> W,
    ) -> PyResult<W> {
        crate::python::runtime::enter(obj.py());
        // The commonest argument, an exact numpy array, is built where the view is returned: a
        // view written through a chain of returns is read back whole from the stack each time (a
        // store-forwarding stall per hop).
        // SAFETY: a live object's address is never NULL.
        let source = unsafe { NonNull::new_unchecked(obj.as_ptr()) };
        // (No `Option<PyResult<Self>>` in between either: the view is written in place.)
        if let Some(p) = crate::python::import::parts_exact(obj) {
            let flags = Flags::NONE.with(Flags::READ_ONLY, p.readonly);
            if let Some(block) = Self::numpy_block(p) {
                return Self::from_borrow_into(block, flags, source, spec, wrap);
            }
        }
        Self::borrow_other(obj, source, spec).map(wrap)
    }

    /// The view of a filled block: its `DLTensor` pointed at its dims, then the common tensor
    /// checked inline and anything else through the general checks (out of line, so the common
    /// case builds the view where it is returned).
    #[inline(always)]
    fn from_borrow(
        borrow: Box<Borrow>,
        flags: Flags,
        source: NonNull<ffi::PyObject>,
        spec: &Spec,
    ) -> PyResult<Self> {
        Self::from_borrow_into(borrow, flags, source, spec, |view| view)
    }

    /// [`TensorView::from_borrow`], the accepted view handed to `wrap` where it is built (see
    /// [`TensorView::borrow_checked_into`]).
    #[inline(always)]
    fn from_borrow_into<W>(
        borrow: Box<Borrow>,
        flags: Flags,
        source: NonNull<ffi::PyObject>,
        spec: &Spec,
        wrap: impl FnOnce(Self) -> W,
    ) -> PyResult<W> {
        let block = Box::into_raw(borrow);
        // SAFETY: `block` is a live, exclusively owned block; the dims pointers are derived through
        // it and written into its DLTensor in place, and the tensor pointer too. The block and what
        // it points to (the dims, the exporter's memory held by the buffer view or by the object
        // the caller borrows for 'a) outlive `tensor`, which is declared first and dropped first.
        unsafe {
            let (shape, strides) = Dims::pointers(std::ptr::addr_of_mut!((*block).dims));
            (*block).tensor.shape = shape;
            (*block).tensor.strides = strides;
            let p = NonNull::new_unchecked(std::ptr::addr_of_mut!((*block).tensor));
            let block = NonNull::new_unchecked(block);
            match ManagedTensor::borrowed_if_common(p, flags) {
                Some(tensor) if tensor.first_failure(spec).is_none() => {
                    Ok(wrap(Self::with(tensor, Some(block), source)))
                }
                Some(tensor) => Err(Self::with(tensor, Some(block), source).refused(spec)),
                None => Self::from_borrow_general(p, block, flags, source, spec).map(wrap),
            }
        }
    }

    /// # Safety
    ///
    /// As in [`TensorView::from_borrow`], whose block `block` is and whose tensor `p` is.
    #[inline(never)]
    unsafe fn from_borrow_general(
        p: NonNull<DLTensor>,
        block: NonNull<Borrow>,
        flags: Flags,
        source: NonNull<ffi::PyObject>,
        spec: &Spec,
    ) -> PyResult<Self> {
        // SAFETY: the caller's promise.
        match unsafe { ManagedTensor::borrowed(p, flags) } {
            Ok(tensor) => Self::with(tensor, Some(block), source).checked(spec),
            Err(e) => {
                // SAFETY: the block from `Box::into_raw`, no longer pointed to by anything.
                let mut b = unsafe { Box::from_raw(block.as_ptr()) };
                release_kept(&mut b, source);
                recycle(b);
                Err(e.into())
            }
        }
    }

    /// This view if it meets `spec`, else the mismatch (the view released).
    #[inline]
    fn checked(self, spec: &Spec) -> PyResult<Self> {
        if self.first_failure(spec).is_none() { Ok(self) } else { Err(self.refused(spec)) }
    }

    /// The mismatch of a view that fails `spec` (the view released).
    #[cold]
    #[inline(never)]
    fn refused(self, spec: &Spec) -> PyErr {
        match self.check(spec) {
            Err(e) => e.into(),
            Ok(()) => unreachable!("refused only after a failed check"),
        }
    }

    /// The view of `tensor`, held in `block` (the block its `DLTensor` lives in), or in a block
    /// of its own for an owned import (`None`).
    #[inline(always)]
    fn with(tensor: ManagedTensor, block: Option<NonNull<Borrow>>, source: NonNull<ffi::PyObject>) -> Self {
        // SAFETY: a live block from `Box::into_raw` (or made here), owned by the new view alone;
        // its `managed` is `None` (a spare block), so nothing is dropped by the write.
        let block = block.unwrap_or_else(|| unsafe { NonNull::new_unchecked(Box::into_raw(blank())) });
        // SAFETY: as above.
        unsafe { std::ptr::addr_of_mut!((*block.as_ptr()).managed).write(Some(tensor)) };
        Self { block, source, _source: PhantomData, _not_send: PhantomData }
    }

    /// A numpy array's struct read into a block; `None` when a stride is not a multiple of the
    /// item size (then DLPack describes the array, or refuses it, instead).
    fn numpy_block(p: crate::python::import::NumpyParts<'_>) -> Option<Box<Borrow>> {
        let mut b = blank();
        if !crate::python::import::fill_dims(&p, &mut b.dims) {
            recycle(b);
            return None;
        }
        let n = p.shape.len();
        b.tensor = DLTensor {
            data: p.data,
            device: Device::CPU.to_raw(),
            ndim: n as i32,
            dtype: p.dtype.to_raw(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        Some(b)
    }

    /// A numpy array as a view: the common case without a `Result` in between.
    #[inline(always)]
    fn from_numpy(
        p: crate::python::import::NumpyParts<'_>,
        source: NonNull<ffi::PyObject>,
        spec: &Spec,
    ) -> Option<PyResult<Self>> {
        let flags = Flags::NONE.with(Flags::READ_ONLY, p.readonly);
        Some(Self::from_borrow(Self::numpy_block(p)?, flags, source, spec))
    }

    /// Every source but an exact numpy array.
    #[inline(never)]
    fn borrow_other(obj: &Bound<'_, PyAny>, source: NonNull<ffi::PyObject>, spec: &Spec) -> PyResult<Self> {
        if let Ok(t) = obj.cast_exact::<Tensor>() {
            let inner = t.get().shared();
            let mut b = blank();
            b.tensor = *inner.dl_tensor();
            b.dims.set(inner.shape(), inner.strides());
            return Self::from_borrow(b, inner.flags(), source, spec);
        }
        let info = crate::python::import::type_info(&obj.get_type())?;
        if info.numpy {
            if let Some(v) = crate::python::import::parts(obj).and_then(|p| Self::from_numpy(p, source, spec))
            {
                return v;
            }
        }
        if let Some(api) = info.exchange {
            if let Some(state) = api.torch_state() {
                state.refuse_untracked_read(obj)?;
            }
            // The borrowed DLTensor cannot say read-only; dlbridge's own table refuses read-only
            // tensors there, and any refusal falls through to the owned import, which carries the
            // producer's flags (and its error, if it refuses too).
            let mut b = blank();
            match api.dltensor_into(obj, &mut b.tensor) {
                Ok(true) if Device::from(b.tensor.device) == Device::CPU => {
                    // SAFETY: the producer's description, read at once: ndim entries each (checked).
                    let copied = match unsafe { crate::managed::dims_of(&b.tensor) } {
                        Ok((shape, Some(strides))) => {
                            b.dims.set(shape, strides);
                            Ok(())
                        }
                        Ok((shape, None)) => {
                            b.dims.set(shape, &crate::layout::c_strides(shape));
                            Ok(())
                        }
                        Err(e) => Err(e),
                    };
                    if let Err(e) = copied {
                        recycle(b);
                        return Err(e.into());
                    }
                    b.torch = api.torch_state();
                    if b.torch.is_some() {
                        // No Python has run since the description: the storage kept is the one it
                        // describes.
                        match crate::python::import::aten_bits_found(obj.py())
                            .and_then(|a| a.keep_memory(obj, &mut b.spare))
                        {
                            Some(Ok(kept)) => b.kept = kept,
                            Some(Err(why)) => {
                                recycle(b);
                                return Err(PyBufferError::new_err(format!(
                                    "a borrowed view cannot keep this tensor's memory valid: {why}"
                                )));
                            }
                            None => {}
                        }
                    }
                    return Self::from_borrow(b, Flags::NONE, source, spec);
                }
                // Device memory needs stream handling: the protocol path below.
                Ok(_) => recycle(b),
                Err(_) => {
                    recycle(b);
                    return Self::with(from_dlpack_with(obj, &ImportOptions::default())?, None, source)
                        .checked(spec);
                }
            }
        }
        // SAFETY: a type-slot check on a live object.
        if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } == 1 {
            match Self::from_buffer(obj, source, spec) {
                Ok(v) => return Ok(v),
                // A format the buffer protocol cannot express, from an object that also speaks
                // DLPack: let DLPack describe it instead.
                Err(_) if info.dlpack => {}
                Err(e) => return Err(e),
            }
        } else if !info.dlpack
            && !crate::python::runtime::is_capsule(obj)
            && !obj.hasattr(pyo3::intern!(obj.py(), "__dlpack__"))?
        {
            // What an argument takes, worded as every path words it (no function named).
            return Err(crate::python::import::not_an_array(obj, "__dlpack__ or the buffer protocol"));
        }
        Self::with(from_dlpack_with(obj, &ImportOptions::default())?, None, source).checked(spec)
    }

    fn from_buffer(obj: &Bound<'_, PyAny>, source: NonNull<ffi::PyObject>, spec: &Spec) -> PyResult<Self> {
        let held = HeldBuffer::get(obj, ffi::PyBUF_RECORDS_RO)?;
        let mut b = blank();
        let m = match crate::python::import::read_view(held.view(), &mut b.dims) {
            Ok(m) => m,
            Err(e) => {
                recycle(b);
                return Err(PyBufferError::new_err(format!("buffer protocol: {e}")));
            }
        };
        b.tensor = DLTensor {
            data: held.view().buf,
            device: Device::CPU.to_raw(),
            ndim: b.dims.ndim() as i32,
            dtype: m.dtype.to_raw(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        b.buffer = Some(held);
        Self::from_borrow(b, Flags::NONE.with(Flags::READ_ONLY, m.readonly), source, spec)
    }
}

impl Drop for TensorView<'_> {
    fn drop(&mut self) {
        // SAFETY: the block from `Box::into_raw`, owned by this view alone.
        let mut b = unsafe { Box::from_raw(self.block.as_ptr()) };
        // The tensor first (a borrowed one never dereferences its pointer when dropped; an owned
        // import's export is released here), then the hold on the memory, then the block.
        b.managed = None;
        release_kept(&mut b, self.source);
        // `managed` and `kept` are empty now.
        b.buffer = None;
        b.torch = None;
        pool(b);
    }
}

/// Gives back the block's hold on a torch tensor's memory, restoring the storage's own `DataPtr`
/// where nothing else holds it (`source`: the viewed object, alive).
fn release_kept(b: &mut Borrow, source: NonNull<ffi::PyObject>) {
    let Some(kept) = b.kept.take() else { return };
    if !crate::python::runtime::attached_here() {
        // (A view is dropped where it was made, with the GIL; without it the hold is kept: the
        // last holder may run a deleter that takes the GIL.)
        return drop(kept);
    }
    // SAFETY: this thread holds the GIL (checked just above); `source` is the live viewed object.
    let (py, obj) = unsafe {
        let py = Python::assume_attached();
        (py, Borrowed::from_ptr(py, source.as_ptr()))
    };
    match crate::python::import::aten_bits_found(py) {
        Some(bits) => bits.release_memory(&obj, kept, &mut b.spare),
        None => drop(kept),
    }
}

/// Releases what a block holds and keeps it for the next view (up to 8 spare blocks a thread).
fn recycle(mut b: Box<Borrow>) {
    b.managed = None;
    b.buffer = None;
    b.torch = None;
    b.kept = None;
    pool(b);
}

/// Keeps an emptied block for the next view (up to 8 spare blocks a thread).
#[inline]
fn pool(b: Box<Borrow>) {
    POOL.with_borrow_mut(|p| {
        if p.len() < 8 {
            p.push(b);
        }
    });
}

impl<'a, 'py> FromPyObject<'a, 'py> for TensorView<'a> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        // SAFETY: a `Borrowed<'a, ..>` argument is alive for 'a.
        unsafe { TensorView::borrow_for(&obj) }
    }
}

fn blank() -> Box<Borrow> {
    if let Some(b) = POOL.with_borrow_mut(Vec::pop) {
        return b;
    }
    Box::new(Borrow {
        managed: None,
        tensor: DLTensor {
            data: std::ptr::null_mut(),
            device: Device::CPU.to_raw(),
            ndim: 0,
            dtype: crate::DataType::UINT8.to_raw(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        dims: Dims::new(),
        buffer: None,
        torch: None,
        kept: None,
        spare: Default::default(),
    })
}

/// Bumps a torch tensor's version counter (after `TorchState::refuse_write`), as torch's own
/// in-place operations do, so autograd refuses a backward pass through a value a kernel overwrote
/// ("modified by an inplace operation") instead of computing wrong gradients: through ATen's
/// `bump_version` where verified (exactly `torch.Tensor`, import's `torch_bits.rs`; a tensor without
/// a counter has nothing to bump), else `torch._C._increment_version` (~180 ns here), which runs
/// Python: call it before taking a view that is used afterwards.
pub(crate) fn bump_version(obj: &Bound<'_, PyAny>) -> PyResult<()> {
    if bump_version_in_aten(obj) { Ok(()) } else { bump_version_in_python(obj) }
}

/// The version bump through ATen, running no Python: whether it was decided here (bumped, or no
/// counter to bump). Never starts the one-time search of ATen's functions (which runs Python):
/// the write rules read before it did.
#[inline]
pub(super) fn bump_version_in_aten(obj: &Bound<'_, PyAny>) -> bool {
    matches!(
        crate::python::import::aten_bits_found(obj.py()).map(|b| b.bump_version(obj)),
        Some(crate::python::import::Bump::Done | crate::python::import::Bump::NoCounter)
    )
}

/// The version bump through `torch._C._increment_version`: Python, which may replace the storage.
#[cold]
pub(super) fn bump_version_in_python(obj: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = obj.py();
    static BUMP: pyo3::sync::PyOnceLock<Option<Py<PyAny>>> = pyo3::sync::PyOnceLock::new();
    let bump = BUMP.get_or_init(py, || {
        py.import("torch")
            .and_then(|t| t.getattr("_C")?.getattr("_increment_version"))
            .ok()
            .map(Bound::unbind)
    });
    if let Some(f) = bump {
        f.bind(py).call1((pyo3::types::PyTuple::new(py, [obj.as_any()])?,))?;
    }
    Ok(())
}
