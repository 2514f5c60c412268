//! What a kernel needs of a tensor, stated once: element type, rank or fixed extents, memory order,
//! device, writability. A [`Spec`] is checked in one pass
//! ([`ManagedTensor::check`](crate::ManagedTensor::check), in `managed.rs` with the wording of its
//! refusal); a refusal is an [`Error::Mismatch`](crate::Error::Mismatch) that names the first field
//! that failed and says expected against found, so Rust code can `match` on it and Python code gets
//! a `TypeError`. This file knows neither `Error` nor `ManagedTensor`: `error.rs` names
//! [`Mismatch`], and `managed.rs` checks against a [`Spec`].
//!
//! Specs are usually written as types, so a `#[pyfunction]` argument states them
//! (`TensorRef<'_, f32, Rank<2>, C>` in [`crate::python`]): shapes [`AnyShape`], [`Rank<N>`] or a
//! tuple of [`Dim<N>`] and [`Any`] extents; orders [`C`], [`F`], [`AnyOrder`]; devices [`Cpu`],
//! [`Cuda`], [`AnyDevice`]. [`spec_of`] turns such a type list into its `Spec`.
//!
//! ```
//! use dlbridge::spec::{self, Any, Dim, C, Cpu, Field};
//! use dlbridge::{Error, ManagedTensor};
//! // A float32 (n, 3) C-contiguous host tensor...
//! let want = spec::spec_of::<f32, (Any, Dim<3>), C, Cpu>(false);
//! assert_eq!(want.to_string(), "float32 (*, 3) C-contiguous cpu tensor");
//! let ok = ManagedTensor::from_vec(vec![0f32; 6], &[2, 3]).unwrap();
//! assert!(ok.check(&want).is_ok());
//! // ...refuses a (3, 2) one, naming the axis.
//! let bad = ManagedTensor::from_vec(vec![0f32; 6], &[3, 2]).unwrap();
//! match bad.check(&want) {
//!     Err(Error::Mismatch(m)) => {
//!         assert_eq!(m.field, Field::Extent { axis: 1 });
//!         assert_eq!(m.to_string(), "expected float32 (*, 3) C-contiguous cpu tensor, got float32 (3, 2) on cpu");
//!     }
//!     other => panic!("{other:?}"),
//! }
//! ```

use std::fmt;
use std::marker::PhantomData;

use crate::device::{Device, DeviceType};
use crate::dims::tuple;
use crate::dtype::{DataType, Element};

/// A required memory order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Order {
    /// Row-major and compact (size-1 axes ignored).
    C,
    /// Column-major and compact (size-1 axes ignored).
    F,
    /// Any strides, including negative, zero and gapped ones.
    Any,
}

/// A required device kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// Memory the CPU can read and write: plain host memory, pinned host memory, CUDA managed
    /// memory ([`Device::is_host_accessible`]).
    Cpu,
    /// CUDA device memory (`cuda`, or `cuda_managed`).
    Cuda,
    /// Any device.
    Any,
}

impl DeviceKind {
    /// Whether `device` is of this kind.
    #[inline]
    pub fn admits(self, device: Device) -> bool {
        match self {
            Self::Cpu => device.is_host_accessible(),
            Self::Cuda => matches!(device.device_type(), DeviceType::CUDA | DeviceType::CUDA_MANAGED),
            Self::Any => true,
        }
    }
}

/// What a tensor must be. Every field left open (`None`, [`Order::Any`], [`DeviceKind::Any`],
/// `writable: false`) admits anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Spec {
    /// The element type.
    pub dtype: Option<DataType>,
    /// The number of dimensions.
    pub rank: Option<usize>,
    /// Fixed extents, one per axis when non-empty (`None`: any extent on that axis); implies the
    /// rank.
    pub extents: &'static [Option<u64>],
    /// The memory order.
    pub order: Order,
    /// The device kind.
    pub device: DeviceKind,
    /// Whether the tensor must be writable (not read-only, no overlapping elements).
    pub writable: bool,
}

impl Spec {
    /// The spec that admits every tensor.
    pub const ANY: Spec = Spec {
        dtype: None,
        rank: None,
        extents: &[],
        order: Order::Any,
        device: DeviceKind::Any,
        writable: false,
    };
}

