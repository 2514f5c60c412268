//! Tensors across processes: `dlbridge.shared_empty`, `dlbridge.share`, and pickling
//! (`Tensor.__reduce_ex__`). The one door between Python and [`crate::shm`].
//!
//! A Tensor pickles as:
//! - **a handle** when its memory lies in a shared segment ([`crate::shm`]), whatever the protocol
//!   and whatever its strides (a view such as `a[::2]` of shared memory is shared memory): a tuple
//!   of a few integers (under 1 KiB whatever the size); unpickling in any process on the machine
//!   maps the same memory. Pickling pins the segment in the pickling process until a receiver
//!   has opened the pickle, so a worker may return a shared tensor and drop it (see `shm`'s docs
//!   for the lifetime);
//! - **one out-of-band `PickleBuffer`** over its bytes with protocol 5 (no copy at pickling; with
//!   a `buffer_callback` the bytes travel beside the pickle, as Ray's object store takes them;
//!   without one, in-band: `bytes` for a read-only tensor, `bytearray` otherwise);
//! - **bytes** (one copy) with protocols 0 to 4.
//!
//! The buffer and bytes forms carry the byte range the elements span with the tensor's own
//! strides, so the unpickled tensor has the same dtype, shape and strides (negative, zero,
//! Fortran order); a (non-shared) tensor with gaps between its elements (a slice such as
//! `a[::2]`, whose span is larger than its elements) is made C-contiguous first, one copy, rather
//! than sending memory that is not the tensor's. Unpickling a buffer gives a tensor over that buffer (zero-copy: a Ray
//! worker's tensor lies in the object store), read-only if the tensor was or if the buffer is
//! (the object store's are, as numpy's arrays from it are); bytes are copied once into aligned
//! memory.
//!
//! A **CUDA** Tensor pickles as a CUDA IPC handle (whatever the protocol; under 1 KiB): the
//! 64-byte `cuIpcGetMemHandle` handle of the allocation its memory lies in, the data's byte
//! offset in it, the allocation's size, the device ordinal, the pickling process's pid, and the
//! dtype, shape, strides and flags. Another process opens it on the same device ordinal (in the
//! device's primary context) and gets a Tensor over the same memory, which closes the mapping
//! (`cuIpcCloseMemHandle`) when the last Tensor over it drops; the process that pickled it (CUDA
//! will not open a process's own handle) gets a Tensor over the original memory, which keeps the
//! original Tensor alive, as long as that Tensor is still alive (else a BufferError).
//! - *Streams*: pickling waits (GIL released) until all work queued on the device's primary
//!   context has finished (`cuCtxSynchronize`), so a receiver reads on any stream what the sender
//!   queued before pickling; the handle carries no event. Writes in the receiver reach the
//!   sender's view when the receiver has synchronised (e.g. `torch.cuda.synchronize()`) and said
//!   so (a queue, an event): dlbridge does not order work across processes after the handle.
//! - *Lifetime*: CUDA IPC does not keep memory alive: the sender must keep the Tensor (or what it
//!   came from) until every receiver is done with it and has dropped it, as for host handles;
//!   freeing it earlier leaves receivers reading memory the sender's allocator may reuse.
//! - Only memory from `cudaMalloc`/`cuMemAlloc` (torch's and cupy's default allocators) has a
//!   handle; managed memory, stream-ordered pools and VMM allocations refuse (BufferError). The
//!   ordinal names the same GPU only where both processes see the same devices
//!   (`CUDA_VISIBLE_DEVICES`). Without a CUDA driver, pickling a CUDA Tensor and unpickling a CUDA
//!   handle are BufferErrors that say so. Other device types refuse to pickle (TypeError).
//!
//! Unpickling checks every field of what it is given (BufferError naming the field): a pickle is
//! data from elsewhere.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyTuple};

use crate::cuda::{Driver, IPC_HANDLE_SIZE};
use crate::device::DeviceType;
use crate::dtype::{DataType, TypeCode};
use crate::export::{AlignedBuffer, HostBuffer};
use crate::flags::Flags;
use crate::layout;
use crate::managed::ManagedTensor;
use crate::python::Tensor;
use crate::python::import::asdlpack_with;
use crate::python::runtime::PyDType;
use crate::shm::{Handle, Pin, Segment, SegmentId};

/// The first item of a shared tensor's handle tuple, and its version.
const HANDLE_TAG: &str = "dlbridge-shm";
const HANDLE_VERSION: u32 = 2;
/// The first item of a CUDA tensor's handle tuple, and its version.
const CUDA_TAG: &str = "dlbridge-cuda";
const CUDA_VERSION: u32 = 1;

