//! XLA FFI handlers in safe Rust: the kernel a `#[pyfunction]` runs eagerly, called by XLA inside
//! `jax.jit` (registered with `jax.ffi.register_ffi_target(name, capsule, platform="cpu")`).
//!
//! A handler is a function [`xla_handler!`](crate::xla_handler) turns into the C entry point XLA
//! calls (`XLA_FFI_Handler`, [`crate::xla_ffi`]). Its body gets a [`Call`]: typed views of the
//! operands ([`Call::input`] → [`BufferRef`]) and results ([`Call::output`] → [`BufferMut`]) with
//! the constraint vocabulary of [`TensorRef`](crate::TensorRef)/[`TensorMut`](crate::TensorMut)
//! (element type, [`Rank`](crate::spec::Rank) or extents, device; XLA's buffers are always dense
//! row-major, so C order), and scalar attributes by name ([`Call::attr`]). Refusals are
//! [`FfiError`]s naming the argument; XLA raises them in Python (`jax.errors.JaxRuntimeError`,
//! `INVALID_ARGUMENT: softmax_xla: x: expected float32 2-d cpu tensor, got ...`). Panics are caught
//! and reported the same way (`INTERNAL`).
//!
//! ```
//! use dlbridge::spec::Rank;
//!
//! dlbridge::xla_handler! {
//!     /// `out = a * x + y` for float32 vectors.
//!     pub fn saxpy_xla(call) {
//!         let a: f32 = call.attr("a")?;
//!         let x = call.input::<f32, Rank<1>>(0, "x")?;
//!         let y = call.input::<f32, Rank<1>>(1, "y")?;
//!         let mut out = call.output::<f32, Rank<1>>(0, "out")?;
//!         let (x, y) = (x.as_slice()?, y.as_slice()?);
//!         for ((o, x), y) in out.as_slice_mut()?.iter_mut().zip(x.iter()).zip(y.iter()) {
//!             *o = a * x + y;
//!         }
//!         Ok(())
//!     }
//! }
//! # let _: dlbridge::xla_ffi::XLA_FFI_Handler = saxpy_xla;
//! ```
//!
//! **The call frame is untrusted metadata**, like a DLPack producer's: its size and API version,
//! every count, kind, rank, extent, dtype and pointer are checked before use, and a malformed frame
//! is an error (never a crash). Only what cannot be checked is trusted: that the pointers XLA
//! passes point where the frame says, for the call (the handler's C contract).
//!
//! **Borrow rules.** XLA lends its buffers for the call. An operand aliased to a result
//! (`input_output_aliases`: the result *is* the operand's memory) must not be read as `&[T]` while
//! the result is written as `&mut [T]`: every slice holds a lease of the process's borrow registry
//! ([`crate::borrow`]), shared for reads, exclusive for writes, so the second is refused
//! ([`crate::Error::AlreadyBorrowed`]). An in-place kernel reads and writes its aliased result
//! only (it holds the operand's values when the handler starts).

use std::any::Any;
use std::ffi::{CString, c_void};
use std::fmt;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::borrow::Lease;
use crate::device::{Device, DeviceType};
use crate::dtype::{DataType, Element};
use crate::layout;
use crate::managed::MAX_NDIM;
use crate::spec::{
    AnyShape, Cpu, DeviceSpec, Field, Mismatch, Order, ShapeSpec, Spec, first_failure_of, spec_of,
};
use crate::view::{SliceMut, SliceRef};
use crate::xla_ffi::*;

/// A handler's failure: an XLA FFI error code and message (the handler's name is prefixed when
/// it reaches XLA).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FfiError {
    code: XLA_FFI_Error_Code,
    message: String,
}

impl FfiError {
    /// An error of `code` saying `message`.
    pub fn new(code: XLA_FFI_Error_Code, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    /// `INVALID_ARGUMENT` saying `message`.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(XLA_FFI_Error_Code::INVALID_ARGUMENT, message)
    }

