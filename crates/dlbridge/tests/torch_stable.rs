//! Native torch ops through torch's stable C ABI, against the real libtorch of the venv's torch:
//! ops defined and registered from Rust, called through torch's dispatcher.
//!
//! Needs `DLBRIDGE_TORCH_DIR` (torch's package folder:
//! `python -c 'import torch, os; print(os.path.dirname(torch.__file__))'`); without it each test
//! prints why and returns, unless `DLBRIDGE_REQUIRE_TORCH=1` (`make rust-test` sets both), which
//! makes the absence a failure.
#![cfg(all(feature = "torch-stable", unix))]

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use dlbridge::DataType;
use dlbridge::spec::Rank;
use dlbridge::torch_stable::sys::StableIValue;
use dlbridge::torch_stable::xla::{AttrType, NativeOp, OutRule, XlaOp};
use dlbridge::torch_stable::{
    ArgKind, Args, DeviceKind, Error, KernelError, Library, NativeKernel, OpSignature, Outputs, Tensor,
    Torch, TorchDevice, Value, register_kernel, run_boxed,
};

const NS: &str = "dlbridge_test";

/// The venv's libtorch, loaded once for the process (`None`: skipped, reason printed).
fn torch() -> Option<&'static Torch> {
    let Some(dir) = std::env::var_os("DLBRIDGE_TORCH_DIR") else {
        if std::env::var("DLBRIDGE_REQUIRE_TORCH").as_deref() == Ok("1") {
            panic!("DLBRIDGE_REQUIRE_TORCH=1 but DLBRIDGE_TORCH_DIR is not set");
        }
        eprintln!(
            "SKIPPED: DLBRIDGE_TORCH_DIR is not set (torch's package folder); `make rust-test` sets it"
        );
        return None;
    };
    let lib = PathBuf::from(dir).join("lib").join(dlbridge::torch_stable::LIBTORCH_CPU);
    Some(Torch::open(&lib).unwrap_or_else(|e| panic!("{}: {e}", lib.display())))
}

/// Registers this file's ops once (fragments of NS; every test calls it).
fn setup() -> Option<&'static Torch> {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let t = torch()?;
    ONCE.call_once(|| {
        let lib = Library::fragment(t, NS).unwrap();
        for sig in [&ADD_ONE, &FAILS, &PANICS] {
            lib.define(sig).unwrap();
        }
        let cpu = Library::implementation(t, NS, "CPU").unwrap();
        // SAFETY: each kernel runs through run_boxed with the signature its op was defined from.
        unsafe {
            cpu.register("add_one", add_one_cpu).unwrap();
            cpu.register("fails", fails_cpu).unwrap();
            cpu.register("panics", panics_cpu).unwrap();
            Library::implementation(t, NS, "Meta").unwrap().register("add_one", add_one_meta).unwrap();
        }
        register_kernel::<Empty>(t, NS, &["CPU", "Meta"]).unwrap();
        dlbridge::torch_stable::xla::register::<Saxpy>(t, NS).unwrap();
        dlbridge::torch_stable::xla::register::<SaxpyInPlace>(t, NS).unwrap();
        dlbridge::torch_stable::xla::register::<Sum8>(t, NS).unwrap();
        dlbridge::torch_stable::xla::register::<SumPlus>(t, NS).unwrap();
    });
    Some(t)
}

const ADD_ONE: OpSignature = OpSignature::new("add_one", &[("x", ArgKind::Tensor)], &[ArgKind::Tensor]);
const FAILS: OpSignature =
    OpSignature::new("fails", &[("x", ArgKind::Tensor), ("why", ArgKind::Str)], &[ArgKind::Tensor]);
const PANICS: OpSignature = OpSignature::new("panics", &[("x", ArgKind::Tensor)], &[ArgKind::Tensor]);
const EMPTY: OpSignature = OpSignature::new("empty", &[("x", ArgKind::Tensor)], &[]);

/// `x + 1` for float32 tensors of any layout: reads through sizes, strides and the data pointer.
unsafe extern "C-unwind" fn add_one_cpu(stack: *mut StableIValue, num_args: u64, num_outputs: u64) {
    // SAFETY: torch calls this with the stack of ADD_ONE (registered for it in setup()).
    unsafe { run_boxed(stack, num_args, num_outputs, &ADD_ONE, add_one_body) }
}

fn add_one_body(args: &mut Args, out: &mut Outputs) -> Result<(), KernelError> {
    let x = args.tensor(0)?;
    if x.dtype()? != DataType::FLOAT32 || x.device()?.kind != DeviceKind::Cpu {
        return Err(format!("x: expected a float32 cpu tensor, got {} {:?}", x.dtype()?, x.device()?).into());
    }
    let (sizes, strides) = (x.sizes()?, x.strides()?);
    let y = x.torch().empty(&sizes, DataType::FLOAT32, TorchDevice::CPU)?;
    let (src, dst) = (x.data_ptr()?.cast::<f32>(), y.data_ptr()?.cast::<f32>());
    let n = y.numel()? as usize;
    for k in 0..n {
        // The element's offset in x from its row-major index k.
        let (mut rem, mut off) = (k, 0isize);
        for d in (0..sizes.len()).rev() {
            let e = sizes[d] as usize;
            off += (rem % e) as isize * strides[d] as isize;
            rem /= e;
        }
        // SAFETY: x is a float32 CPU tensor whose elements sit at these offsets from its data
        // pointer; y is a fresh contiguous float32 CPU tensor of n elements.
        unsafe { dst.add(k).write(src.offset(off).read() + 1.0) };
    }
    out.set(0, Value::Tensor(y))
}

/// `add_one` on the meta device: the output's shape, nothing computed.
unsafe extern "C-unwind" fn add_one_meta(stack: *mut StableIValue, num_args: u64, num_outputs: u64) {
    // SAFETY: as add_one_cpu.
    unsafe {
        run_boxed(stack, num_args, num_outputs, &ADD_ONE, |args, out| {
            let x = args.tensor(0)?;
            out.set(0, Value::Tensor(x.torch().empty(&x.sizes()?, x.dtype()?, x.device()?)?))
        })
    }
}

/// Makes its output (a counted blob), then fails with `why`: both tensors must still be freed.
unsafe extern "C-unwind" fn fails_cpu(stack: *mut StableIValue, num_args: u64, num_outputs: u64) {
    // SAFETY: as add_one_cpu, for FAILS.
    unsafe {
        run_boxed(stack, num_args, num_outputs, &FAILS, |args, out| {
            out.set(0, Value::Tensor(counted(args.tensor(0)?.torch(), &[4], &FAILS_OUTPUT_FREED)))?;
            Err(KernelError(format!("refused: {}", args.str(1)?)))
        })
    }
}

unsafe extern "C-unwind" fn panics_cpu(stack: *mut StableIValue, num_args: u64, num_outputs: u64) {
    // SAFETY: as add_one_cpu, for PANICS.
    unsafe {
        run_boxed(stack, num_args, num_outputs, &PANICS, |_args, _out| {
            panic!("the kernel panicked on purpose")
        })
    }
}

/// Does nothing (registered through the safe route).
struct Empty;
impl NativeKernel for Empty {
    const SIGNATURE: OpSignature = EMPTY;
    fn run(_args: &mut Args, _out: &mut Outputs) -> Result<(), KernelError> {
        Ok(())
    }
}

static FAILS_OUTPUT_FREED: AtomicUsize = AtomicUsize::new(0);

