//! `dlbridge.Tensor`'s Python methods: the reusable, spec-complete DLPack producer that Rust code
//! returns to Python (the class and its constructors are in `runtime/types.rs`).
//!
//! A Tensor shares one `Arc<ManagedTensor>`; every `__dlpack__` call makes a new small struct that
//! holds another reference, so capsules are independent (an unconsumed one frees only its own
//! struct) and the data lives while any Tensor, capsule or consumer refers to it.

use std::ffi::{CStr, c_int, c_void};
use std::sync::Arc;

use pyo3::exceptions::{PyAttributeError, PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyTuple};

use crate::device::{Device, DeviceType};
use crate::dtype::DataType;
use crate::flags::Flags;
use crate::python::runtime::fastcall::{self, StaticDef};
use crate::python::runtime::{PyDType, PyDevice, Tensor, dlpack_device_tuple};
use crate::python::runtime::{legacy_capsule, versioned_capsule};

/// The Python buffer-protocol format of a dtype, where it has one.
fn buffer_format(t: DataType) -> Option<&'static CStr> {
    Some(match t {
        DataType::BOOL => c"?",
        DataType::INT8 => c"b",
        DataType::UINT8 => c"B",
        DataType::INT16 => c"h",
        DataType::UINT16 => c"H",
        DataType::INT32 => c"i",
        DataType::UINT32 => c"I",
        DataType::INT64 => c"q",
        DataType::UINT64 => c"Q",
        DataType::FLOAT16 => c"e",
        DataType::FLOAT32 => c"f",
        DataType::FLOAT64 => c"d",
        DataType::COMPLEX64 => c"Zf",
        DataType::COMPLEX128 => c"Zd",
        _ => return None,
    })
}

/// The numpy array-interface typestr of a dtype, where it has one.
fn typestr(t: DataType) -> Option<String> {
    let endian = if cfg!(target_endian = "little") { '<' } else { '>' };
    let (kind, size) = match t {
        DataType::BOOL => return Some("|b1".into()),
        DataType::INT8 => return Some("|i1".into()),
        DataType::UINT8 => return Some("|u1".into()),
        DataType::INT16 | DataType::INT32 | DataType::INT64 => ('i', t.bits() / 8),
        DataType::UINT16 | DataType::UINT32 | DataType::UINT64 => ('u', t.bits() / 8),
        DataType::FLOAT16 | DataType::FLOAT32 | DataType::FLOAT64 => ('f', t.bits() / 8),
        DataType::COMPLEX64 | DataType::COMPLEX128 => ('c', t.bits() / 8),
        _ => return None,
    };
    Some(format!("{endian}{kind}{size}"))
}

/// Parses `max_version`: `None`, or a `(major, minor)` tuple of ints.
fn parse_max_version(v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<(i64, i64)>> {
    let Some(v) = v else { return Ok(None) };
    if v.is_none() {
        return Ok(None);
    }
    // Fast path for the common exact `(int, int)` tuple, without the generic extraction.
    // SAFETY: exact-type checks on live objects, then borrowed reads of a 2-tuple's items.
    unsafe {
        let p = v.as_ptr();
        if ffi::PyTuple_CheckExact(p) == 1 && ffi::PyTuple_GET_SIZE(p) == 2 {
            let (a, b) = (ffi::PyTuple_GET_ITEM(p, 0), ffi::PyTuple_GET_ITEM(p, 1));
            if ffi::PyLong_CheckExact(a) == 1 && ffi::PyLong_CheckExact(b) == 1 {
                let (a, b) = (ffi::PyLong_AsLongLong(a), ffi::PyLong_AsLongLong(b));
                if !(a == -1 || b == -1) || ffi::PyErr_Occurred().is_null() {
                    return Ok(Some((a, b)));
                }
                ffi::PyErr_Clear();
            }
        }
    }
    let ok = v.cast::<PyTuple>().ok().filter(|t| t.len() == 2).and_then(|t| t.extract::<(i64, i64)>().ok());
    ok.map(Some).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "__dlpack__: max_version must be None or a (major, minor) tuple of ints, got {}",
            v.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })
}

