//! Element types: [`DataType`], the open [`TypeCode`], and the [`Element`] trait that maps Rust
//! scalar types to DLPack dtypes.
//!
//! Names follow numpy, torch and ml_dtypes: `"float32"`, `"bfloat16"`, `"float8_e4m3fn"`,
//! `"complex64"`; vector types append `x{lanes}` (`"float32x4"`), and torch's packed pair of fp4
//! values prints as torch names it, `"float4_e2m1fn_x2"`.
//!
//! ```
//! use dlbridge::DataType;
//! let t: DataType = "bfloat16".parse().unwrap();
//! assert_eq!(t, DataType::BFLOAT16);
//! assert_eq!((t.code().0, t.bits(), t.lanes()), (4, 16, 1));
//! assert_eq!(DataType::FLOAT8_E4M3FN.to_string(), "float8_e4m3fn");
//! ```

use std::fmt;

use crate::ffi::DLDataType;

/// The DLPack type code: an open `u8` with a named constant for every code of DLPack 1.3 and the
/// ones its header has merged since (`TypeCode::FLOAT`, `TypeCode::FLOAT8_E4M3FN`,
/// `TypeCode::BCOMPLEX`, ...). Unknown codes are representable.
pub use crate::ffi::DLDataTypeCode as TypeCode;

/// A DLPack element type: type code, bits per lane and lanes.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataType(pub(crate) DLDataType);

/// The fixed-width names of the codes whose width is implied by the name.
pub(crate) const FIXED_NAMES: [(TypeCode, u8, &str); 11] = [
    (TypeCode::FLOAT8_E3M4, 8, "float8_e3m4"),
    (TypeCode::FLOAT8_E4M3, 8, "float8_e4m3"),
    (TypeCode::FLOAT8_E4M3B11FNUZ, 8, "float8_e4m3b11fnuz"),
    (TypeCode::FLOAT8_E4M3FN, 8, "float8_e4m3fn"),
    (TypeCode::FLOAT8_E4M3FNUZ, 8, "float8_e4m3fnuz"),
    (TypeCode::FLOAT8_E5M2, 8, "float8_e5m2"),
    (TypeCode::FLOAT8_E5M2FNUZ, 8, "float8_e5m2fnuz"),
    (TypeCode::FLOAT8_E8M0FNU, 8, "float8_e8m0fnu"),
    (TypeCode::FLOAT6_E2M3FN, 6, "float6_e2m3fn"),
    (TypeCode::FLOAT6_E3M2FN, 6, "float6_e3m2fn"),
    (TypeCode::FLOAT4_E2M1FN, 4, "float4_e2m1fn"),
];

/// The codes whose name is a prefix followed by the bit width (`int8`, `complex64`).
pub(crate) const WIDTH_NAMES: [(TypeCode, &str); 6] = [
    (TypeCode::UINT, "uint"),
    (TypeCode::INT, "int"),
    (TypeCode::BFLOAT, "bfloat"),
    (TypeCode::FLOAT, "float"),
    (TypeCode::COMPLEX, "complex"),
    (TypeCode::BCOMPLEX, "bcomplex"),
];