/// A float32 tensor over Rust memory whose deleter counts into `freed`.
fn counted(t: &'static Torch, sizes: &[i64], freed: &'static AtomicUsize) -> Tensor {
    struct Blob {
        data: Vec<f32>,
        freed: &'static AtomicUsize,
    }
    unsafe extern "C" fn deleter(_data: *mut c_void, ctx: *mut c_void) {
        // SAFETY: ctx is the Blob boxed below, freed once (torch calls the deleter once).
        let blob = unsafe { Box::from_raw(ctx.cast::<Blob>()) };
        blob.freed.fetch_add(1, Ordering::SeqCst);
    }
    let n: i64 = sizes.iter().product();
    let mut blob = Box::new(Blob { data: (0..n).map(|i| i as f32).collect(), freed });
    let data = blob.data.as_mut_ptr().cast::<c_void>();
    let strides = dlbridge::layout::c_strides(sizes);
    // SAFETY: `data` is the blob's float32 memory of that layout, freed only by the deleter.
    unsafe {
        t.from_blob(
            data,
            sizes,
            &strides,
            0,
            DataType::FLOAT32,
            TorchDevice::CPU,
            Some(deleter),
            Box::into_raw(blob).cast(),
        )
    }
    .unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    let c = t.torch().contiguous(t).unwrap();
    let n = c.numel().unwrap() as usize;
    // SAFETY: a contiguous float32 CPU tensor of n elements, alive while `c` is.
    unsafe { std::slice::from_raw_parts(c.data_ptr().unwrap().cast::<f32>(), n) }.to_vec()
}

fn one(mut v: Vec<Value>) -> Tensor {
    assert_eq!(v.len(), 1);
    match v.pop() {
        Some(Value::Tensor(t)) => t,
        other => panic!("expected a tensor, got {other:?}"),
    }
}

/// `aten::narrow(x, dim, start, length)`: a view with a storage offset (non-contiguous when it
/// cuts the last dimension).
fn narrow(x: &Tensor, dim: i64, start: i64, length: i64) -> Tensor {
    let t = x.torch();
    let args =
        vec![Value::Tensor(x.new_handle().unwrap()), Value::Int(dim), Value::Int(start), Value::Int(length)];
    // SAFETY: the arguments and results have the op's schema types.
    one(unsafe { t.call("aten::narrow", "", args, &[ArgKind::Tensor]) }.unwrap())
}

#[test]
fn the_schema_is_made_from_the_signature() {
    assert_eq!(ADD_ONE.schema().unwrap(), "add_one(Tensor x) -> Tensor");
    assert_eq!(EMPTY.schema().unwrap(), "empty(Tensor x) -> ()");
    assert_eq!(SaxpyInPlace::OP.signature.schema().unwrap(), "saxpy_(Tensor x, Tensor(a!) y, float a) -> ()");
    let two =
        OpSignature::new("f", &[("n", ArgKind::Int), ("b", ArgKind::Bool)], &[ArgKind::Tensor, ArgKind::Int]);
    assert_eq!(two.schema().unwrap(), "f(int n, bool b) -> (Tensor, int)");
    let bad = OpSignature::new("f", &[("x y", ArgKind::Tensor)], &[]);
    assert!(matches!(bad.schema(), Err(Error::Invalid(m)) if m.contains("\"x y\"")));
    let bad = OpSignature::new("f", &[], &[ArgKind::Str]);
    assert!(matches!(bad.schema(), Err(Error::Invalid(m)) if m.contains("Str")));
}

