//! Results in the caller's framework: a kernel returns its output as the kind of object its input
//! was (torch in, `torch.Tensor` out; numpy in, `numpy.ndarray` out; jax, cupy, tensorflow
//! likewise; anything else a `dlbridge.Tensor`), without copying, and allocates outputs with that
//! framework's allocator where it has one.
//!
//! How each framework is reached, found once per type and cached:
//!
//! | the input's type                         | results are made by                                         |
//! |------------------------------------------|-------------------------------------------------------------|
//! | publishes a DLPack C exchange table (torch >= 2.10, dlbridge) | the table's `managed_tensor_to_py_object_no_sync`: no Python call |
//! | `numpy.ndarray`                          | numpy's C API (`PyArray_NewFromDescr`, the tensor as the array's `base`): no Python call |
//! | jax arrays                               | `jax.dlpack.from_dlpack`                                     |
//! | tensorflow tensors                       | `tf.experimental.dlpack.from_dlpack` (a capsule)             |
//! | anything else whose top-level module has `from_dlpack` (cupy, array-api-strict, older torch) | that function |
//! | anything else                            | `dlbridge.Tensor`                                            |
//!
//! Allocation ([`Framework::empty`]): device memory through the table's
//! `managed_tensor_allocator` where the type has one (torch's caching allocator on CUDA; torch's
//! refuses pinned and managed host memory, and reports every refusal as a `MemoryError`); CPU memory as a 256-byte aligned Rust buffer ([`crate::AlignedBuffer`]) that every
//! framework adopts without copying (torch's CPU allocator is plain aligned `malloc`, and going
//! through its table would cost a second tensor round trip, about 300 ns here, for nothing).
//! Host memory is handed out zero-filled: Rust references to uninitialised memory are not
//! allowed. Device memory is only ever reached through raw pointers, and is left as the allocator
//! returns it.
//!
//! Streams: [`Framework::current_work_stream`] is the caller's current stream on a device (from
//! the table; `None` where the framework has no table). A kernel that launches on that stream and
//! returns its output through [`Framework::wrap`] needs no synchronisation: the framework sees the
//! output on the stream it works on. A kernel that launches on another stream must make the
//! caller's stream wait for it before returning (the `_no_sync` functions do not).

use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr::NonNull;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::device::Device;
use crate::dtype::Element;
use crate::managed::ManagedTensor;
use crate::python::import::{Framework, Importer, Kind};
use crate::python::runtime::Tensor;

impl std::fmt::Debug for Framework {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Framework({})", self.name())
    }
}

impl Framework {
    /// The framework of `obj`'s type, found once per type and cached.
    #[inline]
    pub fn of(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        if obj.cast_exact::<Tensor>().is_ok() {
            return Ok(Self::dlbridge());
        }
        Self::of_type(&obj.get_type())
    }

    /// The framework of instances of `ty`.
    pub fn of_type(ty: &Bound<'_, PyType>) -> PyResult<Self> {
        crate::python::import::framework(ty, find)
    }

    /// `dlbridge.Tensor` (this module's class).
    pub const fn dlbridge() -> Self {
        Self { kind: Kind::Dlbridge }
    }

    /// numpy: `numpy.ndarray` results (imports numpy the first time; later calls read the
    /// framework found then, so `Framework::numpy(py)?.from_vec(...)` costs no import).
    pub fn numpy(py: Python<'_>) -> PyResult<Self> {
        static NUMPY: PyOnceLock<Framework> = PyOnceLock::new();
        NUMPY
            .get_or_try_init(py, || {
                Self::of_type(&py.import("numpy")?.getattr("ndarray")?.cast_into::<PyType>()?)
            })
            .copied()
    }

    /// torch: `torch.Tensor` results (imports torch the first time; later calls read the
    /// framework found then).
    pub fn torch(py: Python<'_>) -> PyResult<Self> {
        static TORCH: PyOnceLock<Framework> = PyOnceLock::new();
        TORCH
            .get_or_try_init(py, || {
                Self::of_type(&py.import("torch")?.getattr("Tensor")?.cast_into::<PyType>()?)
            })
            .copied()
    }

