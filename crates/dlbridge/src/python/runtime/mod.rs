//! The runtime every room stands on: releasing Python references, buffer views and foreign
//! deleters without ever blocking, and joining the process (`release.rs`); CPython's fastcall
//! convention for the hot entry points (`fastcall.rs`); the vocabulary classes, `dlbridge.Tensor`
//! (what it holds), `DType`, `Device`, `DeviceType`, and Error -> exception (`types.rs`); the DLPack
//! capsules and their names (`capsule.rs`). It knows no other room.

mod capsule;
pub(in crate::python) mod fastcall;
mod release;
mod types;

pub use capsule::{
    DLTENSOR, DLTENSOR_VERSIONED, USED_DLTENSOR, USED_DLTENSOR_VERSIONED, consume, is_capsule,
};
pub(in crate::python) use capsule::{legacy_capsule, owner_capsule, versioned_capsule};
pub use release::PyOwner;
pub(in crate::python) use release::{
    HeldBuffer, attached_here, drain_queued, enter, gate_deleter, join_process,
};
pub use types::{PyDType, PyDevice, Tensor, argument_error, device_type_enum, device_type_member};
pub(in crate::python) use types::{dlpack_device_tuple, extract_device};
