//! The DLPack C exchange API (1.2/1.3), as consumer and as producer.
//!
//! Consumer: a type publishes `__dlpack_c_exchange_api__` (a capsule named `"dlpack_exchange_api"`,
//! DLPack 1.3). The table is checked (major version 1, walking `prev_api` past newer majors;
//! required functions non-NULL), bound to that type and cached per type, then used to export an
//! owning tensor or a borrowed `DLTensor` of an object of exactly that type without going through
//! Python. DLPack 1.2's integer form (`__c_dlpack_exchange_api__`, the table's address as an int)
//! is not read on the safe path: any Python class can hold any integer there, and reading it would
//! dereference an arbitrary address ([`ExchangeApi::from_address`] is the `unsafe` way in).
//!
//! Producer: `dlbridge.Tensor.__dlpack_c_exchange_api__` is a static table whose five functions
//! serve dlbridge tensors to consumers that skip Python entirely.

use std::ffi::{CStr, c_int, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;

use crate::dtype::DataType;
use crate::export::AlignedBuffer;
use crate::ffi::{
    DLDeviceType, DLManagedTensorVersioned, DLPackExchangeAPI, DLPackExchangeAPIHeader, DLPackSetError,
    DLPackVersion, DLTensor,
};
use crate::managed::ManagedTensor;
use crate::python::runtime::Tensor;

/// Name of the capsule holding an exchange table (DLPack 1.3).
pub const EXCHANGE_API_CAPSULE: &CStr = c"dlpack_exchange_api";

/// A validated exchange table, bound to the one Python type it was read from: major version 1 and
/// every required function present. Its functions are only ever called on objects of exactly that
/// type (the standard says a table is valid for the type that publishes it; a subclass may
/// override `__dlpack__` and is served by the protocol instead).
#[derive(Clone, Copy)]
pub struct ExchangeApi {
    api: &'static DLPackExchangeAPI,
    /// The address of the type the table belongs to.
    ty: usize,
    /// The type's torch state accessors (`requires_grad`, `is_neg`, `is_conj`), if it has them:
    /// its table exports without looking at that state, so each tensor is checked as torch's
    /// `__dlpack__` would refuse it (see [`ExchangeApi::managed_tensor`]).
    torch_state: Option<&'static TorchState>,
}

/// C entry points of torch's state accessors, found once per type (calling them directly skips
/// the attribute lookup and the descriptor call, most of their cost).
/// `None` where the accessor is not a plain C descriptor: then it is looked up and called by name.
#[derive(Clone, Copy)]
pub(crate) struct TorchState {
    requires_grad: Option<Getter>,
    is_leaf: Option<Getter>,
    is_neg: Option<Method>,
    is_conj: Option<Method>,
}

/// A `getset_descriptor`'s C getter and closure.
#[derive(Clone, Copy)]
struct Getter {
    get: ffi::getter,
    closure: *mut c_void,
}

/// A `method_descriptor`'s C function and calling convention (no arguments are passed).
#[derive(Clone, Copy)]
struct Method {
    meth: ffi::PyMethodDefPointer,
    flags: c_int,
}

// SAFETY: function pointers into an extension module (never unloaded) and the closure value its
// static `PyGetSetDef` holds; only ever called with the GIL held.
unsafe impl Send for TorchState {}
// SAFETY: as above; nothing is mutated through them.
unsafe impl Sync for TorchState {}

impl Getter {
    /// The getter of `ty.name` if it is a plain `getset_descriptor`.
    fn of(ty: &Bound<'_, pyo3::types::PyType>, name: &Bound<'_, pyo3::types::PyString>) -> Option<Self> {
        let d = plain_descriptor(ty, name, std::ptr::addr_of_mut!(ffi::PyGetSetDescr_Type))?;
        // SAFETY: a getset_descriptor (checked) has this layout and points to its PyGetSetDef.
        unsafe {
            let def = (*d.as_ptr().cast::<ffi::PyGetSetDescrObject>()).d_getset;
            Some(Self { get: (*def).get?, closure: (*def).closure })
        }
    }

    /// `get(obj)`: a new reference, or an error.
    fn call<'py>(&self, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        // SAFETY: the getter of `obj`'s own type (the caller checked `serves`), with its closure,
        // the GIL held; a new reference or NULL with an exception set.
        unsafe { Bound::from_owned_ptr_or_err(obj.py(), (self.get)(obj.as_ptr(), self.closure)) }
    }
}

impl Method {
    /// The C function of `ty.name` if it is a plain `method_descriptor` of a convention that can be
    /// called with no arguments.
    fn of(ty: &Bound<'_, pyo3::types::PyType>, name: &Bound<'_, pyo3::types::PyString>) -> Option<Self> {
        let d = plain_descriptor(ty, name, std::ptr::addr_of_mut!(ffi::PyMethodDescr_Type))?;
        // SAFETY: a method_descriptor (checked) has this layout and points to its PyMethodDef.
        unsafe {
            let def = (*d.as_ptr().cast::<ffi::PyMethodDescrObject>()).d_method;
            let flags = (*def).ml_flags;
            let plain = [
                ffi::METH_NOARGS,
                ffi::METH_VARARGS,
                ffi::METH_VARARGS | ffi::METH_KEYWORDS,
                ffi::METH_FASTCALL,
                ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
            ];
            plain.contains(&flags).then_some(Self { meth: (*def).ml_meth, flags })
        }
    }

    /// `obj.method()`: whether it returned True.
    fn is_true(&self, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
        let py = obj.py();
        let o = obj.as_ptr();
        // SAFETY: the method of `obj`'s own type (the caller checked `serves`), called as its
        // `ml_flags` convention says with no arguments, the GIL held; each union field read is
        // the one that convention uses; a new reference or NULL with an exception set.
        let r = unsafe {
            let m = self.meth;
            match self.flags {
                f if f == ffi::METH_NOARGS => (m.PyCFunction)(o, std::ptr::null_mut()),
                f if f == ffi::METH_VARARGS => (m.PyCFunction)(o, empty_tuple(py).as_ptr()),
                f if f == ffi::METH_VARARGS | ffi::METH_KEYWORDS => {
                    (m.PyCFunctionWithKeywords)(o, empty_tuple(py).as_ptr(), std::ptr::null_mut())
                }
                f if f == ffi::METH_FASTCALL => (m.PyCFunctionFast)(o, std::ptr::null_mut(), 0),
                _ => (m.PyCFunctionFastWithKeywords)(o, std::ptr::null_mut(), 0, std::ptr::null_mut()),
            }
        };
        // SAFETY: as above.
        let r = unsafe { Bound::from_owned_ptr_or_err(py, r) }?;
        // SAFETY: comparing with the True singleton.
        Ok(r.as_ptr() == unsafe { ffi::Py_True() })
    }
}

