//! The Python vocabulary: `dlbridge.DType`, `dlbridge.Device`, the `dlbridge.DeviceType` IntEnum,
//! the mapping of [`crate::Error`] onto the exceptions the array API standard names, and the
//! `dlbridge.Tensor` class itself (what it holds and how it is made; every room makes or reads
//! one). Its Python methods, the producer side, are in `export/tensor.rs`.

use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::device::{Device, DeviceType};
use crate::dtype::DataType;
use crate::error::Error;
use crate::managed::ManagedTensor;

impl From<Error> for PyErr {
    /// Validation refusals (what cannot be imported or exported) become `BufferError`; bad names and
    /// buffer/layout mismatches `ValueError`; a tensor of the wrong kind for an operation or a
    /// kernel's stated requirements ([`Error::Mismatch`]) or a write the producer refuses
    /// ([`Error::WriteRefused`]) `TypeError`.
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        exception(&e, msg)
    }
}

/// The exception class for `e`, with `msg`.
fn exception(e: &Error, msg: String) -> PyErr {
    match e {
        Error::UnknownDtypeName { .. } | Error::UnknownDeviceName { .. } | Error::BufferMismatch { .. } => {
            PyValueError::new_err(msg)
        }
        Error::Incompatible { .. } | Error::Mismatch(_) | Error::WriteRefused { .. } => {
            PyTypeError::new_err(msg)
        }
        _ => PyBufferError::new_err(msg),
    }
}

/// `e` as the exception for the argument `name`, as PyO3 reports a failed argument conversion:
/// the error's own message, with the note `while processing 'x'` (PEP 678, shown in tracebacks;
/// Python 3.11 and later). For arguments a function converts itself, such as
/// [`crate::python::TensorView::typed`] after a dtype dispatch, so both kinds read the same.
pub fn argument_error(name: &str, e: Error) -> PyErr {
    let err = PyErr::from(e);
    Python::attach(|py| {
        // A Python without notes (3.10) keeps the bare error, as PyO3 does.
        let _ = err
            .value(py)
            .call_method1(pyo3::intern!(py, "add_note"), (format!("while processing '{name}'"),));
    });
    err
}

/// A DLPack element type: `code`, `bits`, `lanes`; `str()` gives the numpy/ml_dtypes name.
#[cfg_attr(
    feature = "dlbridge-module",
    pyclass(module = "dlbridge", name = "DType", frozen, eq, hash, from_py_object)
)]
#[cfg_attr(
    not(feature = "dlbridge-module"),
    pyclass(module = "dlbridge.embedded", name = "DType", frozen, eq, hash, from_py_object)
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyDType(pub DataType);

#[pymethods]
impl PyDType {
    /// `DType("float32")`, or `DType(code, bits, lanes=1)`.
    #[new]
    #[pyo3(signature = (name_or_code, bits=None, lanes=1))]
    fn new(name_or_code: &Bound<'_, PyAny>, bits: Option<u8>, lanes: u16) -> PyResult<Self> {
        let t = if let Ok(name) = name_or_code.extract::<&str>() {
            if bits.is_some() {
                return Err(PyTypeError::new_err("DType(name) takes no bits; use DType(code, bits, lanes)"));
            }
            name.parse::<DataType>()?
        } else {
            let code: u8 = name_or_code.extract()?;
            let bits =
                bits.ok_or_else(|| PyTypeError::new_err("DType(code, bits, lanes): bits is required"))?;
            let t = DataType::new(crate::TypeCode(code), bits, lanes);
            t.validate()?;
            t
        };
        Ok(Self(t))
    }

    /// The DLPack type code.
    #[getter]
    fn code(&self) -> u8 {
        self.0.code().0
    }

    /// Bits per lane.
    #[getter]
    fn bits(&self) -> u8 {
        self.0.bits()
    }

    /// Lanes (1 for scalars).
    #[getter]
    fn lanes(&self) -> u16 {
        self.0.lanes()
    }

    /// The name numpy, torch or ml_dtypes use ("float32", "bfloat16", "float8_e4m3fn").
    #[getter]
    fn name(&self) -> String {
        self.0.to_string()
    }

    /// Bytes per element, or None for packed sub-byte types.
    #[getter]
    fn itemsize(&self) -> Option<usize> {
        self.0.itemsize()
    }

    fn __str__(&self) -> String {
        self.0.to_string()
    }

    fn __repr__(&self) -> String {
        format!("dlbridge.{}", self.0)
    }
}