/// The rebuild functions pickles name (registered by [`add`], so a pickle names this module's).
static REBUILD_SHARED: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static REBUILD_BUFFER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static REBUILD_BYTES: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static REBUILD_CUDA: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static WAIT_FOR_PINS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
/// The pid of the process whose exit hooks wait for pins ([`register_exit_wait`]).
static EXIT_WAIT_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Adds `shared_empty`, `share` and the private rebuild functions to a module.
pub(crate) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(shared_empty, m)?)?;
    m.add_function(wrap_pyfunction!(share, m)?)?;
    for (f, slot) in [
        (wrap_pyfunction!(_rebuild_shared, m)?, &REBUILD_SHARED),
        (wrap_pyfunction!(_rebuild_buffer, m)?, &REBUILD_BUFFER),
        (wrap_pyfunction!(_rebuild_bytes, m)?, &REBUILD_BYTES),
        (wrap_pyfunction!(_rebuild_cuda, m)?, &REBUILD_CUDA),
        (wrap_pyfunction!(_wait_for_pins, m)?, &WAIT_FOR_PINS),
    ] {
        m.add_function(f.clone())?;
        let _ = slot.set(py, f.into_any().unbind());
    }
    // PyO3 lists every added function in `__all__`; the rebuild functions are private.
    let all = m.index()?;
    for name in ["_rebuild_shared", "_rebuild_buffer", "_rebuild_bytes", "_rebuild_cuda", "_wait_for_pins"] {
        all.call_method1("remove", (name,))?;
    }
    Ok(())
}

fn rebuild_fn<'py>(py: Python<'py>, slot: &PyOnceLock<Py<PyAny>>) -> PyResult<Bound<'py, PyAny>> {
    slot.get(py).map(|f| f.bind(py).clone()).ok_or_else(|| {
        PyTypeError::new_err(
            "cannot pickle a dlbridge Tensor: this extension module did not register dlbridge's \
             functions (call dlbridge::python::init_module)",
        )
    })
}

fn dtype_arg(dtype: &Bound<'_, PyAny>) -> PyResult<DataType> {
    if let Ok(d) = dtype.cast::<PyDType>() {
        return Ok(d.get().0);
    }
    if let Ok(name) = dtype.extract::<&str>() {
        return Ok(name.parse::<DataType>()?);
    }
    Err(PyTypeError::new_err(format!(
        "shared_empty(): dtype must be a dlbridge.DType or a dtype name such as \"float32\", got {}",
        dtype.get_type().name().map(|n| n.to_string()).unwrap_or_default()
    )))
}

fn shape_arg(shape: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let dims: Vec<i64> = match shape.extract::<i64>() {
        Ok(n) => vec![n],
        Err(_) => shape.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "shared_empty(): shape must be an int or a sequence of ints, got {}",
                shape.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?,
    };
    if let Some(d) = dims.iter().find(|&&d| d < 0) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "shared_empty(): shape {} has a negative extent {d}",
            crate::error::tuple(&dims)
        )));
    }
    if dims.len() > crate::MAX_NDIM {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "shared_empty(): shape has {} dimensions, at most {} are supported",
            dims.len(),
            crate::MAX_NDIM
        )));
    }
    Ok(dims)
}

fn shm_error(what: &str, e: crate::shm::ShmError) -> PyErr {
    if e.field == "memory" {
        // As numpy refuses an allocation no machine of this size could back.
        return pyo3::exceptions::PyMemoryError::new_err(format!("{what}: {}", e.message));
    }
    PyBufferError::new_err(format!("{what}: {e}"))
}

/// Compact bytes of `numel` elements of a dtype, or an error naming the shape.
fn compact_bytes(dtype: DataType, shape: &[i64], padded: bool) -> PyResult<usize> {
    let numel = layout::element_count(shape)?;
    let bytes = layout::compact_byte_size(numel, dtype.storage_bits(padded))?;
    usize::try_from(bytes).ok().filter(|&b| b <= isize::MAX as usize).ok_or_else(|| {
        PyBufferError::new_err(format!(
            "shape {} of {dtype}: {bytes} bytes do not fit in memory",
            crate::error::tuple(shape)
        ))
    })
}

/// `dlbridge.shared_empty(shape, dtype)`: a zero-filled, writable, C-contiguous CPU tensor in
/// shared memory, which pickles as a handle (see the module docs).
///
/// Args:
///     shape: an int or a sequence of ints.
///     dtype: a `dlbridge.DType` or a dtype name (`"float32"`, `"bfloat16"`).
///
/// Returns:
///     A shared `dlbridge.Tensor`.
///
/// Raises:
///     TypeError: `shape` or `dtype` of the wrong type.
///     ValueError: a negative extent, an unknown dtype name, too many dimensions.
///     MemoryError: more bytes than this machine could ever back: its memory plus swap, this
///         process's memory cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`, plus swap) or
///         `RLIMIT_FSIZE` (the message names the size and the limit). Pages are only reserved
///         when touched, so a size under the limit can still run out later, as `numpy.empty` can.
///     BufferError: the segment cannot be made (descriptors, the kernel's refusal).
#[pyfunction]
fn shared_empty(shape: &Bound<'_, PyAny>, dtype: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let py = shape.py();
    crate::python::runtime::enter(py);
    let dtype = dtype_arg(dtype)?;
    dtype.validate()?;
    let shape = shape_arg(shape)?;
    let bytes = compact_bytes(dtype, &shape, false)?;
    let seg = Segment::create(bytes).map_err(|e| shm_error("shared_empty()", e))?;
    register_exit_wait(py);
    Ok(Tensor::new(seg.tensor(dtype, &shape, None, 0, 0, Flags::NONE)?))
}

