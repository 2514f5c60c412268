//! From a Python object to a [`crate::ManagedTensor`]. `dispatch.rs` decides which protocol the
//! object speaks and hands it to the file that speaks it: numpy's array struct (`numpy.rs`), a
//! capsule (the runtime's `capsule.rs`), the type's C exchange table as a consumer (`exchange.rs`,
//! with torch's bits in `torch_bits.rs`), the `__dlpack__` negotiation (`dlpack.rs`), the buffer
//! protocol and the array interfaces (`protocols.rs`); what each type speaks is cached per type
//! (`cache.rs`). Nothing here calls back into `dispatch.rs`; the room knows only the runtime.

mod cache;
mod dispatch;
mod dlpack;
mod exchange;
mod numpy;
mod protocols;
mod torch_bits;

pub use cache::Framework;
#[cfg(feature = "test-hooks")]
pub(in crate::python) use cache::MISSES;
pub(in crate::python) use cache::{Importer, Kind, framework, type_info};
pub use dispatch::{asdlpack_with, from_dlpack_with};
pub use dlpack::ImportOptions;
pub(in crate::python) use dlpack::options;
pub use exchange::{EXCHANGE_API_CAPSULE, ExchangeApi, TENSOR_EXCHANGE_API};
pub(in crate::python) use exchange::{TorchState, tensor_exchange_capsule};
#[cfg(feature = "test-hooks")]
pub(in crate::python) use numpy::fast_path_enabled;
pub(in crate::python) use numpy::{NumpyParts, adopt, can_adopt, fill_dims, parts, parts_exact};
pub use protocols::AnyTensor;
pub(in crate::python) use protocols::{not_an_array, read_view};
#[cfg(feature = "test-hooks")]
pub(in crate::python) use torch_bits::aten_bits;
#[cfg(all(feature = "torch-stable", unix))]
pub(in crate::python) use torch_bits::install_native_version_hooks;
pub(in crate::python) use torch_bits::{Bump, Kept, SpareKeeper, aten_bits_found};
