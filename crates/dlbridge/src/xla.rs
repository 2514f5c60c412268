//! XLA FFI handlers in safe Rust: the kernel a `#[pyfunction]` runs eagerly, called by XLA inside
//! `jax.jit` (registered with `jax.ffi.register_ffi_target(name, capsule, platform="cpu")`).
//!
//! A handler is a function [`xla_handler!`](crate::xla_handler) turns into the C entry point XLA
//! calls (`XLA_FFI_Handler`, [`crate::xla_ffi`]). Its body gets a [`Call`]: typed views of the
//! operands ([`Call::input`] → [`BufferRef`]) and results ([`Call::output`] → [`BufferMut`]) with
//! the constraint vocabulary of [`TensorRef`](crate::TensorRef)/[`TensorMut`](crate::TensorMut)
//! (element type, [`Rank`](crate::spec::Rank) or extents, device; XLA's buffers are always dense
//! row-major, so C order), and scalar attributes by name ([`Call::attr`]). The handler declares
//! how many operands and results it reads and the names of its attributes ([`Signature`]); a call
//! that passes others is refused before the body runs, as XLA's C++ binding refuses it. Refusals are
//! [`FfiError`]s naming the argument; XLA raises them in Python (`jax.errors.JaxRuntimeError`,
//! `INVALID_ARGUMENT: softmax_xla: x: expected float32 2-d cpu tensor, got ...`). Panics are caught
//! and reported the same way (`INTERNAL`).
//!
//! ```
//! use dlbridge::spec::Rank;
//!
//! dlbridge::xla_handler! {
//!     /// `out = a * x + y` for float32 vectors.
//!     pub fn saxpy_xla(call, operands: 2, results: 1, attrs: ["a"]) {
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
//! is an error (never a crash). The frame and the API table are read field by field through raw
//! pointers, each once the `struct_size` its producer declared covers it (an older XLA's structs
//! are shorter than this crate's), never as a reference to the whole struct. Only what cannot be checked is trusted: that the pointers XLA
//! passes point where the frame says, for the call (the handler's C contract).
//!
//! **Beyond buffers.** A handler reaches what XLA lends through its API table: a state made
//! once per compiled executable at XLA's instantiate stage ([`Call::state`], declared
//! `state: Type = init` in [`xla_handler!`](crate::xla_handler)), scratch memory for the call
//! ([`Call::scratch`]; [`Call::device_scratch`] from XLA's allocator for a CUDA handler), and
//! XLA's intra-op thread pool ([`Call::thread_pool`], a loop that returns once every item has
//! finished, on the calling thread alone where XLA lends no pool). A table too short for a
//! function, or one that fails, is an error (or the serial loop), never a read past its size.
//!
//! **Borrow rules.** XLA lends its buffers for the call. An operand aliased to a result
//! (`input_output_aliases`: the result *is* the operand's memory) must not be read as `&[T]` while
//! the result is written as `&mut [T]`: every slice holds a lease of the process's borrow registry
//! ([`crate::borrow`]), shared for reads, exclusive for writes, so the second is refused
//! ([`crate::Error::AlreadyBorrowed`]). An in-place kernel reads and writes its aliased result
//! only (it holds the operand's values when the handler starts).

use std::any::Any;
use std::ffi::c_void;
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

// The API table and the error type, shared by the handler layer and what a call reaches beyond
// its buffers (a state, scratch memory, the thread pool).
#[macro_use]
mod api;
mod pool;
mod scratch;
mod state;

use api::Api;
#[cfg(feature = "python")]
pub(crate) use api::drop_payload;
pub(crate) use api::panic_message;
pub use api::{FfiError, Result};
pub use pool::ThreadPool;
pub use state::StateDecl;

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

/// What a handler reads, declared in [`xla_handler!`](crate::xla_handler) and checked against
/// every call frame before the body runs, as XLA's C++ binding checks its bound signature: the
/// number of operands, the number of results, and the names of the attributes. A call with more
/// (or fewer) operands or results, or with an attribute the handler does not read (or without one
/// it reads), is refused with an error naming what differs, so no result is ever left unwritten
/// because the caller of `jax.ffi.ffi_call` passed more than the body takes.
///
/// A handler with optional operands or lists of operands declares each tensor parameter
/// ([`Signature::with_operands`], [`Operand`]): the call then passes, for each optional or list
/// parameter `p`, an int64 scalar attribute `p.count` (0 or 1 for an optional, the length of a
/// list) that says how many of the flat operands are `p`'s; the counts are checked against the
/// operands before the body runs, and the body reads operands by parameter
/// ([`Call::input`], [`Call::optional_input`], [`Call::input_list`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signature {
    operands: usize,
    results: usize,
    attrs: &'static [&'static str],
    state: Option<StateDecl>,
    /// The tensor parameters, when one is optional or a list (empty: `operands` plain tensors).
    params: &'static [Operand],
}

/// A tensor parameter of a handler ([`Signature::with_operands`]): one operand, an optional one
/// (`Tensor?`: passed or not), or a list of operands (`Tensor[]`), each named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// One operand.
    Tensor(&'static str),
    /// Zero or one operand (its `<name>.count` attribute says which).
    Optional(&'static str),
    /// Any number of operands (its `<name>.count` attribute says how many).
    List(&'static str),
}

impl Operand {
    /// One operand named `name`.
    pub const fn tensor(name: &'static str) -> Self {
        Self::Tensor(name)
    }

    /// An optional operand named `name`.
    pub const fn optional(name: &'static str) -> Self {
        Self::Optional(name)
    }

    /// A list of operands named `name`.
    pub const fn list(name: &'static str) -> Self {
        Self::List(name)
    }

    /// The parameter's name.
    pub const fn name(&self) -> &'static str {
        match *self {
            Self::Tensor(n) | Self::Optional(n) | Self::List(n) => n,
        }
    }

    /// Whether the call says how many operands the parameter has (an optional or a list).
    pub const fn is_counted(&self) -> bool {
        !matches!(self, Self::Tensor(_))
    }
}

/// The suffix of a counted parameter's count attribute (`bias.count`).
pub const COUNT_SUFFIX: &str = ".count";

/// Whether `attr` is `param` followed by [`COUNT_SUFFIX`] (no allocation).
#[inline]
fn is_count_of(attr: &[u8], param: &str) -> bool {
    let (p, s) = (param.as_bytes(), COUNT_SUFFIX.as_bytes());
    attr.len() == p.len() + s.len() && attr.starts_with(p) && attr.ends_with(s)
}

impl Signature {
    /// `operands` operands, `results` results, the attributes named `attrs` (in any order; each
    /// name once: a repeated name fails to compile when this is evaluated in a `const`, as
    /// [`xla_handler!`](crate::xla_handler) does).
    ///
    /// ```compile_fail,E0080
    /// const S: dlbridge::xla::Signature = dlbridge::xla::Signature::new(1, 1, &["eps", "eps"]);
    /// ```
    pub const fn new(operands: usize, results: usize, attrs: &'static [&'static str]) -> Self {
        let mut i = 0;
        while i < attrs.len() {
            let mut j = i + 1;
            while j < attrs.len() {
                assert!(!bytes_eq(attrs[i].as_bytes(), attrs[j].as_bytes()), "an attribute named twice");
                j += 1;
            }
            i += 1;
        }
        Self { operands, results, attrs, state: None, params: &[] }
    }

    /// This signature with a state, made once when XLA instantiates the handler
    /// ([`Call::state`]).
    pub const fn with_state(mut self, state: StateDecl) -> Self {
        self.state = Some(state);
        self
    }

    /// The state the handler declares, if any.
    pub const fn state(&self) -> Option<StateDecl> {
        self.state
    }

    /// A handler whose tensor parameters are `params`, in order (optional ones and lists among
    /// them), with `results` results and the attributes named `attrs` (the count attributes of
    /// the optional and list parameters come on top, implicitly). Names are distinct, and no
    /// attribute is named like a count (`<parameter>.count`): both fail to compile in a `const`.
    ///
    /// ```compile_fail,E0080
    /// use dlbridge::xla::{Operand, Signature};
    /// const S: Signature = Signature::with_operands(&[Operand::tensor("x"), Operand::list("x")], 1, &[]);
    /// ```
    pub const fn with_operands(
        params: &'static [Operand],
        results: usize,
        attrs: &'static [&'static str],
    ) -> Self {
        let s = Self::new(params.len(), results, attrs);
        let mut i = 0;
        while i < params.len() {
            let mut j = i + 1;
            while j < params.len() {
                assert!(
                    !bytes_eq(params[i].name().as_bytes(), params[j].name().as_bytes()),
                    "a parameter named twice"
                );
                j += 1;
            }
            let mut k = 0;
            while k < attrs.len() {
                let (a, p, x) = (attrs[k].as_bytes(), params[i].name().as_bytes(), COUNT_SUFFIX.as_bytes());
                assert!(
                    !(a.len() == p.len() + x.len() && starts_with(a, p, 0) && starts_with(a, x, p.len())),
                    "an attribute named like a count attribute"
                );
                k += 1;
            }
            i += 1;
        }
        Self { params, ..s }
    }

    /// The tensor parameters, when declared with [`with_operands`](Self::with_operands) (else
    /// empty: [`operands`](Self::operands) plain tensors).
    pub const fn params(&self) -> &'static [Operand] {
        self.params
    }

    /// The number of operands (of tensor parameters, for [`with_operands`](Self::with_operands)).
    pub const fn operands(&self) -> usize {
        self.operands
    }

    /// The number of results.
    pub const fn results(&self) -> usize {
        self.results
    }

    /// The attributes' names.
    pub const fn attrs(&self) -> &'static [&'static str] {
        self.attrs
    }
}

