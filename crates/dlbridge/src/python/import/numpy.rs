//! A fast, self-verified path for numpy arrays: read the array's C struct directly (data,
//! dimensions, strides, dtype number, byte order, writeable flag), as rust-numpy does, instead of
//! paying numpy's `__dlpack__` (a capsule per call) or its buffer export (a format string per call).
//!
//! dlbridge never imports numpy and is not built against it. The first time it meets an object whose
//! type is named `numpy.ndarray` it reads that array both ways, through the struct and through the
//! buffer protocol, and enables the fast path only if every field agrees; otherwise (a numpy with
//! another layout) the fast path stays off for the process and arrays take the DLPack path.
//! The fields read (`data`, `nd`, `dimensions`, `strides`, `descr`, `flags`; in the descriptor
//! `byteorder` and `type_num`) sit at the same offsets in numpy 1.x and 2.x.

use std::ffi::{c_char, c_int};
use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;

use crate::device::Device;
use crate::dtype::DataType;
use crate::managed::ManagedTensor;

#[repr(C)]
struct ArrayFields {
    ob_base: ffi::PyObject,
    data: *mut c_char,
    nd: c_int,
    dimensions: *mut isize,
    strides: *mut isize,
    base: *mut ffi::PyObject,
    descr: *mut DescrHead,
    flags: c_int,
}

#[repr(C)]
struct DescrHead {
    ob_base: ffi::PyObject,
    typeobj: *mut ffi::PyTypeObject,
    kind: c_char,
    type_char: c_char,
    byteorder: c_char,
    former_flags: c_char,
    type_num: c_int,
}

const NPY_ARRAY_WRITEABLE: c_int = 0x0400;

/// A numpy array's metadata, borrowed from the array (valid while it lives and is not resized).
pub struct NumpyParts<'a> {
    /// Address of the first element.
    pub data: *mut std::ffi::c_void,
    /// Extents.
    pub shape: &'a [isize],
    /// Strides in bytes.
    pub strides: &'a [isize],
    /// Element type.
    pub dtype: DataType,
    /// `not flags.writeable`.
    pub readonly: bool,
}

fn dtype_of(type_num: c_int) -> Option<DataType> {
    let long = if size_of::<std::ffi::c_long>() == 8 { DataType::INT64 } else { DataType::INT32 };
    let ulong = if size_of::<std::ffi::c_ulong>() == 8 { DataType::UINT64 } else { DataType::UINT32 };
    Some(match type_num {
        0 => DataType::BOOL,
        1 => DataType::INT8,
        2 => DataType::UINT8,
        3 => DataType::INT16,
        4 => DataType::UINT16,
        5 => DataType::INT32,
        6 => DataType::UINT32,
        7 => long,
        8 => ulong,
        9 => DataType::INT64,
        10 => DataType::UINT64,
        11 => DataType::FLOAT32,
        12 => DataType::FLOAT64,
        14 => DataType::COMPLEX64,
        15 => DataType::COMPLEX128,
        23 => DataType::FLOAT16,
        _ => return None,
    })
}

/// The verified `numpy.ndarray` type (address), or 0 when the fast path is off.
static NDARRAY: OnceLock<usize> = OnceLock::new();