/// The segment a host tensor's memory lies in, with the offsets its handle records: the distance
/// from the segment's data to the tensor's `data` pointer and the producer's `byte_offset`.
fn segment_of(t: &ManagedTensor) -> Option<(Arc<Segment>, u64, u64)> {
    if !t.is_host_accessible() {
        return None;
    }
    let first = t.data_ptr() as usize;
    let (lo, hi) = if t.numel() == 0 {
        (0, 0)
    } else {
        let bits = t.dtype().storage_bits(t.flags().is_subbyte_padded());
        layout::byte_span(t.shape(), t.strides(), bits).ok()?
    };
    let start = first.checked_add_signed(lo)?;
    let (seg, _) = Segment::containing(start, (hi - lo) as usize)?;
    let base = seg.data() as usize;
    let data = t.dl_tensor().data as usize;
    // The producer's (data, byte_offset) pair where data lies in the segment; else the first
    // element as data (the pair's sum is what matters).
    let (off, byte_offset) =
        if data >= base { ((data - base) as u64, t.byte_offset()) } else { ((first - base) as u64, 0) };
    Some((seg, off, byte_offset))
}

/// `dlbridge.share(x)`: a shared tensor with `x`'s contents (dtype, shape): `x` itself, as a
/// Tensor (read-only if `x` is), when its memory already lies in a shared segment; otherwise one
/// copy into a new segment (C-contiguous), which is writable whatever `x` was: it is new memory
/// that only dlbridge holds (so a copy of a jax array, which is read-only, goes back to jax). A
/// CUDA `x` is returned as a Tensor over the same memory (no copy) once the driver has confirmed
/// that its allocation has a CUDA IPC handle; its pickle is that handle (see the module docs for
/// the stream and lifetime contract).
///
/// Args:
///     x: any DLPack producer or object with an array protocol, in host memory or CUDA memory.
///
/// Returns:
///     A shared `dlbridge.Tensor`.
///
/// Raises:
///     TypeError: `x` speaks no array protocol.
///     BufferError: `x` is on another device, its dtype cannot be copied compactly (a packed
///         sub-byte dtype with strides), or the segment cannot be made; for CUDA memory, no
///         CUDA driver, or memory without an IPC handle (managed memory, a stream-ordered pool).
#[pyfunction]
fn share(x: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let t = asdlpack_with(x, None)?.tensor;
    if t.device().device_type() == DeviceType::CUDA {
        cuda_export(&t, "share()")?;
        return Ok(Tensor::new(t));
    }
    if !t.is_host_accessible() {
        return Err(PyBufferError::new_err(format!(
            "share(): x is on {}; only host and CUDA memory can be shared",
            t.device()
        )));
    }
    if segment_of(&t).is_some() {
        return Ok(Tensor::new(t));
    }
    copy_to_segment(x.py(), &t, "share()", false)
}

/// A new shared tensor with a C-contiguous copy of a host tensor's elements and dtype, read-only
/// if `readonly`.
fn copy_to_segment(py: Python<'_>, t: &ManagedTensor, what: &str, readonly: bool) -> PyResult<Tensor> {
    let padded = t.flags().is_subbyte_padded();
    let bytes = compact_bytes(t.dtype(), t.shape(), padded)?;
    let copied;
    let src: &ManagedTensor = if t.is_c_contiguous() {
        t
    } else {
        copied = t.to_contiguous()?;
        &copied
    };
    let seg = Segment::create(bytes).map_err(|e| shm_error(what, e))?;
    register_exit_wait(py);
    {
        let _lease = src.lease(false)?;
        // SAFETY: `src` is a compact host tensor of `bytes` bytes from its first element (C order,
        // validated on entry); the segment has `bytes` bytes of data; a shared lease is held.
        unsafe { std::ptr::copy_nonoverlapping(src.data_ptr().cast::<u8>(), seg.data(), bytes) };
    }
    let flags = Flags::NONE.with(Flags::READ_ONLY, readonly).with(Flags::IS_SUBBYTE_TYPE_PADDED, padded);
    Ok(Tensor::new(seg.tensor(t.dtype(), t.shape(), None, 0, 0, flags)?))
}

/// `Tensor.__deepcopy__`: a shared tensor's copy is a new shared tensor (its pickle, a handle,
/// would give the same memory back); any other tensor's is what pickling gives (its bytes).
pub(crate) fn deepcopy<'py>(slf: &Bound<'py, Tensor>) -> PyResult<Bound<'py, PyAny>> {
    let t = slf.get().shared();
    if !t.is_host_accessible() {
        // Its pickle (a CUDA IPC handle) would give the same memory back, not a copy.
        return Err(PyTypeError::new_err(format!(
            "cannot deepcopy a dlbridge Tensor on {}: copy it with its framework",
            t.device()
        )));
    }
    if segment_of(t).is_some() {
        return Ok(
            Bound::new(slf.py(), copy_to_segment(slf.py(), t, "deepcopy()", t.is_read_only())?)?.into_any()
        );
    }
    let reduced = reduce_ex(slf, 4)?;
    reduced.get_item(0)?.call1(reduced.get_item(1)?.cast_into::<PyTuple>()?)
}

/// A read-only or writable flat byte buffer over part of a tensor, which keeps the tensor alive:
/// what a protocol-5 pickle's `PickleBuffer` wraps.
#[pyclass(frozen, module = "dlbridge._dlbridge", name = "_TensorBytes")]
struct TensorBytes {
    _owner: Arc<ManagedTensor>,
    ptr: usize,
    len: usize,
    readonly: bool,
}