impl DataType {
    /// `bool`: one byte per element, code 6.
    pub const BOOL: Self = Self::new(TypeCode::BOOL, 8, 1);
    /// `int8`.
    pub const INT8: Self = Self::new(TypeCode::INT, 8, 1);
    /// `int16`.
    pub const INT16: Self = Self::new(TypeCode::INT, 16, 1);
    /// `int32`.
    pub const INT32: Self = Self::new(TypeCode::INT, 32, 1);
    /// `int64`.
    pub const INT64: Self = Self::new(TypeCode::INT, 64, 1);
    /// `uint8`.
    pub const UINT8: Self = Self::new(TypeCode::UINT, 8, 1);
    /// `uint16`.
    pub const UINT16: Self = Self::new(TypeCode::UINT, 16, 1);
    /// `uint32`.
    pub const UINT32: Self = Self::new(TypeCode::UINT, 32, 1);
    /// `uint64`.
    pub const UINT64: Self = Self::new(TypeCode::UINT, 64, 1);
    /// `float16` (IEEE half).
    pub const FLOAT16: Self = Self::new(TypeCode::FLOAT, 16, 1);
    /// `float32`.
    pub const FLOAT32: Self = Self::new(TypeCode::FLOAT, 32, 1);
    /// `float64`.
    pub const FLOAT64: Self = Self::new(TypeCode::FLOAT, 64, 1);
    /// `bfloat16`.
    pub const BFLOAT16: Self = Self::new(TypeCode::BFLOAT, 16, 1);
    /// `complex32` (a pair of float16; torch's `chalf`).
    pub const COMPLEX32: Self = Self::new(TypeCode::COMPLEX, 32, 1);
    /// `complex64` (a pair of float32).
    pub const COMPLEX64: Self = Self::new(TypeCode::COMPLEX, 64, 1);
    /// `complex128` (a pair of float64).
    pub const COMPLEX128: Self = Self::new(TypeCode::COMPLEX, 128, 1);
    /// `float8_e3m4`.
    pub const FLOAT8_E3M4: Self = Self::new(TypeCode::FLOAT8_E3M4, 8, 1);
    /// `float8_e4m3`.
    pub const FLOAT8_E4M3: Self = Self::new(TypeCode::FLOAT8_E4M3, 8, 1);
    /// `float8_e4m3b11fnuz`.
    pub const FLOAT8_E4M3B11FNUZ: Self = Self::new(TypeCode::FLOAT8_E4M3B11FNUZ, 8, 1);
    /// `float8_e4m3fn`.
    pub const FLOAT8_E4M3FN: Self = Self::new(TypeCode::FLOAT8_E4M3FN, 8, 1);
    /// `float8_e4m3fnuz`.
    pub const FLOAT8_E4M3FNUZ: Self = Self::new(TypeCode::FLOAT8_E4M3FNUZ, 8, 1);
    /// `float8_e5m2`.
    pub const FLOAT8_E5M2: Self = Self::new(TypeCode::FLOAT8_E5M2, 8, 1);
    /// `float8_e5m2fnuz`.
    pub const FLOAT8_E5M2FNUZ: Self = Self::new(TypeCode::FLOAT8_E5M2FNUZ, 8, 1);
    /// `float8_e8m0fnu`.
    pub const FLOAT8_E8M0FNU: Self = Self::new(TypeCode::FLOAT8_E8M0FNU, 8, 1);
    /// `float6_e2m3fn` (packed unless the tensor's sub-byte-padded flag is set).
    pub const FLOAT6_E2M3FN: Self = Self::new(TypeCode::FLOAT6_E2M3FN, 6, 1);
    /// `float6_e3m2fn` (packed unless the tensor's sub-byte-padded flag is set).
    pub const FLOAT6_E3M2FN: Self = Self::new(TypeCode::FLOAT6_E3M2FN, 6, 1);
    /// `float4_e2m1fn` (packed unless the tensor's sub-byte-padded flag is set).
    pub const FLOAT4_E2M1FN: Self = Self::new(TypeCode::FLOAT4_E2M1FN, 4, 1);
    /// `float4_e2m1fn_x2`: torch's byte holding two fp4 values (code 17, bits 4, lanes 2).
    pub const FLOAT4_E2M1FN_X2: Self = Self::new(TypeCode::FLOAT4_E2M1FN, 4, 2);
    /// `bcomplex32` (a pair of bfloat16; code 18, `kDLBcomplex`; ml_dtypes' name).
    pub const BCOMPLEX32: Self = Self::new(TypeCode::BCOMPLEX, 32, 1);

