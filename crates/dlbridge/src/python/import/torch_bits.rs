//! torch's negative and conjugate bits, read through ATen's own native functions instead of the
//! Python methods.
//!
//! `Tensor.is_neg()` and `Tensor.is_conj()` are generated bindings that release and retake the GIL
//! around a one-bit read: measured here, `is_neg()` alone cost ~100 ns of a torch import that costs
//! ~270 ns without it (more than dlbridge's whole validation), and there is no getter or
//! hand-written method that shows the bit (it survives `detach()`, which drops `_base`, and
//! `torch._C._set_neg` can set it on a live tensor, so nothing can be cached). ATen exports the
//! operators' native kernels from `libtorch_cpu` (`at::native::is_neg(const at::Tensor&)`, the
//! kernel the `is_neg` operator dispatches to: `return self.is_neg();`, a read of one bit of the
//! tensor's dispatch key set): called with the GIL held and no Python in between, a few
//! instructions. (The operator's dispatcher entry, `at::_ops::is_neg::call`, measured ~30 ns.)
//!
//! What this relies on, checked once per process before it is used (else the methods are called,
//! as before):
//! - the type is torch's own `torch.Tensor`: the class `libtorch_python` holds in its global
//!   `THPVariableClass` (what `THPVariable_Check` tests against), whose first static base lies in
//!   `libtorch_python` itself (`dladdr`); never the `Tensor` attribute of `sys.modules["torch"]`,
//!   which any Python code can replace (a stand-in with a slot where `cdata` sits passed the
//!   probes, and ATen's bump then wrote through a pointer the stand-in chose);
//! - an instance of exactly `torch.Tensor` is a `THPVariable`, whose `at::Tensor cdata` (one
//!   `TensorImpl` pointer) follows the object header: the layout of torch's public header
//!   `torch/csrc/autograd/python_variable.h`, which every C++ extension inlines
//!   (`THPVariable_Unpack`). Checked: the type's `tp_basicsize` covers it, and for each probe tensor
//!   the pointer there is the one `Tensor._cdata` reports;
//! - the two symbols exist in the `libtorch_cpu` torch has loaded (found by its soname with
//!   `RTLD_NOLOAD`: never loaded by dlbridge), and agree with `is_neg()`/`is_conj()` on probes with and without each bit
//!   (a negated view, `conj()`, `conj().imag`, a detached negated view, 0-d, empty, bfloat16, one
//!   that requires grad).
//!
//! Only instances of exactly `torch.Tensor` take this path: a subclass may route operators through
//! `__torch_dispatch__` (Python) and is asked through its methods.
//!
//! The same way, and verified the same way (separately: if it does not hold, only this part falls
//! back to torch's Python functions), what a write needs: the version counter is bumped through
//! `torch::autograd::impl::bump_version` (what `torch._C._increment_version` calls, without the
//! Python call around it: ~180 ns here, more inside a compiled custom op), grad mode is read
//! through `c10::GradMode::is_enabled` (the thread-local `torch.is_grad_enabled()` reads), and
//! inference mode through `c10::InferenceMode::is_enabled`. A tensor may have no version counter:
//! an inference tensor, and also a plain tensor whose `.data` was one (its keys no longer say
//! inference). torch's bump throws a C++ exception for such a tensor outside inference mode, and
//! an exception must never cross into Rust; so the counter itself is read first
//! (`torch::autograd::impl::version_counter`, a reference to the `TensorImpl`'s
//! `c10::VariableVersion`, whose one field is the counter's pointer, NULL when there is none), and
//! the bump is made only when it exists. Writing a tensor without a counter outside inference mode
//! is refused before (what torch refuses of `x.add_()`), and inside inference mode there is
//! nothing to bump.
//!
//! The same way, what keeps a borrowed view's memory valid whatever Python runs while the view
//! lives (see [`Keep`]): the storage's `c10::DataPtr` is given a keeper shared with the view.
//!
//! Checked on probes made outside inference mode, whatever mode torch is first seen in: the
//! counter is there exactly where `_version` can be read (a tensor, a view of it, an inference
//! tensor, a plain tensor whose `.data` is an inference tensor); the bump adds exactly one to
//! `_version` and to a view's, which shares the counter; grad mode agrees with
//! `torch.is_grad_enabled()` both ways; inference mode agrees now, inside `torch.inference_mode()`
//! and inside `torch.inference_mode(False)`.

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// `bool at::native::is_neg(const at::Tensor&)` (and `is_conj`): the argument is a pointer to an
/// `at::Tensor`; C-unwind, since C++ may in principle throw (then the process aborts at the next
/// catch, never undefined behaviour).
type BitFn = unsafe extern "C-unwind" fn(*const c_void) -> bool;
/// `void torch::autograd::impl::bump_version(const at::Tensor&)`.
type TensorFn = unsafe extern "C-unwind" fn(*const c_void);
/// `const c10::VariableVersion& torch::autograd::impl::version_counter(const at::Tensor&)`: a
/// pointer to the counter's handle (one `intrusive_ptr`: the counter's address, NULL for none).
type CounterFn = unsafe extern "C-unwind" fn(*const c_void) -> *const *const c_void;
/// `bool c10::GradMode::is_enabled()`.
type FlagFn = unsafe extern "C-unwind" fn() -> bool;

/// ATen's native kernels and the exact type they were verified for.
pub(crate) struct AtenBits {
    is_neg: BitFn,
    is_conj: BitFn,
    /// The address of torch's own `torch.Tensor` (`libtorch_python`'s `THPVariableClass`, which
    /// torch never releases).
    ty: usize,
    /// The address of `c10::UndefinedTensorImpl::_singleton`: the `TensorImpl` of an undefined
    /// tensor, which a `THPVariable` holds once the cyclic GC has cleared it (`THPVariable_clear`;
    /// a finalizer of the same collection may still reach it). ATen's functions are never called
    /// on it (`version_counter` throws a C++ exception there).
    undefined: usize,
    /// The version counter and grad mode, when found and verified (else torch's Python functions).
    versions: Option<Versions>,
    /// Where a tensor's storage keeps its memory, when found and verified (see [`Keep`]).
    keep: Option<Keep>,
    /// `bool c10::TensorImpl::requires_grad() const` (its `this`: the tensor's `TensorImpl`), when
    /// found and verified against the `requires_grad` getter on probes (else the getter is asked).
    requires_grad: Option<BitFn>,
    /// torch's stable accessors reading a tensor's description on its own `at::Tensor` (the
    /// `cdata`), when found and verified against the exchange table's borrowed `DLTensor` on
    /// probes (else the table is asked).
    stable: Option<Stable>,
}

/// The stable accessors a borrowed view reads (`torch_stable`, Unix).
#[cfg(all(feature = "torch-stable", unix))]
type Stable = crate::torch_stable::Describer;
/// No stable accessors here.
#[cfg(not(all(feature = "torch-stable", unix)))]
#[derive(Clone, Copy)]
enum Stable {}

/// torch's version bump, inference test and grad mode (see the module docs).
struct Versions {
    bump_version: TensorFn,
    version_counter: CounterFn,
    grad_enabled: FlagFn,
    inference_mode: FlagFn,
}

impl Versions {
    /// Whether the tensor at `t` has a version counter.
    ///
    /// # Safety
    ///
    /// `t` points to a live, defined `at::Tensor` (a verified `THPVariable`'s `cdata`), the GIL
    /// held.
    #[inline]
    unsafe fn has_counter(&self, t: *const c_void) -> bool {
        // SAFETY: the caller's promise; the function returns a reference to the tensor's
        // `VariableVersion` (verified on probes), whose first word is the counter's pointer.
        unsafe { !(*(self.version_counter)(t)).is_null() }
    }
}

