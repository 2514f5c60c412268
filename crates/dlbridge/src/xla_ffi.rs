//! The raw XLA FFI C ABI, as `xla/ffi/api/c_api.h` declares it (API version 0.3, the header
//! jaxlib ships: `jax.ffi.include_dir()`), as [`crate::ffi`] mirrors DLPack.
//!
//! Nothing here validates or interprets anything: these are the C structs, the enumerations and the
//! function-pointer types a handler meets. Values XLA sends that are C enums in the header (data
//! types, argument and attribute kinds, the execution stage, the extension type) are open integer
//! newtypes, so a value this crate does not know (a later header's) is representable and never
//! undefined behaviour. Safe code uses [`crate::xla`], which validates a call frame before anything
//! reads it. The function pointers of the API table dlbridge never calls are kept as untyped
//! pointers ([`XLA_FFI_Unused`]): they only keep the table's layout.
//!
//! Sizes and field offsets are asserted at compile time for 64-bit targets, and a test compiles a
//! C file against the header jaxlib ships and compares every size and offset with these.
//!
//! ```
//! use dlbridge::xla_ffi::{XLA_FFI_Buffer, XLA_FFI_CallFrame, XLA_FFI_CallFrame_STRUCT_SIZE};
//! assert_eq!(std::mem::size_of::<XLA_FFI_Buffer>(), 48);
//! assert_eq!(XLA_FFI_CallFrame_STRUCT_SIZE, 168);
//! # let _ = std::mem::size_of::<XLA_FFI_CallFrame>();
//! ```
#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]

use std::ffi::{c_char, c_int, c_void};
use std::mem::{offset_of, size_of};

/// `XLA_FFI_API_MAJOR`: the major API version this mirror implements (a call frame's API table
/// must carry it).
pub const XLA_FFI_API_MAJOR: c_int = 0;
/// `XLA_FFI_API_MINOR`: the minor API version this mirror implements.
pub const XLA_FFI_API_MINOR: c_int = 3;

