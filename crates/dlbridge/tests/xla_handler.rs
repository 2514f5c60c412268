//! The XLA FFI handler layer (`dlbridge::xla`) over call frames built here, as XLA builds them,
//! and malformed ones: every refusal is an XLA FFI error (never a crash), panics are caught,
//! typed views follow the borrow rules. Runs under Miri (`make miri`).

use std::ffi::{CStr, c_char, c_void};
use std::ptr::{null, null_mut};

use dlbridge::spec::{Cuda, Dim, Rank};
use dlbridge::xla::FfiError;
use dlbridge::xla_ffi::*;

// --- a fake XLA: an API table whose errors are boxed (code, message) ---

struct FakeError {
    code: XLA_FFI_Error_Code,
    message: std::ffi::CString,
}

unsafe extern "C" fn error_create(args: *mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error {
    // SAFETY: the handler layer passes valid arguments with a NUL-terminated message.
    let args = unsafe { &*args };
    assert!(args.struct_size >= XLA_FFI_Error_Create_Args_STRUCT_SIZE);
    // SAFETY: as above.
    let message = unsafe { CStr::from_ptr(args.message) }.to_owned();
    Box::into_raw(Box::new(FakeError { code: args.errc, message })).cast()
}

unsafe extern "C" fn error_get_message(args: *mut XLA_FFI_Error_GetMessage_Args) {
    // SAFETY: an error made by error_create.
    unsafe { (*args).message = (*(*args).error.cast::<FakeError>()).message.as_ptr() };
}

unsafe extern "C" fn error_destroy(args: *mut XLA_FFI_Error_Destroy_Args) {
    // SAFETY: an error made by error_create, freed once.
    drop(unsafe { Box::from_raw((*args).error.cast::<FakeError>()) });
}

unsafe extern "C" fn stream_get(args: *mut XLA_FFI_Stream_Get_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid arguments from the handler layer.
    unsafe { (*args).stream = std::ptr::without_provenance_mut(0x5eed) };
    null_mut()
}

unsafe extern "C" fn device_ordinal_get(args: *mut XLA_FFI_DeviceOrdinal_Get_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid arguments from the handler layer.
    unsafe { (*args).device_ordinal = 1 };
    null_mut()
}

fn api(major: i32) -> XLA_FFI_Api {
    XLA_FFI_Api {
        struct_size: XLA_FFI_Api_STRUCT_SIZE,
        extension_start: null_mut(),
        api_version: XLA_FFI_Api_Version {
            struct_size: XLA_FFI_Api_Version_STRUCT_SIZE,
            extension_start: null_mut(),
            major_version: major,
            minor_version: 3,
        },
        internal_api: null(),
        XLA_FFI_Error_Create: Some(error_create),
        XLA_FFI_Error_GetMessage: Some(error_get_message),
        XLA_FFI_Error_Destroy: Some(error_destroy),
        XLA_FFI_Handler_Register: null(),
        XLA_FFI_Stream_Get: Some(stream_get),
        XLA_FFI_Type_Register: None,
        XLA_FFI_ExecutionContext_Get: null(),
        XLA_FFI_State_Set: None,
        XLA_FFI_State_Get: None,
        XLA_FFI_DeviceMemory_Allocate: None,
        XLA_FFI_DeviceMemory_Free: None,
        XLA_FFI_ThreadPool_Schedule: None,
        XLA_FFI_ThreadPool_NumThreads: None,
        XLA_FFI_Future_Create: null(),
        XLA_FFI_Future_SetAvailable: null(),
        XLA_FFI_Future_SetError: null(),
        XLA_FFI_RunId_Get: null(),
        XLA_FFI_DeviceOrdinal_Get: Some(device_ordinal_get),
    }
}

/// What a handler returned: Ok, or the error's code and message (the error freed).
fn outcome(err: *mut XLA_FFI_Error) -> Result<(), (XLA_FFI_Error_Code, String)> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: made by error_create, freed here once.
    let e = unsafe { Box::from_raw(err.cast::<FakeError>()) };
    Err((e.code, e.message.to_string_lossy().into_owned()))
}

// --- call frames, as XLA lays them out ---

struct Buf {
    dims: Vec<i64>,
    raw: XLA_FFI_Buffer,
}

fn buf(dtype: XLA_FFI_DataType, data: *mut c_void, dims: &[i64]) -> Buf {
    let mut b = Buf {
        dims: dims.to_vec(),
        raw: XLA_FFI_Buffer {
            struct_size: XLA_FFI_Buffer_STRUCT_SIZE,
            extension_start: null_mut(),
            dtype,
            data,
            rank: dims.len() as i64,
            dims: null_mut(),
        },
    };
    b.raw.dims = b.dims.as_mut_ptr();
    b
}

struct Attr {
    name: Box<XLA_FFI_ByteSpan>,
    kind: XLA_FFI_AttrType,
    value: *mut c_void,
    /// Frees what `value` points to.
    free: Box<dyn FnMut()>,
}

impl Drop for Attr {
    fn drop(&mut self) {
        (self.free)();
    }
}

/// A frame and everything it points to (kept alive by the struct).
struct Frame {
    api: Box<XLA_FFI_Api>,
    args: Vec<Buf>,
    rets: Vec<Buf>,
    arg_types: Vec<XLA_FFI_ArgType>,
    ret_types: Vec<XLA_FFI_RetType>,
    arg_ptrs: Vec<*mut c_void>,
    ret_ptrs: Vec<*mut c_void>,
    attr_types: Vec<XLA_FFI_AttrType>,
    attr_names: Vec<*mut XLA_FFI_ByteSpan>,
    attr_ptrs: Vec<*mut c_void>,
    attrs: Vec<Attr>,
    frame: XLA_FFI_CallFrame,
}

impl Frame {
    fn new(args: Vec<Buf>, rets: Vec<Buf>, attrs: Vec<Attr>) -> Box<Self> {
        let mut f = Box::new(Frame {
            api: Box::new(api(XLA_FFI_API_MAJOR)),
            arg_types: vec![XLA_FFI_ArgType::BUFFER; args.len()],
            ret_types: vec![XLA_FFI_RetType::BUFFER; rets.len()],
            args,
            rets,
            arg_ptrs: vec![],
            ret_ptrs: vec![],
            attr_types: vec![],
            attr_names: vec![],
            attr_ptrs: vec![],
            attrs,
            // SAFETY: all-zero is a valid (NULL-filled) frame, filled in by link().
            frame: unsafe { std::mem::zeroed() },
        });
        f.link();
        f
    }