    /// The code.
    pub fn code(&self) -> XLA_FFI_Error_Code {
        self.code
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// This error with `name: ` before its message (the argument it is about).
    pub fn about(mut self, name: &str) -> Self {
        self.message = format!("{name}: {}", self.message);
        self
    }
}

impl fmt::Display for FfiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
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

/// The dlbridge data type of an XLA FFI element type (`None`: no DLPack equivalent, or unknown).
pub fn data_type(t: XLA_FFI_DataType) -> Option<DataType> {
    Some(match t {
        XLA_FFI_DataType::PRED => DataType::BOOL,
        XLA_FFI_DataType::S8 => DataType::INT8,
        XLA_FFI_DataType::S16 => DataType::INT16,
        XLA_FFI_DataType::S32 => DataType::INT32,
        XLA_FFI_DataType::S64 => DataType::INT64,
        XLA_FFI_DataType::U8 => DataType::UINT8,
        XLA_FFI_DataType::U16 => DataType::UINT16,
        XLA_FFI_DataType::U32 => DataType::UINT32,
        XLA_FFI_DataType::U64 => DataType::UINT64,
        XLA_FFI_DataType::F16 => DataType::FLOAT16,
        XLA_FFI_DataType::F32 => DataType::FLOAT32,
        XLA_FFI_DataType::F64 => DataType::FLOAT64,
        XLA_FFI_DataType::BF16 => DataType::BFLOAT16,
        XLA_FFI_DataType::C64 => DataType::COMPLEX64,
        XLA_FFI_DataType::C128 => DataType::COMPLEX128,
        XLA_FFI_DataType::F8E5M2 => DataType::FLOAT8_E5M2,
        XLA_FFI_DataType::F8E3M4 => DataType::FLOAT8_E3M4,
        XLA_FFI_DataType::F8E4M3 => DataType::FLOAT8_E4M3,
        XLA_FFI_DataType::F8E4M3FN => DataType::FLOAT8_E4M3FN,
        XLA_FFI_DataType::F8E4M3B11FNUZ => DataType::FLOAT8_E4M3B11FNUZ,
        XLA_FFI_DataType::F8E5M2FNUZ => DataType::FLOAT8_E5M2FNUZ,
        XLA_FFI_DataType::F8E4M3FNUZ => DataType::FLOAT8_E4M3FNUZ,
        XLA_FFI_DataType::F8E8M0FNU => DataType::FLOAT8_E8M0FNU,
        _ => return None,
    })
}

/// Runs a handler's `body` over the call frame XLA passed (what [`xla_handler!`](crate::xla_handler) expands to), on
/// the CPU platform: checks the frame, answers XLA's metadata query, catches panics, and turns an
/// error into an XLA FFI error whose message starts with `name`.
///
/// # Safety
///
/// `frame` is NULL or points to a call frame XLA made for this call: every non-NULL pointer in it
/// (and in what it points to) points to what the XLA FFI C API says, valid for the call; buffers
/// are not accessed by anything else during the call (XLA's contract with a handler).
pub unsafe fn handle<F>(frame: *mut XLA_FFI_CallFrame, name: &str, body: F) -> *mut XLA_FFI_Error
where
    F: FnOnce(&mut Call<'_>) -> Result<()>,
{
    // SAFETY: the caller's contract.
    unsafe { handle_on(frame, name, Platform::Cpu, body) }
}

/// [`handle`] for a handler registered on the CUDA platform: buffers are CUDA memory of the call's
/// device, and [`Call::stream`] is the stream to queue work on.
///
/// # Safety
///
/// As [`handle`].
pub unsafe fn handle_cuda<F>(frame: *mut XLA_FFI_CallFrame, name: &str, body: F) -> *mut XLA_FFI_Error
where
    F: FnOnce(&mut Call<'_>) -> Result<()>,
{
    // SAFETY: the caller's contract.
    unsafe { handle_on(frame, name, Platform::Cuda, body) }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Platform {
    Cpu,
    Cuda,
}

/// The API table, once its size and version are checked: what can report errors.
#[derive(Clone, Copy)]
struct Api<'a>(&'a XLA_FFI_Api);

/// The end of the API table's fields dlbridge reads, for a table `struct_size` must cover.
const API_NEEDS: usize =
    std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_Error_Destroy) + size_of::<Option<XLA_FFI_Error_Destroy>>();

impl Api<'_> {
    fn error(self, code: XLA_FFI_Error_Code, message: &str) -> *mut XLA_FFI_Error {
        let Some(create) = self.0.XLA_FFI_Error_Create else { return std::ptr::null_mut() };
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

unsafe fn handle_on<F>(
    frame: *mut XLA_FFI_CallFrame,
    name: &str,
    platform: Platform,
    body: F,
) -> *mut XLA_FFI_Error
where
    F: FnOnce(&mut Call<'_>) -> Result<()>,
{
    // Without a usable API table no error can be made: nothing is read or written, and NULL (the
    // only answer left) is returned.
    if frame.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a call frame (the caller's contract); its first field exists in every version.
    let frame_size = unsafe { (*frame).struct_size };
    // SAFETY: as above: `api` lies within every version's frame.
    let api_ptr = unsafe { (*frame).api };
    if api_ptr.is_null() || frame_size < std::mem::offset_of!(XLA_FFI_CallFrame, ctx) {
        return std::ptr::null_mut();
    }
    // SAFETY: a non-NULL API table; its `struct_size` is read first, and fields only below it.
    let api_size = unsafe { (*api_ptr).struct_size };
    if api_size < API_NEEDS {
        return std::ptr::null_mut();
    }
    // SAFETY: as above; the table covers every field Api reads.
    let api = Api(unsafe { &*api_ptr });
    let v = api.0.api_version;
    if v.major_version != XLA_FFI_API_MAJOR {
        return api.error(
            XLA_FFI_Error_Code::FAILED_PRECONDITION,
            &format!(
                "{name}: XLA FFI API {}.{} (this handler implements {XLA_FFI_API_MAJOR}.{XLA_FFI_API_MINOR})",
                v.major_version, v.minor_version
            ),
        );
    }
    if frame_size < XLA_FFI_CallFrame_STRUCT_SIZE {
        return api.error(
            XLA_FFI_Error_Code::INVALID_ARGUMENT,
            &format!(
                "{name}: call frame of {frame_size} bytes (at least {XLA_FFI_CallFrame_STRUCT_SIZE} needed)"
            ),
        );
    }
    // SAFETY: the frame covers every field up to `attrs` (checked), which is all Call reads.
    let frame = unsafe { &*frame };
    if !frame.extension_start.is_null() {
        // SAFETY: an extension chain head (the C API's contract).
        let ext = unsafe { &*frame.extension_start };
        if ext.type_ == XLA_FFI_Extension_Type::METADATA {
            // SAFETY: a metadata extension (its type says so), checked for size before use.
            return unsafe { write_metadata(api, name, frame.extension_start.cast()) };
        }
    }
    if frame.stage != XLA_FFI_ExecutionStage::EXECUTE {
        return api.error(
            XLA_FFI_Error_Code::INVALID_ARGUMENT,
            &format!("{name}: called at execution stage {} (an execute handler)", frame.stage.0),
        );
    }
    let run = || -> Result<()> {
        let mut call = Call::new(frame, api, platform)?;
        body(&mut call)
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(e)) => api.error(e.code, &format!("{name}: {}", e.message)),
        Err(panic) => {
            api.error(XLA_FFI_Error_Code::INTERNAL, &format!("{name}: panicked: {}", panic_message(&*panic)))
        }
    }
}

fn panic_message(p: &(dyn Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Answers XLA's metadata query: the API version this handler was built for, no traits.
///
/// # Safety
///
/// `ext` points to a metadata extension (of at least an extension head's size).
unsafe fn write_metadata(
    api: Api<'_>,
    name: &str,
    ext: *mut XLA_FFI_Metadata_Extension,
) -> *mut XLA_FFI_Error {
    // SAFETY: the head exists (the caller's contract); the rest only once its size says so.
    let size = unsafe { (*ext).extension_base.struct_size };
    if size < XLA_FFI_Metadata_Extension_STRUCT_SIZE {
        return api.error(
            XLA_FFI_Error_Code::INVALID_ARGUMENT,
            &format!("{name}: metadata extension of {size} bytes"),
        );
    }
    // SAFETY: covered by the size just checked.
    let metadata = unsafe { (*ext).metadata };
    if metadata.is_null() {
        return api.error(
            XLA_FFI_Error_Code::INVALID_ARGUMENT,
            &format!("{name}: metadata extension without metadata"),
        );
    }
    // SAFETY: non-NULL metadata; its size is read first.
    let msize = unsafe { (*metadata).struct_size };
    if msize < XLA_FFI_Metadata_STRUCT_SIZE {
        return api
            .error(XLA_FFI_Error_Code::INVALID_ARGUMENT, &format!("{name}: metadata of {msize} bytes"));
    }
    // SAFETY: the fields written lie below XLA_FFI_Metadata_STRUCT_SIZE (checked).
    unsafe {
        (*metadata).api_version = XLA_FFI_Api_Version {
            struct_size: XLA_FFI_Api_Version_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            major_version: XLA_FFI_API_MAJOR,
            minor_version: XLA_FFI_API_MINOR,
        };
        (*metadata).traits = 0;
    }
    std::ptr::null_mut()
}

/// One checked list of the frame (operands or results): its entries and their kinds.
#[derive(Clone, Copy)]
struct List<'a> {
    kinds: &'a [i32],
    items: &'a [*mut c_void],
}

impl<'a> List<'a> {
    /// # Safety
    ///
    /// `types` and `items` point to `size` entries each when `size > 0` (checked for NULL here).
    unsafe fn new(
        what: &str,
        struct_size: usize,
        need: usize,
        size: i64,
        types: *const i32,
        items: *const *mut c_void,
    ) -> Result<Self> {
        if struct_size < need {
            return Err(FfiError::invalid_argument(format!(
                "{what}: struct_size {struct_size} (at least {need} needed)"
            )));
        }
        let n =
            usize::try_from(size).map_err(|_| FfiError::invalid_argument(format!("{what}: size {size}")))?;
        if n == 0 {
            return Ok(Self { kinds: &[], items: &[] });
        }
        if types.is_null() || items.is_null() || !types.is_aligned() || !items.is_aligned() {
            return Err(FfiError::invalid_argument(format!("{what}: {n} entries without (aligned) arrays")));
        }
        // SAFETY: non-NULL, aligned, `n` entries (the caller's contract).
        Ok(unsafe {
            Self { kinds: std::slice::from_raw_parts(types, n), items: std::slice::from_raw_parts(items, n) }
        })
    }
}

/// One call of a handler: the frame, checked.
pub struct Call<'a> {
    api: Api<'a>,
    ctx: *mut XLA_FFI_ExecutionContext,
    args: List<'a>,
    rets: List<'a>,
    attr_kinds: &'a [i32],
    attr_names: &'a [*mut XLA_FFI_ByteSpan],
    attr_values: &'a [*mut c_void],
    device: Device,
}

impl fmt::Debug for Call<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Call")
            .field("args", &self.args.items.len())
            .field("rets", &self.rets.items.len())
            .field("attrs", &self.attr_values.len())
            .field("device", &self.device)
            .finish()
    }
}

impl<'a> Call<'a> {
    fn new(frame: &'a XLA_FFI_CallFrame, api: Api<'a>, platform: Platform) -> Result<Self> {
        let (a, r, t) = (&frame.args, &frame.rets, &frame.attrs);
        // SAFETY: the frame's arrays, `size` entries each (the C contract), NULL checked in List::new.
        let args = unsafe {
            List::new("args", a.struct_size, XLA_FFI_Args_STRUCT_SIZE, a.size, a.types.cast(), a.args)
        }?;
        // SAFETY: as above.
        let rets = unsafe {
            List::new("rets", r.struct_size, XLA_FFI_Rets_STRUCT_SIZE, r.size, r.types.cast(), r.rets)
        }?;
        // SAFETY: as above (values); the names are checked the same way just below.
        let attrs = unsafe {
            List::new("attrs", t.struct_size, XLA_FFI_Attrs_STRUCT_SIZE, t.size, t.types.cast(), t.attrs)
        }?;
        let attr_names: &[*mut XLA_FFI_ByteSpan] = if attrs.items.is_empty() {
            &[]
        } else if t.names.is_null() || !t.names.is_aligned() {
            return Err(FfiError::invalid_argument("attrs: no names"));
        } else {
            // SAFETY: non-NULL, aligned, one name per attribute (the C contract).
            unsafe { std::slice::from_raw_parts(t.names, attrs.items.len()) }
        };
        let mut call = Self {
            api,
            ctx: frame.ctx,
            args,
            rets,
            attr_kinds: attrs.kinds,
            attr_names,
            attr_values: attrs.items,
            device: Device::CPU,
        };
        if platform == Platform::Cuda {
            call.device = Device::new(DeviceType::CUDA, call.device_ordinal()?);
        }
        Ok(call)
    }

    /// The number of operands.
    pub fn num_inputs(&self) -> usize {
        self.args.items.len()
    }

    /// The number of results.
    pub fn num_outputs(&self) -> usize {
        self.rets.items.len()
    }

    /// The device the buffers are on (the platform the handler was registered for).
    pub fn device(&self) -> Device {
        self.device
    }

    /// Operand `index` (named `name` in errors), of any type: dispatch on [`AnyBuffer::dtype`],
    /// then [`AnyBuffer::typed`].
    pub fn input_any(&self, index: usize, name: &'static str) -> Result<AnyBuffer<'a>> {
        self.buffer(self.args, index, name, false)
    }

    /// Result `index` (named `name` in errors), of any type.
    pub fn output_any(&self, index: usize, name: &'static str) -> Result<AnyBuffer<'a>> {
        self.buffer(self.rets, index, name, true)
    }

    /// Operand `index`, checked against `T`, `S` and `D` (`name` in errors).
    pub fn input<T: Element, S: ShapeSpec>(
        &self,
        index: usize,
        name: &'static str,
    ) -> Result<BufferRef<'a, T, S>> {
        self.input_any(index, name)?.typed()
    }

    /// Result `index`, checked against `T` and `S` (`name` in errors), to write.
    pub fn output<T: Element, S: ShapeSpec>(
        &self,
        index: usize,
        name: &'static str,
    ) -> Result<BufferMut<'a, T, S>> {
        self.output_any(index, name)?.typed_mut()
    }

    fn buffer(&self, list: List<'a>, index: usize, name: &'static str, out: bool) -> Result<AnyBuffer<'a>> {
        let what = if out { "result" } else { "operand" };
        let (Some(&kind), Some(&ptr)) = (list.kinds.get(index), list.items.get(index)) else {
            return Err(FfiError::invalid_argument(format!(
                "{name}: no {what} {index} (the call has {})",
                list.items.len()
            )));
        };
        if kind != XLA_FFI_ArgType::BUFFER.0 {
            return Err(FfiError::invalid_argument(format!(
                "{name}: {what} {index} is of kind {kind}, not a buffer"
            )));
        }
        let buf = ptr.cast::<XLA_FFI_Buffer>();
        if buf.is_null() || !buf.is_aligned() {
            return Err(FfiError::invalid_argument(format!(
                "{name}: {what} {index} is a NULL or misaligned buffer"
            )));
        }
        // SAFETY: a buffer (its kind says so): its size field first, the rest once covered.
        let size = unsafe { (*buf).struct_size };
        if size < XLA_FFI_Buffer_STRUCT_SIZE {
            return Err(FfiError::invalid_argument(format!(
                "{name}: buffer struct_size {size} (at least {XLA_FFI_Buffer_STRUCT_SIZE} needed)"
            )));
        }
        // SAFETY: covered by the size just checked.
        let b = unsafe { &*buf };
        let dtype = data_type(b.dtype).ok_or_else(|| {
            FfiError::invalid_argument(format!(
                "{name}: XLA element type {} has no DLPack equivalent",
                b.dtype.0
            ))
        })?;
        let rank = usize::try_from(b.rank).ok().filter(|&r| r <= MAX_NDIM).ok_or_else(|| {
            FfiError::invalid_argument(format!("{name}: rank {} (0..={MAX_NDIM} allowed)", b.rank))
        })?;
        let shape: &'a [i64] = if rank == 0 {
            &[]
        } else if b.dims.is_null() || !b.dims.is_aligned() {
            return Err(FfiError::invalid_argument(format!(
                "{name}: rank {rank} with NULL or misaligned dims"
            )));
        } else {
            // SAFETY: non-NULL, aligned, `rank` extents (the C contract), read-only for the call.
            unsafe { std::slice::from_raw_parts(b.dims, rank) }
        };
        if let Some(&d) = shape.iter().find(|&&d| d < 0) {
            return Err(FfiError::invalid_argument(format!("{name}: negative extent {d} in {shape:?}")));
        }
        let numel = layout::element_count(shape)
            .ok()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| {
                n.checked_mul(dtype.storage_bits(false).div_ceil(8) as usize)
                    .is_some_and(|b| b <= isize::MAX as usize)
            })
            .ok_or_else(|| {
                FfiError::invalid_argument(format!("{name}: extents {shape:?} exceed the address space"))
            })?;
        let data = b.data;
        if numel > 0 {
            let bytes = numel * dtype.storage_bits(false).div_ceil(8) as usize;
            if data.is_null() || (data as usize).checked_add(bytes).is_none() {
                return Err(FfiError::invalid_argument(format!(
                    "{name}: {numel} elements at address {data:p}"
                )));
            }
        }
        Ok(AnyBuffer { name, dtype, data, shape, numel, device: self.device, writable: out })
    }

    /// Scalar or string attribute `name`, decoded as `T` ([`FromAttr`]).
    pub fn attr<T: FromAttr<'a>>(&self, name: &str) -> Result<T> {
        for ((&kind, &n), &value) in self.attr_kinds.iter().zip(self.attr_names).zip(self.attr_values) {
            if n.is_null() || !n.is_aligned() {
                return Err(FfiError::invalid_argument("attrs: a NULL name"));
            }
            // SAFETY: a non-NULL, aligned byte span (the C contract).
            let span = unsafe { &*n };
            let bytes: &[u8] = if span.len == 0 {
                &[]
            } else if span.ptr.is_null() {
                return Err(FfiError::invalid_argument("attrs: a name without bytes"));
            } else {
                // SAFETY: `len` bytes at `ptr` (the C contract).
                unsafe { std::slice::from_raw_parts(span.ptr.cast(), span.len) }
            };
            if bytes == name.as_bytes() {
                let attr = RawAttr { kind: XLA_FFI_AttrType(kind), value, _frame: PhantomData };
                return T::from_attr(attr).map_err(|e| e.about(&format!("attribute {name}")));
            }
        }
        Err(FfiError::invalid_argument(format!(
            "attribute {name}: missing (the call has {})",
            self.attr_names_list()
        )))
    }

    fn attr_names_list(&self) -> String {
        let names: Vec<String> = self
            .attr_names
            .iter()
            .filter(|n| !n.is_null() && n.is_aligned())
            // SAFETY: non-NULL, aligned spans (the C contract); bytes read only when non-NULL.
            .map(|&n| unsafe {
                let s = &*n;
                if s.ptr.is_null() || s.len == 0 {
                    String::new()
                } else {
                    String::from_utf8_lossy(std::slice::from_raw_parts(s.ptr.cast(), s.len)).into_owned()
                }
            })
            .collect();
        if names.is_empty() { "no attributes".into() } else { names.join(", ") }
    }

    /// The platform stream of the call (a `cudaStream_t` for a CUDA handler; NULL on CPU).
    pub fn stream(&self) -> Result<*mut c_void> {
        let f = self
            .api_fn(std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_Stream_Get), self.api.0.XLA_FFI_Stream_Get)?;
        let mut args = XLA_FFI_Stream_Get_Args {
            struct_size: XLA_FFI_Stream_Get_Args_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            ctx: self.ctx,
            stream: std::ptr::null_mut(),
        };
        // SAFETY: XLA's function with the call's context and arguments of the declared size.
        let err = unsafe { f(&mut args) };
        self.check(err, "stream")?;
        Ok(args.stream)
    }

    fn device_ordinal(&self) -> Result<i32> {
        let f = self.api_fn(
            std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_DeviceOrdinal_Get),
            self.api.0.XLA_FFI_DeviceOrdinal_Get,
        )?;
        let mut args = XLA_FFI_DeviceOrdinal_Get_Args {
            struct_size: XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            ctx: self.ctx,
            device_ordinal: 0,
        };
        // SAFETY: as in stream().
        let err = unsafe { f(&mut args) };
        self.check(err, "device ordinal")?;
        Ok(args.device_ordinal)
    }

    fn api_fn<F>(&self, offset: usize, f: Option<F>) -> Result<F> {
        if self.api.0.struct_size < offset + size_of::<usize>() {
            return Err(FfiError::new(XLA_FFI_Error_Code::UNIMPLEMENTED, "the XLA FFI API table is too old"));
        }
        f.ok_or_else(|| {
            FfiError::new(XLA_FFI_Error_Code::UNIMPLEMENTED, "the XLA FFI API table lacks a function")
        })
    }

    /// Turns an error XLA's own function returned into an [`FfiError`] (and frees it).
    fn check(&self, err: *mut XLA_FFI_Error, what: &str) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        let api = self.api.0;
        let mut message = format!("{what}: XLA reported an error");
        if let Some(get) = api.XLA_FFI_Error_GetMessage {
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
        if let Some(destroy) = api.XLA_FFI_Error_Destroy {
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
}

/// An attribute as the frame holds it, for [`FromAttr`].
#[derive(Clone, Copy)]
pub struct RawAttr<'a> {
    kind: XLA_FFI_AttrType,
    value: *mut c_void,
    _frame: PhantomData<&'a XLA_FFI_CallFrame>,
}