/// Which requirement a tensor failed first (checked in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Field {
    /// The element type.
    DType,
    /// The number of dimensions.
    Rank,
    /// The extent of one axis.
    Extent {
        /// The axis.
        axis: usize,
    },
    /// The device.
    Device,
    /// The memory order.
    Order,
    /// Writability: the tensor is read-only, or its elements may overlap.
    Writable,
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DType => f.write_str("dtype"),
            Self::Rank => f.write_str("ndim"),
            Self::Extent { axis } => write!(f, "shape[{axis}]"),
            Self::Device => f.write_str("device"),
            Self::Order => f.write_str("strides"),
            Self::Writable => f.write_str("writable"),
        }
    }
}

/// A tensor that failed a [`Spec`]: which field, what was expected, what the tensor is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Mismatch {
    /// The first requirement that failed.
    pub field: Field,
    /// The whole requirement.
    pub expected: Spec,
    /// The tensor's element type.
    pub dtype: DataType,
    /// The tensor's extents.
    pub shape: Vec<i64>,
    /// The tensor's strides in elements.
    pub strides: Vec<i64>,
    /// The tensor's device.
    pub device: Device,
    /// Whether the tensor is read-only.
    pub read_only: bool,
}

impl fmt::Display for Spec {
    /// `writable float32 (*, 3) C-contiguous cpu tensor`: the words a refusal uses.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.writable {
            f.write_str("writable ")?;
        }
        match self.dtype {
            Some(d) => write!(f, "{d}")?,
            None => f.write_str("any dtype")?,
        }
        if !self.extents.is_empty() {
            let e: Vec<String> =
                self.extents.iter().map(|e| e.map_or_else(|| "*".to_string(), |n| n.to_string())).collect();
            write!(f, " {}", tuple(&e))?;
        } else if let Some(r) = self.rank {
            write!(f, " {r}-d")?;
        }
        match self.order {
            Order::C => f.write_str(" C-contiguous")?,
            Order::F => f.write_str(" F-contiguous")?,
            Order::Any => {}
        }
        match self.device {
            DeviceKind::Cpu => f.write_str(" cpu")?,
            DeviceKind::Cuda => f.write_str(" cuda")?,
            DeviceKind::Any => {}
        }
        f.write_str(" tensor")
    }
}

/// The one check pass of every typed argument, over a tensor's parts: the first field of `spec`
/// failed (dtype, rank, extents, device, order, writability, in that order), if any. A
/// [`ManagedTensor`](crate::ManagedTensor) and an XLA FFI buffer ([`crate::xla`]) are both checked here.
#[inline(always)]
pub(crate) fn first_failure_of(
    spec: &Spec,
    dtype: DataType,
    shape: &[i64],
    device: Device,
    c_contiguous: impl FnOnce() -> bool,
    f_contiguous: impl FnOnce() -> bool,
    writable: impl FnOnce() -> bool,
) -> Option<Field> {
    if spec.dtype.is_some_and(|d| d != dtype) {
        return Some(Field::DType);
    }
    let rank = if spec.extents.is_empty() { spec.rank } else { Some(spec.extents.len()) };
    if rank.is_some_and(|r| r != shape.len()) {
        return Some(Field::Rank);
    }
    for (axis, (want, &have)) in spec.extents.iter().zip(shape).enumerate() {
        if want.is_some_and(|w| w as i64 != have) {
            return Some(Field::Extent { axis });
        }
    }
    if !spec.device.admits(device) {
        return Some(Field::Device);
    }
    let order_ok = match spec.order {
        Order::C => c_contiguous(),
        Order::F => f_contiguous(),
        Order::Any => true,
    };
    if !order_ok {
        return Some(Field::Order);
    }
    if spec.writable && !writable() {
        return Some(Field::Writable);
    }
    None
}

/// A shape requirement as a type: [`AnyShape`], [`Rank<N>`], or a tuple of [`Dim<N>`] / [`Any`]
/// (up to six axes).
pub trait ShapeSpec {
    /// The rank required, if any.
    const RANK: Option<usize>;
    /// Fixed extents per axis (empty: none fixed).
    const EXTENTS: &'static [Option<u64>];
}

/// One axis of a tuple shape: [`Dim<N>`] (exactly `N`) or [`Any`].
pub trait ExtentSpec {
    /// The extent required, if any.
    const EXTENT: Option<u64>;
}

