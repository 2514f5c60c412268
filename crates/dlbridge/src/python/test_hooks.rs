//! Test-only hooks (feature `test-hooks`, which `make test` turns on and no wheel does): entry
//! points the shipped Python tests use to reach what no public API shows, and a hostile buffer
//! exporter no real library would be. Never part of what users install.

use pyo3::prelude::*;

use super::import::{ImportOptions, from_dlpack_with};
use super::kernels::TensorView;

/// Adds the hooks to `m`.
pub(super) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_drop_on_native_thread, m)?)?;
    m.add_function(wrap_pyfunction!(_drop_many_on_native_thread, m)?)?;
    m.add_function(wrap_pyfunction!(_drop_while_caller_holds_the_gil, m)?)?;
    m.add_function(wrap_pyfunction!(_drop_on_worker, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_driver_available, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_ipc_mappings, m)?)?;
    m.add_function(wrap_pyfunction!(_numpy_fast_path, m)?)?;
    m.add_function(wrap_pyfunction!(_view, m)?)?;
    m.add_function(wrap_pyfunction!(_view_then, m)?)?;
    m.add_function(wrap_pyfunction!(_view_deref, m)?)?;
    m.add_function(wrap_pyfunction!(_view_add, m)?)?;
    m.add_function(wrap_pyfunction!(_view_twice, m)?)?;
    m.add_function(wrap_pyfunction!(_type_cache_misses, m)?)?;
    m.add_function(wrap_pyfunction!(_framework_name, m)?)?;
    m.add_function(wrap_pyfunction!(_wrap_like, m)?)?;
    m.add_function(wrap_pyfunction!(_empty_like_probe, m)?)?;
    m.add_function(wrap_pyfunction!(_from_vec_like, m)?)?;
    m.add_function(wrap_pyfunction!(_numpy_from_vec, m)?)?;
    m.add_function(wrap_pyfunction!(_current_work_stream, m)?)?;
    m.add_function(wrap_pyfunction!(_typed_probe, m)?)?;
    m.add_function(wrap_pyfunction!(_typed_mut_probe, m)?)?;
    m.add_function(wrap_pyfunction!(_typed_mut_of_view, m)?)?;
    m.add_function(wrap_pyfunction!(_typed_mut_fill, m)?)?;
    m.add_function(wrap_pyfunction!(_slice_across_call, m)?)?;
    m.add_function(wrap_pyfunction!(_slice_across_detach, m)?)?;
    m.add_function(wrap_pyfunction!(_torch_bits_from_aten, m)?)?;
    m.add_function(wrap_pyfunction!(_torch_writes_from_aten, m)?)?;
    m.add_function(wrap_pyfunction!(_torch_views_keep_memory, m)?)?;
    m.add_function(wrap_pyfunction!(_torch_views_from_stable_abi, m)?)?;
    m.add_function(wrap_pyfunction!(_xla_copy_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(_table_allocate, m)?)?;
    m.add_class::<HostileBuffer>()?;
    // PyO3 lists every added function in `__all__`; hooks are private, so take them out again.
    let all = m.index()?;
    let public: Vec<String> = all
        .iter()
        .map(|n| n.extract::<String>())
        .collect::<PyResult<Vec<_>>>()?
        .into_iter()
        .filter(|n| !n.starts_with('_'))
        .collect();
    m.setattr("__all__", pyo3::types::PyList::new(m.py(), public)?)?;
    Ok(())
}

/// Whether a CUDA driver could be loaded in this process (tests use it to pick expectations).
#[pyfunction]
fn _cuda_driver_available() -> bool {
    crate::cuda::Driver::get().is_ok()
}

/// The CUDA IPC mappings this process holds, as `(device, pointer, size)` (closed ones are gone).
#[pyfunction]
fn _cuda_ipc_mappings() -> Vec<(i32, usize, usize)> {
    crate::cuda::ipc_mappings()
}

/// Whether the verified numpy struct fast path is on in this process (tests and benchmarks).
#[pyfunction]
fn _numpy_fast_path() -> bool {
    super::import::fast_path_enabled()
}

