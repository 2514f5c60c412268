//! The raw C functions of torch's stable ABI this module uses (`aoti_torch_*` from
//! `torch/csrc/inductor/aoti_torch/c/shim.h`, `torch_*` from `torch/csrc/stable/c/shim.h`), each
//! found with `dlsym` and kept as an `Option` (absent in an older libtorch).
//!
//! Every function is typed `extern "C-unwind"`: `aoti_torch_check` throws a C++ exception by
//! design, and the others catch their own (`AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE`), so the
//! type only matters if one escapes, where `extern "C"` would abort the process.

use std::ffi::{c_char, c_void};

/// `AOTITorchError`: 0 is success, anything else a failure.
pub type AOTITorchError = i32;
/// `StableIValue`: one argument or result on a boxed kernel's stack, encoded in 64 bits.
pub type StableIValue = u64;

/// An opaque `at::Tensor*` (`AtenTensorHandle`); an owning handle is freed with
/// `aoti_torch_delete_tensor_object`.
#[repr(C)]
pub struct AtenTensorOpaque {
    _private: [u8; 0],
}
/// `AtenTensorHandle`.
pub type AtenTensorHandle = *mut AtenTensorOpaque;

/// An opaque `torch::Library*` (`TorchLibraryHandle`).
#[repr(C)]
pub struct TorchLibraryOpaque {
    _private: [u8; 0],
}
/// `TorchLibraryHandle`.
pub type TorchLibraryHandle = *mut TorchLibraryOpaque;

/// An opaque `std::string*` (`StringHandle`, torch 2.10+).
#[repr(C)]
pub struct StringOpaque {
    _private: [u8; 0],
}
/// `StringHandle`.
pub type StringHandle = *mut StringOpaque;

/// An opaque `std::vector<StableIValue>*` (`StableListHandle`, torch 2.10+): a list argument
/// (`int[]`, `float[]`, `bool[]`, `Tensor[]`), its elements encoded as the stack encodes them; the
/// receiver frees it with `torch_delete_list`, which frees the vector only (tensor items stay
/// owning handles).
#[repr(C)]
pub struct StableListOpaque {
    _private: [u8; 0],
}
/// `StableListHandle`.
pub type StableListHandle = *mut StableListOpaque;

/// A boxed kernel as torch calls it: `void(StableIValue* stack, uint64_t num_args,
/// uint64_t num_outputs)`. `C-unwind`: the kernel reports an error by throwing a C++ exception
/// (through `aoti_torch_check`), which must pass through its frame.
pub type BoxedKernel = unsafe extern "C-unwind" fn(*mut StableIValue, u64, u64);

/// The deleter `torch_from_blob` calls with the data pointer and its context when the last
/// reference to the storage goes.
pub type BlobDeleter = unsafe extern "C" fn(data: *mut c_void, ctx: *mut c_void);

