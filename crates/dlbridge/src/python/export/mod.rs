//! From Rust tensors back to Python.

pub(in crate::python) mod framework;
pub(in crate::python) mod tensor;