/// `Tensor.__dlpack__`'s definition (fastcall; keyword-only parameters).
static DLPACK_DEF: StaticDef = StaticDef::new(
    c"__dlpack__",
    dlpack_fastcall,
    c"__dlpack__($self, /, *, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\nExports a DLPack capsule, per the array API standard: a versioned (1.3) capsule when\n`max_version` is at least `(1, 0)`, a legacy one otherwise.",
);

unsafe extern "C" fn dlpack_fastcall(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: CPython calls a method with the GIL held.
    let py = unsafe { Python::assume_attached() };
    crate::python::runtime::drain_queued(py);
    fastcall::run(py, || {
        let names = [
            pyo3::intern!(py, "stream"),
            pyo3::intern!(py, "max_version"),
            pyo3::intern!(py, "dl_device"),
            pyo3::intern!(py, "copy"),
        ];
        // SAFETY: CPython's fastcall arguments, alive for the call.
        let ([], [stream, max_version, dl_device, copy]) =
            unsafe { fastcall::parse::<0, 4>(py, "__dlpack__", args, nargs, kwnames, names) }?;
        // SAFETY: the method descriptor checked that `slf` is a Tensor (a final class), borrowed.
        let t = unsafe { Bound::from_borrowed_ptr(py, slf).cast_into_unchecked::<Tensor>() };
        t.get().dlpack(py, stream.as_deref(), max_version.as_deref(), dl_device.as_deref(), copy.as_deref())
    })
}