/// `ty.name` if it is a descriptor of exactly the type `kind` (a getset or method descriptor)
/// defined by `ty` or one of its bases, so its C function accepts `ty`'s instances without the
/// type check calling through the descriptor would make.
fn plain_descriptor<'py>(
    ty: &Bound<'py, pyo3::types::PyType>,
    name: &Bound<'py, pyo3::types::PyString>,
    kind: *mut ffi::PyTypeObject,
) -> Option<Bound<'py, PyAny>> {
    let d = ty.getattr(name).ok()?;
    if d.get_type_ptr() != kind {
        return None;
    }
    // SAFETY: a getset or method descriptor (checked above) starts with `PyDescr_COMMON`; d_type
    // is the defining class, or NULL.
    let owner = unsafe { (*d.as_ptr().cast::<ffi::PyDescrObject>()).d_type };
    // SAFETY: two live type objects.
    (!owner.is_null() && unsafe { ffi::PyType_IsSubtype(ty.as_type_ptr(), owner) } != 0).then_some(d)
}

/// `()`, CPython's shared empty tuple.
fn empty_tuple(py: Python<'_>) -> Bound<'_, pyo3::types::PyTuple> {
    pyo3::types::PyTuple::empty(py)
}

impl TorchState {
    /// The accessors of `ty`, if it has torch's state (`requires_grad` and `is_neg`): interned, so
    /// the per-type caches hold one pointer (a handful of distinct sets exist in a process).
    pub(crate) fn of(ty: &Bound<'_, pyo3::types::PyType>) -> Option<&'static Self> {
        static INTERNED: std::sync::Mutex<Vec<&'static TorchState>> = std::sync::Mutex::new(Vec::new());
        let state = Self::find(ty)?;
        let key = state.key();
        let mut all = INTERNED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = all.iter().find(|s| s.key() == key) {
            return Some(found);
        }
        let leaked: &'static Self = Box::leak(Box::new(state));
        all.push(leaked);
        Some(leaked)
    }

    /// What identifies a set of accessors (their C entry points).
    fn key(&self) -> [usize; 8] {
        let getter = |g: Option<Getter>| g.map_or((0, 0), |g| (g.get as usize, g.closure as usize));
        let (g, l) = (getter(self.requires_grad), getter(self.is_leaf));
        let m = |m: Option<Method>| {
            m.map_or((0, 0), |m| {
                // SAFETY: every field of the union is a function pointer of the same size; read as
                // one only to compare addresses, never called.
                let f = unsafe { m.meth.PyCFunction };
                (f as usize, m.flags as usize)
            })
        };
        let (n, c) = (m(self.is_neg), m(self.is_conj));
        [g.0, g.1, l.0, l.1, n.0, n.1, c.0, c.1]
    }

    fn find(ty: &Bound<'_, pyo3::types::PyType>) -> Option<Self> {
        let py = ty.py();
        let (rg, neg, conj) = (intern!(py, "requires_grad"), intern!(py, "is_neg"), intern!(py, "is_conj"));
        if !ty.hasattr(rg).unwrap_or(false) || !ty.hasattr(neg).unwrap_or(false) {
            return None;
        }
        Some(Self {
            requires_grad: Getter::of(ty, rg),
            is_leaf: Getter::of(ty, intern!(py, "is_leaf")),
            is_neg: Method::of(ty, neg),
            is_conj: Method::of(ty, conj),
        })
    }

    fn requires_grad(&self, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
        Self::get(self.requires_grad.as_ref(), obj, intern!(obj.py(), "requires_grad"))
    }

    fn get(
        getter: Option<&Getter>,
        obj: &Bound<'_, PyAny>,
        name: &Bound<'_, pyo3::types::PyString>,
    ) -> PyResult<bool> {
        let r = match getter {
            Some(g) => g.call(obj)?,
            None => obj.getattr(name)?,
        };
        // SAFETY: comparing with the True singleton.
        Ok(r.as_ptr() == unsafe { ffi::Py_True() })
    }

    /// A borrowed view of a tensor that requires grad, taken while grad mode is on, is refused: the
    /// function reading it is invisible to autograd, so whatever it returns would carry no
    /// gradient back to the tensor, and a model training through it would silently not learn
    /// (torch's own `__dlpack__` and `.numpy()` refuse such a tensor outright). Inside an op's or
    /// an `autograd.Function`'s body (how dlbridge's kernels run on such tensors) and under
    /// `torch.no_grad()` grad mode is off, and in inference mode autograd records nothing: there
    /// the view is taken.
    ///
    /// For exactly `torch.Tensor`, grad mode and `requires_grad` are read through c10 (a few
    /// instructions each; the getter, a Python attribute call, cost a view about 50 ns); for other
    /// types the getter is asked, only while grad mode is on. Call it before the table's
    /// description: the getter may run Python (a subclass, a torch function mode).
    ///
    /// The commonest case, a tensor that does not require grad (its bit read through ATen), is
    /// decided inline; everything else out of line.
    #[inline]
    pub(crate) fn refuse_untracked_read(&self, obj: &Bound<'_, PyAny>) -> PyResult<()> {
        let bits = super::torch_bits::aten_bits(obj.py());
        // The tensor's own bit first (a field read through ATen): most tensors do not require
        // grad, and then grad mode (a thread-local lookup in libc10) need not be asked.
        let aten_requires_grad = bits.and_then(|b| b.requires_grad(obj));
        if aten_requires_grad == Some(false) {
            return Ok(());
        }
        self.refuse_untracked_read_rest(obj, bits, aten_requires_grad)
    }

    /// [`TorchState::refuse_untracked_read`] past a tensor ATen says does not require grad.
    #[inline(never)]
    fn refuse_untracked_read_rest(
        &self,
        obj: &Bound<'_, PyAny>,
        bits: Option<&'static super::torch_bits::AtenBits>,
        aten_requires_grad: Option<bool>,
    ) -> PyResult<()> {
        let py = obj.py();
        if bits.and_then(|b| b.grad_enabled()) == Some(false) {
            return Ok(());
        }
        let requires_grad = match aten_requires_grad {
            Some(rg) => rg,
            None => self.requires_grad(obj)?,
        };
        if !requires_grad {
            return Ok(());
        }
        let enabled = match bits.and_then(|b| b.grad_enabled()) {
            Some(on) => on,
            None => grad_enabled_py(py)?,
        };
        // Inside inference mode autograd records nothing, even under enable_grad.
        let inference_mode = match bits.and_then(|b| b.inference_mode()) {
            Some(on) => on,
            None => py.import("torch")?.call_method0("is_inference_mode_enabled")?.is_truthy()?,
        };
        if !enabled || inference_mode {
            return Ok(());
        }
        Err(PyBufferError::new_err(
            "requires_grad: this tensor requires grad and grad mode is on, but a plain function is \
             invisible to autograd: its result would carry no gradient back to this tensor (torch's \
             own __dlpack__ refuses it too). Make the function a dlbridge kernel with a backward \
             (dlbridge::python::kernels), or pass tensor.detach(), or call it under torch.no_grad()",
        ))
    }

    /// What torch refuses of an in-place write, refused of a kernel's mutable access too:
    /// - writing into a tensor without a version counter (an inference tensor, or one holding one
    ///   as its `.data`) outside inference mode ("Inplace update to inference tensor outside
    ///   InferenceMode is not allowed");
    /// - writing into a leaf that requires grad while grad mode is on ("a leaf Variable that
    ///   requires grad is being used in an in-place operation"). Under `torch.no_grad()` torch
    ///   allows it (that is how optimizers update parameters), and so does this; a non-leaf that
    ///   requires grad may be written, as torch's in-place operations may (the version counter,
    ///   bumped by `TensorMut`, makes a backward through an overwritten saved value fail in torch).
    ///   Inside inference mode autograd records nothing, and torch writes such a leaf there.
    ///
    /// For exactly `torch.Tensor`, read through ATen and c10 ([`super::torch_bits`]): two calls of
    /// a few instructions, and one getter when grad mode is on and the tensor does not require
    /// grad; else through torch's Python methods.
    pub(crate) fn refuse_write(&self, obj: &Bound<'_, PyAny>) -> crate::Result<()> {
        let py = obj.py();
        let bits = super::torch_bits::aten_bits(py);
        let without_counter = match bits.and_then(|b| b.write_refused_without_counter(obj)) {
            Some(refused) => Ok(refused),
            None => write_refused_without_counter(obj),
        };
        let inference_refused = |reason: String| crate::Error::WriteRefused { field: "is_inference", reason };
        match without_counter {
            Ok(false) => {}
            Ok(true) => {
                return Err(inference_refused(
                    "an inference tensor (made under torch.inference_mode(), or holding one as its .data) \
                     cannot be written in place outside inference mode (torch refuses it too); write it \
                     inside torch.inference_mode(), or pass a clone"
                        .into(),
                ));
            }
            Err(e) => return Err(inference_refused(format!("could not be read: {e}"))),
        }
        // Grad mode off (under no_grad, inside a custom op): every write is allowed, nothing to read.
        if bits.and_then(|b| b.grad_enabled()) == Some(false) {
            return Ok(());
        }
        let refused = |reason: String| crate::Error::WriteRefused { field: "requires_grad", reason };
        // What torch's in-place check refuses of a tensor that requires grad (a leaf; a view whose
        // base is a leaf; a view torch cannot rebase: a multi-output view, one made in a custom
        // Function, under no_grad or in inference mode), read only for such a tensor. A getter
        // that raises (a torch function mode may run Python there) refuses the write too, with
        // its own words.
        // `requires_grad` through c10 for exactly `torch.Tensor` (no Python), else the getter.
        let requires_grad = match bits.and_then(|b| b.requires_grad(obj)) {
            Some(rg) => Ok(rg),
            None => self.requires_grad(obj),
        };
        let why = requires_grad.and_then(|rg| if rg { grad_write_refusal(self, obj) } else { Ok(None) });
        let why = why.map_err(|e| refused(format!("could not be read: {e}")))?;
        let Some(why) = why else { return Ok(()) };
        // Inside inference mode autograd records nothing: torch writes such a leaf there, even under
        // enable_grad.
        let inference_mode = match bits.and_then(|b| b.inference_mode()) {
            Some(on) => Ok(on),
            None => py.import("torch").and_then(|t| t.call_method0("is_inference_mode_enabled")?.is_truthy()),
        };
        if inference_mode.unwrap_or(false) {
            return Ok(());
        }
        match grad_enabled_py(py) {
            Ok(false) => Ok(()),
            Ok(true) => Err(refused(format!(
                "{why} cannot be written in place (torch refuses it too); write under torch.no_grad(), \
                 or pass a tensor that does not require grad"
            ))),
            Err(e) => Err(refused(format!("grad mode could not be read: {e}"))),
        }
    }

    fn call(
        method: Option<&Method>,
        obj: &Bound<'_, PyAny>,
        name: &Bound<'_, pyo3::types::PyString>,
    ) -> PyResult<bool> {
        match method {
            Some(m) => m.is_true(obj),
            None => match obj.getattr_opt(name)? {
                Some(f) => f.call0()?.is_truthy(),
                None => Ok(false),
            },
        }
    }

    /// The negative bit: through ATen's native kernel for exactly `torch.Tensor` (no GIL round trip,
    /// see [`super::torch_bits`]), else the method.
    #[inline]
    fn is_neg(&self, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
        if let Some(bit) = super::torch_bits::aten_bits(obj.py()).and_then(|b| b.is_neg(obj)) {
            return Ok(bit);
        }
        Self::call(self.is_neg.as_ref(), obj, intern!(obj.py(), "is_neg"))
    }

    /// The conjugate bit, as [`TorchState::is_neg`] reads the negative one.
    fn is_conj(&self, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
        if let Some(bit) = super::torch_bits::aten_bits(obj.py()).and_then(|b| b.is_conj(obj)) {
            return Ok(bit);
        }
        Self::call(self.is_conj.as_ref(), obj, intern!(obj.py(), "is_conj"))
    }
}

impl ExchangeApi {
    /// Reads and checks the table a type publishes as a `"dlpack_exchange_api"` capsule in
    /// `__dlpack_c_exchange_api__` (DLPack 1.3). `Ok(None)`: the type has none this crate can use
    /// (none, a newer major only, or only DLPack 1.2's integer form, `__c_dlpack_exchange_api__`,
    /// whose address nothing can check: see [`ExchangeApi::from_address`]).
    pub fn of_type(ty: &Bound<'_, pyo3::types::PyType>) -> PyResult<Option<Self>> {
        let py = ty.py();
        let Some(cap) = ty.getattr_opt(intern!(py, "__dlpack_c_exchange_api__"))? else { return Ok(None) };
        // SAFETY: IsValid checks the object is a capsule with exactly this name; sets no error.
        if unsafe { ffi::PyCapsule_IsValid(cap.as_ptr(), EXCHANGE_API_CAPSULE.as_ptr()) } != 1 {
            return Ok(None);
        }
        // SAFETY: valid under this name.
        let header = unsafe { ffi::PyCapsule_GetPointer(cap.as_ptr(), EXCHANGE_API_CAPSULE.as_ptr()) };
        // SAFETY: a capsule of this name holds a process-lifetime static table by the standard's
        // contract (as a `"dltensor"` capsule holds a tensor): the same trust `__dlpack__` gets.
        Ok(unsafe { Self::check(header.cast(), ty) })
    }

    /// The table at `address` (DLPack 1.2's `__c_dlpack_exchange_api__` integer form), for `ty`.
    ///
    /// # Safety
    ///
    /// `address` is NULL or the address of a process-lifetime exchange table (every `prev_api`
    /// link too) whose functions accept instances of `ty`: an integer a Python class attribute
    /// holds proves nothing, so only call this for a type whose publisher you trust.
    pub unsafe fn from_address(address: usize, ty: &Bound<'_, pyo3::types::PyType>) -> Option<Self> {
        // SAFETY: the caller's promise.
        unsafe { Self::check(std::ptr::with_exposed_provenance(address), ty) }
    }

    /// The table at `header` for `ty`, if [`ExchangeApi::validate_table`] accepts it.
    ///
    /// # Safety
    ///
    /// As for [`ExchangeApi::validate_table`], and the table's functions accept instances of `ty`.
    pub unsafe fn check(
        header: *const DLPackExchangeAPIHeader,
        ty: &Bound<'_, pyo3::types::PyType>,
    ) -> Option<Self> {
        // SAFETY: the caller's promise.
        let api = unsafe { Self::validate_table(header) }?;
        Some(Self { api, ty: ty.as_type_ptr() as usize, torch_state: TorchState::of(ty) })
    }

    /// Walks the header chain to a major-1 table whose required functions are all present.
    ///
    /// # Safety
    ///
    /// `header` is NULL or points to a process-lifetime exchange table (and so does every
    /// `prev_api` link).
    pub unsafe fn validate_table(
        mut header: *const DLPackExchangeAPIHeader,
    ) -> Option<&'static DLPackExchangeAPI> {
        for _ in 0..8 {
            // A NULL or misaligned address is refused before it is dereferenced.
            if !header.is_aligned() {
                return None;
            }
            // SAFETY: the caller's promise; NULL gives None.
            let h = unsafe { header.as_ref()? };
            if h.version.major == 1 {
                // SAFETY: a major-1 header heads a full DLPackExchangeAPI (the header is its first field).
                let api: &'static DLPackExchangeAPI = unsafe { &*header.cast::<DLPackExchangeAPI>() };
                let complete = api.managed_tensor_allocator.is_some()
                    && api.managed_tensor_from_py_object_no_sync.is_some()
                    && api.managed_tensor_to_py_object_no_sync.is_some()
                    && api.current_work_stream.is_some();
                return complete.then_some(api);
            }
            header = h.prev_api;
        }
        None
    }

    /// Whether the table's type has torch's tensor state (torch tensors cannot be read-only).
    pub(crate) fn is_torch(&self) -> bool {
        self.torch_state.is_some()
    }

    /// The checked table.
    pub fn table(&self) -> &'static DLPackExchangeAPI {
        self.api
    }

    /// Whether `obj` is exactly of the table's type (the objects its functions accept).
    #[inline]
    pub fn serves(&self, obj: &Bound<'_, PyAny>) -> bool {
        obj.get_type_ptr() as usize == self.ty
    }

    #[cold]
    fn wrong_type(obj: &Bound<'_, PyAny>) -> PyErr {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "exchange API: a table is only valid for the type it was read from, not {}",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    }

    /// Exports `obj` as an owning tensor, without stream synchronisation; `TypeError` unless `obj`
    /// is exactly of the table's type. Refuses, as the producer's own `__dlpack__` does or should,
    /// what its table would export anyway: for types with torch's state, a tensor that requires
    /// grad (writing it would change the autograd graph behind torch's back) and one whose memory
    /// holds other values than it shows (a lazily conjugated or negated view).
    #[inline]
    pub fn managed_tensor(&self, obj: &Bound<'_, PyAny>) -> PyResult<ManagedTensor> {
        // The table's own failure is this function's error as well.
        self.managed_tensor_or_table_error(obj)?
    }

    /// [`ExchangeApi::managed_tensor`], with the table function's own failure apart (`Ok(Err)`),
    /// so the importer can fall back to the producer's `__dlpack__`, whose error is the producer's
    /// documented one (torch's table raises a `RuntimeError` with a C++ trace for a sparse tensor,
    /// its `__dlpack__` a `BufferError`).
    #[inline]
    pub(crate) fn managed_tensor_or_table_error(
        &self,
        obj: &Bound<'_, PyAny>,
    ) -> PyResult<PyResult<ManagedTensor>> {
        if !self.serves(obj) {
            return Err(Self::wrong_type(obj));
        }
        if let Some(state) = self.torch_state {
            refuse_requires_grad(obj, state)?;
        }
        let f = self.api.managed_tensor_from_py_object_no_sync.expect("checked non-NULL");
        let mut out: *mut DLManagedTensorVersioned = std::ptr::null_mut();
        // SAFETY: `obj` is a live object of exactly the table's type, the GIL is held (`obj` is
        // bound to it), `out` is writable.
        let rc = unsafe { f(obj.as_ptr().cast(), &mut out) };
        if rc != 0 {
            return Ok(Err(PyErr::take(obj.py()).unwrap_or_else(|| {
                PyBufferError::new_err(
                    "the exchange API's managed_tensor_from_py_object_no_sync failed without an exception",
                )
            })));
        }
        // SAFETY: on success `out` is an owning pointer handed to us (the common case taken first).
        let common = std::ptr::NonNull::new(out).and_then(|p| unsafe { ManagedTensor::take_if_common(p) });
        let mt = match common {
            Some(mt) => mt,
            // SAFETY: as above; nothing was taken (NULL is refused without being read).
            None => unsafe { ManagedTensor::from_raw_versioned(out) }?,
        };
        // The producer's deleter (torch's takes the GIL) never runs on a thread without the GIL.
        let mt = crate::python::runtime::gate_deleter(mt);
        refuse_lazy_views(obj, Some(mt.dtype()), self.torch_state)?;
        Ok(Ok(mt))
    }

    /// The type's torch state accessors, if it has them (see [`TorchState`]).
    pub(crate) fn torch_state(&self) -> Option<&'static TorchState> {
        self.torch_state
    }

    /// The table's borrowed `DLTensor` of `obj` (valid while `obj` lives and its metadata is not
    /// changed, so read it at once), or `Ok(None)` when the table has no
    /// `dltensor_from_py_object_no_sync`; `TypeError` unless `obj` is exactly of the table's type.
    /// A borrowed `DLTensor` cannot say read-only: treat it as the producer's promise that writing
    /// is allowed (dlbridge's own table refuses read-only tensors here). Tensors whose memory does
    /// not hold their values as DLPack reads them (torch's lazily conjugated views) are refused.
    pub fn dltensor(&self, obj: &Bound<'_, PyAny>) -> PyResult<Option<DLTensor>> {
        if !self.serves(obj) {
            return Err(Self::wrong_type(obj));
        }
        // No requires_grad refusal: a borrowed view is what kernel ABIs take (tvm-ffi through this
        // very table, nanobind through torch.utils.dlpack.to_dlpack), and reading a tensor that
        // requires grad harms nothing; writing into a leaf that does is refused where mutable
        // access is asked for (TorchState::refuse_write).
        if self.api.dltensor_from_py_object_no_sync.is_none() {
            return Ok(None);
        }
        let mut t = DLTensor {
            data: std::ptr::null_mut(),
            device: crate::Device::CPU.to_raw(),
            ndim: 0,
            dtype: DataType::UINT8.to_raw(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        Ok(self.dltensor_into(obj, &mut t)?.then_some(t))
    }

    /// [`ExchangeApi::dltensor`] written into `out` (no copy of the whole struct through the
    /// result: a borrowed view writes it where it lives); `Ok(false)` when the table has no
    /// `dltensor_from_py_object_no_sync` (`out` then holds nothing usable).
    #[inline]
    pub(crate) fn dltensor_into(&self, obj: &Bound<'_, PyAny>, out: &mut DLTensor) -> PyResult<bool> {
        if !self.serves(obj) {
            return Err(Self::wrong_type(obj));
        }
        if self.api.dltensor_from_py_object_no_sync.is_none() {
            return Ok(false);
        }
        if let Some(done) = self.stable_dltensor_checked(obj, out) {
            return done.map(|()| true);
        }
        // The lazy-view checks first: they may run Python (a subclass's methods, a torch function
        // mode, the first search for ATen's kernels), which may replace the tensor's storage. After
        // the table's call nothing runs Python until the borrowed description is used.
        refuse_lazy_views(obj, None, self.torch_state)?;
        match self.dltensor_from_table(obj)? {
            Some(t) => {
                *out = t;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The checked description of exactly `torch.Tensor` through torch's stable accessors and
    /// ATen's bits, none of which runs Python: the negative bit, the description, the conjugate
    /// bit for a complex tensor. `None`: not decided here (another type, not verified, not
    /// described: not on the CPU, an unusual tensor): the table's path.
    #[inline]
    fn stable_dltensor_checked(&self, obj: &Bound<'_, PyAny>, out: &mut DLTensor) -> Option<PyResult<()>> {
        self.torch_state?;
        let bits = super::torch_bits::aten_bits_found(obj.py())?;
        if bits.is_neg(obj)? {
            return Some(Err(lazy_view_error("is_neg", "the negative bit set", "resolve_neg")));
        }
        if !bits.stable_dltensor_into(obj, out) {
            return None;
        }
        let complex = DataType::from(out.dtype).code() == crate::dtype::TypeCode::COMPLEX;
        if complex && bits.is_conj(obj)? {
            return Some(Err(lazy_view_error("is_conj", "the conjugate bit set", "resolve_conj")));
        }
        Some(Ok(()))
    }

    /// For a type with torch's state: `obj`'s description read through torch's stable accessors on
    /// its own `at::Tensor` (exactly `torch.Tensor` on the CPU, verified: a few C calls, where the
    /// table's borrowed export retakes the GIL and copies the tensor); `None`: ask the table.
    #[inline]
    fn stable_dltensor(&self, obj: &Bound<'_, PyAny>) -> Option<DLTensor> {
        self.torch_state?;
        super::torch_bits::aten_bits_found(obj.py())?.stable_dltensor(obj)
    }

    /// The table's borrowed `DLTensor` of `obj`, with no check of dlbridge's but the type's (runs
    /// no Python).
    pub(crate) fn dltensor_unchecked(&self, obj: &Bound<'_, PyAny>) -> PyResult<Option<DLTensor>> {
        if !self.serves(obj) {
            return Err(Self::wrong_type(obj));
        }
        if self.api.dltensor_from_py_object_no_sync.is_none() {
            return Ok(None);
        }
        if let Some(t) = self.stable_dltensor(obj) {
            return Ok(Some(t));
        }
        self.dltensor_from_table(obj)
    }

    /// The table's own borrowed `DLTensor` of `obj` (`dltensor_from_py_object_no_sync`), with no
    /// check of dlbridge's but the type's (runs no Python).
    fn dltensor_from_table(&self, obj: &Bound<'_, PyAny>) -> PyResult<Option<DLTensor>> {
        if !self.serves(obj) {
            return Err(Self::wrong_type(obj));
        }
        let Some(f) = self.api.dltensor_from_py_object_no_sync else { return Ok(None) };
        let mut t = std::mem::MaybeUninit::<DLTensor>::zeroed();
        // SAFETY: a live object of exactly the table's type, the GIL held, a writable DLTensor.
        if unsafe { f(obj.as_ptr().cast(), t.as_mut_ptr()) } != 0 {
            return Err(PyErr::take(obj.py()).unwrap_or_else(|| {
                PyBufferError::new_err("dltensor_from_py_object_no_sync failed without an exception")
            }));
        }
        // SAFETY: filled by a successful call (and zeroed before it).
        Ok(Some(unsafe { t.assume_init() }))
    }
}

impl ExchangeApi {
    /// A new object of the table's type over `t` (`managed_tensor_to_py_object_no_sync`), without
    /// copying and without stream synchronisation. The producer's deleter runs exactly once: when
    /// the new object is freed, or, if the table refuses the tensor without releasing it (torch
    /// keeps neither the tensor nor its deleter when it throws), here.
    ///
    /// Refused for a type with torch's state, with a message saying why: a read-only tensor (torch
    /// has no read-only tensors and its table ignores the flag, so the memory would come back
    /// writable) and negative strides (torch has none).
    ///
    /// Once handed over, the tensor is the framework's: the producer's deleter runs on the thread
    /// where the framework frees the new object (torch frees a tensor with the GIL released), as it
    /// would after the framework's own `from_dlpack` of that producer. The deleter gate
    /// (`release::gate_deleter`) guards the drops dlbridge makes, not the framework's.
    pub fn to_py_object<'py>(&self, py: Python<'py>, t: ManagedTensor) -> PyResult<Bound<'py, PyAny>> {
        if let Some(e) = self.refusal(&t) {
            return Err(e);
        }
        // Our own struct over the tensor, whose owner tells whether the table released it. The
        // framework frees it where it chooses, so the producer's deleter runs there (ungated): a
        // queued deleter would cost torch's round trip ~170 ns of pending-call machinery here.
        let owner = Arc::new(t.without_deleter_gate());
        let alive = Arc::downgrade(&owner);
        let raw = owner.export_versioned();
        drop(owner);
        // SAFETY: `raw` is an owning struct whose only owner `alive` watches.
        unsafe { self.hand_over(py, raw, alive) }
    }

    /// [`ExchangeApi::to_py_object`] for a tensor whose own struct is watched: `alive` must die
    /// exactly when that struct is deleted (its owner holds the token). No second struct is made.
    pub(crate) fn give_watched<'py, W>(
        &self,
        py: Python<'py>,
        t: ManagedTensor,
        alive: std::sync::Weak<W>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some(e) = self.refusal(&t) {
            return Err(e);
        }
        let raw = t.into_versioned_raw();
        // SAFETY: the caller's promise: `alive` dies exactly when `raw` is deleted.
        unsafe { self.hand_over(py, raw, alive) }
    }

    /// What torch cannot take, with the reason.
    fn refusal(&self, t: &ManagedTensor) -> Option<PyErr> {
        if !self.is_torch() {
            return None;
        }
        let why = if t.is_read_only() {
            "torch tensors are always writable"
        } else if t.strides().iter().zip(t.shape()).any(|(&s, &d)| s < 0 && d > 1) {
            "torch tensors cannot have negative strides"
        } else {
            return None;
        };
        Some(PyBufferError::new_err(format!(
            "cannot return this tensor as a torch.Tensor ({why}): {}; return a copy \
             (ManagedTensor::to_contiguous) instead",
            t.describe()
        )))
    }

    /// Calls `managed_tensor_to_py_object_no_sync` on `raw`; on failure, deletes `raw` if the
    /// table did not (`alive` still alive).
    ///
    /// # Safety
    ///
    /// `raw` is a live owning struct handed over here; `alive` dies exactly when it is deleted.
    unsafe fn hand_over<'py, W>(
        &self,
        py: Python<'py>,
        raw: NonNull<DLManagedTensorVersioned>,
        alive: std::sync::Weak<W>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let f = self.api.managed_tensor_to_py_object_no_sync.expect("checked non-NULL");
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: an owning versioned struct handed over, the GIL held (`py`), a writable out-pointer.
        if unsafe { f(raw.as_ptr(), &mut out) } != 0 {
            let err = PyErr::take(py).unwrap_or_else(|| {
                PyBufferError::new_err("managed_tensor_to_py_object_no_sync failed without an exception")
            });
            if alive.strong_count() > 0 {
                // SAFETY: the table refused the struct and did not delete it (its owner is alive),
                // so it is still ours to delete, once.
                unsafe {
                    if let Some(d) = (*raw.as_ptr()).deleter {
                        d(raw.as_ptr());
                    }
                }
            }
            return Err(err);
        }
        // SAFETY: on success a new reference (NULL is an error).
        unsafe { Bound::from_owned_ptr_or_err(py, out.cast()) }
    }

    /// A new compact row-major tensor of `dtype` and `shape` on `device` from the table's
    /// allocator (`managed_tensor_allocator`: torch's caching allocator), its contents
    /// uninitialised; what came back is validated and checked to be what was asked.
    pub fn allocate(
        &self,
        py: Python<'_>,
        dtype: DataType,
        shape: &[i64],
        device: crate::Device,
    ) -> PyResult<ManagedTensor> {
        let f = self.api.managed_tensor_allocator.expect("checked non-NULL");
        let mut shape_buf = shape.to_vec();
        let mut prototype = DLTensor {
            data: std::ptr::null_mut(),
            device: device.to_raw(),
            ndim: shape.len() as i32,
            dtype: dtype.to_raw(),
            shape: shape_buf.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        let mut out: *mut DLManagedTensorVersioned = std::ptr::null_mut();
        let mut error: Option<(String, String)> = None;
        // SAFETY: a prototype whose shape outlives the call, a writable out-pointer, and a
        // `set_error` that writes only into `error` (alive for the call); the GIL held.
        let rc =
            unsafe { f(&mut prototype, &mut out, std::ptr::addr_of_mut!(error).cast(), Some(collect_error)) };
        if rc != 0 || out.is_null() {
            let (kind, msg) =
                error.unwrap_or_else(|| ("RuntimeError".into(), "failed without an error".into()));
            let msg = format!("managed_tensor_allocator: {msg}");
            return Err(match kind.as_str() {
                "MemoryError" => pyo3::exceptions::PyMemoryError::new_err(msg),
                "ValueError" => pyo3::exceptions::PyValueError::new_err(msg),
                "TypeError" => pyo3::exceptions::PyTypeError::new_err(msg),
                "BufferError" => PyBufferError::new_err(msg),
                _ => pyo3::exceptions::PyRuntimeError::new_err(format!("{kind}: {msg}")),
            });
        }
        // SAFETY: an owning pointer handed to us; validation deletes it on refusal.
        let t = crate::python::runtime::gate_deleter(unsafe { ManagedTensor::from_raw_versioned(out) }?);
        let asked = t.dtype() == dtype && t.shape() == shape && t.device() == device && t.is_c_contiguous();
        if !asked || t.is_read_only() {
            return Err(PyBufferError::new_err(format!(
                "managed_tensor_allocator: asked for a writable C-contiguous {dtype} {} on {device}, got {}",
                crate::error::tuple(shape),
                t.describe()
            )));
        }
        let _ = py;
        Ok(t)
    }

    /// The table owner's current work stream on `device` (`current_work_stream`: torch's current
    /// CUDA stream), or `None` (NULL: the default stream, or a device with no streams).
    pub fn current_work_stream(
        &self,
        py: Python<'_>,
        device: crate::Device,
    ) -> PyResult<Option<NonNull<c_void>>> {
        let f = self.api.current_work_stream.expect("checked non-NULL");
        let mut stream: *mut c_void = std::ptr::null_mut();
        let raw = device.to_raw();
        // SAFETY: plain values and a writable out-pointer, the GIL held (`py`).
        if unsafe { f(raw.device_type, raw.device_id, &mut stream) } != 0 {
            return Err(PyErr::take(py).unwrap_or_else(|| {
                PyBufferError::new_err("current_work_stream failed without an exception")
            }));
        }
        Ok(NonNull::new(stream))
    }
}

/// The `set_error` given to an allocator: records the kind and message into the
/// `Option<(String, String)>` at `ctx`.
unsafe extern "C" fn collect_error(
    ctx: *mut c_void,
    kind: *const std::ffi::c_char,
    message: *const std::ffi::c_char,
) {
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: the allocator passes NUL-terminated strings that outlive the call.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let (kind, message) = (text(kind), text(message));
    // SAFETY: `ctx` is the `Option<(String, String)>` `allocate` passed, alive for the call.
    if let Some(slot) = unsafe { ctx.cast::<Option<(String, String)>>().as_mut() } {
        *slot = Some((kind, message));
    }
}

/// `torch.is_grad_enabled()`, called through Python (where c10's reader was not verified).
fn grad_enabled_py(py: Python<'_>) -> PyResult<bool> {
    static GRAD_ENABLED: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    GRAD_ENABLED
        .get_or_try_init(py, || py.import("torch")?.getattr("is_grad_enabled").map(Bound::unbind))
        .and_then(|f| f.bind(py).call0()?.is_truthy())
}

/// torch's `__dlpack__` refuses a tensor that requires grad ("use tensor.detach()"); its table
/// does not look. One C getter call per import.
#[inline]
fn refuse_requires_grad(obj: &Bound<'_, PyAny>, state: &TorchState) -> PyResult<()> {
    if state.requires_grad(obj)? {
        return Err(PyBufferError::new_err(
            "requires_grad: can't export tensors that require gradient (as torch's __dlpack__ refuses); \
             use tensor.detach()",
        ));
    }
    Ok(())
}

/// torch keeps `z.conj()` and negated views lazy: a bit on the tensor says the memory holds the
/// values before conjugation or negation, and the table (and, for the negative bit, even torch's
/// own `__dlpack__`) exports them as if the memory held the result, so the reader would see
/// wrong values. Complex tensors can carry both bits, real ones (`z.conj().imag`) the negative one:
/// one C call per torch import, a second for complex tensors.
#[inline]
fn refuse_lazy_views(
    obj: &Bound<'_, PyAny>,
    dtype: Option<DataType>,
    state: Option<&TorchState>,
) -> PyResult<()> {
    let Some(state) = state else { return Ok(()) };
    refuse_negative_bit(obj, state)?;
    // (`None`: the dtype is not known yet; the bit is asked whatever it is.)
    if dtype.is_none_or(|d| d.code() == crate::dtype::TypeCode::COMPLEX) && state.is_conj(obj)? {
        return Err(lazy_view_error("is_conj", "the conjugate bit set", "resolve_conj"));
    }
    Ok(())
}

/// The negative-bit refusal alone: what the protocol path needs too, since torch's own
/// `__dlpack__` refuses the conjugate bit and `requires_grad` but exports a negated tensor with
/// the wrong sign.
#[inline]
pub(crate) fn refuse_negative_bit(obj: &Bound<'_, PyAny>, state: &TorchState) -> PyResult<()> {
    if state.is_neg(obj)? {
        return Err(lazy_view_error("is_neg", "the negative bit set", "resolve_neg"));
    }
    Ok(())
}

#[cold]
fn lazy_view_error(method: &str, what: &str, fix: &str) -> PyErr {
    PyBufferError::new_err(format!(
        "{method}: the tensor has {what} (its memory holds other values than it shows); call .{fix}() first"
    ))
}

// ---------------------------------------------------------------------------------------------
// Producer: the table dlbridge.Tensor publishes.

/// Calls `set_error(error_ctx, kind, message)` if given.
fn report(error_ctx: *mut c_void, set_error: DLPackSetError, kind: &CStr, message: &str) {
    if let Some(f) = set_error {
        let msg = std::ffi::CString::new(message.replace('\0', " ")).unwrap_or_default();
        // SAFETY: the consumer's callback with NUL-terminated strings that outlive the call.
        unsafe { f(error_ctx, kind.as_ptr(), msg.as_ptr()) }
    }
}

unsafe extern "C" fn allocator(
    prototype: *mut DLTensor,
    out: *mut *mut DLManagedTensorVersioned,
    error_ctx: *mut c_void,
    set_error: DLPackSetError,
) -> c_int {
    let result = std::panic::catch_unwind(|| {
        // SAFETY: the consumer passes a readable prototype (only dtype, ndim, shape, device read).
        let p = unsafe { prototype.as_ref() }.ok_or("prototype is NULL")?;
        if p.device.device_type != DLDeviceType::CPU {
            return Err("dlbridge allocates host (cpu) memory only");
        }
        let dtype = DataType::from(p.dtype);
        dtype.validate().map_err(|_| "prototype dtype is not valid")?;
        let ndim = usize::try_from(p.ndim)
            .ok()
            .filter(|&n| n <= crate::MAX_NDIM)
            .ok_or("prototype ndim out of range")?;
        if ndim > 0 && p.shape.is_null() {
            return Err("prototype shape is NULL");
        }
        // SAFETY: ndim readable entries (checked non-NULL).
        let shape = if ndim == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(p.shape, ndim) } };
        let numel = crate::layout::element_count(shape).map_err(|_| "prototype shape is invalid")?;
        let bytes = crate::layout::compact_byte_size(numel, dtype.storage_bits(false))
            .map_err(|_| "tensor too large")?;
        let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        let t = ManagedTensor::from_host_bytes(
            AlignedBuffer::<u8>::zeroed(bytes as usize),
            dtype,
            &dims,
            None,
            0,
        )
        .map_err(|_| "allocation refused")?;
        match t.into_raw() {
            crate::RawManagedTensor::Versioned(v) => Ok(v),
            crate::RawManagedTensor::Legacy(_) => Err("internal: exports are versioned"),
        }
    });
    match result {
        Ok(Ok(v)) if !out.is_null() => {
            // SAFETY: `out` is the consumer's writable out-pointer.
            unsafe { *out = v };
            0
        }
        Ok(Ok(v)) => {
            // SAFETY: nowhere to hand it: free it.
            drop(unsafe { ManagedTensor::from_raw_versioned(v) });
            report(error_ctx, set_error, c"ValueError", "managed_tensor_allocator: out is NULL");
            -1
        }
        Ok(Err(msg)) => {
            report(error_ctx, set_error, c"BufferError", &format!("managed_tensor_allocator: {msg}"));
            -1
        }
        Err(_) => {
            report(error_ctx, set_error, c"MemoryError", "managed_tensor_allocator: allocation failed");
            -1
        }
    }
}