/// What the view test hooks return: `(data_ptr, shape, strides, dtype name, readonly)`.
type ViewSeen = (usize, Vec<i64>, Vec<i64>, String, bool);

/// Test hook: what a borrowed [`TensorView`] of `x` sees, as
/// `(data_ptr, shape, strides, dtype name, readonly)`.
#[pyfunction]
fn _view(x: TensorView<'_>) -> ViewSeen {
    (x.data_ptr() as usize, x.shape().to_vec(), x.strides().to_vec(), x.dtype().to_string(), x.is_read_only())
}

/// Test hook: borrows `x` as a [`TensorView`], calls `f()` (Python code that may change `x`'s
/// metadata in place), then returns what the view sees, as [`_view`] does.
#[pyfunction]
fn _view_then(x: TensorView<'_>, f: &Bound<'_, PyAny>) -> PyResult<ViewSeen> {
    f.call0()?;
    Ok(_view(x))
}

/// Test hook: what `x`'s `ManagedTensor` sees through `Deref`, as [`_view`] does, with its
/// description.
#[pyfunction]
fn _view_deref(x: TensorView<'_>) -> (ViewSeen, String) {
    let m: &crate::ManagedTensor = &x;
    let seen = (
        m.data_ptr() as usize,
        m.shape().to_vec(),
        m.strides().to_vec(),
        m.dtype().to_string(),
        m.is_read_only(),
    );
    (seen, m.describe())
}

/// Test hook: adds `delta` to every element of a C-contiguous float64 view in place (through
/// `as_slice_mut`), then returns the sum `as_slice` reads.
#[pyfunction]
fn _view_add(mut x: TensorView<'_>, delta: f64) -> PyResult<f64> {
    x.as_slice_mut::<f64>()?.iter_mut().for_each(|v| *v += delta);
    Ok(x.as_slice::<f64>()?.iter().sum())
}