/// Whether `a[at..]` starts with `b`.
const fn starts_with(a: &[u8], b: &[u8], at: usize) -> bool {
    if a.len() < at + b.len() {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if a[at + i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

const fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Runs a handler's `body` over the call frame XLA passed (what [`xla_handler!`](crate::xla_handler) expands to), on
/// the CPU platform: checks the frame and `signature`, answers XLA's metadata query, catches
/// panics, and turns an error into an XLA FFI error whose message starts with `name`.
///
/// # Safety
///
/// `frame` is NULL or points to a call frame XLA made for this call: every non-NULL pointer in it
/// (and in what it points to) points to what the XLA FFI C API says, valid for the call, for at
/// least the `struct_size` bytes it declares; buffers are not accessed by anything else during the
/// call (XLA's contract with a handler).
pub unsafe fn handle<F>(
    frame: *mut XLA_FFI_CallFrame,
    name: &str,
    signature: &Signature,
    body: F,
) -> *mut XLA_FFI_Error
where
    F: FnOnce(&mut Call<'_>) -> Result<()>,
{
    // SAFETY: the caller's contract.
    unsafe { handle_on(frame, name, Platform::Cpu, signature, body) }
}

/// [`handle`] for a handler registered on the CUDA platform: buffers are CUDA memory of the call's
/// device, and [`Call::stream`] is the stream to queue work on.
///
/// # Safety
///
/// As [`handle`].
pub unsafe fn handle_cuda<F>(
    frame: *mut XLA_FFI_CallFrame,
    name: &str,
    signature: &Signature,
    body: F,
) -> *mut XLA_FFI_Error
where
    F: FnOnce(&mut Call<'_>) -> Result<()>,
{
    // SAFETY: the caller's contract.
    unsafe { handle_on(frame, name, Platform::Cuda, signature, body) }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Platform {
    Cpu,
    Cuda,
}

/// The end of the frame's `$field`: the frame's `struct_size` must reach it before it is read.
macro_rules! frame_end {
    ($field:ident) => {
        std::mem::offset_of!(XLA_FFI_CallFrame, $field) + size_of::<*const c_void>()
    };
}

/// How many extensions of a frame's chain are looked at for the metadata query (the chain is
/// untrusted: a cycle must not hang the handler).
const MAX_EXTENSIONS: usize = 16;

#[inline(always)]
unsafe fn handle_on<F>(
    frame: *mut XLA_FFI_CallFrame,
    name: &str,
    platform: Platform,
    signature: &Signature,
    body: F,
) -> *mut XLA_FFI_Error
where
    F: FnOnce(&mut Call<'_>) -> Result<()>,
{
    // Every field is read through the raw pointer once the frame's `struct_size` covers it: a
    // frame of an older XLA is smaller than the struct, so no reference to the whole frame is made.
    if frame.is_null() || !frame.is_aligned() {
        return std::ptr::null_mut();
    }
    // SAFETY: a call frame (the caller's contract); its first field exists in every version.
    let frame_size = unsafe { (&raw const (*frame).struct_size).read() };
    let api = if frame_size >= frame_end!(api) {
        // SAFETY: covered by the frame's size; the table is the caller's contract.
        unsafe { Api::new((&raw const (*frame).api).read()) }
    } else {
        Api::NONE
    };
    if frame_size >= frame_end!(extension_start) {
        // SAFETY: covered by the frame's size.
        let ext = unsafe { (&raw const (*frame).extension_start).read() };
        if !ext.is_null() {
            // The metadata query: answered without the API table (some XLA builds send none);
            // only its errors need one.
            // SAFETY: an extension chain (the C API's contract).
            if let Some(answer) = unsafe { metadata_query(api, name, ext, signature.state.is_some()) } {
                return answer;
            }
        }
    }
    // Without a usable API table no error can be made: nothing is read or written, and NULL (the
    // only answer left) is returned.
    let Some((major, minor)) = api.major_version() else { return std::ptr::null_mut() };
    if major != XLA_FFI_API_MAJOR {
        return refuse(api, name, FrameFault::Version(major, minor));
    }
    if frame_size < XLA_FFI_CallFrame_STRUCT_SIZE {
        return refuse(api, name, FrameFault::Size(frame_size));
    }
    // SAFETY: covered by the frame's size (checked just above).
    let stage = unsafe { (&raw const (*frame).stage).read() };
    if stage == XLA_FFI_ExecutionStage::INSTANTIATE {
        // SAFETY: covered by the frame's size (checked above).
        let ctx = unsafe { (&raw const (*frame).ctx).read() };
        return match catch_unwind(AssertUnwindSafe(|| state::instantiate(api, ctx, signature.state))) {
            Ok(Ok(())) => std::ptr::null_mut(),
            Ok(Err(e)) => refuse(api, name, FrameFault::Body(e)),
            Err(panic) => refuse(api, name, FrameFault::Panic(panic)),
        };
    }
    if stage != XLA_FFI_ExecutionStage::EXECUTE {
        return refuse(api, name, FrameFault::Stage(stage.0));
    }
    let run = || -> Result<()> {
        // SAFETY: the frame covers XLA_FFI_CallFrame_STRUCT_SIZE bytes (checked), the rest is the
        // caller's contract.
        let mut call = unsafe { Call::new(frame, api, platform, signature) }?;
        body(&mut call)
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(e)) => refuse(api, name, FrameFault::Body(e)),
        Err(panic) => refuse(api, name, FrameFault::Panic(panic)),
    }
}

/// Why a call was refused before (or by) its body, made into XLA's error off the hot path.
enum FrameFault {
    Version(i32, i32),
    Size(usize),
    Stage(i32),
    Body(FfiError),
    Panic(Box<dyn Any + Send>),
}

#[cold]
#[inline(never)]
fn refuse(api: Api<'_>, name: &str, fault: FrameFault) -> *mut XLA_FFI_Error {
    let (code, message) = match fault {
        FrameFault::Version(major, minor) => (
            XLA_FFI_Error_Code::FAILED_PRECONDITION,
            format!(
                "XLA FFI API {major}.{minor} (this handler implements {XLA_FFI_API_MAJOR}.{XLA_FFI_API_MINOR})"
            ),
        ),
        FrameFault::Size(size) => (
            XLA_FFI_Error_Code::INVALID_ARGUMENT,
            format!("call frame of {size} bytes (at least {XLA_FFI_CallFrame_STRUCT_SIZE} needed)"),
        ),
        FrameFault::Stage(stage) => (
            XLA_FFI_Error_Code::INVALID_ARGUMENT,
            format!("called at execution stage {stage} (a handler runs at instantiate and execute)"),
        ),
        FrameFault::Body(e) => (e.code(), e.message().to_owned()),
        FrameFault::Panic(panic) => {
            let message = format!("panicked: {}", panic_message(&*panic));
            // Never unwinds into XLA (an abort): a payload whose Drop panics too.
            api::drop_payload(panic);
            (XLA_FFI_Error_Code::INTERNAL, message)
        }
    };
    api.error(code, &format!("{name}: {message}"))
}

/// Looks for the metadata extension in the frame's extension chain and answers it: `None` when
/// there is none (a call to run), else what the handler returns.
///
/// # Safety
///
/// `ext` is the non-NULL head of an extension chain (each link of at least the size it declares).
#[cold]
#[inline(never)]
unsafe fn metadata_query(
    api: Api<'_>,
    name: &str,
    mut ext: *mut XLA_FFI_Extension_Base,
    stateful: bool,
) -> Option<*mut XLA_FFI_Error> {
    for _ in 0..MAX_EXTENSIONS {
        if ext.is_null() {
            return None;
        }
        if !ext.is_aligned() {
            return Some(
                api.error(XLA_FFI_Error_Code::INVALID_ARGUMENT, &format!("{name}: a misaligned extension")),
            );
        }
        // SAFETY: an extension (the caller's contract); its size is read first, the rest once covered.
        let size = unsafe { (&raw const (*ext).struct_size).read() };
        if size < XLA_FFI_Extension_Base_STRUCT_SIZE {
            return Some(api.error(
                XLA_FFI_Error_Code::INVALID_ARGUMENT,
                &format!("{name}: an extension of {size} bytes"),
            ));
        }
        // SAFETY: covered by the size just checked.
        let (kind, next) = unsafe { ((&raw const (*ext).type_).read(), (&raw const (*ext).next).read()) };
        if kind == XLA_FFI_Extension_Type::METADATA {
            // SAFETY: a metadata extension (its type says so), checked for size before use.
            let answer = unsafe { write_metadata(api, name, ext.cast()) };
            if answer.is_null() {
                // SAFETY: the rest of the same chain.
                unsafe { answer_stages_query(next, stateful) };
            }
            return Some(answer);
        }
        ext = next;
    }
    Some(api.error(
        XLA_FFI_Error_Code::INVALID_ARGUMENT,
        &format!("{name}: more than {MAX_EXTENSIONS} extensions in the call frame"),
    ))
}

/// Answers XLA's metadata query: the API version this handler was built for, no traits. `api`
/// only reports errors (a NULL table: the query is answered all the same, its errors are NULL).
///
/// # Safety
///
/// `ext` points to a metadata extension (of at least an extension head's size, checked).
unsafe fn write_metadata(
    api: Api<'_>,
    name: &str,
    ext: *mut XLA_FFI_Metadata_Extension,
) -> *mut XLA_FFI_Error {
    // SAFETY: the head exists (the caller's contract); the rest only once its size says so.
    let size = unsafe { (&raw const (*ext).extension_base.struct_size).read() };
    if size < XLA_FFI_Metadata_Extension_STRUCT_SIZE {
        return api.error(
            XLA_FFI_Error_Code::INVALID_ARGUMENT,
            &format!("{name}: metadata extension of {size} bytes"),
        );
    }
    // SAFETY: covered by the size just checked.
    let metadata = unsafe { (&raw const (*ext).metadata).read() };
    if metadata.is_null() || !metadata.is_aligned() {
        return api.error(
            XLA_FFI_Error_Code::INVALID_ARGUMENT,
            &format!("{name}: metadata extension without (aligned) metadata"),
        );
    }
    // SAFETY: non-NULL, aligned metadata; its size is read first.
    let msize = unsafe { (&raw const (*metadata).struct_size).read() };
    if msize < XLA_FFI_Metadata_STRUCT_SIZE {
        return api
            .error(XLA_FFI_Error_Code::INVALID_ARGUMENT, &format!("{name}: metadata of {msize} bytes"));
    }
    // SAFETY: the fields written lie below XLA_FFI_Metadata_STRUCT_SIZE (checked), written through
    // the raw pointer (the struct may end before `state_type_id`).
    unsafe {
        (&raw mut (*metadata).api_version).write(XLA_FFI_Api_Version {
            struct_size: XLA_FFI_Api_Version_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            major_version: XLA_FFI_API_MAJOR,
            minor_version: XLA_FFI_API_MINOR,
        });
        (&raw mut (*metadata).traits).write(0);
    }
    std::ptr::null_mut()
}

/// dlbridge's own extension type, chained after the metadata extension of a metadata query by
/// [`needs_instantiate`] only (XLA never sends it; a handler that does not know it skips it, as
/// every unknown extension).
const STAGES_QUERY: XLA_FFI_Extension_Type = XLA_FFI_Extension_Type(0x646c_6273);
/// The stages query's mark (a chain link of another origin that happens to use the same type
/// number is not answered).
const STAGES_MAGIC: u64 = 0x646c_6272_6964_6765;

/// dlbridge's stages query: which stages a handler runs.
#[repr(C)]
struct StagesQuery {
    base: XLA_FFI_Extension_Base,
    magic: u64,
    /// Out: 1 when the handler makes a state at the instantiate stage.
    instantiate: u8,
}

/// Answers the stages query if it follows in the chain `ext`.
///
/// # Safety
///
/// `ext` is NULL or a link of an extension chain (each link of at least the size it declares).
unsafe fn answer_stages_query(mut ext: *mut XLA_FFI_Extension_Base, stateful: bool) {
    for _ in 0..MAX_EXTENSIONS {
        if ext.is_null() || !ext.is_aligned() {
            return;
        }
        // SAFETY: an extension (the caller's contract); its size is read first.
        let size = unsafe { (&raw const (*ext).struct_size).read() };
        if size < XLA_FFI_Extension_Base_STRUCT_SIZE {
            return;
        }
        // SAFETY: covered by the size just checked.
        let (kind, next) = unsafe { ((&raw const (*ext).type_).read(), (&raw const (*ext).next).read()) };
        if kind == STAGES_QUERY && size >= size_of::<StagesQuery>() {
            let q = ext.cast::<StagesQuery>();
            // SAFETY: a link of at least a StagesQuery's size (checked), aligned as its head.
            if q.is_aligned() && unsafe { (&raw const (*q).magic).read() } == STAGES_MAGIC {
                // SAFETY: as above.
                unsafe { (&raw mut (*q).instantiate).write(u8::from(stateful)) };
            }
            return;
        }
        ext = next;
    }
}

/// Whether `handler` must also be registered for XLA's instantiate stage: a handler of
/// [`xla_handler!`](crate::xla_handler) that declares a `state` (made there, [`Call::state`]).
/// `jax.ffi.register_ffi_target(name, {"instantiate": capsule, "execute": capsule})` registers
/// both stages with the one function; `dlbridge.kernels` (add_kernel) does it for such handlers.
/// `false` for any other handler (another origin's too: it answers only XLA's part of the query).
///
/// # Safety
///
/// `handler` is an XLA FFI handler: it answers XLA's metadata query (the call frame XLA sends
/// at registration, with no API table), as every handler XLA registers must.
pub unsafe fn needs_instantiate(handler: XLA_FFI_Handler) -> bool {
    let mut stages = StagesQuery {
        base: XLA_FFI_Extension_Base {
            struct_size: size_of::<StagesQuery>(),
            type_: STAGES_QUERY,
            next: std::ptr::null_mut(),
        },
        magic: STAGES_MAGIC,
        instantiate: 0,
    };
    // XLA's own query: metadata of XLA_FFI_Metadata_STRUCT_SIZE bytes, no API table, no context.
    let mut metadata = XLA_FFI_Metadata {
        struct_size: XLA_FFI_Metadata_STRUCT_SIZE,
        api_version: XLA_FFI_Api_Version {
            struct_size: XLA_FFI_Api_Version_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            major_version: 0,
            minor_version: 0,
        },
        traits: 0,
        state_type_id: XLA_FFI_TypeId { type_id: 0 },
    };
    let mut ext = XLA_FFI_Metadata_Extension {
        extension_base: XLA_FFI_Extension_Base {
            struct_size: XLA_FFI_Metadata_Extension_STRUCT_SIZE,
            type_: XLA_FFI_Extension_Type::METADATA,
            next: (&raw mut stages).cast(),
        },
        metadata: &raw mut metadata,
    };
    let mut frame = XLA_FFI_CallFrame {
        struct_size: XLA_FFI_CallFrame_STRUCT_SIZE,
        extension_start: (&raw mut ext).cast(),
        api: std::ptr::null(),
        ctx: std::ptr::null_mut(),
        stage: XLA_FFI_ExecutionStage::EXECUTE,
        args: XLA_FFI_Args {
            struct_size: XLA_FFI_Args_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            size: 0,
            types: std::ptr::null_mut(),
            args: std::ptr::null_mut(),
        },
        rets: XLA_FFI_Rets {
            struct_size: XLA_FFI_Rets_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            size: 0,
            types: std::ptr::null_mut(),
            rets: std::ptr::null_mut(),
        },
        attrs: XLA_FFI_Attrs {
            struct_size: XLA_FFI_Attrs_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            size: 0,
            types: std::ptr::null_mut(),
            names: std::ptr::null_mut(),
            attrs: std::ptr::null_mut(),
        },
        future: std::ptr::null_mut(),
    };
    // SAFETY: the caller's contract: XLA's metadata query, which every handler answers; the
    // stages link after it is skipped by a handler that does not know it. An error (which no
    // API table can free) is left alone.
    let err = unsafe { handler(&mut frame) };
    err.is_null() && stages.instantiate == 1
}

/// One checked list of the frame (operands, results or attributes): its entries and their kinds,
/// `len` each. Two pointers and one length rather than two slices: a smaller [`Call`] is moved
/// without a `memcpy` call.
#[derive(Clone, Copy)]
struct List<'a> {
    kinds: std::ptr::NonNull<i32>,
    items: std::ptr::NonNull<*mut c_void>,
    len: usize,
    _frame: std::marker::PhantomData<&'a ()>,
}

impl<'a> List<'a> {
    const EMPTY: Self = Self {
        kinds: std::ptr::NonNull::dangling(),
        items: std::ptr::NonNull::dangling(),
        len: 0,
        _frame: std::marker::PhantomData,
    };

    /// The kinds, `len` of them.
    #[inline(always)]
    fn kinds(&self) -> &'a [i32] {
        // SAFETY: `len` aligned entries alive for 'a (checked in `new`), or dangling and empty.
        unsafe { std::slice::from_raw_parts(self.kinds.as_ptr(), self.len) }
    }

    /// The entries, `len` of them.
    #[inline(always)]
    fn items(&self) -> &'a [*mut c_void] {
        // SAFETY: as in `kinds`.
        unsafe { std::slice::from_raw_parts(self.items.as_ptr(), self.len) }
    }

    /// # Safety
    ///
    /// `types` and `items` point to `size` entries each when `size > 0` (checked for NULL here).
    #[inline(always)]
    unsafe fn new(
        what: &'static str,
        struct_size: usize,
        need: usize,
        size: i64,
        types: *const i32,
        items: *const *mut c_void,
    ) -> Result<Self> {
        if struct_size < need {
            return Err(list_error(what, ListFault::Size(struct_size, need)));
        }
        let Ok(n) = usize::try_from(size) else { return Err(list_error(what, ListFault::Count(size))) };
        if n == 0 {
            return Ok(Self::EMPTY);
        }
        if types.is_null() || items.is_null() || !types.is_aligned() || !items.is_aligned() {
            return Err(list_error(what, ListFault::Arrays(n)));
        }
        // SAFETY: non-NULL (checked), aligned, `n` entries alive for 'a (the caller's contract).
        Ok(unsafe {
            Self {
                kinds: std::ptr::NonNull::new_unchecked(types.cast_mut()),
                items: std::ptr::NonNull::new_unchecked(items.cast_mut()),
                len: n,
                _frame: std::marker::PhantomData,
            }
        })
    }
}

/// Why a list of the frame was refused ([`List::new`]).
enum ListFault {
    Size(usize, usize),
    Count(i64),
    Arrays(usize),
}

#[cold]
#[inline(never)]
fn list_error(what: &str, fault: ListFault) -> FfiError {
    let m = match fault {
        ListFault::Size(size, need) => format!("struct_size {size} (at least {need} needed)"),
        ListFault::Count(size) => format!("size {size}"),
        ListFault::Arrays(n) => format!("{n} entries without (aligned) arrays"),
    };
    FfiError::invalid_argument(format!("{what}: {m}"))
}

/// One call of a handler: the frame, checked.
pub struct Call<'a> {
    api: Api<'a>,
    ctx: *mut XLA_FFI_ExecutionContext,
    /// The handler's state declaration, in the signature `handle` was given (borrowed for the
    /// whole call, which this `Call` does not outlive: a body only ever gets `&mut Call`). A
    /// pointer, not a copy: a smaller `Call` is moved without a `memcpy` call.
    state: Option<std::ptr::NonNull<StateDecl>>,
    scratch: scratch::Scratch,
    args: List<'a>,
    rets: List<'a>,
    /// The attributes' kinds and values (`attrs.len` each) and their names, as many.
    attrs: List<'a>,
    attr_names: std::ptr::NonNull<*mut XLA_FFI_ByteSpan>,
    device: Device,
    /// The declared tensor parameters (empty: operand `i` is parameter `i`), once the counts
    /// were checked against the operands.
    params: &'static [Operand],
}

impl Drop for Call<'_> {
    #[inline]
    fn drop(&mut self) {
        // The device scratch goes back to XLA's allocator before the call returns to XLA (a body
        // only ever gets `&mut Call`: the call drops inside `handle`).
        self.scratch.release(self.api, self.ctx);
    }
}

impl fmt::Debug for Call<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Call")
            .field("args", &self.args.len)
            .field("rets", &self.rets.len)
            .field("attrs", &self.attrs.len)
            .field("device", &self.device)
            .finish()
    }
}