/// What [`AtenBits::bump_version`] did.
pub(crate) enum Bump {
    /// The counter went up by one.
    Done,
    /// The tensor has no counter: nothing to bump (writing it outside inference mode was refused
    /// before, by [`AtenBits::write_refused_without_counter`]).
    NoCounter,
    /// Not decided here (not exactly `torch.Tensor`, or not verified): torch's Python function.
    NotHere,
}

/// Where `cdata` sits in a `THPVariable`: right after the object header.
const CDATA_OFFSET: usize = std::mem::size_of::<ffi::PyObject>();

unsafe extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

static BITS: PyOnceLock<Option<AtenBits>> = PyOnceLock::new();
/// Set while [`find`] runs. It runs Python (the probes), from which dlbridge may be called again
/// (a finalizer, a mode, another thread while the probes release the GIL): those calls use the
/// methods instead of waiting for the lock held by the search that called them.
static FINDING: AtomicBool = AtomicBool::new(false);

/// The verified kernels, found once per process (`None`: use the methods). Decided the first time
/// it is asked with torch imported (a duck-typed tensor seen before torch is imported decides
/// nothing); an interrupt during the search decides nothing either (it is raised again).
#[inline]
pub(crate) fn aten_bits(py: Python<'_>) -> Option<&'static AtenBits> {
    if let Some(found) = BITS.get(py) {
        return found.as_ref();
    }
    search(py)
}

/// The verified kernels if the one-time search has already decided (never starts it: it runs
/// Python, which must not run between taking a view and using it).
#[inline]
pub(crate) fn aten_bits_found(py: Python<'_>) -> Option<&'static AtenBits> {
    BITS.get(py)?.as_ref()
}

#[cold]
#[inline(never)]
fn search(py: Python<'_>) -> Option<&'static AtenBits> {
    if !torch_imported(py) || FINDING.swap(true, Ordering::AcqRel) {
        return None;
    }
    let found = find(py);
    FINDING.store(false, Ordering::Release);
    let found = match found {
        Ok(found) => found,
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) => {
            // Not swallowed: raised again at the interpreter's next check; nothing is decided.
            // SAFETY: callable with the GIL held; it only flags a pending SIGINT.
            unsafe { ffi::PyErr_SetInterrupt() };
            return None;
        }
        // Any other failure: the methods, for good (a torch this does not understand).
        Err(_) => None,
    };
    // Only this search sets it (FINDING), so this is the value kept.
    let _ = BITS.set(py, found);
    BITS.get(py)?.as_ref()
}

/// Whether `torch` is in `sys.modules` (dlbridge never imports it for this).
#[cold]
fn torch_imported(py: Python<'_>) -> bool {
    py.import("sys")
        .and_then(|sys| sys.getattr("modules"))
        .is_ok_and(|m| m.contains("torch").unwrap_or(false))
}

impl AtenBits {
    /// The pointer to `obj`'s `at::Tensor`, if `obj` is exactly of the verified type.
    #[inline]
    /// `None` too for an undefined tensor (cleared by the GC): its methods are asked instead, and
    /// say so.
    fn tensor_of(&self, obj: &Bound<'_, PyAny>) -> Option<*const c_void> {
        if obj.get_type_ptr() as usize != self.ty {
            return None;
        }
        // SAFETY: an instance of exactly the verified type is at least `tp_basicsize` long
        // (checked to cover cdata), so the offset stays inside the object; its first word is the
        // `TensorImpl` pointer (checked against `_cdata` on probes), read as the pointer-sized
        // field it is while the GIL is held.
        let t = unsafe { obj.as_ptr().cast::<u8>().add(CDATA_OFFSET).cast::<c_void>().cast_const() };
        // SAFETY: as above.
        let impl_ = unsafe { *t.cast::<usize>() };
        (impl_ != self.undefined).then_some(t)
    }

    /// `obj.is_neg()` read through ATen, or `None` when `obj` is not exactly `torch.Tensor`.
    #[inline]
    pub(crate) fn is_neg(&self, obj: &Bound<'_, PyAny>) -> Option<bool> {
        let t = self.tensor_of(obj)?;
        // SAFETY: `t` points to the live object's `at::Tensor`, a defined one (`tensor_of` refuses
        // the undefined tensor of a cleared object), the GIL is held (`obj` is bound to it), and the function is
        // ATen's native kernel of that signature (verified against the method on probes).
        Some(unsafe { (self.is_neg)(t) })
    }

    /// `obj.requires_grad` read through c10 (a few instructions, where torch's getter costs a
    /// Python attribute call), or `None` when `obj` is not exactly `torch.Tensor` or the function
    /// was not verified.
    #[inline]
    pub(crate) fn requires_grad(&self, obj: &Bound<'_, PyAny>) -> Option<bool> {
        let f = self.requires_grad?;
        let t = self.tensor_of(obj)?;
        // SAFETY: `t` points to the live object's defined `at::Tensor` (as in `is_neg`), whose first
        // word is its `TensorImpl` (checked against `_cdata` on probes); the function is c10's
        // const member of that name, `this` its only argument, verified against the getter on
        // probes; it reads two fields and cannot throw.
        Some(unsafe { f(*t.cast::<*const c_void>()) })
    }

    /// `obj`'s borrowed description (what torch's exchange table's `dltensor_from_py_object_no_sync`
    /// gives, read without it: see `torch_stable::Describer::describe`), or `None` when `obj` is
    /// not exactly `torch.Tensor`, the accessors were not verified, or they do not describe this
    /// tensor (not on the CPU, not strided, a dtype without a DLPack type, no storage): then the
    /// table is asked. Runs no Python. The shape and strides point into the tensor's metadata:
    /// copy them before any Python runs.
    #[inline]
    pub(crate) fn stable_dltensor(&self, obj: &Bound<'_, PyAny>) -> Option<crate::ffi::DLTensor> {
        #[cfg(all(feature = "torch-stable", unix))]
        {
            self.stable_dltensor_with(self.stable.as_ref()?, obj)
        }
        #[cfg(not(all(feature = "torch-stable", unix)))]
        {
            let _ = obj;
            match self.stable {
                None => None,
            }
        }
    }

    /// [`AtenBits::stable_dltensor`] through `describer` (verified, or being verified on probes).
    #[cfg(all(feature = "torch-stable", unix))]
    #[inline]
    fn stable_dltensor_with(
        &self,
        describer: &Stable,
        obj: &Bound<'_, PyAny>,
    ) -> Option<crate::ffi::DLTensor> {
        let t = self.tensor_of(obj)?;
        // SAFETY: `t` points to the live object's defined `at::Tensor` (as in `is_neg`), which is
        // what an `AtenTensorHandle` points to (torch's header says so; verified on probes: the
        // accessors read there what the exchange table describes); the GIL is held (`obj` is
        // bound to it), so no Python changes its metadata during the reads.
        unsafe { describer.describe(t.cast_mut().cast()) }
    }

    /// [`AtenBits::stable_dltensor`] written into `out` (`false`: not described here; `out`
    /// then holds nothing usable).
    #[inline]
    pub(crate) fn stable_dltensor_into(
        &self,
        obj: &Bound<'_, PyAny>,
        out: &mut crate::ffi::DLTensor,
    ) -> bool {
        #[cfg(all(feature = "torch-stable", unix))]
        {
            let (Some(d), Some(t)) = (self.stable.as_ref(), self.tensor_of(obj)) else { return false };
            // SAFETY: as in `stable_dltensor_with`.
            unsafe { d.describe_into(t.cast_mut().cast(), out) }
        }
        #[cfg(not(all(feature = "torch-stable", unix)))]
        {
            let _ = (obj, out);
            false
        }
    }

    /// Whether borrowed views are described through the stable accessors (verified).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn describes_stably(&self) -> bool {
        self.stable.is_some()
    }

    /// `obj.is_conj()` read through ATen, or `None` when `obj` is not exactly `torch.Tensor`.
    #[inline]
    pub(crate) fn is_conj(&self, obj: &Bound<'_, PyAny>) -> Option<bool> {
        let t = self.tensor_of(obj)?;
        // SAFETY: as in `is_neg`.
        Some(unsafe { (self.is_conj)(t) })
    }

    /// Whether the write functions (version bump, inference and grad mode) were verified.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn writes_verified(&self) -> bool {
        self.versions.is_some()
    }

    /// Whether borrowed views keep the memory valid ([`Keep`] verified).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn keeps_memory(&self) -> bool {
        self.keep.is_some()
    }

    /// Whether grad mode is on in this thread (`torch.is_grad_enabled()`), read through c10;
    /// `None` when that was not verified.
    #[inline]
    pub(crate) fn grad_enabled(&self) -> Option<bool> {
        let v = self.versions.as_ref()?;
        // SAFETY: c10's function of this signature (verified against torch.is_grad_enabled()): a
        // read of a thread-local, which cannot throw.
        Some(unsafe { (v.grad_enabled)() })
    }

    /// Whether inference mode is on in this thread (`torch.is_inference_mode_enabled()`), read
    /// through c10; `None` when that was not verified.
    #[inline]
    pub(crate) fn inference_mode(&self) -> Option<bool> {
        let v = self.versions.as_ref()?;
        // SAFETY: c10's function of this signature (verified against
        // torch.is_inference_mode_enabled()): a read of a thread-local, which cannot throw.
        Some(unsafe { (v.inference_mode)() })
    }

    /// Whether `obj` has no version counter while inference mode is off in this thread (an
    /// inference tensor, or one whose `.data` is: what torch refuses to write in place), read
    /// through ATen and c10; `None` when `obj` is not exactly `torch.Tensor` or that was not
    /// verified.
    #[inline]
    pub(crate) fn write_refused_without_counter(&self, obj: &Bound<'_, PyAny>) -> Option<bool> {
        let (v, t) = (self.versions.as_ref()?, self.tensor_of(obj)?);
        // SAFETY: `t` is the live object's tensor, the GIL held (`obj` is bound to it); then c10's
        // thread-local read (verified against torch.is_inference_mode_enabled()).
        Some(unsafe { !v.has_counter(t) && !(v.inference_mode)() })
    }

    /// The pointer to `obj`'s `at::Tensor` if `obj` is an instance of the verified type or of a
    /// subclass of it (the `THPVariable` layout: `tp_base`, which follows the layout, not the MRO a
    /// metaclass may rewrite), and not the undefined tensor of a cleared object.
    fn variable_of(&self, obj: &Bound<'_, PyAny>) -> Option<*const c_void> {
        let mut ty = obj.get_type_ptr();
        for _ in 0..64 {
            if ty.is_null() {
                return None;
            }
            if ty as usize == self.ty {
                // SAFETY: an instance of the verified type or a subtype of it by layout: at least
                // `tp_basicsize` long (checked to cover cdata), its first word there the
                // `TensorImpl` pointer, read with the GIL held.
                let t = unsafe { obj.as_ptr().cast::<u8>().add(CDATA_OFFSET).cast::<c_void>().cast_const() };
                // SAFETY: as above.
                let impl_ = unsafe { *t.cast::<usize>() };
                return (impl_ != 0 && impl_ != self.undefined).then_some(t);
            }
            // SAFETY: a live type's field (each type keeps its base alive).
            ty = unsafe { (*ty).tp_base };
        }
        None
    }

    /// Keeps the memory of `obj`'s storage valid until the returned [`Kept`] is released, whatever
    /// happens to the storage meanwhile (see [`Keep`]); call it with no Python run since the view
    /// of that memory was taken. `Ok(None)`: nothing to keep (no memory); `Err`: the memory
    /// cannot be kept (the view must be refused), with the reason; `None` from the outer option:
    /// not verified here (not a torch tensor, or an unverified torch).
    ///
    /// A keeper's allocation is taken from `spare` when it holds one (the caller's block of views:
    /// a view costs no allocation in steady state).
    pub(crate) fn keep_memory(
        &self,
        obj: &Bound<'_, PyAny>,
        spare: &mut SpareKeeper,
    ) -> Option<Result<Option<Kept>, &'static str>> {
        let k = self.keep.as_ref()?;
        let t = self.variable_of(obj)?;
        // SAFETY: `t` is the live tensor's `at::Tensor` (a defined one), the GIL held.
        Some(unsafe { k.keep(t, spare) })
    }

    /// Gives back what [`AtenBits::keep_memory`] kept for `obj`: where `obj`'s storage still holds
    /// the keeper and nothing else shares it, the storage gets its own `DataPtr` back (and the
    /// keeper's allocation goes to `spare`, for the next view).
    pub(crate) fn release_memory(&self, obj: &Bound<'_, PyAny>, kept: Kept, spare: &mut SpareKeeper) {
        let dp = match (self.keep.as_ref(), self.variable_of(obj)) {
            // SAFETY: as in `keep_memory`.
            (Some(k), Some(t)) => unsafe { k.data_ptr_of(t) },
            _ => None,
        };
        kept.release(dp, spare);
    }

    /// Bumps `obj`'s version counter, as torch's in-place operations do (see [`Bump`]).
    #[inline]
    pub(crate) fn bump_version(&self, obj: &Bound<'_, PyAny>) -> Bump {
        let (Some(v), Some(t)) = (self.versions.as_ref(), self.tensor_of(obj)) else { return Bump::NotHere };
        // SAFETY: as in `write_refused_without_counter`.
        if !unsafe { v.has_counter(t) } {
            return Bump::NoCounter;
        }
        // SAFETY: `t` points to the live object's defined tensor, which has a version counter
        // (read just above with the GIL held: nothing ran in between), so torch's bump cannot
        // throw (it throws only for a missing counter outside inference mode); the function was
        // verified on probes.
        unsafe { (v.bump_version)(t) };
        Bump::Done
    }
}

