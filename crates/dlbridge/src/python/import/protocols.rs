//! The other protocols `asdlpack` takes, as a [`ManagedTensor`]: the buffer protocol,
//! `__array_interface__` (v3) and `__cuda_array_interface__` (v2, v3) (which one speaks is
//! [`super::dispatch`]'s choice). Every field of the non-DLPack protocols is checked, and a
//! refusal names the protocol, the object's type and the field.

use std::ffi::CStr;

use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::cuda::Driver;
use crate::device::Device;
use crate::dims::Dims;
use crate::dtype::DataType;
use crate::flags::Flags;
use crate::interface;
use crate::managed::ManagedTensor;
use crate::python::runtime::{HeldBuffer, PyOwner};

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().fully_qualified_name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// Any array-protocol object as a tensor, with the CUDA producer stream if it declared one.
pub struct AnyTensor {
    /// The tensor.
    pub tensor: ManagedTensor,
    /// The producer's CUDA stream (`__cuda_array_interface__` v3), to be waited on by consumers.
    pub producer_stream: Option<usize>,
}

/// The one refusal of an object that is not an array, on every path (from_dlpack, arguments,
/// asdlpack): what it is, what the path takes (`accepts`; empty: every protocol), and, where that
/// is not every protocol, that `dlbridge.asdlpack` takes the rest. It names no function: an
/// argument's refusal gets PyO3's note naming the argument instead.
pub(crate) fn not_an_array(obj: &Bound<'_, PyAny>, accepts: &str) -> PyErr {
    const ALL: &str = "__dlpack__, the buffer protocol, __array_interface__ or __cuda_array_interface__";
    let t = type_name(obj);
    PyTypeError::new_err(if accepts.is_empty() {
        format!("expected an array (an object with {ALL}), got {t}")
    } else {
        format!(
            "expected an array (an object with {accepts}), got {t}; dlbridge.asdlpack(x) makes a DLPack \
             tensor of any object with {ALL}"
        )
    })
}

fn buffer_error(obj: &Bound<'_, PyAny>, msg: impl std::fmt::Display) -> PyErr {
    PyBufferError::new_err(format!("buffer protocol of {}: {msg}", type_name(obj)))
}

/// What a filled buffer-protocol view describes besides its dims, checked.
pub(crate) struct ViewMeta {
    /// Element type, from the format and item size.
    pub dtype: DataType,
    /// Whether the exporter forbids writes.
    pub readonly: bool,
}

const _: () = assert!(size_of::<isize>() == size_of::<i64>(), "buffer views assume a 64-bit Py_ssize_t");

/// Reads and checks a filled `Py_buffer`, writing its shape and element strides into `dims`: no
/// suboffsets, a tensor format consistent with the item size, ndim within `MAX_NDIM`, byte strides
/// that are multiples of the item size (never truncated), valid extents, and `len` equal to the
/// element count times the item size. NULL strides mean C order and a NULL shape a 1-d buffer of
/// `len / itemsize` items (PEP 3118, as numpy reads them). The error names the field. The one
/// reader of buffer views: `asdlpack` and `TensorView` both call it.
pub(crate) fn read_view(v: &ffi::Py_buffer, dims: &mut Dims) -> Result<ViewMeta, String> {
    if !v.suboffsets.is_null() {
        return Err("suboffsets (indirect, PIL-style buffers) cannot be a tensor".into());
    }
    let format = if v.format.is_null() {
        std::borrow::Cow::Borrowed("B")
    } else {
        // SAFETY: a NUL-terminated format string owned by the view.
        unsafe { CStr::from_ptr(v.format) }.to_string_lossy()
    };
    let itemsize = usize::try_from(v.itemsize)
        .ok()
        .filter(|&i| i > 0)
        .ok_or_else(|| format!("itemsize {} is not positive", v.itemsize))?;
    let dtype = interface::buffer_format(&format, itemsize).map_err(|e| e.to_string())?;
    let ndim = usize::try_from(v.ndim)
        .ok()
        .filter(|&n| n <= crate::MAX_NDIM)
        .ok_or_else(|| format!("ndim {} is out of range", v.ndim))?;
    let len = usize::try_from(v.len).map_err(|_| format!("len {} is negative", v.len))?;
    if v.shape.is_null() {
        // A plain byte run: one dimension of len / itemsize items.
        if ndim > 1 || len % itemsize != 0 {
            return Err(format!(
                "shape is NULL with ndim {ndim} and len {len} (not a whole number of {itemsize}-byte items)"
            ));
        }
        let n = ndim;
        let (shape, strides) = dims.resize(n);
        if n == 1 {
            shape[0] = (len / itemsize) as i64;
            strides[0] = 1;
        }
    } else {
        let (shape, strides) = dims.resize(ndim);
        // SAFETY: the exporter provides ndim shape entries while the view is held; Py_ssize_t has
        // the size and alignment of int64_t (asserted above).
        let given = unsafe { std::slice::from_raw_parts(v.shape.cast::<i64>(), ndim) };
        shape.copy_from_slice(given);
        if v.strides.is_null() {
            strides.copy_from_slice(&crate::layout::c_strides(given));
        } else {
            // SAFETY: as for shape.
            let bytes = unsafe { std::slice::from_raw_parts(v.strides, ndim) };
            interface::element_strides(bytes.iter().map(|&b| b as i64), itemsize, strides)?;
        }
    }
    let numel = crate::layout::element_count(dims.shape()).map_err(|e| e.to_string())?;
    if numel.checked_mul(itemsize as u64) != Some(len as u64) {
        return Err(format!("len {len} does not match shape {:?} of {itemsize}-byte items", dims.shape()));
    }
    Ok(ViewMeta { dtype, readonly: v.readonly != 0 })
}

