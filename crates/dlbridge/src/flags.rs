//! [`Flags`] of a versioned tensor and the ABI [`Version`].
//!
//! ```
//! use dlbridge::{Flags, Version};
//! let f = Flags::READ_ONLY | Flags::IS_COPIED;
//! assert!(f.is_read_only() && f.is_copied() && !f.is_subbyte_padded());
//! assert_eq!(Version::CURRENT.to_string(), "1.3");
//! ```

use std::fmt;
use std::ops::{BitOr, BitOrAssign};

use crate::ffi;

/// The `flags` word of a `DLManagedTensorVersioned`. Unknown bits are kept, never interpreted.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(pub u64);

impl Flags {
    /// No flag set.
    pub const NONE: Self = Self(0);
    /// The consumer must not write through the data pointer.
    pub const READ_ONLY: Self = Self(ffi::DLPACK_FLAG_BITMASK_READ_ONLY);
    /// The producer copied the data for this export; the consumer owns it alone.
    pub const IS_COPIED: Self = Self(ffi::DLPACK_FLAG_BITMASK_IS_COPIED);
    /// Sub-byte elements are padded to a byte each rather than packed.
    pub const IS_SUBBYTE_TYPE_PADDED: Self = Self(ffi::DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED);

    /// Whether every bit of `other` is set here.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// The read-only bit.
    pub const fn is_read_only(self) -> bool {
        self.contains(Self::READ_ONLY)
    }

    /// The is-copied bit.
    pub const fn is_copied(self) -> bool {
        self.contains(Self::IS_COPIED)
    }

    /// The sub-byte-padded bit.
    pub const fn is_subbyte_padded(self) -> bool {
        self.contains(Self::IS_SUBBYTE_TYPE_PADDED)
    }

    /// These flags with `other` set or cleared.
    pub const fn with(self, other: Self, on: bool) -> Self {
        if on { Self(self.0 | other.0) } else { Self(self.0 & !other.0) }
    }
}

impl BitOr for Flags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl BitOrAssign for Flags {
    fn bitor_assign(&mut self, rhs: Self) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for Flags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        for (flag, name) in [
            (Self::READ_ONLY, "READ_ONLY"),
            (Self::IS_COPIED, "IS_COPIED"),
            (Self::IS_SUBBYTE_TYPE_PADDED, "IS_SUBBYTE_TYPE_PADDED"),
        ] {
            if self.contains(flag) {
                names.push(name.to_owned());
            }
        }
        let rest = self.0 & !0b111;
        if rest != 0 {
            names.push(format!("{rest:#x}"));
        }
        if names.is_empty() {
            names.push("NONE".to_owned());
        }
        write!(f, "Flags({})", names.join(" | "))
    }
}

/// A DLPack ABI version.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct Version {
    /// Major version: a different major means a different struct layout.
    pub major: u32,
    /// Minor version: compatible additions.
    pub minor: u32,
}

impl Version {
    /// The version this crate implements and writes into what it exports: 1.3.
    pub const CURRENT: Self = Self { major: ffi::DLPACK_MAJOR_VERSION, minor: ffi::DLPACK_MINOR_VERSION };

    /// The raw ABI struct.
    pub const fn to_raw(self) -> ffi::DLPackVersion {
        ffi::DLPackVersion { major: self.major, minor: self.minor }
    }
}

impl From<ffi::DLPackVersion> for Version {
    fn from(v: ffi::DLPackVersion) -> Self {
        Self { major: v.major, minor: v.minor }
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}