impl<'a> RawAttr<'a> {
    /// A scalar attribute's element type and value bytes, checked.
    fn scalar(self, want: XLA_FFI_DataType, rust: &str, bytes: usize) -> Result<&'a [u8]> {
        if self.kind != XLA_FFI_AttrType::SCALAR {
            return Err(FfiError::invalid_argument(format!(
                "expected a {rust} scalar, got attribute kind {}",
                self.kind.0
            )));
        }
        let s = self.value.cast::<XLA_FFI_Scalar>();
        if s.is_null() || !s.is_aligned() {
            return Err(FfiError::invalid_argument("a NULL scalar"));
        }
        // SAFETY: a scalar (its kind says so), non-NULL and aligned.
        let s = unsafe { &*s };
        if s.dtype != want {
            let got = data_type(s.dtype).map_or_else(|| format!("XLA type {}", s.dtype.0), |d| d.to_string());
            return Err(FfiError::invalid_argument(format!(
                "expected a {rust} scalar, got {got} (pass numpy.{rust_np}(value))",
                rust_np = data_type(want).map_or_else(String::new, |d| d.to_string())
            )));
        }
        if s.value.is_null() {
            return Err(FfiError::invalid_argument("a scalar without a value"));
        }
        // SAFETY: a value of the scalar's type: `bytes` bytes (the C contract).
        Ok(unsafe { std::slice::from_raw_parts(s.value.cast::<u8>(), bytes) })
    }
}