#[inline]
pub(super) fn from_buffer(obj: &Bound<'_, PyAny>) -> PyResult<ManagedTensor> {
    let held = HeldBuffer::get(obj, ffi::PyBUF_RECORDS_RO)?;
    let mut dims = Dims::new();
    let m = read_view(held.view(), &mut dims).map_err(|e| buffer_error(obj, e))?;
    let flags = Flags::NONE.with(Flags::READ_ONLY, m.readonly);
    let data = held.view().buf;
    // SAFETY: the view's memory (data, as the exporter describes it) stays valid while `held`
    // holds the view; writable only if the exporter said so.
    let t = unsafe {
        ManagedTensor::from_raw_parts(
            data,
            Device::CPU,
            m.dtype,
            dims.shape(),
            Some(dims.strides()),
            0,
            flags,
            held,
        )
    };
    t.map_err(|e| buffer_error(obj, e))
}

/// Reads `d[key]`, or `None` when absent.
fn item<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    d.get_item(key)
}

/// The fields `__array_interface__` and `__cuda_array_interface__` share, parsed.
struct Interface<'py> {
    dict: Bound<'py, PyDict>,
    typestr: String,
    shape: Vec<i64>,
    /// In bytes, as the interface gives them.
    strides_bytes: Option<Vec<i64>>,
}

impl Interface<'_> {
    /// The layout checked by [`interface::array_layout`] (for a buffer of `buffer_len` bytes).
    fn layout(
        &self,
        who: &str,
        offset: usize,
        buffer_len: Option<usize>,
    ) -> PyResult<interface::ArrayLayout> {
        interface::array_layout(&self.typestr, &self.shape, self.strides_bytes.as_deref(), offset, buffer_len)
            .map_err(|p| match p {
                interface::LayoutProblem::Value(m) => PyValueError::new_err(format!("{who}: {m}")),
                interface::LayoutProblem::NotATensor(m) => PyBufferError::new_err(format!("{who}: {m}")),
            })
    }
}