/// The dlbridge.Tensor behind a raw object pointer, or a Python TypeError set.
///
/// # Safety
///
/// The GIL is held and `obj` is a live object.
unsafe fn tensor_of<'py>(py: Python<'py>, obj: *mut c_void) -> Option<Bound<'py, Tensor>> {
    if obj.is_null() {
        crate::python::runtime::fastcall::raise(PyBufferError::new_err("exchange API: py_object is NULL"));
        return None;
    }
    // SAFETY: the caller's promise: a live object, borrowed.
    let any = unsafe { Bound::from_borrowed_ptr(py, obj.cast()) };
    match any.cast_into::<Tensor>() {
        Ok(t) => Some(t),
        Err(e) => {
            crate::python::runtime::fastcall::raise(PyErr::from(e));
            None
        }
    }
}

unsafe extern "C" fn from_py_object_no_sync(
    py_object: *mut c_void,
    out: *mut *mut DLManagedTensorVersioned,
) -> c_int {
    // SAFETY: the exchange API is called with the GIL held (it passes Python objects).
    let py = unsafe { Python::assume_attached() };
    // SAFETY: as above.
    let Some(t) = (unsafe { tensor_of(py, py_object) }) else { return -1 };
    if out.is_null() {
        crate::python::runtime::fastcall::raise(PyBufferError::new_err("exchange API: out is NULL"));
        return -1;
    }
    if let Some(e) = t.get().unsynchronised_export_refusal() {
        crate::python::runtime::fastcall::raise(e);
        return -1;
    }
    let p = t.get().shared().export_versioned();
    // SAFETY: the consumer's writable out-pointer.
    unsafe { *out = p.as_ptr() };
    0
}