    /// Points the frame at its parts (again, after a test changed them).
    fn link(&mut self) {
        self.arg_ptrs = self.args.iter_mut().map(|b| (&raw mut b.raw).cast()).collect();
        self.ret_ptrs = self.rets.iter_mut().map(|b| (&raw mut b.raw).cast()).collect();
        self.attr_types = self.attrs.iter().map(|a| a.kind).collect();
        self.attr_names = self.attrs.iter_mut().map(|a| &raw mut *a.name).collect();
        self.attr_ptrs = self.attrs.iter().map(|a| a.value).collect();
        self.frame = XLA_FFI_CallFrame {
            struct_size: XLA_FFI_CallFrame_STRUCT_SIZE,
            extension_start: null_mut(),
            api: (&raw mut *self.api).cast_const(),
            ctx: null_mut(),
            stage: XLA_FFI_ExecutionStage::EXECUTE,
            args: XLA_FFI_Args {
                struct_size: XLA_FFI_Args_STRUCT_SIZE,
                extension_start: null_mut(),
                size: self.args.len() as i64,
                types: self.arg_types.as_mut_ptr(),
                args: self.arg_ptrs.as_mut_ptr(),
            },
            rets: XLA_FFI_Rets {
                struct_size: XLA_FFI_Rets_STRUCT_SIZE,
                extension_start: null_mut(),
                size: self.rets.len() as i64,
                types: self.ret_types.as_mut_ptr(),
                rets: self.ret_ptrs.as_mut_ptr(),
            },
            attrs: XLA_FFI_Attrs {
                struct_size: XLA_FFI_Attrs_STRUCT_SIZE,
                extension_start: null_mut(),
                size: self.attrs.len() as i64,
                types: self.attr_types.as_mut_ptr(),
                names: self.attr_names.as_mut_ptr(),
                attrs: self.attr_ptrs.as_mut_ptr(),
            },
            future: null_mut(),
        };
    }

    /// Operand `i`'s struct, reached through the pointer the frame holds (so writing it keeps the
    /// frame's pointers valid under Stacked Borrows).
    fn arg(&mut self, i: usize) -> &mut XLA_FFI_Buffer {
        // SAFETY: a pointer link() derived from a live box of self.
        unsafe { &mut *self.arg_ptrs[i].cast::<XLA_FFI_Buffer>() }
    }

    /// Result `i`'s struct, as arg().
    fn ret(&mut self, i: usize) -> &mut XLA_FFI_Buffer {
        // SAFETY: as in arg().
        unsafe { &mut *self.ret_ptrs[i].cast::<XLA_FFI_Buffer>() }
    }

    fn call(&mut self, h: XLA_FFI_Handler) -> Result<(), (XLA_FFI_Error_Code, String)> {
        // SAFETY: a frame whose every pointer points into self, alive for the call.
        outcome(unsafe { h(&raw mut self.frame) })
    }
}

fn span(s: &'static str) -> Box<XLA_FFI_ByteSpan> {
    Box::new(XLA_FFI_ByteSpan { ptr: s.as_ptr().cast::<c_char>(), len: s.len() })
}

fn scalar<T: Copy + 'static>(name: &'static str, dtype: XLA_FFI_DataType, v: T) -> Attr {
    let value = Box::into_raw(Box::new(v));
    let s = Box::into_raw(Box::new(XLA_FFI_Scalar { dtype, value: value.cast() }));
    let free = Box::new(move || {
        // SAFETY: made by Box::into_raw above, freed once (on drop).
        drop(unsafe { (Box::from_raw(s), Box::from_raw(value)) });
    });
    Attr { name: span(name), kind: XLA_FFI_AttrType::SCALAR, value: s.cast(), free }
}

fn string(name: &'static str, v: &'static str) -> Attr {
    let s = Box::into_raw(span(v));
    // SAFETY: made by Box::into_raw above, freed once (on drop).
    let free = Box::new(move || drop(unsafe { Box::from_raw(s) }));
    Attr { name: span(name), kind: XLA_FFI_AttrType::STRING, value: s.cast(), free }
}

/// An array attribute of `size` elements of `dtype` at `data` (any pointer, for hostile frames).
fn raw_array(name: &'static str, dtype: XLA_FFI_DataType, size: usize, data: *mut c_void) -> Attr {
    let a = Box::into_raw(Box::new(XLA_FFI_Array { dtype, size, data }));
    // SAFETY: made by Box::into_raw above, freed once (on drop).
    let free = Box::new(move || drop(unsafe { Box::from_raw(a) }));
    Attr { name: span(name), kind: XLA_FFI_AttrType::ARRAY, value: a.cast(), free }
}

/// An array attribute holding `v` (kept alive by the attribute).
fn array<T: Copy + 'static>(name: &'static str, dtype: XLA_FFI_DataType, v: &[T]) -> Attr {
    let data = Box::into_raw(v.to_vec().into_boxed_slice());
    let mut a = raw_array(name, dtype, v.len(), data.cast());
    let mut free_array = std::mem::replace(&mut a.free, Box::new(|| {}));
    a.free = Box::new(move || {
        free_array();
        // SAFETY: made by Box::into_raw above, freed once (on drop).
        drop(unsafe { Box::from_raw(data) });
    });
    a
}

fn f32s(v: &mut [f32]) -> *mut c_void {
    v.as_mut_ptr().cast()
}

// --- handlers ---