/// What an attribute decodes to: `f32`, `f64`, `i32`, `i64`, `bool` (scalars of exactly that type:
/// pass `numpy.float32(a)` from Python), `&str` (a string attribute).
pub trait FromAttr<'a>: Sized {
    /// Decodes `attr`.
    fn from_attr(attr: RawAttr<'a>) -> Result<Self>;
}

macro_rules! scalar_attr {
    ($($t:ty => $x:ident,)*) => {$(
        impl<'a> FromAttr<'a> for $t {
            fn from_attr(attr: RawAttr<'a>) -> Result<Self> {
                let b = attr.scalar(XLA_FFI_DataType::$x, stringify!($t), size_of::<$t>())?;
                Ok(<$t>::from_ne_bytes(b.try_into().expect("size_of bytes")))
            }
        }
    )*};
}
scalar_attr! {
    f32 => F32,
    f64 => F64,
    i32 => S32,
    i64 => S64,
    u32 => U32,
    u64 => U64,
}

impl<'a> FromAttr<'a> for bool {
    fn from_attr(attr: RawAttr<'a>) -> Result<Self> {
        match attr.scalar(XLA_FFI_DataType::PRED, "bool", 1)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(FfiError::invalid_argument(format!("a bool of byte {b}"))),
        }
    }
}

