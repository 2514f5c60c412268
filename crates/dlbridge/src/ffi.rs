//! The raw DLPack 1.3 ABI, exactly as `dlpack.h` declares it, with the enumeration values the
//! header has merged since the 1.3 tag (still minor version 3: new values keep the ABI): type code
//! `kDLBcomplex` (18) and device types `kDLTPU` (19), `kDLTPUHost` (20) and `kDLAscend` (21).
//!
//! Nothing here validates or interprets anything: these are the C structs, the flag bits and the
//! function-pointer types of the C exchange API. Values that come from a producer and are C enums
//! in the header (the device type, the type code) are open integer newtypes, [`DLDeviceType`] and
//! [`DLDataTypeCode`], so a value this crate does not know (a later header's) is representable and
//! never undefined behaviour. Safe code uses [`crate::ManagedTensor`], which validates these structs
//! once.
//!
//! Sizes and field offsets are asserted at compile time for 64-bit targets.
//!
//! ```
//! use dlbridge::ffi::{DLDataType, DLDataTypeCode, DLManagedTensorVersioned};
//! let f32_type = DLDataType { code: DLDataTypeCode::FLOAT, bits: 32, lanes: 1 };
//! assert_eq!(f32_type.code.0, 2);
//! assert_eq!(std::mem::size_of::<DLManagedTensorVersioned>(), 80);
//! ```

use std::ffi::{c_char, c_int, c_void};

/// `DLPACK_MAJOR_VERSION`: the major ABI version this crate implements.
pub const DLPACK_MAJOR_VERSION: u32 = 1;
/// `DLPACK_MINOR_VERSION`: the minor ABI version this crate implements (1.3).
pub const DLPACK_MINOR_VERSION: u32 = 3;

/// `DLPACK_FLAG_BITMASK_READ_ONLY`: the consumer must not write through `data`.
pub const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1 << 0;
/// `DLPACK_FLAG_BITMASK_IS_COPIED`: the producer copied the data for this export; the consumer
/// owns that memory alone.
pub const DLPACK_FLAG_BITMASK_IS_COPIED: u64 = 1 << 1;
/// `DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED`: sub-byte elements are padded to a byte each
/// instead of packed (DLPack 1.1).
pub const DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED: u64 = 1 << 2;

/// `DLPackVersion`: the ABI version a producer filled into a versioned tensor.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DLPackVersion {
    /// A change means the layout of `DLManagedTensorVersioned` changed.
    pub major: u32,
    /// ABI-compatible additions (new enum values, new flags).
    pub minor: u32,
}

/// `DLDeviceType`: where the data lives. An open `int32_t`: any value may arrive from a producer.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DLDeviceType(pub i32);

impl DLDeviceType {
    /// `kDLCPU` (1): host memory.
    pub const CPU: Self = Self(1);
    /// `kDLCUDA` (2): CUDA device memory.
    pub const CUDA: Self = Self(2);
    /// `kDLCUDAHost` (3): pinned host memory from `cudaMallocHost`.
    pub const CUDA_HOST: Self = Self(3);
    /// `kDLOpenCL` (4): an OpenCL buffer.
    pub const OPENCL: Self = Self(4);
    /// `kDLVulkan` (7): a Vulkan buffer.
    pub const VULKAN: Self = Self(7);
    /// `kDLMetal` (8): Apple Metal.
    pub const METAL: Self = Self(8);
    /// `kDLVPI` (9): Verilog simulator buffer.
    pub const VPI: Self = Self(9);
    /// `kDLROCM` (10): AMD ROCm/HIP device memory.
    pub const ROCM: Self = Self(10);
    /// `kDLROCMHost` (11): pinned host memory from `hipMallocHost`.
    pub const ROCM_HOST: Self = Self(11);
    /// `kDLExtDev` (12): reserved extension device.
    pub const EXT_DEV: Self = Self(12);
    /// `kDLCUDAManaged` (13): CUDA managed (unified) memory.
    pub const CUDA_MANAGED: Self = Self(13);
    /// `kDLOneAPI` (14): oneAPI unified shared memory.
    pub const ONE_API: Self = Self(14);
    /// `kDLWebGPU` (15): WebGPU.
    pub const WEBGPU: Self = Self(15);
    /// `kDLHexagon` (16): Qualcomm Hexagon DSP.
    pub const HEXAGON: Self = Self(16);
    /// `kDLMAIA` (17): Microsoft MAIA.
    pub const MAIA: Self = Self(17);
    /// `kDLTrn` (18): AWS Trainium.
    pub const TRN: Self = Self(18);
    /// `kDLTPU` (19): Google TPU device memory (merged after the 1.3 tag).
    pub const TPU: Self = Self(19);
    /// `kDLTPUHost` (20): pinned host memory of a TPU runtime, the TPU's mirror of `kDLCUDAHost`
    /// (jax's `pinned_host` memory kind; merged after the 1.3 tag).
    pub const TPU_HOST: Self = Self(20);
    /// `kDLAscend` (21): Huawei Ascend NPU device memory (merged after the 1.3 tag).
    pub const ASCEND: Self = Self(21);
}