impl<'a> Call<'a> {
    /// The frame's lists, checked, and the call checked against `signature`.
    ///
    /// # Safety
    ///
    /// `frame` is aligned and covers `XLA_FFI_CallFrame_STRUCT_SIZE` bytes (its lists, embedded,
    /// included); what it points to is as the C API says, for `'a`.
    #[inline(always)]
    unsafe fn new(
        frame: *const XLA_FFI_CallFrame,
        api: Api<'a>,
        platform: Platform,
        signature: &Signature,
    ) -> Result<Self> {
        // SAFETY: the embedded lists lie below XLA_FFI_CallFrame_STRUCT_SIZE (the caller's
        // contract), so a reference to each covers only the frame's bytes.
        let (a, r, t) = unsafe { (&(*frame).args, &(*frame).rets, &(*frame).attrs) };
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
        let attr_names = if attrs.len == 0 {
            std::ptr::NonNull::dangling()
        } else if t.names.is_null() || !t.names.is_aligned() {
            return Err(FfiError::invalid_argument("attrs: no names"));
        } else {
            // SAFETY: non-NULL (checked); aligned, one name per attribute (the C contract).
            unsafe { std::ptr::NonNull::new_unchecked(t.names) }
        };
        let mut call = Self {
            api,
            // SAFETY: below XLA_FFI_CallFrame_STRUCT_SIZE (the caller's contract).
            ctx: unsafe { (&raw const (*frame).ctx).read() },
            state: signature.state.as_ref().map(std::ptr::NonNull::from),
            scratch: scratch::Scratch::default(),
            args,
            rets,
            attrs,
            attr_names,
            device: Device::CPU,
            params: &[],
        };
        call.check_signature(signature)?;
        if platform == Platform::Cuda {
            call.device = Device::new(DeviceType::CUDA, call.device_ordinal()?);
        }
        Ok(call)
    }