/// A device: `type` (a DeviceType) and `id`; `str()` gives "cpu" or "cuda:1".
#[cfg_attr(
    feature = "dlbridge-module",
    pyclass(module = "dlbridge", name = "Device", frozen, eq, hash, from_py_object)
)]
#[cfg_attr(
    not(feature = "dlbridge-module"),
    pyclass(module = "dlbridge.embedded", name = "Device", frozen, eq, hash, from_py_object)
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyDevice(pub Device);

#[pymethods]
impl PyDevice {
    /// `Device("cuda:1")`, `Device("cuda", 1)`, `Device(DeviceType.CUDA, 1)` or `Device(2, 1)`.
    #[new]
    #[pyo3(signature = (kind, id=None))]
    fn new(kind: &Bound<'_, PyAny>, id: Option<i32>) -> PyResult<Self> {
        if let Ok(name) = kind.extract::<&str>() {
            let d = name.parse::<Device>()?;
            return match id {
                None => Ok(Self(d)),
                Some(i) if !name.contains(':') => Ok(Self(Device::new(d.device_type(), i))),
                Some(i) if i == d.id() => Ok(Self(d)),
                Some(i) => Err(PyValueError::new_err(format!(
                    "device: {name:?} names ordinal {}, but id={i} was given too",
                    d.id()
                ))),
            };
        }
        let t: i32 = kind.extract()?;
        if !DeviceType(t).is_known() {
            return Err(PyValueError::new_err(format!("device type: {t} is not a DLPack 1.3 device type")));
        }
        Ok(Self(Device::new(DeviceType(t), id.unwrap_or(0))))
    }

    /// The device type, a `dlbridge.DeviceType` member.
    #[getter]
    fn r#type<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        device_type_member(py, self.0.device_type())
    }

    /// The ordinal.
    #[getter]
    fn id(&self) -> i32 {
        self.0.id()
    }

    fn __str__(&self) -> String {
        self.0.to_string()
    }

    fn __repr__(&self) -> String {
        format!("dlbridge.Device('{}')", self.0)
    }

    /// `(type, id)`, as `__dlpack_device__` returns it.
    fn __dlpack_device__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        dlpack_device_tuple(py, self.0)
    }
}

/// The names of the `DeviceType` members, by code (the array API's names where it has one; 19-21
/// were merged into the header after DLPack 1.3).
const DEVICE_TYPE_NAMES: [(i32, &str); 19] = [
    (1, "CPU"),
    (2, "CUDA"),
    (3, "CUDA_HOST"),
    (4, "OPENCL"),
    (7, "VULKAN"),
    (8, "METAL"),
    (9, "VPI"),
    (10, "ROCM"),
    (11, "ROCM_HOST"),
    (12, "EXT_DEV"),
    (13, "CUDA_MANAGED"),
    (14, "ONE_API"),
    (15, "WEBGPU"),
    (16, "HEXAGON"),
    (17, "MAIA"),
    (18, "TRN"),
    (19, "TPU"),
    (20, "TPU_HOST"),
    (21, "ASCEND"),
];

/// The `dlbridge.DeviceType` IntEnum and its members indexed by code, made once per interpreter.
struct DeviceTypes {
    enum_type: Py<PyAny>,
    members: Vec<Option<Py<PyAny>>>,
}

static DEVICE_TYPES: PyOnceLock<DeviceTypes> = PyOnceLock::new();

fn device_types(py: Python<'_>) -> PyResult<&DeviceTypes> {
    DEVICE_TYPES.get_or_try_init(py, || {
        let pairs = PyList::empty(py);
        for (code, name) in DEVICE_TYPE_NAMES {
            pairs.append((name, code))?;
        }
        let kwargs = PyDict::new(py);
        kwargs.set_item("module", "dlbridge")?;
        let enum_type = py.import("enum")?.getattr("IntEnum")?.call(("DeviceType", pairs), Some(&kwargs))?;
        let last = DEVICE_TYPE_NAMES[DEVICE_TYPE_NAMES.len() - 1].0 as usize;
        let mut members: Vec<Option<Py<PyAny>>> = (0..=last).map(|_| None).collect();
        for (code, name) in DEVICE_TYPE_NAMES {
            members[code as usize] = Some(enum_type.getattr(name)?.unbind());
        }
        Ok(DeviceTypes { enum_type: enum_type.unbind(), members })
    })
}

/// The `dlbridge.DeviceType` IntEnum class.
pub fn device_type_enum(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    Ok(device_types(py)?.enum_type.bind(py).clone())
}

