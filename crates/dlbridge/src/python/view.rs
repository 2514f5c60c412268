//! [`TensorView`]: a borrowed, non-owning view of a Python array for the duration of a call, with
//! no capsule and (for compact layouts of up to 8 dimensions) no allocation.
//!
//! Sources, fastest first: a `dlbridge.Tensor` (its own metadata), a type with the exchange API's
//! `dltensor_from_py_object_no_sync` (torch), the buffer protocol (numpy and every buffer
//! exporter), and otherwise an ordinary owned import.

use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::Deref;
use std::ptr::NonNull;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use super::cache;
use super::import::{ImportOptions, from_dlpack_with};
use super::tensor::Tensor;
use crate::device::Device;
use crate::ffi::DLTensor;
use crate::flags::Flags;
use crate::managed::ManagedTensor;

const INLINE: usize = 8;

/// Where a borrowed `DLTensor` and the storage it points into live while the view exists (one
/// heap block, so the addresses stay put when the view moves).
struct Borrow {
    tensor: DLTensor,
    strides: [i64; INLINE],
    spill: Vec<i64>,
    shape: [i64; INLINE],
    shape_spill: Vec<i64>,
    buffer: Option<ffi::Py_buffer>,
}

impl Borrow {
    /// Releases a held buffer view (the GIL is held: views live inside the call that made them).
    fn release(&mut self) {
        if let Some(mut view) = self.buffer.take() {
            // SAFETY: a view filled by PyObject_GetBuffer, released once, with the GIL held.
            unsafe { ffi::PyBuffer_Release(&mut view) };
        }
    }
}

impl Drop for Borrow {
    fn drop(&mut self) {
        self.release();
    }
}

thread_local! {
    /// Spare storage blocks, so a view costs no allocation in steady state. Boxed on purpose: a
    /// live view points into its block, so blocks must keep their address when the pool moves.
    #[allow(clippy::vec_box)]
    static POOL: std::cell::RefCell<Vec<Box<Borrow>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A tensor borrowed from a Python object for the duration of a call: a `#[pyfunction]` argument
/// type that costs no capsule and no DLPack round trip. It derefs to [`ManagedTensor`], so every
/// accessor and typed view works; mutable access is through [`TensorView::as_slice_mut`] and
/// (feature `ndarray`) [`TensorView::as_array_mut`].
///
/// ```no_run
/// use dlbridge::python::TensorView;
/// use pyo3::prelude::*;
///
/// /// The sum of a float64 array from numpy, torch, or any buffer exporter, without a copy.
/// #[pyfunction]
/// fn total(t: TensorView<'_>) -> PyResult<f64> {
///     Ok(t.as_slice::<f64>()?.iter().sum())
/// }
/// ```
pub struct TensorView<'a> {
    // Declared first so it drops before the storage it points into.
    tensor: ManagedTensor,
    borrow: Option<Box<Borrow>>,
    _source: PhantomData<&'a ()>,
    _not_send: PhantomData<*const ()>,
}

impl Deref for TensorView<'_> {
    type Target = ManagedTensor;
    fn deref(&self) -> &ManagedTensor {
        &self.tensor
    }
}

