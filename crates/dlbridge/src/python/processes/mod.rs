//! Tensors across processes.

#[cfg(target_os = "linux")]
pub(in crate::python) mod shared;