/// The verified version-counter and inference-mode functions, for [`may_write_handle`] and
/// [`bump_handle`], which run without the GIL (inside a native torch op): set once, from
/// verified [`Versions`].
#[cfg(all(feature = "torch-stable", unix))]
static NATIVE_VERSIONS: std::sync::OnceLock<(CounterFn, TensorFn, FlagFn)> = std::sync::OnceLock::new();

/// The verified `requires_grad`, grad-mode and inference-mode functions, for
/// [`untracked_grad_handle`] (set once, with [`NATIVE_VERSIONS`], where `requires_grad` was
/// verified too).
#[cfg(all(feature = "torch-stable", unix))]
static NATIVE_GRAD: std::sync::OnceLock<(BitFn, FlagFn, FlagFn)> = std::sync::OnceLock::new();

/// Installs [`crate::torch_stable::set_version_hooks`]'s functions from torch's own (the
/// verified `version_counter`, `bump_version` and `InferenceMode::is_enabled`), so a native op
/// that writes an argument in place refuses an inference tensor outside inference mode and bumps
/// `_version` as torch's in-place operations do. Runs the one-time search if it has not run
/// (torch imported). Returns whether the hooks are installed (`false`: the symbols were not
/// found or not verified; nothing is checked or bumped then).
#[cfg(all(feature = "torch-stable", unix))]
pub(crate) fn install_native_version_hooks(py: Python<'_>) -> bool {
    let Some(bits) = aten_bits(py) else { return false };
    let Some(v) = bits.versions.as_ref() else { return false };
    NATIVE_VERSIONS.get_or_init(|| (v.version_counter, v.bump_version, v.inference_mode));
    if let Some(requires_grad) = bits.requires_grad {
        NATIVE_GRAD.get_or_init(|| (requires_grad, v.grad_enabled, v.inference_mode));
    }
    let hooks = crate::torch_stable::VersionHooks {
        may_write: may_write_handle,
        bump: bump_handle,
        untracked_grad: untracked_grad_handle,
    };
    // SAFETY: the functions meet the hooks' contract: given a live handle of a defined tensor
    // (an `at::Tensor*`, what the verified functions take), they read the tensor's counter, its
    // `requires_grad` and the thread's grad and inference modes, and bump only where there is a
    // counter, so torch's bump cannot throw (it throws only for a missing counter outside
    // inference mode); none touches Python. Another call installs the same functions: the first
    // stay.
    let _ = unsafe { crate::torch_stable::set_version_hooks(hooks) };
    crate::torch_stable::has_version_hooks()
}

