//! From a Python object to a [`crate::ManagedTensor`].

pub(in crate::python) mod cache;
pub(in crate::python) mod dispatch;
pub(in crate::python) mod dlpack;
pub(in crate::python) mod exchange;
pub(in crate::python) mod numpy;
pub(in crate::python) mod protocols;
pub(in crate::python) mod torch_bits;

pub use dispatch::{asdlpack_with, from_dlpack_with};
pub use dlpack::ImportOptions;
pub(in crate::python) use dlpack::options;
pub use protocols::AnyTensor;
