//! A handler's state: made once when XLA instantiates the handler (once per compiled executable
//! that calls it), kept by XLA (`XLA_FFI_State_Set`), read by every call (`XLA_FFI_State_Get`) and
//! freed by XLA with this module's deleter when the executable goes.
//!
//! Every dlbridge state is one XLA type, registered once per XLA registry (`XLA_FFI_Type_Register`)
//! under a name unique to this copy of the code: a [`StateBox`] holding the handler's value as
//! `dyn Any`, so [`Call::state`](super::Call::state) checks the Rust type it is read as.

use crate::fork::ForkSafeMutex;
use std::any::{Any, TypeId};
use std::ffi::c_void;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

use super::api::{Api, FfiError, Result, drop_payload, panic_message};
use crate::xla_ffi::*;

/// What [`xla_handler!`](crate::xla_handler)'s `state: Type = init` declares: the state's type
/// and how to make it (at XLA's instantiate stage, once per compiled executable).
#[derive(Clone, Copy)]
pub struct StateDecl {
    type_id: fn() -> TypeId,
    type_name: fn() -> &'static str,
    make: fn() -> Box<dyn Any + Send + Sync>,
}

impl StateDecl {
    /// A state of type `T`, made by `make` (which returns a `T` in a box: a box of another type
    /// is refused when it is read, [`Call::state`](super::Call::state)).
    pub const fn new<T: Any + Send + Sync>(make: fn() -> Box<dyn Any + Send + Sync>) -> Self {
        Self { type_id: TypeId::of::<T>, type_name: std::any::type_name::<T>, make }
    }

    /// The state's type name.
    pub fn type_name(&self) -> &'static str {
        (self.type_name)()
    }

    /// Whether the state is a `T`.
    pub fn is<T: Any>(&self) -> bool {
        (self.type_id)() == TypeId::of::<T>()
    }
}

impl fmt::Debug for StateDecl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StateDecl").field("type", &self.type_name()).finish()
    }
}

impl PartialEq for StateDecl {
    fn eq(&self, other: &Self) -> bool {
        (self.type_id)() == (other.type_id)()
    }
}

impl Eq for StateDecl {}

/// What XLA keeps: the handler's value and its type's name (for errors).
pub(super) struct StateBox {
    type_name: &'static str,
    value: Box<dyn Any + Send + Sync>,
}

/// The deleter XLA calls when an executable goes: drops the box (never blocks in dlbridge; the
/// state's own `Drop` must not block either, e.g. on the GIL). A panic in it is reported, never
/// unwound into XLA.
unsafe extern "C" fn drop_state(state: *mut c_void) {
    if state.is_null() {
        return;
    }
    // SAFETY: XLA passes a state of this type, which only instantiate() made (Box::into_raw of a
    // StateBox), once.
    let state = unsafe { Box::from_raw(state.cast::<StateBox>()) };
    if let Err(p) = catch_unwind(AssertUnwindSafe(move || drop(state))) {
        eprintln!("dlbridge: dropping an XLA handler's state panicked: {}", panic_message(&*p));
        drop_payload(p);
    }
}

/// The type id each XLA gave dlbridge's state type, keyed by its API table (XLA's is a static
/// object, one per copy of XLA: jaxlib's, or a plugin's, each with its own type registry). The
/// first one is also kept in two atomics, read without the lock.
static FIRST_REGISTRY: AtomicUsize = AtomicUsize::new(0);
static FIRST_ID: AtomicI64 = AtomicI64::new(0);
/// Fork-safe: a forked child finds it free (a thread registering the type at the fork would
/// otherwise leave it held forever in the child).
static REGISTRIES: ForkSafeMutex<Vec<(usize, i64)>> = ForkSafeMutex::new(Vec::new());

fn registry_key(api: Api<'_>) -> Option<(usize, XLA_FFI_Type_Register)> {
    api_field!(api, XLA_FFI_Type_Register).map(|f| (api.table as usize, f))
}

/// dlbridge's state type id in `api`'s registry: `None` when it was never registered there (no
/// handler of this copy of dlbridge was instantiated through it).
fn known_type_id(key: usize) -> Option<i64> {
    if FIRST_REGISTRY.load(Ordering::Acquire) == key {
        return Some(FIRST_ID.load(Ordering::Relaxed));
    }
    let known = REGISTRIES.lock();
    known.iter().find(|(k, _)| *k == key).map(|&(_, id)| id)
}

/// dlbridge's state type id in `api`'s registry, registered now if it is not yet.
fn type_id(api: Api<'_>) -> Result<i64> {
    let Some((key, register)) = registry_key(api) else {
        return Err(FfiError::new(
            XLA_FFI_Error_Code::UNIMPLEMENTED,
            "state: the XLA FFI API table has no XLA_FFI_Type_Register (an older XLA?)",
        ));
    };
    if let Some(id) = known_type_id(key) {
        return Ok(id);
    }
    let mut known = REGISTRIES.lock();
    if let Some(&(_, id)) = known.iter().find(|(k, _)| *k == key) {
        return Ok(id);
    }
    // A name unique to this copy of the code (two extensions each linking dlbridge register two
    // types, each with its own deleter).
    let name = format!("dlbridge.xla.HandlerState@{:p}", drop_state as *const ());
    let info = XLA_FFI_TypeInfo {
        struct_size: XLA_FFI_TypeInfo_STRUCT_SIZE,
        extension_start: std::ptr::null_mut(),
        deleter: Some(drop_state),
    };
    let mut id = XLA_FFI_TypeId { type_id: 0 };
    let mut args = XLA_FFI_Type_Register_Args {
        struct_size: XLA_FFI_Type_Register_Args_STRUCT_SIZE,
        extension_start: std::ptr::null_mut(),
        name: XLA_FFI_ByteSpan { ptr: name.as_ptr().cast(), len: name.len() },
        type_id: &mut id,
        type_info: &info,
    };
    // SAFETY: XLA's function with arguments of the declared size, alive for the call (XLA copies
    // the name and the type info).
    let err = unsafe { register(&mut args) };
    api.check(err, "state: registering its type")?;
    if id.type_id <= 0 {
        return Err(FfiError::new(
            XLA_FFI_Error_Code::INTERNAL,
            format!("state: XLA assigned type id {} to {name}", id.type_id),
        ));
    }
    known.push((key, id.type_id));
    if FIRST_REGISTRY.load(Ordering::Relaxed) == 0 {
        FIRST_ID.store(id.type_id, Ordering::Relaxed);
        FIRST_REGISTRY.store(key, Ordering::Release);
    }
    Ok(id.type_id)
}