/// Reads the struct of `obj`, assumed to be a numpy array (unchecked layout).
///
/// # Safety
///
/// `obj` is an instance of numpy.ndarray (or a subclass) whose struct has the layout above.
unsafe fn read<'a>(obj: &'a Bound<'_, PyAny>) -> Option<NumpyParts<'a>> {
    // SAFETY: the caller's promise.
    let a = unsafe { &*obj.as_ptr().cast::<ArrayFields>() };
    let nd = usize::try_from(a.nd).ok().filter(|&n| n <= crate::MAX_NDIM)?;
    if a.descr.is_null() || (nd > 0 && (a.dimensions.is_null() || a.strides.is_null())) {
        return None;
    }
    // SAFETY: a live descriptor owned by the array.
    let d = unsafe { &*a.descr };
    let native = matches!(d.byteorder as u8, b'=' | b'|')
        || (d.byteorder as u8 == b'<') == cfg!(target_endian = "little");
    let dtype = dtype_of(d.type_num)?;
    if !native && dtype.itemsize().unwrap_or(1) > 1 {
        return None;
    }
    // SAFETY: nd entries owned by the array.
    let (shape, strides) = unsafe {
        if nd == 0 {
            (&[][..], &[][..])
        } else {
            (std::slice::from_raw_parts(a.dimensions, nd), std::slice::from_raw_parts(a.strides, nd))
        }
    };
    Some(NumpyParts {
        data: a.data.cast(),
        shape,
        strides,
        dtype,
        readonly: a.flags & NPY_ARRAY_WRITEABLE == 0,
    })
}

/// Whether the buffer protocol describes `obj` exactly as the struct read does: `Some(true)` or
/// `Some(false)`, or `None` when this array cannot decide it (a dtype or byte order the fast path
/// does not read, or one numpy will not export), so a later array is asked instead.
fn agrees_with_buffer(obj: &Bound<'_, PyAny>) -> Option<bool> {
    // SAFETY: only called for an object whose type is named numpy.ndarray.
    let p = unsafe { read(obj) }?;
    let held = match crate::python::runtime::HeldBuffer::get(obj, ffi::PyBUF_RECORDS_RO) {
        Ok(h) => h,
        Err(_) => return None,
    };
    let mut dims = crate::dims::Dims::new();
    let Ok(m) = super::protocols::read_view(held.view(), &mut dims) else { return None };
    let mut from_struct = crate::dims::Dims::new();
    let same = held.view().buf == p.data
        && fill_dims(&p, &mut from_struct)
        && (dims.shape(), dims.strides()) == (from_struct.shape(), from_struct.strides())
        && m.readonly == p.readonly
        && m.dtype == p.dtype
        && p.dtype.itemsize() == usize::try_from(held.view().itemsize).ok();
    Some(same)
}

/// The struct read of `obj` if it is a numpy array and the fast path is verified on.
pub fn parts<'a>(obj: &'a Bound<'_, PyAny>) -> Option<NumpyParts<'a>> {
    let ty = obj.get_type_ptr();
    let verified = match NDARRAY.get() {
        Some(&t) => t,
        None => {
            let ndarray = find_ndarray(ty)?;
            // First sighting of an array that can decide it: verify on this very array, once per
            // process. An array that cannot decide leaves the question open (and takes DLPack).
            let verdict = agrees_with_buffer(obj)?;
            *NDARRAY.get_or_init(|| if verdict { ndarray } else { 0 })
        }
    };
    if verified == 0 {
        return None;
    }
    // SAFETY: a type check against the verified ndarray type.
    if unsafe { ffi::PyObject_TypeCheck(obj.as_ptr(), verified as *mut ffi::PyTypeObject) } == 0 {
        return None;
    }
    // SAFETY: an instance of the verified ndarray type.
    unsafe { read(obj) }
}

/// The struct read of `obj` if its type is exactly the verified `numpy.ndarray` (one pointer
/// comparison: the check every import makes first). Subclasses go through [`parts`].
pub fn parts_exact<'a>(obj: &'a Bound<'_, PyAny>) -> Option<NumpyParts<'a>> {
    match NDARRAY.get() {
        // SAFETY: an instance of exactly the verified ndarray type.
        Some(&t) if t != 0 && obj.get_type_ptr() as usize == t => unsafe { read(obj) },
        _ => None,
    }
}

