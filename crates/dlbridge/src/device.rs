//! Devices: [`Device`] and the open [`DeviceType`].
//!
//! ```
//! use dlbridge::{Device, DeviceType};
//! let d: Device = "cuda:1".parse().unwrap();
//! assert_eq!(d, Device::new(DeviceType::CUDA, 1));
//! assert_eq!(d.to_string(), "cuda:1");
//! assert_eq!(Device::CPU.to_string(), "cpu");
//! assert!(Device::CPU.is_host_accessible() && !d.is_host_accessible());
//! ```

use std::fmt;

use crate::ffi::DLDevice;

/// The DLPack device type: an open `i32` with a named constant for every device of DLPack 1.3 and
/// the ones its header has merged since (`DeviceType::CPU`, `DeviceType::CUDA`,
/// `DeviceType::TPU_HOST`, ...). Unknown values are representable.
pub use crate::ffi::DLDeviceType as DeviceType;

pub(crate) const NAMES: [(DeviceType, &str); 19] = [
    (DeviceType::CPU, "cpu"),
    (DeviceType::CUDA, "cuda"),
    (DeviceType::CUDA_HOST, "cuda_host"),
    (DeviceType::OPENCL, "opencl"),
    (DeviceType::VULKAN, "vulkan"),
    (DeviceType::METAL, "metal"),
    (DeviceType::VPI, "vpi"),
    (DeviceType::ROCM, "rocm"),
    (DeviceType::ROCM_HOST, "rocm_host"),
    (DeviceType::EXT_DEV, "ext_dev"),
    (DeviceType::CUDA_MANAGED, "cuda_managed"),
    (DeviceType::ONE_API, "oneapi"),
    (DeviceType::WEBGPU, "webgpu"),
    (DeviceType::HEXAGON, "hexagon"),
    (DeviceType::MAIA, "maia"),
    (DeviceType::TRN, "trn"),
    (DeviceType::TPU, "tpu"),
    (DeviceType::TPU_HOST, "tpu_host"),
    (DeviceType::ASCEND, "ascend"),
];

impl DeviceType {
    /// Every device type the header names (DLPack 1.3's 16, then `TPU`, `TPU_HOST` and `ASCEND`,
    /// merged since), in code order.
    pub const ALL: [Self; 19] = {
        let mut all = [Self::CPU; 19];
        let mut i = 0;
        while i < 19 {
            all[i] = NAMES[i].0;
            i += 1;
        }
        all
    };

    /// The lower-case name (`"cpu"`, `"cuda_host"`, `"tpu_host"`), or `None` for a value the header
    /// does not name.
    pub fn name(self) -> Option<&'static str> {
        NAMES.iter().find(|(t, _)| *t == self).map(|(_, n)| *n)
    }

    /// Whether the header names this device type (1-4 and 7-21: DLPack 1.3's 1-18, and 19-21
    /// merged since).
    pub const fn is_known(self) -> bool {
        matches!(self.0, 1..=4 | 7..=21)
    }

    /// Whether the CPU can read and write this memory directly: plain host memory, CUDA, ROCm or
    /// TPU pinned host memory, and CUDA managed memory.
    pub const fn is_host_accessible(self) -> bool {
        matches!(self, Self::CPU | Self::CUDA_HOST | Self::ROCM_HOST | Self::CUDA_MANAGED | Self::TPU_HOST)
    }

    /// Whether the ordinal is meaningless for this type (host memory kinds print without `:id`).
    const fn is_host_kind(self) -> bool {
        matches!(self, Self::CPU | Self::CUDA_HOST | Self::ROCM_HOST | Self::TPU_HOST)
    }
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "device_type({})", self.0),
        }
    }
}

/// A device: type and ordinal. Prints as torch does: `"cpu"`, `"cuda:1"`.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Device(DLDevice);

impl Device {
    /// Host memory, ordinal 0.
    pub const CPU: Self = Self::new(DeviceType::CPU, 0);

    /// A device from its type and ordinal.
    pub const fn new(device_type: DeviceType, id: i32) -> Self {
        Self(DLDevice { device_type, device_id: id })
    }

    /// CUDA device `id`.
    pub const fn cuda(id: i32) -> Self {
        Self::new(DeviceType::CUDA, id)
    }

    /// The device type.
    pub const fn device_type(self) -> DeviceType {
        self.0.device_type
    }

    /// The ordinal.
    pub const fn id(self) -> i32 {
        self.0.device_id
    }

    /// Whether the CPU can dereference pointers on this device (see
    /// [`DeviceType::is_host_accessible`]).
    pub const fn is_host_accessible(self) -> bool {
        self.0.device_type.is_host_accessible()
    }

    /// The raw ABI struct.
    pub const fn to_raw(self) -> DLDevice {
        self.0
    }

    /// Wraps a raw ABI struct.
    pub const fn from_raw(raw: DLDevice) -> Self {
        Self(raw)
    }
}

impl From<DLDevice> for Device {
    fn from(raw: DLDevice) -> Self {
        Self(raw)
    }
}

impl From<Device> for DLDevice {
    fn from(d: Device) -> Self {
        d.0
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.device_type();
        if t.is_host_kind() && self.id() == 0 { write!(f, "{t}") } else { write!(f, "{t}:{}", self.id()) }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_device_type_round_trips_through_its_name() {
        for t in DeviceType::ALL {
            let d = Device::new(t, 3);
            assert_eq!(d.to_string().parse::<Device>().unwrap(), d);
        }
        assert_eq!(DeviceType::ALL.len(), 19);
        assert_eq!(DeviceType::ALL[15], DeviceType::TRN);
    }

    #[test]
    fn the_device_types_merged_after_1_3_have_the_headers_codes_and_names() {
        for (t, code, name) in [
            (DeviceType::TPU, 19, "tpu"),
            (DeviceType::TPU_HOST, 20, "tpu_host"),
            (DeviceType::ASCEND, 21, "ascend"),
        ] {
            assert_eq!((t.0, t.name(), t.is_known()), (code, Some(name), true));
            assert_eq!(t.to_string(), name);
            assert_eq!(name.parse::<Device>().unwrap(), Device::new(t, 0));
            assert_eq!(format!("{name}:2").parse::<Device>().unwrap(), Device::new(t, 2));
        }
        // TPU host memory is pinned host memory, like cuda_host: it prints without its ordinal 0.
        assert_eq!(Device::new(DeviceType::TPU_HOST, 0).to_string(), "tpu_host");
        assert_eq!(Device::new(DeviceType::TPU, 0).to_string(), "tpu:0");
        assert_eq!(Device::new(DeviceType::ASCEND, 1).to_string(), "ascend:1");
    }

    #[test]
    fn unknown_types_print_their_value_and_bad_names_are_refused() {
        assert_eq!(Device::new(DeviceType(22), 0).to_string(), "device_type(22):0");
        assert!(!DeviceType(22).is_known());
        for v in -2..40 {
            assert_eq!(DeviceType(v).is_known(), DeviceType(v).name().is_some(), "{v}");
        }
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            let err = bad.parse::<Device>().unwrap_err().to_string();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn host_accessible_kinds() {
        let host: Vec<_> = DeviceType::ALL.iter().filter(|t| t.is_host_accessible()).collect();
        assert_eq!(
            host,
            [
                &DeviceType::CPU,
                &DeviceType::CUDA_HOST,
                &DeviceType::ROCM_HOST,
                &DeviceType::CUDA_MANAGED,
                &DeviceType::TPU_HOST
            ]
        );
    }
}