impl Tensor {
    /// The body of `__dlpack__` (see the method's doc above).
    fn dlpack<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<&Bound<'py, PyAny>>,
        dl_device: Option<&Bound<'py, PyAny>>,
        copy: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let versioned = parse_max_version(max_version)?.is_some_and(|(major, _)| major >= 1);
        let copy = match copy.filter(|c| !c.is_none()) {
            None => None,
            Some(c) => Some(c.cast::<PyBool>().map(|b| b.is_true()).map_err(|_| {
                PyTypeError::new_err(format!(
                    "__dlpack__: copy must be None or a bool, got {}",
                    c.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                ))
            })?),
        };
        self.check_stream(stream)?;
        let device = self.target_device(dl_device)?;
        self.sync_streams(stream)?;
        let (source, flags) = if copy == Some(true) {
            if !self.inner.is_host_accessible() {
                return Err(PyBufferError::new_err(format!(
                    "__dlpack__: copy=True needs host memory; this tensor is on {}",
                    self.inner.device()
                )));
            }
            let c = self.inner.to_contiguous()?;
            (Arc::new(c), Flags::IS_COPIED)
        } else {
            (Arc::clone(&self.inner), self.inner.flags())
        };
        if versioned {
            versioned_capsule(py, source.export_versioned_as(device, flags))
        } else if flags.is_read_only() && source.is_versioned() {
            // A tensor that came from a legacy capsule is read-only only by assumption; handing it
            // on as legacy claims no more than its producer did (jax -> dlbridge -> jax works).
            Err(PyBufferError::new_err(
                "__dlpack__: this tensor is read-only and a legacy capsule (max_version None or below (1, 0)) cannot say so; ask with max_version=(1, 0) or later, or copy=True",
            ))
        } else {
            legacy_capsule(py, source.export_legacy_as(device))
        }
    }

    fn check_stream(&self, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let Some(s) = stream.filter(|s| !s.is_none()) else { return Ok(()) };
        let dev = self.inner.device();
        let v: i64 = s.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "__dlpack__: stream must be None or an int for a tensor on {dev}, got {}",
                s.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ))
        })?;
        let t = dev.device_type();
        if t == DeviceType::CPU && v != -1 {
            return Err(PyValueError::new_err(format!(
                "__dlpack__: stream must be None (or -1) for a cpu tensor, got {v}"
            )));
        }
        if matches!(t, DeviceType::CUDA | DeviceType::CUDA_MANAGED | DeviceType::ROCM) && v == 0 {
            return Err(PyValueError::new_err(
                "__dlpack__: stream 0 is ambiguous and disallowed by the standard; use 1 (legacy default), 2 (per-thread) or -1 (no sync)",
            ));
        }
        Ok(())
    }

    /// Makes the consumer's stream wait for the producer's, as the standard asks of a producer:
    /// `stream=None` means the legacy default stream (1), `-1` means no synchronisation.
    fn sync_streams(&self, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let Some(producer) = self.producer_stream else { return Ok(()) };
        let consumer: i64 = match stream.filter(|s| !s.is_none()) {
            None => 1,
            Some(s) => s.extract()?,
        };
        if consumer == -1 || consumer as usize == producer {
            return Ok(());
        }
        let device = self.inner.device().id();
        crate::cuda::Driver::get()
            // SAFETY: the producer stream is the one its `__cuda_array_interface__` declared live;
            // the consumer stream is the caller's, which the array API standard makes responsible
            // for passing a valid stream of the tensor's device (as torch and cupy trust it).
            .and_then(|d| unsafe { d.stream_wait(device, producer, consumer as usize) })
            .map_err(|why| PyBufferError::new_err(format!("__dlpack__: cannot make stream {consumer} wait for the producer's stream {producer:#x}: {why}")))
    }

    /// Where the export says the data lives: the tensor's own device, or cpu when the consumer
    /// asked for cpu and the memory is host-accessible.
    fn target_device(&self, dl_device: Option<&Bound<'_, PyAny>>) -> PyResult<Device> {
        let own = self.inner.device();
        let Some(d) = dl_device.filter(|d| !d.is_none()) else { return Ok(own) };
        let (t, id) = d.extract::<(i32, i32)>().map_err(|_| {
            PyTypeError::new_err(format!(
                "__dlpack__: dl_device must be None or a (device_type, device_id) tuple of ints, got {}",
                d.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?;
        let want = Device::new(DeviceType(t), id);
        if want == own || (want == Device::CPU && own.is_host_accessible()) {
            Ok(want)
        } else {
            Err(PyBufferError::new_err(format!(
                "__dlpack__: dl_device {want} is not available for a tensor on {own}"
            )))
        }
    }
}

#[pymethods]
impl Tensor {
    /// The DLPack 1.3 C exchange table (a `"dlpack_exchange_api"` capsule): consumers that read it
    /// take dlbridge tensors without calling into Python.
    #[classattr]
    fn __dlpack_c_exchange_api__(py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(crate::python::import::tensor_exchange_capsule(py)?.unbind())
    }

    /// Exports a DLPack capsule, per the array API standard: a versioned (1.3) capsule when
    /// `max_version` is at least `(1, 0)`, a legacy one otherwise. A read-only tensor refuses a
    /// legacy capsule (it cannot say read-only), unless the tensor itself came from a legacy
    /// capsule, whose read-only mark is only dlbridge's assumption.
    ///
    /// (Defined with CPython's fastcall convention, see `fastcall.rs`: this class attribute is
    /// the method descriptor.)
    #[classattr]
    fn __dlpack__(py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(DLPACK_DEF.method(&py.get_type::<Tensor>())?.unbind())
    }

    /// Pickling: a shared tensor as a handle to its memory, a CUDA tensor as a CUDA IPC handle,
    /// otherwise its bytes (one out-of-band `PickleBuffer` with protocol 5); see
    /// `python/processes/shared.rs`.
    #[cfg(target_os = "linux")]
    fn __reduce_ex__<'py>(slf: &Bound<'py, Self>, protocol: i32) -> PyResult<Bound<'py, PyTuple>> {
        crate::python::processes::reduce_ex(slf, protocol)
    }

    /// `copy.deepcopy`: new memory (a shared tensor's copy is a new shared tensor; a tensor in
    /// device memory refuses, TypeError); see `python/processes/shared.rs`.
    #[cfg(target_os = "linux")]
    fn __deepcopy__<'py>(slf: &Bound<'py, Self>, memo: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let _ = memo; // nothing inside a Tensor is a Python object to memoise
        crate::python::processes::deepcopy(slf)
    }

    /// `(DeviceType, id)`.
    fn __dlpack_device__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let t = self
            .device_tuple
            .get_or_try_init(py, || dlpack_device_tuple(py, self.inner.device()).map(Bound::unbind))?;
        Ok(t.bind(py).clone())
    }

    /// Extents.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.shape())
    }

    /// Strides in elements.
    #[getter]
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.strides())
    }

    /// Number of dimensions.
    #[getter]
    fn ndim(&self) -> usize {
        self.inner.ndim()
    }

    /// Number of elements.
    #[getter]
    fn size(&self) -> usize {
        self.inner.numel()
    }

    /// The element type.
    #[getter]
    fn dtype(&self) -> PyDType {
        PyDType(self.inner.dtype())
    }

    /// The device.
    #[getter]
    fn device(&self) -> PyDevice {
        PyDevice(self.inner.device())
    }

    /// Whether consumers must not write.
    #[getter]
    fn readonly(&self) -> bool {
        self.inner.is_read_only()
    }

    /// Bytes per element (None for packed sub-byte types).
    #[getter]
    fn itemsize(&self) -> Option<usize> {
        self.inner.dtype().itemsize()
    }

    /// Bytes the elements would take if compact (exact, even past 2^64 for broadcast tensors).
    #[getter]
    fn nbytes(&self) -> u128 {
        self.inner.nbytes()
    }

    /// Address of the first element (byte_offset applied).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.inner.data_ptr() as usize
    }

    /// The producer's byte offset.
    #[getter]
    fn byte_offset(&self) -> u64 {
        self.inner.byte_offset()
    }

    /// Row-major compact.
    #[getter]
    fn is_c_contiguous(&self) -> bool {
        self.inner.is_c_contiguous()
    }

    /// Column-major compact.
    #[getter]
    fn is_f_contiguous(&self) -> bool {
        self.inner.is_f_contiguous()
    }

    fn __repr__(&self) -> String {
        let t = &*self.inner;
        let module = if cfg!(feature = "dlbridge-module") { "dlbridge" } else { "dlbridge.embedded" };
        format!(
            "{module}.Tensor(shape={}, dtype={}, device={}, strides={}, readonly={})",
            crate::error::tuple(t.shape()),
            t.dtype(),
            t.device(),
            crate::error::tuple(t.strides()),
            if t.is_read_only() { "True" } else { "False" }
        )
    }

    /// numpy's array interface (v3), for host memory of a dtype numpy has.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = &*self.inner;
        if !t.is_host_accessible() {
            return Err(PyAttributeError::new_err(format!(
                "__array_interface__: the tensor is on {}, not host memory",
                t.device()
            )));
        }
        let ts = typestr(t.dtype()).ok_or_else(|| {
            PyAttributeError::new_err(format!("__array_interface__: numpy has no typestr for {}", t.dtype()))
        })?;
        self.interface_dict(py, ts, 3)
    }

    /// The CUDA array interface (v3), for CUDA memory.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = &*self.inner;
        if !matches!(t.device().device_type(), DeviceType::CUDA | DeviceType::CUDA_MANAGED) {
            return Err(PyAttributeError::new_err(format!(
                "__cuda_array_interface__: the tensor is on {}, not CUDA memory",
                t.device()
            )));
        }
        let ts = typestr(t.dtype()).ok_or_else(|| {
            PyAttributeError::new_err(format!("__cuda_array_interface__: no typestr for {}", t.dtype()))
        })?;
        let d = self.interface_dict(py, ts, 3)?;
        // v3: the stream the producer's work is queued on (None: no synchronisation needed).
        d.set_item("stream", self.producer_stream)?;
        Ok(d)
    }

    /// The buffer protocol, for host memory of a dtype with a buffer format.
    unsafe fn __getbuffer__(slf: PyRef<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let inner = Arc::clone(&slf.inner);
        let t = &*inner;
        if view.is_null() {
            return Err(PyBufferError::new_err("buffer protocol: NULL view"));
        }
        if !t.is_host_accessible() {
            return Err(PyBufferError::new_err(format!(
                "buffer protocol: the tensor is on {}, not host memory",
                t.device()
            )));
        }
        let fmt = buffer_format(t.dtype()).ok_or_else(|| {
            PyBufferError::new_err(format!(
                "buffer protocol: {} has no buffer format; use DLPack instead",
                t.dtype()
            ))
        })?;
        if flags & ffi::PyBUF_WRITABLE != 0 && t.is_read_only() {
            return Err(PyBufferError::new_err("buffer protocol: the tensor is read-only"));
        }
        let c = t.is_c_contiguous();
        let f = t.is_f_contiguous();
        let want = |mask: c_int| flags & mask == mask;
        let refuse =
            |what: &str| PyBufferError::new_err(format!("buffer protocol: the tensor is not {what}"));
        if want(ffi::PyBUF_C_CONTIGUOUS) && !c {
            return Err(refuse("C-contiguous"));
        }
        if want(ffi::PyBUF_F_CONTIGUOUS) && !f {
            return Err(refuse("Fortran-contiguous"));
        }
        if want(ffi::PyBUF_ANY_CONTIGUOUS) && !(c || f) {
            return Err(refuse("contiguous"));
        }
        if !want(ffi::PyBUF_STRIDES) && !c {
            return Err(refuse("C-contiguous, and the consumer did not ask for strides"));
        }
        let itemsize = t.dtype().itemsize().unwrap_or(1) as isize;
        let n = t.ndim();
        let mut dims: Vec<isize> = Vec::with_capacity(2 * n);
        dims.extend(t.shape().iter().map(|&d| d as isize));
        dims.extend(t.strides().iter().map(|&s| s as isize * itemsize));
        let dims = Box::into_raw(Box::new(dims));
        // SAFETY: `view` is the consumer's Py_buffer to fill; `dims` lives until __releasebuffer__;
        // the view holds a new reference to this Tensor, which keeps the data alive.
        unsafe {
            let v = &mut *view;
            v.obj = slf.into_ptr();
            v.buf = t.data_ptr();
            v.len = (t.numel() as isize) * itemsize;
            v.readonly = c_int::from(t.is_read_only());
            v.itemsize = itemsize;
            v.format = if want(ffi::PyBUF_FORMAT) { fmt.as_ptr().cast_mut() } else { std::ptr::null_mut() };
            v.ndim = n as c_int;
            let base = (*dims).as_mut_ptr();
            v.shape = if want(ffi::PyBUF_ND) { base } else { std::ptr::null_mut() };
            v.strides = if want(ffi::PyBUF_STRIDES) { base.add(n) } else { std::ptr::null_mut() };
            v.suboffsets = std::ptr::null_mut();
            v.internal = dims.cast::<c_void>();
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, view: *mut ffi::Py_buffer) {
        // SAFETY: `internal` is the box made in __getbuffer__, freed once here.
        unsafe {
            let internal = (*view).internal;
            if !internal.is_null() {
                drop(Box::from_raw(internal.cast::<Vec<isize>>()));
                (*view).internal = std::ptr::null_mut();
            }
        }
    }
}

impl Tensor {
    fn interface_dict<'py>(&self, py: Python<'py>, ts: String, version: u32) -> PyResult<Bound<'py, PyDict>> {
        let t = &*self.inner;
        let d = PyDict::new(py);
        d.set_item("version", version)?;
        d.set_item("shape", PyTuple::new(py, t.shape())?)?;
        d.set_item("typestr", &ts)?;
        d.set_item("descr", vec![("", ts.as_str())])?;
        d.set_item("data", (t.data_ptr() as usize, t.is_read_only()))?;
        if t.is_c_contiguous() {
            d.set_item("strides", py.None())?;
        } else {
            let item = t.dtype().itemsize().unwrap_or(1) as i64;
            d.set_item("strides", PyTuple::new(py, t.strides().iter().map(|s| s * item))?)?;
        }
        Ok(d)
    }
}
