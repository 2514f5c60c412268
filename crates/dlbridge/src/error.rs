//! The one error type of dlbridge. Every variant names the field and the value that was refused.

use std::fmt;

pub(crate) use crate::dims::tuple;
use crate::dtype::DataType;

/// Everything dlbridge can refuse, each naming the offending field and value.
///
/// ```
/// use dlbridge::{DataType, Error};
/// let e = Error::ZeroLanes { dtype: DataType::new(dlbridge::TypeCode::FLOAT, 32, 0) };
/// assert!(e.to_string().contains("lanes"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// A NULL pointer where a managed tensor was expected.
    NullTensor,
    /// A versioned tensor whose major version is not 1 (its deleter has been called).
    UnsupportedVersion {
        /// The producer's major version.
        major: u32,
        /// The producer's minor version.
        minor: u32,
    },
    /// `ndim` negative or above [`crate::MAX_NDIM`].
    InvalidNdim {
        /// The value found.
        ndim: i64,
        /// The largest accepted.
        max: usize,
    },
    /// `shape` is NULL while `ndim > 0`.
    NullShape {
        /// The tensor's ndim.
        ndim: i32,
    },
    /// `shape` or `strides` not aligned for `int64_t`.
    MisalignedPointer {
        /// `"shape"` or `"strides"`.
        field: &'static str,
        /// The address found.
        address: usize,
    },
    /// A negative extent in `shape`.
    NegativeDim {
        /// The axis.
        axis: usize,
        /// The extent found.
        value: i64,
    },
    /// The product of `shape` does not fit in `isize`.
    ElementCountOverflow {
        /// The shape.
        shape: Vec<i64>,
    },
    /// The bytes the tensor spans (from its strides) do not fit the address space.
    SpanOverflow {
        /// The shape.
        shape: Vec<i64>,
        /// The strides, in elements.
        strides: Vec<i64>,
    },
    /// `data` is NULL while the tensor has elements.
    NullData {
        /// The element count.
        numel: u64,
    },
    /// A type code DLPack 1.3 does not define.
    UnknownTypeCode {
        /// The code found.
        code: u8,
    },
    /// `bits` not valid for the type code.
    InvalidBits {
        /// The dtype found.
        dtype: DataType,
        /// The widths accepted for its code.
        allowed: &'static [u8],
    },
    /// `lanes == 0`.
    ZeroLanes {
        /// The dtype found.
        dtype: DataType,
    },
    /// A device type DLPack 1.3 does not define.
    UnknownDeviceType {
        /// The value found.
        device_type: i32,
    },
    /// `data + byte_offset` (plus the span) wraps around the address space.
    ByteOffsetOverflow {
        /// The data pointer.
        data: usize,
        /// The byte offset.
        byte_offset: u64,
    },
    /// A dtype name that does not parse.
    UnknownDtypeName {
        /// The name given.
        name: String,
    },
    /// A device name that does not parse.
    UnknownDeviceName {
        /// The name given.
        name: String,
    },
    /// A Rust buffer too small for the shape and strides asked of it, or a shape whose element
    /// count is not the buffer length.
    BufferMismatch {
        /// What the layout needs.
        expected: String,
        /// What the buffer has.
        found: String,
    },
    /// Typed access to memory that a live slice or view from another handle already holds in a
    /// conflicting way (see [`crate::borrow`]): exclusive access while any other access is live,
    /// or shared access while an exclusive one is.
    AlreadyBorrowed {
        /// First byte of the range asked for.
        start: usize,
        /// One past its last byte.
        end: usize,
        /// Whether exclusive (mutable) access was asked for.
        exclusive: bool,
    },
    /// Mutable access the producer's own rules refuse for this tensor (torch: an in-place write
    /// into a leaf that requires grad while grad mode is on).
    WriteRefused {
        /// The field or state that refuses it (`"requires_grad"`).
        field: &'static str,
        /// Why, and what to do instead.
        reason: String,
    },
    /// A tensor that is not what a typed view or an operation needs.
    Incompatible {
        /// What was needed ("float32 C-contiguous host tensor").
        expected: String,
        /// What the tensor is ("float64 shape (3, 4) strides (1, 3) on cuda:0").
        found: String,
    },
    /// A tensor that fails a kernel's stated requirements ([`crate::spec::Spec`]): which field
    /// failed first, and the whole expected-against-found, to `match` on.
    Mismatch(Box<crate::spec::Mismatch>),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NullTensor => write!(f, "managed tensor pointer is NULL"),
            Self::UnsupportedVersion { major, minor } => write!(
                f,
                "version: DLPack {major}.{minor} is not supported (major must be 1; this is DLPack 1.3)"
            ),
            Self::InvalidNdim { ndim, max } => write!(f, "ndim: {ndim} is out of range (0 to {max})"),
            Self::NullShape { ndim } => write!(f, "shape: NULL with ndim {ndim}"),
            Self::MisalignedPointer { field, address } => {
                write!(f, "{field}: pointer {address:#x} is not aligned for int64")
            }
            Self::NegativeDim { axis, value } => write!(f, "shape[{axis}]: {value} is negative"),
            Self::ElementCountOverflow { shape } => {
                write!(f, "shape: element count of {} overflows", tuple(shape))
            }
            Self::SpanOverflow { shape, strides } => write!(
                f,
                "strides: {} over shape {} span more bytes than the address space holds",
                tuple(strides),
                tuple(shape)
            ),
            Self::NullData { numel } => write!(f, "data: NULL with {numel} elements"),
            Self::UnknownTypeCode { code } => write!(f, "dtype.code: {code} is not a DLPack 1.3 type code"),
            Self::InvalidBits { dtype, allowed } => write!(
                f,
                "dtype.bits: {} is invalid for type code {} (allowed: {})",
                dtype.bits(),
                dtype.code().0,
                allowed.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", ")
            ),
            Self::ZeroLanes { dtype } => write!(
                f,
                "dtype.lanes: 0 (code {}, bits {}); lanes must be at least 1",
                dtype.code().0,
                dtype.bits()
            ),
            Self::UnknownDeviceType { device_type } => {
                write!(f, "device.device_type: {device_type} is not a DLPack 1.3 device type")
            }
            Self::ByteOffsetOverflow { data, byte_offset } => {
                write!(f, "byte_offset: {byte_offset} added to data {data:#x} overflows the address space")
            }
            Self::UnknownDtypeName { name } => write!(f, "dtype: unknown name {name:?}"),
            Self::UnknownDeviceName { name } => write!(f, "device: unknown name {name:?}"),
            Self::BufferMismatch { expected, found } => {
                write!(f, "buffer: layout needs {expected}, buffer has {found}")
            }
            Self::Incompatible { expected, found } => write!(f, "expected {expected}, got {found}"),
            Self::Mismatch(m) => write!(f, "{m}"),
            Self::AlreadyBorrowed { start, end, exclusive } => write!(
                f,
                "memory {start:#x}..{end:#x}: already borrowed {} (a slice or view from another handle \
                 over the same memory is alive)",
                if *exclusive { "(mutable access needs it alone)" } else { "mutably" }
            ),
            Self::WriteRefused { field, reason } => write!(f, "{field}: {reason}"),
        }
    }
}

impl std::error::Error for Error {}

/// Shorthand for results with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