/// Any number of dimensions, any extents.
#[derive(Debug, Clone, Copy)]
pub struct AnyShape;
/// Exactly `N` dimensions, any extents.
#[derive(Debug, Clone, Copy)]
pub struct Rank<const N: usize>;
/// An axis of extent exactly `N` (in a tuple shape).
#[derive(Debug, Clone, Copy)]
pub struct Dim<const N: u64>;
/// An axis of any extent (in a tuple shape).
#[derive(Debug, Clone, Copy)]
pub struct Any;

impl ShapeSpec for AnyShape {
    const RANK: Option<usize> = None;
    const EXTENTS: &'static [Option<u64>] = &[];
}
impl<const N: usize> ShapeSpec for Rank<N> {
    const RANK: Option<usize> = Some(N);
    const EXTENTS: &'static [Option<u64>] = &[];
}
impl<const N: u64> ExtentSpec for Dim<N> {
    const EXTENT: Option<u64> = Some(N);
}
impl ExtentSpec for Any {
    const EXTENT: Option<u64> = None;
}

macro_rules! tuple_shape {
    ($n:literal: $($a:ident),+) => {
        impl<$($a: ExtentSpec),+> ShapeSpec for ($($a,)+) {
            const RANK: Option<usize> = Some($n);
            const EXTENTS: &'static [Option<u64>] = &[$($a::EXTENT),+];
        }
    };
}
tuple_shape!(1: A);
tuple_shape!(2: A, B);
tuple_shape!(3: A, B, D);
tuple_shape!(4: A, B, D, E);
tuple_shape!(5: A, B, D, E, G);
tuple_shape!(6: A, B, D, E, G, H);

/// A memory-order requirement as a type: [`C`], [`F`] or [`AnyOrder`].
pub trait OrderSpec {
    /// The order required.
    const ORDER: Order;
}
/// Row-major, compact.
#[derive(Debug, Clone, Copy)]
pub struct C;
/// Column-major, compact.
#[derive(Debug, Clone, Copy)]
pub struct F;
/// Any strides.
#[derive(Debug, Clone, Copy)]
pub struct AnyOrder;
impl OrderSpec for C {
    const ORDER: Order = Order::C;
}
impl OrderSpec for F {
    const ORDER: Order = Order::F;
}
impl OrderSpec for AnyOrder {
    const ORDER: Order = Order::Any;
}
/// An order under which the elements are one compact run of memory ([`C`] or [`F`]): a slice.
pub trait Compact: OrderSpec {}
impl Compact for C {}
impl Compact for F {}

/// A device requirement as a type: [`Cpu`], [`Cuda`] or [`AnyDevice`].
pub trait DeviceSpec {
    /// The device kind required.
    const DEVICE: DeviceKind;
}
/// Host-accessible memory.
#[derive(Debug, Clone, Copy)]
pub struct Cpu;
/// CUDA memory.
#[derive(Debug, Clone, Copy)]
pub struct Cuda;
/// Any device.
#[derive(Debug, Clone, Copy)]
pub struct AnyDevice;
impl DeviceSpec for Cpu {
    const DEVICE: DeviceKind = DeviceKind::Cpu;
}
impl DeviceSpec for Cuda {
    const DEVICE: DeviceKind = DeviceKind::Cuda;
}
impl DeviceSpec for AnyDevice {
    const DEVICE: DeviceKind = DeviceKind::Any;
}

/// The [`Spec`] a list of requirement types states (`writable` for mutable arguments).
pub const fn spec_of<T: Element, S: ShapeSpec, O: OrderSpec, D: DeviceSpec>(writable: bool) -> Spec {
    Spec {
        dtype: Some(T::DTYPE),
        rank: S::RANK,
        extents: S::EXTENTS,
        order: O::ORDER,
        device: D::DEVICE,
        writable,
    }
}

/// The specs of a requirement-type list as constants (one per monomorphisation), so a typed
/// argument's check reads a constant. (Only the Python layer's typed arguments use them.)
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) struct SpecOf<T, S, O, D>(PhantomData<(T, S, O, D)>);
#[cfg_attr(not(feature = "python"), allow(dead_code))]
impl<T: Element, S: ShapeSpec, O: OrderSpec, D: DeviceSpec> SpecOf<T, S, O, D> {
    /// Read access.
    pub(crate) const READ: Spec = spec_of::<T, S, O, D>(false);
    /// Write access.
    pub(crate) const WRITE: Spec = spec_of::<T, S, O, D>(true);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::managed::ManagedTensor;

