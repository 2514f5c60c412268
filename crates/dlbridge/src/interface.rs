//! Parsers for the non-DLPack array protocols' type descriptions, pure and panic-free (fuzz
//! targets): Python buffer-protocol format strings (PEP 3118 / `struct` syntax) and numpy
//! array-interface typestrs. Both map onto a [`DataType`] or refuse with an error naming the field.
//!
//! ```
//! use dlbridge::DataType;
//! use dlbridge::interface::{buffer_format, typestr};
//! assert_eq!(buffer_format("<f", 4).unwrap(), DataType::FLOAT32);
//! assert_eq!(buffer_format("Zd", 16).unwrap(), DataType::COMPLEX128);
//! assert_eq!(typestr("<i8").unwrap(), DataType::INT64);
//! assert!(typestr(">f4").is_err() || cfg!(target_endian = "big"));
//! ```

use crate::dtype::DataType;
use crate::error::{Error, Result};

fn refuse(field: &str, value: &str, why: &str) -> Error {
    Error::Incompatible { expected: format!("{field} {why}"), found: format!("{field} {value:?}") }
}

/// Kinds of element the protocols can describe.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bool,
    Int,
    UInt,
    Float,
    Complex,
}

fn dtype_of(kind: Kind, bytes: usize) -> Option<DataType> {
    Some(match (kind, bytes) {
        (Kind::Bool, 1) => DataType::BOOL,
        (Kind::Int, 1) => DataType::INT8,
        (Kind::Int, 2) => DataType::INT16,
        (Kind::Int, 4) => DataType::INT32,
        (Kind::Int, 8) => DataType::INT64,
        (Kind::UInt, 1) => DataType::UINT8,
        (Kind::UInt, 2) => DataType::UINT16,
        (Kind::UInt, 4) => DataType::UINT32,
        (Kind::UInt, 8) => DataType::UINT64,
        (Kind::Float, 2) => DataType::FLOAT16,
        (Kind::Float, 4) => DataType::FLOAT32,
        (Kind::Float, 8) => DataType::FLOAT64,
        (Kind::Complex, 8) => DataType::COMPLEX64,
        (Kind::Complex, 16) => DataType::COMPLEX128,
        _ => return None,
    })
}