impl<'a> FromAttr<'a> for &'a str {
    fn from_attr(attr: RawAttr<'a>) -> Result<Self> {
        if attr.kind != XLA_FFI_AttrType::STRING {
            return Err(FfiError::invalid_argument(format!(
                "expected a string, got attribute kind {}",
                attr.kind.0
            )));
        }
        let s = attr.value.cast::<XLA_FFI_ByteSpan>();
        if s.is_null() || !s.is_aligned() {
            return Err(FfiError::invalid_argument("a NULL string"));
        }
        // SAFETY: a byte span (its kind says so), non-NULL and aligned.
        let s = unsafe { &*s };
        let bytes: &[u8] = if s.len == 0 {
            &[]
        } else if s.ptr.is_null() {
            return Err(FfiError::invalid_argument("a string without bytes"));
        } else {
            // SAFETY: `len` bytes at `ptr`, alive for the call.
            unsafe { std::slice::from_raw_parts(s.ptr.cast(), s.len) }
        };
        std::str::from_utf8(bytes).map_err(|e| FfiError::invalid_argument(format!("not UTF-8 ({e})")))
    }
}

/// An operand or result of any element type (checked metadata, no access yet).
#[derive(Debug, Clone, Copy)]
pub struct AnyBuffer<'a> {
    name: &'static str,
    dtype: DataType,
    data: *mut c_void,
    shape: &'a [i64],
    numel: usize,
    device: Device,
    writable: bool,
}