    /// Every named standard dtype, in code order.
    pub const ALL: [Self; 29] = [
        Self::INT8,
        Self::INT16,
        Self::INT32,
        Self::INT64,
        Self::UINT8,
        Self::UINT16,
        Self::UINT32,
        Self::UINT64,
        Self::FLOAT16,
        Self::FLOAT32,
        Self::FLOAT64,
        Self::BFLOAT16,
        Self::COMPLEX32,
        Self::COMPLEX64,
        Self::COMPLEX128,
        Self::BOOL,
        Self::FLOAT8_E3M4,
        Self::FLOAT8_E4M3,
        Self::FLOAT8_E4M3B11FNUZ,
        Self::FLOAT8_E4M3FN,
        Self::FLOAT8_E4M3FNUZ,
        Self::FLOAT8_E5M2,
        Self::FLOAT8_E5M2FNUZ,
        Self::FLOAT8_E8M0FNU,
        Self::FLOAT6_E2M3FN,
        Self::FLOAT6_E3M2FN,
        Self::FLOAT4_E2M1FN,
        Self::FLOAT4_E2M1FN_X2,
        Self::BCOMPLEX32,
    ];

    /// A data type from its three fields; not validated (see [`DataType::validate`]).
    pub const fn new(code: TypeCode, bits: u8, lanes: u16) -> Self {
        Self(DLDataType { code, bits, lanes })
    }

    /// The type code.
    pub const fn code(self) -> TypeCode {
        self.0.code
    }

    /// Bits per lane.
    pub const fn bits(self) -> u8 {
        self.0.bits
    }

    /// Number of lanes (1 for scalars).
    pub const fn lanes(self) -> u16 {
        self.0.lanes
    }

    /// The raw ABI struct.
    pub const fn to_raw(self) -> DLDataType {
        self.0
    }

    /// Wraps a raw ABI struct; not validated.
    pub const fn from_raw(raw: DLDataType) -> Self {
        Self(raw)
    }

    /// Bits one element occupies in memory: `bits * lanes`, or a whole byte per lane for
    /// sub-byte types when `subbyte_padded` (the tensor flag) is set.
    pub const fn storage_bits(self, subbyte_padded: bool) -> u64 {
        let bits = if subbyte_padded && self.0.bits < 8 { 8 } else { self.0.bits as u64 };
        bits * self.0.lanes as u64
    }

    /// Bytes per element when an element is a whole number of bytes (`bits * lanes` divisible
    /// by 8); `None` for packed sub-byte types.
    pub const fn itemsize(self) -> Option<usize> {
        let b = self.storage_bits(false);
        if b % 8 == 0 { Some((b / 8) as usize) } else { None }
    }

    /// Whether [`DataType::validate`] would accept this dtype, without building an error (the
    /// validation fast path asks this on every import).
    #[inline]
    pub(crate) fn is_valid(self) -> bool {
        let DLDataType { code, bits, lanes } = self.0;
        // Two table reads instead of a match and a search: this runs on every import.
        lanes != 0 && (VALID_BITS[usize::from(code.0)] >> bits_slot(bits)) & 1 != 0
    }

    fn base_name(self) -> Option<String> {
        let DLDataType { code, bits, .. } = self.0;
        if code == TypeCode::BOOL && bits == 8 {
            return Some("bool".to_owned());
        }
        if let Some((_, _, name)) = FIXED_NAMES.iter().find(|(c, b, _)| *c == code && *b == bits) {
            return Some((*name).to_owned());
        }
        WIDTH_NAMES.iter().find(|(c, _)| *c == code).map(|(_, prefix)| format!("{prefix}{bits}"))
    }
}

/// The bit widths a type code allows, or `None` for an unknown code (the one table behind
/// [`DataType::validate`] and, through [`VALID_BITS`], [`DataType::is_valid`]).
#[inline]
pub(crate) const fn allowed_bits(code: TypeCode) -> Option<&'static [u8]> {
    Some(match code {
        TypeCode::INT | TypeCode::UINT => &[1, 2, 4, 8, 16, 32, 64],
        TypeCode::FLOAT => &[16, 32, 64],
        TypeCode::OPAQUE_HANDLE => &[8, 16, 32, 64],
        TypeCode::BFLOAT => &[16],
        TypeCode::COMPLEX => &[32, 64, 128],
        TypeCode::BOOL => &[8],
        c if c.0 >= TypeCode::FLOAT8_E3M4.0 && c.0 <= TypeCode::FLOAT8_E8M0FNU.0 => &[8],
        TypeCode::FLOAT6_E2M3FN | TypeCode::FLOAT6_E3M2FN => &[6],
        TypeCode::FLOAT4_E2M1FN => &[4],
        TypeCode::BCOMPLEX => &[32],
        _ => return None,
    })
}