/// Parses the fields `__array_interface__` and `__cuda_array_interface__` share.
fn interface_fields<'py>(
    obj: &Bound<'py, PyAny>,
    proto: &str,
    raw: &Bound<'py, PyAny>,
    versions: &[i64],
) -> PyResult<Interface<'py>> {
    let who = || format!("{proto} of {}", type_name(obj));
    let wrong = |field: &str, want: &str, got: &Bound<'_, PyAny>| {
        PyTypeError::new_err(format!(
            "{}: '{field}' must be {want}, got {}",
            who(),
            got.repr().map(|r| r.to_string()).unwrap_or_else(|_| type_name(got))
        ))
    };
    let d = raw.cast::<PyDict>().map_err(|_| wrong("(the interface itself)", "a dict", raw))?.clone();
    let version = item(&d, "version")?
        .ok_or_else(|| PyValueError::new_err(format!("{}: 'version' is missing", who())))?;
    let v: i64 = version.extract().map_err(|_| wrong("version", "an int", &version))?;
    if !versions.contains(&v) {
        return Err(PyValueError::new_err(format!(
            "{}: 'version' {v} is not supported (supported: {versions:?})",
            who()
        )));
    }
    let ts = item(&d, "typestr")?
        .ok_or_else(|| PyValueError::new_err(format!("{}: 'typestr' is missing", who())))?;
    let ts_s: String = ts.extract().map_err(|_| wrong("typestr", "a str", &ts))?;
    if let Some(descr) = item(&d, "descr")? {
        let ok =
            descr.cast::<PyList>().ok().filter(|l| l.len() == 1).and_then(|l| l.get_item(0).ok()).and_then(
                |f| {
                    let (name, t): (String, String) = f.extract().ok()?;
                    Some(name.is_empty() && t == ts_s)
                },
            );
        if ok != Some(true) {
            return Err(PyBufferError::new_err(format!(
                "{}: 'descr' {} is not consistent with typestr {ts_s:?} (structured dtypes are not tensors)",
                who(),
                descr.repr()?
            )));
        }
    }
    let shape_o =
        item(&d, "shape")?.ok_or_else(|| PyValueError::new_err(format!("{}: 'shape' is missing", who())))?;
    let shape: Vec<i64> = shape_o
        .cast::<PyTuple>()
        .ok()
        .and_then(|t| t.extract().ok())
        .ok_or_else(|| wrong("shape", "a tuple of ints", &shape_o))?;
    let strides_bytes: Option<Vec<i64>> = match item(&d, "strides")? {
        None => None,
        Some(s) if s.is_none() => None,
        Some(s) => Some(
            s.cast::<PyTuple>()
                .ok()
                .and_then(|t| t.extract().ok())
                .ok_or_else(|| wrong("strides", "None or a tuple of ints", &s))?,
        ),
    };
    if let Some(m) = item(&d, "mask")? {
        if !m.is_none() {
            return Err(PyBufferError::new_err(format!(
                "{}: 'mask' is set; masked arrays cannot be a tensor",
                who()
            )));
        }
    }
    Ok(Interface { dict: d, typestr: ts_s, shape, strides_bytes })
}