    /// A short name: `dlbridge`, `numpy`, `exchange table`, or the function used.
    pub fn name(&self) -> &str {
        match self.kind {
            Kind::Dlbridge => "dlbridge",
            Kind::Numpy => "numpy",
            Kind::Table(_) => "exchange table",
            Kind::Function(i) => &i.name,
        }
    }

    /// `t` as an object of this framework, without copying (see the module docs for each path;
    /// the frameworks reached through their own `from_dlpack` decide for themselves, and copy
    /// only if they cannot hold the memory, as jax does for host memory not aligned to 64 bytes).
    /// A read-only tensor keeps its flag (numpy, dlbridge) or is refused where the framework has
    /// no read-only tensors and its table would make it writable (torch); jax and tensorflow take
    /// their input through a legacy capsule here, which cannot say read-only, so a read-only
    /// tensor is refused for them too (return a writable copy). torch also refuses negative
    /// strides.
    pub fn wrap<'py>(&self, py: Python<'py>, t: ManagedTensor) -> PyResult<Bound<'py, PyAny>> {
        match self.kind {
            Kind::Dlbridge => Ok(Bound::new(py, Tensor::new(t))?.into_any()),
            Kind::Table(api) => api.to_py_object(py, t),
            Kind::Numpy => match crate::python::import::adopt(py, t) {
                Ok(made) => made,
                Err(t) => numpy_from_dlpack(py, t),
            },
            Kind::Function(i) => i.call(py, t),
        }
    }

    /// A `Vec` as a tensor of this framework with `shape` (its product must be the length),
    /// without copying.
    pub fn from_vec<'py, T: Element>(
        &self,
        py: Python<'py>,
        v: Vec<T>,
        shape: &[usize],
    ) -> PyResult<Bound<'py, PyAny>> {
        self.wrap(py, ManagedTensor::from_vec(v, shape)?)
    }

    /// An owned `ndarray` array as a tensor of this framework, with its strides, without copying.
    #[cfg(feature = "ndarray")]
    pub fn from_ndarray<'py, T: Element, D: ndarray::Dimension>(
        &self,
        py: Python<'py>,
        a: ndarray::Array<T, D>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.wrap(py, ManagedTensor::from_ndarray(a)?)
    }

    /// A new writable C-contiguous tensor of `T` with `shape` on `device`, to fill and return (see
    /// the module docs: CPU memory an aligned Rust buffer, device memory the framework's allocator
    /// through its table; host memory zero-filled). Device memory needs a framework with a table.
    pub fn empty<T: Element>(&self, py: Python<'_>, shape: &[usize], device: Device) -> PyResult<Output<T>> {
        let tensor = match self.kind {
            // Host memory: an aligned Rust buffer, zeroed as it is allocated, that every framework
            // adopts without copying. (torch's CPU allocator is plain aligned malloc; going
            // through its table would add a second tensor round trip, about 300 ns, for nothing.)
            _ if device.device_type() == crate::DeviceType::CPU => {
                // A zero extent makes no elements, whatever the others are.
                let count = if shape.contains(&0) {
                    Some(0)
                } else {
                    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
                };
                let buf = count
                    .ok_or_else(|| "the element count overflows".to_string())
                    .and_then(|n| crate::AlignedBuffer::<T>::try_zeroed(n).map_err(|e| e.to_string()))
                    .map_err(|e| {
                        pyo3::exceptions::PyMemoryError::new_err(format!("empty: shape {shape:?}: {e}"))
                    })?;
                if let Kind::Table(_) = self.kind {
                    // Watched, so the table can be handed this very struct (see `Output::into_object`).
                    let token = std::sync::Arc::new(());
                    let alive = std::sync::Arc::downgrade(&token);
                    let t = ManagedTensor::from_host(Watched { buf, _token: token }, shape)?;
                    return Ok(Output { tensor: t, framework: *self, alive: Some(alive), _t: PhantomData });
                }
                ManagedTensor::from_host(buf, shape)?
            }
            // Device memory: the framework's allocator, through its table (torch's caching
            // allocator on CUDA; torch's refuses pinned and managed host memory).
            Kind::Table(api) => {
                let dims = shape.iter().map(|&d| i64::try_from(d)).collect::<Result<Vec<i64>, _>>().map_err(
                    |_| {
                        pyo3::exceptions::PyValueError::new_err(format!(
                            "empty: shape {shape:?} exceeds int64"
                        ))
                    },
                )?;
                let mut t = api.allocate(py, T::DTYPE, &dims, device)?;
                if t.is_host_accessible() {
                    zero(&mut t);
                }
                t
            }
            _ => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "empty: {} has no allocator for {device} memory (only a framework with a DLPack \
                     exchange table can allocate device memory here)",
                    self.name()
                )));
            }
        };
        Ok(Output { tensor, framework: *self, alive: None, _t: PhantomData })
    }

    /// [`Framework::empty`] with the shape and device of `like`.
    pub fn empty_like<T: Element>(&self, py: Python<'_>, like: &ManagedTensor) -> PyResult<Output<T>> {
        // The shape on the stack for the usual ranks (validated extents are non-negative).
        let mut inline = [0usize; 8];
        let heap: Vec<usize>;
        let shape: &[usize] = match like.shape() {
            s if s.len() <= inline.len() => {
                inline.iter_mut().zip(s).for_each(|(o, &d)| *o = d as usize);
                &inline[..s.len()]
            }
            s => {
                heap = s.iter().map(|&d| d as usize).collect();
                &heap
            }
        };
        self.empty::<T>(py, shape, like.device())
    }

    /// The caller's current work stream on `device`, from the framework's exchange table
    /// (`current_work_stream`; torch's current CUDA stream); `None` for the default stream, a
    /// device without streams, or a framework without a table.
    pub fn current_work_stream(&self, py: Python<'_>, device: Device) -> PyResult<Option<NonNull<c_void>>> {
        match self.kind {
            Kind::Table(api) => api.current_work_stream(py, device),
            _ => Ok(None),
        }
    }
}