unsafe extern "C" fn to_py_object_no_sync(
    tensor: *mut DLManagedTensorVersioned,
    out_py_object: *mut *mut c_void,
) -> c_int {
    // SAFETY: called with the GIL held.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: the consumer hands over (steals into) an owning pointer; validation deletes it on refusal.
    let t = match unsafe { ManagedTensor::from_raw_versioned(tensor) } {
        // Whoever produced it, its deleter may take the GIL.
        Ok(t) => crate::python::runtime::gate_deleter(t),
        Err(e) => {
            crate::python::runtime::fastcall::raise(PyErr::from(e));
            return -1;
        }
    };
    match Bound::new(py, Tensor::new(t)) {
        Ok(obj) if !out_py_object.is_null() => {
            // SAFETY: a writable out-pointer; the new reference passes to the caller.
            unsafe { *out_py_object = obj.into_ptr().cast() };
            0
        }
        Ok(_) => {
            crate::python::runtime::fastcall::raise(PyBufferError::new_err(
                "exchange API: out_py_object is NULL",
            ));
            -1
        }
        Err(e) => {
            crate::python::runtime::fastcall::raise(e);
            -1
        }
    }
}

unsafe extern "C" fn dltensor_from_py_object_no_sync(py_object: *mut c_void, out: *mut DLTensor) -> c_int {
    // SAFETY: called with the GIL held.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: as above.
    let Some(t) = (unsafe { tensor_of(py, py_object) }) else { return -1 };
    if out.is_null() {
        crate::python::runtime::fastcall::raise(PyBufferError::new_err("exchange API: out is NULL"));
        return -1;
    }
    if let Some(e) = t.get().unsynchronised_export_refusal() {
        crate::python::runtime::fastcall::raise(e);
        return -1;
    }
    let inner: &Arc<ManagedTensor> = t.get().shared();
    // A borrowed DLTensor has no flags: a consumer would take read-only memory as writable, and
    // padded sub-byte elements as packed (reading other values, over half the memory).
    let flagged = if inner.is_read_only() {
        Some("read-only")
    } else if inner.flags().is_subbyte_padded() && inner.dtype().bits() < 8 {
        Some("sub-byte elements padded to a byte each")
    } else {
        None
    };
    if let Some(what) = flagged {
        crate::python::runtime::fastcall::raise(PyBufferError::new_err(format!(
            "dltensor_from_py_object_no_sync: the tensor is {what}, which a borrowed DLTensor \
             cannot say; use managed_tensor_from_py_object_no_sync"
        )));
        return -1;
    }
    let mut d = *inner.dl_tensor();
    // Shape and strides point into the tensor, which the borrowed object keeps alive; strides are
    // always materialised (NULL-stride producers get the tensor's own copy).
    d.strides = if inner.ndim() == 0 { std::ptr::null_mut() } else { inner.strides().as_ptr().cast_mut() };
    // SAFETY: the consumer's writable DLTensor.
    unsafe { *out = d };
    0
}