    /// The call against what the handler reads: as many operands and results, and the same
    /// attributes.
    #[inline]
    fn check_signature(&mut self, s: &Signature) -> Result<()> {
        if !s.params.is_empty() {
            return self.check_params(s);
        }
        if self.args.len != s.operands {
            return Err(self.count_error("operands", s.operands, self.args.len));
        }
        if self.rets.len != s.results {
            return Err(self.count_error("results", s.results, self.rets.len));
        }
        if self.attrs.len != s.attrs.len() {
            return Err(self.attrs_error(s.attrs));
        }
        // As many as declared, and every declared name (distinct: Signature::new) among them: the
        // same set.
        'declared: for a in s.attrs {
            for i in 0..self.attrs.len {
                if self.attr_name(i)? == a.as_bytes() {
                    continue 'declared;
                }
            }
            return Err(self.attrs_error(s.attrs));
        }
        Ok(())
    }

    /// [`check_signature`](Self::check_signature) for declared parameters: the declared
    /// attributes and one count per optional or list parameter (an int64 scalar: 0 or 1 for an
    /// optional, at least 0 for a list), the operands as many as the counts say; records where
    /// each parameter's operands are.
    #[inline(never)]
    fn check_params(&mut self, s: &Signature) -> Result<()> {
        let counted = s.params.iter().filter(|p| p.is_counted()).count();
        if self.rets.len != s.results {
            return Err(self.count_error("results", s.results, self.rets.len));
        }
        if self.attrs.len != s.attrs.len() + counted {
            return Err(self.params_attrs_error(s));
        }
        'declared: for a in s.attrs {
            for i in 0..self.attrs.len {
                if self.attr_name(i)? == a.as_bytes() {
                    continue 'declared;
                }
            }
            return Err(self.params_attrs_error(s));
        }
        let mut next = 0usize;
        for p in s.params {
            let n = match *p {
                Operand::Tensor(_) => 1,
                Operand::Optional(name) | Operand::List(name) => {
                    let Some(n) = self.count_of(name)? else {
                        return Err(self.params_attrs_error(s));
                    };
                    let most = if matches!(p, Operand::Optional(_)) { 1 } else { self.args.len as i64 };
                    if !(0..=most).contains(&n) {
                        return Err(FfiError::invalid_argument(format!(
                            "attribute {name}{COUNT_SUFFIX}: {n} operands (0..={most} allowed)"
                        )));
                    }
                    n as usize
                }
            };
            next += n;
        }
        if next != self.args.len {
            return Err(FfiError::invalid_argument(format!(
                "wrong number of operands: the counts say {next}, the call has {} (the handler reads {})",
                self.args.len,
                s.params.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ")
            )));
        }
        self.params = s.params;
        Ok(())
    }

    /// The value of parameter `name`'s count attribute (`None`: the call has none), read as an
    /// int64 scalar.
    fn count_of(&self, name: &str) -> Result<Option<i64>> {
        let Some(i) = (0..self.attrs.len).find(|&i| self.attr_name(i).is_ok_and(|a| is_count_of(a, name)))
        else {
            return Ok(None);
        };
        let attr = RawAttr {
            kind: XLA_FFI_AttrType(self.attrs.kinds()[i]),
            value: self.attrs.items()[i],
            _frame: PhantomData,
        };
        i64::from_attr(attr).map(Some).map_err(|e| e.about(&format!("attribute {name}{COUNT_SUFFIX}")))
    }

    /// Declared parameter `index`'s first operand and operand count (the counts were checked
    /// against the operands before the body ran).
    fn span_of(&self, index: usize) -> Result<(usize, usize)> {
        let mut first = 0usize;
        for (k, p) in self.params.iter().enumerate() {
            let n = match *p {
                Operand::Tensor(_) => 1,
                Operand::Optional(name) | Operand::List(name) => self.count_of(name)?.unwrap_or(0) as usize,
            };
            if k == index {
                return Ok((first, n));
            }
            first += n;
        }
        Err(FfiError::invalid_argument(format!("no parameter {index}")))
    }

    #[cold]
    #[inline(never)]
    fn params_attrs_error(&self, s: &Signature) -> FfiError {
        let counts: Vec<String> = s
            .params
            .iter()
            .filter(|p| p.is_counted())
            .map(|p| format!("{}{COUNT_SUFFIX}", p.name()))
            .collect();
        let mut all: Vec<&str> = s.attrs.to_vec();
        all.extend(counts.iter().map(String::as_str));
        self.attrs_error(&all)
    }

    #[cold]
    #[inline(never)]
    fn count_error(&self, what: &str, expected: usize, got: usize) -> FfiError {
        FfiError::invalid_argument(format!(
            "wrong number of {what}: expected {expected}, got {got} (the handler reads {expected})"
        ))
    }

    #[cold]
    #[inline(never)]
    fn attrs_error(&self, declared: &[&str]) -> FfiError {
        let got: Vec<String> = (0..self.attrs.len)
            .map(|i| {
                self.attr_name(i)
                    .map_or_else(|e| e.message().to_owned(), |b| String::from_utf8_lossy(b).into_owned())
            })
            .collect();
        let list = |v: &[&str]| if v.is_empty() { "none".to_owned() } else { v.join(", ") };
        let got_refs: Vec<&str> = got.iter().map(String::as_str).collect();
        let unexpected: Vec<&str> = got_refs.iter().copied().filter(|g| !declared.contains(g)).collect();
        let missing: Vec<&str> = declared.iter().copied().filter(|a| !got_refs.contains(a)).collect();
        let mut m = format!(
            "wrong attributes: the handler reads {}, the call has {}",
            list(declared),
            list(&got_refs)
        );
        if !unexpected.is_empty() {
            m += &format!(" (unexpected: {})", unexpected.join(", "));
        }
        if !missing.is_empty() {
            m += &format!(" (missing: {})", missing.join(", "));
        }
        FfiError::invalid_argument(m)
    }

    /// The number of operands.
    pub fn num_inputs(&self) -> usize {
        self.args.len
    }

    /// The number of results.
    pub fn num_outputs(&self) -> usize {
        self.rets.len
    }

    /// The device the buffers are on (the platform the handler was registered for).
    pub fn device(&self) -> Device {
        self.device
    }

    /// Operand `index` (named `name` in errors), of any type: dispatch on [`AnyBuffer::dtype`],
    /// then [`AnyBuffer::typed`].
    #[inline(always)]
    pub fn input_any(&self, index: usize, name: &'static str) -> Result<AnyBuffer<'a>> {
        let flat = if self.params.is_empty() { index } else { self.declared_tensor(index, name)? };
        self.buffer(self.args, flat, name, false)
    }

    /// The operand of tensor parameter `index` of a handler that declares its parameters (out of
    /// line: the usual handler, whose operand `i` is parameter `i`, keeps `input_any` small).
    #[inline(never)]
    fn declared_tensor(&self, index: usize, name: &'static str) -> Result<usize> {
        Ok(self.operands_of(index, name, Kind::Tensor)?.0)
    }

    /// Where parameter `index`'s operands are (first, count), if it is declared of kind `want`
    /// (a handler declared with [`Signature::with_operands`]; else every operand is a tensor
    /// parameter).
    #[inline]
    fn operands_of(&self, index: usize, name: &'static str, want: Kind) -> Result<(usize, usize)> {
        let declared = if self.params.is_empty() {
            (index < self.args.len).then_some((Operand::Tensor(name), (index, 1)))
        } else {
            match self.params.get(index) {
                Some(&p) => Some((p, self.span_of(index)?)),
                None => None,
            }
        };
        match declared {
            Some((p, span)) if Kind::of(p) == want => Ok(span),
            Some((p, _)) => Err(FfiError::invalid_argument(format!(
                "{name}: parameter {index} ({}) is declared {}, read as {}: read it with {}",
                p.name(),
                Kind::of(p).word(),
                want.word(),
                Kind::of(p).reader()
            ))),
            None => Err(FfiError::invalid_argument(format!(
                "{name}: no parameter {index} (the handler declares {})",
                if self.params.is_empty() { self.args.len } else { self.params.len() }
            ))),
        }
    }

    /// Optional operand parameter `index` ([`Operand::Optional`]; named `name` in errors), of
    /// any type: `None` when the caller passed none.
    pub fn optional_input_any(&self, index: usize, name: &'static str) -> Result<Option<AnyBuffer<'a>>> {
        let (first, n) = self.operands_of(index, name, Kind::Optional)?;
        if n == 0 { Ok(None) } else { self.buffer(self.args, first, name, false).map(Some) }
    }

    /// Optional operand parameter `index`, checked against `T` and `S` as [`Call::input`]:
    /// `None` when the caller passed none (a kernel's `Tensor?` parameter given `None`).
    pub fn optional_input<T: Element, S: ShapeSpec>(
        &self,
        index: usize,
        name: &'static str,
    ) -> Result<Option<BufferRef<'a, T, S>>> {
        match self.optional_input_any(index, name)? {
            Some(b) => b.typed().map(Some),
            None => Ok(None),
        }
    }

    /// List parameter `index` ([`Operand::List`]; named `name` in errors), its operands of any
    /// type, in order.
    pub fn input_list_any(&self, index: usize, name: &'static str) -> Result<Vec<AnyBuffer<'a>>> {
        let (first, n) = self.operands_of(index, name, Kind::List)?;
        (0..n)
            .map(|i| self.buffer(self.args, first + i, name, false).map_err(|e| item_error(e, name, i)))
            .collect()
    }

    /// List parameter `index`, each operand checked against `T` and `S` as [`Call::input`]
    /// (an error names the item: `xs[2]: expected float32 ...`).
    pub fn input_list<T: Element, S: ShapeSpec>(
        &self,
        index: usize,
        name: &'static str,
    ) -> Result<Vec<BufferRef<'a, T, S>>> {
        let (first, n) = self.operands_of(index, name, Kind::List)?;
        (0..n)
            .map(|i| {
                self.buffer(self.args, first + i, name, false)
                    .and_then(AnyBuffer::typed)
                    .map_err(|e| item_error(e, name, i))
            })
            .collect()
    }

    /// Result `index` (named `name` in errors), of any type.
    #[inline(always)]
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

    #[inline(always)]
    fn buffer(&self, list: List<'a>, index: usize, name: &'static str, out: bool) -> Result<AnyBuffer<'a>> {
        // The checks, in order; each refusal is made by a cold function, so this path keeps no
        // message's arguments around.
        let (Some(&kind), Some(&ptr)) = (list.kinds().get(index), list.items().get(index)) else {
            return Err(BufferFault::Missing(list.len).error(name, out, index));
        };
        if kind != XLA_FFI_ArgType::BUFFER.0 {
            return Err(BufferFault::Kind(kind).error(name, out, index));
        }
        let buf = ptr.cast::<XLA_FFI_Buffer>();
        if buf.is_null() || !buf.is_aligned() {
            return Err(BufferFault::Null.error(name, out, index));
        }
        // SAFETY: a buffer (its kind says so): its size field first, the rest once covered.
        let size = unsafe { (*buf).struct_size };
        if size < XLA_FFI_Buffer_STRUCT_SIZE {
            return Err(BufferFault::Size(size).error(name, out, index));
        }
        // SAFETY: covered by the size just checked (XLA_FFI_Buffer_STRUCT_SIZE is the whole struct).
        let b = unsafe { &*buf };
        let Some(dtype) = data_type(b.dtype) else {
            return Err(BufferFault::Dtype(b.dtype.0).error(name, out, index));
        };
        let rank = b.rank as usize;
        if b.rank < 0 || rank > MAX_NDIM {
            return Err(BufferFault::Rank(b.rank).error(name, out, index));
        }
        let shape: &'a [i64] = if rank == 0 {
            &[]
        } else if b.dims.is_null() || !b.dims.is_aligned() {
            return Err(BufferFault::Dims(rank).error(name, out, index));
        } else {
            // SAFETY: non-NULL, aligned, `rank` extents (the C contract), read-only for the call.
            unsafe { std::slice::from_raw_parts(b.dims, rank) }
        };
        // One pass over the extents: a negative one is an error wherever it is; a zero makes the
        // count 0 (an overflowing product of the others is then irrelevant); else elements and
        // bytes stay within isize.
        let mut numel: usize = 1;
        let (mut negative, mut zero, mut overflow) = (false, false, false);
        for &d in shape {
            negative |= d < 0;
            zero |= d == 0;
            match numel.checked_mul(d as usize) {
                Some(n) if n <= isize::MAX as usize => numel = n,
                _ => overflow = true,
            }
        }
        if negative {
            return Err(BufferFault::Negative(shape).error(name, out, index));
        }
        let itemsize = dtype.storage_bits(false).div_ceil(8) as usize;
        let bytes = if zero {
            numel = 0;
            0
        } else {
            match numel.checked_mul(itemsize) {
                Some(bytes) if !overflow && bytes <= isize::MAX as usize => bytes,
                _ => return Err(BufferFault::Extents(shape).error(name, out, index)),
            }
        };
        let data = b.data;
        if bytes > 0 && (data.is_null() || (data as usize).checked_add(bytes).is_none()) {
            return Err(BufferFault::Data(numel, data).error(name, out, index));
        }
        Ok(AnyBuffer { name, dtype, data, shape, numel, device: self.device, writable: out })
    }

    /// Attribute `name` (a scalar, a string or an array), decoded as `T` ([`FromAttr`]).
    pub fn attr<T: FromAttr<'a>>(&self, name: &str) -> Result<T> {
        for i in 0..self.attrs.len {
            if self.attr_name(i)? == name.as_bytes() {
                let attr = RawAttr {
                    kind: XLA_FFI_AttrType(self.attrs.kinds()[i]),
                    value: self.attrs.items()[i],
                    _frame: PhantomData,
                };
                return T::from_attr(attr).map_err(|e| e.about(&format!("attribute {name}")));
            }
        }
        Err(FfiError::invalid_argument(format!(
            "attribute {name}: missing (the call has {})",
            self.attr_names_list()
        )))
    }

    /// The attributes' names, one per attribute.
    #[inline(always)]
    fn attr_names(&self) -> &'a [*mut XLA_FFI_ByteSpan] {
        // SAFETY: `attrs.len` aligned names alive for 'a (checked in `Call::new`), or dangling and
        // empty.
        unsafe { std::slice::from_raw_parts(self.attr_names.as_ptr(), self.attrs.len) }
    }

    /// Attribute `i`'s name (`i` below the number of attributes).
    #[inline]
    fn attr_name(&self, i: usize) -> Result<&'a [u8]> {
        let n = self.attr_names()[i];
        if n.is_null() || !n.is_aligned() {
            return Err(FfiError::invalid_argument("attrs: a NULL name"));
        }
        // SAFETY: a non-NULL, aligned byte span (the C contract), alive for the call.
        let span = unsafe { &*n };
        if span.len == 0 {
            Ok(&[])
        } else if span.ptr.is_null() {
            Err(FfiError::invalid_argument("attrs: a name without bytes"))
        } else {
            // SAFETY: `len` bytes at `ptr` (the C contract), alive for the call.
            Ok(unsafe { std::slice::from_raw_parts(span.ptr.cast(), span.len) })
        }
    }

    fn attr_names_list(&self) -> String {
        let names: Vec<String> = (0..self.attrs.len)
            .filter_map(|i| self.attr_name(i).ok())
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect();
        if names.is_empty() { "no attributes".into() } else { names.join(", ") }
    }

    /// The platform stream of the call (a `cudaStream_t` for a CUDA handler; NULL on CPU).
    pub fn stream(&self) -> Result<*mut c_void> {
        let f = api_field!(self.api, XLA_FFI_Stream_Get).ok_or_else(too_old)?;
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
        let f = api_field!(self.api, XLA_FFI_DeviceOrdinal_Get).ok_or_else(too_old)?;
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

    /// Turns an error XLA's own function returned into an [`FfiError`] (and frees it).
    fn check(&self, err: *mut XLA_FFI_Error, what: &str) -> Result<()> {
        self.api.check(err, what)
    }

    /// The state made when XLA instantiated this handler (once per compiled executable that
    /// calls it), declared in [`xla_handler!`](crate::xla_handler) as `state: Type = init`.
    /// Shared by every call of that executable, from any thread: `Type` is `Send + Sync`, and
    /// interior mutability (atomics, locks) is how a call changes it.
    ///
    /// An error when the handler declares no state or another type, or when none was made:
    /// XLA runs the instantiate stage only for a handler registered for it
    /// (`jax.ffi.register_ffi_target(name, {"instantiate": capsule, "execute": capsule})`, which
    /// [`add_kernel`](crate::python::add_kernel) does for a handler with a state). As a native
    /// torch op, the state is made at the op's first call and kept for the process.
    pub fn state<T: std::any::Any + Send + Sync>(&self) -> Result<&T> {
        // SAFETY: the signature's declaration, borrowed by `handle` for the whole call (see the
        // field).
        let decl = self.state.map(|p| unsafe { *p.as_ptr() });
        state::get::<T>(self.api, self.ctx, decl)
    }

    /// `n` elements of `T`, each `T::default()`, to use during the call: freed when the call
    /// returns. XLA's CPU runtime has no allocator for a handler (its
    /// `XLA_FFI_DeviceMemory_Allocate` serves GPU contexts only), so this is a Rust allocation,
    /// on the torch op path too. `RESOURCE_EXHAUSTED` when it cannot be made.
    ///
    /// The slice is the call's: kept past the call, it does not compile.
    ///
    /// ```compile_fail,E0521
    /// use std::sync::Mutex;
    /// static KEPT: Mutex<Vec<&'static mut [u8]>> = Mutex::new(Vec::new());
    /// dlbridge::xla_handler! {
    ///     fn h(call, operands: 0, results: 0) {
    ///         let s = call.scratch::<u8>(4)?;
    ///         KEPT.lock().unwrap().push(s); // E0521: borrowed data escapes the body
    ///         Ok(())
    ///     }
    /// }
    /// ```
    pub fn scratch<T: Copy + Default>(&self, n: usize) -> Result<&mut [T]> {
        self.scratch.host::<T>(n)
    }

    /// `bytes` bytes of device memory aligned to `align` (a power of two, at most 16 for XLA),
    /// from XLA's allocator for the call's device (`XLA_FFI_DeviceMemory_Allocate`), given back
    /// when the call returns: scratch for a CUDA handler's kernels (queued on
    /// [`stream`](Self::stream)). XLA's CPU runtime has none (an error; use
    /// [`scratch`](Self::scratch)). The pointer is the handler's to pass to device code, never
    /// read here.
    pub fn device_scratch(&self, bytes: usize, align: usize) -> Result<*mut c_void> {
        self.scratch.device(self.api, self.ctx, bytes, align)
    }

    /// XLA's intra-op thread pool for a parallel loop ([`ThreadPool::parallel_for`],
    /// [`ThreadPool::for_each_chunk_mut`]), which returns once every item has finished. Where
    /// XLA lends none (a context without a pool, an older API table, a native torch op), the
    /// loop runs on the calling thread alone.
    pub fn thread_pool(&self) -> ThreadPool<'_> {
        ThreadPool::new(self.api, self.ctx)
    }
}

