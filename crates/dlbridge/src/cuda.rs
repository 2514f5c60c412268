//! The CUDA driver, loaded at run time (`libcuda.so.1` through `dlopen`), never a build-time
//! dependency: used to learn which device a CUDA pointer belongs to and to make one stream wait
//! for another. On a machine without a driver every call returns an error that says so.
//!
//! ```
//! # if cfg!(miri) { return; } // Miri cannot call dlopen (foreign code)
//! match dlbridge::cuda::Driver::get() {
//!     Ok(_) => println!("a CUDA driver is present"),
//!     Err(e) => assert!(e.contains("libcuda")),
//! }
//! ```
//!
//! Stream handles cannot be checked, so making one stream wait for another is `unsafe`:
//!
//! ```compile_fail,E0133
//! if let Ok(d) = dlbridge::cuda::Driver::get() {
//!     d.stream_wait(0, 0xdead_beef, 1).unwrap(); // E0133: call to unsafe function
//! }
//! ```

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuEvent = *mut c_void;

const CU_POINTER_ATTRIBUTE_IS_MANAGED: c_int = 8;
const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;

type Init = unsafe extern "C" fn(c_uint) -> CuResult;
type PointerGetAttribute = unsafe extern "C" fn(*mut c_void, c_int, u64) -> CuResult;
type DeviceGet = unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult;
type CtxRetain = unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult;
type CtxRelease = unsafe extern "C" fn(CuDevice) -> CuResult;
type CtxPush = unsafe extern "C" fn(CuContext) -> CuResult;
type CtxPop = unsafe extern "C" fn(*mut CuContext) -> CuResult;
type EventCreate = unsafe extern "C" fn(*mut CuEvent, c_uint) -> CuResult;
type EventRecord = unsafe extern "C" fn(CuEvent, CuStream) -> CuResult;
type StreamWaitEvent = unsafe extern "C" fn(CuStream, CuEvent, c_uint) -> CuResult;
type EventDestroy = unsafe extern "C" fn(CuEvent) -> CuResult;

/// The driver entry points dlbridge uses.
pub struct Driver {
    pointer_get_attribute: PointerGetAttribute,
    device_get: DeviceGet,
    primary_ctx_retain: CtxRetain,
    primary_ctx_release: CtxRelease,
    ctx_push: CtxPush,
    ctx_pop: CtxPop,
    event_create: EventCreate,
    event_record: EventRecord,
    stream_wait_event: StreamWaitEvent,
    event_destroy: EventDestroy,
}

#[cfg(unix)]
unsafe extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();