/// A bit width's slot in [`VALID_BITS`]'s masks; 31 (never set) for a width no code allows.
#[inline]
const fn bits_slot(bits: u8) -> u32 {
    match bits {
        1 => 0,
        2 => 1,
        4 => 2,
        6 => 3,
        8 => 4,
        16 => 5,
        32 => 6,
        64 => 7,
        128 => 8,
        _ => 31,
    }
}

/// For each type code, a mask of the [`bits_slot`]s [`allowed_bits`] allows (0: unknown code),
/// built from that table at compile time.
static VALID_BITS: [u32; 256] = {
    let mut masks = [0u32; 256];
    let mut code = 0;
    while code < 256 {
        if let Some(widths) = allowed_bits(TypeCode(code as u8)) {
            let mut i = 0;
            while i < widths.len() {
                masks[code] |= 1 << bits_slot(widths[i]);
                i += 1;
            }
        }
        code += 1;
    }
    masks
};

impl From<DLDataType> for DataType {
    fn from(raw: DLDataType) -> Self {
        Self(raw)
    }
}

impl From<DataType> for DLDataType {
    fn from(t: DataType) -> Self {
        t.0
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.base_name(), self.lanes()) {
            (Some(name), 1) => f.write_str(&name),
            (Some(name), 2) if *self == Self::FLOAT4_E2M1FN_X2 => write!(f, "{name}_x2"),
            (Some(name), lanes) => write!(f, "{name}x{lanes}"),
            (None, _) => {
                write!(f, "dtype(code={}, bits={}, lanes={})", self.code().0, self.bits(), self.lanes())
            }
        }
    }
}

impl fmt::Debug for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A Rust scalar type with a DLPack dtype, so typed slices and arrays can be taken of tensors of
/// that dtype and Rust buffers of it exported.
///
/// # Safety
///
/// `DTYPE` must describe the type's in-memory representation exactly (size, and the meaning of
/// its bytes), `Self` must have no padding, all-zero bytes must be a valid value, and every byte
/// pattern for which [`Element::is_valid_bytes`] returns true (every pattern, when
/// `ALL_BIT_PATTERNS_VALID`) must be a valid value of `Self`. dlbridge reinterprets
/// foreign memory of dtype `DTYPE` as `[Self]` on the strength of this promise.
pub unsafe trait Element: Copy + Send + Sync + 'static {
    /// The dtype of this type.
    const DTYPE: DataType;

    /// True when every bit pattern of the right size is a valid `Self` (integers, floats); then
    /// [`Element::is_valid_bytes`] is never consulted. `bool` sets it false.
    const ALL_BIT_PATTERNS_VALID: bool = true;

    /// Whether `bytes` (a whole number of elements) hold only valid values of `Self`. The default
    /// says yes, which is right for types where every bit pattern is a value (integers, floats);
    /// `bool` checks that every byte is 0 or 1.
    fn is_valid_bytes(bytes: &[u8]) -> bool {
        let _ = bytes;
        true
    }
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        // SAFETY: the dtype has exactly this type's size and representation, no padding, and
        // every bit pattern is a valid value.
        unsafe impl Element for $t {
            const DTYPE: DataType = DataType::$d;
        }
    )*};
}

element! {
    i8 => INT8, i16 => INT16, i32 => INT32, i64 => INT64,
    u8 => UINT8, u16 => UINT16, u32 => UINT32, u64 => UINT64,
    f32 => FLOAT32, f64 => FLOAT64,
    half::f16 => FLOAT16, half::bf16 => BFLOAT16,
    num_complex::Complex<f32> => COMPLEX64, num_complex::Complex<f64> => COMPLEX128,
}

// SAFETY: DLPack bool is one byte per element; `is_valid_bytes` admits only 0 and 1, the two
// valid bit patterns of Rust's `bool`.
unsafe impl Element for bool {
    const DTYPE: DataType = DataType::BOOL;
    const ALL_BIT_PATTERNS_VALID: bool = false;