/// A tensor parameter's kind, as declared ([`Operand`]) and as read.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Tensor,
    Optional,
    List,
}

impl Kind {
    fn of(p: Operand) -> Self {
        match p {
            Operand::Tensor(_) => Self::Tensor,
            Operand::Optional(_) => Self::Optional,
            Operand::List(_) => Self::List,
        }
    }

    fn word(self) -> &'static str {
        match self {
            Self::Tensor => "a tensor",
            Self::Optional => "an optional tensor",
            Self::List => "a list of tensors",
        }
    }

    fn reader(self) -> &'static str {
        match self {
            Self::Tensor => "Call::input",
            Self::Optional => "Call::optional_input",
            Self::List => "Call::input_list",
        }
    }
}

/// `e`, about list item `i` of `name`: its message's `name: ` prefix becomes `name[i]: `.
#[cold]
#[inline(never)]
fn item_error(e: FfiError, name: &str, i: usize) -> FfiError {
    let rest = e.message().strip_prefix(name).and_then(|r| r.strip_prefix(": ")).map(str::to_owned);
    match rest {
        Some(rest) => FfiError::new(e.code(), format!("{name}[{i}]: {rest}")),
        None => e.about(&format!("{name}[{i}]")),
    }
}

/// Why an operand or result was refused ([`Call::buffer`]), made into its message off the hot path.
enum BufferFault<'s> {
    Missing(usize),
    Kind(i32),
    Null,
    Size(usize),
    Dtype(i32),
    Rank(i64),
    Dims(usize),
    Negative(&'s [i64]),
    Extents(&'s [i64]),
    Data(usize, *mut c_void),
}

impl BufferFault<'_> {
    #[cold]
    #[inline(never)]
    fn error(self, name: &str, out: bool, index: usize) -> FfiError {
        let what = if out { "result" } else { "operand" };
        let m = match self {
            Self::Missing(n) => format!("no {what} {index} (the call has {n})"),
            Self::Kind(k) => format!("{what} {index} is of kind {k}, not a buffer"),
            Self::Null => format!("{what} {index} is a NULL or misaligned buffer"),
            Self::Size(s) => format!("buffer struct_size {s} (at least {XLA_FFI_Buffer_STRUCT_SIZE} needed)"),
            Self::Dtype(t) => format!("XLA element type {t} has no DLPack equivalent"),
            Self::Rank(r) => format!("rank {r} (0..={MAX_NDIM} allowed)"),
            Self::Dims(r) => format!("rank {r} with NULL or misaligned dims"),
            Self::Negative(shape) => {
                let d = shape.iter().find(|&&d| d < 0).copied().unwrap_or_default();
                format!("negative extent {d} in {shape:?}")
            }
            Self::Extents(shape) => format!("extents {shape:?} exceed the address space"),
            Self::Data(n, data) => format!("{n} elements at address {data:p}"),
        };
        FfiError::invalid_argument(format!("{name}: {m}"))
    }
}

