//! The vocabulary's own refusals: parsing dtype and device names ([`DataType`] and [`Device`]
//! `FromStr`) and [`DataType::validate`]. They live above [`crate::error`], which names the values
//! they parse in its variants, so the values (`dtype.rs`, `device.rs`) know nothing of `Error`.

use std::str::FromStr;

use crate::device::{Device, NAMES};
use crate::dtype::{DataType, FIXED_NAMES, WIDTH_NAMES, allowed_bits};
use crate::error::Error;
use crate::ffi::DLDataType;

impl DataType {
    /// Whether `bits` is one this crate accepts for `code`, lanes is at least 1, and the code is
    /// known. Float6 must be 6 bits, float4 4, bool and float8 8, bfloat16 16, bcomplex 32 (the
    /// header defines `kDLBcomplex` as two bfloat16, so one width only).
    ///
    /// ```
    /// use dlbridge::{DataType, TypeCode};
    /// assert!(DataType::FLOAT32.validate().is_ok());
    /// assert!(DataType::new(TypeCode::FLOAT6_E2M3FN, 8, 1).validate().is_err());
    /// assert!(DataType::new(TypeCode(99), 8, 1).validate().is_err());
    /// ```
    pub fn validate(self) -> Result<(), Error> {
        let DLDataType { code, bits, lanes } = self.0;
        let Some(ok_bits) = allowed_bits(code) else { return Err(Error::UnknownTypeCode { code: code.0 }) };
        if !ok_bits.contains(&bits) {
            return Err(Error::InvalidBits { dtype: self, allowed: ok_bits });
        }
        if lanes == 0 {
            return Err(Error::ZeroLanes { dtype: self });
        }
        Ok(())
    }
}

impl FromStr for DataType {
    type Err = Error;

    /// Parses the names [`Display`](std::fmt::Display) prints: `"float32"`, `"bool"`,
    /// `"float8_e5m2"`, `"float32x4"`, `"float4_e2m1fn_x2"`. The result is validated.
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::UnknownDtypeName { name: s.to_owned() };
        if s == "bool" {
            return Ok(Self::BOOL);
        }
        if s == "float4_e2m1fn_x2" {
            return Ok(Self::FLOAT4_E2M1FN_X2);
        }
        if let Some(&(code, bits, _)) = FIXED_NAMES.iter().find(|(_, _, n)| *n == s) {
            return Ok(Self::new(code, bits, 1));
        }
        // `{base}x{lanes}` for vector types of a fixed-width name.
        if let Some((base, lanes)) = s.rsplit_once('x') {
            if let (Ok(base), Ok(lanes)) = (base.parse::<DataType>(), lanes.parse::<u16>()) {
                if base.lanes() == 1 && lanes > 1 {
                    let t = Self::new(base.code(), base.bits(), lanes);
                    return t.validate().map(|()| t).map_err(|_| bad());
                }
            }
        }
        for (code, prefix) in WIDTH_NAMES {
            if let Some(digits) = s.strip_prefix(prefix) {
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    continue;
                }
                let bits: u8 = digits.parse().map_err(|_| bad())?;
                let t = Self::new(code, bits, 1);
                return t.validate().map(|()| t).map_err(|_| bad());
            }
        }
        Err(bad())
    }
}

impl FromStr for Device {
    type Err = Error;

    /// Parses `"cpu"`, `"cuda"` (ordinal 0), `"cuda:1"`, `"rocm_host"`, ...
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::UnknownDeviceName { name: s.to_owned() };
        let (name, id) = match s.split_once(':') {
            Some((name, id)) => (name, id.parse::<i32>().ok().filter(|i| *i >= 0).ok_or_else(bad)?),
            None => (s, 0),
        };
        let (t, _) = NAMES.iter().find(|(_, n)| *n == name).ok_or_else(bad)?;
        Ok(Self::new(*t, id))
    }
}