macro_rules! open_enum {
    ($(#[$m:meta])* $name:ident : $repr:ty { $($(#[$vm:meta])* $v:ident = $n:expr,)* }) => {
        $(#[$m])*
        #[repr(transparent)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name(pub $repr);
        impl $name {
            $($(#[$vm])* pub const $v: Self = Self($n);)*
        }
    };
}

open_enum! {
    /// `XLA_FFI_Extension_Type`.
    XLA_FFI_Extension_Type: c_int {
        /// `XLA_FFI_Extension_Metadata`: the call asks the handler for its metadata.
        METADATA = 1,
    }
}

open_enum! {
    /// `XLA_FFI_Error_Code` (absl's status codes).
    XLA_FFI_Error_Code: c_int {
        /// OK.
        OK = 0,
        /// CANCELLED.
        CANCELLED = 1,
        /// UNKNOWN.
        UNKNOWN = 2,
        /// INVALID_ARGUMENT.
        INVALID_ARGUMENT = 3,
        /// DEADLINE_EXCEEDED.
        DEADLINE_EXCEEDED = 4,
        /// NOT_FOUND.
        NOT_FOUND = 5,
        /// ALREADY_EXISTS.
        ALREADY_EXISTS = 6,
        /// PERMISSION_DENIED.
        PERMISSION_DENIED = 7,
        /// RESOURCE_EXHAUSTED.
        RESOURCE_EXHAUSTED = 8,
        /// FAILED_PRECONDITION.
        FAILED_PRECONDITION = 9,
        /// ABORTED.
        ABORTED = 10,
        /// OUT_OF_RANGE.
        OUT_OF_RANGE = 11,
        /// UNIMPLEMENTED.
        UNIMPLEMENTED = 12,
        /// INTERNAL.
        INTERNAL = 13,
        /// UNAVAILABLE.
        UNAVAILABLE = 14,
        /// DATA_LOSS.
        DATA_LOSS = 15,
        /// UNAUTHENTICATED.
        UNAUTHENTICATED = 16,
    }
}

open_enum! {
    /// `XLA_FFI_DataType` (XLA's `PrimitiveType` numbering).
    XLA_FFI_DataType: c_int {
        /// INVALID.
        INVALID = 0,
        /// PRED (bool).
        PRED = 1,
        /// S1.
        S1 = 30,
        /// S2.
        S2 = 26,
        /// S4.
        S4 = 21,
        /// S8.
        S8 = 2,
        /// S16.
        S16 = 3,
        /// S32.
        S32 = 4,
        /// S64.
        S64 = 5,
        /// U1.
        U1 = 31,
        /// U2.
        U2 = 27,
        /// U4.
        U4 = 22,
        /// U8.
        U8 = 6,
        /// U16.
        U16 = 7,
        /// U32.
        U32 = 8,
        /// U64.
        U64 = 9,
        /// F16.
        F16 = 10,
        /// F32.
        F32 = 11,
        /// F64.
        F64 = 12,
        /// BF16.
        BF16 = 16,
        /// C64.
        C64 = 15,
        /// C128.
        C128 = 18,
        /// TOKEN.
        TOKEN = 17,
        /// F8E5M2.
        F8E5M2 = 19,
        /// F8E3M4.
        F8E3M4 = 29,
        /// F8E4M3.
        F8E4M3 = 28,
        /// F8E4M3FN.
        F8E4M3FN = 20,
        /// F8E4M3B11FNUZ.
        F8E4M3B11FNUZ = 23,
        /// F8E5M2FNUZ.
        F8E5M2FNUZ = 24,
        /// F8E4M3FNUZ.
        F8E4M3FNUZ = 25,
        /// F4E2M1FN.
        F4E2M1FN = 32,
        /// F8E8M0FNU.
        F8E8M0FNU = 33,
    }
}

open_enum! {
    /// `XLA_FFI_ArgType`.
    XLA_FFI_ArgType: c_int {
        /// A buffer ([`XLA_FFI_Buffer`]).
        BUFFER = 1,
    }
}

open_enum! {
    /// `XLA_FFI_RetType`.
    XLA_FFI_RetType: c_int {
        /// A buffer ([`XLA_FFI_Buffer`]).
        BUFFER = 1,
    }
}

open_enum! {
    /// `XLA_FFI_AttrType`.
    XLA_FFI_AttrType: c_int {
        /// An array ([`XLA_FFI_Array`]).
        ARRAY = 1,
        /// A dictionary ([`XLA_FFI_Attrs`]).
        DICTIONARY = 2,
        /// A scalar ([`XLA_FFI_Scalar`]).
        SCALAR = 3,
        /// A string ([`XLA_FFI_ByteSpan`]).
        STRING = 4,
    }
}

open_enum! {
    /// `XLA_FFI_ExecutionStage`.
    XLA_FFI_ExecutionStage: c_int {
        /// INSTANTIATE.
        INSTANTIATE = 0,
        /// PREPARE.
        PREPARE = 1,
        /// INITIALIZE.
        INITIALIZE = 2,
        /// EXECUTE.
        EXECUTE = 3,
    }
}

/// `XLA_FFI_Handler_Traits` bit: the handler may be captured in a command buffer (CUDA graph).
pub const XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE: u32 = 1 << 0;

/// `XLA_FFI_Extension_Base`: the head of every extension in a struct's `extension_start` chain.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Extension_Base {
    /// The extension struct's size.
    pub struct_size: usize,
    /// Which extension this is.
    pub type_: XLA_FFI_Extension_Type,
    /// The next extension, or NULL.
    pub next: *mut XLA_FFI_Extension_Base,
}

/// `XLA_FFI_Api_Version`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct XLA_FFI_Api_Version {
    /// `XLA_FFI_Api_Version_STRUCT_SIZE` of the writer.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The major version.
    pub major_version: c_int,
    /// The minor version.
    pub minor_version: c_int,
}

/// `XLA_FFI_Error`: opaque, made by the API table's `XLA_FFI_Error_Create`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Error {
    _opaque: [u8; 0],
}

/// `XLA_FFI_Error_Create_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Error_Create_Args {
    /// `XLA_FFI_Error_Create_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The message (NUL-terminated; XLA copies it).
    pub message: *const c_char,
    /// The code.
    pub errc: XLA_FFI_Error_Code,
}

/// `XLA_FFI_Error_GetMessage_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Error_GetMessage_Args {
    /// `XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The error.
    pub error: *mut XLA_FFI_Error,
    /// Out: its message, owned by the error.
    pub message: *const c_char,
}

/// `XLA_FFI_Error_Destroy_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Error_Destroy_Args {
    /// `XLA_FFI_Error_Destroy_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The error to free.
    pub error: *mut XLA_FFI_Error,
}

/// `XLA_FFI_Buffer`: a dense row-major array XLA lends the handler for the call.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Buffer {
    /// `XLA_FFI_Buffer_STRUCT_SIZE` of the writer.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The element type.
    pub dtype: XLA_FFI_DataType,
    /// The first element.
    pub data: *mut c_void,
    /// The number of dimensions.
    pub rank: i64,
    /// `rank` extents.
    pub dims: *mut i64,
}