impl TensorView<'_> {
    /// The elements as a mutable slice (see [`ManagedTensor::as_slice_mut`]).
    pub fn as_slice_mut<T: crate::Element>(&mut self) -> crate::Result<&mut [T]> {
        self.tensor.as_slice_mut()
    }

    /// A mutable ndarray view (see [`ManagedTensor::as_array_mut`]).
    #[cfg(feature = "ndarray")]
    pub fn as_array_mut<T: crate::Element>(&mut self) -> crate::Result<ndarray::ArrayViewMutD<'_, T>> {
        self.tensor.as_array_mut()
    }

    /// The view of a filled block: the common tensor inline, anything else through the general
    /// checks (out of line, so the common case builds the view where it is returned).
    #[inline(always)]
    fn from_borrow(borrow: Box<Borrow>, flags: Flags) -> PyResult<Self> {
        match Self::from_borrow_if_common(borrow, flags) {
            Ok(v) => Ok(v),
            Err(b) => Self::from_borrow_general(b, flags),
        }
    }

    #[inline(never)]
    fn from_borrow_general(borrow: Box<Borrow>, flags: Flags) -> PyResult<Self> {
        let p = NonNull::from(&borrow.tensor);
        // SAFETY: the DLTensor and what it points to (the boxed strides, the exporter's memory held
        // by the Py_buffer or the object the caller borrows for the call) outlive `tensor`, which
        // is declared first and so dropped first.
        let tensor = unsafe { ManagedTensor::borrowed(p, flags) }?;
        Ok(Self::with(tensor, Some(borrow)))
    }

    /// [`TensorView::from_borrow`] for the common tensor: `Err` gives the block back when the
    /// general checks must decide.
    #[inline(always)]
    fn from_borrow_if_common(borrow: Box<Borrow>, flags: Flags) -> Result<Self, Box<Borrow>> {
        let p = NonNull::from(&borrow.tensor);
        // SAFETY: as in `from_borrow`.
        match unsafe { ManagedTensor::borrowed_if_common(p, flags) } {
            Some(tensor) => Ok(Self::with(tensor, Some(borrow))),
            None => Err(borrow),
        }
    }

    #[inline(always)]
    fn with(tensor: ManagedTensor, borrow: Option<Box<Borrow>>) -> Self {
        Self { tensor, borrow, _source: PhantomData, _not_send: PhantomData }
    }

    /// A numpy array's struct read into a block; `None` when a stride is not a multiple of the
    /// item size (then DLPack describes the array, or refuses it, instead).
    fn numpy_block(p: super::numpy::NumpyParts<'_>) -> Option<Box<Borrow>> {
        let mut b = blank();
        let n = p.shape.len();
        let ok = if n <= INLINE {
            super::numpy::element_strides(&p, &mut b.strides[..n])
        } else {
            b.spill = vec![0; n];
            super::numpy::element_strides(&p, &mut b.spill)
        };
        if !ok {
            recycle(b);
            return None;
        }
        b.tensor = DLTensor {
            data: p.data,
            device: Device::CPU.to_raw(),
            ndim: n as i32,
            dtype: p.dtype.to_raw(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        point_strides(&mut b, n);
        // npy_intp and int64_t have the same size and alignment on 64-bit targets.
        // SAFETY: the array's n extents read as i64 instead of isize (identical layout).
        set_shape(&mut b, unsafe { std::slice::from_raw_parts(p.shape.as_ptr().cast::<i64>(), n) });
        Some(b)
    }

    /// A numpy array as a view: the common case without a `Result` in between.
    #[inline(always)]
    fn from_numpy(p: super::numpy::NumpyParts<'_>) -> Option<PyResult<Self>> {
        let flags = Flags::NONE.with(Flags::READ_ONLY, p.readonly);
        Some(Self::from_borrow(Self::numpy_block(p)?, flags))
    }

    /// Borrows `obj` for the lifetime `'a` of the call.
    #[inline(always)]
    pub fn borrow(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        // The commonest argument, an exact numpy array, is built where the view is returned: a
        // view written through a chain of returns is read back whole from the stack each time (a
        // store-forwarding stall per hop).
        if let Some(v) = super::numpy::parts_exact(obj).and_then(Self::from_numpy) {
            return v;
        }
        Self::borrow_other(obj)
    }

    /// Every source but an exact numpy array.
    #[inline(never)]
    fn borrow_other(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(t) = obj.cast_exact::<Tensor>() {
            let inner = t.get().shared();
            let mut b = blank();
            b.tensor = *inner.dl_tensor();
            set_strides(&mut b, inner.strides());
            return Self::from_borrow(b, inner.flags());
        }
        let info = cache::type_info(&obj.get_type())?;
        if info.numpy {
            if let Some(v) = super::numpy::parts(obj).and_then(Self::from_numpy) {
                return v;
            }
        }
        if let Some(t) = info.exchange.map(|api| api.dltensor(obj)).transpose()?.flatten() {
            if Device::from(t.device) == Device::CPU {
                let mut b = blank();
                b.tensor = t;
                if !copy_dims_inline(&mut b, &t) {
                    // SAFETY: the producer's description, read at once for ndim entries (checked).
                    let (shape, strides) = unsafe { crate::managed::dims_of(&t) }?;
                    set_shape(&mut b, shape);
                    match strides {
                        Some(s) => set_strides(&mut b, s),
                        None => b.tensor.strides = std::ptr::null_mut(),
                    }
                }
                return Self::from_borrow(b, Flags::NONE);
            }
            // Device memory needs stream handling: fall through to the protocol path.
        }
        // SAFETY: a type-slot check on a live object.
        if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } == 1 {
            match Self::from_buffer(obj) {
                Ok(v) => return Ok(v),
                // A format the buffer protocol cannot express, from an object that also speaks
                // DLPack: let DLPack describe it instead.
                Err(_) if info.dlpack => {}
                Err(e) => return Err(e),
            }
        }
        Ok(Self::with(from_dlpack_with(obj, &ImportOptions::default())?, None))
    }

    fn from_buffer(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut b = blank();
        let mut view = MaybeUninit::<ffi::Py_buffer>::zeroed();
        // SAFETY: a zeroed view for the exporter to fill (strides and format requested).
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), ffi::PyBUF_RECORDS_RO) } != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        // SAFETY: filled by a successful GetBuffer; released by the block (or its drop) from here on.
        b.buffer = Some(unsafe { view.assume_init() });
        let v = b.buffer.as_ref().expect("just set");
        let m = super::protocols::read_view(v)
            .map_err(|e| PyBufferError::new_err(format!("buffer protocol: {e}")))?;
        let (n, readonly) = (m.shape.len(), m.readonly);
        let tensor = DLTensor {
            data: v.buf,
            device: Device::CPU.to_raw(),
            ndim: n as i32,
            dtype: m.dtype.to_raw(),
            shape: m.shape.as_ptr().cast_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        let (inline, spill) = (m.inline, m.spill);
        b.tensor = tensor;
        b.strides = inline;
        b.spill = spill;
        point_strides(&mut b, n);
        Self::from_borrow(b, Flags::NONE.with(Flags::READ_ONLY, readonly))
    }
}

