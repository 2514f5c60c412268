//! The CUDA driver, loaded at run time (`libcuda.so.1` through `dlopen`), never a build-time
//! dependency: used to learn which device a CUDA pointer belongs to, to make one stream wait
//! for another, and to share allocations between processes (CUDA IPC: [`Driver::ipc_export`] in
//! the process that owns the memory, [`Driver::ipc_open`] in another). On a machine without a
//! driver every call returns an error that says so; a driver that lacks an optional entry point
//! (the IPC ones) refuses only the calls that need it, naming it.
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
use std::sync::{Arc, Mutex, OnceLock, Weak};

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuEvent = *mut c_void;

const CU_POINTER_ATTRIBUTE_IS_MANAGED: c_int = 8;
const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// Bytes in a CUDA IPC memory handle (`CU_IPC_HANDLE_SIZE`).
pub const IPC_HANDLE_SIZE: usize = 64;

/// `CUipcMemHandle`: an opaque 64-byte token, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcMemHandle {
    reserved: [u8; IPC_HANDLE_SIZE],
}

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
type CtxSynchronize = unsafe extern "C" fn() -> CuResult;
type IpcGetMemHandle = unsafe extern "C" fn(*mut IpcMemHandle, u64) -> CuResult;
type IpcOpenMemHandle = unsafe extern "C" fn(*mut u64, IpcMemHandle, c_uint) -> CuResult;
type IpcCloseMemHandle = unsafe extern "C" fn(u64) -> CuResult;
type MemGetAddressRange = unsafe extern "C" fn(*mut u64, *mut usize, u64) -> CuResult;
type MemcpyDtoDAsync = unsafe extern "C" fn(u64, u64, usize, CuStream) -> CuResult;

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
    // Optional: a driver without them refuses only what needs them.
    ctx_synchronize: Option<CtxSynchronize>,
    ipc_get_mem_handle: Option<IpcGetMemHandle>,
    ipc_open_mem_handle: Option<IpcOpenMemHandle>,
    ipc_close_mem_handle: Option<IpcCloseMemHandle>,
    mem_get_address_range: Option<MemGetAddressRange>,
    memcpy_dtod_async: Option<MemcpyDtoDAsync>,
}

/// What [`Driver::ipc_export`] learns of the allocation holding a pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcExport {
    /// The allocation's IPC handle (of its base: CUDA hands out handles of whole allocations).
    pub handle: [u8; IPC_HANDLE_SIZE],
    /// The allocation's first byte.
    pub base: usize,
    /// The allocation's size in bytes.
    pub size: usize,
}

/// Another process's allocation opened in this one (`cuIpcOpenMemHandle`); closed
/// (`cuIpcCloseMemHandle`) when dropped. One per handle and device at a time in a process:
/// [`Driver::ipc_open`] hands out the live one again (CUDA maps a handle once per context).
pub struct IpcMapping {
    device: i32,
    ctx: CuContext,
    dev: CuDevice,
    ptr: u64,
    size: usize,
}

// SAFETY: the fields are plain values; `ctx` is the device's primary context, retained for the
// mapping's life, which the driver lets any thread push; device memory is not touched here.
unsafe impl Send for IpcMapping {}
// SAFETY: as above; nothing is mutated through `&IpcMapping`.
unsafe impl Sync for IpcMapping {}

/// A device's primary context, retained and current while this lives (see
/// [`Driver::enter_primary_context`]).
struct PrimaryContext<'d> {
    drv: &'d Driver,
    dev: CuDevice,
    ctx: CuContext,
    /// Whether dropping releases the retain (false once handed on).
    release: bool,
}

impl PrimaryContext<'_> {
    /// Pops the context now and hands the retain to the caller, who releases it (once).
    fn keep_retained(mut self) -> (CuDevice, CuContext) {
        self.release = false;
        (self.dev, self.ctx)
    }
}