/// The dtype of a buffer-protocol `format` string whose elements are `itemsize` bytes.
///
/// Accepts one element code with an optional byte-order prefix (`@`, `=`, `<`, `>`, `!`) and an
/// optional repeat count of 1: `?`, `b B h H i I l L q Q n N` integers, `e f d` floats, `Zf Zd`
/// complex. `itemsize` must match the code's size under the prefix (native sizes for `@` or no
/// prefix, standard sizes otherwise). Refuses non-native byte order for multi-byte elements,
/// structs, pointers, chars, strings, padding and repeat counts other than 1.
pub fn buffer_format(format: &str, itemsize: usize) -> Result<DataType> {
    let bad = |why: &str| refuse("format", format, why);
    let (prefix, rest) = match format.as_bytes().first() {
        Some(b'@' | b'=' | b'<' | b'>' | b'!') => (format.as_bytes()[0], &format[1..]),
        _ => (b'@', format),
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let (count, code) = rest.split_at(digits);
    if !count.is_empty() && count != "1" {
        return Err(bad("with one element per item (no repeat count)"));
    }
    let native = prefix == b'@';
    let (kind, native_size, std_size) = match code {
        "?" => (Kind::Bool, 1, 1),
        "b" => (Kind::Int, 1, 1),
        "B" => (Kind::UInt, 1, 1),
        "h" => (Kind::Int, 2, 2),
        "H" => (Kind::UInt, 2, 2),
        "i" => (Kind::Int, 4, 4),
        "I" => (Kind::UInt, 4, 4),
        "l" => (Kind::Int, size_of::<std::ffi::c_long>(), 4),
        "L" => (Kind::UInt, size_of::<std::ffi::c_ulong>(), 4),
        "q" => (Kind::Int, 8, 8),
        "Q" => (Kind::UInt, 8, 8),
        "n" if native => (Kind::Int, size_of::<isize>(), 0),
        "N" if native => (Kind::UInt, size_of::<usize>(), 0),
        "e" => (Kind::Float, 2, 2),
        "f" => (Kind::Float, 4, 4),
        "d" => (Kind::Float, 8, 8),
        "Zf" => (Kind::Complex, 8, 8),
        "Zd" => (Kind::Complex, 16, 16),
        _ => {
            return Err(bad(
                "of a bool, integer, float or complex element (struct, pointer, char and string formats are not tensors)",
            ));
        }
    };
    let size = if native { native_size } else { std_size };
    if size != itemsize {
        return Err(Error::Incompatible {
            expected: format!("itemsize {size} for format {format:?}"),
            found: format!("itemsize {itemsize}"),
        });
    }
    let little = cfg!(target_endian = "little");
    let foreign = match prefix {
        b'<' => !little,
        b'>' | b'!' => little,
        _ => false,
    };
    if foreign && size > 1 {
        return Err(bad("in native byte order (DLPack data is native-endian)"));
    }
    dtype_of(kind, size).ok_or_else(|| bad("of a supported size"))
}

/// The dtype of a numpy array-interface `typestr` (`"<f4"`, `"|b1"`, `"<c16"`).
///
/// Accepts kinds `b` (1 byte), `i`, `u`, `f` (2, 4, 8 bytes) and `c` (8, 16 bytes) with byte order
/// `<`, `>`, `=` or `|`; refuses non-native order for multi-byte elements and the kinds `V`, `O`,
/// `M`, `m`, `S`, `U`, `a` (records, objects, datetimes, strings).
pub fn typestr(s: &str) -> Result<DataType> {
    let bad = |why: &str| refuse("typestr", s, why);
    let b = s.as_bytes();
    if b.len() < 3 || !matches!(b[0], b'<' | b'>' | b'=' | b'|') {
        return Err(bad("of the form <byte order><kind><size>, like \"<f4\""));
    }
    // `get` rather than indexing: a multi-byte character at position 1 must not panic.
    let size: usize = s.get(2..).and_then(|d| d.parse().ok()).ok_or_else(|| bad("with a decimal size"))?;
    let kind = match b[1] {
        b'b' => Kind::Bool,
        b'i' => Kind::Int,
        b'u' => Kind::UInt,
        b'f' => Kind::Float,
        b'c' => Kind::Complex,
        _ => {
            return Err(bad(
                "of kind b, i, u, f or c (records, objects, datetimes and strings are not tensors)",
            ));
        }
    };
    let little = cfg!(target_endian = "little");
    let foreign = match b[0] {
        b'<' => !little,
        b'>' => little,
        _ => false,
    };
    if foreign && size > 1 {
        return Err(bad("in native byte order (DLPack data is native-endian)"));
    }
    dtype_of(kind, size).ok_or_else(|| bad("of a supported size"))
}

/// Byte strides as element strides, written into `out` (one per stride). A stride that is not a
/// multiple of `itemsize` is refused, never truncated; the message names the axis. Shared by the
/// array interfaces, the buffer protocol and the numpy fast path.
///
/// ```
/// let mut out = [0i64; 2];
/// dlbridge::interface::element_strides([16, -4], 4, &mut out).unwrap();
/// assert_eq!(out, [4, -1]);
/// assert!(dlbridge::interface::element_strides([6], 4, &mut out).is_err());
/// ```
pub fn element_strides(
    bytes: impl IntoIterator<Item = i64>,
    itemsize: usize,
    out: &mut [i64],
) -> std::result::Result<(), String> {
    let item = i64::try_from(itemsize).unwrap_or(0);
    // Every numpy dtype dlbridge reads has a power-of-two size: a mask and a shift per axis
    // instead of a division.
    let (pow2, shift) = (item != 0 && itemsize.is_power_of_two(), itemsize.trailing_zeros());
    for (axis, (o, b)) in out.iter_mut().zip(bytes).enumerate() {
        let exact = if pow2 { b & (item - 1) == 0 } else { item != 0 && b % item == 0 };
        if !exact {
            return Err(format!("strides[{axis}] = {b} bytes is not a multiple of the item size {itemsize}"));
        }
        *o = if pow2 { b >> shift } else { b / item };
    }
    Ok(())
}

/// The layout part of `__array_interface__` / `__cuda_array_interface__`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrayLayout {
    /// The element type, from the typestr.
    pub dtype: DataType,
    /// Strides in elements (`None`: C order).
    pub strides: Option<Vec<i64>>,
}

