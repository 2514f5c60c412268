//! Benchmark shim: the operations the Python benchmark times, done with dlbridge. The peer shims
//! (bench/shim-pyo3-dlpack, bench/shim-dlpark) expose the same functions with their crates.

use std::sync::{Arc, OnceLock};

use dlbridge::python::TensorView;
use dlbridge::{AlignedBuffer, ManagedTensor};
use pyo3::prelude::*;

/// Owned import: import, read the data pointer, drop (the producer's deleter runs here).
#[pyfunction]
fn import_ptr(t: ManagedTensor) -> usize {
    t.data_ptr() as usize
}

/// Borrowed view for the duration of the call: read the data pointer.
#[pyfunction]
fn view_ptr(t: TensorView<'_>) -> usize {
    t.data_ptr() as usize
}

static TORCH_TABLE: OnceLock<dlbridge::python::ExchangeApi> = OnceLock::new();

/// torch's exchange table, looked up once (so the floors below time torch's functions only).
fn torch_table(x: &Bound<'_, PyAny>) -> PyResult<dlbridge::python::ExchangeApi> {
    if let Some(api) = TORCH_TABLE.get() {
        return Ok(*api);
    }
    let api =
        dlbridge::python::ExchangeApi::of_type(&x.get_type())?.expect("torch publishes an exchange table");
    Ok(*TORCH_TABLE.get_or_init(|| api))
}

/// torch's own cost, for reference: its exchange table's owning export and deleter, with no
/// validation and nothing else (what any consumer of torch's table pays at least).
#[pyfunction]
fn torch_floor_owned(x: &Bound<'_, PyAny>) -> PyResult<usize> {
    let api = torch_table(x)?;
    let f = api.table().managed_tensor_from_py_object_no_sync.expect("checked");
    let mut out = std::ptr::null_mut();
    // SAFETY: a torch tensor, the GIL held, a writable out-pointer.
    assert_eq!(unsafe { f(x.as_ptr().cast(), &mut out) }, 0);
    // SAFETY: an owning pointer from torch, read then deleted once.
    unsafe {
        let p = (*out).dl_tensor.data as usize;
        ((*out).deleter.expect("torch sets a deleter"))(out);
        Ok(p)
    }
}

/// torch's own cost of a borrowed `DLTensor` (`dltensor_from_py_object_no_sync`), no validation.
#[pyfunction]
fn torch_floor_view(x: &Bound<'_, PyAny>) -> PyResult<usize> {
    let api = torch_table(x)?;
    let f = api.table().dltensor_from_py_object_no_sync.expect("torch has it");
    let mut t = std::mem::MaybeUninit::<dlbridge::ffi::DLTensor>::zeroed();
    // SAFETY: a torch tensor, the GIL held, a writable DLTensor.
    assert_eq!(unsafe { f(x.as_ptr().cast(), t.as_mut_ptr()) }, 0);
    // SAFETY: filled by torch.
    Ok(unsafe { t.assume_init() }.data as usize)
}

/// The floor of a function that returns an address: one object in, its address out as an int.
#[pyfunction]
fn ptr_floor(x: &Bound<'_, PyAny>) -> usize {
    x.as_ptr() as usize
}

/// The floor: a trivial function taking one object.
#[pyfunction]
fn noop(_x: &Bound<'_, PyAny>) -> usize {
    0
}

/// A fresh `vec![0f32; n]` exported as a dlbridge.Tensor.
#[pyfunction]
fn export_fresh(n: usize) -> PyResult<ManagedTensor> {
    Ok(ManagedTensor::from_vec(vec![0f32; n], &[n])?)
}

/// A fresh 256-byte-aligned buffer of `n` float32, every page written (resident), exported.
#[pyfunction]
fn export_fresh_aligned(n: usize) -> PyResult<ManagedTensor> {
    let mut buf = AlignedBuffer::<f32>::zeroed(n);
    for (i, x) in buf.iter_mut().enumerate() {
        *x = i as f32;
    }
    Ok(ManagedTensor::from_host(buf, &[n])?)
}