#[pymethods]
impl TensorBytes {
    unsafe fn __getbuffer__(slf: PyRef<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if flags & ffi::PyBUF_WRITABLE != 0 && slf.readonly {
            return Err(PyBufferError::new_err("buffer protocol: the tensor is read-only"));
        }
        let (ptr, len, ro) = (slf.ptr, slf.len as ffi::Py_ssize_t, c_int::from(slf.readonly));
        // SAFETY: `view` is the consumer's Py_buffer; FillInfo takes a new reference to this object,
        // which owns the tensor whose `len` bytes from `ptr` it spans (checked when made).
        let rc = unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr as *mut c_void, len, ro, flags) };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

fn dtype_tuple(t: DataType) -> (u8, u8, u16) {
    (t.code().0, t.bits(), t.lanes())
}

/// `Tensor.__reduce_ex__(protocol)` (see the module docs).
pub(crate) fn reduce_ex<'py>(slf: &Bound<'py, Tensor>, protocol: i32) -> PyResult<Bound<'py, PyTuple>> {
    let py = slf.py();
    let t = slf.get().shared();
    if t.device().device_type() == DeviceType::CUDA {
        return reduce_cuda(py, t);
    }
    if !t.is_host_accessible() {
        return Err(PyTypeError::new_err(format!(
            "cannot pickle a dlbridge Tensor on {}: only host and CUDA memory pickle",
            t.device()
        )));
    }
    let padded = t.flags().is_subbyte_padded();
    let (readonly, dtype) = (t.is_read_only(), dtype_tuple(t.dtype()));
    if let Some((seg, data_offset, byte_offset)) = segment_of(t) {
        let h = seg.handle();
        // The sender keeps the memory until a receiver has opened this pickle (see the module docs).
        let (slot, tag) = seg.pin().map_or((-1, 0), |p| (i32::from(p.slot), p.tag));
        if slot >= 0 {
            register_exit_wait(py);
        }
        let handle = (
            (
                HANDLE_TAG,
                HANDLE_VERSION,
                h.pid,
                h.fd,
                h.id.dev,
                h.id.ino,
                PyBytes::new(py, &h.id.token),
                slot,
                tag,
            ),
            (h.data_len, data_offset, byte_offset),
            (dtype, t.shape(), t.strides(), readonly, padded),
        );
        return PyTuple::new(
            py,
            [rebuild_fn(py, &REBUILD_SHARED)?, PyTuple::new(py, [handle.into_pyobject(py)?])?.into_any()],
        );
    }
    // The byte range the elements span, relative to the first; a layout with gaps is compacted.
    let bits = t.dtype().storage_bits(padded);
    let (lo, hi) = if t.numel() == 0 { (0, 0) } else { layout::byte_span(t.shape(), t.strides(), bits)? };
    let compact = compact_bytes(t.dtype(), t.shape(), padded)?;
    let (src, lo, hi) = if (hi - lo) as usize > compact {
        let c = Arc::new(t.to_contiguous()?);
        (c, 0, compact as isize)
    } else {
        (Arc::clone(t), lo, hi)
    };
    let start = (src.data_ptr() as usize).wrapping_add_signed(lo);
    let len = (hi - lo) as usize;
    let meta = (dtype, src.shape().to_vec(), src.strides().to_vec(), (-lo) as u64, readonly, padded);
    if protocol >= 5 {
        let bytes = TensorBytes { _owner: src, ptr: start, len, readonly };
        let pb = py.import("pickle")?.getattr("PickleBuffer")?.call1((Bound::new(py, bytes)?,))?;
        let args = (pb, meta.0, meta.1, meta.2, meta.3, meta.4, meta.5).into_pyobject(py)?;
        PyTuple::new(py, [rebuild_fn(py, &REBUILD_BUFFER)?, args.into_any()])
    } else {
        let data = {
            let _lease = src.lease(false)?;
            // SAFETY: the `len` bytes from `start` are the span of `src`'s elements (validated on
            // entry), alive while `src` is; a shared lease is held while they are read.
            PyBytes::new(py, unsafe { std::slice::from_raw_parts(start as *const u8, len) })
        };
        let args = (data, meta.0, meta.1, meta.2, meta.3, meta.4, meta.5).into_pyobject(py)?;
        PyTuple::new(py, [rebuild_fn(py, &REBUILD_BYTES)?, args.into_any()])
    }
}

/// Waits (GIL released) until every shared tensor this process pickled in the last 10 s has been
/// opened by a receiver, at most until 2 s after this process's first call (private: run at exit,
/// see [`register_exit_wait`]).
#[pyfunction]
fn _wait_for_pins(py: Python<'_>) {
    // One 2 s budget per process however many hooks call it (a child of `os.fork` inherits its
    // parent's atexit hook and registers its own: it waited 4 s, review), yet every call still
    // waits for what is pending then: from CPython 3.13 a multiprocessing child runs the atexit
    // hook before the finalizers that flush a queue's feeder thread, so the first call may find
    // no pin yet, and the finalizer's call is the one that must wait (CI, 3.13).
    static FIRST: std::sync::Mutex<Option<(u32, std::time::Instant)>> = std::sync::Mutex::new(None);
    let me = std::process::id();
    let first = {
        let mut g = FIRST.lock().unwrap_or_else(|e| e.into_inner());
        match *g {
            Some((pid, at)) if pid == me => at,
            _ => g.insert((me, std::time::Instant::now())).1,
        }
    };
    let left = Duration::from_secs(2).saturating_sub(first.elapsed());
    py.detach(|| crate::shm::wait_for_recent_pins(Duration::from_secs(10), left));
}