unsafe extern "C" fn current_work_stream(
    _device_type: DLDeviceType,
    _device_id: i32,
    out: *mut *mut c_void,
) -> c_int {
    // dlbridge queues no work on any stream: its current work stream is always "none".
    if !out.is_null() {
        // SAFETY: the consumer's writable out-pointer.
        unsafe { *out = std::ptr::null_mut() };
    }
    0
}

/// The table `dlbridge.Tensor` publishes (a process-lifetime static, as the standard requires).
pub static TENSOR_EXCHANGE_API: DLPackExchangeAPI = DLPackExchangeAPI {
    header: DLPackExchangeAPIHeader {
        version: DLPackVersion {
            major: crate::ffi::DLPACK_MAJOR_VERSION,
            minor: crate::ffi::DLPACK_MINOR_VERSION,
        },
        prev_api: std::ptr::null_mut(),
    },
    managed_tensor_allocator: Some(allocator),
    managed_tensor_from_py_object_no_sync: Some(from_py_object_no_sync),
    managed_tensor_to_py_object_no_sync: Some(to_py_object_no_sync),
    dltensor_from_py_object_no_sync: Some(dltensor_from_py_object_no_sync),
    current_work_stream: Some(current_work_stream),
};

/// The `"dlpack_exchange_api"` capsule over [`TENSOR_EXCHANGE_API`].
pub fn tensor_exchange_capsule(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let p = NonNull::from(&TENSOR_EXCHANGE_API);
    // SAFETY: a static table, a static name, no destructor (nothing to free).
    let cap = unsafe { ffi::PyCapsule_New(p.as_ptr().cast(), EXCHANGE_API_CAPSULE.as_ptr(), None) };
    // SAFETY: a new reference or NULL with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, cap) }
}