macro_rules! symbols {
    ($($(#[$m:meta])* $name:ident: fn($($arg:ty),* $(,)?) $(-> $ret:ty)?;)*) => {
        /// The functions found in libtorch (`None`: this libtorch does not export it).
        #[allow(non_snake_case)]
        #[derive(Clone, Copy)]
        pub(crate) struct Symbols {
            $($(#[$m])* pub(crate) $name: Option<unsafe extern "C-unwind" fn($($arg),*) $(-> $ret)?>,)*
        }

        impl Symbols {
            /// Whether function `name` was found (`false` for a name not in this table).
            pub(crate) fn has(&self, name: &str) -> bool {
                match name {
                    $(stringify!($name) => self.$name.is_some(),)*
                    _ => false,
                }
            }

            /// Looks every function up in `handle`.
            ///
            /// # Safety
            ///
            /// `handle` is a live `dlopen` handle of a libtorch whose exports of these names have
            /// the C signatures declared here (torch's stable ABI promises they keep them).
            pub(crate) unsafe fn resolve(handle: *mut c_void) -> Self {
                Self {
                    $($name: {
                        // SAFETY: a live handle and a NUL-terminated name.
                        let p = unsafe { libc::dlsym(handle, concat!(stringify!($name), "\0").as_ptr().cast()) };
                        if p.is_null() {
                            None
                        } else {
                            // SAFETY: the export of this name is the function of this signature
                            // (the caller's contract); a data pointer and a function pointer have
                            // the same size on every platform with dlsym.
                            Some(unsafe {
                                std::mem::transmute::<*mut c_void, unsafe extern "C-unwind" fn($($arg),*) $(-> $ret)?>(p)
                            })
                        }
                    },)*
                }
            }
        }
    };
}

symbols! {
    /// `uint64_t aoti_torch_abi_version()` (TORCH_ABI_VERSION of the running libtorch).
    aoti_torch_abi_version: fn() -> u64;
    /// `torch::Library(Kind::IMPL, ns, key)` on the heap.
    aoti_torch_library_init_impl: fn(*const c_char, *const c_char, *const c_char, u32, *mut TorchLibraryHandle) -> AOTITorchError;
    /// `torch::Library(Kind::DEF, ns)` on the heap.
    aoti_torch_library_init_def: fn(*const c_char, *const c_char, u32, *mut TorchLibraryHandle) -> AOTITorchError;
    /// `torch::Library(Kind::FRAGMENT, ns)` on the heap.
    aoti_torch_library_init_fragment: fn(*const c_char, *const c_char, u32, *mut TorchLibraryHandle) -> AOTITorchError;
    /// `m.def(schema)`.
    aoti_torch_library_def: fn(TorchLibraryHandle, *const c_char) -> AOTITorchError;
    /// `m.impl(name, boxed)` with libtorch's own ABI version (torch 2.7+).
    aoti_torch_library_impl: fn(TorchLibraryHandle, *const c_char, BoxedKernel) -> AOTITorchError;
    /// `m.impl(name, boxed)` with the extension's ABI version (torch 2.10+).
    torch_library_impl: fn(TorchLibraryHandle, *const c_char, BoxedKernel, u64) -> AOTITorchError;
    /// Throws `c10::Error(msg)` when `cond` is false.
    aoti_torch_check: fn(bool, *const c_char, *const c_char, u32, *const c_char);
    /// The calling thread's last shim error message (torch 2.13+), borrowed.
    torch_exception_get_what_without_backtrace: fn() -> *const c_char;
    /// A boxed dispatcher call with libtorch's own ABI version.
    aoti_torch_call_dispatcher: fn(*const c_char, *const c_char, *mut StableIValue) -> AOTITorchError;
    /// A boxed dispatcher call with the extension's ABI version (torch 2.10+).
    torch_call_dispatcher: fn(*const c_char, *const c_char, *mut StableIValue, u64) -> AOTITorchError;

    /// Frees an owning tensor handle.
    aoti_torch_delete_tensor_object: fn(AtenTensorHandle) -> AOTITorchError;
    /// A new owning handle to the same tensor.
    aoti_torch_new_tensor_handle: fn(AtenTensorHandle, *mut AtenTensorHandle) -> AOTITorchError;
    /// The first element's address (storage offset applied), borrowed.
    aoti_torch_get_data_ptr: fn(AtenTensorHandle, *mut *mut c_void) -> AOTITorchError;
    /// The extents, borrowed from the tensor.
    aoti_torch_get_sizes: fn(AtenTensorHandle, *mut *mut i64) -> AOTITorchError;
    /// The strides (in elements), borrowed from the tensor.
    aoti_torch_get_strides: fn(AtenTensorHandle, *mut *mut i64) -> AOTITorchError;
    /// The number of dimensions.
    aoti_torch_get_dim: fn(AtenTensorHandle, *mut i64) -> AOTITorchError;
    /// The number of elements.
    aoti_torch_get_numel: fn(AtenTensorHandle, *mut i64) -> AOTITorchError;
    /// The dtype code (`aoti_torch_dtype_*`).
    aoti_torch_get_dtype: fn(AtenTensorHandle, *mut i32) -> AOTITorchError;
    /// The device type code (`aoti_torch_device_type_*`).
    aoti_torch_get_device_type: fn(AtenTensorHandle, *mut i32) -> AOTITorchError;
    /// The device index.
    aoti_torch_get_device_index: fn(AtenTensorHandle, *mut i32) -> AOTITorchError;
    /// The layout code (`aoti_torch_layout_*`).
    aoti_torch_get_layout: fn(AtenTensorHandle, *mut i32) -> AOTITorchError;
    /// The storage offset, in elements.
    aoti_torch_get_storage_offset: fn(AtenTensorHandle, *mut i64) -> AOTITorchError;
    /// Whether the tensor is C-contiguous.
    aoti_torch_is_contiguous: fn(AtenTensorHandle, *mut bool) -> AOTITorchError;
    /// A new uninitialised tensor: `(ndim, sizes, strides, dtype, device_type, device_index, out)`.
    aoti_torch_empty_strided: fn(i64, *const i64, *const i64, i32, i32, i32, *mut AtenTensorHandle) -> AOTITorchError;
    /// `self.copy_(src, non_blocking)`.
    aoti_torch_copy_: fn(AtenTensorHandle, AtenTensorHandle, i32) -> AOTITorchError;
    /// A tensor over foreign memory with a deleter (torch 2.11+).
    torch_from_blob: fn(
        *mut c_void, i64, *const i64, *const i64, i64, i32, i32, i32, *mut AtenTensorHandle,
        i32, *const u8, i64, Option<BlobDeleter>, *mut c_void,
    ) -> AOTITorchError;

    /// A new `std::string` (torch 2.10+).
    torch_new_string_handle: fn(*const c_char, usize, *mut StringHandle) -> AOTITorchError;
    /// Frees a `std::string` (torch 2.10+).
    torch_delete_string: fn(StringHandle) -> AOTITorchError;
    /// A string's length (torch 2.10+).
    torch_string_length: fn(StringHandle, *mut usize) -> AOTITorchError;
    /// A string's bytes, borrowed (torch 2.10+).
    torch_string_c_str: fn(StringHandle, *mut *const c_char) -> AOTITorchError;
    /// A list's length (torch 2.10+).
    torch_list_size: fn(StableListHandle, *mut usize) -> AOTITorchError;
    /// A list's item, copied out (an owning tensor handle stays the list's to give) (torch 2.10+).
    torch_list_get_item: fn(StableListHandle, usize, *mut StableIValue) -> AOTITorchError;
    /// Frees a list (the vector, not what its items own) (torch 2.10+).
    torch_delete_list: fn(StableListHandle) -> AOTITorchError;
    /// A new, empty list with room for `size` items (torch 2.10+).
    torch_new_list_reserve_size: fn(usize, *mut StableListHandle) -> AOTITorchError;
    /// Appends an item to a list (torch 2.10+).
    torch_list_push_back: fn(StableListHandle, StableIValue) -> AOTITorchError;
    /// A new heap `StableIValue`, an optional argument's box (torch 2.13+).
    torch_new_stable_ivalue: fn(*mut *mut StableIValue) -> AOTITorchError;
    /// Frees a heap `StableIValue`, an optional argument's box (torch 2.13+; a plain `delete`).
    torch_delete_stable_ivalue: fn(*mut StableIValue) -> AOTITorchError;
    /// C++ `operator delete(void*)`: what frees an optional argument's box before torch 2.13
    /// (torch made it with `new StableIValue`).
    #[allow(non_snake_case)]
    _ZdlPv: fn(*mut c_void);

    /// dtype code.
    aoti_torch_dtype_bool: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_uint8: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_uint16: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_uint32: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_uint64: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_int8: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_int16: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_int32: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_int64: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_float16: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_bfloat16: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_float32: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_float64: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_complex64: fn() -> i32;
    /// dtype code.
    aoti_torch_dtype_complex128: fn() -> i32;
    /// layout code.
    aoti_torch_layout_strided: fn() -> i32;
    /// device type code.
    aoti_torch_device_type_cpu: fn() -> i32;
    /// device type code.
    aoti_torch_device_type_cuda: fn() -> i32;
    /// device type code.
    aoti_torch_device_type_meta: fn() -> i32;
}