/// `DLDevice`: a device type and an ordinal.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DLDevice {
    /// The kind of device.
    pub device_type: DLDeviceType,
    /// The device ordinal; 0 for plain, pinned and managed host memory.
    pub device_id: i32,
}

/// `DLDataTypeCode`: the type code stored in `DLDataType::code` (a `uint8_t` on the wire).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DLDataTypeCode(pub u8);

impl DLDataTypeCode {
    /// `kDLInt` (0): signed integer.
    pub const INT: Self = Self(0);
    /// `kDLUInt` (1): unsigned integer.
    pub const UINT: Self = Self(1);
    /// `kDLFloat` (2): IEEE float.
    pub const FLOAT: Self = Self(2);
    /// `kDLOpaqueHandle` (3): opaque handle; meaning agreed between frameworks.
    pub const OPAQUE_HANDLE: Self = Self(3);
    /// `kDLBfloat` (4): bfloat16.
    pub const BFLOAT: Self = Self(4);
    /// `kDLComplex` (5): complex, a compact pair; `bits` is the total (64 for complex64).
    pub const COMPLEX: Self = Self(5);
    /// `kDLBool` (6): boolean, one byte per element.
    pub const BOOL: Self = Self(6);
    /// `kDLFloat8_e3m4` (7).
    pub const FLOAT8_E3M4: Self = Self(7);
    /// `kDLFloat8_e4m3` (8).
    pub const FLOAT8_E4M3: Self = Self(8);
    /// `kDLFloat8_e4m3b11fnuz` (9).
    pub const FLOAT8_E4M3B11FNUZ: Self = Self(9);
    /// `kDLFloat8_e4m3fn` (10).
    pub const FLOAT8_E4M3FN: Self = Self(10);
    /// `kDLFloat8_e4m3fnuz` (11).
    pub const FLOAT8_E4M3FNUZ: Self = Self(11);
    /// `kDLFloat8_e5m2` (12).
    pub const FLOAT8_E5M2: Self = Self(12);
    /// `kDLFloat8_e5m2fnuz` (13).
    pub const FLOAT8_E5M2FNUZ: Self = Self(13);
    /// `kDLFloat8_e8m0fnu` (14): exponent-only scale type.
    pub const FLOAT8_E8M0FNU: Self = Self(14);
    /// `kDLFloat6_e2m3fn` (15): `bits` must be 6.
    pub const FLOAT6_E2M3FN: Self = Self(15);
    /// `kDLFloat6_e3m2fn` (16): `bits` must be 6.
    pub const FLOAT6_E3M2FN: Self = Self(16);
    /// `kDLFloat4_e2m1fn` (17): `bits` must be 4.
    pub const FLOAT4_E2M1FN: Self = Self(17);
    /// `kDLBcomplex` (18): complex of two bfloat16, laid out as `kDLComplex` (a compact pair);
    /// `bits` is the total, 32 (merged after the 1.3 tag).
    pub const BCOMPLEX: Self = Self(18);
}