/// Shared buffers by size.
type SharedBySize = std::sync::Mutex<Vec<(usize, Arc<ManagedTensor>)>>;

static SHARED: OnceLock<SharedBySize> = OnceLock::new();

/// A shared Rust buffer of `n` float32 (made once per size, 256-byte aligned) exported again: the
/// timed export allocates no data.
#[pyfunction]
fn export_shared(n: usize) -> PyResult<ManagedTensor> {
    let cache = SHARED.get_or_init(Default::default);
    let mut c = cache.lock().expect("not poisoned");
    let t = match c.iter().find(|(k, _)| *k == n) {
        Some((_, t)) => Arc::clone(t),
        None => {
            let t = Arc::new(ManagedTensor::from_host(AlignedBuffer::<f32>::zeroed(n), &[n])?);
            c.push((n, Arc::clone(&t)));
            t
        }
    };
    // SAFETY: a fresh struct sharing the buffer, owned here.
    Ok(unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }?)
}

/// The kernel author's kit: a function with an empty body taking three typed (float32) tensors.
#[pyfunction]
fn typed3(
    _a: dlbridge::python::TensorRef<'_, f32>,
    _b: dlbridge::python::TensorRef<'_, f32>,
    _c: dlbridge::python::TensorRef<'_, f32>,
) {
}

/// A typed float32 argument converted and dropped (the conversion alone).
#[pyfunction]
fn typed_ptr(t: dlbridge::python::TensorRef<'_, f32>) -> usize {
    t.data_ptr() as usize
}

/// `empty_like(x)` (float32) returned in x's framework.
#[pyfunction]
fn empty_like(
    py: Python<'_>,
    x: dlbridge::python::TensorRef<'_, f32>,
) -> PyResult<dlbridge::python::Output<f32>> {
    x.empty_like::<f32>(py)
}

static TORCH: pyo3::sync::PyOnceLock<dlbridge::python::Framework> = pyo3::sync::PyOnceLock::new();

/// A Rust-made `n`-element float32 tensor returned to a torch caller as a torch.Tensor.
#[pyfunction]
fn rust_made_torch(py: Python<'_>, n: usize) -> PyResult<Bound<'_, PyAny>> {
    let torch = TORCH.get_or_try_init(py, || dlbridge::python::Framework::torch(py))?;
    torch.from_vec(py, vec![0f32; n], &[n])
}

/// Takes a tensor and returns it: the caller's own object (a typed argument keeps it).
#[pyfunction]
fn identity<'py>(py: Python<'py>, x: dlbridge::python::TensorRef<'_, f32>) -> Bound<'py, PyAny> {
    x.object(py).to_owned()
}

/// Takes a tensor and returns a new object of its framework over the same memory (an owned
/// import, then the framework's exchange table back): what tvm-ffi does for a returned tensor.
#[pyfunction]
fn round_trip<'py>(x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let t: ManagedTensor = x.extract()?;
    dlbridge::python::Framework::of(x)?.wrap(x.py(), t)
}

// --- every mode (issue 22): empty-body kernels for jax.jit and torch.compile ---

dlbridge::xla_handler! {
    /// An XLA FFI handler with an empty body: its operand and result decoded, nothing computed
    /// (the bench's C++ twin binds `Arg<AnyBuffer>().Ret<AnyBuffer>()` and returns success).
    fn empty_xla(call, operands: 1, results: 1) {
        let _x = call.input_any(0, "x")?;
        let _out = call.output_any(0, "out")?;
        Ok(())
    }
}