impl Driver {
    /// The process's CUDA driver, loaded and initialised on first use; `Err` says why not.
    pub fn get() -> Result<&'static Driver, String> {
        DRIVER.get_or_init(Self::load).as_ref().map_err(Clone::clone)
    }

    #[cfg(not(unix))]
    fn load() -> Result<Driver, String> {
        Err("loading libcuda at run time is implemented for unix only".into())
    }

    #[cfg(unix)]
    fn load() -> Result<Driver, String> {
        const RTLD_NOW: c_int = 2;
        // SAFETY: dlopen with a static NUL-terminated name.
        let lib = unsafe { dlopen(c"libcuda.so.1".as_ptr(), RTLD_NOW) };
        if lib.is_null() {
            return Err("no CUDA driver: libcuda.so.1 could not be loaded".into());
        }
        let sym = |name: &CStr| -> Result<*mut c_void, String> {
            // SAFETY: a live handle and a static NUL-terminated name.
            let p = unsafe { dlsym(lib, name.as_ptr()) };
            if p.is_null() { Err(format!("the CUDA driver lacks {}", name.to_string_lossy())) } else { Ok(p) }
        };
        macro_rules! load {
            ($name:literal, $ty:ty) => {
                // SAFETY: the driver API symbol has this C signature (cuda.h, API version 3020+).
                unsafe { std::mem::transmute::<*mut c_void, $ty>(sym($name)?) }
            };
        }
        let init = load!(c"cuInit", Init);
        // SAFETY: cuInit(0) is the documented first call.
        let rc = unsafe { init(0) };
        if rc != 0 {
            return Err(format!("the CUDA driver failed to initialise (cuInit error {rc})"));
        }
        Ok(Driver {
            pointer_get_attribute: load!(c"cuPointerGetAttribute", PointerGetAttribute),
            device_get: load!(c"cuDeviceGet", DeviceGet),
            primary_ctx_retain: load!(c"cuDevicePrimaryCtxRetain", CtxRetain),
            primary_ctx_release: load!(c"cuDevicePrimaryCtxRelease_v2", CtxRelease),
            ctx_push: load!(c"cuCtxPushCurrent_v2", CtxPush),
            ctx_pop: load!(c"cuCtxPopCurrent_v2", CtxPop),
            event_create: load!(c"cuEventCreate", EventCreate),
            event_record: load!(c"cuEventRecord", EventRecord),
            stream_wait_event: load!(c"cuStreamWaitEvent", StreamWaitEvent),
            event_destroy: load!(c"cuEventDestroy_v2", EventDestroy),
        })
    }

    /// The device ordinal of a CUDA pointer, and whether it is managed (unified) memory.
    pub fn pointer_device(&self, ptr: usize) -> Result<(i32, bool), String> {
        let mut ordinal: c_int = -1;
        // SAFETY: the attribute query writes one int; an invalid pointer gives an error code.
        let rc = unsafe {
            (self.pointer_get_attribute)(
                (&raw mut ordinal).cast(),
                CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr as u64,
            )
        };
        if rc != 0 {
            return Err(format!("the CUDA driver does not know pointer {ptr:#x} (error {rc})"));
        }
        let mut managed: c_uint = 0;
        // SAFETY: as above; writes one unsigned int.
        let rc = unsafe {
            (self.pointer_get_attribute)(
                (&raw mut managed).cast(),
                CU_POINTER_ATTRIBUTE_IS_MANAGED,
                ptr as u64,
            )
        };
        Ok((ordinal, rc == 0 && managed != 0))
    }

    /// Makes `consumer` wait for the work queued so far on `producer` (both raw stream handles of
    /// device `device`; 1 and 2 are the legacy and per-thread default streams), by recording an
    /// event on the producer stream and waiting on it from the consumer stream.
    ///
    /// # Safety
    ///
    /// `producer` and `consumer` are each 1, 2, or a live `CUstream` of device `device` that stays
    /// valid for the call: the driver dereferences stream handles without checking them, so an
    /// arbitrary integer may crash the process.
    pub unsafe fn stream_wait(&self, device: i32, producer: usize, consumer: usize) -> Result<(), String> {
        let err = |what: &str, rc: c_int| Err(format!("CUDA {what} failed (error {rc})"));
        let mut dev: CuDevice = 0;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: out-pointers to locals; the driver validates the ordinal; the stream handles are
        // live streams of this device (the caller's promise).
        unsafe {
            let rc = (self.device_get)(&mut dev, device);
            if rc != 0 {
                return err("cuDeviceGet", rc);
            }
            let rc = (self.primary_ctx_retain)(&mut ctx, dev);
            if rc != 0 {
                return err("cuDevicePrimaryCtxRetain", rc);
            }
            let rc = (self.ctx_push)(ctx);
            let result =
                if rc != 0 { err("cuCtxPushCurrent", rc) } else { self.wait_in_context(producer, consumer) };
            let mut popped: CuContext = std::ptr::null_mut();
            if rc == 0 {
                (self.ctx_pop)(&mut popped);
            }
            (self.primary_ctx_release)(dev);
            result
        }
    }

    fn wait_in_context(&self, producer: usize, consumer: usize) -> Result<(), String> {
        let mut ev: CuEvent = std::ptr::null_mut();
        // SAFETY: a context is current; the stream handles come from the producer and consumer.
        unsafe {
            let rc = (self.event_create)(&mut ev, CU_EVENT_DISABLE_TIMING);
            if rc != 0 {
                return Err(format!("CUDA cuEventCreate failed (error {rc})"));
            }
            let mut rc = (self.event_record)(ev, producer as CuStream);
            if rc == 0 {
                rc = (self.stream_wait_event)(consumer as CuStream, ev, 0);
            }
            (self.event_destroy)(ev);
            if rc != 0 { Err(format!("CUDA stream synchronisation failed (error {rc})")) } else { Ok(()) }
        }
    }
}