/// Why an interface layout was refused: a bad value (`ValueError`) or something that cannot be a
/// tensor (`BufferError`), with a message naming the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutProblem {
    /// A value out of range or inconsistent with another field.
    Value(String),
    /// A valid description of something that is not a tensor dlbridge can hold.
    NotATensor(String),
}

impl std::fmt::Display for LayoutProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Value(m) | Self::NotATensor(m) => f.write_str(m),
        }
    }
}

/// Checks an array-interface layout: the typestr, byte strides (`None`: C order) that must be
/// multiples of the item size and one per dimension, a valid shape, and, when the data is a buffer
/// of `buffer_len` bytes, that every element from `offset` lies inside it.
///
/// ```
/// use dlbridge::interface::array_layout;
/// let l = array_layout("<f8", &[2, 3], Some(&[8, 16]), 0, None).unwrap();
/// assert_eq!(l.strides, Some(vec![1, 2]));
/// assert!(array_layout("<f8", &[2, 3], None, 8, Some(48)).is_err()); // one element past the end
/// ```
pub fn array_layout(
    typestr_value: &str,
    shape: &[i64],
    strides_bytes: Option<&[i64]>,
    offset: usize,
    buffer_len: Option<usize>,
) -> std::result::Result<ArrayLayout, LayoutProblem> {
    let dtype = typestr(typestr_value).map_err(|e| LayoutProblem::NotATensor(e.to_string()))?;
    let itemsize = dtype.itemsize().unwrap_or(1) as i64;
    let strides = match strides_bytes {
        None => None,
        Some(bytes) => {
            if bytes.len() != shape.len() {
                return Err(LayoutProblem::Value(format!(
                    "'strides' has {} entries for {} dimensions",
                    bytes.len(),
                    shape.len()
                )));
            }
            let mut out = vec![0; bytes.len()];
            element_strides(bytes.iter().copied(), itemsize as usize, &mut out)
                .map_err(LayoutProblem::NotATensor)?;
            Some(out)
        }
    };
    let numel = crate::layout::element_count(shape).map_err(|e| LayoutProblem::NotATensor(e.to_string()))?;
    if let Some(len) = buffer_len {
        if offset > len {
            return Err(LayoutProblem::Value(format!("'offset' {offset} is past the buffer's {len} bytes")));
        }
        let (lo, hi) = match (&strides, numel) {
            (_, 0) => (0, 0),
            (None, n) => (0, n as i128 * itemsize as i128),
            (Some(s), _) => {
                let (lo, hi) = crate::layout::byte_span(shape, s, dtype.storage_bits(false))
                    .map_err(|e| LayoutProblem::NotATensor(e.to_string()))?;
                (lo as i128, hi as i128)
            }
        };
        if offset as i128 + lo < 0 {
            return Err(LayoutProblem::Value("the layout reaches before the start of the buffer".into()));
        }
        if offset as i128 + hi > len as i128 {
            return Err(LayoutProblem::Value(format!(
                "the layout needs {hi} bytes from offset {offset}, the buffer has {len}"
            )));
        }
    }
    Ok(ArrayLayout { dtype, strides })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_numeric_format_maps() {
        for (f, size, t) in [
            ("?", 1, DataType::BOOL),
            ("b", 1, DataType::INT8),
            (">B", 1, DataType::UINT8),
            ("<h", 2, DataType::INT16),
            ("=H", 2, DataType::UINT16),
            ("i", 4, DataType::INT32),
            ("I", 4, DataType::UINT32),
            ("l", 8, DataType::INT64),
            ("<l", 4, DataType::INT32),
            ("L", 8, DataType::UINT64),
            ("q", 8, DataType::INT64),
            ("@Q", 8, DataType::UINT64),
            ("n", 8, DataType::INT64),
            ("e", 2, DataType::FLOAT16),
            ("1f", 4, DataType::FLOAT32),
            ("d", 8, DataType::FLOAT64),
            ("Zf", 8, DataType::COMPLEX64),
            ("<Zd", 16, DataType::COMPLEX128),
        ] {
            assert_eq!(buffer_format(f, size).unwrap(), t, "{f}");
        }
    }

    #[test]
    fn non_tensor_formats_are_refused_naming_the_field() {
        for (f, size) in [
            (">f", 4),
            ("!i", 4),
            ("P", 8),
            ("c", 1),
            ("3s", 3),
            ("T{i:x:}", 4),
            ("O", 8),
            ("2f", 8),
            ("x", 1),
            ("", 1),
            ("<n", 8),
            ("g", 16),
        ] {
            let e = buffer_format(f, size).unwrap_err().to_string();
            assert!(e.contains("format"), "{f}: {e}");
        }
        let e = buffer_format("f", 8).unwrap_err().to_string();
        assert_eq!(e, "expected itemsize 4 for format \"f\", got itemsize 8");
    }

    #[test]
    fn typestrs() {
        assert_eq!(typestr("|b1").unwrap(), DataType::BOOL);
        assert_eq!(typestr("|u1").unwrap(), DataType::UINT8);
        assert_eq!(typestr(">i1").unwrap(), DataType::INT8);
        assert_eq!(typestr("<f2").unwrap(), DataType::FLOAT16);
        assert_eq!(typestr("=c8").unwrap(), DataType::COMPLEX64);
        for bad in
            [">f4", "<V8", "|O8", "<M8", "<m8", "|S5", "<U3", "f4", "<f16", "<fx", "", "<", "<c4", "<¡"]
        {
            let e = typestr(bad).unwrap_err().to_string();
            assert!(e.contains("typestr"), "{bad}: {e}");
        }
    }

    #[test]
    fn array_layouts() {
        assert_eq!(array_layout("<i4", &[3], None, 0, Some(12)).unwrap().dtype, DataType::INT32);
        assert!(
            matches!(array_layout("<i4", &[3], Some(&[6]), 0, None), Err(LayoutProblem::NotATensor(m)) if m.contains("strides"))
        );
        assert!(
            matches!(array_layout("<i4", &[3], Some(&[4, 4]), 0, None), Err(LayoutProblem::Value(m)) if m.contains("strides"))
        );
        assert!(matches!(array_layout("<i4", &[3], Some(&[-4]), 4, Some(12)), Err(LayoutProblem::Value(_))));
        assert!(array_layout("<i4", &[3], Some(&[-4]), 8, Some(12)).is_ok());
        assert!(
            matches!(array_layout("<i4", &[3], None, 16, Some(12)), Err(LayoutProblem::Value(m)) if m.contains("offset"))
        );
        assert!(
            matches!(array_layout("<i4", &[-1], None, 0, None), Err(LayoutProblem::NotATensor(m)) if m.contains("shape"))
        );
    }

    proptest! {
        #[test]
        fn parsers_never_panic(s in ".{0,12}", size in 0usize..40) {
            let _ = buffer_format(&s, size);
            let _ = typestr(&s);
        }

        #[test]
        fn array_layout_never_panics(
            shape in prop::collection::vec(any::<i64>(), 0..4),
            strides in prop::collection::vec(any::<i64>(), 0..4),
            offset in any::<usize>(),
            len in any::<Option<usize>>(),
        ) {
            let _ = array_layout("<f4", &shape, Some(&strides), offset, len);
            let _ = array_layout("|u1", &shape, None, offset, len);
        }

        /// The mask-and-shift path (power-of-two item sizes) agrees with plain division, for
        /// every stride including negative ones and the extremes.
        #[test]
        fn element_strides_match_division(
            bytes in prop::collection::vec(any::<i64>(), 0..5),
            itemsize in prop::sample::select(vec![0usize, 1, 2, 3, 4, 6, 8, 12, 16, 32, 1 << 40, 1 << 63]),
        ) {
            let mut out = vec![0; bytes.len()];
            let got = element_strides(bytes.iter().copied(), itemsize, &mut out).map(|()| out);
            let want = bytes
                .iter()
                .map(|&b| match i64::try_from(itemsize) {
                    Ok(i) if i != 0 && b % i == 0 => Some(b / i),
                    _ => None,
                })
                .collect::<Option<Vec<i64>>>();
            prop_assert_eq!(got.ok(), want);
        }
    }
}