/// Makes this process wait for its recent pins before it exits (once per process, when it first
/// makes, opens or pickles a segment): an `atexit` hook, and a `multiprocessing` finalizer (a
/// multiprocessing child leaves through `os._exit` after the finalizers registered before its
/// exit began: registering when the tensor is made, not when a queue's feeder thread pickles it,
/// puts it among them; priority -10 runs after the queue's feeder thread has flushed, at -5).
/// Best effort: if the hooks cannot be registered (an interpreter shutting down), the process
/// exits without waiting, and the next call tries again.
fn register_exit_wait(py: Python<'_>) {
    let me = std::process::id();
    if EXIT_WAIT_PID.swap(me, std::sync::atomic::Ordering::Relaxed) == me {
        return;
    }
    if register_exit_hooks(py).is_err() {
        EXIT_WAIT_PID.store(0, std::sync::atomic::Ordering::Relaxed);
    }
}

fn register_exit_hooks(py: Python<'_>) -> PyResult<()> {
    let Some(f) = WAIT_FOR_PINS.get(py) else { return Ok(()) };
    py.import("atexit")?.call_method1("register", (f,))?;
    if py.import("sys")?.getattr("modules")?.contains("multiprocessing.util")? {
        let kw = pyo3::types::PyDict::new(py);
        kw.set_item("exitpriority", -10)?;
        py.import("multiprocessing.util")?.getattr("Finalize")?.call((py.None(), f), Some(&kw))?;
    }
    Ok(())
}

/// A BufferError about a field of what is being unpickled.
fn bad(field: &str, why: impl std::fmt::Display) -> PyErr {
    PyBufferError::new_err(format!("unpickling a dlbridge Tensor: {field}: {why}"))
}

fn field<'py, T: for<'a> FromPyObject<'a, 'py>>(
    t: &Bound<'py, PyTuple>,
    i: usize,
    name: &str,
) -> PyResult<T> {
    let v = t.get_item(i).map_err(|_| bad(name, "missing"))?;
    v.extract::<T>().map_err(|_| {
        bad(name, format!("unexpected value {}", v.repr().map(|r| r.to_string()).unwrap_or_default()))
    })
}

/// A handle's outer tuple (three parts) and its first part (`who_len` items: tag, version, pid,
/// then the kind's own), with the tag and version checked: `(handle, who, pid)`.
fn handle_header<'a, 'py>(
    handle: &'a Bound<'py, PyAny>,
    tag: &str,
    version: u32,
    who_len: usize,
) -> PyResult<(&'a Bound<'py, PyTuple>, Bound<'py, PyTuple>, u32)> {
    let h = handle.cast::<PyTuple>().map_err(|_| bad("handle", "not a tuple"))?;
    if h.len() != 3 {
        return Err(bad("handle", format!("{} items, expected 3", h.len())));
    }
    let who = tuple_field(h, 0, "handle", who_len)?;
    let got_tag: String = field(&who, 0, "handle.tag")?;
    let got_version: u32 = field(&who, 1, "handle.version")?;
    if got_tag != tag || got_version != version {
        return Err(bad(
            "handle.version",
            format!("{got_tag:?} version {got_version}; this dlbridge reads {tag:?} {version}"),
        ));
    }
    let pid: u32 = field(&who, 2, "handle.pid")?;
    Ok((h, who, pid))
}

/// A handle's second and third parts: `(size, data offset, byte offset)` (the data offset's field
/// named `offset_name`) and the layout, each read and checked by [`meta`].
fn handle_place_and_layout(h: &Bound<'_, PyTuple>, offset_name: &str) -> PyResult<(u64, u64, u64, Meta)> {
    let place = tuple_field(h, 1, "handle", 3)?;
    let size: u64 = field(&place, 0, "handle.size")?;
    let data_offset: u64 = field(&place, 1, offset_name)?;
    let byte_offset: u64 = field(&place, 2, "handle.byte_offset")?;
    let desc = tuple_field(h, 2, "handle", 5)?;
    let m = meta(
        field(&desc, 0, "dtype")?,
        field(&desc, 1, "shape")?,
        field(&desc, 2, "strides")?,
        field(&desc, 3, "readonly")?,
        field(&desc, 4, "subbyte_padded")?,
    )?;
    Ok((size, data_offset, byte_offset, m))
}

fn tuple_field<'py>(
    t: &Bound<'py, PyTuple>,
    i: usize,
    name: &str,
    len: usize,
) -> PyResult<Bound<'py, PyTuple>> {
    let v = t.get_item(i).map_err(|_| bad(name, "missing"))?;
    let v = v.cast_into::<PyTuple>().map_err(|_| bad(name, "not a tuple"))?;
    if v.len() != len {
        return Err(bad(name, format!("{} items, expected {len}", v.len())));
    }
    Ok(v)
}

/// The tensor description shared by every form: dtype, shape, strides, flags.
struct Meta {
    dtype: DataType,
    shape: Vec<i64>,
    strides: Vec<i64>,
    flags: Flags,
}