    fn is_valid_bytes(bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| b <= 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn is_valid_agrees_with_validate() {
        for code in 0..=255u8 {
            for bits in 0..=255u8 {
                for lanes in [0u16, 1, 2, 4] {
                    let t = DataType(DLDataType { code: TypeCode(code), bits, lanes });
                    assert_eq!(t.is_valid(), t.validate().is_ok(), "{code} {bits} {lanes}");
                }
            }
        }
    }

    #[test]
    fn every_named_dtype_round_trips_through_its_name_and_validates() {
        for t in DataType::ALL {
            t.validate().unwrap();
            let name = t.to_string();
            assert_eq!(name.parse::<DataType>().unwrap(), t, "{name}");
        }
    }

    #[test]
    fn names_match_numpy_torch_and_ml_dtypes() {
        let names: Vec<String> = DataType::ALL.iter().map(|t| t.to_string()).collect();
        for expected in [
            "int8",
            "uint64",
            "float16",
            "float32",
            "bfloat16",
            "complex64",
            "complex128",
            "bool",
            "float8_e4m3fn",
            "float8_e5m2fnuz",
            "float8_e8m0fnu",
            "float6_e3m2fn",
            "float4_e2m1fn",
            "float4_e2m1fn_x2",
            "bcomplex32",
        ] {
            assert!(names.iter().any(|n| n == expected), "{expected} missing from {names:?}");
        }
        assert_eq!(DataType::new(TypeCode::FLOAT, 32, 4).to_string(), "float32x4");
        assert_eq!("float32x4".parse::<DataType>().unwrap(), DataType::new(TypeCode::FLOAT, 32, 4));
        assert_eq!(DataType::new(TypeCode(42), 8, 1).to_string(), "dtype(code=42, bits=8, lanes=1)");
    }

    #[test]
    fn bcomplex_is_two_bfloat16_and_nothing_else() {
        let t: DataType = "bcomplex32".parse().unwrap();
        assert_eq!(
            (t, t.code().0, t.bits(), t.lanes(), t.itemsize()),
            (DataType::BCOMPLEX32, 18, 32, 1, Some(4))
        );
        assert_eq!(t.to_string(), "bcomplex32");
        assert_eq!("bcomplex32x2".parse::<DataType>().unwrap(), DataType::new(TypeCode::BCOMPLEX, 32, 2));
        for bits in [16, 64, 128] {
            let e = DataType::new(TypeCode::BCOMPLEX, bits, 1).validate().unwrap_err();
            assert_eq!(
                e,
                Error::InvalidBits { dtype: DataType::new(TypeCode::BCOMPLEX, bits, 1), allowed: &[32] }
            );
        }
        // The next code is still unknown.
        assert_eq!(DataType::new(TypeCode(19), 32, 1).validate(), Err(Error::UnknownTypeCode { code: 19 }));
    }

    #[test]
    fn bad_names_are_refused_with_the_name() {
        for bad in [
            "",
            "float",
            "float12",
            "int3",
            "bfloat32",
            "floatx",
            "float32x0",
            "quux",
            "float8",
            "bcomplex64",
            "bcomplex16",
        ] {
            let err = bad.parse::<DataType>().unwrap_err();
            assert!(err.to_string().contains(&format!("{bad:?}")), "{bad}: {err}");
        }
    }

    #[test]
    fn itemsize_and_storage_bits() {
        assert_eq!(DataType::FLOAT32.itemsize(), Some(4));
        assert_eq!(DataType::COMPLEX128.itemsize(), Some(16));
        assert_eq!(DataType::FLOAT4_E2M1FN.itemsize(), None);
        assert_eq!(DataType::FLOAT4_E2M1FN_X2.itemsize(), Some(1));
        assert_eq!(DataType::FLOAT6_E2M3FN.storage_bits(false), 6);
        assert_eq!(DataType::FLOAT6_E2M3FN.storage_bits(true), 8);
    }

    #[test]
    fn bool_bytes_are_checked() {
        assert!(bool::is_valid_bytes(&[0, 1, 1, 0]));
        assert!(!bool::is_valid_bytes(&[0, 2]));
        assert!(f32::is_valid_bytes(&[0xff; 8]));
    }
}