/// Zero-fills a freshly allocated host tensor that no other handle can reach yet.
fn zero(t: &mut ManagedTensor) {
    let n = t.nbytes() as usize;
    if n > 0 {
        // SAFETY: host-accessible memory of `n` bytes from the first element (compact, checked by
        // `allocate`), writable, just allocated and reachable only through `t`, borrowed mutably.
        unsafe { std::ptr::write_bytes(t.data_ptr().cast::<u8>(), 0, n) };
    }
}

/// `numpy.from_dlpack(t)`: what numpy says of a tensor its C API cannot take this way (device,
/// dtype).
fn numpy_from_dlpack<'py>(py: Python<'py>, t: ManagedTensor) -> PyResult<Bound<'py, PyAny>> {
    let obj = Bound::new(py, Tensor::new(t))?;
    py.import("numpy")?.getattr("from_dlpack")?.call1((obj,))
}

impl Importer {
    fn call<'py>(&self, py: Python<'py>, t: ManagedTensor) -> PyResult<Bound<'py, PyAny>> {
        let obj = Bound::new(py, Tensor::new(t))?.into_any();
        let arg = if self.capsule { obj.call_method0(pyo3::intern!(py, "__dlpack__"))? } else { obj };
        self.func.bind(py).call1((arg,))
    }
}

/// Finds the framework of `ty` (a cache miss).
fn find(ty: &Bound<'_, PyType>) -> PyResult<Framework> {
    let py = ty.py();
    let info = crate::python::import::type_info(ty)?;
    if let Some(api) = info.exchange {
        return Ok(Framework { kind: Kind::Table(api) });
    }
    if info.numpy && crate::python::import::can_adopt(py) {
        return Ok(Framework { kind: Kind::Numpy });
    }
    let module: String = ty.getattr(pyo3::intern!(py, "__module__"))?.extract().unwrap_or_default();
    let root = module.split('.').next().unwrap_or_default();
    let (path, capsule) = match root {
        "jax" | "jaxlib" => ("jax.dlpack", false),
        "tensorflow" => ("tensorflow.experimental.dlpack", true),
        "" | "builtins" => return Ok(Framework::dlbridge()),
        other => (other, false),
    };
    // Only a module already imported (the type's own package) is asked; nothing new is imported
    // but the dlpack submodules named above.
    let loaded = py.import("sys")?.getattr("modules")?.get_item(root).is_ok();
    let func = if loaded { py.import(path).and_then(|m| m.getattr("from_dlpack")).ok() } else { None };
    match func.filter(|f| f.is_callable()) {
        Some(f) => Ok(Framework {
            kind: Kind::Function(Importer::interned(f, capsule, format!("{path}.from_dlpack"))),
        }),
        None => Ok(Framework::dlbridge()),
    }
}

