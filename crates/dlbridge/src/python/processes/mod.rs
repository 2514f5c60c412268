//! Tensors across processes (Linux): `dlbridge.shared_empty`, `dlbridge.share`, pickling a
//! `dlbridge.Tensor` (`shared.rs`, the one door to `crate::shm`). Knows the runtime and import.

#[cfg(target_os = "linux")]
mod shared;

#[cfg(target_os = "linux")]
pub(in crate::python) use shared::{add, deepcopy, reduce_ex};