fn meta(
    dtype: (u8, u8, u16),
    shape: Vec<i64>,
    strides: Vec<i64>,
    readonly: bool,
    padded: bool,
) -> PyResult<Meta> {
    let dtype = DataType::new(TypeCode(dtype.0), dtype.1, dtype.2);
    dtype.validate().map_err(|e| bad("dtype", e))?;
    if shape.len() > crate::MAX_NDIM || shape.iter().any(|&d| d < 0) {
        return Err(bad("shape", crate::error::tuple(&shape)));
    }
    if strides.len() != shape.len() {
        return Err(bad(
            "strides",
            format!("{} for shape {}", crate::error::tuple(&strides), crate::error::tuple(&shape)),
        ));
    }
    let flags = Flags::NONE.with(Flags::READ_ONLY, readonly).with(Flags::IS_SUBBYTE_TYPE_PADDED, padded);
    Ok(Meta { dtype, shape, strides, flags })
}

/// Unpickles a shared tensor's handle (private: pickles name it).
#[pyfunction]
fn _rebuild_shared(handle: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let py = handle.py();
    crate::python::runtime::enter(py);
    let (h, who, pid) = handle_header(handle, HANDLE_TAG, HANDLE_VERSION, 9)?;
    let fd: i32 = field(&who, 3, "handle.fd")?;
    let (dev, ino): (u64, u64) = (field(&who, 4, "handle.dev")?, field(&who, 5, "handle.inode")?);
    let token: Vec<u8> = field(&who, 6, "handle.token")?;
    let token: [u8; 16] = token
        .try_into()
        .map_err(|t: Vec<u8>| bad("handle.token", format!("{} bytes, expected 16", t.len())))?;
    let slot: i32 = field(&who, 7, "handle.pin_slot")?;
    let tag: u32 = field(&who, 8, "handle.pin_tag")?;
    let pin = match slot {
        -1 => None,
        s if (0..crate::shm::PIN_SLOTS as i32).contains(&s) && tag != 0 => Some(Pin { slot: s as u8, tag }),
        _ => return Err(bad("handle.pin_slot", format!("slot {slot} with tag {tag}"))),
    };
    let (data_len, data_offset, byte_offset, m) = handle_place_and_layout(h, "handle.data_offset")?;
    let handle = Handle { pid, fd, id: SegmentId { dev, ino, token }, data_len, pin };
    let seg = Segment::open(&handle).map_err(|e| bad(&format!("handle.{}", e.field), e.message))?;
    register_exit_wait(py);
    let t = seg
        .tensor(m.dtype, &m.shape, Some(&m.strides), data_offset, byte_offset, m.flags)
        .map_err(|e| bad("handle.shape/strides/offsets", e))?;
    Ok(Tensor::new(t))
}

/// A tensor over (or, `copy`, a copy of) the bytes of `buf` with this description, the first
/// element `first` bytes in.
fn rebuild(buf: &Bound<'_, PyAny>, m: Meta, first: u64, copy: bool) -> PyResult<Tensor> {
    let src = asdlpack_with(buf, None).map_err(|e| bad("buffer", e))?.tensor;
    if !src.is_host_accessible() || !src.is_c_contiguous() {
        return Err(bad("buffer", "not a contiguous host buffer"));
    }
    let len = u64::try_from(src.nbytes()).map_err(|_| bad("buffer", "too large"))?;
    if !crate::shm::fits_in(m.dtype, &m.shape, &m.strides, m.flags, first, len)
        .map_err(|e| bad("shape", e))?
    {
        return Err(bad(
            "shape/strides",
            format!(
                "{} strides {} of {} from byte {first} do not fit in {len} bytes",
                crate::error::tuple(&m.shape),
                crate::error::tuple(&m.strides),
                m.dtype
            ),
        ));
    }
    let align = m.dtype.itemsize().unwrap_or(1).next_power_of_two().min(16);
    let aligned = (src.data_ptr() as usize + first as usize) % align == 0;
    if copy || !aligned {
        let mut out = AlignedBuffer::<u8>::zeroed(len as usize);
        let dst = out.as_mut_ptr();
        {
            let _lease = src.lease(false)?;
            // SAFETY: `src` is a compact host buffer of `len` bytes (checked above) and `out` has
            // `len` bytes; a shared lease is held on the source.
            unsafe { std::ptr::copy_nonoverlapping(src.data_ptr().cast::<u8>(), dst, len as usize) };
        }
        // SAFETY: every element the layout reaches lies in the `len` bytes from `dst` (checked
        // above against `src`, which has as many), which `out`, the owner, keeps allocated (its
        // heap block does not move with it) and nothing else refers to.
        let t = unsafe {
            ManagedTensor::from_raw_parts(
                dst.cast::<c_void>(),
                crate::Device::CPU,
                m.dtype,
                &m.shape,
                Some(&m.strides),
                first,
                m.flags,
                out,
            )
        }
        .map_err(|e| bad("shape/strides", e))?;
        return Ok(Tensor::new(t));
    }
    let flags = m.flags.with(Flags::READ_ONLY, m.flags.is_read_only() || src.is_read_only());
    let data = src.data_ptr();
    // SAFETY: every element the layout reaches lies in the `len` bytes of `src` from `data` (checked
    // above), which `src` (the owner) keeps alive; writable only where `src` is.
    let t = unsafe {
        ManagedTensor::from_raw_parts(
            data,
            src.device(),
            m.dtype,
            &m.shape,
            Some(&m.strides),
            first,
            flags,
            src,
        )
    }
    .map_err(|e| bad("shape/strides", e))?;
    Ok(Tensor::new(t))
}

