//! The kernel author's kit.

pub(in crate::python) mod kernel;
pub(in crate::python) mod typed;
pub(in crate::python) mod view;
