//! What a handler reaches through XLA's API table besides its buffers (`dlbridge::xla`): the state
//! made at the instantiate stage (`state: Type = init`, `Call::state`), scratch memory
//! (`Call::scratch`) and the intra-op thread pool (`Call::thread_pool`), over a fake XLA built
//! here (its pool runs tasks on threads of its own, or later, or refuses them) and over hostile
//! tables (too short for the functions, or functions that fail): a clear error or the serial
//! loop, never a crash. Runs under Miri.

use std::ffi::{CStr, c_void};
use std::ptr::{null, null_mut};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use dlbridge::spec::Rank;
use dlbridge::xla::{FfiError, needs_instantiate};
use dlbridge::xla_ffi::*;

// --- a fake XLA ---

struct FakeError {
    code: XLA_FFI_Error_Code,
    message: std::ffi::CString,
}

fn fake_error(code: XLA_FFI_Error_Code, m: &str) -> *mut XLA_FFI_Error {
    Box::into_raw(Box::new(FakeError { code, message: std::ffi::CString::new(m).unwrap() })).cast()
}

unsafe extern "C" fn error_create(args: *mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid arguments with a NUL-terminated message (the handler layer's).
    let args = unsafe { &*args };
    // SAFETY: as above.
    let message = unsafe { CStr::from_ptr(args.message) }.to_owned();
    Box::into_raw(Box::new(FakeError { code: args.errc, message })).cast()
}

unsafe extern "C" fn error_get_message(args: *mut XLA_FFI_Error_GetMessage_Args) {
    // SAFETY: an error made here.
    unsafe { (*args).message = (*(*args).error.cast::<FakeError>()).message.as_ptr() };
}

unsafe extern "C" fn error_destroy(args: *mut XLA_FFI_Error_Destroy_Args) {
    // SAFETY: an error made here, freed once.
    drop(unsafe { Box::from_raw((*args).error.cast::<FakeError>()) });
}

/// The one type the fake registry knows (dlbridge registers one), and its deleter.
static REGISTERED: Mutex<Vec<(String, i64, Option<unsafe extern "C" fn(*mut c_void)>)>> =
    Mutex::new(Vec::new());

unsafe extern "C" fn type_register(args: *mut XLA_FFI_Type_Register_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid arguments (the handler layer's).
    let a = unsafe { &*args };
    assert!(a.struct_size >= XLA_FFI_Type_Register_Args_STRUCT_SIZE);
    // SAFETY: as above.
    let name = String::from_utf8(
        unsafe { std::slice::from_raw_parts(a.name.ptr.cast::<u8>(), a.name.len) }.to_vec(),
    )
    .unwrap();
    // SAFETY: as above.
    let (info, id) = unsafe { (&*a.type_info, &mut *a.type_id) };
    assert_eq!(id.type_id, 0, "dlbridge asks for an id");
    let mut r = REGISTERED.lock().unwrap();
    // Each test's table is a table of its own (dlbridge registers once per table): a name again
    // gets its id.
    if let Some((_, known, _)) = r.iter().find(|(n, ..)| *n == name) {
        id.type_id = *known;
        return null_mut();
    }
    id.type_id = 40 + r.len() as i64;
    r.push((name, id.type_id, info.deleter));
    null_mut()
}

/// What the fake XLA keeps per "executable" (the call's context): its instantiate state.
/// A pointer the fake XLA keeps or hands to a thread.
#[derive(Clone, Copy)]
struct Ptr(*mut c_void);
// SAFETY: XLA's contract: a state or a task's data is used from any thread.
unsafe impl Send for Ptr {}

struct Ctx {
    state: Mutex<Option<(i64, Ptr)>>,
    threads: i64,
    pool: Pool,
}

#[derive(Clone, Copy, PartialEq)]
enum Pool {
    /// Each task on a thread of its own (joined by the test).
    Threads,
    /// Tasks kept and run after the handler returned.
    Later,
    /// Schedule fails.
    Refuses,
}

fn ctx(threads: i64, pool: Pool) -> Box<Ctx> {
    Box::new(Ctx { state: Mutex::new(None), threads, pool })
}

/// # Safety
/// `ctx` is a `Ctx` of a test.
unsafe fn the_ctx<'a>(ctx: *mut XLA_FFI_ExecutionContext) -> &'a Ctx {
    // SAFETY: the caller's contract.
    unsafe { &*ctx.cast::<Ctx>() }
}

unsafe extern "C" fn state_set(args: *mut XLA_FFI_State_Set_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid arguments with a test's context.
    let a = unsafe { &*args };
    assert_eq!(a.stage, XLA_FFI_ExecutionStage::INSTANTIATE);
    // SAFETY: as above.
    let (c, id) = unsafe { (the_ctx(a.ctx), (*a.type_id).type_id) };
    let mut s = c.state.lock().unwrap();
    if s.is_some() {
        return fake_error(XLA_FFI_Error_Code::FAILED_PRECONDITION, "State is already set");
    }
    *s = Some((id, Ptr(a.state)));
    null_mut()
}

unsafe extern "C" fn state_get(args: *mut XLA_FFI_State_Get_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid arguments with a test's context.
    let a = unsafe { &mut *args };
    assert_eq!(a.stage, XLA_FFI_ExecutionStage::INSTANTIATE);
    // SAFETY: as above.
    let (c, id) = unsafe { (the_ctx(a.ctx), (*a.type_id).type_id) };
    match *c.state.lock().unwrap() {
        Some((t, s)) if t == id => {
            a.state = s.0;
            null_mut()
        }
        Some(_) => fake_error(XLA_FFI_Error_Code::INVALID_ARGUMENT, "State of another type"),
        None => fake_error(XLA_FFI_Error_Code::NOT_FOUND, "State is not set"),
    }
}

/// Frees the state a context holds with the registered deleter (what XLA does when the
/// executable goes).
fn drop_executable(c: &Ctx) {
    if let Some((id, s)) = c.state.lock().unwrap().take() {
        let deleter = REGISTERED.lock().unwrap().iter().find(|r| r.1 == id).and_then(|r| r.2).unwrap();
        // SAFETY: the state dlbridge set, of the type registered with this deleter, freed once.
        unsafe { deleter(s.0) };
    }
}

struct Task(XLA_FFI_Task, Ptr);

static JOINS: Mutex<Vec<std::thread::JoinHandle<()>>> = Mutex::new(Vec::new());
static LATER: Mutex<Vec<Task>> = Mutex::new(Vec::new());

unsafe extern "C" fn schedule(args: *mut XLA_FFI_ThreadPool_Schedule_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid arguments with a test's context.
    let a = unsafe { &*args };
    // SAFETY: as above.
    let c = unsafe { the_ctx(a.ctx) };
    let t = Task(a.task.unwrap(), Ptr(a.data));
    match c.pool {
        Pool::Threads => JOINS.lock().unwrap().push(std::thread::spawn(move || {
            let t = t;
            // SAFETY: the task and its data, run once.
            unsafe { (t.0)(t.1.0) }
        })),
        Pool::Later => LATER.lock().unwrap().push(t),
        Pool::Refuses => return fake_error(XLA_FFI_Error_Code::UNIMPLEMENTED, "No intra-op thread pool"),
    }
    null_mut()
}

unsafe extern "C" fn num_threads(args: *mut XLA_FFI_ThreadPool_NumThreads_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid arguments with a test's context.
    let a = unsafe { &*args };
    // SAFETY: as above.
    let c = unsafe { the_ctx(a.ctx) };
    if c.threads < 0 {
        return fake_error(XLA_FFI_Error_Code::UNIMPLEMENTED, "No intra-op thread pool available");
    }
    // SAFETY: as above.
    unsafe { *a.num_threads = c.threads };
    null_mut()
}

fn join_pool() {
    for j in std::mem::take(&mut *JOINS.lock().unwrap()) {
        j.join().unwrap();
    }
}

fn run_later() -> usize {
    let tasks = std::mem::take(&mut *LATER.lock().unwrap());
    let n = tasks.len();
    for t in tasks {
        // SAFETY: a task and its data, run once.
        unsafe { (t.0)(t.1.0) };
    }
    n
}

fn api() -> XLA_FFI_Api {
    XLA_FFI_Api {
        struct_size: XLA_FFI_Api_STRUCT_SIZE,
        extension_start: null_mut(),
        api_version: XLA_FFI_Api_Version {
            struct_size: XLA_FFI_Api_Version_STRUCT_SIZE,
            extension_start: null_mut(),
            major_version: 0,
            minor_version: 3,
        },
        internal_api: null(),
        XLA_FFI_Error_Create: Some(error_create),
        XLA_FFI_Error_GetMessage: Some(error_get_message),
        XLA_FFI_Error_Destroy: Some(error_destroy),
        XLA_FFI_Handler_Register: null(),
        XLA_FFI_Stream_Get: None,
        XLA_FFI_Type_Register: Some(type_register),
        XLA_FFI_ExecutionContext_Get: null(),
        XLA_FFI_State_Set: Some(state_set),
        XLA_FFI_State_Get: Some(state_get),
        XLA_FFI_DeviceMemory_Allocate: Some(device_allocate),
        XLA_FFI_DeviceMemory_Free: Some(device_free),
        XLA_FFI_ThreadPool_Schedule: Some(schedule),
        XLA_FFI_ThreadPool_NumThreads: Some(num_threads),
        XLA_FFI_Future_Create: null(),
        XLA_FFI_Future_SetAvailable: null(),
        XLA_FFI_Future_SetError: null(),
        XLA_FFI_RunId_Get: null(),
        XLA_FFI_DeviceOrdinal_Get: None,
    }
}

fn outcome(err: *mut XLA_FFI_Error) -> Result<(), (XLA_FFI_Error_Code, String)> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: made here, freed once.
    let e = unsafe { Box::from_raw(err.cast::<FakeError>()) };
    Err((e.code, e.message.to_string_lossy().into_owned()))
}

/// Calls `h` at `stage` with one u64 result buffer (`out`, when executing) and the context `c`.
fn call(
    h: XLA_FFI_Handler,
    api: &XLA_FFI_Api,
    c: &Ctx,
    stage: XLA_FFI_ExecutionStage,
    out: &mut [u64],
) -> Result<(), (XLA_FFI_Error_Code, String)> {
    let mut dims = [out.len() as i64];
    let mut buf = XLA_FFI_Buffer {
        struct_size: XLA_FFI_Buffer_STRUCT_SIZE,
        extension_start: null_mut(),
        dtype: XLA_FFI_DataType::U64,
        data: out.as_mut_ptr().cast(),
        rank: 1,
        dims: dims.as_mut_ptr(),
    };
    let mut ret_types = [XLA_FFI_RetType::BUFFER];
    let mut rets = [(&raw mut buf).cast::<c_void>()];
    let n_rets = if stage == XLA_FFI_ExecutionStage::EXECUTE { 1 } else { 0 };
    let mut frame = XLA_FFI_CallFrame {
        struct_size: XLA_FFI_CallFrame_STRUCT_SIZE,
        extension_start: null_mut(),
        api,
        ctx: (c as *const Ctx).cast_mut().cast(),
        stage,
        args: XLA_FFI_Args {
            struct_size: XLA_FFI_Args_STRUCT_SIZE,
            extension_start: null_mut(),
            size: 0,
            types: null_mut(),
            args: null_mut(),
        },
        rets: XLA_FFI_Rets {
            struct_size: XLA_FFI_Rets_STRUCT_SIZE,
            extension_start: null_mut(),
            size: n_rets,
            types: ret_types.as_mut_ptr(),
            rets: rets.as_mut_ptr(),
        },
        attrs: XLA_FFI_Attrs {
            struct_size: XLA_FFI_Attrs_STRUCT_SIZE,
            extension_start: null_mut(),
            size: 0,
            types: null_mut(),
            names: null_mut(),
            attrs: null_mut(),
        },
        future: null_mut(),
    };
    // SAFETY: a frame whose pointers point to locals alive for the call.
    outcome(unsafe { h(&mut frame) })
}

const EXECUTE: XLA_FFI_ExecutionStage = XLA_FFI_ExecutionStage::EXECUTE;
const INSTANTIATE: XLA_FFI_ExecutionStage = XLA_FFI_ExecutionStage::INSTANTIATE;

// --- handlers ---

static MADE: AtomicUsize = AtomicUsize::new(0);
static DROPPED: AtomicUsize = AtomicUsize::new(0);

struct Counter {
    calls: AtomicU64,
}

impl Counter {
    fn new() -> Self {
        MADE.fetch_add(1, Ordering::SeqCst);
        Self { calls: AtomicU64::new(0) }
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        DROPPED.fetch_add(1, Ordering::SeqCst);
    }
}

dlbridge::xla_handler! {
    /// Writes how many calls its state has served.
    fn counting(call, operands: 0, results: 1, state: Counter = Counter::new()) {
        let n = call.state::<Counter>()?.calls.fetch_add(1, Ordering::SeqCst) + 1;
        call.output::<u64, Rank<1>>(0, "out")?.as_slice_mut()?[0] = n;
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// Reads its state as another type.
    fn wrong_type(call, operands: 0, results: 1, state: Counter = Counter::new()) {
        call.state::<u32>().map(|_| ())
    }
}

dlbridge::xla_handler! {
    /// Asks for a state it does not declare.
    fn stateless(call, operands: 0, results: 1) {
        call.state::<Counter>().map(|_| ())
    }
}

static MAKING_PANICS: AtomicBool = AtomicBool::new(true);

fn panicking_state() -> u8 {
    if MAKING_PANICS.load(Ordering::SeqCst) {
        panic!("no state today");
    }
    1
}

dlbridge::xla_handler! {
    /// Its state's init panics.
    fn bad_init(call, operands: 0, results: 1, state: u8 = panicking_state()) {
        let _ = call;
        Ok(())
    }
}

/// Each item of a loop of `n` writes `i + 1` to `out[i]` (with a pool) and counts itself.
fn fill(call: &dlbridge::xla::Call<'_>, out: &mut [u64]) -> Result<usize, FfiError> {
    let pool = call.thread_pool();
    let runs = AtomicUsize::new(0);
    pool.for_each_chunk_mut(out, 3, |i, chunk| {
        runs.fetch_add(1, Ordering::SeqCst);
        for (k, o) in chunk.iter_mut().enumerate() {
            *o = (i * 3 + k + 1) as u64;
        }
    })?;
    Ok(pool.num_threads() * 1000 + runs.into_inner())
}

dlbridge::xla_handler! {
    /// Fills its result on the pool; result 0 says the threads and items (threads * 1000 + items).
    fn pooled(call, operands: 0, results: 1) {
        let mut out = call.output::<u64, Rank<1>>(0, "out")?;
        let mut o = out.as_slice_mut()?;
        let scratch = call.scratch::<u64>(o.len())?;
        let info = fill(call, scratch)?;
        o.copy_from_slice(scratch);
        o[0] = info as u64;
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// A loop of more items than a counter can pass safely: refused before any runs.
    fn pool_too_long(call, operands: 0, results: 1) {
        call.thread_pool().parallel_for(usize::MAX, |_| panic!("never run"))
    }
}

dlbridge::xla_handler! {
    /// A loop whose item 5 panics.
    fn pool_panics(call, operands: 0, results: 1) {
        call.thread_pool().parallel_for(20, |i| {
            if i == 5 {
                panic!("item {i} failed");
            }
        })
    }
}

// --- the state ---

#[test]
fn the_state_is_made_once_at_instantiation_read_by_every_call_and_freed_by_xla() {
    let api = api();
    let (made, dropped) = (MADE.load(Ordering::SeqCst), DROPPED.load(Ordering::SeqCst));
    let c = ctx(1, Pool::Threads);
    call(counting, &api, &c, INSTANTIATE, &mut []).unwrap();
    let mut out = [0u64];
    for n in 1..=3 {
        call(counting, &api, &c, EXECUTE, &mut out).unwrap();
        assert_eq!(out[0], n);
    }
    // A second executable: a state of its own.
    let c2 = ctx(1, Pool::Threads);
    call(counting, &api, &c2, INSTANTIATE, &mut []).unwrap();
    call(counting, &api, &c2, EXECUTE, &mut out).unwrap();
    assert_eq!(out[0], 1);
    assert!(MADE.load(Ordering::SeqCst) >= made + 2);
    // Instantiating the same executable again: XLA refuses the second state, dlbridge frees it.
    let before = DROPPED.load(Ordering::SeqCst);
    let e = call(counting, &api, &c, INSTANTIATE, &mut []).unwrap_err();
    assert!(e.1.contains("already set"), "{e:?}");
    assert!(DROPPED.load(Ordering::SeqCst) > before);
    drop_executable(&c);
    drop_executable(&c2);
    assert!(DROPPED.load(Ordering::SeqCst) >= dropped + 3);
}

#[test]
fn a_state_never_made_or_read_as_another_type_is_a_clear_error() {
    let api = api();
    let c = ctx(1, Pool::Threads);
    let mut out = [0u64];
    // Registered for execute only: XLA never instantiated it.
    let (code, m) = call(counting, &api, &c, EXECUTE, &mut out).unwrap_err();
    assert_eq!(code, XLA_FFI_Error_Code::FAILED_PRECONDITION);
    assert!(m.contains("state: none was made") && m.contains("\"instantiate\": capsule"), "{m}");
    call(wrong_type, &api, &c, INSTANTIATE, &mut []).unwrap();
    let (_, m) = call(wrong_type, &api, &c, EXECUTE, &mut out).unwrap_err();
    assert!(m.contains("is a xla_context::Counter, not a u32"), "{m}");
    drop_executable(&c);
    let c = ctx(1, Pool::Threads);
    // A handler without a state instantiates to nothing, and refuses to read one.
    call(stateless, &api, &c, INSTANTIATE, &mut []).unwrap();
    assert!(c.state.lock().unwrap().is_none());
    let (_, m) = call(stateless, &api, &c, EXECUTE, &mut out).unwrap_err();
    assert!(m.contains("declares none"), "{m}");
    // A panicking init is an error of the instantiate stage.
    let (code, m) = call(bad_init, &api, &c, INSTANTIATE, &mut []).unwrap_err();
    assert_eq!(code, XLA_FFI_Error_Code::INTERNAL);
    assert!(m.contains("bad_init: panicked: no state today"), "{m}");
    assert!(c.state.lock().unwrap().is_none());
    MAKING_PANICS.store(false, Ordering::SeqCst);
    call(bad_init, &api, &c, INSTANTIATE, &mut []).unwrap();
    drop_executable(&c);
}

#[test]
fn a_table_too_short_for_the_state_functions_is_an_error_never_a_read_past_it() {
    for (end, missing) in [
        (std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_Type_Register), "XLA_FFI_Type_Register"),
        (std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_State_Set), "XLA_FFI_State_Set"),
    ] {
        let mut api = api();
        api.struct_size = end;
        let c = ctx(1, Pool::Threads);
        let (code, m) = call(counting, &api, &c, INSTANTIATE, &mut []).unwrap_err();
        assert_eq!(code, XLA_FFI_Error_Code::UNIMPLEMENTED);
        assert!(m.contains(missing), "{m}");
        assert!(c.state.lock().unwrap().is_none());
        let (_, m) = call(counting, &api, &c, EXECUTE, &mut [0]).unwrap_err();
        assert!(m.contains("state"), "{m}");
    }
    // NULL functions in a table of full size: the same errors.
    let mut api = api();
    api.XLA_FFI_State_Get = None;
    let c = ctx(1, Pool::Threads);
    call(counting, &api, &c, INSTANTIATE, &mut []).unwrap();
    let (_, m) = call(counting, &api, &c, EXECUTE, &mut [0]).unwrap_err();
    assert!(m.contains("XLA_FFI_State_Get"), "{m}");
    drop_executable(&c);
}

#[test]
fn only_a_handler_with_a_state_asks_for_the_instantiate_stage() {
    // SAFETY: handlers of this file, which answer the metadata query.
    unsafe {
        assert!(needs_instantiate(counting));
        assert!(!needs_instantiate(stateless));
        assert!(!needs_instantiate(pooled));
        assert!(!needs_instantiate(foreign));
    }
}

/// A handler of another origin that knows only XLA's metadata extension.
unsafe extern "C" fn foreign(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    // SAFETY: XLA's metadata query (the only call this test makes).
    unsafe {
        let ext = (*frame).extension_start.cast::<XLA_FFI_Metadata_Extension>();
        assert_eq!((*ext).extension_base.type_, XLA_FFI_Extension_Type::METADATA);
        (*(*ext).metadata).api_version.major_version = 0;
        (*(*ext).metadata).api_version.minor_version = 3;
    }
    null_mut()
}

// --- the thread pool and scratch ---

fn expected(n: usize) -> Vec<u64> {
    (1..=n as u64).collect()
}

#[test]
fn a_loop_runs_every_item_once_on_the_pool() {
    let api = api();
    for threads in [4, 2] {
        let c = ctx(threads, Pool::Threads);
        let mut out = [0u64; 10];
        call(pooled, &api, &c, EXECUTE, &mut out).unwrap();
        join_pool();
        // 10 elements in chunks of 3: 4 items, each once.
        assert_eq!(out[0], threads as u64 * 1000 + 4);
        assert_eq!(out[1..], expected(10)[1..]);
    }
}

#[test]
fn tasks_the_pool_runs_late_or_never_leave_the_loop_to_the_caller() {
    let api = api();
    // Scheduled tasks run only after the handler returned: the caller ran every item, and the
    // late tasks claim none (and touch nothing freed).
    let c = ctx(4, Pool::Later);
    let mut out = [0u64; 10];
    call(pooled, &api, &c, EXECUTE, &mut out).unwrap();
    assert_eq!(out[0], 4000 + 4);
    assert_eq!(out[1..], expected(10)[1..]);
    assert_eq!(run_later(), 3);
    // A pool that refuses tasks, or reports none, or one thread: the caller alone.
    for (threads, pool, reported) in [(4, Pool::Refuses, 4), (-1, Pool::Threads, 1), (1, Pool::Threads, 1)] {
        let c = ctx(threads, pool);
        let mut out = [0u64; 10];
        call(pooled, &api, &c, EXECUTE, &mut out).unwrap();
        assert_eq!(out[0], reported * 1000 + 4);
        assert_eq!(out[1..], expected(10)[1..]);
    }
    // A table without the pool's functions, or too short for them: the caller alone, and the
    // functions past its size never called.
    let mut short = api.clone_table();
    short.struct_size = std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_ThreadPool_Schedule);
    short.XLA_FFI_ThreadPool_NumThreads = Some(never);
    short.XLA_FFI_ThreadPool_Schedule = Some(never_schedule);
    let c = ctx(4, Pool::Threads);
    let mut out = [0u64; 10];
    call(pooled, &short, &c, EXECUTE, &mut out).unwrap();
    assert_eq!(out[0], 1004);
    assert_eq!(out[1..], expected(10)[1..]);
    assert!(!NEVER.load(Ordering::SeqCst));
}