impl Importer {
    /// One leaked importer per function (a handful per process).
    fn interned(f: Bound<'_, PyAny>, capsule: bool, name: String) -> &'static Self {
        static ALL: std::sync::Mutex<Vec<&'static Importer>> = std::sync::Mutex::new(Vec::new());
        let mut all = ALL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = all.iter().find(|i| i.func.as_ptr() == f.as_ptr() && i.capsule == capsule) {
            return found;
        }
        let leaked: &'static Self = Box::leak(Box::new(Importer { func: f.unbind(), capsule, name }));
        all.push(leaked);
        leaked
    }
}

/// A new tensor made by [`Framework::empty`]: fill it through its typed views, then return it
/// (it converts to the framework's object when returned from a `#[pyfunction]`, or with
/// [`Output::into_object`]). `Send`, so it can be filled without the GIL.
pub struct Output<T> {
    tensor: ManagedTensor,
    framework: Framework,
    /// Alive exactly as long as `tensor`'s own struct (its owner holds the token), for a table
    /// that may refuse the struct without releasing it: then `into_object` releases it.
    alive: Option<std::sync::Weak<()>>,
    _t: PhantomData<fn() -> T>,
}

/// An aligned buffer whose export also owns a token, so whoever holds a `Weak` of the token sees
/// whether the exported struct has been deleted.
struct Watched<T> {
    buf: crate::AlignedBuffer<T>,
    _token: std::sync::Arc<()>,
}

// SAFETY: the buffer's contract (its heap memory does not move with it and lives until it drops);
// the token is only a reference count.
unsafe impl<T: Element> crate::HostBuffer for Watched<T> {
    type Elem = T;
    fn as_mut_ptr(&mut self) -> *mut T {
        crate::HostBuffer::as_mut_ptr(&mut self.buf)
    }
    fn elem_count(&self) -> usize {
        crate::HostBuffer::elem_count(&self.buf)
    }
}

impl<T: Element> Output<T> {
    /// The tensor (metadata, `data_ptr`).
    pub fn tensor(&self) -> &ManagedTensor {
        &self.tensor
    }

    /// The framework it will be returned as.
    pub fn framework(&self) -> Framework {
        self.framework
    }

    /// The elements, row-major, mutably (host memory; holds an exclusive lease).
    pub fn as_slice_mut(&mut self) -> crate::Result<crate::SliceMut<'_, T>> {
        self.tensor.as_slice_mut::<T>()
    }

    /// The elements, row-major (host memory; holds a shared lease).
    pub fn as_slice(&self) -> crate::Result<crate::SliceRef<'_, T>> {
        self.tensor.as_slice::<T>()
    }

    /// A mutable `ndarray` view (host memory; holds an exclusive lease).
    #[cfg(feature = "ndarray")]
    pub fn as_array_mut(&mut self) -> crate::Result<crate::ndarray::ArrayGuardMut<'_, T>> {
        self.tensor.as_array_mut::<T>()
    }

    /// The address of the first element (host or device memory), for a kernel launch.
    pub fn data_ptr_mut(&mut self) -> *mut T {
        self.tensor.data_ptr().cast()
    }

    /// The framework's object over this memory (no copy).
    pub fn into_object(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        match (self.framework.kind, self.alive) {
            // This very struct goes to the table: no second export around it.
            (Kind::Table(api), Some(alive)) => api.give_watched(py, self.tensor, alive),
            _ => self.framework.wrap(py, self.tensor),
        }
    }
}

impl<'py, T: Element> IntoPyObject<'py> for Output<T> {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.into_object(py)
    }
}