/// A function the API table does not reach (an older XLA's) or holds as NULL.
#[cold]
fn too_old() -> FfiError {
    FfiError::new(XLA_FFI_Error_Code::UNIMPLEMENTED, "the XLA FFI API table lacks a function (an older XLA?)")
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
                "expected a {rust} scalar, got attribute kind {} ({})",
                self.kind.0,
                attr_kind_name(self.kind)
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
            // What to change, in the kernel author's terms: the declaration (a dlbridge kernel
            // passes each attribute as the type its declaration names, whatever Python number the
            // caller gave) or the handler's read; only a hand-written ffi_call passes its own.
            let np = data_type(want).map_or_else(|| format!("XLA type {}", want.0), |d| d.to_string());
            return Err(FfiError::invalid_argument(format!(
                "the handler reads a {rust} scalar, but the call passed {got}: declare the attribute \
                 \"{np}\" where the kernel is declared (KernelDef.attrs, kernel(attrs=...)), or read \
                 it as the declared type in the handler (a jax.ffi.ffi_call of your own: pass \
                 numpy.{np}(value))"
            )));
        }
        if s.value.is_null() {
            return Err(FfiError::invalid_argument("a scalar without a value"));
        }
        // SAFETY: a value of the scalar's type: `bytes` bytes (the C contract).
        Ok(unsafe { std::slice::from_raw_parts(s.value.cast::<u8>(), bytes) })
    }
}