impl Drop for TensorView<'_> {
    fn drop(&mut self) {
        // The borrowed ManagedTensor never dereferences its pointer when dropped, so the block can
        // be released and recycled first.
        if let Some(b) = self.borrow.take() {
            recycle(b);
        }
    }
}

/// Releases what a block holds and keeps it for the next view (up to 8 spare blocks a thread).
fn recycle(mut b: Box<Borrow>) {
    b.release();
    POOL.with_borrow_mut(|p| {
        if p.len() < 8 {
            p.push(b);
        }
    });
}

impl<'a, 'py> FromPyObject<'a, 'py> for TensorView<'a> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        TensorView::borrow(&obj)
    }
}

fn blank() -> Box<Borrow> {
    if let Some(mut b) = POOL.with_borrow_mut(Vec::pop) {
        b.spill.clear();
        b.shape_spill.clear();
        return b;
    }
    Box::new(Borrow {
        tensor: DLTensor {
            data: std::ptr::null_mut(),
            device: Device::CPU.to_raw(),
            ndim: 0,
            dtype: crate::DataType::UINT8.to_raw(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        strides: [0; INLINE],
        spill: Vec::new(),
        shape: [0; INLINE],
        shape_spill: Vec::new(),
        buffer: None,
    })
}

/// The common case of [`set_shape`] and [`set_strides`] in one pass: both given, aligned, for 1 to
/// 8 dimensions, copied element by element into the block (a `memcpy` call costs more than these
/// few moves). False, with nothing written, for anything else: the checked path then runs.
fn copy_dims_inline(b: &mut Borrow, t: &DLTensor) -> bool {
    let n = match usize::try_from(t.ndim) {
        Ok(n) if (1..=INLINE).contains(&n) => n,
        _ => return false,
    };
    if t.shape.is_null() || t.strides.is_null() || !t.shape.is_aligned() || !t.strides.is_aligned() {
        return false;
    }
    for i in 0..n {
        // SAFETY: non-NULL, aligned, and the producer's `ndim` entries each (checked above).
        unsafe {
            b.shape[i] = t.shape.add(i).read();
            b.strides[i] = t.strides.add(i).read();
        }
    }
    b.tensor.shape = b.shape.as_mut_ptr();
    b.tensor.strides = b.strides.as_mut_ptr();
    true
}

/// Copies `strides` into the boxed storage and points the DLTensor at it.
fn set_strides(b: &mut Borrow, strides: &[i64]) {
    let n = strides.len();
    if n <= INLINE {
        b.strides[..n].copy_from_slice(strides);
    } else {
        b.spill = strides.to_vec();
    }
    point_strides(b, n);
}

/// Copies `shape` into the block and points the DLTensor at it. Views keep their own shape (and
/// strides), so Python code the called function runs cannot change them under the view (numpy's
/// `a.shape = ...` frees the old dimensions; torch's in-place `unsqueeze_` rewrites them).
fn set_shape(b: &mut Borrow, shape: &[i64]) {
    let n = shape.len();
    b.tensor.shape = if n == 0 {
        std::ptr::null_mut()
    } else if n <= INLINE {
        b.shape[..n].copy_from_slice(shape);
        b.shape.as_mut_ptr()
    } else {
        b.shape_spill = shape.to_vec();
        b.shape_spill.as_mut_ptr()
    };
}

fn point_strides(b: &mut Borrow, n: usize) {
    b.tensor.strides = if n == 0 {
        std::ptr::null_mut()
    } else if n <= INLINE {
        b.strides.as_mut_ptr()
    } else {
        b.spill.as_mut_ptr()
    };
}
