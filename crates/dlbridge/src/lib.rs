//! # dlbridge
//!
//! Zero-copy tensor exchange through DLPack 1.3. Foreign tensors (from numpy, torch, jax, C
//! libraries...) enter as a [`ManagedTensor`], validated once, after which every accessor is safe;
//! Rust-owned storage leaves as a `ManagedTensor` whose deleter frees it exactly once.
//!
//! ```
//! use dlbridge::{ManagedTensor, RawManagedTensor};
//! // A Rust buffer exported as a DLPack tensor...
//! let data = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
//! let ptr = data.as_ptr();
//! let exported = ManagedTensor::from_vec(data, &[2, 3]).unwrap();
//! // ...handed over as a raw `DLManagedTensorVersioned*`, as a C consumer would receive it...
//! let RawManagedTensor::Versioned(raw) = exported.into_raw() else { unreachable!() };
//! // ...and taken back in through the validating door. No copy happened.
//! let imported = unsafe { ManagedTensor::from_raw_versioned(raw) }.unwrap();
//! assert_eq!(imported.data_ptr().cast_const().cast::<f32>(), ptr);
//! assert_eq!(imported.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
//! ```
//!
//! Modules: [`ffi`] is the raw ABI; [`layout`] the overflow-checked stride arithmetic; the rest is
//! re-exported at the crate root. Feature `ndarray` adds `ndarray` views and export; feature
//! `python` the PyO3 layer ([`python`]); features `faer`, `nalgebra`, `arrow`, `image`, `candle`
//! and `cudarc` the bridges to those crates ([`bridges`], a table of what each does).

pub mod borrow;
pub mod bridges;
pub mod cuda;
pub mod device;
mod dims;
pub mod dtype;
pub mod error;
pub mod export;
pub mod ffi;
pub mod flags;
pub mod interface;
pub mod layout;
pub mod managed;
#[cfg(feature = "ndarray")]
pub mod ndarray;
#[cfg(feature = "python")]
pub mod python;
pub mod spec;
mod view;

pub use device::{Device, DeviceType};
pub use dtype::{DataType, Element, TypeCode};
pub use error::{Error, Result};
pub use export::{ALIGNMENT, AlignedBuffer, HostBuffer};
pub use flags::{Flags, Version};
pub use managed::{MAX_NDIM, ManagedTensor, RawManagedTensor};
pub use view::{SliceMut, SliceRef};