impl<'a> RawAttr<'a> {
    /// An array attribute's elements as `T`, checked: the kind, the element type (`want`, or
    /// `also`), and the pointer and count (the frame is untrusted: a NULL or misaligned array or
    /// data pointer, or a count whose bytes pass the address space, is refused, never read).
    fn array<T: Element>(
        self,
        want: XLA_FFI_DataType,
        also: Option<XLA_FFI_DataType>,
        rust: &str,
    ) -> Result<&'a [T]> {
        if self.kind != XLA_FFI_AttrType::ARRAY {
            return Err(FfiError::invalid_argument(format!(
                "expected an array of {rust}, got attribute kind {} ({})",
                self.kind.0,
                attr_kind_name(self.kind)
            )));
        }
        let a = self.value.cast::<XLA_FFI_Array>();
        if a.is_null() || !a.is_aligned() {
            return Err(FfiError::invalid_argument("a NULL array"));
        }
        // SAFETY: an array (its kind says so), non-NULL and aligned.
        let a = unsafe { &*a };
        if a.dtype != want && Some(a.dtype) != also {
            let got = data_type(a.dtype).map_or_else(|| format!("XLA type {}", a.dtype.0), |d| d.to_string());
            let np = data_type(want).map_or_else(|| format!("XLA type {}", want.0), |d| d.to_string());
            return Err(FfiError::invalid_argument(format!(
                "the handler reads an array of {rust}, but the call passed an array of {got}: declare \
                 the attribute \"{np}[]\" where the kernel is declared (KernelDef.attrs, \
                 kernel(attrs=...)), or read it as the declared type in the handler (a \
                 jax.ffi.ffi_call of your own: pass numpy.asarray(values, numpy.{np}))"
            )));
        }
        if a.size == 0 {
            return Ok(&[]);
        }
        let fits = a.size.checked_mul(size_of::<T>()).filter(|&b| b <= isize::MAX as usize);
        let Some(bytes) = fits else {
            return Err(FfiError::invalid_argument(format!(
                "an array of {} elements of {rust} exceeds the address space",
                a.size
            )));
        };
        let data = a.data;
        if data.is_null()
            || (data as usize) % align_of::<T>() != 0
            || (data as usize).checked_add(bytes).is_none()
        {
            return Err(FfiError::invalid_argument(format!(
                "an array of {} elements of {rust} at address {data:p}",
                a.size
            )));
        }
        // SAFETY: `size` elements of the array's element type (checked: T's) at `data`, non-NULL
        // and aligned, their bytes inside the address space, alive for the call (the C contract).
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), bytes) };
        if !T::ALL_BIT_PATTERNS_VALID && !T::is_valid_bytes(bytes) {
            return Err(FfiError::invalid_argument(format!("invalid {} values in the array", T::DTYPE)));
        }
        // SAFETY: as above; valid values of T.
        Ok(unsafe { std::slice::from_raw_parts(data.cast::<T>(), a.size) })
    }
}

/// The C API's name of an attribute kind, for errors.
fn attr_kind_name(kind: XLA_FFI_AttrType) -> &'static str {
    match kind {
        XLA_FFI_AttrType::ARRAY => "an array",
        XLA_FFI_AttrType::DICTIONARY => "a dictionary",
        XLA_FFI_AttrType::SCALAR => "a scalar",
        XLA_FFI_AttrType::STRING => "a string",
        _ => "unknown",
    }
}

/// What an attribute decodes to: `f32`, `f64`, `i32`, `i64`, `bool` (scalars of exactly that type:
/// pass `numpy.float32(a)` from Python), `&str` (a string attribute), `&[i64]`, `&[i32]`,
/// `&[f32]`, `&[f64]`, `&[bool]` (an array attribute of exactly that element type, borrowed from
/// the call: `KernelDef.attrs` types `"int64[]"`, `"int32[]"`, `"float32[]"`, `"float64[]"`,
/// `"bool[]"`).
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

macro_rules! array_attr {
    ($($t:ty => $x:ident,)*) => {$(
        impl<'a> FromAttr<'a> for &'a [$t] {
            fn from_attr(attr: RawAttr<'a>) -> Result<Self> {
                attr.array::<$t>(XLA_FFI_DataType::$x, None, stringify!($t))
            }
        }
    )*};
}
array_attr! {
    i64 => S64,
    i32 => S32,
    f32 => F32,
    f64 => F64,
}

/// A `bool[]` attribute: a PRED array, or a U8 one (XLA has no bool array attribute, so a
/// dlbridge kernel passes one from jax as bytes), each byte 0 or 1 (checked).
impl<'a> FromAttr<'a> for &'a [bool] {
    fn from_attr(attr: RawAttr<'a>) -> Result<Self> {
        attr.array::<bool>(XLA_FFI_DataType::PRED, Some(XLA_FFI_DataType::U8), "bool")
    }
}