impl Drop for PrimaryContext<'_> {
    fn drop(&mut self) {
        let mut popped: CuContext = std::ptr::null_mut();
        // SAFETY: this context was pushed by `enter_primary_context` on this thread (the guard is
        // not Send: it holds a raw context pointer) and is popped once; the retain is released
        // once, unless handed on.
        unsafe {
            (self.drv.ctx_pop)(&mut popped);
            if self.release {
                (self.drv.primary_ctx_release)(self.dev);
            }
        }
    }
}

/// A mapping this process holds: (device, handle, mapping).
type Mapped = (i32, [u8; IPC_HANDLE_SIZE], Weak<IpcMapping>);

static MAPPINGS: Mutex<Vec<Mapped>> = Mutex::new(Vec::new());

fn mappings() -> std::sync::MutexGuard<'static, Vec<Mapped>> {
    // Every change is one push or retain: a panic while holding the lock leaves it consistent.
    MAPPINGS.lock().unwrap_or_else(|e| e.into_inner())
}

impl IpcMapping {
    /// The device pointer of the mapped allocation's first byte in this process.
    pub fn ptr(&self) -> usize {
        self.ptr as usize
    }

    /// The mapped allocation's size in bytes (as the driver reports it for the opened pointer).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device ordinal it is mapped on.
    pub fn device(&self) -> i32 {
        self.device
    }
}