static NEVER: AtomicBool = AtomicBool::new(false);

unsafe extern "C" fn never(_: *mut XLA_FFI_ThreadPool_NumThreads_Args) -> *mut XLA_FFI_Error {
    NEVER.store(true, Ordering::SeqCst);
    null_mut()
}

unsafe extern "C" fn never_schedule(_: *mut XLA_FFI_ThreadPool_Schedule_Args) -> *mut XLA_FFI_Error {
    NEVER.store(true, Ordering::SeqCst);
    null_mut()
}

trait CloneTable {
    fn clone_table(&self) -> XLA_FFI_Api;
}

impl CloneTable for XLA_FFI_Api {
    fn clone_table(&self) -> XLA_FFI_Api {
        api()
    }
}

#[test]
fn a_panic_in_an_item_is_an_error_of_the_call() {
    let api = api();
    for (threads, pool) in [(4, Pool::Threads), (1, Pool::Threads), (3, Pool::Later)] {
        let c = ctx(threads, pool);
        let (code, m) = call(pool_panics, &api, &c, EXECUTE, &mut [0]).unwrap_err();
        join_pool();
        run_later();
        assert_eq!(code, XLA_FFI_Error_Code::INTERNAL);
        assert!(m.contains("pool_panics: a thread pool task panicked: item 5 failed"), "{m}");
        let (code, m) = call(pool_too_long, &api, &c, EXECUTE, &mut [0]).unwrap_err();
        assert_eq!(code, XLA_FFI_Error_Code::INVALID_ARGUMENT);
        assert!(m.contains("a loop of 18446744073709551615 items"), "{m}");
    }
}

