//! Bridges to the Rust array ecosystem, each behind its own cargo feature (all off by default):
//!
//! | feature | module | into the other crate (import) | out of it (export) |
//! |---|---|---|---|
//! | `faer` | `faer` | `MatRef`/`MatMut` over 2-d tensors, any strides | `Mat<T>` |
//! | `nalgebra` | `nalgebra` | `DMatrixView`/`DMatrixViewMut`, `DVectorView`/`DVectorViewMut` | `DMatrix`, `DVector` |
//! | `arrow` | `arrow` | `PrimitiveArray`, `FixedSizeListArray` (`arrow.fixed_shape_tensor`) | the same |
//! | `image` | `image` | `ImageBuffer` over the tensor (HWC) | `ImageBuffer<P, Vec<_>>` |
//! | `candle` | `candle` | a CPU `Tensor` (one copy: candle cannot hold foreign memory) | a CPU `Tensor` (one copy: candle writes its storage through `&Tensor`) |
//! | `cudarc` | `cudarc` | `CudaView`/`CudaViewMut` over CUDA tensors | `CudaSlice<T>` |
//!
//! Every typed view over an imported tensor goes through the same check-and-lease path as
//! [`ManagedTensor::as_slice`] and the ndarray views (host memory of the right dtype, aligned,
//! writable and non-overlapping for mutable views, a shared or exclusive lease in
//! [`crate::borrow`] held while the view lives). Views are guards whose methods lend the other
//! crate's view type only for as long as the guard is borrowed (those types are `Copy` or
//! cheaply cloned, so a view of the guard's own lifetime could outlive its lease). Exports go
//! through [`ManagedTensor::from_host_strided`] and [`crate::HostBuffer`], so they are validated
//! like any foreign tensor and free the other crate's storage exactly once.

#[cfg(feature = "arrow")]
pub mod arrow;
#[cfg(feature = "candle")]
pub mod candle;
#[cfg(feature = "cudarc")]
pub mod cudarc;
#[cfg(feature = "faer")]
pub mod faer;
#[cfg(feature = "image")]
pub mod image;
#[cfg(feature = "nalgebra")]
pub mod nalgebra;

#[allow(unused_imports)]
use crate::{Error, ManagedTensor, Result};

/// The extents and strides (in elements) of a tensor of exactly `N` dimensions, or an error that
/// names its ndim.
#[allow(dead_code)]
pub(crate) fn dims<const N: usize>(t: &ManagedTensor, what: &str) -> Result<([usize; N], [isize; N])> {
    if t.ndim() != N {
        return Err(Error::Incompatible {
            expected: format!("a {N}-d tensor ({what})"),
            found: t.describe(),
        });
    }
    let mut shape = [0usize; N];
    let mut strides = [0isize; N];
    for ax in 0..N {
        // Validated on entry: extents are non-negative and their product fits isize; strides fit
        // isize on the 64-bit targets this crate supports (ffi.rs asserts the layout).
        shape[ax] = t.shape()[ax] as usize;
        strides[ax] = t.strides()[ax] as isize;
    }
    Ok((shape, strides))
}