/// The instantiate stage: makes the declared state (if any) and hands it to XLA.
pub(super) fn instantiate(
    api: Api<'_>,
    ctx: *mut XLA_FFI_ExecutionContext,
    decl: Option<StateDecl>,
) -> Result<()> {
    let Some(decl) = decl else { return Ok(()) };
    let mut id = XLA_FFI_TypeId { type_id: type_id(api)? };
    let set = api_field!(api, XLA_FFI_State_Set).ok_or_else(|| {
        FfiError::new(
            XLA_FFI_Error_Code::UNIMPLEMENTED,
            "state: the XLA FFI API table has no XLA_FFI_State_Set",
        )
    })?;
    let value = (decl.make)();
    let state = Box::into_raw(Box::new(StateBox { type_name: decl.type_name(), value }));
    let mut args = XLA_FFI_State_Set_Args {
        struct_size: XLA_FFI_State_Set_Args_STRUCT_SIZE,
        extension_start: std::ptr::null_mut(),
        ctx,
        stage: XLA_FFI_ExecutionStage::INSTANTIATE,
        type_id: &mut id,
        state: state.cast(),
    };
    // SAFETY: XLA's function with the call's context and arguments of the declared size; it takes
    // the state on success (and frees it with the type's deleter, drop_state).
    let err = unsafe { set(&mut args) };
    let taken = err.is_null();
    // XLA's error is read and freed first: a state whose Drop panics (below) leaks nothing of it.
    let result = api.check(err, "state: XLA_FFI_State_Set");
    if !taken {
        // Not taken: freed here.
        // SAFETY: made just above, not handed over.
        drop(unsafe { Box::from_raw(state) });
    }
    result
}

/// The state the instantiate stage made, as a `T`.
pub(super) fn get<'c, T: Any>(
    api: Api<'c>,
    ctx: *mut XLA_FFI_ExecutionContext,
    decl: Option<StateDecl>,
) -> Result<&'c T> {
    let Some(decl) = decl else {
        return Err(FfiError::new(
            XLA_FFI_Error_Code::FAILED_PRECONDITION,
            "state: the handler declares none (xla_handler!'s `state: Type = init`)",
        ));
    };
    if !decl.is::<T>() {
        return Err(FfiError::new(
            XLA_FFI_Error_Code::FAILED_PRECONDITION,
            format!(
                "state: the handler's state is a {}, not a {}",
                decl.type_name(),
                std::any::type_name::<T>()
            ),
        ));
    }
    let not_instantiated = |why: &str| {
        FfiError::new(
            XLA_FFI_Error_Code::FAILED_PRECONDITION,
            format!(
                "state: none was made ({why}): XLA runs a handler's instantiate stage only where it is \
                 registered for it: jax.ffi.register_ffi_target(name, {{\"instantiate\": capsule, \
                 \"execute\": capsule}}) (dlbridge.python::add_kernel does)"
            ),
        )
    };
    // Registered by the instantiate stage, or here (a table that makes the state on demand, as
    // the native torch op's, sees its type first here).
    let id = type_id(api)?;
    let get = api_field!(api, XLA_FFI_State_Get).ok_or_else(|| {
        FfiError::new(
            XLA_FFI_Error_Code::UNIMPLEMENTED,
            "state: the XLA FFI API table has no XLA_FFI_State_Get",
        )
    })?;
    let mut id = XLA_FFI_TypeId { type_id: id };
    let mut args = XLA_FFI_State_Get_Args {
        struct_size: XLA_FFI_State_Get_Args_STRUCT_SIZE,
        extension_start: std::ptr::null_mut(),
        ctx,
        stage: XLA_FFI_ExecutionStage::INSTANTIATE,
        type_id: &mut id,
        state: std::ptr::null_mut(),
    };
    // SAFETY: XLA's function with the call's context and arguments of the declared size.
    let err = unsafe { get(&mut args) };
    if let Err(e) = api.check(err, "XLA_FFI_State_Get") {
        return Err(not_instantiated(e.message()));
    }
    let state = args.state.cast::<StateBox>();
    if state.is_null() || !state.is_aligned() {
        return Err(not_instantiated("XLA_FFI_State_Get gave none"));
    }
    // SAFETY: a state of dlbridge's type (the id is this copy's, whose states only instantiate()
    // makes: a StateBox), which XLA keeps until the executable goes, after this call.
    let state = unsafe { &*state };
    state.value.downcast_ref::<T>().ok_or_else(|| {
        FfiError::new(
            XLA_FFI_Error_Code::FAILED_PRECONDITION,
            format!("state: XLA holds a {}, not a {}", state.type_name, std::any::type_name::<T>()),
        )
    })
}