// --- device scratch (XLA's allocator) ---

/// Blocks the fake allocator lent and not yet got back: (address, layout).
static LENT: Mutex<Vec<(usize, std::alloc::Layout)>> = Mutex::new(Vec::new());
static FREED: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn device_allocate(args: *mut XLA_FFI_DeviceMemory_Allocate_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid arguments (the handler layer's).
    let a = unsafe { &mut *args };
    assert!(a.struct_size >= XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE);
    if a.size > 1 << 20 {
        return fake_error(XLA_FFI_Error_Code::RESOURCE_EXHAUSTED, "Out of memory");
    }
    let layout = std::alloc::Layout::from_size_align(a.size.max(1), a.alignment).unwrap();
    // SAFETY: a layout of non-zero size.
    let block = unsafe { std::alloc::alloc(layout) };
    assert!(!block.is_null());
    a.data = block.cast();
    LENT.lock().unwrap().push((block as usize, layout));
    null_mut()
}

unsafe extern "C" fn device_free(args: *mut XLA_FFI_DeviceMemory_Free_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid arguments (the handler layer's).
    let a = unsafe { &*args };
    let mut lent = LENT.lock().unwrap();
    let i = lent
        .iter()
        .position(|&(p, l)| p == a.data as usize && l.size() == a.size.max(1))
        .expect("a lent block, once");
    let (_, layout) = lent.remove(i);
    // SAFETY: the block device_allocate allocated with this layout, freed once.
    unsafe { std::alloc::dealloc(a.data.cast(), layout) };
    FREED.fetch_add(1, Ordering::SeqCst);
    null_mut()
}

dlbridge::xla_handler! {
    /// Takes two blocks of device scratch and writes into them (as its device code would).
    fn device_scratch(call, operands: 0, results: 1) {
        let a = call.device_scratch(64, 16)?;
        let b = call.device_scratch(8, 8)?;
        // SAFETY: 64 and 8 bytes the fake allocator lent for the call (host memory here).
        unsafe {
            a.cast::<u8>().write_bytes(7, 64);
            b.cast::<u64>().write(9);
        }
        call.output::<u64, Rank<1>>(0, "out")?.as_slice_mut()?[0] = 2;
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// Asks for device scratch it cannot get, after one block it can.
    fn device_scratch_refused(call, operands: 0, results: 1) {
        call.device_scratch(16, 16)?;
        match call.device_scratch(32, 3) {
            Err(e) if e.message().contains("alignment 3 is not a power of two") => {}
            other => panic!("{other:?}"),
        }
        call.device_scratch(1 << 30, 16).map(|_| ())
    }
}

#[test]
fn device_scratch_comes_from_xlas_allocator_and_goes_back_after_the_call() {
    let api = api();
    let c = ctx(1, Pool::Threads);
    let freed = FREED.load(Ordering::SeqCst);
    let mut out = [0u64];
    call(device_scratch, &api, &c, EXECUTE, &mut out).unwrap();
    assert_eq!(out[0], 2);
    assert!(FREED.load(Ordering::SeqCst) >= freed + 2);
    // Refused: the error, and the block it had got back all the same.
    let (code, m) = call(device_scratch_refused, &api, &c, EXECUTE, &mut out).unwrap_err();
    assert_eq!(code, XLA_FFI_Error_Code::INTERNAL);
    assert!(m.contains("device scratch: Out of memory"), "{m}");
    assert!(FREED.load(Ordering::SeqCst) >= freed + 3);
    // A table without the allocator (XLA:CPU's answers an error; an older one has no fields).
    let mut none = api.clone_table();
    none.XLA_FFI_DeviceMemory_Free = None;
    let (code, m) = call(device_scratch, &none, &c, EXECUTE, &mut out).unwrap_err();
    assert_eq!(code, XLA_FFI_Error_Code::UNIMPLEMENTED);
    assert!(m.contains("no XLA_FFI_DeviceMemory_Allocate/Free"), "{m}");
    let mut short = api.clone_table();
    short.struct_size = std::mem::offset_of!(XLA_FFI_Api, XLA_FFI_DeviceMemory_Free);
    let (code, _) = call(device_scratch, &short, &c, EXECUTE, &mut out).unwrap_err();
    assert_eq!(code, XLA_FFI_Error_Code::UNIMPLEMENTED);
}

// --- a panic whose payload panics when dropped ---

/// A panic payload whose `Drop` panics in turn.
struct PayloadBomb;

impl Drop for PayloadBomb {
    fn drop(&mut self) {
        panic!("the payload's drop panicked");
    }
}

/// Items started so far, and whether the body of `pool_payload_bomb` has left (returned or
/// unwound) — what the second item, still running on a pool thread, must never see.
static BOMB_STARTED: AtomicUsize = AtomicUsize::new(0);
static BOMB_BODY_LEFT: AtomicBool = AtomicBool::new(false);
static BOMB_SAW_BODY_LEFT: AtomicBool = AtomicBool::new(false);

/// Sets [`BOMB_BODY_LEFT`] when the body leaves, by return or by unwinding.
struct BodyLeft;

impl Drop for BodyLeft {
    fn drop(&mut self) {
        BOMB_BODY_LEFT.store(true, Ordering::SeqCst);
    }
}

/// Polls `cond` for up to `ms` milliseconds.
fn wait_for(ms: u64, cond: impl Fn() -> bool) -> bool {
    let end = std::time::Instant::now() + std::time::Duration::from_millis(ms);
    while std::time::Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    cond()
}

dlbridge::xla_handler! {
    /// A loop of two items: the first panics with a [`PayloadBomb`] once the second runs; the
    /// second, on a pool thread, waits a while and records whether the body had left meanwhile.
    fn pool_payload_bomb(call, operands: 0, results: 1) {
        let _left = BodyLeft;
        let borrowed = Box::new([7u8; 4]); // on the heap: freed when the body leaves
        call.thread_pool().parallel_for(2, |_| {
            if BOMB_STARTED.fetch_add(1, Ordering::SeqCst) == 0 {
                wait_for(2000, || BOMB_STARTED.load(Ordering::SeqCst) >= 2);
                std::panic::panic_any(PayloadBomb);
            }
            // The loop must still wait for this item: its closure and what it borrows are alive.
            wait_for(300, || BOMB_BODY_LEFT.load(Ordering::SeqCst));
            BOMB_SAW_BODY_LEFT.store(BOMB_BODY_LEFT.load(Ordering::SeqCst), Ordering::SeqCst);
            assert_eq!(borrowed[3], 7);
        })
    }
}

#[test]
fn a_panic_payload_whose_drop_panics_never_ends_the_loop_before_its_items() {
    let api = api();
    let c = ctx(2, Pool::Threads);
    let (code, m) = call(pool_payload_bomb, &api, &c, EXECUTE, &mut [0]).unwrap_err();
    join_pool();
    assert_eq!(code, XLA_FFI_Error_Code::INTERNAL);
    assert_eq!(BOMB_STARTED.load(Ordering::SeqCst), 2, "both items ran");
    assert!(!BOMB_SAW_BODY_LEFT.load(Ordering::SeqCst), "the loop returned while an item ran");
    assert!(m.contains("pool_payload_bomb: a thread pool task panicked: (no message)"), "{m}");
}

/// A state whose `Drop` panics with a [`PayloadBomb`].
struct DropBomb;

impl Drop for DropBomb {
    fn drop(&mut self) {
        std::panic::panic_any(PayloadBomb);
    }
}

dlbridge::xla_handler! {
    /// Its body panics with a [`PayloadBomb`]; its state's drop does too.
    fn bomb_state(call, operands: 0, results: 1, state: DropBomb = DropBomb) {
        let _ = call;
        std::panic::panic_any(PayloadBomb)
    }
}

/// What the child process checks: every panic with a bombing payload is an error of the call (or
/// reported by the deleter), never an unwind into XLA (a process abort).
fn bombing_payloads_are_errors() {
    let api = api();
    let c = ctx(1, Pool::Threads);
    call(bomb_state, &api, &c, INSTANTIATE, &mut []).unwrap();
    // The body's panic.
    let (code, m) = call(bomb_state, &api, &c, EXECUTE, &mut [0]).unwrap_err();
    assert_eq!(code, XLA_FFI_Error_Code::INTERNAL);
    assert!(m.contains("bomb_state: panicked: (no message)"), "{m}");
    // A second state XLA refuses is dropped by the instantiate stage: its Drop's panic.
    let (code, m) = call(bomb_state, &api, &c, INSTANTIATE, &mut []).unwrap_err();
    assert_eq!(code, XLA_FFI_Error_Code::INTERNAL);
    assert!(m.contains("bomb_state: panicked"), "{m}");
    // The deleter: reported, never unwound.
    drop_executable(&c);
}

#[test]
fn a_panic_payload_whose_drop_panics_is_an_error_never_an_abort() {
    if cfg!(miri) {
        // No process to spawn: the checks in this process (Miri checks nothing leaks).
        bombing_payloads_are_errors();
        return;
    }
    const CHILD: &str = "XLA_CONTEXT_BOMB_CHILD";
    if std::env::var_os(CHILD).is_some() {
        bombing_payloads_are_errors();
        println!("CHILD OK");
        return;
    }
    // In a child process: the old code aborted the process.
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["a_panic_payload_whose_drop_panics_is_an_error_never_an_abort", "--exact", "--nocapture"])
        .env(CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let end = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > end {
            child.kill().unwrap();
            panic!("the child hung");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(status.success() && stdout.contains("CHILD OK"), "{status}\n{stdout}\n{stderr}");
}

dlbridge::xla_handler! {
    /// Keeps its first host scratch slice across later host and device requests (the first
    /// request makes the call's arenas), and looks for an operand and an attribute the call has
    /// none of (empty lists).
    fn scratch_kept_across_requests(call, operands: 0, results: 1) {
        let first = call.scratch::<u64>(4)?;
        first.fill(5);
        let dev = call.device_scratch(32, 16)?;
        let second = call.scratch::<u8>(3)?;
        let empty = call.scratch::<u32>(0)?;
        second.fill(1);
        // SAFETY: 32 bytes the fake allocator lent for the call (host memory here).
        unsafe { dev.cast::<u8>().write_bytes(3, 32) };
        first[3] += u64::from(second[2]) + empty.len() as u64;
        let missing = call.input_any(0, "x").is_err() && call.attr::<i64>("a").is_err();
        call.output::<u64, Rank<1>>(0, "out")?.as_slice_mut()?[0] = first.iter().sum::<u64>() + u64::from(missing);
        Ok(())
    }
}

#[test]
fn host_scratch_stays_valid_after_later_scratch_requests() {
    let api = api();
    let c = ctx(1, Pool::Threads);
    let freed = FREED.load(Ordering::SeqCst);
    let mut out = [0u64];
    call(scratch_kept_across_requests, &api, &c, EXECUTE, &mut out).unwrap();
    // 4 * 5 + 1 written through the first slice after the later requests, + 1: the empty
    // operand and attribute lists refused the look-ups.
    assert_eq!(out[0], 22);
    assert!(FREED.load(Ordering::SeqCst) > freed);
}

/// `Call<'a>` is covariant in `'a` (a helper may take a call for a shorter lifetime): the call's
/// scratch holds no lifetime of its own. This compiles only while that holds.
#[test]
fn a_call_may_be_lent_for_a_shorter_lifetime() {
    fn shorten<'s, 'l: 's>(c: &'s dlbridge::xla::Call<'l>) -> &'s dlbridge::xla::Call<'s> {
        c
    }
    let _ = shorten;
}