/// `XLA_FFI_ExecutionContext`: opaque.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_ExecutionContext {
    _opaque: [u8; 0],
}

/// `XLA_FFI_Future`: opaque.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Future {
    _opaque: [u8; 0],
}

/// `XLA_FFI_ByteSpan`: a string that is not NUL-terminated.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct XLA_FFI_ByteSpan {
    /// The bytes.
    pub ptr: *const c_char,
    /// Their number.
    pub len: usize,
}

/// `XLA_FFI_Scalar`: a scalar attribute.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Scalar {
    /// Its type.
    pub dtype: XLA_FFI_DataType,
    /// Its value.
    pub value: *mut c_void,
}

/// `XLA_FFI_Array`: an array attribute.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Array {
    /// The element type.
    pub dtype: XLA_FFI_DataType,
    /// The number of elements.
    pub size: usize,
    /// The elements.
    pub data: *mut c_void,
}

/// `XLA_FFI_TypeId`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct XLA_FFI_TypeId {
    /// The id (0: unknown).
    pub type_id: i64,
}

/// `XLA_FFI_Args`: the call's operands.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Args {
    /// `XLA_FFI_Args_STRUCT_SIZE` of the writer.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The number of operands.
    pub size: i64,
    /// `size` kinds.
    pub types: *mut XLA_FFI_ArgType,
    /// `size` operands.
    pub args: *mut *mut c_void,
}

/// `XLA_FFI_Rets`: the call's results.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Rets {
    /// `XLA_FFI_Rets_STRUCT_SIZE` of the writer.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The number of results.
    pub size: i64,
    /// `size` kinds.
    pub types: *mut XLA_FFI_RetType,
    /// `size` results.
    pub rets: *mut *mut c_void,
}

/// `XLA_FFI_Attrs`: the call's attributes, sorted by name.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Attrs {
    /// `XLA_FFI_Attrs_STRUCT_SIZE` of the writer.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The number of attributes.
    pub size: i64,
    /// `size` kinds.
    pub types: *mut XLA_FFI_AttrType,
    /// `size` names.
    pub names: *mut *mut XLA_FFI_ByteSpan,
    /// `size` values.
    pub attrs: *mut *mut c_void,
}

/// `XLA_FFI_CallFrame`: everything a handler gets.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_CallFrame {
    /// `XLA_FFI_CallFrame_STRUCT_SIZE` of the writer.
    pub struct_size: usize,
    /// Extensions (the metadata query), or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The API table.
    pub api: *const XLA_FFI_Api,
    /// The execution context (stream, device ordinal, ...).
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// The stage.
    pub stage: XLA_FFI_ExecutionStage,
    /// Operands.
    pub args: XLA_FFI_Args,
    /// Results.
    pub rets: XLA_FFI_Rets,
    /// Attributes.
    pub attrs: XLA_FFI_Attrs,
    /// Out: an asynchronous handler's future.
    pub future: *mut XLA_FFI_Future,
}