/// Reads `data` as `(pointer, readonly)`.
fn pointer_pair(who: &str, data: &Bound<'_, PyAny>) -> PyResult<(usize, bool)> {
    let bad = || {
        PyTypeError::new_err(format!(
            "{who}: 'data' must be a (pointer, readonly) tuple of an int and a bool, got {}",
            data.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    };
    let t = data.cast::<PyTuple>().map_err(|_| bad())?;
    if t.len() != 2 {
        return Err(bad());
    }
    let p = t.get_item(0)?;
    let ptr: i128 = p.extract().map_err(|_| bad())?;
    let ptr = usize::try_from(ptr)
        .map_err(|_| PyValueError::new_err(format!("{who}: 'data' pointer {ptr} is not an address")))?;
    let ro: bool = t.get_item(1)?.extract().map_err(|_| bad())?;
    Ok((ptr, ro))
}

pub(super) fn from_array_interface(obj: &Bound<'_, PyAny>, ai: &Bound<'_, PyAny>) -> PyResult<ManagedTensor> {
    let who = format!("__array_interface__ of {}", type_name(obj));
    let iface = interface_fields(obj, "__array_interface__", ai, &[3])?;
    let (d, shape) = (iface.dict.clone(), iface.shape.clone());
    let offset = match item(&d, "offset")? {
        None => 0usize,
        Some(o) => o
            .extract::<usize>()
            .map_err(|_| PyTypeError::new_err(format!("{who}: 'offset' must be a non-negative int")))?,
    };
    let data = item(&d, "data")?;
    let to_err = |e: crate::Error| PyBufferError::new_err(format!("{who}: {e}"));
    match data {
        Some(data) if data.is_instance_of::<PyTuple>() => {
            let (ptr, ro) = pointer_pair(&who, &data)?;
            if offset != 0 {
                return Err(PyValueError::new_err(format!(
                    "{who}: 'offset' applies only when 'data' is a buffer, not a pointer"
                )));
            }
            let l = iface.layout(&who, 0, None)?;
            let flags = Flags::NONE.with(Flags::READ_ONLY, ro);
            // SAFETY: the interface promises the memory is valid while `obj` lives; the owner
            // keeps `obj` alive. The layout is validated (overflow, NULL with elements).
            unsafe {
                ManagedTensor::from_raw_parts(
                    ptr as *mut _,
                    Device::CPU,
                    l.dtype,
                    &shape,
                    l.strides.as_deref(),
                    0,
                    flags,
                    PyOwner::new(obj),
                )
            }
            .map_err(to_err)
        }
        other => {
            // 'data' is an object exposing the buffer protocol, or None: the object itself does.
            let src = match &other {
                Some(o) if !o.is_none() => o.clone(),
                _ => obj.clone(),
            };
            // SAFETY: a type-slot check on a live object.
            if unsafe { ffi::PyObject_CheckBuffer(src.as_ptr()) } != 1 {
                return Err(PyTypeError::new_err(format!(
                    "{who}: 'data' must be a (pointer, readonly) tuple or an object with the buffer protocol, got {}",
                    type_name(&src)
                )));
            }
            let view = HeldBuffer::get(&src, ffi::PyBUF_RECORDS_RO)?;
            let base = view.view().buf as usize;
            let len = view.view().len as usize;
            let ro = view.view().readonly != 0;
            let l = iface.layout(&who, offset, Some(len))?;
            let flags = Flags::NONE.with(Flags::READ_ONLY, ro);
            // SAFETY: the layout was checked to stay inside the buffer view, which the owner holds.
            unsafe {
                ManagedTensor::from_raw_parts(
                    (base + offset) as *mut _,
                    Device::CPU,
                    l.dtype,
                    &shape,
                    l.strides.as_deref(),
                    0,
                    flags,
                    (view, PyOwner::new(obj)),
                )
            }
            .map_err(to_err)
        }
    }
}

pub(super) fn from_cuda_array_interface(
    obj: &Bound<'_, PyAny>,
    cai: &Bound<'_, PyAny>,
    device_id: Option<i32>,
) -> PyResult<AnyTensor> {
    let who = format!("__cuda_array_interface__ of {}", type_name(obj));
    let iface = interface_fields(obj, "__cuda_array_interface__", cai, &[2, 3])?;
    let (d, shape) = (iface.dict.clone(), iface.shape.clone());
    let interface::ArrayLayout { dtype, strides } = iface.layout(&who, 0, None)?;
    let data = item(&d, "data")?.ok_or_else(|| PyValueError::new_err(format!("{who}: 'data' is missing")))?;
    let (ptr, ro) = pointer_pair(&who, &data)?;
    let producer_stream =
        match item(&d, "stream")? {
            None => None,
            Some(s) if s.is_none() => None,
            Some(s) => {
                let v: i64 = s
                    .extract()
                    .map_err(|_| PyTypeError::new_err(format!("{who}: 'stream' must be None or an int")))?;
                if v == 0 {
                    return Err(PyValueError::new_err(format!(
                        "{who}: 'stream' 0 is disallowed (ambiguous); use 1 or 2 for default streams"
                    )));
                }
                Some(usize::try_from(v).map_err(|_| {
                    PyValueError::new_err(format!("{who}: 'stream' {v} is not a stream handle"))
                })?)
            }
        };
    let numel =
        crate::layout::element_count(&shape).map_err(|e| PyBufferError::new_err(format!("{who}: {e}")))?;
    let (id, managed) = match device_id {
        Some(id) => (id, false),
        None if numel == 0 || ptr == 0 => (0, false),
        None => Driver::get().and_then(|drv| drv.pointer_device(ptr)).map_err(|why| {
            PyBufferError::new_err(format!(
                "{who}: cannot tell which CUDA device pointer {ptr:#x} is on ({why}); pass device_id= to asdlpack"
            ))
        })?,
    };
    let device = if managed { Device::new(crate::DeviceType::CUDA_MANAGED, id) } else { Device::cuda(id) };
    let flags = Flags::NONE.with(Flags::READ_ONLY, ro);
    // SAFETY: the interface promises the device memory is valid while `obj` lives; the owner keeps
    // it alive; the pointer is recorded, never dereferenced on the host.
    let tensor = unsafe {
        ManagedTensor::from_raw_parts(
            ptr as *mut _,
            device,
            dtype,
            &shape,
            strides.as_deref(),
            0,
            flags,
            PyOwner::new(obj),
        )
    }
    .map_err(|e| PyBufferError::new_err(format!("{who}: {e}")))?;
    Ok(AnyTensor { tensor, producer_stream })
}