/// `DLDataType`: type code, bits per lane and number of lanes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DLDataType {
    /// The type code.
    pub code: DLDataTypeCode,
    /// Bits per lane.
    pub bits: u8,
    /// Vector width; 1 for scalars.
    pub lanes: u16,
}

/// `DLTensor`: a plain, non-owning tensor description.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLTensor {
    /// Base pointer (a device pointer or handle for non-host devices).
    pub data: *mut c_void,
    /// Where the data lives.
    pub device: DLDevice,
    /// Number of dimensions.
    pub ndim: i32,
    /// Element type.
    pub dtype: DLDataType,
    /// `ndim` extents; may be NULL when `ndim == 0`.
    pub shape: *mut i64,
    /// `ndim` strides in elements; NULL meant compact row-major before DLPack 1.2.
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// `DLManagedTensor`: the legacy (pre-1.0) owning tensor, found in `"dltensor"` capsules.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor description.
    pub dl_tensor: DLTensor,
    /// Producer context, may be NULL.
    pub manager_ctx: *mut c_void,
    /// Frees `manager_ctx` and the struct itself; may be NULL.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLManagedTensorVersioned`: the owning tensor of DLPack 1.x, found in `"dltensor_versioned"`
/// capsules. Everything up to and including `flags` keeps its layout in every future major version.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    /// The version the producer implements.
    pub version: DLPackVersion,
    /// Producer context, may be NULL.
    pub manager_ctx: *mut c_void,
    /// Frees `manager_ctx` and the struct itself; may be NULL.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `DLPACK_FLAG_BITMASK_*` bits.
    pub flags: u64,
    /// The tensor description (last, unlike the legacy struct).
    pub dl_tensor: DLTensor,
}

/// `SetError` callback of [`DLPackManagedTensorAllocator`]: `kind` is a Python exception class
/// name, `message` the text.
pub type DLPackSetError =
    Option<unsafe extern "C" fn(error_ctx: *mut c_void, kind: *const c_char, message: *const c_char)>;

/// `DLPackManagedTensorAllocator`: allocate a new tensor like `prototype` (only dtype, ndim, shape
/// and device are read); 0 on success with an owning pointer in `*out`, -1 after calling `set_error`.
pub type DLPackManagedTensorAllocator = Option<
    unsafe extern "C" fn(
        prototype: *mut DLTensor,
        out: *mut *mut DLManagedTensorVersioned,
        error_ctx: *mut c_void,
        set_error: DLPackSetError,
    ) -> c_int,
>;

/// `DLPackManagedTensorFromPyObjectNoSync`: export a Python object as an owning versioned tensor,
/// without stream synchronisation; 0 on success, -1 with a Python exception set.
pub type DLPackManagedTensorFromPyObjectNoSync =
    Option<unsafe extern "C" fn(py_object: *mut c_void, out: *mut *mut DLManagedTensorVersioned) -> c_int>;

/// `DLPackManagedTensorToPyObjectNoSync`: import (steal) a versioned tensor as a new reference to
/// a producer-type Python object; 0 on success, -1 with a Python exception set.
pub type DLPackManagedTensorToPyObjectNoSync = Option<
    unsafe extern "C" fn(tensor: *mut DLManagedTensorVersioned, out_py_object: *mut *mut c_void) -> c_int,
>;

/// `DLPackDLTensorFromPyObjectNoSync`: fill a caller-provided `DLTensor` that borrows from the
/// Python object (no ownership transfer, no allocation, no sync); 0 or -1 with a Python exception.
pub type DLPackDLTensorFromPyObjectNoSync =
    Option<unsafe extern "C" fn(py_object: *mut c_void, out: *mut DLTensor) -> c_int>;

/// `DLPackCurrentWorkStream`: the producer's current stream for a device (NULL for CPU);
/// 0 or -1 with a Python exception.
pub type DLPackCurrentWorkStream = Option<
    unsafe extern "C" fn(
        device_type: DLDeviceType,
        device_id: i32,
        out_current_stream: *mut *mut c_void,
    ) -> c_int,
>;