#[test]
fn add_one_is_a_native_op_called_through_the_dispatcher() {
    let Some(t) = setup() else { return };
    assert!(t.version().starts_with("2."), "{}", t.version());
    assert!(t.has("aoti_torch_get_sizes") && t.has("aoti_torch_library_impl"));
    assert!(!t.has("no_such_function"));
    static FREED: AtomicUsize = AtomicUsize::new(0);
    let x = counted(t, &[2, 3], &FREED);
    assert_eq!((x.sizes().unwrap(), x.strides().unwrap()), (vec![2, 3], vec![3, 1]));
    assert_eq!(
        (x.dtype().unwrap(), x.device().unwrap(), x.storage_offset().unwrap()),
        (DataType::FLOAT32, TorchDevice::CPU, 0)
    );
    // SAFETY: the arguments and results have the op's schema types.
    let y = one(unsafe {
        t.call("dlbridge_test::add_one", "", vec![Value::Tensor(x.new_handle().unwrap())], &[ArgKind::Tensor])
    }
    .unwrap());
    assert_eq!(f32s(&y), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!((y.sizes().unwrap(), y.dtype().unwrap()), (vec![2, 3], DataType::FLOAT32));
    // A view with a storage offset and a stride that is not the row's length.
    let v = narrow(&x, 1, 1, 2);
    assert_eq!(
        (v.sizes().unwrap(), v.strides().unwrap(), v.storage_offset().unwrap()),
        (vec![2, 2], vec![3, 1], 1)
    );
    assert!(!v.is_contiguous().unwrap());
    assert_eq!(v.data_ptr().unwrap(), x.data_ptr().unwrap().cast::<f32>().wrapping_add(1).cast());
    // SAFETY: the arguments and results have the op's schema types.
    let w =
        one(unsafe { t.call("dlbridge_test::add_one", "", vec![Value::Tensor(v)], &[ArgKind::Tensor]) }
            .unwrap());
    assert_eq!(f32s(&w), [2.0, 3.0, 5.0, 6.0]);
    // The kernel deleted its input handles: the last reference is ours, and the memory goes
    // exactly once when it drops.
    drop((y, w));
    assert_eq!(FREED.load(Ordering::SeqCst), 0);
    drop(x);
    assert_eq!(FREED.load(Ordering::SeqCst), 1);
}

#[test]
fn the_meta_kernel_makes_the_output_on_the_meta_device() {
    let Some(t) = setup() else { return };
    let x = t.empty(&[5, 7], DataType::FLOAT32, TorchDevice::META).unwrap();
    assert_eq!(x.device().unwrap().kind, DeviceKind::Meta);
    // SAFETY: the arguments and results have the op's schema types.
    let y =
        one(unsafe { t.call("dlbridge_test::add_one", "", vec![Value::Tensor(x)], &[ArgKind::Tensor]) }
            .unwrap());
    assert_eq!((y.sizes().unwrap(), y.device().unwrap().kind), (vec![5, 7], DeviceKind::Meta));
}

#[test]
fn a_kernel_error_reaches_the_caller_and_every_tensor_is_freed() {
    let Some(t) = setup() else { return };
    static FREED: AtomicUsize = AtomicUsize::new(0);
    let x = counted(t, &[3], &FREED);
    let before = FAILS_OUTPUT_FREED.load(Ordering::SeqCst);
    let args = vec![Value::Tensor(x.new_handle().unwrap()), Value::Str("not today".into())];
    // SAFETY: the arguments and results have the op's schema types.
    let err = unsafe { t.call("dlbridge_test::fails", "", args, &[ArgKind::Tensor]) }.unwrap_err();
    let Error::Call { message, .. } = &err else { panic!("{err:?}") };
    if t.has("torch_exception_get_what_without_backtrace") {
        assert!(message.contains("fails: refused: not today"), "{message}");
    }
    // The output it made was freed when it failed, the input handle it got too: ours is the last.
    assert_eq!(FAILS_OUTPUT_FREED.load(Ordering::SeqCst), before + 1);
    drop(x);
    assert_eq!(FREED.load(Ordering::SeqCst), 1);
}

#[test]
fn a_kernel_panic_is_an_error_and_frees_its_input() {
    let Some(t) = setup() else { return };
    static FREED: AtomicUsize = AtomicUsize::new(0);
    let x = counted(t, &[2], &FREED);
    // SAFETY: the arguments and results have the op's schema types.
    let err = unsafe {
        t.call("dlbridge_test::panics", "", vec![Value::Tensor(x.new_handle().unwrap())], &[ArgKind::Tensor])
    }
    .unwrap_err();
    if t.has("torch_exception_get_what_without_backtrace") {
        assert!(err.to_string().contains("panics: panicked: the kernel panicked on purpose"), "{err}");
    }
    drop(x);
    assert_eq!(FREED.load(Ordering::SeqCst), 1);
    // The process goes on: the op works again.
    let y = t.empty(&[1], DataType::FLOAT32, TorchDevice::CPU).unwrap();
    // SAFETY: the arguments and results have the op's schema types.
    assert!(unsafe { t.call("dlbridge_test::empty", "", vec![Value::Tensor(y)], &[]) }.unwrap().is_empty());
}

#[test]
fn torch_errors_carry_torch_message() {
    let Some(t) = setup() else { return };
    let lib = Library::fragment(t, NS).unwrap();
    let err = lib.define(&ADD_ONE).unwrap_err();
    let Error::Call { function, message } = &err else { panic!("{err:?}") };
    assert_eq!(*function, "aoti_torch_library_def");
    if t.has("torch_exception_get_what_without_backtrace") {
        assert!(message.contains("multiple times"), "{message}");
    }
    // SAFETY: the arguments and results have the op's schema types.
    let err = unsafe { t.call("dlbridge_test::no_such_op", "", vec![], &[]) }.unwrap_err();
    if t.has("torch_exception_get_what_without_backtrace") {
        assert!(err.to_string().contains("Could not find schema for dlbridge_test::no_such_op"), "{err}");
    }
    assert!(matches!(lib.def("bad schema ("), Err(Error::Call { .. })));
    assert!(matches!(lib.def("nul\0"), Err(Error::Invalid(m)) if m.starts_with("schema:")));
    let err = t.empty_strided(&[2, 2], &[1], DataType::FLOAT32, TorchDevice::CPU).unwrap_err();
    assert!(matches!(&err, Error::Invalid(m) if m.starts_with("strides:")), "{err}");
}

// --- One body for XLA and torch: an XLA FFI handler as the op's CPU kernel. ---

dlbridge::xla_handler! {
    /// `out = a * x + y` for float32 vectors (what `jax.jit` would call).
    fn saxpy_xla(call, operands: 2, results: 1, attrs: ["a"]) {
        let a: f32 = call.attr("a")?;
        let x = call.input::<f32, Rank<1>>(0, "x")?;
        let y = call.input::<f32, Rank<1>>(1, "y")?;
        let mut out = call.output::<f32, Rank<1>>(0, "out")?;
        let (x, y) = (x.as_slice()?, y.as_slice()?);
        for ((o, x), y) in out.as_slice_mut()?.iter_mut().zip(x.iter()).zip(y.iter()) {
            *o = a * x + y;
        }
        Ok(())
    }
}

dlbridge::xla_handler! {
    /// `y += a * x` in place: result 0 is operand 1's memory.
    fn saxpy_inplace_xla(call, operands: 2, results: 1, attrs: ["a"]) {
        let a: f32 = call.attr("a")?;
        let x = call.input::<f32, Rank<1>>(0, "x")?;
        let mut y = call.output::<f32, Rank<1>>(0, "y")?;
        if call.input_any(1, "y")?.data_ptr().cast::<f32>() != y.as_mut_ptr() {
            return Err(dlbridge::xla::FfiError::invalid_argument("y: result 0 must alias operand 1"));
        }
        let x = x.as_slice()?;
        for (y, x) in y.as_slice_mut()?.iter_mut().zip(x.iter()) {
            *y += a * x;
        }
        Ok(())
    }
}

struct Saxpy;
impl NativeOp for Saxpy {
    const OP: XlaOp = XlaOp {
        signature: OpSignature::new(
            "saxpy",
            &[("x", ArgKind::Tensor), ("y", ArgKind::Tensor), ("a", ArgKind::Float)],
            &[ArgKind::Tensor],
        ),
        attrs: &[("a", AttrType::F32)],
        out: Some(OutRule::Like(0)),
        handler: saxpy_xla,
    };
}

struct SaxpyInPlace;
impl NativeOp for SaxpyInPlace {
    const OP: XlaOp = XlaOp {
        signature: OpSignature::new(
            "saxpy_",
            &[("x", ArgKind::Tensor), ("y", ArgKind::TensorMut), ("a", ArgKind::Float)],
            &[],
        ),
        attrs: &[("a", AttrType::F32)],
        out: None,
        handler: saxpy_inplace_xla,
    };
}

dlbridge::xla_handler! {
    /// `out = k * (a + b + ... + h)` and `twice = 2 * out`: more operands and arguments than the
    /// adapter's small frame and inline argument slots hold.
    fn sum8_xla(call, operands: 8, results: 2, attrs: ["k"]) {
        let k: f64 = call.attr("k")?;
        let names = ["a", "b", "c", "d", "e", "f", "g", "h"];
        let mut sum = vec![0f32; call.input::<f32, Rank<1>>(0, "a")?.as_slice()?.len()];
        for (i, name) in names.into_iter().enumerate() {
            let x = call.input::<f32, Rank<1>>(i, name)?;
            for (s, x) in sum.iter_mut().zip(x.as_slice()?.iter()) {
                *s += x;
            }
        }
        let mut out = call.output::<f32, Rank<1>>(0, "out")?;
        for (o, s) in out.as_slice_mut()?.iter_mut().zip(&sum) {
            *o = k as f32 * s;
        }
        let mut twice = call.output::<f32, Rank<1>>(1, "twice")?;
        for (o, s) in twice.as_slice_mut()?.iter_mut().zip(&sum) {
            *o = 2.0 * k as f32 * s;
        }
        Ok(())
    }
}

/// Two results like argument `a` (an output rule of its own, not `Like`).
fn sum8_rule(
    tensors: &[dlbridge::torch_stable::xla::TensorInfo],
    _args: &Args,
) -> Result<Vec<dlbridge::torch_stable::xla::TensorInfo>, KernelError> {
    Ok(vec![tensors[0].clone(), tensors[0].clone()])
}

struct Sum8;
impl NativeOp for Sum8 {
    const OP: XlaOp = XlaOp {
        signature: OpSignature::new(
            "sum8",
            &[
                ("a", ArgKind::Tensor),
                ("b", ArgKind::Tensor),
                ("c", ArgKind::Tensor),
                ("d", ArgKind::Tensor),
                ("e", ArgKind::Tensor),
                ("f", ArgKind::Tensor),
                ("g", ArgKind::Tensor),
                ("h", ArgKind::Tensor),
                ("k", ArgKind::Float),
            ],
            &[ArgKind::Tensor, ArgKind::Tensor],
        ),
        attrs: &[("k", AttrType::F64)],
        out: Some(OutRule::Fn(sum8_rule)),
        handler: sum8_xla,
    };
}

fn filled(t: &'static Torch, v: &[f32]) -> Tensor {
    let x = t.empty(&[v.len() as i64], DataType::FLOAT32, TorchDevice::CPU).unwrap();
    // SAFETY: a fresh contiguous float32 CPU tensor of v.len() elements, written before any read.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), x.data_ptr().unwrap().cast::<f32>(), v.len()) };
    x
}

#[test]
fn an_xla_handler_runs_as_the_ops_cpu_kernel() {
    let Some(t) = setup() else { return };
    let x = filled(t, &[1.0, 2.0, 3.0, 4.0]);
    let y = filled(t, &[10.0, 20.0, 30.0, 40.0]);
    let call = |x: &Tensor, y: &Tensor, a: f64| {
        let args = vec![
            Value::Tensor(x.new_handle().unwrap()),
            Value::Tensor(y.new_handle().unwrap()),
            Value::Float(a),
        ];
        // SAFETY: the arguments and results have the op's schema types.
        unsafe { t.call("dlbridge_test::saxpy", "", args, &[ArgKind::Tensor]) }
    };
    assert_eq!(f32s(&one(call(&x, &y, 2.0).unwrap())), [12.0, 24.0, 36.0, 48.0]);
    // A strided operand (every other element) is made contiguous for the handler.
    let wide = filled(t, &[1.0, 0.0, 2.0, 0.0, 3.0, 0.0, 4.0, 0.0]);
    let every_other = strided_view(&wide);
    assert_eq!(every_other.strides().unwrap(), vec![2]);
    assert_eq!(f32s(&one(call(&every_other, &y, 1.0).unwrap())), [11.0, 22.0, 33.0, 44.0]);
    // The handler's own refusal, as under jax.jit, is the op's error.
    let err = call(&x, &t.empty(&[2, 2], DataType::FLOAT32, TorchDevice::CPU).unwrap(), 1.0).unwrap_err();
    if t.has("torch_exception_get_what_without_backtrace") {
        assert!(err.to_string().contains("saxpy: saxpy_xla: y: expected float32 1-d"), "{err}");
    }
    // Meta: the output rule, no handler.
    let m = t.empty(&[6], DataType::FLOAT32, TorchDevice::META).unwrap();
    let out = one(call(&m, &m, 1.0).unwrap());
    assert_eq!((out.sizes().unwrap(), out.device().unwrap().kind), (vec![6], DeviceKind::Meta));
}

#[test]
fn an_op_with_more_arguments_than_the_small_frame_runs_the_same_handler() {
    // 8 tensors and a scalar: the adapter's large frame and heap-held arguments (9 > 8 slots).
    let Some(t) = setup() else { return };
    let xs: Vec<Tensor> = (0..8).map(|i| filled(t, &[i as f32, 10.0 * i as f32])).collect();
    let mut args: Vec<Value> = xs.iter().map(|x| Value::Tensor(x.new_handle().unwrap())).collect();
    args.push(Value::Float(0.5));
    // SAFETY: the arguments and results have the op's schema types.
    let outs =
        unsafe { t.call("dlbridge_test::sum8", "", args, &[ArgKind::Tensor, ArgKind::Tensor]) }.unwrap();
    let f = |v: &Value| match v {
        Value::Tensor(t) => f32s(t),
        other => panic!("not a tensor: {other:?}"),
    };
    // sum of 0..8 = 28: [28, 280] * 0.5, and twice that.
    assert_eq!(outs.iter().map(f).collect::<Vec<_>>(), [vec![14.0, 140.0], vec![28.0, 280.0]]);
}

/// `wide[::2]`: `aten::slice` takes optional arguments, so this is `aten::unfold(x, 0, 1, 2)`
/// (sizes [n/2, 1], strides [2, 1]) then `aten::squeeze.dim(1)`.
fn strided_view(wide: &Tensor) -> Tensor {
    let t = wide.torch();
    // SAFETY: the arguments and results have the op's schema types.
    let u = one(unsafe {
        t.call(
            "aten::unfold",
            "",
            vec![Value::Tensor(wide.new_handle().unwrap()), Value::Int(0), Value::Int(1), Value::Int(2)],
            &[ArgKind::Tensor],
        )
    }
    .unwrap());
    // SAFETY: the arguments and results have the op's schema types.
    one(unsafe { t.call("aten::squeeze", "dim", vec![Value::Tensor(u), Value::Int(1)], &[ArgKind::Tensor]) }
        .unwrap())
}

#[test]
fn an_in_place_xla_handler_writes_the_callers_tensor() {
    let Some(t) = setup() else { return };
    let x = filled(t, &[1.0, 2.0, 3.0]);
    let y = filled(t, &[10.0, 20.0, 30.0]);
    let args = vec![
        Value::Tensor(x.new_handle().unwrap()),
        Value::Tensor(y.new_handle().unwrap()),
        Value::Float(2.0),
    ];
    // SAFETY: the arguments and results have the op's schema types.
    assert!(unsafe { t.call("dlbridge_test::saxpy_", "", args, &[]) }.unwrap().is_empty());
    assert_eq!(f32s(&y), [12.0, 24.0, 36.0]);
    // A non-contiguous y: computed on a contiguous copy, copied back into the caller's view.
    let wide = filled(t, &[10.0, -1.0, 20.0, -1.0, 30.0, -1.0]);
    let view = strided_view(&wide);
    let args = vec![Value::Tensor(x.new_handle().unwrap()), Value::Tensor(view), Value::Float(1.0)];
    // SAFETY: the arguments and results have the op's schema types.
    assert!(unsafe { t.call("dlbridge_test::saxpy_", "", args, &[]) }.unwrap().is_empty());
    assert_eq!(f32s(&wide), [11.0, -1.0, 22.0, -1.0, 33.0, -1.0]);
}

#[test]
fn kernels_run_on_many_threads_at_once() {
    let Some(t) = setup() else { return };
    static FREED: AtomicUsize = AtomicUsize::new(0);
    let x = counted(t, &[16], &FREED);
    std::thread::scope(|s| {
        for _ in 0..4 {
            let h = x.new_handle().unwrap();
            s.spawn(move || {
                for _ in 0..200 {
                    let args = vec![Value::Tensor(h.new_handle().unwrap())];
                    // SAFETY: the arguments and results have the op's schema types.
                    let y =
                        one(unsafe { t.call("dlbridge_test::add_one", "", args, &[ArgKind::Tensor]) }
                            .unwrap());
                    assert_eq!(f32s(&y)[15], 16.0);
                    let args = vec![Value::Tensor(h.new_handle().unwrap()), Value::Str("busy".into())];
                    // SAFETY: as above.
                    assert!(unsafe { t.call("dlbridge_test::fails", "", args, &[ArgKind::Tensor]) }.is_err());
                }
            });
        }
    });
    drop(x);
    assert_eq!(FREED.load(Ordering::SeqCst), 1);
}

#[test]
fn an_op_made_at_run_time_gets_a_slot() {
    let Some(t) = setup() else { return };
    // As a kernel kit would from a declaration it reads when a module initialises.
    let name = String::from("saxpy_rt");
    let params = [("x", ArgKind::Tensor), ("y", ArgKind::Tensor), ("a", ArgKind::Float)];
    let op = XlaOp::leak(
        &name,
        &params,
        &[ArgKind::Tensor],
        &[("a", AttrType::F32)],
        Some(OutRule::Like(0)),
        saxpy_xla,
    );
    dlbridge::torch_stable::xla::register_op(t, NS, op).unwrap();
    let (x, y) = (filled(t, &[1.0, 2.0]), filled(t, &[3.0, 4.0]));
    let args = vec![
        Value::Tensor(x.new_handle().unwrap()),
        Value::Tensor(y.new_handle().unwrap()),
        Value::Float(10.0),
    ];
    // SAFETY: the arguments and results have the op's schema types.
    let out = one(unsafe { t.call(&format!("{NS}::{name}"), "", args, &[ArgKind::Tensor]) }.unwrap());
    assert_eq!(f32s(&out), [13.0, 24.0]);
    let m = t.empty(&[3], DataType::FLOAT32, TorchDevice::META).unwrap();
    let args = vec![Value::Tensor(m.new_handle().unwrap()), Value::Tensor(m), Value::Float(1.0)];
    // SAFETY: as above.
    let out = one(unsafe { t.call(&format!("{NS}::{name}"), "", args, &[ArgKind::Tensor]) }.unwrap());
    assert_eq!((out.sizes().unwrap(), out.device().unwrap().kind), (vec![3], DeviceKind::Meta));
    // Defined once: a second registration of the name is torch's refusal, a mismatched op is ours.
    let again = XlaOp::leak(
        &name,
        &params,
        &[ArgKind::Tensor],
        &[("a", AttrType::F32)],
        Some(OutRule::Like(0)),
        saxpy_xla,
    );
    assert!(matches!(dlbridge::torch_stable::xla::register_op(t, NS, again), Err(Error::Call { .. })));
    let bad = XlaOp::leak("bad_rt", &params, &[ArgKind::Tensor], &[], Some(OutRule::Like(0)), saxpy_xla);
    let err = dlbridge::torch_stable::xla::register_op(t, NS, bad).unwrap_err();
    assert!(matches!(&err, Error::Invalid(m) if m.contains("argument a has no attribute type")), "{err}");
}

#[test]
fn scalar_defaults_are_in_the_schema_and_checked() {
    const ARGS: &[(&str, ArgKind)] =
        &[("x", ArgKind::Tensor), ("a", ArgKind::Float), ("n", ArgKind::Int), ("b", ArgKind::Bool)];
    let sig = OpSignature::new("d", ARGS, &[ArgKind::Tensor]).with_defaults(&[("a", "1e-05"), ("b", "True")]);
    assert_eq!(sig.schema().unwrap(), "d(Tensor x, float a=1e-05, int n, bool b=True) -> Tensor");
    let leaked = OpSignature::new("d", ARGS, &[]).leak_defaults(&[("n", "-3")]);
    assert_eq!(leaked.schema().unwrap(), "d(Tensor x, float a, int n=-3, bool b) -> ()");
    for (bad, why) in [
        (&[("z", "1")][..], "no such argument"),
        (&[("x", "1")][..], "kind Tensor"),
        (&[("a", "inf")][..], "kind Float"),
        (&[("n", "1.5")][..], "kind Int"),
        (&[("b", "true")][..], "kind Bool"),
    ] {
        let sig = OpSignature::new("d", ARGS, &[]).leak_defaults(bad);
        assert!(
            matches!(sig.schema(), Err(Error::Invalid(ref m)) if m.contains(why)),
            "{bad:?}: {:?}",
            sig.schema()
        );
    }
    // String and list defaults: a literal in double quotes (\\ and \" escaped), a list of its
    // element kind.
    const MORE: &[(&str, ArgKind)] = &[
        ("s", ArgKind::Str),
        ("ns", ArgKind::IntList),
        ("fs", ArgKind::FloatList),
        ("bs", ArgKind::BoolList),
    ];
    let sig = OpSignature::new("l", MORE, &[]).leak_defaults(&[
        ("s", r#""a \"b\" \\c""#),
        ("ns", "[0, -1]"),
        ("fs", "[0.5, 1e-05]"),
        ("bs", "[]"),
    ]);
    assert_eq!(
        sig.schema().unwrap(),
        r#"l(str s="a \"b\" \\c", int[] ns=[0, -1], float[] fs=[0.5, 1e-05], bool[] bs=[]) -> ()"#
    );
    for (bad, why) in [
        (&[("s", "abc")][..], "kind Str"),
        (&[("s", r#""a"b""#)][..], "kind Str"),
        (&[("s", r#""a\n""#)][..], "kind Str"),
        (&[("ns", "[0.5]")][..], "kind IntList"),
        (&[("ns", "0")][..], "kind IntList"),
        (&[("fs", "[inf]")][..], "kind FloatList"),
        (&[("bs", "[true]")][..], "kind BoolList"),
    ] {
        let sig = OpSignature::new("l", MORE, &[]).leak_defaults(bad);
        assert!(
            matches!(sig.schema(), Err(Error::Invalid(ref m)) if m.contains(why)),
            "{bad:?}: {:?}",
            sig.schema()
        );
    }
    // A list is an argument only.
    let listed = OpSignature::new("r", &[], &[ArgKind::IntList]);
    assert!(matches!(listed.schema(), Err(Error::Invalid(ref m)) if m.contains("IntList")));
    assert!(Error::Invalid(String::new()).is_unsupported());
    assert!(Error::Missing { symbol: "torch_library_impl", torch: "2.9.0".into() }.is_unsupported());
    assert!(!Error::Call { function: "f", message: String::new() }.is_unsupported());
}

/// The data pointers and sizes of the tensors the version-bump hook was called with.
static BUMPED: std::sync::Mutex<Vec<(usize, i64)>> = std::sync::Mutex::new(Vec::new());

/// The data pointer and size of the tensor behind a handle the hooks are given.
///
/// # Safety
///
/// A live handle, borrowed (never freed here).
unsafe fn seen(h: dlbridge::torch_stable::sys::AtenTensorHandle) -> (usize, i64) {
    let t = Torch::get().expect("a kernel runs only with torch loaded");
    // SAFETY: the caller's promise; ManuallyDrop: borrowed, never deleted here.
    let borrowed = std::mem::ManuallyDrop::new(unsafe { Tensor::from_raw(t, h) }.expect("not NULL"));
    (borrowed.data_ptr().unwrap() as usize, borrowed.numel().unwrap())
}

/// Stand-ins for torch's C++ rules (which a process without Python's torch cannot verify): a
/// 5-element tensor may not be written (as an inference tensor outside inference mode), and
/// every bump is recorded.
unsafe fn refuse_five(h: dlbridge::torch_stable::sys::AtenTensorHandle) -> bool {
    // SAFETY: the hooks' contract: a live handle.
    unsafe { seen(h) }.1 != 5
}

/// A stand-in for "requires grad in grad mode": a 9-element tensor.
unsafe fn nine_requires_grad(h: dlbridge::torch_stable::sys::AtenTensorHandle) -> bool {
    // SAFETY: the hooks' contract: a live handle.
    unsafe { seen(h) }.1 == 9
}

unsafe fn recording_bump(h: dlbridge::torch_stable::sys::AtenTensorHandle) {
    // SAFETY: the hooks' contract: a live handle.
    let s = unsafe { seen(h) };
    BUMPED.lock().unwrap().push(s);
}

#[test]
fn an_in_place_op_checks_then_bumps_its_written_argument_through_the_version_hooks() {
    let Some(t) = setup() else { return };
    let hooks = dlbridge::torch_stable::VersionHooks {
        may_write: refuse_five,
        bump: recording_bump,
        untracked_grad: nine_requires_grad,
    };
    // SAFETY: each only reads the live handle they are given (and record what they saw).
    unsafe { dlbridge::torch_stable::set_version_hooks(hooks) };
    assert!(dlbridge::torch_stable::has_version_hooks());
    // 7 and 5 elements: no other test's tensors (other tests run meanwhile, and may reuse an
    // address).
    let x = filled(t, &[1.0; 7]);
    let y = filled(t, &[3.0; 7]);
    let call = |x: &Tensor, y: &Tensor| {
        let args = vec![
            Value::Tensor(x.new_handle().unwrap()),
            Value::Tensor(y.new_handle().unwrap()),
            Value::Float(1.0),
        ];
        // SAFETY: the arguments and results have the op's schema types.
        unsafe { t.call("dlbridge_test::saxpy_", "", args, &[]) }
    };
    assert!(call(&x, &y).unwrap().is_empty());
    assert_eq!(f32s(&y), [4.0; 7]);
    {
        let bumped = BUMPED.lock().unwrap();
        let y_seen = (y.data_ptr().unwrap() as usize, 7);
        assert_eq!(bumped.iter().filter(|&&p| p == y_seen).count(), 1, "{bumped:?}");
        assert!(!bumped.contains(&(x.data_ptr().unwrap() as usize, 7)));
    }
    // Refused before the handler runs: nothing written, nothing bumped.
    let (x5, y5) = (filled(t, &[1.0; 5]), filled(t, &[3.0; 5]));
    let e = call(&x5, &y5).unwrap_err();
    assert!(e.to_string().contains("y: an inference tensor cannot be written in place"), "{e}");
    assert_eq!(f32s(&y5), [3.0; 5]);
    assert!(!BUMPED.lock().unwrap().iter().any(|&(_, n)| n == 5));
    // An argument autograd would lose track of (read or written), refused before the handler
    // runs, naming it: nothing written, nothing bumped.
    let (x9, y9) = (filled(t, &[1.0; 9]), filled(t, &[3.0; 9]));
    let e = call(&x9, &y9).unwrap_err();
    assert!(e.to_string().contains("argument 'x' requires grad in grad mode"), "{e}");
    assert_eq!(f32s(&y9), [3.0; 9]);
    assert!(!BUMPED.lock().unwrap().iter().any(|&(_, n)| n == 9));
}

#[test]
fn a_borrowed_description_is_the_tensors_layout_without_a_new_handle() {
    let Some(t) = torch() else { return };
    let d = t.describer().unwrap();
    let x = t.empty(&[4, 6], DataType::FLOAT64, TorchDevice::CPU).unwrap();
    let v = narrow(&narrow(&x, 0, 1, 2), 1, 2, 3); // an offset, strided view: extents [2, 3], strides [6, 1]
    // SAFETY: a live owning handle of this torch; nothing changes its metadata meanwhile.
    let seen = unsafe { d.describe(v.as_raw()) }.expect("a CPU strided float64 tensor");
    assert_eq!(seen.ndim, 2);
    // SAFETY: two extents and two strides, alive while `v` is unchanged.
    let (shape, strides) = unsafe {
        (
            std::slice::from_raw_parts(seen.shape, 2).to_vec(),
            std::slice::from_raw_parts(seen.strides, 2).to_vec(),
        )
    };
    assert_eq!((shape, strides), (vec![2, 3], vec![6, 1]));
    assert_eq!(DataType::from(seen.dtype), DataType::FLOAT64);
    assert_eq!(seen.byte_offset, 0);
    // The first element's address: the storage offset (1 * 6 + 2 elements) applied.
    assert_eq!(seen.data as usize, x.data_ptr().unwrap() as usize + 8 * 8);
    let scalar = t.empty(&[], DataType::INT32, TorchDevice::CPU).unwrap();
    // SAFETY: as above.
    let s = unsafe { d.describe(scalar.as_raw()) }.expect("a 0-d tensor");
    assert!(s.ndim == 0 && s.shape.is_null() && s.strides.is_null());
    // Not described: a tensor on the meta device (the caller asks its other path).
    let meta = t.empty(&[3], DataType::FLOAT32, TorchDevice::META).unwrap();
    // SAFETY: as above.
    assert!(unsafe { d.describe(meta.as_raw()) }.is_none());
}

// --- Tensor? and Tensor[] arguments: decoded from torch's box and list, every handle freed once ---

dlbridge::xla_handler! {
    /// `out = x + sum(xs) (+ bias)`, float32 vectors.
    fn sum_plus_xla(call, operands: [tensor("x"), list("xs"), optional("bias")], results: 1) {
        let x = call.input::<f32, Rank<1>>(0, "x")?;
        let xs = call.input_list::<f32, Rank<1>>(1, "xs")?;
        let bias = call.optional_input::<f32, Rank<1>>(2, "bias")?;
        let mut out = call.output::<f32, Rank<1>>(0, "out")?;
        let mut o = out.as_slice_mut()?;
        o.copy_from_slice(&x.as_slice()?);
        for t in xs.iter().chain(bias.iter()) {
            for (o, v) in o.iter_mut().zip(t.as_slice()?.iter()) {
                *o += v;
            }
        }
        Ok(())
    }
}

struct SumPlus;
impl NativeOp for SumPlus {
    const OP: XlaOp = XlaOp {
        signature: OpSignature::new(
            "sum_plus",
            &[("x", ArgKind::Tensor), ("xs", ArgKind::TensorList), ("bias", ArgKind::OptTensor)],
            &[ArgKind::Tensor],
        )
        .with_defaults(&[("bias", "None")]),
        attrs: &[],
        out: Some(OutRule::Like(0)),
        handler: sum_plus_xla,
    };
}

static SUM_PLUS_FREED: AtomicUsize = AtomicUsize::new(0);

#[test]
fn optional_and_list_arguments_reach_the_handler_and_every_tensor_is_freed_once() {
    let Some(t) = setup() else { return };
    assert_eq!(
        SumPlus::OP.signature.schema().unwrap(),
        "sum_plus(Tensor x, Tensor[] xs, Tensor? bias=None) -> Tensor"
    );
    let call = |args: Vec<Value>| {
        // SAFETY: the arguments and results have the op's schema types.
        unsafe { t.call("dlbridge_test::sum_plus", "", args, &[ArgKind::Tensor]) }
    };
    let freed = &SUM_PLUS_FREED;
    let made = {
        let x = counted(t, &[3], freed); // 0 1 2
        let xs: Vec<Tensor> = (0..3).map(|_| counted(t, &[3], freed)).collect();
        let bias = counted(t, &[3], freed);
        let handles = |v: &[Tensor]| v.iter().map(|t| t.new_handle().unwrap()).collect::<Vec<_>>();
        // Three items and a bias; none and no bias; a list with an item of another dtype.
        let out = one(call(vec![
            Value::Tensor(x.new_handle().unwrap()),
            Value::TensorList(handles(&xs)),
            Value::OptTensor(Some(bias.new_handle().unwrap())),
        ])
        .unwrap());
        assert_eq!(f32s(&out), [0.0, 5.0, 10.0]);
        let out = one(call(vec![
            Value::Tensor(x.new_handle().unwrap()),
            Value::TensorList(vec![]),
            Value::OptTensor(None),
        ])
        .unwrap());
        assert_eq!(f32s(&out), [0.0, 1.0, 2.0]);
        let int = t.empty(&[3], DataType::INT32, TorchDevice::CPU).unwrap();
        let err = call(vec![
            Value::Tensor(x.new_handle().unwrap()),
            Value::TensorList(vec![xs[0].new_handle().unwrap(), int]),
            Value::OptTensor(Some(bias.new_handle().unwrap())),
        ])
        .unwrap_err();
        if t.has("torch_exception_get_what_without_backtrace") {
            assert!(err.to_string().contains("xs[1]: expected float32"), "{err}");
        }
        // The Meta kernel decodes them too.
        let m = t.empty(&[4], DataType::FLOAT32, TorchDevice::META).unwrap();
        let out = one(call(vec![
            Value::Tensor(m.new_handle().unwrap()),
            Value::TensorList(vec![m.new_handle().unwrap()]),
            Value::OptTensor(Some(m)),
        ])
        .unwrap());
        assert_eq!(out.sizes().unwrap(), vec![4]);
        5
    };
    // Every counted tensor's storage freed once: no handle leaked by the decoding.
    assert_eq!(freed.load(Ordering::SeqCst), made);
}

// --- The smallest frame (one operand written in place) and a list past the largest ---

dlbridge::xla_handler! {
    /// `x = -x` in place: result 0 is operand 0's memory.
    fn negate_inplace_xla(call, operands: 1, results: 1) {
        let mut x = call.output::<f32, Rank<2>>(0, "x")?;
        if call.input_any(0, "x")?.data_ptr().cast::<f32>() != x.as_mut_ptr() {
            return Err(dlbridge::xla::FfiError::invalid_argument("x: result 0 must alias operand 0"));
        }
        for v in x.as_slice_mut()?.iter_mut() {
            *v = -*v;
        }
        Ok(())
    }
}

struct NegateInPlace;
impl NativeOp for NegateInPlace {
    const OP: XlaOp = XlaOp {
        signature: OpSignature::new("negate_", &[("x", ArgKind::TensorMut)], &[]),
        attrs: &[],
        out: None,
        handler: negate_inplace_xla,
    };
}

#[test]
fn the_one_operand_frame_writes_a_strided_argument_back_and_reports_the_handlers_error() {
    let Some(t) = setup() else { return };
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        dlbridge::torch_stable::xla::register::<NegateInPlace>(t, NS).unwrap();
    });
    // A non-contiguous view written in place: the handler gets a contiguous copy (its result
    // aliasing it), copied back into the view; the rest of the base is untouched.
    let base = t.empty(&[2, 3], DataType::FLOAT32, TorchDevice::CPU).unwrap();
    // SAFETY: a fresh contiguous float32 CPU tensor of 6 elements, written before any read.
    unsafe {
        std::ptr::copy_nonoverlapping(
            [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].as_ptr(),
            base.data_ptr().unwrap().cast::<f32>(),
            6,
        )
    };
    let view = narrow(&base, 1, 0, 2);
    assert!(!view.is_contiguous().unwrap());
    let args = vec![Value::Tensor(view.new_handle().unwrap())];
    // SAFETY: the arguments and results have the op's schema types.
    assert!(unsafe { t.call("dlbridge_test::negate_", "", args, &[]) }.unwrap().is_empty());
    assert_eq!(f32s(&base), [-1.0, -2.0, 3.0, -4.0, -5.0, 6.0]);
    // A rank-1 tensor for a rank-2 handler: the handler's own error reaches the caller, nothing
    // written.
    let x = filled(t, &[1.0, -2.0]);
    let args = vec![Value::Tensor(x.new_handle().unwrap())];
    // SAFETY: as above.
    let e = unsafe { t.call("dlbridge_test::negate_", "", args, &[]) }.unwrap_err();
    if t.has("torch_exception_get_what_without_backtrace") {
        assert!(e.to_string().contains("x: expected writable float32 2-d"), "{e}");
    }
    assert_eq!(f32s(&x), [1.0, -2.0]);
}

#[test]
fn a_list_past_the_frame_is_refused_naming_it_and_every_tensor_is_freed_once() {
    let Some(t) = setup() else { return };
    static FREED: AtomicUsize = AtomicUsize::new(0);
    {
        let x = counted(t, &[3], &FREED);
        let xs: Vec<Tensor> = (0..17).map(|_| counted(t, &[3], &FREED)).collect();
        let args = vec![
            Value::Tensor(x.new_handle().unwrap()),
            Value::TensorList(xs.iter().map(|t| t.new_handle().unwrap()).collect()),
            Value::OptTensor(None),
        ];
        // SAFETY: the arguments and results have the op's schema types.
        let e = unsafe { t.call("dlbridge_test::sum_plus", "", args, &[ArgKind::Tensor]) }.unwrap_err();
        if t.has("torch_exception_get_what_without_backtrace") {
            assert!(e.to_string().contains("18 tensor operands (xs: a list of 17 tensors)"), "{e}");
        }
    }
    assert_eq!(FREED.load(Ordering::SeqCst), 18);
}

// --- An in-place op's copy-back is no torch op of its own ---

/// Writes `k` into element `k` (C order) of `x`.
fn iota<T: dlbridge::Element>(
    call: &dlbridge::xla::Call<'_>,
    of: impl Fn(usize) -> T,
) -> dlbridge::xla::Result<()> {
    let mut x = call.output::<T, dlbridge::spec::AnyShape>(0, "x")?;
    x.as_slice_mut()?.iter_mut().enumerate().for_each(|(k, v)| *v = of(k));
    Ok(())
}

dlbridge::xla_handler! {
    /// `x[k] = k` in place (C order), for elements of 1, 2, 4, 8 and 16 bytes, any shape: result
    /// 0 is operand 0's memory.
    fn iota_inplace_xla(call, operands: 1, results: 1) {
        match call.input_any(0, "x")?.dtype() {
            DataType::UINT8 => iota(call, |k| k as u8),
            DataType::INT16 => iota(call, |k| k as i16),
            DataType::FLOAT32 => iota(call, |k| k as f32),
            DataType::FLOAT64 => iota(call, |k| k as f64),
            _ => iota(call, |k| num_complex::Complex::new(k as f64, -(k as f64))),
        }
    }
}

struct IotaInPlace;
impl NativeOp for IotaInPlace {
    const OP: XlaOp = XlaOp {
        signature: OpSignature::new("iota_", &[("x", ArgKind::TensorMut)], &[]),
        attrs: &[],
        out: None,
        handler: iota_inplace_xla,
    };
}

/// Registers `dlbridge_test::iota_` once for every test that calls it.
fn register_iota(t: &'static Torch) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        dlbridge::torch_stable::xla::register::<IotaInPlace>(t, NS).unwrap();
    });
}

/// torch's own version counter of `x` (`aten::_version`), which a torch op writing `x` bumps.
fn torch_version(x: &Tensor) -> i64 {
    let t = x.torch();
    let args = vec![Value::Tensor(x.new_handle().unwrap())];
    // SAFETY: the arguments and results have the op's schema types.
    match unsafe { t.call("aten::_version", "", args, &[ArgKind::Int]) }.unwrap().as_slice() {
        [Value::Int(v)] => *v,
        other => panic!("aten::_version: {other:?}"),
    }
}

/// The bytes of a contiguous CPU tensor.
fn bytes(x: &Tensor) -> Vec<u8> {
    assert!(x.is_contiguous().unwrap());
    let dtype = x.dtype().unwrap();
    let n = x.numel().unwrap() as usize * usize::from(dtype.bits()) / 8;
    // SAFETY: a contiguous CPU tensor of n bytes, alive while `x` is.
    unsafe { std::slice::from_raw_parts(x.data_ptr().unwrap().cast::<u8>(), n) }.to_vec()
}

/// A `[2, 3, 4]` tensor of `dtype`, every byte 0xAB.
fn patterned(t: &'static Torch, dtype: DataType) -> Tensor {
    let x = t.empty(&[2, 3, 4], dtype, TorchDevice::CPU).unwrap();
    let n = 24 * usize::from(dtype.bits()) / 8;
    // SAFETY: a fresh contiguous CPU tensor of n bytes.
    unsafe { std::ptr::write_bytes(x.data_ptr().unwrap().cast::<u8>(), 0xAB, n) };
    x
}

/// `aten::transpose.int(x, d0, d1)`: a view whose last dimension is not the densest.
fn transpose(x: &Tensor, d0: i64, d1: i64) -> Tensor {
    let t = x.torch();
    let args = vec![Value::Tensor(x.new_handle().unwrap()), Value::Int(d0), Value::Int(d1)];
    // SAFETY: the arguments and results have the op's schema types.
    one(unsafe { t.call("aten::transpose", "int", args, &[ArgKind::Tensor]) }.unwrap())
}

#[test]
fn a_strided_in_place_argument_is_written_back_in_place_without_a_torch_op_bumping_its_version() {
    // torch's in-place ops bump a written tensor's version once; the kernel's version hook is
    // that once. Writing a non-contiguous argument back through `aten::copy_` bumped it again.
    let Some(t) = setup() else { return };
    register_iota(t);
    let iota = |x: &Tensor| {
        let args = vec![Value::Tensor(x.new_handle().unwrap())];
        // SAFETY: the arguments and results have the op's schema types.
        assert!(unsafe { t.call("dlbridge_test::iota_", "", args, &[]) }.unwrap().is_empty());
    };
    let widths =
        [DataType::UINT8, DataType::INT16, DataType::FLOAT32, DataType::FLOAT64, DataType::COMPLEX128];
    // [:, :, 1:3] (rows of 2 contiguous elements) and x.transpose(0, 2) (no contiguous row).
    type ViewOf = fn(&Tensor) -> Tensor;
    let views: [(&str, ViewOf); 2] =
        [("narrowed", |b| narrow(b, 2, 1, 2)), ("transposed", |b| transpose(b, 0, 2))];
    for dtype in widths {
        for (layout, view_of) in views {
            let (base, reference) = (patterned(t, dtype), patterned(t, dtype));
            let view = view_of(&base);
            assert!(!view.is_contiguous().unwrap());
            let before = torch_version(&base);
            iota(&view);
            // torch's counter untouched: no version hooks from Python in this process (the one
            // bump is theirs), and no torch op wrote the view.
            assert_eq!((torch_version(&view), torch_version(&base)), (before, before), "{dtype} {layout}");
            // What torch's own copy of the handler's values into the same view writes: the view's
            // elements, in C order, and nothing else.
            let values = t.empty(&view.sizes().unwrap(), dtype, TorchDevice::CPU).unwrap();
            iota(&values);
            let args = vec![Value::Tensor(view_of(&reference)), Value::Tensor(values), Value::Bool(false)];
            // SAFETY: the arguments and results have the op's schema types.
            unsafe { t.call("aten::copy_", "", args, &[ArgKind::Tensor]) }.unwrap();
            assert_eq!(bytes(&base), bytes(&reference), "{dtype} {layout}");
            // The contiguous base, written where it is: untouched too.
            iota(&base);
            assert_eq!(torch_version(&base), before, "{dtype} {layout}");
        }
    }
}

/// `dtype`'s elements in C order, read through torch (`aten::contiguous`'s copy).
fn values(t: &'static Torch, x: &Tensor) -> Vec<u8> {
    bytes(&t.contiguous(x).unwrap())
}

#[test]
fn a_written_argument_with_a_huge_stride_on_an_extent_of_one_is_written_back_as_torch_copies() {
    // torch lets a dimension of extent 1 have any stride (as_strided, empty_strided: it is never
    // applied). The strided copy-back multiplied each stride by the element width and stepped
    // through it, an overflow for 2^62: a build with overflow checks failed the call after the
    // handler had run ("attempt to multiply with overflow"), one without relied on wrapping.
    let Some(t) = setup() else { return };
    register_iota(t);
    let iota = |x: &Tensor| {
        let args = vec![Value::Tensor(x.new_handle().unwrap())];
        // SAFETY: the arguments and results have the op's schema types.
        unsafe { t.call("dlbridge_test::iota_", "", args, &[]) }.map(|r| assert!(r.is_empty()))
    };
    let widths =
        [DataType::UINT8, DataType::INT16, DataType::FLOAT32, DataType::FLOAT64, DataType::COMPLEX128];
    // An outer dimension of extent 1 with the huge stride, and the last one (no contiguous row).
    let huge = 1i64 << 62;
    let layouts: [(&[i64], &[i64]); 2] = [(&[2, 1, 3], &[6, huge, 2]), (&[3, 2, 1], &[1, 3, huge])];
    for dtype in widths {
        for (sizes, strides) in layouts {
            let w = usize::from(dtype.bits()) / 8;
            // The storage the extents reach: (extent - 1) * stride + 1 elements.
            let n = sizes.iter().zip(strides).map(|(&e, &s)| (e - 1) * s).sum::<i64>() as usize + 1;
            let make = || {
                let x = t.empty_strided(sizes, strides, dtype, TorchDevice::CPU).unwrap();
                // SAFETY: a fresh CPU tensor whose storage holds the n elements its extents reach.
                unsafe { std::ptr::write_bytes(x.data_ptr().unwrap().cast::<u8>(), 0xAB, n * w) };
                x
            };
            let (x, reference) = (make(), make());
            assert!(!x.is_contiguous().unwrap());
            iota(&x).unwrap_or_else(|e| panic!("{dtype} {sizes:?} {strides:?}: {e}"));
            let expected = t.empty(sizes, dtype, TorchDevice::CPU).unwrap();
            iota(&expected).unwrap();
            let args = vec![
                Value::Tensor(reference.new_handle().unwrap()),
                Value::Tensor(expected),
                Value::Bool(false),
            ];
            // SAFETY: the arguments and results have the op's schema types.
            unsafe { t.call("aten::copy_", "", args, &[ArgKind::Tensor]) }.unwrap();
            assert_eq!(values(t, &x), values(t, &reference), "{dtype} {sizes:?} {strides:?}");
            // Every byte of the storage, the ones between the view's elements included.
            // SAFETY: both storages hold n elements (made above), alive while x and reference are.
            let storage = |x: &Tensor| unsafe {
                std::slice::from_raw_parts(x.data_ptr().unwrap().cast::<u8>(), n * w).to_vec()
            };
            assert_eq!(storage(&x), storage(&reference), "{dtype} {sizes:?} {strides:?}");
        }
    }
}

// --- An op torch could never dispatch ---

dlbridge::xla_handler! {
    /// Makes nothing of its one attribute (what a no-tensor op's handler would be).
    fn no_tensor_xla(call, operands: 0, results: 1, attrs: ["n"]) {
        let _n: i64 = call.attr("n")?;
        Ok(())
    }
}

fn n_floats(
    _: &[dlbridge::torch_stable::xla::TensorInfo],
    args: &Args,
) -> Result<Vec<dlbridge::torch_stable::xla::TensorInfo>, KernelError> {
    Ok(vec![dlbridge::torch_stable::xla::TensorInfo { dtype: DataType::FLOAT32, shape: vec![args.int(0)?] }])
}

struct NoTensor;
impl NativeOp for NoTensor {
    const OP: XlaOp = XlaOp {
        signature: OpSignature::new("no_tensor", &[("n", ArgKind::Int)], &[ArgKind::Tensor]),
        attrs: &[("n", AttrType::I64)],
        out: Some(OutRule::Fn(n_floats)),
        handler: no_tensor_xla,
    };
}

#[test]
fn an_op_without_a_tensor_argument_is_refused_at_registration_and_nothing_is_defined() {
    // torch's dispatcher picks a kernel by the tensor arguments' keys: such an op registered, and
    // every call failed ("There were no tensor arguments to this function").
    let Some(t) = setup() else { return };
    let refused = |e: Error| {
        assert!(
            matches!(&e, Error::Invalid(m) if m.starts_with("no_tensor")
                && m.contains(r#"args [("n", Int)] has no tensor argument"#)),
            "{e}"
        );
        assert!(e.is_unsupported(), "dlbridge.kernels keeps the Python op for it");
    };
    refused(NoTensor::OP.validate().unwrap_err());
    refused(dlbridge::torch_stable::xla::register::<NoTensor>(t, NS).unwrap_err());
    let op = XlaOp::leak(
        "no_tensor",
        &[("n", ArgKind::Int)],
        &[ArgKind::Tensor],
        &[("n", AttrType::I64)],
        Some(OutRule::Fn(n_floats)),
        no_tensor_xla,
    );
    refused(dlbridge::torch_stable::xla::register_op(t, NS, op).unwrap_err());
    // Nothing was defined: the name is still free, and no call reaches a kernel.
    // SAFETY: the arguments and results have the (would-be) op's schema types.
    let e = unsafe { t.call("dlbridge_test::no_tensor", "", vec![Value::Int(3)], &[ArgKind::Tensor]) }
        .unwrap_err();
    if t.has("torch_exception_get_what_without_backtrace") {
        assert!(e.to_string().contains("Could not find schema for dlbridge_test::no_tensor"), "{e}");
    }
    // An op whose only tensors are optional or listed is dispatched by them when given: kept.
    let listed = XlaOp {
        signature: OpSignature::new("listed_only", &[("xs", ArgKind::TensorList)], &[]),
        attrs: &[],
        out: None,
        handler: no_tensor_xla,
    };
    listed.validate().unwrap();
}