/// `XLA_FFI_Handler`: what `jax.ffi.register_ffi_target` takes (in a capsule).
pub type XLA_FFI_Handler = unsafe extern "C" fn(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error;

/// `XLA_FFI_Error_Create`.
pub type XLA_FFI_Error_Create =
    unsafe extern "C" fn(args: *mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error;
/// `XLA_FFI_Error_GetMessage`.
pub type XLA_FFI_Error_GetMessage = unsafe extern "C" fn(args: *mut XLA_FFI_Error_GetMessage_Args);
/// `XLA_FFI_Error_Destroy`.
pub type XLA_FFI_Error_Destroy = unsafe extern "C" fn(args: *mut XLA_FFI_Error_Destroy_Args);
/// `XLA_FFI_Stream_Get`.
pub type XLA_FFI_Stream_Get = unsafe extern "C" fn(args: *mut XLA_FFI_Stream_Get_Args) -> *mut XLA_FFI_Error;
/// `XLA_FFI_DeviceOrdinal_Get`.
pub type XLA_FFI_DeviceOrdinal_Get =
    unsafe extern "C" fn(args: *mut XLA_FFI_DeviceOrdinal_Get_Args) -> *mut XLA_FFI_Error;
/// A function of the API table dlbridge never calls (the header has its type): kept for the
/// table's layout only.
pub type XLA_FFI_Unused = *const c_void;
/// `XLA_FFI_Type_Register`.
pub type XLA_FFI_Type_Register =
    unsafe extern "C" fn(args: *mut XLA_FFI_Type_Register_Args) -> *mut XLA_FFI_Error;
/// `XLA_FFI_State_Set`.
pub type XLA_FFI_State_Set = unsafe extern "C" fn(args: *mut XLA_FFI_State_Set_Args) -> *mut XLA_FFI_Error;
/// `XLA_FFI_State_Get`.
pub type XLA_FFI_State_Get = unsafe extern "C" fn(args: *mut XLA_FFI_State_Get_Args) -> *mut XLA_FFI_Error;
/// `XLA_FFI_DeviceMemory_Allocate`.
pub type XLA_FFI_DeviceMemory_Allocate =
    unsafe extern "C" fn(args: *mut XLA_FFI_DeviceMemory_Allocate_Args) -> *mut XLA_FFI_Error;
/// `XLA_FFI_DeviceMemory_Free`.
pub type XLA_FFI_DeviceMemory_Free =
    unsafe extern "C" fn(args: *mut XLA_FFI_DeviceMemory_Free_Args) -> *mut XLA_FFI_Error;
/// `XLA_FFI_Task`: a task for the thread pool, called once with its `data`.
pub type XLA_FFI_Task = unsafe extern "C" fn(data: *mut c_void);
/// `XLA_FFI_ThreadPool_Schedule`.
pub type XLA_FFI_ThreadPool_Schedule =
    unsafe extern "C" fn(args: *mut XLA_FFI_ThreadPool_Schedule_Args) -> *mut XLA_FFI_Error;
/// `XLA_FFI_ThreadPool_NumThreads`.
pub type XLA_FFI_ThreadPool_NumThreads =
    unsafe extern "C" fn(args: *mut XLA_FFI_ThreadPool_NumThreads_Args) -> *mut XLA_FFI_Error;

/// `XLA_FFI_TypeInfo`: how XLA frees an object of a registered type (a handler's state).
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_TypeInfo {
    /// `XLA_FFI_TypeInfo_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// Frees an object of the type.
    pub deleter: Option<unsafe extern "C" fn(object: *mut c_void)>,
}

/// `XLA_FFI_Type_Register_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Type_Register_Args {
    /// `XLA_FFI_Type_Register_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The type's name (unique in the process).
    pub name: XLA_FFI_ByteSpan,
    /// In-out: 0 asks XLA to assign an id, which it writes here.
    pub type_id: *mut XLA_FFI_TypeId,
    /// The type's deleter.
    pub type_info: *const XLA_FFI_TypeInfo,
}

/// `XLA_FFI_State_Set_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_State_Set_Args {
    /// `XLA_FFI_State_Set_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The call's context.
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// The stage whose state this is.
    pub stage: XLA_FFI_ExecutionStage,
    /// The state's registered type.
    pub type_id: *mut XLA_FFI_TypeId,
    /// The state (XLA owns it once set, and frees it with the type's deleter).
    pub state: *mut c_void,
}

/// `XLA_FFI_State_Get_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_State_Get_Args {
    /// `XLA_FFI_State_Get_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The call's context.
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// The stage whose state is read.
    pub stage: XLA_FFI_ExecutionStage,
    /// The state's registered type.
    pub type_id: *mut XLA_FFI_TypeId,
    /// Out: the state.
    pub state: *mut c_void,
}

/// `XLA_FFI_DeviceMemory_Allocate_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_DeviceMemory_Allocate_Args {
    /// `XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The call's context.
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// Bytes.
    pub size: usize,
    /// Their alignment.
    pub alignment: usize,
    /// Out: the memory.
    pub data: *mut c_void,
}

/// `XLA_FFI_DeviceMemory_Free_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_DeviceMemory_Free_Args {
    /// `XLA_FFI_DeviceMemory_Free_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The call's context.
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// Bytes (as allocated).
    pub size: usize,
    /// The memory.
    pub data: *mut c_void,
}

/// `XLA_FFI_ThreadPool_Schedule_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_ThreadPool_Schedule_Args {
    /// `XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The call's context.
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// The task.
    pub task: Option<XLA_FFI_Task>,
    /// Its argument.
    pub data: *mut c_void,
}

/// `XLA_FFI_ThreadPool_NumThreads_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_ThreadPool_NumThreads_Args {
    /// `XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The call's context.
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// Out: where XLA writes the number of threads.
    pub num_threads: *mut i64,
}