/// Whether `obj` has no version counter while inference mode is off (torch's refusal of an
/// in-place write), asked through torch's Python attributes (for what [`super::torch_bits`] does
/// not read: a subclass, or a torch whose functions were not verified): `_version` raises
/// `RuntimeError` exactly when there is no counter.
fn write_refused_without_counter(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = obj.py();
    match obj.getattr(intern!(py, "_version")) {
        Ok(_) => return Ok(false),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyRuntimeError>(py) => {}
        Err(e) => return Err(e),
    }
    static MODE: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    let mode = MODE.get_or_try_init(py, || {
        py.import("torch")?.getattr("is_inference_mode_enabled").map(Bound::unbind)
    })?;
    Ok(!mode.bind(py).call0()?.is_truthy()?)
}

/// Why torch refuses an in-place write into `obj`, a tensor that requires grad, while grad mode
/// is on (its `check_inplace`): a leaf; a view whose base is a leaf; a view it cannot rebase (its
/// creation metadata is not `DEFAULT`). `None`: torch writes it (a non-leaf, a plain view of one).
fn grad_write_refusal(state: &TorchState, obj: &Bound<'_, PyAny>) -> PyResult<Option<&'static str>> {
    let py = obj.py();
    if TorchState::get(state.is_leaf.as_ref(), obj, intern!(py, "is_leaf"))? {
        return Ok(Some("a leaf tensor that requires grad"));
    }
    let base = obj.getattr(intern!(py, "_base"))?;
    if base.is_none() {
        return Ok(None);
    }
    let autograd = py.import("torch")?.getattr("_C")?.getattr("_autograd")?;
    let meta = autograd.call_method1("_get_creation_meta", (obj,))?;
    if !meta.eq(autograd.getattr("CreationMeta")?.getattr("DEFAULT")?)? {
        return Ok(Some(
            "a view torch cannot rebase (the output of a function returning several views, of a custom \
             Function, or made under no_grad or inference mode) that requires grad",
        ));
    }
    if base.getattr(intern!(py, "is_leaf"))?.is_truthy()? {
        return Ok(Some("a view of a leaf tensor that requires grad"));
    }
    Ok(None)
}