/// numpy's `ndarray` type if `ty` is it or derives from it ([`parts`] verifies the layout).
pub fn ndarray_type<'py>(ty: &Bound<'py, pyo3::types::PyType>) -> Option<Bound<'py, pyo3::types::PyType>> {
    let p = find_ndarray(ty.as_type_ptr())?;
    // SAFETY: a live type object (a base of `ty`, kept alive by it), borrowed.
    let any = unsafe { Bound::from_borrowed_ptr(ty.py(), p as *mut ffi::PyObject) };
    any.cast_into::<pyo3::types::PyType>().ok()
}

/// `ty` or a base that is numpy's `ndarray`: a static type of that name whose instances are at
/// least as large as the fields read here, if any.
fn find_ndarray(mut ty: *mut ffi::PyTypeObject) -> Option<usize> {
    for _ in 0..32 {
        if ty.is_null() {
            return None;
        }
        // SAFETY: a live type object; tp_name is a NUL-terminated string it owns.
        let name = unsafe { std::ffi::CStr::from_ptr((*ty).tp_name) };
        // numpy's ndarray is a static (non-heap) type whose instances hold the fields read here: a
        // class made in Python can take the name (`__name__ = "numpy.ndarray"`), but it is always a
        // heap type, and a smaller struct would be read out of bounds.
        // SAFETY: as above; reads the type's flags and instance size.
        let (heap, size) =
            unsafe { (ffi::PyType_HasFeature(ty, ffi::Py_TPFLAGS_HEAPTYPE) != 0, (*ty).tp_basicsize) };
        if name.to_bytes() == b"numpy.ndarray" && !heap && size >= size_of::<ArrayFields>() as ffi::Py_ssize_t
        {
            return Some(ty as usize);
        }
        // SAFETY: as above.
        ty = unsafe { (*ty).tp_base };
    }
    None
}

/// Whether the fast path is on (for tests and the benchmark report).
#[cfg(feature = "test-hooks")]
pub fn fast_path_enabled() -> bool {
    NDARRAY.get().is_some_and(|&t| t != 0)
}

/// The array's shape and element strides into `dims` (see [`crate::interface::element_strides`]):
/// what both the owned import and the borrowed view take from the struct. False when a byte stride
/// is not a multiple of the item size (numpy's own DLPack path then refuses the array).
#[inline(always)]
pub fn fill_dims(p: &NumpyParts<'_>, dims: &mut crate::dims::Dims) -> bool {
    let (shape, strides) = dims.resize(p.shape.len());
    for (d, &s) in shape.iter_mut().zip(p.shape) {
        *d = s as i64;
    }
    let item = p.dtype.itemsize().unwrap_or(1);
    crate::interface::element_strides(p.strides.iter().map(|&b| b as i64), item, strides).is_ok()
}

/// The numpy type number of `dtype` in native byte order, if numpy has one.
fn type_num_of(dtype: DataType) -> Option<c_int> {
    let long8 = size_of::<std::ffi::c_long>() == 8;
    Some(match dtype {
        DataType::BOOL => 0,
        DataType::INT8 => 1,
        DataType::UINT8 => 2,
        DataType::INT16 => 3,
        DataType::UINT16 => 4,
        DataType::INT32 => 5,
        DataType::UINT32 => 6,
        DataType::INT64 => {
            if long8 {
                7
            } else {
                9
            }
        }
        DataType::UINT64 => {
            if long8 {
                8
            } else {
                10
            }
        }
        DataType::FLOAT32 => 11,
        DataType::FLOAT64 => 12,
        DataType::COMPLEX64 => 14,
        DataType::COMPLEX128 => 15,
        DataType::FLOAT16 => 23,
        _ => return None,
    })
}