/// `XLA_FFI_Stream_Get_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Stream_Get_Args {
    /// `XLA_FFI_Stream_Get_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The call's context.
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// Out: the platform stream (a `cudaStream_t` on CUDA).
    pub stream: *mut c_void,
}

/// `XLA_FFI_DeviceOrdinal_Get_Args`.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_DeviceOrdinal_Get_Args {
    /// `XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE`.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The call's context.
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// Out: the device ordinal.
    pub device_ordinal: i32,
}

/// `XLA_FFI_Metadata`: what a handler says of itself when asked.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Metadata {
    /// `XLA_FFI_Metadata_STRUCT_SIZE` of the writer (XLA).
    pub struct_size: usize,
    /// Out: the API version the handler was built against.
    pub api_version: XLA_FFI_Api_Version,
    /// Out: the handler's traits.
    pub traits: u32,
    /// Out: the type of the state the handler makes, if any.
    pub state_type_id: XLA_FFI_TypeId,
}

/// `XLA_FFI_Metadata_Extension`: a call frame carrying it asks for the handler's metadata.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Metadata_Extension {
    /// The extension head (`type_ == METADATA`).
    pub extension_base: XLA_FFI_Extension_Base,
    /// Where to write the metadata.
    pub metadata: *mut XLA_FFI_Metadata,
}

/// `XLA_FFI_Api`: the table of functions XLA lends the handler.
#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Api {
    /// `XLA_FFI_Api_STRUCT_SIZE` of the writer.
    pub struct_size: usize,
    /// Extensions, or NULL.
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The version XLA implements.
    pub api_version: XLA_FFI_Api_Version,
    /// XLA's own.
    pub internal_api: *const c_void,
    /// `XLA_FFI_Error_Create`.
    pub XLA_FFI_Error_Create: Option<XLA_FFI_Error_Create>,
    /// `XLA_FFI_Error_GetMessage`.
    pub XLA_FFI_Error_GetMessage: Option<XLA_FFI_Error_GetMessage>,
    /// `XLA_FFI_Error_Destroy`.
    pub XLA_FFI_Error_Destroy: Option<XLA_FFI_Error_Destroy>,
    /// `XLA_FFI_Handler_Register`.
    pub XLA_FFI_Handler_Register: XLA_FFI_Unused,
    /// `XLA_FFI_Stream_Get`.
    pub XLA_FFI_Stream_Get: Option<XLA_FFI_Stream_Get>,
    /// `XLA_FFI_Type_Register`.
    pub XLA_FFI_Type_Register: Option<XLA_FFI_Type_Register>,
    /// `XLA_FFI_ExecutionContext_Get`.
    pub XLA_FFI_ExecutionContext_Get: XLA_FFI_Unused,
    /// `XLA_FFI_State_Set`.
    pub XLA_FFI_State_Set: Option<XLA_FFI_State_Set>,
    /// `XLA_FFI_State_Get`.
    pub XLA_FFI_State_Get: Option<XLA_FFI_State_Get>,
    /// `XLA_FFI_DeviceMemory_Allocate`.
    pub XLA_FFI_DeviceMemory_Allocate: Option<XLA_FFI_DeviceMemory_Allocate>,
    /// `XLA_FFI_DeviceMemory_Free`.
    pub XLA_FFI_DeviceMemory_Free: Option<XLA_FFI_DeviceMemory_Free>,
    /// `XLA_FFI_ThreadPool_Schedule`.
    pub XLA_FFI_ThreadPool_Schedule: Option<XLA_FFI_ThreadPool_Schedule>,
    /// `XLA_FFI_ThreadPool_NumThreads`.
    pub XLA_FFI_ThreadPool_NumThreads: Option<XLA_FFI_ThreadPool_NumThreads>,
    /// `XLA_FFI_Future_Create`.
    pub XLA_FFI_Future_Create: XLA_FFI_Unused,
    /// `XLA_FFI_Future_SetAvailable`.
    pub XLA_FFI_Future_SetAvailable: XLA_FFI_Unused,
    /// `XLA_FFI_Future_SetError`.
    pub XLA_FFI_Future_SetError: XLA_FFI_Unused,
    /// `XLA_FFI_RunId_Get`.
    pub XLA_FFI_RunId_Get: XLA_FFI_Unused,
    /// `XLA_FFI_DeviceOrdinal_Get`.
    pub XLA_FFI_DeviceOrdinal_Get: Option<XLA_FFI_DeviceOrdinal_Get>,
}