impl<'a> AnyBuffer<'a> {
    /// The argument's name (as the handler gave it).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The element type.
    pub fn dtype(&self) -> DataType {
        self.dtype
    }

    /// The extents (the buffer is dense row-major).
    pub fn shape(&self) -> &'a [i64] {
        self.shape
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The first element's address (device memory for a CUDA handler).
    pub fn data_ptr(&self) -> *mut c_void {
        self.data
    }

    fn check(&self, spec: &Spec) -> Result<()> {
        let c = || true;
        let f = || layout::is_f_contiguous(self.shape, &layout::c_strides(self.shape));
        let w = || self.writable;
        match first_failure_of(spec, self.dtype, self.shape, self.device, c, f, w) {
            None => Ok(()),
            Some(field) => Err(self.mismatch(spec, field)),
        }
    }

    #[cold]
    fn mismatch(&self, spec: &Spec, field: Field) -> FfiError {
        let m = Mismatch {
            field,
            expected: *spec,
            dtype: self.dtype,
            shape: self.shape.to_vec(),
            strides: layout::c_strides(self.shape),
            device: self.device,
            read_only: !self.writable,
        };
        FfiError::from(crate::Error::Mismatch(Box::new(m))).about(self.name)
    }

    /// This operand as `T` elements of shape `S` on device `D` (checked here, as a typed
    /// argument is at conversion).
    pub fn typed<T: Element, S: ShapeSpec, D: DeviceSpec>(self) -> Result<BufferRef<'a, T, S, D>> {
        self.check(&spec_of::<T, S, crate::spec::C, D>(false))?;
        Ok(BufferRef { buf: self, _t: PhantomData })
    }

    /// This result as `T` elements of shape `S` on device `D`, to write (operands are refused:
    /// XLA's operands are read-only; alias one to a result to write it in place).
    pub fn typed_mut<T: Element, S: ShapeSpec, D: DeviceSpec>(self) -> Result<BufferMut<'a, T, S, D>> {
        self.check(&spec_of::<T, S, crate::spec::C, D>(true))?;
        Ok(BufferMut { buf: self, _t: PhantomData })
    }

    fn lease(&self, exclusive: bool) -> Result<Lease> {
        if self.numel == 0 || !self.device.is_host_accessible() {
            return Ok(Lease::acquire(0, 0, exclusive)?);
        }
        let lo = self.data as usize;
        let hi = lo + self.numel * self.dtype.storage_bits(false).div_ceil(8) as usize;
        Lease::acquire(lo, hi, exclusive).map_err(FfiError::from)
    }

    fn slice<T: Element>(&self) -> Result<SliceRef<'a, T>> {
        self.host_check::<T>()?;
        let lease = self.lease(false).map_err(|e| e.about(self.name))?;
        if self.numel == 0 {
            return Ok(SliceRef::from_lease(&[], lease));
        }
        // SAFETY: host memory of `numel` elements of T (checked dtype, aligned), alive for the call;
        // nothing writes it through dlbridge while the shared lease lives.
        let bytes =
            unsafe { std::slice::from_raw_parts(self.data.cast::<u8>(), self.numel * size_of::<T>()) };
        if !T::ALL_BIT_PATTERNS_VALID && !T::is_valid_bytes(bytes) {
            return Err(FfiError::invalid_argument(format!("{}: invalid {} values", self.name, T::DTYPE)));
        }
        // SAFETY: as above; valid values of T.
        Ok(SliceRef::from_lease(
            unsafe { std::slice::from_raw_parts(self.data.cast::<T>(), self.numel) },
            lease,
        ))
    }

    fn slice_mut<T: Element>(&mut self) -> Result<SliceMut<'_, T>> {
        self.host_check::<T>()?;
        let lease = self.lease(true).map_err(|e| e.about(self.name))?;
        if self.numel == 0 {
            return Ok(SliceMut::from_lease(&mut [], lease));
        }
        // SAFETY: as in slice(); a result buffer XLA lends to the handler to write, the exclusive
        // lease makes this the only dlbridge access meanwhile (an aliased operand's reads are
        // refused), and `&mut self` the only one through this buffer.
        let bytes =
            unsafe { std::slice::from_raw_parts(self.data.cast::<u8>(), self.numel * size_of::<T>()) };
        if !T::ALL_BIT_PATTERNS_VALID && !T::is_valid_bytes(bytes) {
            // A fresh result buffer holds anything: bool results are zeroed first.
            // SAFETY: as above, writable bytes of the buffer, not borrowed elsewhere (`bytes` ends here).
            unsafe { std::ptr::write_bytes(self.data.cast::<u8>(), 0, self.numel * size_of::<T>()) };
        }
        // SAFETY: as above; valid values of T.
        Ok(SliceMut::from_lease(
            unsafe { std::slice::from_raw_parts_mut(self.data.cast::<T>(), self.numel) },
            lease,
        ))
    }

    fn host_check<T: Element>(&self) -> Result<()> {
        if !self.device.is_host_accessible() {
            return Err(FfiError::invalid_argument(format!(
                "{}: a {} buffer has no host slice",
                self.name, self.device
            )));
        }
        if (self.data as usize) % align_of::<T>() != 0 {
            return Err(FfiError::invalid_argument(format!(
                "{}: data {:p} is not aligned for {}",
                self.name,
                self.data,
                T::DTYPE
            )));
        }
        Ok(())
    }
}