/// Whether the tensor at `t` has a version counter.
///
/// # Safety
///
/// `t` is a live `AtenTensorHandle` (an `at::Tensor*`) of a defined tensor; `counter` is the
/// verified `version_counter`.
#[cfg(all(feature = "torch-stable", unix))]
unsafe fn native_has_counter(counter: CounterFn, t: crate::torch_stable::sys::AtenTensorHandle) -> bool {
    // SAFETY: the caller's promise; the verified function returns a reference to the tensor's
    // `VariableVersion`, whose first word is the counter's pointer (NULL: none).
    unsafe { !(*counter(t.cast_const().cast::<c_void>())).is_null() }
}

/// The `may_write` hook: `false` for a tensor without a counter while inference mode is off.
///
/// # Safety
///
/// `t` is a live `AtenTensorHandle` of a defined tensor.
#[cfg(all(feature = "torch-stable", unix))]
unsafe fn may_write_handle(t: crate::torch_stable::sys::AtenTensorHandle) -> bool {
    match NATIVE_VERSIONS.get() {
        // SAFETY: the caller's promise, and the verified functions; c10's inference-mode read is a
        // thread-local read, which cannot throw.
        Some(&(counter, _, inference)) => unsafe { native_has_counter(counter, t) || inference() },
        None => true,
    }
}

/// The `untracked_grad` hook: the tensor requires grad while grad mode is on and inference mode
/// off (`false` where `requires_grad` was not verified: nothing is refused then).
///
/// # Safety
///
/// `t` is a live `AtenTensorHandle` of a defined tensor.
#[cfg(all(feature = "torch-stable", unix))]
unsafe fn untracked_grad_handle(t: crate::torch_stable::sys::AtenTensorHandle) -> bool {
    let Some(&(requires_grad, grad_enabled, inference)) = NATIVE_GRAD.get() else { return false };
    // SAFETY: the modes are thread-local reads (verified against torch.is_grad_enabled() and
    // torch.is_inference_mode_enabled()); `t` is a live `at::Tensor*` of a defined tensor (the
    // caller's promise), whose first word is its `TensorImpl` (checked against `_cdata` on probes),
    // the `this` of the verified const member, which reads two fields and cannot throw.
    unsafe { grad_enabled() && !inference() && requires_grad(*t.cast_const().cast::<*const c_void>()) }
}

/// The `bump` hook: torch's bump, where the tensor has a counter.
///
/// # Safety
///
/// `t` is a live `AtenTensorHandle` of a defined tensor.
#[cfg(all(feature = "torch-stable", unix))]
unsafe fn bump_handle(t: crate::torch_stable::sys::AtenTensorHandle) {
    if let Some(&(counter, bump, _)) = NATIVE_VERSIONS.get() {
        // SAFETY: the caller's promise; the bump runs only where the counter exists, so it
        // cannot throw (see `Versions::has_counter`).
        unsafe {
            if native_has_counter(counter, t) {
                bump(t.cast_const().cast::<c_void>());
            }
        }
    }
}

/// Finds the kernels and checks them on probe tensors; `Ok(None)` when anything does not
/// hold (no torch, another layout, a symbol missing, a disagreement).
fn find(py: Python<'_>) -> PyResult<Option<AtenBits>> {
    // Only where torch is already imported: dlbridge never imports it for this. The module is
    // used for the probes only: the type whose instances are read is torch's own (`tensor_type`),
    // never an attribute Python code can replace (a stand-in module's `Tensor` with a slot where
    // `cdata` sits passed the checks, and ATen's bump wrote through a pointer it chose).
    let Some(torch) = py.import("sys")?.getattr("modules")?.get_item("torch").ok() else { return Ok(None) };
    let Some(tensor_type) = torch_tensor_type(py) else { return Ok(None) };
    let Some(lib) = loaded(c"libtorch_cpu.so") else { return Ok(None) };
    let sym = |name: &std::ffi::CStr| {
        // SAFETY: a handle from dlopen and a NUL-terminated name.
        let p = unsafe { dlsym(lib, name.as_ptr()) };
        // SAFETY: a non-NULL symbol of this mangled name is the function of this signature.
        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, BitFn>(p) })
    };
    let (Some(is_neg), Some(is_conj)) =
        (sym(c"_ZN2at6native6is_negERKNS_6TensorE"), sym(c"_ZN2at6native7is_conjERKNS_6TensorE"))
    else {
        return Ok(None);
    };
    // SAFETY: a handle from dlopen and a NUL-terminated name (c10's data symbol, found through
    // libtorch_cpu's dependencies); only its address is used, never dereferenced.
    let undefined = unsafe { dlsym(lib, c"_ZN3c1019UndefinedTensorImpl10_singletonE".as_ptr()) };
    if undefined.is_null() {
        return Ok(None);
    }
    let mut bits = AtenBits {
        is_neg,
        is_conj,
        ty: tensor_type.as_type_ptr() as usize,
        undefined: undefined as usize,
        versions: None,
        keep: None,
        requires_grad: sym(c"_ZNK3c1010TensorImpl13requires_gradEv"),
        stable: None,
    };
    // The probes run with the caller's modes set aside (a TorchFunctionMode, a dispatch mode such
    // as FakeTensorMode or make_fx's tracer, a default device, inference mode): they are real CPU
    // tensors, and no user code sees dlbridge's probe operations.
    let globals = pyo3::types::PyDict::new(py);
    globals.set_item("torch", &torch)?;
    py.run(QUIET, Some(&globals), None)?;
    let quiet = globals.get_item("quiet")?.ok_or_else(|| pyo3::exceptions::PyKeyError::new_err("quiet"))?;
    let stack = quiet.call1((&torch,))?;
    let result = probe(py, &torch, &globals, &mut bits, lib);
    stack.call_method0("close")?;
    Ok(result?.then_some(bits))
}

/// Leaves the caller's torch modes for the probes: `quiet(torch)` enters the contexts and returns
/// the `ExitStack` whose `close()` restores them.
const QUIET: &std::ffi::CStr = c"import contextlib
def quiet(torch):
    stack = contextlib.ExitStack()
    try:
        try:
            from torch.utils._python_dispatch import _disable_current_modes
        except ImportError:
            pass
        else:
            stack.enter_context(_disable_current_modes())
        stack.enter_context(torch._C.DisableTorchFunction())
        stack.enter_context(torch.inference_mode(False))
    except BaseException:
        stack.close()
        raise
    return stack