/// Unpickles a protocol-5 tensor: a tensor over `buf` (private: pickles name it).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _rebuild_buffer(
    buf: &Bound<'_, PyAny>,
    dtype: (u8, u8, u16),
    shape: Vec<i64>,
    strides: Vec<i64>,
    first: u64,
    readonly: bool,
    padded: bool,
) -> PyResult<Tensor> {
    rebuild(buf, meta(dtype, shape, strides, readonly, padded)?, first, false)
}

/// Unpickles a protocol 0-4 tensor: a copy of `data` (private: pickles name it).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _rebuild_bytes(
    data: &Bound<'_, PyAny>,
    dtype: (u8, u8, u16),
    shape: Vec<i64>,
    strides: Vec<i64>,
    first: u64,
    readonly: bool,
    padded: bool,
) -> PyResult<Tensor> {
    rebuild(data, meta(dtype, shape, strides, readonly, padded)?, first, true)
}

// ---- CUDA tensors: CUDA IPC handles ----------------------------------------------------------------

/// The CUDA tensors this process pickled, by the IPC handle of their allocation: (device,
/// handle, allocation base, allocation size, the tensor). Unpickling in this same process (CUDA
/// will not open a process's own handle) finds the tensor here while it is alive.
type Exported = (i32, [u8; IPC_HANDLE_SIZE], usize, usize, std::sync::Weak<ManagedTensor>);

static EXPORTED: std::sync::Mutex<Vec<Exported>> = std::sync::Mutex::new(Vec::new());

fn exported() -> std::sync::MutexGuard<'static, Vec<Exported>> {
    // Every change is one push or retain: a panic while holding the lock leaves it consistent.
    EXPORTED.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a CUDA tensor's handle records: the allocation's IPC handle, base and size, and the data
/// pointer's place in it as (data_offset, byte_offset).
struct CudaExport {
    ipc: crate::cuda::IpcExport,
    data_offset: u64,
    byte_offset: u64,
}

/// The IPC handle of the allocation a CUDA tensor's elements lie in, checked: the driver places
/// the elements on the tensor's device, not in managed memory, all inside one allocation.
fn cuda_export(t: &ManagedTensor, what: &str) -> PyResult<CudaExport> {
    let device = t.device().id();
    let fail = |why: String| PyBufferError::new_err(format!("{what}: a tensor on {}: {why}", t.device()));
    let drv = Driver::get().map_err(fail)?;
    let first = t.data_ptr() as usize;
    let (lo, hi) = if t.numel() == 0 {
        (0, 0)
    } else {
        let bits = t.dtype().storage_bits(t.flags().is_subbyte_padded());
        layout::byte_span(t.shape(), t.strides(), bits)?
    };
    let start = first.checked_add_signed(lo).ok_or_else(|| fail("its span overflows".into()))?;
    let (ordinal, managed) = drv.pointer_device(start).map_err(fail)?;
    if ordinal != device {
        return Err(fail(format!("the driver places its memory on device {ordinal}")));
    }
    if managed {
        return Err(fail("managed (unified) memory has no CUDA IPC handle".into()));
    }
    let ipc = drv.ipc_export(device, start).map_err(fail)?;
    let end = start as u128 + (hi - lo) as u128;
    if end > ipc.base as u128 + ipc.size as u128 {
        return Err(fail(format!(
            "its elements run past the end of their allocation ({:#x}, {} bytes)",
            ipc.base, ipc.size
        )));
    }
    let data = t.dl_tensor().data as usize;
    // The producer's (data, byte_offset) pair where data lies in the allocation; else the first
    // element as data (the pair's sum is what matters).
    let (data_offset, byte_offset) = if data >= ipc.base && data - ipc.base <= ipc.size {
        ((data - ipc.base) as u64, t.byte_offset())
    } else {
        ((first - ipc.base) as u64, 0)
    };
    Ok(CudaExport { ipc, data_offset, byte_offset })
}

/// `Tensor.__reduce_ex__` of a CUDA tensor: a CUDA IPC handle (see the module docs).
fn reduce_cuda<'py>(py: Python<'py>, t: &Arc<ManagedTensor>) -> PyResult<Bound<'py, PyTuple>> {
    let what = "cannot pickle a dlbridge Tensor";
    let ex = cuda_export(t, what)?;
    let device = t.device().id();
    // Everything queued on the device so far finishes before the handle exists (the stream
    // contract); the GIL is released meanwhile.
    py.detach(|| Driver::get().and_then(|d| d.synchronize(device)))
        .map_err(|e| PyBufferError::new_err(format!("{what}: a tensor on {}: {e}", t.device())))?;
    {
        let mut reg = exported();
        reg.retain(|e| e.4.strong_count() > 0);
        let w = Arc::downgrade(t);
        // Once per tensor and allocation, however often it is pickled.
        if !reg.iter().any(|e| e.0 == device && e.1 == ex.ipc.handle && std::sync::Weak::ptr_eq(&e.4, &w)) {
            reg.push((device, ex.ipc.handle, ex.ipc.base, ex.ipc.size, w));
        }
    }
    let padded = t.flags().is_subbyte_padded();
    let handle = (
        (CUDA_TAG, CUDA_VERSION, std::process::id(), device, PyBytes::new(py, &ex.ipc.handle)),
        (ex.ipc.size as u64, ex.data_offset, ex.byte_offset),
        (dtype_tuple(t.dtype()), t.shape(), t.strides(), t.is_read_only(), padded),
    );
    PyTuple::new(
        py,
        [rebuild_fn(py, &REBUILD_CUDA)?, PyTuple::new(py, [handle.into_pyobject(py)?])?.into_any()],
    )
}

