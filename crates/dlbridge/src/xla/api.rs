//! The XLA FFI API table as far as its `struct_size` reaches ([`Api`], [`api_field!`]) and a
//! handler's error ([`FfiError`]): what the handler layer ([`crate::xla`]) and what a call reaches
//! besides its buffers (its state, scratch memory, the thread pool) share.

use std::any::Any;
use std::ffi::{CString, c_void};
use std::fmt;
use std::marker::PhantomData;

use crate::xla_ffi::*;

/// A handler's failure: an XLA FFI error code and message (the handler's name is prefixed when
/// it reaches XLA). One pointer wide (boxed), so a handler's `Result`s stay small on the path
/// where nothing fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FfiError(Box<ErrorInner>);

#[derive(Debug, Clone, PartialEq, Eq)]
struct ErrorInner {
    code: XLA_FFI_Error_Code,
    message: String,
}

impl FfiError {
    /// An error of `code` saying `message`.
    #[cold]
    pub fn new(code: XLA_FFI_Error_Code, message: impl Into<String>) -> Self {
        Self(Box::new(ErrorInner { code, message: message.into() }))
    }

    /// `INVALID_ARGUMENT` saying `message`.
    #[cold]
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(XLA_FFI_Error_Code::INVALID_ARGUMENT, message)
    }

    /// The code.
    pub fn code(&self) -> XLA_FFI_Error_Code {
        self.0.code
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// This error with `name: ` before its message (the argument it is about).
    pub fn about(mut self, name: &str) -> Self {
        self.0.message = format!("{name}: {}", self.0.message);
        self
    }
}

impl fmt::Display for FfiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.message)
    }
}

impl std::error::Error for FfiError {}

impl From<crate::Error> for FfiError {
    fn from(e: crate::Error) -> Self {
        let code = match e {
            crate::Error::AlreadyBorrowed { .. } => XLA_FFI_Error_Code::FAILED_PRECONDITION,
            _ => XLA_FFI_Error_Code::INVALID_ARGUMENT,
        };
        Self::new(code, e.to_string())
    }
}

/// The result of a handler's body.
pub type Result<T, E = FfiError> = std::result::Result<T, E>;

/// The API table, as far as its `struct_size` reaches. No reference to an `XLA_FFI_Api` is ever
/// made: a table of an older XLA is smaller than the struct, so each field is read through the raw
/// pointer once `size` covers it ([`api_field!`]). A table that does not reach every function
/// dlbridge may call to make or free an error (or a NULL one) is kept as size 0: nothing in it is
/// read, and no error can be made.
#[derive(Clone, Copy)]
pub(super) struct Api<'a> {
    pub(super) table: *const XLA_FFI_Api,
    pub(super) size: usize,
    _frame: PhantomData<&'a XLA_FFI_CallFrame>,
}

/// The end of the API table's fields an error needs (made, read, freed): a table reaching less is
/// unusable.
const API_NEEDS: usize =
    std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_Error_Destroy) + size_of::<Option<XLA_FFI_Error_Destroy>>();

/// Field `$field` of the API table `$api` (an `Option` of a function pointer), or `None` when
/// the table's size does not cover it.
macro_rules! api_field {
    ($api:expr, $field:ident) => {{
        let api: Api<'_> = $api;
        if api.size >= std::mem::offset_of!(XLA_FFI_Api, $field) + size_of::<*const c_void>() {
            // SAFETY: a non-NULL, aligned table of `size` bytes (Api::new), which cover the field;
            // read through the raw pointer, no reference to the whole struct made.
            unsafe { (&raw const (*api.table).$field).read() }
        } else {
            None
        }
    }};
}

// Every field read by api_field! is one pointer wide.
const _: () = {
    assert!(size_of::<Option<XLA_FFI_Error_Create>>() == size_of::<*const c_void>());
    assert!(size_of::<Option<XLA_FFI_Stream_Get>>() == size_of::<*const c_void>());
    assert!(size_of::<Option<XLA_FFI_DeviceOrdinal_Get>>() == size_of::<*const c_void>());
};

impl Api<'_> {
    /// Turns an error XLA's own function returned into an [`FfiError`] (and frees it).
    pub(super) fn check(self, err: *mut XLA_FFI_Error, what: &str) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        let mut message = format!("{what}: XLA reported an error");
        if let Some(get) = api_field!(self, XLA_FFI_Error_GetMessage) {
            let mut args = XLA_FFI_Error_GetMessage_Args {
                struct_size: XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                error: err,
                message: std::ptr::null(),
            };
            // SAFETY: XLA's function and XLA's error.
            unsafe { get(&mut args) };
            if !args.message.is_null() {
                // SAFETY: a NUL-terminated message owned by the error, read before it is freed.
                let m = unsafe { std::ffi::CStr::from_ptr(args.message) };
                message = format!("{what}: {}", m.to_string_lossy());
            }
        }
        if let Some(destroy) = api_field!(self, XLA_FFI_Error_Destroy) {
            let mut args = XLA_FFI_Error_Destroy_Args {
                struct_size: XLA_FFI_Error_Destroy_Args_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                error: err,
            };
            // SAFETY: XLA's function and XLA's error, freed once.
            unsafe { destroy(&mut args) };
        }
        Err(FfiError::new(XLA_FFI_Error_Code::INTERNAL, message))
    }

    /// No table: nothing can be read or reported.
    pub(super) const NONE: Self = Self { table: std::ptr::null(), size: 0, _frame: PhantomData };

    /// # Safety
    ///
    /// `table` is NULL or points to an API table of at least the `struct_size` bytes it declares.
    #[inline]
    pub(super) unsafe fn new(table: *const XLA_FFI_Api) -> Self {
        if table.is_null() || !table.is_aligned() {
            return Self::NONE;
        }
        // SAFETY: a non-NULL, aligned table; its first field exists in every version.
        let size = unsafe { (&raw const (*table).struct_size).read() };
        if size < API_NEEDS { Self::NONE } else { Self { table, size, _frame: PhantomData } }
    }

    /// The API version XLA implements (`None`: no usable table).
    #[inline]
    pub(super) fn major_version(self) -> Option<(i32, i32)> {
        if self.size == 0 {
            return None;
        }
        // SAFETY: `api_version` lies below API_NEEDS, which a usable table covers.
        let v = unsafe { (&raw const (*self.table).api_version).read() };
        Some((v.major_version, v.minor_version))
    }

    #[cold]
    #[inline(never)]
    pub(super) fn error(self, code: XLA_FFI_Error_Code, message: &str) -> *mut XLA_FFI_Error {
        let Some(create) = api_field!(self, XLA_FFI_Error_Create) else { return std::ptr::null_mut() };
        let message = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
        let mut args = XLA_FFI_Error_Create_Args {
            struct_size: XLA_FFI_Error_Create_Args_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            message: message.as_ptr(),
            errc: code,
        };
        // SAFETY: XLA's function, with arguments of the declared size; it copies the message.
        unsafe { create(&mut args) }
    }
}

/// The message a panic carried (its `&str` or `String` payload), for the error a caller gets.
pub(crate) fn panic_message(p: &(dyn Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Drops a caught panic's payload without unwinding: a payload whose `Drop` panics in turn has
/// that panic's payload dropped the same way (a few times over; past that it is leaked, never
/// dropped), so nothing unwinds from here.
pub(crate) fn drop_payload(mut p: Box<dyn Any + Send>) {
    for _ in 0..4 {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(p))) {
            Ok(()) => return,
            Err(again) => p = again,
        }
    }
    std::mem::forget(p);
}