";

/// The probes of [`find`], inside its quiet contexts: whether the bits hold (`bits.versions` set
/// when the write functions hold too).
fn probe(
    py: Python<'_>,
    torch: &Bound<'_, PyAny>,
    globals: &Bound<'_, pyo3::types::PyDict>,
    bits: &mut AtenBits,
    lib: *mut c_void,
) -> PyResult<bool> {
    let probes = py.eval(
        c"(lambda z, c: [z, torch._neg_view(z), c, c.conj(), c.conj().imag, torch._neg_view(z).detach(), \
           torch.zeros(()), torch.zeros(0, 3), torch.zeros(2, dtype=torch.bfloat16), \
           torch.ones(2, requires_grad=True), torch._neg_view(c.conj())])\
           (torch.arange(3.0), torch.complex(torch.ones(2), torch.ones(2)))",
        Some(globals),
        None,
    )?;
    let (mut saw_neg, mut saw_conj, mut saw_plain) = (false, false, false);
    let mut grads = [false; 2];
    for p in probes.try_iter()? {
        let p = p?;
        let Some(t) = bits.tensor_of(&p) else { return Ok(false) };
        // SAFETY: inside the object (basicsize checked); a pointer-sized field read as such.
        let cdata = unsafe { *t.cast::<usize>() };
        if cdata != p.getattr("_cdata")?.extract::<usize>()? {
            return Ok(false);
        }
        // c10's requires_grad must agree with the getter on every probe (one that requires grad
        // among them), else the getter is asked.
        let rg = p.getattr("requires_grad")?.extract::<bool>()?;
        grads[usize::from(rg)] = true;
        if bits.requires_grad.is_some() && bits.requires_grad(&p) != Some(rg) {
            bits.requires_grad = None;
        }
        let (neg, conj) =
            (p.call_method0("is_neg")?.extract::<bool>()?, p.call_method0("is_conj")?.extract::<bool>()?);
        if bits.is_neg(&p) != Some(neg) || bits.is_conj(&p) != Some(conj) {
            return Ok(false);
        }
        saw_neg |= neg;
        saw_conj |= conj;
        saw_plain |= !neg && !conj;
    }
    if !(saw_neg && saw_conj && saw_plain) {
        return Ok(false);
    }
    if grads != [true, true] {
        bits.requires_grad = None;
    }
    // A failure there leaves only that part to torch's Python functions (an interrupt is passed on).
    bits.versions = match find_versions(py, torch, bits, lib) {
        Ok(v) => v,
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) => return Err(e),
        Err(_) => None,
    };
    bits.keep = match find_keep(py, torch, bits, lib) {
        Ok(k) => k,
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) => return Err(e),
        Err(_) => None,
    };
    bits.stable = match find_stable(py, torch, bits) {
        Ok(k) => k,
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) => return Err(e),
        Err(_) => None,
    };
    Ok(true)
}

/// torch's stable accessors (`torch_stable::Describer`) on the `cdata` of probe tensors, checked
/// against the exchange table's borrowed `DLTensor` of each (data, dtype, shape, strides: an
/// offset and strided view, 0-d, empty, expanded, transposed, several dtypes, one that requires
/// grad); a meta and a sparse tensor must be left to the table. `Ok(None)` when anything does not
/// hold (no stable function, another handle layout, a disagreement).
#[cfg(all(feature = "torch-stable", unix))]
fn find_stable(py: Python<'_>, torch: &Bound<'_, PyAny>, bits: &AtenBits) -> PyResult<Option<Stable>> {
    let Ok(describer) = crate::torch_stable::Torch::attach().and_then(|t| t.describer()) else {
        return Ok(None);
    };
    let ty = torch.getattr("Tensor")?.cast_into::<pyo3::types::PyType>()?;
    if ty.as_type_ptr() as usize != bits.ty {
        return Ok(None);
    }
    // The type's own exchange table (DLPack 1.3's capsule; major version 1): the reference.
    let cap = ty.getattr(pyo3::intern!(py, "__dlpack_c_exchange_api__"))?;
    // SAFETY: IsValid checks the object is a capsule of exactly this name; sets no error.
    if unsafe { ffi::PyCapsule_IsValid(cap.as_ptr(), c"dlpack_exchange_api".as_ptr()) } != 1 {
        return Ok(None);
    }
    // SAFETY: a valid capsule of this name holds a process-lifetime table (DLPack's contract).
    let api = unsafe { ffi::PyCapsule_GetPointer(cap.as_ptr(), c"dlpack_exchange_api".as_ptr()) }
        .cast::<crate::ffi::DLPackExchangeAPI>();
    // SAFETY: as above; NULL gives None; a major-1 header heads a full table.
    let Some(f) = (unsafe { api.as_ref() })
        .filter(|a| a.header.version.major == 1)
        .and_then(|a| a.dltensor_from_py_object_no_sync)
    else {
        return Ok(None);
    };
    let listed_by_table = |p: &Bound<'_, PyAny>| {
        let mut t = std::mem::MaybeUninit::<crate::ffi::DLTensor>::zeroed();
        // SAFETY: an object of exactly the table's type (a probe tensor), the GIL held, a writable
        // DLTensor, filled on success (and zeroed before).
        (unsafe { f(p.as_ptr().cast(), t.as_mut_ptr()) } == 0).then(|| unsafe { t.assume_init() })
    };
    let globals = pyo3::types::PyDict::new(py);
    globals.set_item("torch", torch)?;
    let probes = py.eval(
        c"[torch.arange(10.0)[2:9:3], torch.zeros(()), torch.zeros(0, 3), torch.ones(3, 1).expand(3, 4), \
           torch.arange(6.0, dtype=torch.float64).reshape(2, 3).t(), torch.ones(2, 3, 4).permute(2, 0, 1), \
           torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float16), \
           torch.zeros(3, dtype=torch.bool), torch.arange(4), torch.zeros(5, dtype=torch.uint8), \
           torch.zeros(2, dtype=torch.complex64), torch.ones(2, requires_grad=True), \
           torch.zeros(4, dtype=torch.int8)[1:]]",
        Some(&globals),
        None,
    )?;
    for p in probes.try_iter()? {
        let p = p?;
        let (Some(stable), Some(listed)) = (bits.stable_dltensor_with(&describer, &p), listed_by_table(&p))
        else {
            return Ok(None);
        };
        // SAFETY: both descriptions read just now, no Python run since: ndim entries each.
        let same = unsafe {
            stable.data == listed.data
                && stable.byte_offset == listed.byte_offset
                && stable.ndim == listed.ndim
                && crate::DataType::from(stable.dtype) == crate::DataType::from(listed.dtype)
                && crate::Device::from(stable.device) == crate::Device::from(listed.device)
                && match (crate::managed::dims_of(&stable), crate::managed::dims_of(&listed)) {
                    (Ok((s1, t1)), Ok((s2, t2))) => {
                        let t1 = t1.map_or_else(|| crate::layout::c_strides(s1), <[i64]>::to_vec);
                        let t2 = t2.map_or_else(|| crate::layout::c_strides(s2), <[i64]>::to_vec);
                        s1 == s2 && t1 == t2
                    }
                    _ => false,
                }
        };
        if !same {
            return Ok(None);
        }
    }
    let others =
        py.eval(c"[torch.zeros(2, device='meta'), torch.zeros(3).to_sparse()]", Some(&globals), None)?;
    for p in others.try_iter()? {
        if bits.stable_dltensor_with(&describer, &p?).is_some() {
            return Ok(None);
        }
    }
    Ok(Some(describer))
}