/// `DLPackExchangeAPIHeader`: the version of an exchange table and a link to an older-major one.
#[repr(C)]
#[derive(Debug)]
pub struct DLPackExchangeAPIHeader {
    /// The table's version; a consumer checks `major` before reading anything else.
    pub version: DLPackVersion,
    /// An older-major table offered as well, or NULL.
    pub prev_api: *mut DLPackExchangeAPIHeader,
}

/// `DLPackExchangeAPI`: the C exchange table a type publishes (DLPack 1.2/1.3), a process-lifetime
/// static. Only `dltensor_from_py_object_no_sync` may be NULL.
#[repr(C)]
#[derive(Debug)]
pub struct DLPackExchangeAPI {
    /// Version and chain link; first, so a header pointer is a table pointer.
    pub header: DLPackExchangeAPIHeader,
    /// Allocate a new tensor.
    pub managed_tensor_allocator: DLPackManagedTensorAllocator,
    /// Export a Python object (owning).
    pub managed_tensor_from_py_object_no_sync: DLPackManagedTensorFromPyObjectNoSync,
    /// Import a tensor as a Python object (stealing it).
    pub managed_tensor_to_py_object_no_sync: DLPackManagedTensorToPyObjectNoSync,
    /// Borrow a Python object as a plain `DLTensor` (optional).
    pub dltensor_from_py_object_no_sync: DLPackDLTensorFromPyObjectNoSync,
    /// The producer's current work stream.
    pub current_work_stream: DLPackCurrentWorkStream,
}

// SAFETY: an exchange table is an immutable, process-lifetime static by the standard's rules: its
// function pointers and `prev_api` link are only read, from any thread.
unsafe impl Sync for DLPackExchangeAPI {}
// SAFETY: as above.
unsafe impl Sync for DLPackExchangeAPIHeader {}

#[cfg(target_pointer_width = "64")]
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<DLPackVersion>() == 8 && align_of::<DLPackVersion>() == 4);
    assert!(size_of::<DLDevice>() == 8 && align_of::<DLDevice>() == 4);
    assert!(size_of::<DLDataType>() == 4 && align_of::<DLDataType>() == 2);
    assert!(offset_of!(DLDataType, bits) == 1 && offset_of!(DLDataType, lanes) == 2);
    assert!(size_of::<DLTensor>() == 48 && align_of::<DLTensor>() == 8);
    assert!(offset_of!(DLTensor, device) == 8);
    assert!(offset_of!(DLTensor, ndim) == 16);
    assert!(offset_of!(DLTensor, dtype) == 20);
    assert!(offset_of!(DLTensor, shape) == 24);
    assert!(offset_of!(DLTensor, strides) == 32);
    assert!(offset_of!(DLTensor, byte_offset) == 40);
    assert!(size_of::<DLManagedTensor>() == 64);
    assert!(offset_of!(DLManagedTensor, manager_ctx) == 48);
    assert!(offset_of!(DLManagedTensor, deleter) == 56);
    assert!(size_of::<DLManagedTensorVersioned>() == 80);
    assert!(offset_of!(DLManagedTensorVersioned, manager_ctx) == 8);
    assert!(offset_of!(DLManagedTensorVersioned, deleter) == 16);
    assert!(offset_of!(DLManagedTensorVersioned, flags) == 24);
    assert!(offset_of!(DLManagedTensorVersioned, dl_tensor) == 32);
    assert!(size_of::<DLPackExchangeAPIHeader>() == 16);
    assert!(offset_of!(DLPackExchangeAPIHeader, prev_api) == 8);
    assert!(size_of::<DLPackExchangeAPI>() == 56);
    assert!(offset_of!(DLPackExchangeAPI, managed_tensor_allocator) == 16);
    assert!(offset_of!(DLPackExchangeAPI, managed_tensor_from_py_object_no_sync) == 24);
    assert!(offset_of!(DLPackExchangeAPI, managed_tensor_to_py_object_no_sync) == 32);
    assert!(offset_of!(DLPackExchangeAPI, dltensor_from_py_object_no_sync) == 40);
    assert!(offset_of!(DLPackExchangeAPI, current_work_stream) == 48);
    // Nullable function pointers are one pointer wide (the niche of `Option<fn>`).
    assert!(size_of::<DLPackCurrentWorkStream>() == 8);
};