/// The empty-body handler's capsule, for `jax.ffi.register_ffi_target`.
#[pyfunction]
fn empty_xla_capsule(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyCapsule>> {
    dlbridge::python::xla_capsule(py, empty_xla)
}

/// An in-place kernel with an empty body: one typed mutable float32 argument.
#[pyfunction]
fn empty_inplace(x: dlbridge::TensorMut<'_, f32>) {
    let _ = x;
}

// --- against nanobind (issue 31): the README's argument and result paths, one function each; the
// nanobind shim (bench/shim-nanobind) has the same functions in C++ ---

/// A read-only argument as the README declares one (`TensorRef<'_, f32, Rank<1>, C>`): its address.
#[pyfunction]
fn arg_ref_1c(x: dlbridge::TensorRef<'_, f32, dlbridge::spec::Rank<1>, dlbridge::spec::C>) -> usize {
    x.data_ptr() as usize
}

/// A writable argument as the README declares one (`TensorMut<'_, f32, Rank<1>, C>`): its address.
#[pyfunction]
fn arg_mut_1c(mut x: dlbridge::TensorMut<'_, f32, dlbridge::spec::Rank<1>, dlbridge::spec::C>) -> usize {
    x.data_ptr_mut() as usize
}

/// A Rust-made `n`-element float32 result as a numpy.ndarray, written as the README writes it.
#[pyfunction]
fn numpy_from_vec(py: Python<'_>, n: usize) -> PyResult<Bound<'_, PyAny>> {
    dlbridge::Framework::numpy(py)?.from_vec(py, vec![0f32; n], &[n])
}

/// A Rust-made `n`-element float32 result as a torch.Tensor, written as the README writes it.
#[pyfunction]
fn torch_from_vec(py: Python<'_>, n: usize) -> PyResult<Bound<'_, PyAny>> {
    dlbridge::Framework::torch(py)?.from_vec(py, vec![0f32; n], &[n])
}

dlbridge::xla_handler! {
    /// `native_empty_like`'s handler: its operand and result decoded, nothing computed.
    fn empty_like_xla(call, operands: 1, results: 1) {
        call.input_any(0, "x")?;
        call.output_any(0, "out")?;
        Ok(())
    }
}

/// `native_empty_like(x)`: a new uninitialised float32 tensor like `x` (the eager body of an
/// empty kernel; as a kernel with a handler, `add_kernel` makes it a native torch op).
#[pyfunction]
fn native_empty_like(
    py: Python<'_>,
    x: dlbridge::python::TensorRef<'_, f32>,
) -> PyResult<dlbridge::python::Output<f32>> {
    x.empty_like::<f32>(py)
}

/// The shim module.
#[pymodule]
fn dlbridge_bench(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(import_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(view_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(noop, m)?)?;
    m.add_function(wrap_pyfunction!(ptr_floor, m)?)?;
    m.add_function(wrap_pyfunction!(torch_floor_owned, m)?)?;
    m.add_function(wrap_pyfunction!(torch_floor_view, m)?)?;
    m.add_function(wrap_pyfunction!(export_fresh, m)?)?;
    m.add_function(wrap_pyfunction!(export_shared, m)?)?;
    m.add_function(wrap_pyfunction!(export_fresh_aligned, m)?)?;
    m.add_function(wrap_pyfunction!(typed3, m)?)?;
    m.add_function(wrap_pyfunction!(typed_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(empty_like, m)?)?;
    m.add_function(wrap_pyfunction!(rust_made_torch, m)?)?;
    m.add_function(wrap_pyfunction!(identity, m)?)?;
    m.add_function(wrap_pyfunction!(round_trip, m)?)?;
    m.add_function(wrap_pyfunction!(empty_xla_capsule, m)?)?;
    m.add_function(wrap_pyfunction!(empty_inplace, m)?)?;
    m.add_function(wrap_pyfunction!(arg_ref_1c, m)?)?;
    m.add_function(wrap_pyfunction!(arg_mut_1c, m)?)?;
    m.add_function(wrap_pyfunction!(numpy_from_vec, m)?)?;
    m.add_function(wrap_pyfunction!(torch_from_vec, m)?)?;
    m.add_function(wrap_pyfunction!(native_empty_like, m)?)?;
    // An empty kernel with a handler: a native torch op (torch.ops.dlbridge_bench.native_empty_like).
    let def = dlbridge::python::KernelDef {
        out: Some("x"),
        ffi: Some(empty_like_xla),
        ..dlbridge::python::KernelDef::default()
    };
    dlbridge::python::add_kernel(m, m.getattr("native_empty_like")?, &def, None)?;
    Ok(())
}