macro_rules! struct_size {
    ($(#[$m:meta])* $name:ident = $ty:ident, $last:ident: $fty:ty) => {
        $(#[$m])*
        pub const $name: usize = offset_of!($ty, $last) + size_of::<$fty>();
    };
}

struct_size!(
    /// `XLA_FFI_Extension_Base_STRUCT_SIZE`.
    XLA_FFI_Extension_Base_STRUCT_SIZE = XLA_FFI_Extension_Base, next: *mut XLA_FFI_Extension_Base);
struct_size!(
    /// `XLA_FFI_Api_Version_STRUCT_SIZE`.
    XLA_FFI_Api_Version_STRUCT_SIZE = XLA_FFI_Api_Version, minor_version: c_int);
struct_size!(
    /// `XLA_FFI_Error_Create_Args_STRUCT_SIZE`.
    XLA_FFI_Error_Create_Args_STRUCT_SIZE = XLA_FFI_Error_Create_Args, errc: XLA_FFI_Error_Code);
struct_size!(
    /// `XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE`.
    XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE = XLA_FFI_Error_GetMessage_Args, message: *const c_char);
struct_size!(
    /// `XLA_FFI_Error_Destroy_Args_STRUCT_SIZE`.
    XLA_FFI_Error_Destroy_Args_STRUCT_SIZE = XLA_FFI_Error_Destroy_Args, error: *mut XLA_FFI_Error);
struct_size!(
    /// `XLA_FFI_Buffer_STRUCT_SIZE`.
    XLA_FFI_Buffer_STRUCT_SIZE = XLA_FFI_Buffer, dims: *mut i64);
struct_size!(
    /// `XLA_FFI_Args_STRUCT_SIZE`.
    XLA_FFI_Args_STRUCT_SIZE = XLA_FFI_Args, args: *mut *mut c_void);
struct_size!(
    /// `XLA_FFI_Rets_STRUCT_SIZE`.
    XLA_FFI_Rets_STRUCT_SIZE = XLA_FFI_Rets, rets: *mut *mut c_void);
struct_size!(
    /// `XLA_FFI_Attrs_STRUCT_SIZE`.
    XLA_FFI_Attrs_STRUCT_SIZE = XLA_FFI_Attrs, attrs: *mut *mut c_void);
struct_size!(
    /// `XLA_FFI_CallFrame_STRUCT_SIZE` (up to `attrs`, as the header says: `future` is newer).
    XLA_FFI_CallFrame_STRUCT_SIZE = XLA_FFI_CallFrame, attrs: XLA_FFI_Attrs);
struct_size!(
    /// `XLA_FFI_Stream_Get_Args_STRUCT_SIZE`.
    XLA_FFI_Stream_Get_Args_STRUCT_SIZE = XLA_FFI_Stream_Get_Args, stream: *mut c_void);
struct_size!(
    /// `XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE`.
    XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE = XLA_FFI_DeviceOrdinal_Get_Args, device_ordinal: i32);
struct_size!(
    /// `XLA_FFI_TypeInfo_STRUCT_SIZE`.
    XLA_FFI_TypeInfo_STRUCT_SIZE = XLA_FFI_TypeInfo, deleter: *const c_void);
struct_size!(
    /// `XLA_FFI_Type_Register_Args_STRUCT_SIZE`.
    XLA_FFI_Type_Register_Args_STRUCT_SIZE = XLA_FFI_Type_Register_Args, type_id: *mut XLA_FFI_TypeId);
struct_size!(
    /// `XLA_FFI_State_Set_Args_STRUCT_SIZE`.
    XLA_FFI_State_Set_Args_STRUCT_SIZE = XLA_FFI_State_Set_Args, state: *mut c_void);
struct_size!(
    /// `XLA_FFI_State_Get_Args_STRUCT_SIZE`.
    XLA_FFI_State_Get_Args_STRUCT_SIZE = XLA_FFI_State_Get_Args, state: *mut c_void);
struct_size!(
    /// `XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE`.
    XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE = XLA_FFI_DeviceMemory_Allocate_Args, data: *mut c_void);
struct_size!(
    /// `XLA_FFI_DeviceMemory_Free_Args_STRUCT_SIZE`.
    XLA_FFI_DeviceMemory_Free_Args_STRUCT_SIZE = XLA_FFI_DeviceMemory_Free_Args, data: *mut c_void);
struct_size!(
    /// `XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE`.
    XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE = XLA_FFI_ThreadPool_Schedule_Args, data: *mut c_void);
struct_size!(
    /// `XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE`.
    XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE = XLA_FFI_ThreadPool_NumThreads_Args, num_threads: *mut i64);
struct_size!(
    /// `XLA_FFI_Metadata_STRUCT_SIZE` (up to `traits`, as the header says).
    XLA_FFI_Metadata_STRUCT_SIZE = XLA_FFI_Metadata, traits: u32);
struct_size!(
    /// `XLA_FFI_Metadata_Extension_STRUCT_SIZE`.
    XLA_FFI_Metadata_Extension_STRUCT_SIZE = XLA_FFI_Metadata_Extension, metadata: *mut XLA_FFI_Metadata);
struct_size!(
    /// `XLA_FFI_Api_STRUCT_SIZE`.
    XLA_FFI_Api_STRUCT_SIZE = XLA_FFI_Api, XLA_FFI_DeviceOrdinal_Get: Option<XLA_FFI_DeviceOrdinal_Get>);

/// Every struct's size and every field's offset, by the header's names: the layout test compiles
/// the same list in C against jaxlib's header and compares (`tests/xla_ffi_layout.rs`).
#[doc(hidden)]
pub fn layout_table() -> Vec<(&'static str, usize)> {
    macro_rules! table {
        ($($ty:ident { $($f:ident),* })*) => {
            vec![$(
                (stringify!($ty), size_of::<$ty>()),
                $((concat!(stringify!($ty), ".", stringify!($f)), offset_of!($ty, $f)),)*
            )*]
        };
    }
    let mut t = table! {
        XLA_FFI_Extension_Base { struct_size, next }
        XLA_FFI_Api_Version { struct_size, extension_start, major_version, minor_version }
        XLA_FFI_Error_Create_Args { struct_size, extension_start, message, errc }
        XLA_FFI_Error_GetMessage_Args { struct_size, extension_start, error, message }
        XLA_FFI_Error_Destroy_Args { struct_size, extension_start, error }
        XLA_FFI_Buffer { struct_size, extension_start, dtype, data, rank, dims }
        XLA_FFI_ByteSpan { ptr, len }
        XLA_FFI_Scalar { dtype, value }
        XLA_FFI_Array { dtype, size, data }
        XLA_FFI_TypeId { type_id }
        XLA_FFI_Args { struct_size, extension_start, size, types, args }
        XLA_FFI_Rets { struct_size, extension_start, size, types, rets }
        XLA_FFI_Attrs { struct_size, extension_start, size, types, names, attrs }
        XLA_FFI_CallFrame { struct_size, extension_start, api, ctx, stage, args, rets, attrs, future }
        XLA_FFI_Stream_Get_Args { struct_size, extension_start, ctx, stream }
        XLA_FFI_DeviceOrdinal_Get_Args { struct_size, extension_start, ctx, device_ordinal }
        XLA_FFI_TypeInfo { struct_size, extension_start, deleter }
        XLA_FFI_Type_Register_Args { struct_size, extension_start, name, type_id, type_info }
        XLA_FFI_State_Set_Args { struct_size, extension_start, ctx, stage, type_id, state }
        XLA_FFI_State_Get_Args { struct_size, extension_start, ctx, stage, type_id, state }
        XLA_FFI_DeviceMemory_Allocate_Args { struct_size, extension_start, ctx, size, alignment, data }
        XLA_FFI_DeviceMemory_Free_Args { struct_size, extension_start, ctx, size, data }
        XLA_FFI_ThreadPool_Schedule_Args { struct_size, extension_start, ctx, task, data }
        XLA_FFI_ThreadPool_NumThreads_Args { struct_size, extension_start, ctx, num_threads }
        XLA_FFI_Metadata { struct_size, api_version, traits, state_type_id }
        XLA_FFI_Metadata_Extension { extension_base, metadata }
        XLA_FFI_Api {
            struct_size, extension_start, api_version, internal_api, XLA_FFI_Error_Create,
            XLA_FFI_Error_GetMessage, XLA_FFI_Error_Destroy, XLA_FFI_Handler_Register,
            XLA_FFI_Stream_Get, XLA_FFI_Type_Register, XLA_FFI_ExecutionContext_Get,
            XLA_FFI_State_Set, XLA_FFI_State_Get, XLA_FFI_DeviceMemory_Allocate,
            XLA_FFI_DeviceMemory_Free, XLA_FFI_ThreadPool_Schedule, XLA_FFI_ThreadPool_NumThreads,
            XLA_FFI_Future_Create, XLA_FFI_Future_SetAvailable, XLA_FFI_Future_SetError,
            XLA_FFI_RunId_Get, XLA_FFI_DeviceOrdinal_Get
        }
    };
    t.push(("XLA_FFI_Extension_Base.type", offset_of!(XLA_FFI_Extension_Base, type_)));
    t.extend([
        ("XLA_FFI_Extension_Base_STRUCT_SIZE", XLA_FFI_Extension_Base_STRUCT_SIZE),
        ("XLA_FFI_Api_Version_STRUCT_SIZE", XLA_FFI_Api_Version_STRUCT_SIZE),
        ("XLA_FFI_Error_Create_Args_STRUCT_SIZE", XLA_FFI_Error_Create_Args_STRUCT_SIZE),
        ("XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE", XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE),
        ("XLA_FFI_Error_Destroy_Args_STRUCT_SIZE", XLA_FFI_Error_Destroy_Args_STRUCT_SIZE),
        ("XLA_FFI_Buffer_STRUCT_SIZE", XLA_FFI_Buffer_STRUCT_SIZE),
        ("XLA_FFI_Args_STRUCT_SIZE", XLA_FFI_Args_STRUCT_SIZE),
        ("XLA_FFI_Rets_STRUCT_SIZE", XLA_FFI_Rets_STRUCT_SIZE),
        ("XLA_FFI_Attrs_STRUCT_SIZE", XLA_FFI_Attrs_STRUCT_SIZE),
        ("XLA_FFI_CallFrame_STRUCT_SIZE", XLA_FFI_CallFrame_STRUCT_SIZE),
        ("XLA_FFI_Stream_Get_Args_STRUCT_SIZE", XLA_FFI_Stream_Get_Args_STRUCT_SIZE),
        ("XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE", XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE),
        ("XLA_FFI_TypeInfo_STRUCT_SIZE", XLA_FFI_TypeInfo_STRUCT_SIZE),
        ("XLA_FFI_Type_Register_Args_STRUCT_SIZE", XLA_FFI_Type_Register_Args_STRUCT_SIZE),
        ("XLA_FFI_State_Set_Args_STRUCT_SIZE", XLA_FFI_State_Set_Args_STRUCT_SIZE),
        ("XLA_FFI_State_Get_Args_STRUCT_SIZE", XLA_FFI_State_Get_Args_STRUCT_SIZE),
        ("XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE", XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE),
        ("XLA_FFI_DeviceMemory_Free_Args_STRUCT_SIZE", XLA_FFI_DeviceMemory_Free_Args_STRUCT_SIZE),
        ("XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE", XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE),
        ("XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE", XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE),
        ("XLA_FFI_Metadata_STRUCT_SIZE", XLA_FFI_Metadata_STRUCT_SIZE),
        ("XLA_FFI_Metadata_Extension_STRUCT_SIZE", XLA_FFI_Metadata_Extension_STRUCT_SIZE),
        ("XLA_FFI_Api_STRUCT_SIZE", XLA_FFI_Api_STRUCT_SIZE),
        ("XLA_FFI_API_MAJOR", XLA_FFI_API_MAJOR as usize),
        ("XLA_FFI_API_MINOR", XLA_FFI_API_MINOR as usize),
    ]);
    t
}

#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(size_of::<XLA_FFI_Extension_Base>() == 24);
    assert!(size_of::<XLA_FFI_Api_Version>() == 24);
    assert!(size_of::<XLA_FFI_Error_Create_Args>() == 32);
    assert!(size_of::<XLA_FFI_Buffer>() == 48 && offset_of!(XLA_FFI_Buffer, data) == 24);
    assert!(size_of::<XLA_FFI_ByteSpan>() == 16 && size_of::<XLA_FFI_Scalar>() == 16);
    assert!(size_of::<XLA_FFI_Array>() == 24);
    assert!(size_of::<XLA_FFI_Args>() == 40 && size_of::<XLA_FFI_Rets>() == 40);
    assert!(size_of::<XLA_FFI_Attrs>() == 48);
    assert!(offset_of!(XLA_FFI_CallFrame, stage) == 32 && offset_of!(XLA_FFI_CallFrame, args) == 40);
    assert!(offset_of!(XLA_FFI_CallFrame, attrs) == 120 && size_of::<XLA_FFI_CallFrame>() == 176);
    assert!(XLA_FFI_CallFrame_STRUCT_SIZE == 168);
    assert!(size_of::<XLA_FFI_Metadata>() == 48 && XLA_FFI_Metadata_STRUCT_SIZE == 36);
    assert!(size_of::<XLA_FFI_Metadata_Extension>() == 32);
    assert!(size_of::<XLA_FFI_Api>() == 192 && XLA_FFI_Api_STRUCT_SIZE == 192);
};