/// The `DeviceType` member for `t` (a plain int for a type the header does not name).
pub fn device_type_member(py: Python<'_>, t: DeviceType) -> PyResult<Bound<'_, PyAny>> {
    let m = usize::try_from(t.0).ok().and_then(|i| device_types(py).ok()?.members.get(i)?.as_ref());
    match m {
        Some(m) => Ok(m.bind(py).clone()),
        None => Ok(t.0.into_pyobject(py)?.into_any()),
    }
}

/// `(DeviceType member, id)`.
pub fn dlpack_device_tuple(py: Python<'_>, d: Device) -> PyResult<Bound<'_, PyTuple>> {
    PyTuple::new(py, [device_type_member(py, d.device_type())?, d.id().into_pyobject(py)?.into_any()])
}

/// Reads a device given as "cpu"/"cuda:1", a `dlbridge.Device`, or a `(type, id)` tuple.
pub fn extract_device(obj: &Bound<'_, PyAny>) -> PyResult<Device> {
    if let Ok(d) = obj.cast::<PyDevice>() {
        return Ok(d.get().0);
    }
    if let Ok(name) = obj.extract::<&str>() {
        return Ok(name.parse::<Device>()?);
    }
    if let Ok((t, id)) = obj.extract::<(i32, i32)>() {
        if !DeviceType(t).is_known() {
            return Err(PyValueError::new_err(format!("device: type {t} is not a DLPack 1.3 device type")));
        }
        return Ok(Device::new(DeviceType(t), id));
    }
    Err(PyTypeError::new_err(format!(
        "device: expected \"cpu\", a dlbridge.Device or a (type, id) tuple, got {}",
        obj.get_type().name()?
    )))
}

/// A DLPack tensor owned by dlbridge: any DLPack consumer (numpy, torch, jax, ...) accepts it,
/// as often as asked.
// The Python package's own module is `dlbridge`; a downstream extension's copy of the class is
// another class (not `dlbridge.Tensor`, which `isinstance` would deny), and says so.
#[cfg_attr(feature = "dlbridge-module", pyclass(module = "dlbridge", name = "Tensor", frozen))]
#[cfg_attr(not(feature = "dlbridge-module"), pyclass(module = "dlbridge.embedded", name = "Tensor", frozen))]
pub struct Tensor {
    pub(in crate::python) inner: Arc<ManagedTensor>,
    /// `__dlpack_device__`'s tuple, made on first call.
    pub(in crate::python) device_tuple: PyOnceLock<Py<PyTuple>>,
    /// The CUDA stream the producer's work is queued on (`__cuda_array_interface__` v3): consumers
    /// asking for a stream are made to wait on it.
    pub(in crate::python) producer_stream: Option<usize>,
}

impl Tensor {
    /// Wraps a tensor.
    pub fn new(t: ManagedTensor) -> Self {
        Self { inner: Arc::new(t), device_tuple: PyOnceLock::new(), producer_stream: None }
    }

    /// Wraps a tensor whose producer queues work on CUDA stream `stream`.
    pub fn with_producer_stream(t: ManagedTensor, stream: Option<usize>) -> Self {
        Self { inner: Arc::new(t), device_tuple: PyOnceLock::new(), producer_stream: stream }
    }

    /// Why the exchange table's unsynchronised exports must refuse this tensor, if they must: one
    /// whose producer queues work on a CUDA stream (`__cuda_array_interface__` v3) needs the
    /// stream handshake that only `__dlpack__(stream=...)` makes (the table's consumer would read
    /// before the producer's work is done).
    pub(crate) fn unsynchronised_export_refusal(&self) -> Option<PyErr> {
        self.producer_stream.map(|s| {
            PyBufferError::new_err(format!(
                "exchange API: the tensor's producer queues work on CUDA stream {s:#x}; a no-sync \
                 export cannot wait for it, so use __dlpack__(stream=...)"
            ))
        })
    }

    /// The shared tensor.
    pub fn shared(&self) -> &Arc<ManagedTensor> {
        &self.inner
    }
}

impl<'py> IntoPyObject<'py> for ManagedTensor {
    type Target = Tensor;
    type Output = Bound<'py, Tensor>;
    type Error = PyErr;

    /// A `dlbridge.Tensor` owning this tensor, so a `#[pyfunction]` can return a `ManagedTensor`.
    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, Tensor>> {
        Bound::new(py, Tensor::new(self))
    }
}