/// The type parameters of a typed view (no data: the view neither owns nor drops a `T`).
type Marker<T, S, D> = PhantomData<(fn() -> T, S, D)>;

/// A typed operand: elements `T`, shape `S` (e.g. [`Rank<2>`](crate::spec::Rank)), device `D`
/// ([`Cpu`] by default), checked when made ([`Call::input`]).
#[derive(Debug, Clone, Copy)]
pub struct BufferRef<'a, T, S = AnyShape, D = Cpu> {
    buf: AnyBuffer<'a>,
    _t: Marker<T, S, D>,
}

/// A typed result to write: elements `T`, shape `S`, device `D` ([`Call::output`]).
#[derive(Debug)]
pub struct BufferMut<'a, T, S = AnyShape, D = Cpu> {
    buf: AnyBuffer<'a>,
    _t: Marker<T, S, D>,
}

macro_rules! common {
    ($ty:ident) => {
        impl<'a, T: Element, S: ShapeSpec, D: DeviceSpec> $ty<'a, T, S, D> {
            /// The extents.
            pub fn shape(&self) -> &'a [i64] {
                self.buf.shape
            }
            /// The number of elements.
            pub fn numel(&self) -> usize {
                self.buf.numel
            }
            /// The argument's name.
            pub fn name(&self) -> &'static str {
                self.buf.name
            }
            /// The first element (device memory for a CUDA handler): for kernels that launch
            /// device code.
            pub fn as_ptr(&self) -> *const T {
                self.buf.data.cast_const().cast()
            }
            /// The elements in row-major order (host memory), holding a shared lease.
            pub fn as_slice(&self) -> Result<SliceRef<'_, T>> {
                self.buf.slice::<T>()
            }
        }
    };
}
common!(BufferRef);
common!(BufferMut);

