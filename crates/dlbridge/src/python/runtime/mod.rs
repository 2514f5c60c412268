//! What every room of the Python layer stands on.

pub(in crate::python) mod capsule;
pub(in crate::python) mod fastcall;
pub(in crate::python) mod release;
pub(in crate::python) mod types;