/// A live tensor this process pickled with this handle, with its allocation's base and size.
fn exported_tensor(
    device: i32,
    handle: &[u8; IPC_HANDLE_SIZE],
) -> Option<(Arc<ManagedTensor>, usize, usize)> {
    let reg = exported();
    // Upgraded under the lock, dropped (if ever the last) only after it is released.
    let found = reg
        .iter()
        .filter(|e| e.0 == device && &e.1 == handle)
        .find_map(|e| e.4.upgrade().map(|t| (t, e.2, e.3)));
    drop(reg);
    found
}

/// Unpickles a CUDA tensor's IPC handle (private: pickles name it).
#[pyfunction]
fn _rebuild_cuda(handle: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let py = handle.py();
    crate::python::runtime::enter(py);
    let (h, who, pid) = handle_header(handle, CUDA_TAG, CUDA_VERSION, 5)?;
    let device: i32 = field(&who, 3, "handle.device")?;
    if device < 0 {
        return Err(bad("handle.device", format!("{device} is not a device ordinal")));
    }
    let ipc: Vec<u8> = field(&who, 4, "handle.ipc_handle")?;
    let ipc: [u8; IPC_HANDLE_SIZE] = ipc.try_into().map_err(|t: Vec<u8>| {
        bad("handle.ipc_handle", format!("{} bytes, expected {IPC_HANDLE_SIZE}", t.len()))
    })?;
    let (size, data_offset, byte_offset, m) = handle_place_and_layout(h, "handle.offset")?;
    // The layout must lie in the allocation the handle declares (and, below, in what it maps).
    let first =
        data_offset.checked_add(byte_offset).ok_or_else(|| bad("handle.offset", "offset overflow"))?;
    if data_offset > size
        || !crate::shm::fits_in(m.dtype, &m.shape, &m.strides, m.flags, first, size)
            .map_err(|e| bad("handle.shape/strides/offsets", e))?
    {
        return Err(bad(
            "handle.shape/strides/offsets",
            format!(
                "shape {} strides {} of {} from byte {data_offset} + {byte_offset} do not fit in the \
                 {size}-byte allocation",
                crate::error::tuple(&m.shape),
                crate::error::tuple(&m.strides),
                m.dtype
            ),
        ));
    }
    let mut flags = m.flags;
    let (base, owner): (usize, Box<dyn Send + Sync>) = if pid == std::process::id() {
        let Some((orig, base, alloc)) = exported_tensor(device, &ipc) else {
            return Err(bad(
                "handle.pid",
                "a CUDA handle this process made, of memory no Tensor it pickled holds any more (CUDA \
                 cannot open a process's own handle; keep the tensor until the receivers are done)",
            ));
        };
        if alloc as u64 != size {
            return Err(bad("handle.size", format!("{size}, but the allocation has {alloc} bytes")));
        }
        // Never more writable than the tensor it maps.
        flags = flags.with(Flags::READ_ONLY, flags.is_read_only() || orig.is_read_only());
        (base, Box::new(orig))
    } else {
        let drv = Driver::get().map_err(|e| bad("handle", format!("cannot open a CUDA IPC handle: {e}")))?;
        let mapping = py.detach(|| drv.ipc_open(device, &ipc)).map_err(|e| bad("handle.ipc_handle", e))?;
        // The layout lies in `size` bytes (checked above); the mapping must have them (the
        // driver may report an importer's allocation rounded up to its granularity).
        if (mapping.size() as u64) < size {
            return Err(bad(
                "handle.size",
                format!("{size}, but the opened allocation has only {} bytes", mapping.size()),
            ));
        }
        (mapping.ptr(), Box::new(mapping))
    };
    let data = base.wrapping_add(data_offset as usize) as *mut c_void;
    // SAFETY: every element the layout reaches lies inside `size` bytes from `base` (checked
    // above), which the allocation has (the size the driver reports for the opened mapping, or
    // the one recorded when this process pickled it); the owner keeps it alive: the IPC mapping (closed when the last
    // tensor drops) or the live tensor this process pickled. Other processes may write it (see
    // the module docs); nothing here dereferences device memory.
    let t = unsafe {
        ManagedTensor::from_raw_parts(
            data,
            crate::Device::cuda(device),
            m.dtype,
            &m.shape,
            Some(&m.strides),
            byte_offset,
            flags,
            owner,
        )
    }
    .map_err(|e| bad("handle.shape/strides/offsets", e))?;
    Ok(Tensor::new(t))
}