    fn t(shape: &[usize], strides: &[isize]) -> ManagedTensor {
        let n = shape.iter().product::<usize>().max(1) * 4;
        ManagedTensor::from_host_strided(vec![0f64; n], shape, strides, 0).unwrap()
    }

    fn field(t: &ManagedTensor, s: &Spec) -> Option<Field> {
        match t.check(s) {
            Ok(()) => None,
            Err(Error::Mismatch(m)) => Some(m.field),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn each_field_is_named() {
        let c = t(&[2, 3], &[3, 1]);
        assert_eq!(field(&c, &spec_of::<f64, Rank<2>, C, Cpu>(true)), None);
        assert_eq!(field(&c, &spec_of::<f32, Rank<2>, C, Cpu>(false)), Some(Field::DType));
        assert_eq!(field(&c, &spec_of::<f64, Rank<3>, C, Cpu>(false)), Some(Field::Rank));
        assert_eq!(
            field(&c, &spec_of::<f64, (Dim<2>, Dim<4>), C, Cpu>(false)),
            Some(Field::Extent { axis: 1 })
        );
        assert_eq!(field(&c, &spec_of::<f64, (Dim<2>, Any), C, Cpu>(false)), None);
        assert_eq!(field(&c, &spec_of::<f64, (Any,), C, Cpu>(false)), Some(Field::Rank));
        assert_eq!(field(&c, &spec_of::<f64, AnyShape, C, Cuda>(false)), Some(Field::Device));
        assert_eq!(field(&c, &spec_of::<f64, AnyShape, F, Cpu>(false)), Some(Field::Order));
        let f = t(&[2, 3], &[1, 2]);
        assert_eq!(field(&f, &spec_of::<f64, AnyShape, F, AnyDevice>(false)), None);
        assert_eq!(field(&f, &spec_of::<f64, AnyShape, AnyOrder, Cpu>(true)), None);
        let overlapping = t(&[2, 2], &[1, 1]);
        assert_eq!(field(&overlapping, &spec_of::<f64, AnyShape, AnyOrder, Cpu>(false)), None);
        assert_eq!(
            field(&overlapping, &spec_of::<f64, AnyShape, AnyOrder, Cpu>(true)),
            Some(Field::Writable)
        );
        let ro = ManagedTensor::from_vec(vec![1.0f64], &[1]).unwrap().into_read_only();
        assert_eq!(field(&ro, &spec_of::<f64, Rank<1>, C, Cpu>(true)), Some(Field::Writable));
        assert_eq!(field(&ro, &Spec::ANY), None);
    }

    #[test]
    fn overlap_is_named_when_it_is_why_writing_is_refused() {
        // A foreign tensor whose elements overlap but which is not marked read-only (torch's
        // `expand`): the refusal says why.
        let t = t(&[3], &[0]);
        let mut m = match t.check(&spec_of::<f64, AnyShape, AnyOrder, Cpu>(true)) {
            Err(Error::Mismatch(m)) => m,
            other => panic!("{other:?}"),
        };
        m.read_only = false;
        assert_eq!(
            m.to_string(),
            "expected writable float64 cpu tensor, got float64 (3,) strides (0,) (elements overlap) on cpu"
        );
    }

    #[test]
    fn messages_say_expected_and_found() {
        let f = t(&[3, 4], &[1, 3]);
        let e = f.check(&spec_of::<f32, Rank<2>, C, Cpu>(false)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "expected float32 2-d C-contiguous cpu tensor, got float64 (3, 4) strides (1, 3) on cpu"
        );
        let ro = ManagedTensor::from_vec(vec![1.0f64; 3], &[3]).unwrap().into_read_only();
        let e = ro.check(&spec_of::<f64, AnyShape, AnyOrder, AnyDevice>(true)).unwrap_err();
        assert_eq!(e.to_string(), "expected writable float64 tensor, got read-only float64 (3,) on cpu");
        let overlapping = t(&[2, 2], &[0, 1]);
        let e = overlapping.check(&spec_of::<f64, AnyShape, AnyOrder, Cpu>(true)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "expected writable float64 cpu tensor, got read-only float64 (2, 2) strides (0, 1) on cpu"
        );
    }
}
