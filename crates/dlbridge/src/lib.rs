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
//! ## Where things are
//!
//! At the crate root: [`ManagedTensor`], [`DataType`], [`Element`], [`Device`], [`DeviceType`],
//! [`Error`], [`Result`], [`Flags`], [`SliceRef`]/[`SliceMut`], [`AlignedBuffer`], [`HostBuffer`],
//! and, with feature `python`, the PyO3 argument and result types `TensorRef`, `TensorMut`,
//! `TensorView`, `Framework`, `Output` and `argument_error` (defined in [`python`], which has
//! the rest of the Python layer). In modules, named by path: [`spec`] (the requirement types of
//! typed arguments: `Rank`, `Dim`, `Any`, `C`, `F`, `AnyOrder`, `Cpu`, `Cuda`, `AnyDevice`),
//! [`ffi`] (the raw ABI), [`layout`] (the overflow-checked stride arithmetic), [`borrow`] (the
//! borrow registry), [`export`], `ndarray` (feature `ndarray`: views and export) and
//! [`bridges`] (features `faer`, `nalgebra`, `arrow`, `image`, `candle`, `cudarc`: a table of what
//! each does), `torch_stable` (feature `torch-stable`: kernels as native torch ops through torch's
//! stable C ABI, found at run time).
//!
//! A PyO3 kernel's `use` lines (features `python` and `ndarray`, `pyo3 = "0.30"`):
//!
//! ```
//! # #[cfg(feature = "python")]
//! # mod kernel {
//! use dlbridge::spec::{AnyOrder, C, Cpu, Rank};
//! use dlbridge::{DataType, Framework, TensorMut, TensorRef, TensorView, argument_error};
//! use pyo3::prelude::*;
//! # }
//! ```

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
mod fork;
pub mod interface;
pub mod layout;
pub mod managed;
#[cfg(feature = "ndarray")]
pub mod ndarray;
mod parse;
mod process_wide;
#[cfg(feature = "python")]
pub mod python;
#[cfg(all(feature = "shm", target_os = "linux"))]
pub mod shm;
#[cfg(all(feature = "shm", target_os = "linux"))]
mod shm_registry;
pub mod spec;
#[cfg(all(feature = "torch-stable", unix))]
pub mod torch_stable;
mod view;
pub mod xla;
pub mod xla_ffi;

pub use device::{Device, DeviceType};
pub use dtype::{DataType, Element, TypeCode};
pub use error::{Error, Result};
pub use export::{ALIGNMENT, AlignedBuffer, HostBuffer};
pub use flags::{Flags, Version};
pub use managed::{MAX_NDIM, ManagedTensor, RawManagedTensor};
#[cfg(feature = "python")]
pub use python::{Framework, Output, TensorList, TensorMut, TensorRef, TensorView, argument_error};
pub use view::{SliceMut, SliceRef};