/// Test hook: imports `x`, then drops the imported tensor on a new native thread that never held
/// the GIL, while this thread has released it. The producer's deleter must cope (take the GIL
/// itself); the test checks it ran.
#[pyfunction]
fn _drop_on_native_thread(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<()> {
    let t = from_dlpack_with(x, &ImportOptions::default())?;
    py.detach(move || std::thread::spawn(move || drop(t)).join())
        .map_err(|_| pyo3::exceptions::PyRuntimeError::new_err("the native thread panicked"))
}

/// Test hook: imports `x` `n` times, then drops the tensors one after another on a new native
/// thread that never holds the GIL, and returns at once (the thread is not joined): each drop
/// queues its release under the deferred-release lock, so a fork meanwhile may find it held.
#[pyfunction]
fn _drop_many_on_native_thread(x: &Bound<'_, PyAny>, n: usize) -> PyResult<()> {
    let tensors =
        (0..n).map(|_| from_dlpack_with(x, &ImportOptions::default())).collect::<PyResult<Vec<_>>>()?;
    std::thread::spawn(move || tensors.into_iter().for_each(drop));
    Ok(())
}

/// Test hook: a buffer exporter that reports whatever metadata it is given (shape, strides,
/// itemsize, format, len), over a small internal buffer, so the hostile-input tests can hand dlbridge
/// inconsistent buffer views no real exporter produces. dlbridge must refuse them before reading.
#[pyclass(name = "_HostileBuffer", module = "dlbridge", frozen)]
struct HostileBuffer {
    data: Vec<u8>,
    shape: Vec<isize>,
    strides: Vec<isize>,
    itemsize: isize,
    format: std::ffi::CString,
    len: isize,
}

#[pymethods]
impl HostileBuffer {
    #[new]
    #[pyo3(signature = (*, shape, strides, itemsize, format, length))]
    fn new(
        shape: Vec<isize>,
        strides: Vec<isize>,
        itemsize: isize,
        format: &str,
        length: isize,
    ) -> PyResult<Self> {
        let format = std::ffi::CString::new(format)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        // Backed by at least `length` bytes, so a view that is consistent is also in bounds.
        let data = vec![0; usize::try_from(length).unwrap_or(0).max(64)];
        Ok(Self { data, shape, strides, itemsize, format, len: length })
    }

    unsafe fn __getbuffer__(
        slf: PyRef<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        _flags: std::ffi::c_int,
    ) -> PyResult<()> {
        let (buf, shape, strides) = (slf.data.as_ptr(), slf.shape.as_ptr(), slf.strides.as_ptr());
        let (len, itemsize, ndim, format) = (slf.len, slf.itemsize, slf.shape.len(), slf.format.as_ptr());
        // SAFETY: filling the consumer's view; the arrays live as long as this frozen object, which
        // the view references.
        unsafe {
            let v = &mut *view;
            v.obj = slf.into_ptr();
            v.buf = buf.cast_mut().cast();
            v.len = len;
            v.readonly = 1;
            v.itemsize = itemsize;
            v.format = format.cast_mut();
            v.ndim = ndim as std::ffi::c_int;
            v.shape = shape.cast_mut();
            v.strides = strides.cast_mut();
            v.suboffsets = std::ptr::null_mut();
            v.internal = std::ptr::null_mut();
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}
}

/// Test hook: takes `x` as `asdlpack` does (a DLPack import, or a buffer view held), then drops
/// the tensor on a scoped worker thread while this thread keeps holding the GIL and waits for the
/// worker (rayon without `detach`): a deleter that waited for the GIL would deadlock here.
/// Returns after the worker finished.
#[pyfunction]
fn _drop_while_caller_holds_the_gil(x: &Bound<'_, PyAny>) -> PyResult<()> {
    let t = super::asdlpack_with(x, None)?.tensor;
    std::thread::scope(|s| s.spawn(move || drop(t)).join())
        .map_err(|_| pyo3::exceptions::PyRuntimeError::new_err("the worker thread panicked"))
}

/// Test hook: what a kernel that forgets `py.detach` does: takes `t` as a `ManagedTensor` argument
/// (any producer) and drops it on a scoped worker while this thread holds the GIL and joins it.
/// A producer's deleter that took the GIL on the worker deadlocked here.
#[pyfunction]
fn _drop_on_worker(t: crate::ManagedTensor) -> PyResult<()> {
    std::thread::scope(|s| s.spawn(move || drop(t)).join())
        .map_err(|_| pyo3::exceptions::PyRuntimeError::new_err("the worker thread panicked"))
}

/// Test hook: `f(x, x)` for a function taking two views: writes `value` into every float64 of `b`
/// through a mutable slice while a shared slice of `a` is alive, as a kernel given the same array
/// twice would. Returns what happened to the write (the borrow error's message, or "written").
#[pyfunction]
fn _view_twice(a: TensorView<'_>, mut b: TensorView<'_>, value: f64) -> PyResult<String> {
    let r = a.as_slice::<f64>()?;
    let outcome = match b.as_slice_mut::<f64>() {
        Ok(mut w) => {
            w.iter_mut().for_each(|v| *v = value);
            "written".to_string()
        }
        Err(e) => e.to_string(),
    };
    drop(r);
    Ok(outcome)
}

/// Test hook: how many type-level lookups (type-cache misses) dlbridge made so far.
#[pyfunction]
fn _type_cache_misses() -> usize {
    super::import::MISSES.load(std::sync::atomic::Ordering::Relaxed)
}

/// The name of the framework results for callers of `like` are returned as.
#[pyfunction]
fn _framework_name(like: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(super::Framework::of(like)?.name().to_string())
}

/// `t`'s memory (any producer, imported) returned as `like`'s framework's object.
#[pyfunction]
fn _wrap_like<'py>(like: &Bound<'py, PyAny>, t: crate::ManagedTensor) -> PyResult<Bound<'py, PyAny>> {
    super::Framework::of(like)?.wrap(like.py(), t)
}