impl<T: Element, S: ShapeSpec, D: DeviceSpec> BufferMut<'_, T, S, D> {
    /// The elements in row-major order to write (host memory), holding an exclusive lease.
    pub fn as_slice_mut(&mut self) -> Result<SliceMut<'_, T>> {
        self.buf.slice_mut::<T>()
    }

    /// The first element, to write (device memory for a CUDA handler).
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.buf.data.cast()
    }
}

// Keep Order in the vocabulary this module documents (XLA buffers are C order).
const _: Order = Order::C;

/// Turns a body over a [`Call`] into an XLA FFI handler (an `unsafe extern "C" fn` of type
/// [`XLA_FFI_Handler`](crate::xla_ffi::XLA_FFI_Handler)) for the CPU platform, or, with `cuda`
/// before `fn`, for the CUDA platform. See [the module](crate::xla).
///
/// The body is safe code: an unsafe operation in it needs its own `unsafe` block.
///
/// ```compile_fail,E0133
/// unsafe fn dangerous() {}
/// dlbridge::xla_handler! {
///     fn h(call) {
///         let _ = call;
///         dangerous(); // E0133: call to unsafe function requires unsafe block
///         Ok(())
///     }
/// }
/// ```
#[macro_export]
macro_rules! xla_handler {
    ($(#[$m:meta])* $vis:vis fn $name:ident($call:ident) $body:block) => {
        $crate::xla_handler!(@emit handle, $(#[$m])* $vis fn $name($call) $body);
    };
    ($(#[$m:meta])* $vis:vis cuda fn $name:ident($call:ident) $body:block) => {
        $crate::xla_handler!(@emit handle_cuda, $(#[$m])* $vis fn $name($call) $body);
    };
    // One expansion for both platforms: `$handle` is `xla::handle` or `xla::handle_cuda`.
    (@emit $handle:ident, $(#[$m:meta])* $vis:vis fn $name:ident($call:ident) $body:block) => {
        $(#[$m])*
        ///
        /// # Safety
        ///
        /// XLA's handler contract: `frame` is a call frame XLA made for this call.
        $vis unsafe extern "C" fn $name(
            frame: *mut $crate::xla_ffi::XLA_FFI_CallFrame,
        ) -> *mut $crate::xla_ffi::XLA_FFI_Error {
            // The body is a safe fn of its own (not code inside this unsafe fn or an unsafe block):
            // an unsafe call in it needs its own `unsafe` block and SAFETY line.
            fn body($call: &mut $crate::xla::Call<'_>) -> $crate::xla::Result<()> {
                $body
            }
            // SAFETY: the contract above is the caller's (XLA's).
            unsafe { $crate::xla::$handle(frame, stringify!($name), body) }
        }
    };
}