impl<'a> FromAttr<'a> for &'a str {
    fn from_attr(attr: RawAttr<'a>) -> Result<Self> {
        if attr.kind != XLA_FFI_AttrType::STRING {
            return Err(FfiError::invalid_argument(format!(
                "expected a string, got attribute kind {} ({})",
                attr.kind.0,
                attr_kind_name(attr.kind)
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
            // A fresh result buffer holds anything; an aliased one (an in-place op's `Tensor(a!)`,
            // jax's input_output_aliases) the caller's values, where torch and numpy read any
            // nonzero byte as True. Each byte becomes what it reads as (bool, the one such
            // element, is one byte: nonzero to 1), so either is valid and keeps its values.
            // SAFETY: as above, writable bytes of the buffer, not borrowed elsewhere (`bytes` ends here).
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(self.data.cast::<u8>(), self.numel * size_of::<T>())
            };
            if size_of::<T>() == 1 {
                bytes.iter_mut().for_each(|b| *b = u8::from(*b != 0));
            } else {
                bytes.fill(0);
            }
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
/// The handler declares what it reads: `operands: N, results: M` and, when it reads attributes,
/// `attrs: ["a", "eps"]` (a [`Signature`]). Every call is checked against it before the body runs,
/// as XLA's C++ binding checks its bound signature: a call passing another number of operands or
/// results, or other attributes, is refused (`INVALID_ARGUMENT: saxpy_xla: wrong number of
/// operands: expected 2, got 3 ...`), so the body never leaves a result it did not know of
/// unwritten.
///
/// After the attributes, `state: Type = init` declares a state (`Type: Send + Sync + 'static`):
/// `init`, an expression (it sees no call: no buffers, no attributes), is evaluated at XLA's
/// instantiate stage, once per custom call of a compiled executable, and every call reads the
/// value with [`Call::state`]. Such a handler is registered for both stages
/// ([`needs_instantiate`]; `add_kernel` does it). A body also reaches scratch memory
/// ([`Call::scratch`]) and XLA's intra-op thread pool ([`Call::thread_pool`]):
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use dlbridge::spec::Rank;
///
/// /// A table made once per compiled executable.
/// struct Squares {
///     table: Vec<f32>,
///     calls: AtomicU64,
/// }
///
/// dlbridge::xla_handler! {
///     /// `out[i] = x[i]²` for small integers in float32, read from the state's table.
///     pub fn squares_xla(call, operands: 1, results: 1,
///                        state: Squares = Squares { table: (0..256).map(|i| (i * i) as f32).collect(), calls: AtomicU64::new(0) }) {
///         let state = call.state::<Squares>()?;
///         state.calls.fetch_add(1, Ordering::Relaxed);
///         let x = call.input::<f32, Rank<1>>(0, "x")?;
///         let mut out = call.output::<f32, Rank<1>>(0, "out")?;
///         let x = x.as_slice()?;
///         let x: &[f32] = &x;
///         let tmp = call.scratch::<f32>(x.len())?; // freed when the call returns
///         // Chunks of 1024 elements in parallel on XLA's pool (or this thread alone).
///         call.thread_pool().for_each_chunk_mut(tmp, 1024, |i, chunk| {
///             for (k, t) in chunk.iter_mut().enumerate() {
///                 let v = x[i * 1024 + k];
///                 *t = state.table.get(v as usize).copied().unwrap_or(v * v);
///             }
///         })?;
///         out.as_slice_mut()?.copy_from_slice(tmp);
///         Ok(())
///     }
/// }
/// // SAFETY: a handler of this crate, which answers XLA's metadata query.
/// assert!(unsafe { dlbridge::xla::needs_instantiate(squares_xla) });
/// ```
///
/// The state is shared by the calls of an executable, on any thread: it is `Send + Sync`.
///
/// ```compile_fail,E0277
/// dlbridge::xla_handler! {
///     fn h(call, operands: 0, results: 0, state: std::rc::Rc<u8> = std::rc::Rc::new(1)) {
///         let _ = call;
///         Ok(())
///     }
/// }
/// ```
///
/// The declaration of what the handler reads is required:
///
/// ```compile_fail
/// dlbridge::xla_handler! {
///     fn h(call) {
///         let _ = call;
///         Ok(())
///     }
/// }
/// ```
///
/// Optional tensors and lists of tensors: declare each tensor parameter, `operands:
/// [tensor("x"), optional("bias"), list("xs")]` ([`Operand`], [`Signature::with_operands`]); the
/// call then passes an int64 attribute `<parameter>.count` per optional or list parameter
/// (`dlbridge.kernels` and the native torch op add them), checked with the operands before the
/// body runs, and the body reads each parameter by its index among the declared ones:
///
/// ```
/// use dlbridge::spec::Rank;
///
/// dlbridge::xla_handler! {
///     /// `out = x @ weight.T (+ bias)`.
///     pub fn linear_xla(call, operands: [tensor("x"), tensor("weight"), optional("bias")], results: 1) {
///         let x = call.input::<f32, Rank<2>>(0, "x")?;
///         let w = call.input::<f32, Rank<2>>(1, "weight")?;
///         let bias = call.optional_input::<f32, Rank<1>>(2, "bias")?;
///         let mut out = call.output::<f32, Rank<2>>(0, "out")?;
///         let (m, k, n) = (x.shape()[0] as usize, x.shape()[1] as usize, w.shape()[0] as usize);
///         let (x, w) = (x.as_slice()?, w.as_slice()?);
///         let b = bias.as_ref().map(|b| b.as_slice()).transpose()?;
///         let mut o = out.as_slice_mut()?;
///         for i in 0..m {
///             for j in 0..n {
///                 let dot: f32 = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
///                 o[i * n + j] = dot + b.as_ref().map_or(0.0, |b| b[j]);
///             }
///         }
///         Ok(())
///     }
/// }
/// # let _: dlbridge::xla_ffi::XLA_FFI_Handler = linear_xla;
/// ```
///
/// The body is safe code: an unsafe operation in it needs its own `unsafe` block.
///
/// ```compile_fail,E0133
/// unsafe fn dangerous() {}
/// dlbridge::xla_handler! {
///     fn h(call, operands: 0, results: 0) {
///         let _ = call;
///         dangerous(); // E0133: call to unsafe function requires unsafe block
///         Ok(())
///     }
/// }
/// ```
#[macro_export]
macro_rules! xla_handler {
    // Tensor parameters declared one by one (optional ones and lists among them).
    ($(#[$m:meta])* $vis:vis fn $name:ident(
        $call:ident, operands: [$($kind:ident($p:literal)),* $(,)?], results: $r:expr $(, attrs: [$($a:expr),* $(,)?])?
        $(, state: $sty:ty = $sinit:expr)? $(,)?
    ) $body:block) => {
        $crate::xla_handler!(@emit handle, $crate::xla::Signature::with_operands(
            &[$($crate::xla::Operand::$kind($p)),*], $r, &[$($($a),*)?]
        ), [$($sty, $sinit)?], $(#[$m])* $vis fn $name($call) $body);
    };
    ($(#[$m:meta])* $vis:vis cuda fn $name:ident(
        $call:ident, operands: [$($kind:ident($p:literal)),* $(,)?], results: $r:expr $(, attrs: [$($a:expr),* $(,)?])?
        $(, state: $sty:ty = $sinit:expr)? $(,)?
    ) $body:block) => {
        $crate::xla_handler!(@emit handle_cuda, $crate::xla::Signature::with_operands(
            &[$($crate::xla::Operand::$kind($p)),*], $r, &[$($($a),*)?]
        ), [$($sty, $sinit)?], $(#[$m])* $vis fn $name($call) $body);
    };
    ($(#[$m:meta])* $vis:vis fn $name:ident(
        $call:ident, operands: $n:expr, results: $r:expr $(, attrs: [$($a:expr),* $(,)?])?
        $(, state: $sty:ty = $sinit:expr)? $(,)?
    ) $body:block) => {
        $crate::xla_handler!(@emit handle, $crate::xla::Signature::new($n, $r, &[$($($a),*)?]), [$($sty, $sinit)?], $(#[$m])* $vis fn $name($call) $body);
    };
    ($(#[$m:meta])* $vis:vis cuda fn $name:ident(
        $call:ident, operands: $n:expr, results: $r:expr $(, attrs: [$($a:expr),* $(,)?])?
        $(, state: $sty:ty = $sinit:expr)? $(,)?
    ) $body:block) => {
        $crate::xla_handler!(@emit handle_cuda, $crate::xla::Signature::new($n, $r, &[$($($a),*)?]), [$($sty, $sinit)?], $(#[$m])* $vis fn $name($call) $body);
    };
    // One expansion for both platforms: `$handle` is `xla::handle` or `xla::handle_cuda`.
    (@emit $handle:ident, $sig:expr, [$($sty:ty, $sinit:expr)?], $(#[$m:meta])* $vis:vis fn $name:ident($call:ident) $body:block) => {
        $(#[$m])*
        ///
        /// # Safety
        ///
        /// XLA's handler contract: `frame` is a call frame XLA made for this call.
        $vis unsafe extern "C" fn $name(
            frame: *mut $crate::xla_ffi::XLA_FFI_CallFrame,
        ) -> *mut $crate::xla_ffi::XLA_FFI_Error {
            // What the body reads, checked against the call before it runs (evaluated at compile
            // time: an attribute named twice does not compile).
            $(
                // The state, made at XLA's instantiate stage (once per compiled executable).
                fn make_state() -> ::std::boxed::Box<dyn ::std::any::Any + ::core::marker::Send + ::core::marker::Sync> {
                    let state: $sty = $sinit;
                    ::std::boxed::Box::new(state)
                }
            )?
            const SIGNATURE: $crate::xla::Signature = $sig
                $(.with_state($crate::xla::StateDecl::new::<$sty>(make_state)))?;
            // The body is a safe fn of its own (not code inside this unsafe fn or an unsafe block):
            // an unsafe call in it needs its own `unsafe` block and SAFETY line.
            fn body($call: &mut $crate::xla::Call<'_>) -> $crate::xla::Result<()> {
                $body
            }
            // SAFETY: the contract above is the caller's (XLA's).
            unsafe { $crate::xla::$handle(frame, stringify!($name), &SIGNATURE, body) }
        }
    };
    ($(#[$m:meta])* $vis:vis $(cuda)? fn $name:ident($call:ident) $body:block) => {
        ::core::compile_error!(concat!(
            "xla_handler!: declare what ", stringify!($name), " reads, checked against every call: ",
            "fn ", stringify!($name), "(", stringify!($call), ", operands: N, results: M, attrs: [\"name\", ...])"
        ));
    };
}