/// No stable accessors without `torch_stable`.
#[cfg(not(all(feature = "torch-stable", unix)))]
fn find_stable(_: Python<'_>, _: &Bound<'_, PyAny>, _: &AtenBits) -> PyResult<Option<Stable>> {
    Ok(None)
}

/// The version counter, bump, grad and inference mode, checked on probes; `Ok(None)` when anything
/// does not hold. (`dlsym` on `libtorch_cpu`'s handle also searches what it depends on: c10.)
fn find_versions(
    py: Python<'_>,
    torch: &Bound<'_, PyAny>,
    bits: &AtenBits,
    lib: *mut c_void,
) -> PyResult<Option<Versions>> {
    let sym = |name: &std::ffi::CStr| {
        // SAFETY: a handle from dlopen and a NUL-terminated name.
        let p = unsafe { dlsym(lib, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let bump = sym(c"_ZN5torch8autograd4impl12bump_versionERKN2at6TensorE")
        .or_else(|| sym(c"_ZN5torch8autograd4impl12bump_versionERKN2at10TensorBaseE"));
    let counter = sym(c"_ZN5torch8autograd4impl15version_counterERKN2at6TensorE")
        .or_else(|| sym(c"_ZN5torch8autograd4impl15version_counterERKN2at10TensorBaseE"));
    let (Some(bump), Some(counter), Some(grad), Some(mode)) =
        (bump, counter, sym(c"_ZN3c108GradMode10is_enabledEv"), sym(c"_ZN3c1013InferenceMode10is_enabledEv"))
    else {
        return Ok(None);
    };
    // SAFETY: non-NULL symbols of these mangled names are the functions of these signatures (an
    // `at::Tensor` and an `at::TensorBase` are the same one pointer; a C++ reference return is a
    // pointer).
    let v = unsafe {
        Versions {
            bump_version: std::mem::transmute::<*mut c_void, TensorFn>(bump),
            version_counter: std::mem::transmute::<*mut c_void, CounterFn>(counter),
            grad_enabled: std::mem::transmute::<*mut c_void, FlagFn>(grad),
            inference_mode: std::mem::transmute::<*mut c_void, FlagFn>(mode),
        }
    };
    // Probes made outside inference mode, whatever mode torch is first seen in: a tensor, a view
    // of it (sharing its counter), an inference tensor, and a plain tensor whose `.data` was an
    // inference tensor (no counter, keys not inference); `counted` says where `_version` reads.
    let globals = pyo3::types::PyDict::new(py);
    globals.set_item("torch", torch)?;
    py.run(
        c"with torch.inference_mode(False):\n    a = torch.zeros(4)\n    b = a[1:]\n    \
          with torch.inference_mode():\n        inf = torch.zeros(2)\n        dz = torch.zeros(2)\n    \
          dz.data = torch.ones(2)\n\
          def readable(t):\n    try:\n        t._version\n        return True\n    \
          except RuntimeError:\n        return False\n\
          probes = [a, b, inf, dz]\ncounted = [readable(t) for t in probes]\n",
        Some(&globals),
        None,
    )?;
    let item =
        |k: &str| globals.get_item(k)?.ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(k.to_owned()));
    let counted: Vec<bool> = item("counted")?.extract()?;
    if counted != [true, true, false, false] {
        return Ok(None);
    }
    for (p, counted) in item("probes")?.try_iter()?.zip(counted) {
        let Some(t) = bits.tensor_of(&p?) else { return Ok(None) };
        // SAFETY: a live probe tensor of the verified type, the GIL held.
        if unsafe { v.has_counter(t) } != counted {
            return Ok(None);
        }
    }
    let (a, b) = (item("a")?, item("b")?);
    let version = |t: &Bound<'_, PyAny>| t.getattr("_version")?.extract::<u64>();
    let Some(ta) = bits.tensor_of(&a) else { return Ok(None) };
    let (va, vb) = (version(&a)?, version(&b)?);
    // SAFETY: a probe of the verified type with a counter (checked just above): the bump cannot
    // throw.
    unsafe { (v.bump_version)(ta) };
    if version(&a)? != va + 1 || version(&b)? != vb + 1 {
        return Ok(None);
    }
    // Grad mode both ways, restored whatever the checks find.
    let set = torch.getattr("_C")?.getattr("_set_grad_enabled")?;
    let was: bool = torch.call_method0("is_grad_enabled")?.extract()?;
    // SAFETY: c10's thread-local read (the symbol of that name).
    let agrees_now = unsafe { (v.grad_enabled)() } == was;
    set.call1((!was,))?;
    // SAFETY: as above.
    let agrees_flipped = unsafe { (v.grad_enabled)() } != was;
    set.call1((was,))?;
    if !(agrees_now && agrees_flipped) {
        return Ok(None);
    }
    // Inference mode now, inside `torch.inference_mode()` and inside `torch.inference_mode(False)`
    // (each left whatever the check finds).
    let now: bool = torch.call_method0("is_inference_mode_enabled")?.extract()?;
    // SAFETY: c10's thread-local read (the symbol of that name).
    let mut agrees = unsafe { (v.inference_mode)() } == now;
    for mode in [true, false] {
        let ctx = torch.call_method1("inference_mode", (mode,))?;
        ctx.call_method0("__enter__")?;
        // SAFETY: as above.
        agrees &= unsafe { (v.inference_mode)() } == mode;
        ctx.call_method1("__exit__", (py.None(), py.None(), py.None()))?;
    }
    Ok(agrees.then_some(v))
}

/// The library of this soname if it is loaded (never loads it: `RTLD_NOLOAD`). The soname, not a
/// path taken from `torch.__file__`, which Python code can set.
fn loaded(soname: &std::ffi::CStr) -> Option<*mut c_void> {
    const RTLD_LAZY: c_int = 1;
    const RTLD_NOLOAD: c_int = 4;
    // SAFETY: a NUL-terminated name; RTLD_NOLOAD returns an already loaded library or NULL.
    let lib = unsafe { dlopen(soname.as_ptr(), RTLD_LAZY | RTLD_NOLOAD) };
    (!lib.is_null()).then_some(lib)
}

/// `Dl_info` of `dladdr`.
#[repr(C)]
struct DlInfo {
    fname: *const c_char,
    fbase: *mut c_void,
    sname: *const c_char,
    saddr: *mut c_void,
}

unsafe extern "C" {
    fn dladdr(addr: *const c_void, info: *mut DlInfo) -> c_int;
}

/// The base address of the loaded object that contains `addr` (`None`: none does, e.g. the heap).
fn object_of(addr: *const c_void) -> Option<usize> {
    let mut info = DlInfo {
        fname: std::ptr::null(),
        fbase: std::ptr::null_mut(),
        sname: std::ptr::null(),
        saddr: std::ptr::null_mut(),
    };
    // SAFETY: `dladdr` only compares `addr` with the loaded objects' ranges and fills `info`.
    (unsafe { dladdr(addr, &mut info) } != 0 && !info.fbase.is_null()).then_some(info.fbase as usize)
}

/// torch's own `torch.Tensor`, proven from torch's library rather than taken from a Python
/// attribute: the type `libtorch_python` holds in its global `THPVariableClass` (set when torch
/// was imported, the class `THPVariable_Check` tests against), whose first static base is a type
/// object inside `libtorch_python` itself (`torch._C.TensorBase`, the `THPVariable` layout: a
/// Python-made type is on the heap, so it is no such base) and covers `cdata`. `None` when any
/// of this does not hold.
fn torch_tensor_type(py: Python<'_>) -> Option<Bound<'_, pyo3::types::PyType>> {
    let lib = loaded(c"libtorch_python.so")?;
    // SAFETY: a handle from dlopen and a NUL-terminated name.
    let slot = unsafe { dlsym(lib, c"THPVariableClass".as_ptr()) }.cast::<*mut ffi::PyObject>();
    if slot.is_null() {
        return None;
    }
    let home = object_of(slot.cast())?;
    // SAFETY: the exported global `PyObject* THPVariableClass`, written by torch at import with
    // the GIL held; read with the GIL held.
    let class = unsafe { *slot };
    // SAFETY: a non-NULL pointer torch keeps a reference to (it never releases the class).
    if class.is_null() || unsafe { ffi::PyType_Check(class) } == 0 {
        return None;
    }
    // SAFETY: a live type object (checked), borrowed.
    let ty = unsafe { Bound::from_borrowed_ptr(py, class) }.cast_into::<pyo3::types::PyType>().ok()?;
    let covers = |t: *mut ffi::PyTypeObject| {
        // SAFETY: a live type object's field.
        usize::try_from(unsafe { (*t).tp_basicsize })
            .is_ok_and(|b| b >= CDATA_OFFSET + std::mem::size_of::<usize>())
    };
    let mut base = ty.as_type_ptr();
    // SAFETY: a live type's flags (each type keeps its base alive); the chain ends at `object`,
    // a static type.
    while unsafe { ffi::PyType_HasFeature(base, ffi::Py_TPFLAGS_HEAPTYPE) } != 0 {
        // SAFETY: a live type's field.
        base = unsafe { (*base).tp_base };
        if base.is_null() {
            return None;
        }
    }
    (covers(ty.as_type_ptr()) && covers(base) && object_of(base.cast()) == Some(home)).then_some(ty)
}

/// `c10::DeleterFnPtr`: `void (*)(void*)`.
type DeleterFn = unsafe extern "C-unwind" fn(*mut c_void);

/// How a borrowed view keeps a torch tensor's memory valid (verified on probes, see
/// [`find_keep`]).
///
/// Holding the tensor, or a reference to its `StorageImpl`, is not enough: `x.set_()` gives the
/// tensor another storage, and `x.resize_()`, `x.share_memory_()` or `storage.resize_()` give the
/// same storage other memory, each freeing the old memory at once (torch's own DLPack export and
/// `x.numpy()` have this gap). What frees the memory is the storage's `c10::DataPtr`, a unique
/// owner `{data, deleter, context}`: its deleter runs when the storage drops or replaces it.
/// So while a view lives, the `DataPtr` owns the memory through a shared keeper ([`Held`]: the
/// original deleter and context, and a count of holders), whose deleter only counts down: the
/// original deleter runs once neither the storage nor any view holds the keeper. When the last
/// view goes and the storage still holds the keeper, the storage gets its own deleter and context
/// back (so a deleter identity torch reads afterwards, `is_shared()`, is its own again).
///
/// The layout this writes is torch's public headers, checked on probes: `TensorImpl::storage_` (one
/// `StorageImpl*`) and `StorageImpl::data_ptr_` (`DataPtr` = `UniqueVoidPtr{data_, unique_ptr<void,
/// DeleterFnPtr> ctx_}`, libstdc++ keeping the deleter before the pointer), found where the probes
/// put the storage and the data (`untyped_storage()._cdata`, `data_ptr()`), the context of
/// torch's CPU allocator being the data itself and its deleter inside `libc10`; then a keeper is
/// put on a probe and given back, and put on a probe torch then frees (its deleter must run).
/// Copy-on-write storages (`torch._lazy_clone`, deleter `c10::impl::cow::cow_deleter`) are not
/// wrapped: torch tells them by that deleter, and a write would stop copying. Such a view is
/// refused.
struct Keep {
    /// Byte offset of `storage_` in a `TensorImpl`.
    storage: usize,
    /// Byte offset of `data_ptr_` in a `StorageImpl`.
    data_ptr: usize,
    /// `c10::impl::cow::cow_deleter`.
    cow: usize,
}

/// The words of a `DataPtr`, as [`Keep`] found them.
#[repr(C)]
struct DataPtrWords {
    data: *mut c_void,
    deleter: Option<DeleterFn>,
    context: *mut c_void,
}

/// The keeper a kept `DataPtr` holds as its context (see [`Keep`]).
struct Held {
    /// Holders: the storage's `DataPtr` while it holds the keeper, and each [`Kept`].
    holders: std::sync::atomic::AtomicUsize,
    deleter: Option<DeleterFn>,
    context: *mut c_void,
}

/// A view's hold on a torch tensor's memory ([`AtenBits::keep_memory`]). Dropped without
/// [`AtenBits::release_memory`], it counts down only (the storage keeps the keeper until torch
/// frees it), and only with the GIL: without it the memory is kept for good rather than risk a
/// deleter that waits for the GIL (never reached: a view is dropped where it was made).
pub(crate) struct Kept(std::ptr::NonNull<Held>);

/// The keeper's deleter, in the storage's `DataPtr`: runs where torch frees or replaces it (any
/// thread, with or without the GIL).
unsafe extern "C-unwind" fn keeper_deleter(context: *mut c_void) {
    // SAFETY: the context is the `Held` this keeper was made with, alive while it has holders.
    unsafe { drop_holder(context.cast()) };
}

/// The address of [`keeper_deleter`] (how a kept `DataPtr` is told apart).
fn keeper_address() -> usize {
    keeper_deleter as DeleterFn as usize
}

/// Counts one holder of `held` down; the last one runs the original deleter (as the `DataPtr`
/// would have: a NULL context is not deleted) and frees the keeper.
///
/// # Safety
///
/// `held` is a live keeper and the caller is one of its holders, counted once.
unsafe fn drop_holder(held: *mut Held) {
    // SAFETY: the caller's promise.
    if unsafe { (*held).holders.fetch_sub(1, Ordering::AcqRel) } != 1 {
        return;
    }
    // SAFETY: the last holder: nothing else reads the keeper; made by `Box::new` in `keep`.
    let held = unsafe { Box::from_raw(held) };
    if let (Some(d), false) = (held.deleter, held.context.is_null()) {
        // SAFETY: the storage's own deleter and context, run once, as its `DataPtr` would have.
        unsafe { d(held.context) };
    }
}

impl Keep {
    /// Where the `DataPtr` of the storage of the tensor at `t` is, or `None` without a storage.
    ///
    /// # Safety
    ///
    /// `t` points to a live, defined `at::Tensor`, the GIL held.
    unsafe fn data_ptr_of(&self, t: *const c_void) -> Option<*mut DataPtrWords> {
        // SAFETY: the caller's promise; the offsets were found on probes (see [`Keep`]).
        unsafe {
            let impl_ = *t.cast::<*const u8>();
            let storage = *impl_.add(self.storage).cast::<*mut u8>();
            (!storage.is_null()).then(|| storage.add(self.data_ptr).cast::<DataPtrWords>())
        }
    }

    /// See [`AtenBits::keep_memory`].
    ///
    /// # Safety
    ///
    /// As for [`Keep::data_ptr_of`].
    unsafe fn keep(&self, t: *const c_void, spare: &mut SpareKeeper) -> Result<Option<Kept>, &'static str> {
        // SAFETY: the caller's promise.
        let Some(dp) = (unsafe { self.data_ptr_of(t) }) else { return Err("the tensor has no storage") };
        // SAFETY: the live storage's `DataPtr`, read and written with the GIL held (torch changes
        // a storage only with the GIL held or from a thread its caller started: torch's own limit).
        unsafe {
            if (*dp).data.is_null() {
                return Ok(None);
            }
            let deleter = (*dp).deleter.map_or(0, |d| d as usize);
            if deleter == keeper_address() {
                // Already kept by another view: one holder more.
                let held = (*dp).context.cast::<Held>();
                (*held).holders.fetch_add(1, Ordering::Relaxed);
                return Ok(Some(Kept(std::ptr::NonNull::new_unchecked(held))));
            }
            if deleter == self.cow {
                return Err("the tensor's storage is copy-on-write (a lazy clone); pass a .clone()");
            }
            let held = Box::into_raw(spare.fill(Held {
                holders: std::sync::atomic::AtomicUsize::new(2),
                deleter: (*dp).deleter,
                context: (*dp).context,
            }));
            (*dp).context = held.cast();
            (*dp).deleter = Some(keeper_deleter);
            Ok(Some(Kept(std::ptr::NonNull::new_unchecked(held))))
        }
    }
}

impl Kept {
    /// Gives the hold back; `dp` is the `DataPtr` of the viewed tensor's storage now (if any).
    /// Called with the GIL held (the last holder may run a deleter that takes it).
    fn release(self, dp: Option<*mut DataPtrWords>, spare: &mut SpareKeeper) {
        let held = self.0.as_ptr();
        std::mem::forget(self);
        if let Some(dp) = dp {
            // SAFETY: the live storage's `DataPtr` (the viewed tensor is alive), the GIL held; the
            // keeper is alive (this hold counts).
            unsafe {
                let ours = (*dp).deleter.is_some_and(|d| d as usize == keeper_address())
                    && (*dp).context == held.cast();
                // Only the storage and this view hold it: the storage gets its own back.
                if ours && (*held).holders.load(Ordering::Acquire) == 2 {
                    let held = Box::from_raw(held);
                    (*dp).deleter = held.deleter;
                    (*dp).context = held.context;
                    spare.0 = Some(held);
                    return;
                }
            }
        }
        // SAFETY: this hold counted once; given back once.
        unsafe { drop_holder(held) };
    }
}

/// One keeper's allocation kept for the next view, in the block of the view that gave it back
/// (no thread-local lookup: a view's block is at hand where it keeps and releases memory).
#[derive(Default)]
pub(crate) struct SpareKeeper(Option<Box<Held>>);

impl SpareKeeper {
    /// `held` in the spare allocation, or in a new one.
    fn fill(&mut self, held: Held) -> Box<Held> {
        match self.0.take() {
            Some(mut b) => {
                *b = held;
                b
            }
            None => Box::new(held),
        }
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        if crate::python::runtime::attached_here() {
            // SAFETY: this hold counted once; given back once.
            unsafe { drop_holder(self.0.as_ptr()) };
        }
    }
}

/// Finds and checks [`Keep`] on probes; `Ok(None)` when anything does not hold.
fn find_keep(
    py: Python<'_>,
    torch: &Bound<'_, PyAny>,
    bits: &AtenBits,
    lib: *mut c_void,
) -> PyResult<Option<Keep>> {
    // SAFETY: a handle from dlopen and NUL-terminated names (c10's, through libtorch_cpu's
    // dependencies); only their addresses are used here.
    let (cow, free_cpu) = unsafe {
        (
            dlsym(lib, c"_ZN3c104impl3cow11cow_deleterEPv".as_ptr()),
            dlsym(lib, c"_ZN3c108free_cpuEPv".as_ptr()),
        )
    };
    if cow.is_null() || free_cpu.is_null() {
        return Ok(None);
    }
    let c10 = object_of(free_cpu);
    let globals = pyo3::types::PyDict::new(py);
    globals.set_item("torch", torch)?;
    py.run(
        c"a = torch.zeros(1000)\nprobes = [a, a[10:], torch.zeros(7, dtype=torch.float64), torch.ones(3, 2)]\n\
          storages = [p.untyped_storage()._cdata for p in probes]\n\
          datas = [p.untyped_storage().data_ptr() for p in probes]\n",
        Some(&globals),
        None,
    )?;
    let item =
        |k: &str| globals.get_item(k)?.ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(k.to_owned()));
    let storages: Vec<usize> = item("storages")?.extract()?;
    let datas: Vec<usize> = item("datas")?.extract()?;
    let mut tensors = Vec::new();
    for p in item("probes")?.try_iter()? {
        let Some(t) = bits.tensor_of(&p?) else { return Ok(None) };
        tensors.push(t);
    }
    let word = |p: usize| {
        // SAFETY: only called on words inside a probe's live TensorImpl or StorageImpl (offsets
        // below their sizes: a TensorImpl and a StorageImpl are far larger than 80 bytes).
        unsafe { *(p as *const usize) }
    };
    // SAFETY: a live probe tensor's `at::Tensor`, the GIL held: its TensorImpl pointer.
    let impls: Vec<usize> = tensors.iter().map(|&t| unsafe { *t.cast::<usize>() }).collect();
    // The first word past the object's header (vtable, reference counts) that holds the wanted
    // value for every probe (the `DataPtr`'s context repeats its data further on).
    let find = |bases: &[usize], wanted: &[usize]| {
        (1..10).map(|k| k * 8).find(|&o| bases.iter().zip(wanted).all(|(&b, &w)| word(b + o) == w))
    };
    let Some(storage) = find(&impls, &storages) else { return Ok(None) };
    let Some(data_ptr) = find(&storages, &datas) else { return Ok(None) };
    // torch's CPU allocator: the context is the data, the deleter in libc10.
    let allocator_words = storages.iter().zip(&datas).all(|(&s, &d)| {
        let deleter = word(s + data_ptr + 8);
        word(s + data_ptr + 16) == d && deleter != 0 && object_of(deleter as *const c_void) == c10
    });
    if !allocator_words || c10.is_none() {
        return Ok(None);
    }
    let keep = Keep { storage, data_ptr, cow: cow as usize };
    // A keeper given back restores the storage's own words; a keeper on a storage torch frees
    // runs its deleter (the probe's memory is freed once the hold is given back too).
    let (t0, s0) = (tensors[0], storages[0]);
    let before = (word(s0 + data_ptr + 8), word(s0 + data_ptr + 16));
    let mut spare = SpareKeeper::default();
    // SAFETY: a live probe tensor, the GIL held.
    let Ok(Some(kept)) = (unsafe { keep.keep(t0, &mut spare) }) else { return Ok(None) };
    // SAFETY: as above.
    let Ok(Some(second)) = (unsafe { keep.keep(t0, &mut spare) }) else { return Ok(None) };
    // SAFETY: as above.
    let dp = unsafe { keep.data_ptr_of(t0) };
    second.release(dp, &mut spare);
    kept.release(dp, &mut spare);
    if (word(s0 + data_ptr + 8), word(s0 + data_ptr + 16)) != before {
        return Ok(None);
    }
    py.run(c"f = torch.zeros(5)\nfd = f.data_ptr()\n", Some(&globals), None)?;
    let Some(tf) = bits.tensor_of(&item("f")?) else { return Ok(None) };
    // SAFETY: a live probe tensor, the GIL held.
    let Ok(Some(kept)) = (unsafe { keep.keep(tf, &mut spare) }) else { return Ok(None) };
    let held = kept.0.as_ptr();
    py.run(c"f.set_(torch.zeros(0))\nfd2 = f.data_ptr()\n", Some(&globals), None)?;
    // SAFETY: the keeper is alive (`kept` holds it).
    let freed_by_torch = unsafe { (*held).holders.load(Ordering::Acquire) } == 1;
    // SAFETY: as above.
    let dp = unsafe { keep.data_ptr_of(tf) };
    kept.release(dp, &mut spare);
    Ok(freed_by_torch.then_some(keep))
}