dlbridge::xla_handler! {
    /// `out = a * x + y`, float32 vectors.
    fn saxpy(call, operands: 2, results: 1, attrs: ["a"]) {
        let a: f32 = call.attr("a")?;
        let x = call.input::<f32, Rank<1>>(0, "x")?;
        let y = call.input::<f32, Rank<1>>(1, "y")?;
        let mut out = call.output::<f32, Rank<1>>(0, "out")?;
        let (x, y) = (x.as_slice()?, y.as_slice()?);
        for ((o, x), y) in out.as_slice_mut()?.iter_mut().zip(x.iter()).zip(y.iter()) {
            *o = a * x + y;
        }
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// In place: result 0 aliases operand 1; reads x, reads and writes the result.
    fn saxpy_inplace(call, operands: 2, results: 1, attrs: ["a"]) {
        let a: f32 = call.attr("a")?;
        let x = call.input::<f32, Rank<1>>(0, "x")?;
        let mut y = call.output::<f32, Rank<1>>(0, "y")?;
        let x = x.as_slice()?;
        for (y, x) in y.as_slice_mut()?.iter_mut().zip(x.iter()) {
            *y += a * x;
        }
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// Takes its bool result for writing and writes nothing (as an in-place op that keeps
    /// some of its values does): what the buffer held must read the same afterwards.
    fn bools_untouched(call, operands: 0, results: 1) {
        let mut y = call.output::<bool, Rank<1>>(0, "y")?;
        let _ = y.as_slice_mut()?;
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// Wrong on purpose: reads operand 1 while writing result 0 (which aliases it).
    fn saxpy_reads_aliased(call, operands: 2, results: 1, attrs: ["a"]) {
        let y_in = call.input::<f32, Rank<1>>(1, "y_in")?;
        let mut y = call.output::<f32, Rank<1>>(0, "y")?;
        let r = y_in.as_slice()?;
        let mut w = y.as_slice_mut()?;
        w[0] = r[0];
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// Reads attributes of every kind and checks a fixed-extent shape.
    fn attrs(call, operands: 0, results: 1, attrs: ["eps", "n", "flag", "mode"]) {
        let eps: f64 = call.attr("eps")?;
        let n: i64 = call.attr("n")?;
        let flag: bool = call.attr("flag")?;
        let mode: &str = call.attr("mode")?;
        let mut out = call.output::<f64, (Dim<4>,)>(0, "out")?;
        out.as_slice_mut()?.copy_from_slice(&[eps, n as f64, f64::from(u8::from(flag)), mode.len() as f64]);
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// Reads an array attribute of each element type: out = [sum(i64s), sum(i32s), sum(f32s),
    /// sum(f64s), count of trues, number of elements in all].
    fn arrays(call, operands: 0, results: 1, attrs: ["i64s", "i32s", "f32s", "f64s", "bools"]) {
        let a: &[i64] = call.attr("i64s")?;
        let b: &[i32] = call.attr("i32s")?;
        let c: &[f32] = call.attr("f32s")?;
        let d: &[f64] = call.attr("f64s")?;
        let e: &[bool] = call.attr("bools")?;
        let mut out = call.output::<f64, (Dim<6>,)>(0, "out")?;
        out.as_slice_mut()?.copy_from_slice(&[
            a.iter().sum::<i64>() as f64,
            f64::from(b.iter().sum::<i32>()),
            f64::from(c.iter().sum::<f32>()),
            d.iter().sum(),
            e.iter().filter(|&&t| t).count() as f64,
            (a.len() + b.len() + c.len() + d.len() + e.len()) as f64,
        ]);
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// Panics.
    fn panics(_call, operands: 0, results: 0) {
        panic!("kernel bug")
    }
}

dlbridge::xla_handler! {
    /// Returns its own error.
    fn refuses(_call, operands: 0, results: 0) {
        Err(FfiError::invalid_argument("x: must be sorted"))
    }
}

dlbridge::xla_handler! {
    /// A CUDA handler: reports the stream and device it was given (no memory touched).
    cuda fn on_cuda(call, operands: 1, results: 0) {
        let stream = call.stream()?;
        let x = call.input_any(0, "x")?.typed::<f32, Rank<1>, Cuda>()?;
        if call.input::<f32, Rank<1>>(0, "x").is_ok() {
            return Err(FfiError::invalid_argument("a cuda buffer passed as a cpu one"));
        }
        if stream as usize != 0x5eed || call.device().to_string() != "cuda:1" || x.as_slice().is_ok() {
            return Err(FfiError::invalid_argument("wrong stream, device, or a host slice of device memory"));
        }
        Ok(())
    }
}

fn saxpy_frame(x: &mut [f32], y: &mut [f32], out: &mut [f32]) -> Box<Frame> {
    let n = x.len() as i64;
    Frame::new(
        vec![buf(XLA_FFI_DataType::F32, f32s(x), &[n]), buf(XLA_FFI_DataType::F32, f32s(y), &[n])],
        vec![buf(XLA_FFI_DataType::F32, f32s(out), &[n])],
        vec![scalar("a", XLA_FFI_DataType::F32, 2.0f32)],
    )
}

fn invalid(r: Result<(), (XLA_FFI_Error_Code, String)>, words: &[&str]) {
    let (code, message) = r.expect_err("refused");
    assert_eq!(code, XLA_FFI_Error_Code::INVALID_ARGUMENT, "{message}");
    for w in words {
        assert!(message.contains(w), "{message:?} lacks {w:?}");
    }
}

// --- tests ---

#[test]
fn a_handler_computes_into_its_result() {
    let (mut x, mut y, mut out) = ([1.0f32, 2.0, 3.0], [10.0f32, 20.0, 30.0], [0.0f32; 3]);
    let mut f = saxpy_frame(&mut x, &mut y, &mut out);
    f.call(saxpy).unwrap();
    drop(f);
    assert_eq!(out, [12.0, 24.0, 36.0]);
}

#[test]
fn an_in_place_handler_writes_its_aliased_result() {
    let (mut x, mut y) = ([1.0f32, 2.0], [10.0f32, 20.0]);
    let yp = f32s(&mut y);
    // Result 0 is operand 1's memory, as XLA passes an input_output_aliases pair.
    let mut f = Frame::new(
        vec![buf(XLA_FFI_DataType::F32, f32s(&mut x), &[2]), buf(XLA_FFI_DataType::F32, yp, &[2])],
        vec![buf(XLA_FFI_DataType::F32, yp, &[2])],
        vec![scalar("a", XLA_FFI_DataType::F32, 3.0f32)],
    );
    f.call(saxpy_inplace).unwrap();
    // Reading the aliased operand while writing the result is refused, not undefined behaviour.
    let (code, message) = f.call(saxpy_reads_aliased).unwrap_err();
    assert_eq!(code, XLA_FFI_Error_Code::FAILED_PRECONDITION, "{message}");
    assert!(message.starts_with("saxpy_reads_aliased: y: "), "{message}");
    drop(f);
    assert_eq!(y, [13.0, 26.0]);
}

/// A bool result whose bytes are not all 0 or 1 (a fresh buffer, or the caller's own tensor
/// aliased as the result of an in-place op: torch and numpy read any nonzero byte as True) is
/// made valid byte by byte, nonzero to 1, so the caller's values read the same. Before, the whole
/// buffer was zeroed: an aliased tensor with one byte 2 lost every True (review).
#[test]
fn a_bool_result_keeps_the_truth_of_its_bytes() {
    let mut y: [u8; 4] = [0, 1, 2, 255];
    let mut f = Frame::new(vec![], vec![buf(XLA_FFI_DataType::PRED, y.as_mut_ptr().cast(), &[4])], vec![]);
    f.call(bools_untouched).unwrap();
    drop(f);
    assert_eq!(y, [0, 1, 1, 1]);
}

#[test]
fn refusals_name_the_argument() {
    let (mut x, mut y, mut out) = ([1.0f32; 3], [1.0f32; 3], [0.0f32; 3]);
    let mut f = saxpy_frame(&mut x, &mut y, &mut out);
    f.arg(1).dtype = XLA_FFI_DataType::F64;
    invalid(f.call(saxpy), &["saxpy: y: expected float32 1-d", "got float64"]);
    drop(f);
    let mut f = Frame::new(
        vec![
            buf(XLA_FFI_DataType::F32, f32s(&mut x), &[3, 1]),
            buf(XLA_FFI_DataType::F32, f32s(&mut y), &[3]),
        ],
        vec![buf(XLA_FFI_DataType::F32, f32s(&mut out), &[3])],
        vec![scalar("a", XLA_FFI_DataType::F32, 2.0f32)],
    );
    invalid(f.call(saxpy), &["saxpy: x: expected float32 1-d", "(3, 1)"]);
}

#[test]
fn attributes_are_read_by_name_and_type() {
    let mut out = [0.0f64; 4];
    let mut f = Frame::new(
        vec![],
        vec![buf(XLA_FFI_DataType::F64, out.as_mut_ptr().cast(), &[4])],
        vec![
            scalar("eps", XLA_FFI_DataType::F64, 0.5f64),
            string("mode", "fast"),
            scalar("n", XLA_FFI_DataType::S64, 7i64),
            scalar("flag", XLA_FFI_DataType::PRED, 1u8),
        ],
    );
    f.call(attrs).unwrap();
    assert_eq!(out, [0.5, 7.0, 1.0, 4.0]);
    // eps as float32: a type error naming the attribute and what to change in the kernel's
    // declaration (a dlbridge kernel passes the declared type, whatever Python number it got).
    f.attrs[0] = scalar("eps", XLA_FFI_DataType::F32, 0.5f32);
    f.link();
    invalid(
        f.call(attrs),
        &[
            "attribute eps: the handler reads a f64 scalar, but the call passed float32",
            "declare the attribute \"float64\" where the kernel is declared (KernelDef.attrs",
        ],
    );
    // A bool that is not 0 or 1.
    f.attrs[0] = scalar("eps", XLA_FFI_DataType::F64, 0.5f64);
    f.attrs[3] = scalar("flag", XLA_FFI_DataType::PRED, 7u8);
    f.link();
    invalid(f.call(attrs), &["attribute flag: a bool of byte 7"]);
    // Missing.
    f.attrs.truncate(2);
    f.link();
    invalid(
        f.call(attrs),
        &[
            "attrs: wrong attributes: the handler reads eps, n, flag, mode, the call has eps, mode (missing: n, flag)",
        ],
    );
    // A fixed extent.
    f.attrs.push(scalar("n", XLA_FFI_DataType::S64, 7i64));
    f.attrs.push(scalar("flag", XLA_FFI_DataType::PRED, 0u8));
    f.link();
    // SAFETY: the result's one extent, through the frame's pointer.
    unsafe { *f.ret(0).dims = 3 };
    invalid(f.call(attrs), &["attrs: out: expected writable float64 (4,)", "got float64 (3,)"]);
}

fn arrays_frame(out: &mut [f64; 6]) -> Box<Frame> {
    Frame::new(
        vec![],
        vec![buf(XLA_FFI_DataType::F64, out.as_mut_ptr().cast(), &[6])],
        vec![
            array("i64s", XLA_FFI_DataType::S64, &[1i64 << 40, -2]),
            array("i32s", XLA_FFI_DataType::S32, &[3i32, 4]),
            array("f32s", XLA_FFI_DataType::F32, &[0.5f32]),
            array("f64s", XLA_FFI_DataType::F64, &[0.25f64, 0.5, 1.0]),
            array("bools", XLA_FFI_DataType::PRED, &[1u8, 0, 1]),
        ],
    )
}

#[test]
fn array_attributes_are_read_as_slices_of_their_element_type() {
    let mut out = [0.0f64; 6];
    let mut f = arrays_frame(&mut out);
    f.call(arrays).unwrap();
    assert_eq!(out, [((1i64 << 40) - 2) as f64, 7.0, 0.5, 1.75, 2.0, 11.0]);
    // A bool array as bytes (how jax passes one: XLA has no bool array attribute).
    f.attrs[4] = array("bools", XLA_FFI_DataType::U8, &[0u8, 1, 1, 1]);
    f.link();
    f.call(arrays).unwrap();
    assert_eq!(out[4..], [3.0, 12.0]);
    // Empty arrays: no data pointer needed.
    for (i, (name, dtype)) in [
        ("i64s", XLA_FFI_DataType::S64),
        ("i32s", XLA_FFI_DataType::S32),
        ("f32s", XLA_FFI_DataType::F32),
        ("f64s", XLA_FFI_DataType::F64),
        ("bools", XLA_FFI_DataType::PRED),
    ]
    .into_iter()
    .enumerate()
    {
        f.attrs[i] = raw_array(name, dtype, 0, null_mut());
    }
    f.link();
    f.call(arrays).unwrap();
    assert_eq!(out, [0.0; 6]);
}

#[test]
fn hostile_array_attributes_are_refused_never_read() {
    let mut out = [0.0f64; 6];
    let mut f = arrays_frame(&mut out);
    // The wrong element type: names the attribute and the declaration to change.
    f.attrs[0] = array("i64s", XLA_FFI_DataType::S32, &[1i32, 2]);
    f.link();
    invalid(
        f.call(arrays),
        &[
            "attribute i64s: the handler reads an array of i64, but the call passed an array of int32",
            "declare the attribute \"int64[]\" where the kernel is declared",
        ],
    );
    // A scalar where an array is read.
    f.attrs[0] = scalar("i64s", XLA_FFI_DataType::S64, 1i64);
    f.link();
    invalid(f.call(arrays), &["attribute i64s: expected an array of i64, got attribute kind 3 (a scalar)"]);
    // A NULL array struct.
    f.attrs[0] = array("i64s", XLA_FFI_DataType::S64, &[1i64]);
    f.attrs[0].value = null_mut();
    f.link();
    invalid(f.call(arrays), &["attribute i64s: a NULL array"]);
    // NULL data with a nonzero size.
    f.attrs[0] = raw_array("i64s", XLA_FFI_DataType::S64, 3, null_mut());
    f.link();
    invalid(f.call(arrays), &["attribute i64s: an array of 3 elements of i64 at address 0x0"]);
    // A size whose bytes overflow the address space (never multiplied unchecked, never read).
    let mut word = 0i64;
    f.attrs[0] = raw_array("i64s", XLA_FFI_DataType::S64, usize::MAX / 4, (&raw mut word).cast());
    f.link();
    invalid(f.call(arrays), &["attribute i64s: an array of", "exceeds the address space"]);
    // Data whose end passes the end of the address space.
    f.attrs[0] = raw_array("i64s", XLA_FFI_DataType::S64, 4, (usize::MAX - 15) as *mut c_void);
    f.link();
    invalid(f.call(arrays), &["attribute i64s: an array of 4 elements of i64 at address"]);
    // Misaligned data.
    let words = [0u64; 3];
    let odd = words.as_ptr().cast::<u8>().wrapping_add(1).cast_mut();
    f.attrs[0] = raw_array("i64s", XLA_FFI_DataType::S64, 2, odd.cast());
    f.link();
    invalid(f.call(arrays), &["attribute i64s: an array of 2 elements of i64 at address"]);
    // A bool array with a byte that is no bool.
    f.attrs[0] = array("i64s", XLA_FFI_DataType::S64, &[1i64]);
    f.attrs[4] = array("bools", XLA_FFI_DataType::PRED, &[1u8, 2]);
    f.link();
    invalid(f.call(arrays), &["attribute bools: invalid bool values in the array"]);
    f.attrs[4] = array("bools", XLA_FFI_DataType::U8, &[255u8]);
    f.link();
    invalid(f.call(arrays), &["attribute bools: invalid bool values in the array"]);
    f.attrs[4] = array("bools", XLA_FFI_DataType::S8, &[1u8]);
    f.link();
    invalid(
        f.call(arrays),
        &["attribute bools: the handler reads an array of bool, but the call passed an array of int8"],
    );
    // Each element type checked: f32 read, f64 passed.
    f.attrs[4] = array("bools", XLA_FFI_DataType::PRED, &[1u8]);
    f.attrs[2] = array("f32s", XLA_FFI_DataType::F64, &[1.0f64]);
    f.link();
    invalid(
        f.call(arrays),
        &["attribute f32s: the handler reads an array of f32, but the call passed an array of float64"],
    );
    // A string read as an array, an array read as a string.
    f.attrs[2] = string("f32s", "abc");
    f.link();
    invalid(f.call(arrays), &["attribute f32s: expected an array of f32, got attribute kind 4 (a string)"]);
    let mut g = Frame::new(
        vec![],
        vec![buf(XLA_FFI_DataType::F64, out.as_mut_ptr().cast(), &[4])],
        vec![
            scalar("eps", XLA_FFI_DataType::F64, 0.5f64),
            array("mode", XLA_FFI_DataType::S64, &[1i64]),
            scalar("n", XLA_FFI_DataType::S64, 7i64),
            scalar("flag", XLA_FFI_DataType::PRED, 1u8),
        ],
    );
    invalid(g.call(attrs), &["attribute mode: expected a string, got attribute kind 1 (an array)"]);
    // An array read as a scalar: the kind named too.
    g.attrs[1] = string("mode", "fast");
    g.attrs[0] = array("eps", XLA_FFI_DataType::F64, &[0.5f64]);
    g.link();
    invalid(g.call(attrs), &["attribute eps: expected a f64 scalar, got attribute kind 1 (an array)"]);
    assert_eq!(out, [0.0; 6], "nothing was written by a refused call");
}

#[test]
fn panics_and_errors_become_xla_errors() {
    let mut f = Frame::new(vec![], vec![], vec![]);
    let (code, message) = f.call(panics).unwrap_err();
    assert_eq!((code, message.as_str()), (XLA_FFI_Error_Code::INTERNAL, "panics: panicked: kernel bug"));
    invalid(f.call(refuses), &["refuses: x: must be sorted"]);
}

#[test]
fn malformed_frames_are_errors() {
    let (mut x, mut y, mut out) = ([1.0f32; 3], [1.0f32; 3], [0.0f32; 3]);
    let xp = f32s(&mut x);
    let mut f = Frame::new(
        vec![buf(XLA_FFI_DataType::F32, xp, &[3]), buf(XLA_FFI_DataType::F32, f32s(&mut y), &[3])],
        vec![buf(XLA_FFI_DataType::F32, f32s(&mut out), &[3])],
        vec![scalar("a", XLA_FFI_DataType::F32, 2.0f32)],
    );
    // Too few operands, a negative count, no arrays.
    f.frame.args.size = 1;
    invalid(f.call(saxpy), &["saxpy: wrong number of operands: expected 2, got 1"]);
    f.frame.args.size = -1;
    invalid(f.call(saxpy), &["args: size -1"]);
    f.frame.args.size = 2;
    let types = f.frame.args.types;
    f.frame.args.types = null_mut();
    invalid(f.call(saxpy), &["args: 2 entries without"]);
    f.frame.args.types = types;
    // A NULL buffer, an unknown kind, a buffer of an older (smaller) layout.
    let args = f.frame.args.args;
    // SAFETY: the frame's operand array (2 entries), written through its own pointer.
    let first = unsafe { args.read() };
    // SAFETY: as above.
    unsafe { args.write(null_mut()) };
    invalid(f.call(saxpy), &["x: operand 0 is a NULL"]);
    // SAFETY: as above.
    unsafe { args.write(first) };
    // SAFETY: the frame's kind array, as above.
    unsafe { types.write(XLA_FFI_ArgType(9)) };
    invalid(f.call(saxpy), &["x: operand 0 is of kind 9"]);
    // SAFETY: as above.
    unsafe { types.write(XLA_FFI_ArgType::BUFFER) };
    f.arg(0).struct_size = 16;
    invalid(f.call(saxpy), &["x: buffer struct_size 16"]);
    f.arg(0).struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    // Rank, extents, data, element type.
    f.arg(0).rank = 65;
    invalid(f.call(saxpy), &["x: rank 65"]);
    f.arg(0).rank = 1;
    let dims = f.arg(0).dims;
    f.arg(0).dims = null_mut();
    invalid(f.call(saxpy), &["x: rank 1 with NULL"]);
    f.arg(0).dims = dims;
    // SAFETY: the operand's one extent, through its own pointer.
    unsafe { dims.write(-3) };
    invalid(f.call(saxpy), &["x: negative extent -3"]);
    // SAFETY: as above.
    unsafe { dims.write(i64::MAX) };
    invalid(f.call(saxpy), &["exceed the address space"]);
    // SAFETY: as above.
    unsafe { dims.write(3) };
    f.arg(0).data = null_mut();
    invalid(f.call(saxpy), &["x: 3 elements at address 0x0"]);
    f.arg(0).data = xp.cast::<u8>().wrapping_add(1).cast();
    invalid(f.call(saxpy), &["x: data", "is not aligned for float32"]);
    f.arg(0).data = xp;
    f.arg(0).dtype = XLA_FFI_DataType(99);
    invalid(f.call(saxpy), &["x: XLA element type 99"]);
    f.arg(0).dtype = XLA_FFI_DataType::F32;
    // An old call frame, an older attribute list, the wrong stage.
    f.frame.struct_size = 100;
    invalid(f.call(saxpy), &["saxpy: call frame of 100 bytes"]);
    f.frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
    f.frame.attrs.struct_size = 8;
    invalid(f.call(saxpy), &["attrs: struct_size 8"]);
    f.frame.attrs.struct_size = XLA_FFI_Attrs_STRUCT_SIZE;
    f.frame.stage = XLA_FFI_ExecutionStage::PREPARE;
    invalid(f.call(saxpy), &["execution stage 1"]);
    f.frame.stage = XLA_FFI_ExecutionStage::EXECUTE;
    f.call(saxpy).unwrap();
    drop(f);
    assert_eq!(out, [3.0; 3]);
}

#[test]
fn the_api_version_is_checked_and_an_unusable_table_is_left_alone() {
    let (mut x, mut y, mut out) = ([1.0f32; 3], [1.0f32; 3], [0.0f32; 3]);
    let mut f = saxpy_frame(&mut x, &mut y, &mut out);
    let table = f.frame.api.cast_mut();
    // SAFETY: the frame's table, written through the frame's own pointer.
    unsafe { *table = api(1) };
    let (code, message) = f.call(saxpy).unwrap_err();
    assert_eq!(code, XLA_FFI_Error_Code::FAILED_PRECONDITION);
    assert!(message.contains("XLA FFI API 1.3 (this handler implements 0.3)"), "{message}");
    // No table, or one too small to make an error with: nothing is touched, NULL comes back.
    // SAFETY: as above.
    unsafe { (*table).struct_size = 16 };
    f.call(saxpy).unwrap();
    // A table that ends before XLA_FFI_Error_Destroy (a function the layer may call).
    // SAFETY: as above.
    unsafe { (*table).struct_size = std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_Error_Destroy) };
    f.call(saxpy).unwrap();
    f.frame.api = null();
    f.call(saxpy).unwrap();
    drop(f);
    assert_eq!(out, [0.0; 3]);
    // SAFETY: NULL is handled before anything is read.
    assert!(unsafe { saxpy(null_mut()) }.is_null());
}

#[test]
fn the_metadata_query_gets_the_api_version() {
    let mut f = Frame::new(vec![], vec![], vec![]);
    let metadata = Box::into_raw(Box::new(XLA_FFI_Metadata {
        struct_size: XLA_FFI_Metadata_STRUCT_SIZE,
        api_version: XLA_FFI_Api_Version {
            struct_size: 0,
            extension_start: null_mut(),
            major_version: -1,
            minor_version: -1,
        },
        traits: 99,
        state_type_id: XLA_FFI_TypeId { type_id: 0 },
    }));
    let mut ext = XLA_FFI_Metadata_Extension {
        extension_base: XLA_FFI_Extension_Base {
            struct_size: XLA_FFI_Metadata_Extension_STRUCT_SIZE,
            type_: XLA_FFI_Extension_Type::METADATA,
            next: null_mut(),
        },
        metadata,
    };
    f.frame.extension_start = (&raw mut ext).cast();
    // The body never runs (it would panic).
    f.call(panics).unwrap();
    // SAFETY: the box made above, read and written only through `metadata`.
    let m = unsafe { &mut *metadata };
    assert_eq!((m.api_version.major_version, m.api_version.minor_version), (0, 3));
    assert_eq!(m.api_version.struct_size, XLA_FFI_Api_Version_STRUCT_SIZE);
    assert_eq!(m.traits, 0);
    m.struct_size = 8;
    invalid(f.call(panics), &["panics: metadata of 8 bytes"]);
    // SAFETY: made by Box::into_raw above, freed once.
    drop(unsafe { Box::from_raw(metadata) });
}

#[test]
fn a_cuda_handler_gets_the_stream_and_device_of_the_call() {
    let mut f = Frame::new(
        vec![buf(XLA_FFI_DataType::F32, std::ptr::without_provenance_mut(0x1000), &[4])],
        vec![],
        vec![],
    );
    f.call(on_cuda).unwrap();
}

#[test]
fn xla_element_types_map_to_dlpack() {
    use dlbridge::DataType;
    use dlbridge::xla::data_type;
    assert_eq!(data_type(XLA_FFI_DataType::F32), Some(DataType::FLOAT32));
    assert_eq!(data_type(XLA_FFI_DataType::BF16), Some(DataType::BFLOAT16));
    assert_eq!(data_type(XLA_FFI_DataType::PRED), Some(DataType::BOOL));
    assert_eq!(data_type(XLA_FFI_DataType::C128), Some(DataType::COMPLEX128));
    assert_eq!(data_type(XLA_FFI_DataType::TOKEN), None);
    assert_eq!(data_type(XLA_FFI_DataType(1000)), None);
}

// --- structs of an older XLA: shorter than this crate's, read only below their struct_size ---

/// The first `size` bytes of `value` in an allocation of exactly `size` bytes, its `struct_size`
/// (the first field) set to `size`: a struct as an older (or another) XLA lays it out, shorter
/// than this crate's. Miri reports any read past the end.
struct Short {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Short {
    fn of<T>(value: &T, size: usize) -> Self {
        assert!((size_of::<usize>()..=size_of::<T>()).contains(&size));
        let layout = std::alloc::Layout::from_size_align(size, align_of::<T>()).unwrap();
        // SAFETY: a layout of non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null());
        // SAFETY: `size` bytes of `value` (at most its size) into a fresh allocation of `size`
        // bytes; its first field is a usize (every XLA FFI struct's struct_size).
        unsafe {
            std::ptr::copy_nonoverlapping((value as *const T).cast::<u8>(), ptr, size);
            ptr.cast::<usize>().write(size);
        }
        Short { ptr, layout }
    }

    fn as_ptr<T>(&self) -> *mut T {
        self.ptr.cast()
    }
}

impl Drop for Short {
    fn drop(&mut self) {
        // SAFETY: allocated in Short::of with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// The size of an API table that ends right after `XLA_FFI_Error_Destroy` (an XLA before the
/// stream and device functions): all an error needs.
const OLD_API: usize = std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_Handler_Register);

#[test]
fn an_older_xlas_shorter_api_table_is_read_only_below_its_size() {
    let (mut x, mut y, mut out) = ([1.0f32, 2.0, 3.0], [10.0f32, 20.0, 30.0], [0.0f32; 3]);
    let mut f = saxpy_frame(&mut x, &mut y, &mut out);
    let table = Short::of(&api(XLA_FFI_API_MAJOR), OLD_API);
    f.frame.api = table.as_ptr();
    // A call runs, and its errors are made through the short table.
    f.call(saxpy).unwrap();
    f.arg(1).dtype = XLA_FFI_DataType::F64;
    invalid(f.call(saxpy), &["saxpy: y: expected float32 1-d"]);
    f.arg(1).dtype = XLA_FFI_DataType::F32;
    // A CUDA handler needs the device ordinal, a function this table does not reach.
    let mut g = Frame::new(
        vec![buf(XLA_FFI_DataType::F32, std::ptr::without_provenance_mut(0x1000), &[4])],
        vec![],
        vec![],
    );
    g.frame.api = table.as_ptr();
    let (code, message) = g.call(on_cuda).unwrap_err();
    assert_eq!(code, XLA_FFI_Error_Code::UNIMPLEMENTED, "{message}");
    assert!(message.starts_with("on_cuda: the XLA FFI API table lacks a function"), "{message}");
    // A table too short to make an error with (up to the version only): nothing is read past it,
    // nothing runs, NULL comes back.
    let tiny = Short::of(&api(XLA_FFI_API_MAJOR), std::mem::offset_of!(XLA_FFI_Api, internal_api));
    f.frame.api = tiny.as_ptr();
    out = [0.0; 3];
    f.call(saxpy).unwrap();
    drop((f, g));
    assert_eq!(out, [0.0; 3]);
}

#[test]
fn an_older_xlas_shorter_call_frame_is_read_only_below_its_size() {
    let (mut x, mut y, mut out) = ([1.0f32, 2.0, 3.0], [10.0f32, 20.0, 30.0], [0.0f32; 3]);
    let f = saxpy_frame(&mut x, &mut y, &mut out);
    let call = |size: usize| {
        let frame = Short::of(&f.frame, size);
        // SAFETY: a frame of `size` bytes whose pointers point into `f`, alive for the call.
        outcome(unsafe { saxpy(frame.as_ptr()) })
    };
    // The frame the header describes: up to `attrs`, without the newer `future`.
    call(XLA_FFI_CallFrame_STRUCT_SIZE).unwrap();
    // Shorter: an error through the API table when the frame reaches it...
    invalid(call(std::mem::offset_of!(XLA_FFI_CallFrame, ctx)), &["saxpy: call frame of 24 bytes"]);
    invalid(call(std::mem::offset_of!(XLA_FFI_CallFrame, args)), &["saxpy: call frame of 40 bytes"]);
    // ... and nothing read past the frame when it does not (no table: NULL, nothing run).
    call(std::mem::offset_of!(XLA_FFI_CallFrame, api)).unwrap();
    call(size_of::<usize>()).unwrap();
    drop(f);
    assert_eq!(out, [12.0, 24.0, 36.0]);
}

// --- the metadata query ---

fn metadata_ext(metadata: *mut XLA_FFI_Metadata) -> Box<XLA_FFI_Metadata_Extension> {
    Box::new(XLA_FFI_Metadata_Extension {
        extension_base: XLA_FFI_Extension_Base {
            struct_size: XLA_FFI_Metadata_Extension_STRUCT_SIZE,
            type_: XLA_FFI_Extension_Type::METADATA,
            next: null_mut(),
        },
        metadata,
    })
}

fn blank_metadata() -> *mut XLA_FFI_Metadata {
    Box::into_raw(Box::new(XLA_FFI_Metadata {
        struct_size: XLA_FFI_Metadata_STRUCT_SIZE,
        api_version: XLA_FFI_Api_Version {
            struct_size: 0,
            extension_start: null_mut(),
            major_version: -1,
            minor_version: -1,
        },
        traits: 99,
        state_type_id: XLA_FFI_TypeId { type_id: 0 },
    }))
}

#[test]
fn the_metadata_query_is_answered_without_an_api_table() {
    // Some XLA builds send the query with a NULL API table: the answer needs none.
    let metadata = blank_metadata();
    let mut ext = metadata_ext(metadata);
    let mut f = Frame::new(vec![], vec![], vec![]);
    f.frame.api = null();
    f.frame.extension_start = (&raw mut *ext).cast();
    // The body never runs (it would panic, and with no table the panic could not be reported).
    f.call(panics).unwrap();
    // SAFETY: the box made above, read only through `metadata`.
    let m = unsafe { &*metadata };
    assert_eq!((m.api_version.major_version, m.api_version.minor_version), (0, 3));
    assert_eq!(m.api_version.struct_size, XLA_FFI_Api_Version_STRUCT_SIZE);
    assert_eq!(m.traits, 0);
    // A metadata struct of an older XLA (up to `traits`, allocated so), in a frame that ends
    // after its extension chain: answered, nothing read or written past either.
    // SAFETY: read for the copy only.
    let old = Short::of(unsafe { &*metadata }, XLA_FFI_Metadata_STRUCT_SIZE);
    ext.metadata = old.as_ptr();
    let frame = Short::of(&f.frame, std::mem::offset_of!(XLA_FFI_CallFrame, api));
    // SAFETY: the frame's pointers point into `ext`, alive for the call.
    outcome(unsafe { panics(frame.as_ptr()) }).unwrap();
    // SAFETY: the short metadata's fields below its size.
    let (major, traits) = unsafe {
        let m = old.as_ptr::<XLA_FFI_Metadata>();
        ((*m).api_version.major_version, (*m).traits)
    };
    assert_eq!((major, traits), (0, 0));
    // A malformed query without a table cannot be refused (no error can be made): NULL, untouched.
    ext.metadata = metadata;
    // SAFETY: the box made above, written only through `metadata`.
    unsafe { (*metadata).struct_size = 8 };
    // SAFETY: as above.
    unsafe { (*metadata).traits = 7 };
    f.call(panics).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { (*metadata).traits }, 7);
    // SAFETY: made by Box::into_raw above, freed once.
    drop(unsafe { Box::from_raw(metadata) });
}

#[test]
fn the_metadata_extension_is_found_anywhere_in_the_chain() {
    let metadata = blank_metadata();
    let mut ext = metadata_ext(metadata);
    let mut other = Box::new(XLA_FFI_Extension_Base {
        struct_size: XLA_FFI_Extension_Base_STRUCT_SIZE,
        type_: XLA_FFI_Extension_Type(77),
        next: (&raw mut *ext).cast(),
    });
    let mut f = Frame::new(vec![], vec![], vec![]);
    f.frame.extension_start = &raw mut *other;
    f.call(panics).unwrap();
    // SAFETY: the box made above, read only through `metadata`.
    assert_eq!(unsafe { (*metadata).api_version.minor_version }, XLA_FFI_API_MINOR);
    // A chain without the query: the call runs. A cycle: refused, not followed forever.
    other.next = null_mut();
    f.frame.extension_start = &raw mut *other;
    let (code, message) = f.call(panics).unwrap_err();
    assert_eq!((code, message.as_str()), (XLA_FFI_Error_Code::INTERNAL, "panics: panicked: kernel bug"));
    other.next = &raw mut *other;
    invalid(f.call(panics), &["panics: more than 16 extensions"]);
    // SAFETY: made by Box::into_raw above, freed once.
    drop(unsafe { Box::from_raw(metadata) });
}

// --- arity: what the handler declared, checked before the body runs ---

#[test]
fn extra_operands_results_and_attributes_are_refused_before_the_body_runs() {
    let (mut x, mut y, mut z, mut out, mut out2) =
        ([1.0f32; 3], [1.0f32; 3], [1.0f32; 3], [0.0f32; 3], [0.0f32; 3]);
    let f32s3 = |p| buf(XLA_FFI_DataType::F32, p, &[3]);
    // One operand too many (the body would read two and ignore the third).
    let mut f = Frame::new(
        vec![f32s3(f32s(&mut x)), f32s3(f32s(&mut y)), f32s3(f32s(&mut z))],
        vec![f32s3(f32s(&mut out))],
        vec![scalar("a", XLA_FFI_DataType::F32, 2.0f32)],
    );
    invalid(f.call(saxpy), &["saxpy: wrong number of operands: expected 2, got 3"]);
    drop(f);
    // One result too many (the body would leave it unwritten).
    let mut f = Frame::new(
        vec![f32s3(f32s(&mut x)), f32s3(f32s(&mut y))],
        vec![f32s3(f32s(&mut out)), f32s3(f32s(&mut out2))],
        vec![scalar("a", XLA_FFI_DataType::F32, 2.0f32)],
    );
    invalid(f.call(saxpy), &["saxpy: wrong number of results: expected 1, got 2"]);
    // Too few results.
    f.frame.rets.size = 0;
    invalid(f.call(saxpy), &["saxpy: wrong number of results: expected 1, got 0"]);
    drop(f);
    // An attribute the handler does not read; one misspelt; none.
    let mut f = Frame::new(
        vec![f32s3(f32s(&mut x)), f32s3(f32s(&mut y))],
        vec![f32s3(f32s(&mut out))],
        vec![scalar("a", XLA_FFI_DataType::F32, 2.0f32), scalar("b", XLA_FFI_DataType::F32, 1.0f32)],
    );
    invalid(
        f.call(saxpy),
        &["saxpy: wrong attributes: the handler reads a, the call has a, b (unexpected: b)"],
    );
    f.attrs.remove(0);
    f.link();
    invalid(
        f.call(saxpy),
        &["saxpy: wrong attributes: the handler reads a, the call has b (unexpected: b) (missing: a)"],
    );
    f.attrs.clear();
    f.link();
    invalid(f.call(saxpy), &["saxpy: wrong attributes: the handler reads a, the call has none (missing: a)"]);
    // As many as declared, one twice and one missing: refused too.
    let mut g = Frame::new(
        vec![],
        vec![buf(XLA_FFI_DataType::F64, out2.as_mut_ptr().cast(), &[0])],
        ["eps", "eps", "n", "flag"].map(|n| scalar(n, XLA_FFI_DataType::F64, 0.5f64)).into(),
    );
    invalid(g.call(attrs), &["attrs: wrong attributes: ", "(missing: mode)"]);
    drop(g);
    // What the handler declared: it runs.
    f.attrs.push(scalar("a", XLA_FFI_DataType::F32, 2.0f32));
    f.link();
    f.call(saxpy).unwrap();
    drop(f);
    assert_eq!(out, [3.0; 3]);
    assert_eq!(out2, [0.0; 3]);
}

#[test]
fn the_signature_is_what_the_handler_declared() {
    let s = dlbridge::xla::Signature::new(2, 1, &["a", "eps"]);
    assert_eq!((s.operands(), s.results(), s.attrs()), (2, 1, &["a", "eps"][..]));
}

// --- optional operands and lists of operands ---

dlbridge::xla_handler! {
    /// `out = sum_i xs[i] (+ bias)`, float32 vectors: a list and an optional.
    fn sum_plus(call, operands: [list("xs"), optional("bias")], results: 1, attrs: ["scale"]) {
        let scale: f32 = call.attr("scale")?;
        let xs = call.input_list::<f32, Rank<1>>(0, "xs")?;
        let bias = call.optional_input::<f32, Rank<1>>(1, "bias")?;
        let mut out = call.output::<f32, Rank<1>>(0, "out")?;
        let mut o = out.as_slice_mut()?;
        o.fill(0.0);
        for x in &xs {
            for (o, x) in o.iter_mut().zip(x.as_slice()?.iter()) {
                *o += scale * x;
            }
        }
        if let Some(b) = &bias {
            for (o, b) in o.iter_mut().zip(b.as_slice()?.iter()) {
                *o += b;
            }
        }
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// Wrong on purpose: reads its optional parameter as a plain tensor.
    fn reads_optional_as_tensor(call, operands: [tensor("x"), optional("bias")], results: 0) {
        call.input::<f32, Rank<1>>(1, "bias")?;
        Ok(())
    }
}

fn counts(xs: i64, bias: i64) -> Vec<Attr> {
    vec![
        scalar("scale", XLA_FFI_DataType::F32, 1.0f32),
        scalar("xs.count", XLA_FFI_DataType::S64, xs),
        scalar("bias.count", XLA_FFI_DataType::S64, bias),
    ]
}

#[test]
fn optional_and_list_parameters_are_read_by_their_counts() {
    let (mut a, mut b, mut c, mut bias, mut out) =
        ([1.0f32; 3], [2.0f32; 3], [4.0f32; 3], [0.5f32; 3], [0.0f32; 3]);
    let v = |p| buf(XLA_FFI_DataType::F32, p, &[3]);
    // Three list items and a bias.
    let mut f = Frame::new(
        vec![v(f32s(&mut a)), v(f32s(&mut b)), v(f32s(&mut c)), v(f32s(&mut bias))],
        vec![v(f32s(&mut out))],
        counts(3, 1),
    );
    f.call(sum_plus).unwrap();
    drop(f);
    assert_eq!(out, [7.5; 3]);
    // No bias (None), an empty list.
    let mut f = Frame::new(vec![v(f32s(&mut a))], vec![v(f32s(&mut out))], counts(1, 0));
    f.call(sum_plus).unwrap();
    drop(f);
    assert_eq!(out, [1.0; 3]);
    let mut f = Frame::new(vec![], vec![v(f32s(&mut out))], counts(0, 0));
    f.call(sum_plus).unwrap();
    drop(f);
    assert_eq!(out, [0.0; 3]);
}

#[test]
fn malformed_counts_are_refused_before_the_body_runs() {
    let (mut a, mut b, mut out) = ([1.0f32; 3], [2.0f32; 3], [0.0f32; 3]);
    let v = |p| buf(XLA_FFI_DataType::F32, p, &[3]);
    let operands = |a: &mut [f32; 3], b: &mut [f32; 3]| vec![v(f32s(a)), v(f32s(b))];
    // Counts that do not add up to the operands.
    let mut f = Frame::new(operands(&mut a, &mut b), vec![v(f32s(&mut out))], counts(1, 0));
    invalid(f.call(sum_plus), &["sum_plus: wrong number of operands: the counts say 1, the call has 2"]);
    drop(f);
    // An optional counted twice; a negative list; a count past the operands.
    let mut f = Frame::new(operands(&mut a, &mut b), vec![v(f32s(&mut out))], counts(0, 2));
    invalid(f.call(sum_plus), &["sum_plus: attribute bias.count: 2 operands (0..=1 allowed)"]);
    drop(f);
    let mut f = Frame::new(operands(&mut a, &mut b), vec![v(f32s(&mut out))], counts(-1, 1));
    invalid(f.call(sum_plus), &["sum_plus: attribute xs.count: -1 operands"]);
    drop(f);
    let mut f = Frame::new(operands(&mut a, &mut b), vec![v(f32s(&mut out))], counts(i64::MAX, 1));
    invalid(f.call(sum_plus), &["sum_plus: attribute xs.count: ", "operands (0..=2 allowed)"]);
    drop(f);
    // A count missing, of another type.
    let mut attrs = counts(2, 0);
    attrs.pop();
    let mut f = Frame::new(operands(&mut a, &mut b), vec![v(f32s(&mut out))], attrs);
    invalid(
        f.call(sum_plus),
        &[
            "sum_plus: wrong attributes: the handler reads scale, xs.count, bias.count",
            "(missing: bias.count)",
        ],
    );
    drop(f);
    let mut attrs = counts(2, 0);
    attrs[2] = scalar("bias.count", XLA_FFI_DataType::F32, 0.0f32);
    let mut f = Frame::new(operands(&mut a, &mut b), vec![v(f32s(&mut out))], attrs);
    invalid(f.call(sum_plus), &["sum_plus: attribute bias.count"]);
    drop(f);
    // A list item of another dtype is named by its index.
    let mut d = [1.0f64; 3];
    let mut f = Frame::new(
        vec![v(f32s(&mut a)), buf(XLA_FFI_DataType::F64, d.as_mut_ptr().cast(), &[3])],
        vec![v(f32s(&mut out))],
        counts(2, 0),
    );
    invalid(f.call(sum_plus), &["sum_plus: xs[1]: expected float32"]);
    drop(f);
    // An optional parameter read as a plain tensor: the body's mistake, said.
    let mut f =
        Frame::new(operands(&mut a, &mut b), vec![], vec![scalar("bias.count", XLA_FFI_DataType::S64, 1i64)]);
    invalid(
        f.call(reads_optional_as_tensor),
        &[
            "bias: parameter 1 (bias) is declared an optional tensor, read as a tensor: read it with Call::optional_input",
        ],
    );
    drop(f);
    assert_eq!(out, [0.0; 3]);
}

#[test]
fn a_declared_signature_lists_its_parameters() {
    use dlbridge::xla::{Operand, Signature};
    const S: Signature =
        Signature::with_operands(&[Operand::tensor("x"), Operand::optional("b")], 1, &["eps"]);
    assert_eq!(S.params(), &[Operand::Tensor("x"), Operand::Optional("b")][..]);
    assert_eq!((S.operands(), S.results(), S.attrs()), (2, 1, &["eps"][..]));
    assert!(S.params()[1].is_counted() && !S.params()[0].is_counted());
}