/// The IPC mappings this process holds now, as (device, pointer, size): what tests check to see
/// that dropping the last tensor over a mapping closed it.
#[doc(hidden)]
pub fn ipc_mappings() -> Vec<(i32, usize, usize)> {
    let reg = mappings();
    // Upgraded under the lock, dropped after it is released (an Arc is never dropped under it).
    let live: Vec<Arc<IpcMapping>> = reg.iter().filter_map(|(_, _, w)| w.upgrade()).collect();
    drop(reg);
    live.iter().map(|m| (m.device, m.ptr(), m.size)).collect()
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let Ok(drv) = Driver::get() else { return };
        // SAFETY: `ctx` is the primary context retained when the mapping was opened (released
        // here, once); `ptr` is what cuIpcOpenMemHandle returned in it, closed once; the calls
        // take no lock of dlbridge's or Python's, so this may run in any deleter.
        unsafe {
            if (drv.ctx_push)(self.ctx) == 0 {
                if let Some(close) = drv.ipc_close_mem_handle {
                    close(self.ptr);
                }
                let mut popped: CuContext = std::ptr::null_mut();
                (drv.ctx_pop)(&mut popped);
            }
            (drv.primary_ctx_release)(self.dev);
        }
        // This one's entry is dead now (its strong count is 0); only weak references are dropped
        // under the lock (never an Arc: see `ipc_open`).
        mappings().retain(|(_, _, w)| w.strong_count() > 0);
    }
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
        macro_rules! opt {
            ($name:literal, $ty:ty) => {
                // SAFETY: as for load!: the symbol, where the driver has it, has this C signature.
                sym($name).ok().map(|p| unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
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
            ctx_synchronize: opt!(c"cuCtxSynchronize", CtxSynchronize),
            ipc_get_mem_handle: opt!(c"cuIpcGetMemHandle", IpcGetMemHandle),
            // cuda.h 11+ #defines cuIpcOpenMemHandle to the _v2 symbol (same signature); older
            // drivers export only the first name.
            ipc_open_mem_handle: opt!(c"cuIpcOpenMemHandle_v2", IpcOpenMemHandle)
                .or(opt!(c"cuIpcOpenMemHandle", IpcOpenMemHandle)),
            ipc_close_mem_handle: opt!(c"cuIpcCloseMemHandle", IpcCloseMemHandle),
            mem_get_address_range: opt!(c"cuMemGetAddressRange_v2", MemGetAddressRange),
            memcpy_dtod_async: opt!(c"cuMemcpyDtoDAsync_v2", MemcpyDtoDAsync),
        })
    }

    fn need<T: Copy>(f: Option<T>, name: &str) -> Result<T, String> {
        f.ok_or_else(|| format!("the CUDA driver lacks {name}"))
    }

    /// Retains device `device`'s primary context and makes it current: popped when the guard is
    /// dropped, and released then too unless the guard hands the retain on
    /// ([`PrimaryContext::keep_retained`]). Every error path undoes what was done.
    fn enter_primary_context(&self, device: i32) -> Result<PrimaryContext<'_>, String> {
        let err = |what: &str, rc: c_int| Err(format!("CUDA {what} failed for device {device} (error {rc})"));
        let mut dev: CuDevice = 0;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: out-pointers to locals; the driver validates the ordinal; the context pushed is
        // the one just retained, released here if the push fails (else by the guard).
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
            if rc != 0 {
                (self.primary_ctx_release)(dev);
                return err("cuCtxPushCurrent", rc);
            }
        }
        Ok(PrimaryContext { drv: self, dev, ctx, release: true })
    }

    /// Runs `f` with device `device`'s primary context current (retained, pushed, popped and
    /// released around it).
    fn in_primary_context<T>(&self, device: i32, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
        let _current = self.enter_primary_context(device)?;
        f()
    }

    /// Waits until every command queued in device `device`'s primary context (every stream of
    /// it: torch's, cupy's and jax's work lives there) has finished (`cuCtxSynchronize`).
    pub fn synchronize(&self, device: i32) -> Result<(), String> {
        let sync = Self::need(self.ctx_synchronize, "cuCtxSynchronize")?;
        self.in_primary_context(device, || {
            // SAFETY: a context is current (in_primary_context); the call takes no arguments.
            let rc = unsafe { sync() };
            if rc != 0 { Err(format!("CUDA cuCtxSynchronize failed (error {rc})")) } else { Ok(()) }
        })
    }

    /// The allocation (base, size) that device pointer `ptr` lies in, as the driver knows it.
    fn address_range(&self, ptr: u64) -> Result<(u64, usize), String> {
        let range = Self::need(self.mem_get_address_range, "cuMemGetAddressRange_v2")?;
        let (mut base, mut size): (u64, usize) = (0, 0);
        // SAFETY: out-pointers to locals; the driver looks `ptr` up and returns an error for an
        // address it did not allocate (the pointer is never dereferenced).
        let rc = unsafe { range(&mut base, &mut size, ptr) };
        if rc != 0 {
            return Err(format!(
                "the CUDA driver knows no allocation at {ptr:#x} (cuMemGetAddressRange error {rc})"
            ));
        }
        Ok((base, size))
    }

    /// The IPC handle of the allocation device pointer `ptr` (of device `device`) lies in, with
    /// the allocation's base and size. Memory from `cudaMalloc`/`cuMemAlloc` (torch's and
    /// cupy's default allocators) has one; managed memory, stream-ordered pools and VMM
    /// allocations do not (the driver's error is returned).
    pub fn ipc_export(&self, device: i32, ptr: usize) -> Result<IpcExport, String> {
        let get = Self::need(self.ipc_get_mem_handle, "cuIpcGetMemHandle")?;
        self.in_primary_context(device, || {
            let (base, size) = self.address_range(ptr as u64)?;
            let mut h = IpcMemHandle { reserved: [0; IPC_HANDLE_SIZE] };
            // SAFETY: a context is current; the driver writes the 64-byte handle to a local and
            // returns an error for memory it cannot export.
            let rc = unsafe { get(&mut h, base) };
            if rc != 0 {
                return Err(format!(
                    "the CUDA driver gives no IPC handle for the allocation at {base:#x} (cuIpcGetMemHandle \
                     error {rc}: only cudaMalloc/cuMemAlloc memory can be shared)"
                ));
            }
            Ok(IpcExport { handle: h.reserved, base: base as usize, size })
        })
    }

    /// Opens another process's IPC handle on device `device` (in its primary context, which the
    /// mapping keeps retained), or hands out this process's live mapping of it. The driver
    /// refuses a handle of this process's own memory, and one it does not know.
    pub fn ipc_open(&self, device: i32, handle: &[u8; IPC_HANDLE_SIZE]) -> Result<Arc<IpcMapping>, String> {
        let open = Self::need(self.ipc_open_mem_handle, "cuIpcOpenMemHandle")?;
        let close = Self::need(self.ipc_close_mem_handle, "cuIpcCloseMemHandle")?;
        Self::need(self.mem_get_address_range, "cuMemGetAddressRange_v2")?;
        let mut reg = mappings();
        // Upgraded under the lock and returned after it is released: an Arc is never dropped
        // while it is held (the mapping's Drop takes it).
        if let Some(m) =
            reg.iter().find(|(d, h, _)| *d == device && h == handle).and_then(|(_, _, w)| w.upgrade())
        {
            drop(reg);
            return Ok(m);
        }
        // The context is popped and released when `current` drops, unless a mapping keeps it.
        let current = self.enter_primary_context(device)?;
        // SAFETY: the primary context is current; the handle is 64 plain bytes passed by value,
        // which the driver looks up and refuses if unknown; a handle opened is closed on every
        // error path.
        let (ptr, size) = unsafe {
            let mut ptr: u64 = 0;
            let rc = open(&mut ptr, IpcMemHandle { reserved: *handle }, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
            let result = if rc != 0 {
                Err(format!(
                    "the CUDA driver cannot open the IPC handle on device {device} (cuIpcOpenMemHandle \
                     error {rc}: a handle of this process's own memory, of freed memory, or not a handle)"
                ))
            } else {
                match self.address_range(ptr) {
                    Ok((base, size)) if base == ptr => Ok((ptr, size)),
                    Ok((base, _)) => {
                        Err(format!("the opened handle maps at {ptr:#x} inside an allocation at {base:#x}"))
                    }
                    Err(e) => Err(e),
                }
            };
            if result.is_err() && rc == 0 {
                close(ptr);
            }
            result?
        };
        // The mapping keeps the retain (released in its Drop); the context is popped here.
        let (dev, ctx) = current.keep_retained();
        let m = Arc::new(IpcMapping { device, ctx, dev, ptr, size });
        reg.retain(|(_, _, w)| w.strong_count() > 0);
        reg.push((device, *handle, Arc::downgrade(&m)));
        drop(reg);
        Ok(m)
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
        // The stream handles are live streams of this device (the caller's promise).
        self.in_primary_context(device, || self.wait_in_context(producer, consumer))
    }

    /// Queues a copy of `bytes` bytes from device memory `src` to device memory `dst` on `stream`
    /// (`cuMemcpyDtoDAsync`), inside device `device`'s primary context; returns once it is queued.
    ///
    /// # Safety
    ///
    /// `src` and `dst` are device pointers of device `device` to at least `bytes` bytes that do
    /// not overlap, alive until the copy has run on `stream`; `stream` is 1, 2, or a live
    /// `CUstream` of that device (the driver dereferences it unchecked).
    pub unsafe fn memcpy_async(
        &self,
        device: i32,
        dst: usize,
        src: usize,
        bytes: usize,
        stream: usize,
    ) -> Result<(), String> {
        let f = Self::need(self.memcpy_dtod_async, "cuMemcpyDtoDAsync_v2")?;
        self.in_primary_context(device, || {
            // SAFETY: a context is current; the pointers, size and stream are the caller's promise.
            let rc = unsafe { f(dst as u64, src as u64, bytes, stream as CuStream) };
            if rc != 0 { Err(format!("CUDA cuMemcpyDtoDAsync failed (error {rc})")) } else { Ok(()) }
        })
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