/// `empty_like(x)` of float32 (x's shape and device) in x's framework, filled by Rust with 0, 1,
/// 2, ...: the object and the address Rust wrote to.
#[pyfunction]
fn _empty_like_probe<'py>(py: Python<'py>, x: TensorView<'_>) -> PyResult<(Bound<'py, PyAny>, usize)> {
    let mut out = x.framework(py)?.empty_like::<f32>(py, &x)?;
    let ptr = out.data_ptr_mut() as usize;
    if out.tensor().is_host_accessible() {
        for (i, v) in out.as_slice_mut()?.iter_mut().enumerate() {
            *v = i as f32;
        }
    }
    Ok((out.into_object(py)?, ptr))
}

/// A Rust `Vec` of `0..n` float64 returned in `like`'s framework: the object and the `Vec`'s address.
#[pyfunction]
fn _from_vec_like<'py>(like: &Bound<'py, PyAny>, n: usize) -> PyResult<(Bound<'py, PyAny>, usize)> {
    let v: Vec<f64> = (0..n).map(|i| i as f64).collect();
    let ptr = v.as_ptr() as usize;
    Ok((super::Framework::of(like)?.from_vec(like.py(), v, &[n])?, ptr))
}

/// `n` float32 zeros as the README returns a numpy result: `Framework::numpy(py)?.from_vec(...)`.
#[pyfunction]
fn _numpy_from_vec(py: Python<'_>, n: usize) -> PyResult<Bound<'_, PyAny>> {
    super::Framework::numpy(py)?.from_vec(py, vec![0f32; n], &[n])
}

/// The current work stream `like`'s framework reports for `device` (0 for none).
#[pyfunction]
fn _current_work_stream(like: &Bound<'_, PyAny>, device: super::PyDevice) -> PyResult<usize> {
    Ok(super::Framework::of(like)?
        .current_work_stream(like.py(), device.0)?
        .map_or(0, |p| p.as_ptr() as usize))
}

/// Converts `x` as a `TensorRef<f32, (Any, Dim<3>), C, Cpu>`: its shape, or the refusal.
#[pyfunction]
fn _typed_probe(
    x: super::TensorRef<'_, f32, (crate::spec::Any, crate::spec::Dim<3>), crate::spec::C>,
) -> Vec<i64> {
    x.shape().to_vec()
}

/// Converts `x` as a `TensorMut<f64, Rank<1>, C>` and does nothing with it: the conversion's own
/// checks and effects (torch's write rules, the version bump).
#[pyfunction]
fn _typed_mut_probe(_x: super::TensorMut<'_, f64, crate::spec::Rank<1>, crate::spec::C>) {}

/// Test hook: a view made typed for writing by hand (`TensorView::typed_mut`), as a kernel taking
/// an untyped view may.
#[pyfunction]
fn _typed_mut_of_view(x: TensorView<'_>) -> PyResult<()> {
    x.typed_mut::<f64, crate::spec::Rank<1>, crate::spec::C, crate::spec::Cpu>()?;
    Ok(())
}

/// Converts `x` as a `TensorMut<f64, Rank<1>, C>` and writes `value` into every element: a kernel
/// writing its argument.
#[pyfunction]
fn _typed_mut_fill(
    mut x: super::TensorMut<'_, f64, crate::spec::Rank<1>, crate::spec::C>,
    value: f64,
) -> PyResult<()> {
    x.as_slice_mut()?.iter_mut().for_each(|v| *v = value);
    Ok(())
}

/// A kernel that calls back into Python while it holds a mutable slice of `x` (C-contiguous
/// float64): takes the slice, calls `f()`, then writes `value` into every element through the
/// slice and returns the sum it reads back. Whatever `f` does to `x` (`set_`, `resize_`), the
/// slice's memory must stay valid (or the access be refused).
#[pyfunction]
fn _slice_across_call(mut x: TensorView<'_>, f: &Bound<'_, PyAny>, value: f64) -> PyResult<f64> {
    let mut s = x.as_slice_mut::<f64>()?;
    f.call0()?;
    s.iter_mut().for_each(|v| *v = value);
    Ok(s.iter().sum())
}

/// A kernel that runs without the GIL while it holds a mutable slice of `x` (C-contiguous
/// float64): takes the slice, releases the GIL for `seconds` (other Python threads run), then
/// writes `value` into every element and returns the sum it reads back.
#[pyfunction]
fn _slice_across_detach(py: Python<'_>, mut x: TensorView<'_>, seconds: f64, value: f64) -> PyResult<f64> {
    let mut s = x.as_slice_mut::<f64>()?;
    let slice: &mut [f64] = &mut s;
    Ok(py.detach(|| {
        std::thread::sleep(std::time::Duration::from_secs_f64(seconds));
        slice.iter_mut().for_each(|v| *v = value);
        slice.iter().sum()
    }))
}

/// Whether torch's negative and conjugate bits are read through ATen's native kernels in this
/// process (verified once; else through the methods).
#[pyfunction]
fn _torch_bits_from_aten(py: Python<'_>) -> bool {
    super::import::aten_bits(py).is_some()
}

/// Whether a torch write's checks and version bump go through ATen and c10 in this process
/// (verified once; else through torch's Python functions).
#[pyfunction]
fn _torch_writes_from_aten(py: Python<'_>) -> bool {
    super::import::aten_bits(py).is_some_and(|b| b.writes_verified())
}

/// Whether borrowed views of torch tensors keep their memory valid through the storage's
/// `DataPtr` in this process (verified once).
#[pyfunction]
fn _torch_views_keep_memory(py: Python<'_>) -> bool {
    super::import::aten_bits(py).is_some_and(|b| b.keeps_memory())
}

/// Whether borrowed views of exactly `torch.Tensor` are described through torch's stable
/// accessors in this process (verified once against the exchange table; else the table is asked).
#[pyfunction]
fn _torch_views_from_stable_abi(py: Python<'_>) -> bool {
    super::import::aten_bits(py).is_some_and(|b| b.describes_stably())
}

crate::xla_handler! {
    /// `out = x` on the CUDA platform, queued on the call's stream as one device-to-device copy
    /// through the driver (no device code of dlbridge's own): what the `gpu` tests run to reach
    /// the CUDA side of the XLA FFI layer (platform stream, device buffers, device ordinal).
    cuda fn xla_copy_cuda(call, operands: 1, results: 1) {
        let x = call.input_any(0, "x")?;
        let out = call.output_any(0, "out")?;
        if x.dtype() != out.dtype() || x.shape() != out.shape() {
            return Err(crate::xla::FfiError::invalid_argument(format!(
                "out: expected {} {:?} like x, got {} {:?}",
                x.dtype(),
                x.shape(),
                out.dtype(),
                out.shape()
            )));
        }
        let bytes = x.numel() * x.dtype().itemsize().unwrap_or(0);
        let stream = call.stream()? as usize;
        let internal = |e: String| crate::xla::FfiError::new(crate::xla_ffi::XLA_FFI_Error_Code::INTERNAL, e);
        let driver = crate::cuda::Driver::get().map_err(internal)?;
        if bytes > 0 {
            // SAFETY: XLA's two buffers of this call (an operand and a result, not aliased: no
            // input_output_aliases is declared), each `bytes` long, on the call's device, alive
            // until the call's stream has run; the stream is XLA's for this call.
            unsafe { driver.memcpy_async(x.device().id(), out.data_ptr() as usize, x.data_ptr() as usize, bytes, stream) }
                .map_err(internal)?;
        }
        Ok(())
    }
}

/// The capsule of [`xla_copy_cuda`], for `jax.ffi.register_ffi_target(name, capsule, platform="CUDA")`.
#[pyfunction]
fn _xla_copy_cuda(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyCapsule>> {
    super::kernels::xla_capsule(py, xla_copy_cuda)
}

/// float32 memory of `shape` on `device` from the exchange table of `like`'s type (its
/// allocator), as a dlbridge Tensor.
#[pyfunction]
fn _table_allocate(
    like: &Bound<'_, PyAny>,
    shape: Vec<i64>,
    device: super::PyDevice,
) -> PyResult<crate::ManagedTensor> {
    let api = super::import::type_info(&like.get_type())?
        .exchange
        .ok_or_else(|| pyo3::exceptions::PyTypeError::new_err("no exchange table"))?;
    api.allocate(like.py(), crate::DataType::FLOAT32, &shape, device.0)
}