type NewFromDescr = unsafe extern "C" fn(
    *mut ffi::PyTypeObject,
    *mut ffi::PyObject,
    c_int,
    *const isize,
    *const isize,
    *mut std::ffi::c_void,
    c_int,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;
type DescrFromType = unsafe extern "C" fn(c_int) -> *mut ffi::PyObject;
type SetBaseObject = unsafe extern "C" fn(*mut ffi::PyObject, *mut ffi::PyObject) -> c_int;

/// The three functions of numpy's C API (the `_ARRAY_API` table every numpy extension imports)
/// that make an array over memory numpy does not own.
struct CApi {
    ndarray: usize,
    new_from_descr: NewFromDescr,
    descr_from_type: DescrFromType,
    set_base: SetBaseObject,
}

/// numpy's C API, loaded once per process: `None` if numpy cannot be imported, or its table is
/// not of ABI 1.x or 2.x, or the `ndarray` type it names is not the verified one (then arrays are
/// made through `numpy.from_dlpack`).
fn capi(py: Python<'_>) -> Option<&'static CApi> {
    static CAPI: pyo3::sync::PyOnceLock<Option<CApi>> = pyo3::sync::PyOnceLock::new();
    CAPI.get_or_init(py, || load_capi(py)).as_ref()
}

fn load_capi(py: Python<'_>) -> Option<CApi> {
    let m = py
        .import("numpy._core._multiarray_umath")
        .or_else(|_| py.import("numpy.core._multiarray_umath"))
        .ok()?;
    let cap = m.getattr("_ARRAY_API").ok()?;
    // SAFETY: a type check on a live object.
    if unsafe { ffi::PyCapsule_CheckExact(cap.as_ptr()) } != 1 {
        return None;
    }
    // SAFETY: a capsule; numpy's is unnamed (a NULL name).
    let table = unsafe { ffi::PyCapsule_GetPointer(cap.as_ptr(), std::ptr::null()) }
        .cast::<*const std::ffi::c_void>();
    if table.is_null() {
        PyErr::take(py);
        return None;
    }
    // SAFETY: numpy's C API table: entry 0 is `unsigned PyArray_GetNDArrayCVersion(void)` in every
    // numpy; entries 2, 45, 94 and 282 are read only once the ABI version is one that has them
    // (1.x and 2.x), and the type in entry 2 is checked to be numpy's ndarray type.
    unsafe {
        let version: unsafe extern "C" fn() -> std::ffi::c_uint = std::mem::transmute(*table);
        if !matches!(version() >> 24, 1 | 2) {
            return None;
        }
        let ndarray = *table.add(2) as *mut ffi::PyTypeObject;
        if find_ndarray(ndarray) != Some(ndarray as usize)
            || NDARRAY.get().is_some_and(|&t| t != 0 && t != ndarray as usize)
        {
            return None;
        }
        Some(CApi {
            ndarray: ndarray as usize,
            descr_from_type: std::mem::transmute::<*const std::ffi::c_void, DescrFromType>(*table.add(45)),
            new_from_descr: std::mem::transmute::<*const std::ffi::c_void, NewFromDescr>(*table.add(94)),
            set_base: std::mem::transmute::<*const std::ffi::c_void, SetBaseObject>(*table.add(282)),
        })
    }
}

/// Whether numpy's C API is available to [`adopt`] arrays (numpy importable, table checked).
pub fn can_adopt(py: Python<'_>) -> bool {
    capi(py).is_some()
}

/// A `numpy.ndarray` over `t`'s memory, made through numpy's C API without a copy: the array's
/// `base` is a private capsule (`capsule.rs`'s `OWNER`) that owns `t`, so the producer's
/// deleter runs when numpy frees the array and no DLPack consumer can take the tensor out from
/// under it. `Err(t)` when numpy cannot hold it this way (not plain CPU memory, a
/// dtype numpy has no number for, the C API unavailable): take `numpy.from_dlpack` instead.
pub fn adopt<'py>(
    py: Python<'py>,
    t: crate::ManagedTensor,
) -> Result<PyResult<Bound<'py, PyAny>>, crate::ManagedTensor> {
    let (Some(api), Some(type_num)) = (capi(py), type_num_of(t.dtype())) else { return Err(t) };
    if t.device() != crate::Device::CPU || t.ndim() > 32 {
        return Err(t);
    }
    let item = t.dtype().itemsize().unwrap_or(1) as isize;
    // Extents and byte strides: on the stack for the usual ranks. A tensor with exactly numpy's
    // own C strides passes none, and numpy computes the same ones (and its flags) itself.
    let n = t.ndim();
    let mut inline = [0isize; 16];
    let mut heap = Vec::new();
    let (dims, strides) = if n <= 8 {
        inline.split_at_mut(8)
    } else {
        heap.resize(2 * n, 0);
        heap.split_at_mut(n)
    };
    for (i, (&d, &s)) in t.shape().iter().zip(t.strides()).enumerate() {
        dims[i] = d as isize;
        // The validated span fits the address space, so each byte stride of an axis of extent > 1
        // does; one of an axis of extent 0 or 1 is never used and may be anything.
        strides[i] = (s as isize).checked_mul(item).unwrap_or(0);
    }
    // Exactly numpy's own C strides (not merely C-contiguous: an axis of extent 1 may carry any
    // stride, which numpy.from_dlpack would keep too): numpy's rule is `layout::c_strides`' (an
    // extent of 0 counts as 1). Ranks above 8 pass their strides.
    let mut c = [0i64; 8];
    let own = n <= c.len() && {
        crate::layout::c_strides_into(t.shape(), &mut c[..n]);
        t.strides() == &c[..n]
    };
    let strides_ptr = if own { std::ptr::null() } else { strides.as_ptr() };
    let (nd, data) = (t.ndim() as c_int, t.data_ptr());
    let flags = if t.is_read_only() { 0 } else { NPY_ARRAY_WRITEABLE };
    let base = match crate::python::runtime::owner_capsule(py, t) {
        Ok(b) => b,
        Err(e) => return Ok(Err(e)),
    };
    // SAFETY: numpy's checked C API with the GIL held: a new descriptor reference (stolen by
    // NewFromDescr, on failure too); an array over `data` with `nd` extents and byte strides (NULL
    // only where numpy computes the very same) that stay inside the tensor `base` owns;
    // SetBaseObject steals `base` (on failure too), which then keeps the memory alive for as long
    // as the array.
    unsafe {
        let descr = (api.descr_from_type)(type_num);
        if descr.is_null() {
            return Ok(Err(PyErr::fetch(py)));
        }
        let arr = (api.new_from_descr)(
            api.ndarray as *mut ffi::PyTypeObject,
            descr,
            nd,
            dims.as_ptr(),
            strides_ptr,
            data,
            flags,
            std::ptr::null_mut(),
        );
        let arr = match Bound::from_owned_ptr_or_err(py, arr) {
            Ok(a) => a,
            Err(e) => return Ok(Err(e)),
        };
        if (api.set_base)(arr.as_ptr(), base.into_ptr()) != 0 {
            return Ok(Err(PyErr::fetch(py)));
        }
        Ok(Ok(arr))
    }
}

/// A numpy array read through its struct (see the module docs), owning a reference to it; `None`
/// when the layout needs numpy's own refusal (a stride that is not a multiple of the item size).
#[inline]
pub(super) fn from_numpy(obj: &Bound<'_, PyAny>, p: NumpyParts<'_>) -> PyResult<Option<ManagedTensor>> {
    // Inline for up to 8 dimensions (no allocation), as every view and export keeps its dims.
    let mut dims = crate::dims::Dims::new();
    if !fill_dims(&p, &mut dims) {
        return Ok(None);
    }
    let flags = crate::flags::Flags::NONE.with(crate::flags::Flags::READ_ONLY, p.readonly);
    // SAFETY: numpy's own description of the array's memory, which the owner keeps alive.
    let t = unsafe {
        ManagedTensor::from_raw_parts(
            p.data,
            Device::CPU,
            p.dtype,
            dims.shape(),
            Some(dims.strides()),
            0,
            flags,
            crate::python::runtime::PyOwner::new(obj),
        )
    }?;
    Ok(Some(t))
}
