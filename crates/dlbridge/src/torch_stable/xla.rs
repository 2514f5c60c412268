//! The adapter: a kernel's XLA FFI handler (the body `jax.jit` runs, [`crate::xla_handler!`],
//! `KernelDef.ffi`) run as a torch op's CPU kernel, so one body serves both.
//!
//! The handler's one view of typed buffers and attributes is [`crate::xla::Call`]. For torch,
//! [`run_xla`] turns the boxed stack into the call frame XLA would have made: each tensor
//! argument (made C-contiguous when it is not: XLA buffers are dense row-major) becomes an
//! operand `XLA_FFI_Buffer`, each scalar argument an attribute of the type the handler reads
//! ([`AttrType`]: a schema `float` passed as an `f32` scalar when the handler reads `f32`), and
//! each result a buffer torch allocated (`aoti_torch_empty_strided`) from the op's output rule
//! ([`OutRule`]). A tensor the op writes in place (`Tensor(a!)`) is both an operand and a result
//! over the same memory, as XLA's `input_output_aliases` pass it (copied back when it was not
//! contiguous). The handler then runs unchanged, with every check it makes under `jax.jit`, and
//! its error becomes the op's `RuntimeError`. The frame's API table is dlbridge's own: it makes,
//! reads and frees errors, gives the CPU stream (NULL), registers types, and keeps a handler's
//! state (`xla_handler!`'s `state:`): made by the handler's instantiate stage, run at the first
//! call that asks for it, and kept for the process. It lends no thread pool (a handler's
//! parallel loop runs on the calling thread) and no allocator (a handler's scratch is a Rust
//! allocation anyway).
//!
//! The Meta kernel ([`meta_kernel`]) is the same output rule on the meta device: fake tensors and
//! `torch.compile` need no Python.

use std::cell::Cell;
use std::ffi::{CStr, CString, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use super::kernel::{Args, KernelError, Outputs, Value, run_boxed};
use super::library::Library;
use super::signature::{ArgKind, OpSignature};
use super::sys::{BoxedKernel, StableIValue};
use super::{Error, Result, Tensor, Torch, TorchDevice};
use crate::DataType;
use crate::xla_ffi::*;

/// The type an XLA handler reads an attribute as ([`crate::xla::Call::attr`]); the torch schema
/// type follows (`float`, `int`, `bool`, `str`, `int[]`, `float[]`, `bool[]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttrType {
    /// An `f32` scalar (schema `float`, rounded).
    F32,
    /// An `f64` scalar (schema `float`).
    F64,
    /// An `i32` scalar (schema `int`, range-checked).
    I32,
    /// An `i64` scalar (schema `int`).
    I64,
    /// A `bool` scalar.
    Bool,
    /// A string.
    Str,
    /// An array of `i64` (schema `int[]`).
    I64s,
    /// An array of `i32` (schema `int[]`, each element range-checked).
    I32s,
    /// An array of `f32` (schema `float[]`, rounded).
    F32s,
    /// An array of `f64` (schema `float[]`).
    F64s,
    /// An array of `bool` (schema `bool[]`).
    Bools,
}

impl AttrType {
    /// The type a `KernelDef.attrs` name says (`"float32"`, `"float64"`, `"int32"`, `"int64"`,
    /// `"bool"`, `"str"`, `"int64[]"`, `"int32[]"`, `"float32[]"`, `"float64[]"`, `"bool[]"`),
    /// `None` for another.
    pub fn from_numpy_name(name: &str) -> Option<Self> {
        Some(match name {
            "float32" => Self::F32,
            "float64" => Self::F64,
            "int32" => Self::I32,
            "int64" => Self::I64,
            "bool" => Self::Bool,
            "str" => Self::Str,
            "int64[]" => Self::I64s,
            "int32[]" => Self::I32s,
            "float32[]" => Self::F32s,
            "float64[]" => Self::F64s,
            "bool[]" => Self::Bools,
            _ => return None,
        })
    }

    /// The schema argument kind carrying it.
    pub fn arg_kind(self) -> ArgKind {
        match self {
            Self::F32 | Self::F64 => ArgKind::Float,
            Self::I32 | Self::I64 => ArgKind::Int,
            Self::Bool => ArgKind::Bool,
            Self::Str => ArgKind::Str,
            Self::I64s | Self::I32s => ArgKind::IntList,
            Self::F32s | Self::F64s => ArgKind::FloatList,
            Self::Bools => ArgKind::BoolList,
        }
    }
}

/// The shape and element type of a tensor, as an output rule sees and makes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The element type.
    pub dtype: DataType,
    /// The extents.
    pub shape: Vec<i64>,
}

/// An output rule with a context, made at run time (e.g. from a kernel's declared results) and
/// kept for the process.
pub type DynOutRule = dyn Fn(&[TensorInfo], &Args) -> Result<Vec<TensorInfo>, KernelError> + Send + Sync;

/// How an op's fresh results are shaped (the same rule makes the CPU kernel's result buffers and
/// the Meta kernel's outputs).
#[derive(Clone, Copy)]
pub enum OutRule {
    /// Like tensor argument `i` of the signature (its shape and dtype): `KernelDef.out = Some("x")`.
    Like(usize),
    /// Computed from the tensor arguments (in order) and the op's arguments.
    Fn(fn(&[TensorInfo], &Args) -> Result<Vec<TensorInfo>, KernelError>),
    /// As `Fn`, a closure (`KernelDef.results`: each result's rule).
    Dyn(&'static DynOutRule),
}

impl std::fmt::Debug for OutRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Like(i) => f.debug_tuple("Like").field(i).finish(),
            Self::Fn(p) => f.debug_tuple("Fn").field(p).finish(),
            Self::Dyn(_) => f.write_str("Dyn(..)"),
        }
    }
}

/// An op whose CPU kernel is an XLA FFI handler.
///
/// Operands are the signature's tensor arguments in order, attributes its scalar arguments by
/// name, results the fresh outputs of `out` (the signature's `Tensor` results) followed by the
/// `Tensor(a!)` arguments, aliased, in order.
#[derive(Debug, Clone, Copy)]
pub struct XlaOp {
    /// The op's name, arguments and results.
    pub signature: OpSignature,
    /// The type the handler reads each scalar argument as (by name; every scalar argument once).
    pub attrs: &'static [(&'static str, AttrType)],
    /// The rule for the fresh results (`None`: the op only writes its `Tensor(a!)` arguments).
    pub out: Option<OutRule>,
    /// The handler.
    pub handler: XLA_FFI_Handler,
}

impl XlaOp {
    /// An op made at run time, for [`register_op`]: its names are leaked, once per op, for the
    /// process (see [`OpSignature::leak`]).
    pub fn leak(
        name: &str,
        args: &[(&str, ArgKind)],
        rets: &[ArgKind],
        attrs: &[(&str, AttrType)],
        out: Option<OutRule>,
        handler: XLA_FFI_Handler,
    ) -> Self {
        let attrs: Vec<(&'static str, AttrType)> =
            attrs.iter().map(|&(n, t)| (super::signature::keep_str(n), t)).collect();
        Self {
            signature: OpSignature::leak(name, args, rets),
            attrs: super::signature::keep(attrs.into_boxed_slice()),
            out,
            handler,
        }
    }

    /// Checks that the parts agree: the op has a tensor argument (torch's dispatcher picks a
    /// kernel by its tensors: with none, every call fails), every scalar argument has its
    /// attribute type (of the same schema kind), every result is a tensor the rule makes, and
    /// `Like` names a tensor argument.
    pub fn validate(&self) -> Result<()> {
        let sig = &self.signature;
        let bad = |m: String| Err(Error::Invalid(format!("{}: {m}", sig.name())));
        if !sig.args().iter().any(|(_, k)| {
            matches!(k, ArgKind::Tensor | ArgKind::TensorMut | ArgKind::OptTensor | ArgKind::TensorList)
        }) {
            return bad(format!(
                "args {:?} has no tensor argument: torch's dispatcher picks an op's kernel by its \
                 tensor arguments, so every call of it would fail (give it a Tensor argument)",
                sig.args()
            ));
        }
        for &(name, kind) in sig.args() {
            if matches!(kind, ArgKind::Tensor | ArgKind::TensorMut | ArgKind::OptTensor | ArgKind::TensorList)
            {
                continue;
            }
            match self.attrs.iter().find(|(n, _)| *n == name) {
                Some(&(_, t)) if t.arg_kind() == kind => {}
                Some(&(_, t)) => {
                    return bad(format!("argument {name} is {kind:?} but its attribute type {t:?}"));
                }
                None => return bad(format!("argument {name} has no attribute type")),
            }
        }
        if let Some((name, _)) = self.attrs.iter().find(|(n, _)| !sig.args().iter().any(|(a, _)| a == n)) {
            return bad(format!("attribute {name} is not an argument"));
        }
        let tensors =
            sig.args().iter().filter(|(_, k)| matches!(k, ArgKind::Tensor | ArgKind::TensorMut)).count();
        let mutated = sig.args().iter().filter(|(_, k)| *k == ArgKind::TensorMut).count();
        // Optional and list arguments: operands, and a count attribute each.
        let counted =
            sig.args().iter().filter(|(_, k)| matches!(k, ArgKind::OptTensor | ArgKind::TensorList)).count();
        let scalars = sig.args().len() - tensors - counted;
        if tensors + counted > MAX_FRAME_ITEMS
            || scalars + counted > MAX_FRAME_ITEMS
            || sig.rets().len() + mutated > MAX_FRAME_ITEMS
        {
            return bad(format!(
                "{tensors} tensor arguments, {scalars} scalar arguments, {} results (at most {MAX_FRAME_ITEMS} each)",
                sig.rets().len() + mutated
            ));
        }
        if sig.rets().iter().any(|&k| k != ArgKind::Tensor) {
            return bad("results must be tensors".into());
        }
        match (self.out, sig.rets().len()) {
            (None, 0) => {}
            (None, n) => return bad(format!("{n} results but no output rule")),
            (Some(OutRule::Like(i)), 1) => {
                if !matches!(sig.args().get(i), Some((_, ArgKind::Tensor | ArgKind::TensorMut))) {
                    return bad(format!("the output rule names argument {i}, not a tensor"));
                }
            }
            (Some(OutRule::Like(_)), n) => {
                return bad(format!("a Like rule makes 1 result, the signature has {n}"));
            }
            (Some(OutRule::Fn(_) | OutRule::Dyn(_)), _) => {}
        }
        Ok(())
    }
}

/// An [`XlaOp`] known at compile time: its kernels are [`cpu_kernel::<Self>`](cpu_kernel) and
/// [`meta_kernel::<Self>`](meta_kernel) (a boxed kernel has no context pointer, so each op is
/// its own function).
pub trait NativeOp: 'static {
    /// The op.
    const OP: XlaOp;
}

/// The boxed CPU kernel of `O`: [`run_xla`].
///
/// # Safety
///
/// Torch's boxed-kernel contract for an op of schema `O::OP.signature.schema()` ([`run_boxed`]).
pub unsafe extern "C-unwind" fn cpu_kernel<O: NativeOp>(
    stack: *mut StableIValue,
    num_args: u64,
    num_outputs: u64,
) {
    // SAFETY: the caller's contract.
    unsafe { run_xla(&O::OP, stack, num_args, num_outputs) }
}

/// The boxed Meta kernel of `O`: [`run_meta`].
///
/// # Safety
///
/// As [`cpu_kernel`].
pub unsafe extern "C-unwind" fn meta_kernel<O: NativeOp>(
    stack: *mut StableIValue,
    num_args: u64,
    num_outputs: u64,
) {
    // SAFETY: the caller's contract.
    unsafe { run_meta(&O::OP, stack, num_args, num_outputs) }
}

/// Runs `op`'s output rule over torch's boxed stack on the meta device (its Meta kernel): fake
/// tensors and `torch.compile` get the outputs' shapes and dtypes without Python.
///
/// # Safety
///
/// Torch's boxed-kernel contract for an op of schema `op.signature.schema()` ([`run_boxed`]).
pub unsafe fn run_meta(op: &XlaOp, stack: *mut StableIValue, num_args: u64, num_outputs: u64) {
    // SAFETY: the caller's contract.
    unsafe {
        run_boxed(stack, num_args, num_outputs, &op.signature, |args, outs| {
            let infos = tensor_infos(op, args)?;
            for (i, info) in output_infos(op, &infos, args)?.into_iter().enumerate() {
                let t = args_torch(args)?.empty(&info.shape, info.dtype, TorchDevice::META)?;
                outs.set(i, Value::Tensor(t))?;
            }
            Ok(())
        })
    }
}

/// What decoding the op's `Tensor?` and `Tensor[]` arguments needs of this torch (its functions
/// to free an optional's box and to read and free a list): [`Error::Missing`] without them, so
/// the op is not defined rather than leak or fail at every call.
fn needs_for_args(torch: &'static Torch, sig: &OpSignature) -> Result<()> {
    let kinds = || sig.args().iter().map(|&(_, k)| k);
    let missing = |symbol| Err(Error::Missing { symbol, torch: torch.version() });
    if kinds().any(|k| k == ArgKind::OptTensor)
        && !torch.has("torch_delete_stable_ivalue")
        && !torch.has("_ZdlPv")
    {
        return missing("torch_delete_stable_ivalue");
    }
    if kinds().any(|k| k == ArgKind::TensorList) {
        for f in ["torch_list_size", "torch_list_get_item", "torch_delete_list"] {
            if !torch.has(f) {
                return missing(f);
            }
        }
    }
    Ok(())
}

/// Defines `O`'s op in namespace `ns` and registers its CPU and Meta kernels. The libraries are
/// kept for the process.
pub fn register<O: NativeOp>(torch: &'static Torch, ns: &str) -> Result<()> {
    O::OP.validate()?;
    needs_for_args(torch, &O::OP.signature)?;
    let name = O::OP.signature.name();
    Library::fragment(torch, ns)?.define(&O::OP.signature)?;
    // SAFETY: the op was just defined from O's signature (a definition by anyone else would
    // have made define() fail), which is what both kernels decode the stack with.
    unsafe {
        Library::implementation(torch, ns, "CPU")?.register(name, cpu_kernel::<O>)?;
        Library::implementation(torch, ns, "Meta")?.register(name, meta_kernel::<O>)
    }
}

/// How many ops [`register_op`] can register in one process.
pub const RUNTIME_SLOTS: usize = 256;

/// The ops [`register_op`] registered, by slot: slot `I`'s kernels are `slot_cpu::<I>` and
/// `slot_meta::<I>` (a boxed kernel has no context pointer, so each slot is its own function).
static SLOTS: [OnceLock<XlaOp>; RUNTIME_SLOTS] = [const { OnceLock::new() }; RUNTIME_SLOTS];
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

/// The op in slot `I` (set before its kernels were registered, never changed).
#[inline]
fn slot(i: usize) -> &'static XlaOp {
    match SLOTS[i].get() {
        Some(op) => op,
        None => {
            // Unreachable: a slot's kernels are registered only after the slot is set.
            eprintln!("dlbridge: a torch_stable runtime slot ran before it was set");
            std::process::abort()
        }
    }
}

unsafe extern "C-unwind" fn slot_cpu<const I: usize>(
    stack: *mut StableIValue,
    num_args: u64,
    num_outputs: u64,
) {
    // SAFETY: torch calls the kernel registered for slot I's op, defined from its signature.
    unsafe { run_xla(slot(I), stack, num_args, num_outputs) }
}

unsafe extern "C-unwind" fn slot_meta<const I: usize>(
    stack: *mut StableIValue,
    num_args: u64,
    num_outputs: u64,
) {
    // SAFETY: as slot_cpu.
    unsafe { run_meta(slot(I), stack, num_args, num_outputs) }
}

macro_rules! slot_table {
    ($f:ident; $($i:literal)*) => { [$($f::<$i> as BoxedKernel),*] };
}
macro_rules! slots {
    ($f:ident) => {
        slot_table!($f;
            0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
            32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63
            64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 91 92 93 94 95
            96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114 115 116 117 118 119 120 121 122 123 124 125 126 127
            128 129 130 131 132 133 134 135 136 137 138 139 140 141 142 143 144 145 146 147 148 149 150 151 152 153 154 155 156 157 158 159
            160 161 162 163 164 165 166 167 168 169 170 171 172 173 174 175 176 177 178 179 180 181 182 183 184 185 186 187 188 189 190 191
            192 193 194 195 196 197 198 199 200 201 202 203 204 205 206 207 208 209 210 211 212 213 214 215 216 217 218 219 220 221 222 223
            224 225 226 227 228 229 230 231 232 233 234 235 236 237 238 239 240 241 242 243 244 245 246 247 248 249 250 251 252 253 254 255)
    };
}
static SLOT_CPU: [BoxedKernel; RUNTIME_SLOTS] = slots!(slot_cpu);
static SLOT_META: [BoxedKernel; RUNTIME_SLOTS] = slots!(slot_meta);

/// [`register`] for an op made at run time (e.g. from a kernel declared when an extension module
/// initialises: its names leaked to `'static`, see [`OpSignature::leak`]): defines it in
/// namespace `ns` and registers its CPU and Meta kernels through one of [`RUNTIME_SLOTS`]
/// per-process slots. [`Error::Invalid`] once they are used up, or for an op that does not
/// [`validate`](XlaOp::validate). A slot stays taken if torch then refuses the op.
pub fn register_op(torch: &'static Torch, ns: &str, op: XlaOp) -> Result<()> {
    op.validate()?;
    needs_for_args(torch, &op.signature)?;
    let i = NEXT_SLOT.fetch_add(1, Ordering::Relaxed);
    if i >= RUNTIME_SLOTS {
        return Err(Error::Invalid(format!(
            "{}: every one of the {RUNTIME_SLOTS} runtime op slots is taken",
            op.signature.name()
        )));
    }
    let op = SLOTS[i].get_or_init(|| op);
    let name = op.signature.name();
    Library::fragment(torch, ns)?.define(&op.signature)?;
    // SAFETY: the op was just defined from slot i's signature (a definition by anyone else would
    // have made define() fail), which is what slot i's kernels decode the stack with.
    unsafe {
        Library::implementation(torch, ns, "CPU")?.register(name, SLOT_CPU[i])?;
        Library::implementation(torch, ns, "Meta")?.register(name, SLOT_META[i])
    }
}

fn args_torch(args: &Args) -> Result<&'static Torch, KernelError> {
    let _ = args;
    Torch::get().ok_or_else(|| KernelError("torch is not loaded".into()))
}

/// The tensor arguments' shapes and dtypes, in order.
fn tensor_infos(op: &XlaOp, args: &Args) -> Result<Vec<TensorInfo>, KernelError> {
    let mut v = Vec::new();
    for (i, &(_, kind)) in op.signature.args().iter().enumerate() {
        if matches!(kind, ArgKind::Tensor | ArgKind::TensorMut) {
            let t = args.tensor(i)?;
            v.push(TensorInfo { dtype: t.dtype()?, shape: t.sizes()? });
        }
    }
    Ok(v)
}

fn output_infos(op: &XlaOp, infos: &[TensorInfo], args: &Args) -> Result<Vec<TensorInfo>, KernelError> {
    match op.out {
        None => Ok(Vec::new()),
        Some(OutRule::Like(i)) => {
            // Argument i is a tensor (validate): its place among the tensors.
            let k = op.signature.args()[..i]
                .iter()
                .filter(|(_, k)| matches!(k, ArgKind::Tensor | ArgKind::TensorMut))
                .count();
            Ok(vec![infos[k].clone()])
        }
        Some(OutRule::Fn(_) | OutRule::Dyn(_)) => {
            let v = match op.out {
                Some(OutRule::Fn(f)) => f(infos, args)?,
                Some(OutRule::Dyn(f)) => f(infos, args)?,
                _ => unreachable!("matched just above"),
            };
            if v.len() != op.signature.rets().len() {
                return Err(KernelError(format!(
                    "the output rule made {} results, the op returns {}",
                    v.len(),
                    op.signature.rets().len()
                )));
            }
            Ok(v)
        }
    }
}

/// The XLA element type of `dtype` (`None`: XLA has none dlbridge maps).
fn xla_dtype(dtype: DataType) -> Option<XLA_FFI_DataType> {
    Some(match dtype {
        DataType::BOOL => XLA_FFI_DataType::PRED,
        DataType::INT8 => XLA_FFI_DataType::S8,
        DataType::INT16 => XLA_FFI_DataType::S16,
        DataType::INT32 => XLA_FFI_DataType::S32,
        DataType::INT64 => XLA_FFI_DataType::S64,
        DataType::UINT8 => XLA_FFI_DataType::U8,
        DataType::UINT16 => XLA_FFI_DataType::U16,
        DataType::UINT32 => XLA_FFI_DataType::U32,
        DataType::UINT64 => XLA_FFI_DataType::U64,
        DataType::FLOAT16 => XLA_FFI_DataType::F16,
        DataType::FLOAT32 => XLA_FFI_DataType::F32,
        DataType::FLOAT64 => XLA_FFI_DataType::F64,
        DataType::BFLOAT16 => XLA_FFI_DataType::BF16,
        DataType::COMPLEX64 => XLA_FFI_DataType::C64,
        DataType::COMPLEX128 => XLA_FFI_DataType::C128,
        _ => return None,
    })
}

/// The most tensor arguments, scalar arguments and results an [`XlaOp`] may have (the frame is
/// built on the stack, without allocating).
pub const MAX_FRAME_ITEMS: usize = 16;

/// A tensor argument as the handler sees it: the argument itself when it is C-contiguous, else
/// a contiguous copy (copied back into the argument after the call when the op writes it).
enum Operand<'a> {
    Borrowed(&'a Tensor),
    Copied { tensor: Tensor, copy_back_into: Option<usize> },
}

impl Operand<'_> {
    fn tensor(&self) -> &Tensor {
        match self {
            Self::Borrowed(t) => t,
            Self::Copied { tensor, .. } => tensor,
        }
    }
}

const NO_BUFFER: XLA_FFI_Buffer = XLA_FFI_Buffer {
    struct_size: XLA_FFI_Buffer_STRUCT_SIZE,
    extension_start: null_mut(),
    dtype: XLA_FFI_DataType::INVALID,
    data: null_mut(),
    rank: 0,
    dims: null_mut(),
};
const NO_SPAN: XLA_FFI_ByteSpan = XLA_FFI_ByteSpan { ptr: std::ptr::null(), len: 0 };
const NO_ARRAY: XLA_FFI_Array = XLA_FFI_Array { dtype: XLA_FFI_DataType::INVALID, size: 0, data: null_mut() };

/// Runs `op.handler` over torch's boxed stack (see [the module](self)).
///
/// # Safety
///
/// Torch's boxed-kernel contract for an op of schema `op.signature.schema()` ([`run_boxed`]).
pub unsafe fn run_xla(op: &XlaOp, stack: *mut StableIValue, num_args: u64, num_outputs: u64) {
    // SAFETY: the caller's contract.
    unsafe {
        run_boxed(stack, num_args, num_outputs, &op.signature, |args, outs| call_handler(op, args, outs))
    }
}

#[cold]
fn too_many(what: &str, n: usize) -> KernelError {
    // (run_boxed's error names the op: this one names what overflowed.)
    KernelError(format!("{n} {what} (at most {MAX_FRAME_ITEMS})"))
}

/// The XLA buffer over `data`: `dims` extents of `dtype`, C-contiguous host memory.
fn buffer(
    data: *mut c_void,
    dtype: DataType,
    dims: &[i64],
    what: &str,
) -> Result<XLA_FFI_Buffer, KernelError> {
    let x =
        xla_dtype(dtype).ok_or_else(|| KernelError(format!("{what}: {dtype} has no XLA element type")))?;
    Ok(XLA_FFI_Buffer {
        struct_size: XLA_FFI_Buffer_STRUCT_SIZE,
        extension_start: null_mut(),
        dtype: x,
        data,
        rank: dims.len() as i64,
        dims: dims.as_ptr().cast_mut(),
    })
}

/// The frame's capacity for an op of at most this many tensor arguments, scalar arguments and
/// results: the usual op fills a quarter of the stack [`MAX_FRAME_ITEMS`] would.
const SMALL_FRAME_ITEMS: usize = 4;

fn call_handler(op: &XlaOp, args: &Args, outs: &mut Outputs) -> Result<(), KernelError> {
    let sig = &op.signature;
    // The frame's operands (a tensor each, an optional one when given, each item of a list),
    // attributes (each scalar, and the count of each optional or list argument) and results:
    // the signature's own counts unless optional or list arguments make them depend on the call.
    let c = sig.arg_counts();
    let (operands, scalars, mutated) =
        if c.counted == 0 { (c.tensors, c.scalars, c.mutated) } else { frame_counts(sig, args)? };
    if operands > MAX_FRAME_ITEMS {
        return Err(too_many_items(sig, args, operands));
    }
    // One body, four capacities (validate() bounds the signature's counts by MAX_FRAME_ITEMS, and
    // the body refuses a list past it; the fresh results are at most the signature's results).
    // An op without attributes (the usual tensor-in, tensor-out op) builds no attribute arrays.
    const S: usize = SMALL_FRAME_ITEMS;
    if operands <= 1 && sig.rets().len() + mutated <= 1 && scalars == 0 {
        // The commonest op of all (one tensor in, one out, or one written in place).
        return call_handler_in::<1, 0>(op, args, outs);
    }
    if operands <= S && sig.rets().len() + mutated <= S {
        if scalars == 0 {
            return call_handler_in::<S, 0>(op, args, outs);
        }
        if scalars <= S {
            return call_handler_in::<S, S>(op, args, outs);
        }
    }
    call_handler_in::<MAX_FRAME_ITEMS, MAX_FRAME_ITEMS>(op, args, outs)
}

/// Only lists make more operands than the signature's tensors (validate()): names them.
#[cold]
#[inline(never)]
fn too_many_items(sig: &OpSignature, args: &Args, operands: usize) -> KernelError {
    let mut lists = Vec::new();
    for (i, &(name, kind)) in sig.args().iter().enumerate() {
        if let (ArgKind::TensorList, Ok(items)) = (kind, args.tensor_list(i)) {
            lists.push(format!("{name}: a list of {} tensors", items.len()));
        }
    }
    KernelError(format!(
        "{operands} tensor operands ({}), but the native op's frame holds at most {MAX_FRAME_ITEMS}: \
         pass fewer items",
        lists.join(", ")
    ))
}

/// The frame's operands, attributes and written arguments for this call of an op with optional
/// or list arguments.
#[inline(never)]
fn frame_counts(sig: &OpSignature, args: &Args) -> Result<(usize, usize, usize), KernelError> {
    let (mut operands, mut scalars, mut mutated) = (0, 0, 0);
    for (i, &(_, kind)) in sig.args().iter().enumerate() {
        match kind {
            ArgKind::Tensor => operands += 1,
            ArgKind::TensorMut => (operands, mutated) = (operands + 1, mutated + 1),
            ArgKind::OptTensor => {
                (operands, scalars) = (operands + args.opt_tensor(i)?.is_some() as usize, scalars + 1)
            }
            ArgKind::TensorList => (operands, scalars) = (operands + args.tensor_list(i)?.len(), scalars + 1),
            _ => scalars += 1,
        }
    }
    Ok((operands, scalars, mutated))
}

/// [`call_handler`] with a frame of `N` operands and results and `A` attributes, on the stack
/// (each capacity its own function: inlined together, the small frame would be as large as the
/// largest).
#[inline(never)]
fn call_handler_in<const N: usize, const A: usize>(
    op: &XlaOp,
    args: &Args,
    outs: &mut Outputs,
) -> Result<(), KernelError> {
    let torch = args_torch(args)?;
    let sig = &op.signature;
    // Operands: every tensor argument, C-contiguous on the CPU (an optional one when given, each
    // item of a list), in order.
    let mut operands: [Option<Operand<'_>>; N] = std::array::from_fn(|_| None);
    let mut dtypes = [DataType::BOOL; N];
    let mut names: [&str; N] = [""; N];
    let mut aliased = [0usize; N]; // operand index of each Tensor(a!) argument
    let mut plain = [0usize; N]; // operand index of each Tensor or Tensor(a!) argument
    let (mut n_ops, mut n_aliased, mut n_plain) = (0, 0, 0);
    // What only some ops need, made at first use (an op of plain tensors and scalars drops a
    // `None`, nothing else): the count attribute of each optional or list argument, and the
    // int32/float32 narrowings of array attributes.
    let mut extras: Option<Box<Extras>> = None;
    let hooks = super::version_hooks();
    for (i, &(name, kind)) in sig.args().iter().enumerate() {
        let tensors: &[Tensor] = match kind {
            ArgKind::Tensor | ArgKind::TensorMut => std::slice::from_ref(args.tensor(i)?),
            ArgKind::OptTensor => {
                let t = args.opt_tensor(i)?;
                push_count(&mut extras, name, usize::from(t.is_some()));
                t.map_or(&[], std::slice::from_ref)
            }
            ArgKind::TensorList => {
                let ts = args.tensor_list(i)?;
                push_count(&mut extras, name, ts.len());
                ts
            }
            _ => continue,
        };
        for t in tensors {
            if n_ops == N {
                return Err(too_many("tensor operands", n_ops + 1));
            }
            let device = t.device_kind()?;
            if device != super::DeviceKind::Cpu {
                return Err(not_on_cpu(name, device));
            }
            // A tensor that requires grad in grad mode: only an op without an autograd formula
            // gets here so (a registered formula runs the op with grad mode off), where the
            // result, or the written argument, would silently carry no gradient.
            if let Some(hooks) = hooks {
                // SAFETY: a live handle of a defined tensor (its device was read above).
                if unsafe { (hooks.untracked_grad)(t.as_raw()) } {
                    return Err(untracked_grad(name));
                }
            }
            let operand =
                if t.is_contiguous()? { Operand::Borrowed(t) } else { copied(torch, t, kind, i, name)? };
            if kind == ArgKind::TensorMut {
                aliased[n_aliased] = n_ops;
                n_aliased += 1;
            }
            if matches!(kind, ArgKind::Tensor | ArgKind::TensorMut) {
                plain[n_plain] = n_ops;
                n_plain += 1;
            }
            dtypes[n_ops] = operand.tensor().dtype()?;
            names[n_ops] = name;
            operands[n_ops] = Some(operand);
            n_ops += 1;
        }
    }
    // What torch's ADInplaceOrView kernel would refuse before the call: writing an inference
    // tensor outside inference mode.
    if let Some(hooks) = hooks {
        for (i, &(name, kind)) in sig.args().iter().enumerate() {
            // SAFETY: a live handle of a defined tensor (its device was read above).
            if kind == ArgKind::TensorMut && !unsafe { (hooks.may_write)(args.tensor(i)?.as_raw()) } {
                return Err(inference_write(name));
            }
        }
    }
    let operand = |k: usize| operands[k].as_ref().expect("the first n_ops are set").tensor();
    // The operands' buffers, each operand's extents read once (borrowed from torch).
    let mut arg_bufs = [NO_BUFFER; N];
    let mut dims: [&[i64]; N] = [&[]; N];
    for k in 0..n_ops {
        // SAFETY: the operand is held through the call (an argument, or a copy made here), and by
        // torch's rule nothing changes an op's arguments' metadata during the call (a concurrent
        // `resize_` would be a data race inside torch itself); the frame only reads the extents.
        dims[k] = unsafe { operand(k).sizes_borrowed() }?;
        arg_bufs[k] = buffer(operand(k).data_ptr()?, dtypes[k], dims[k], names[k])?;
    }
    // Fresh results from the output rule, and their buffers: a result's extents are the rule's
    // (the operand's own for `Like`, the rule's vectors otherwise, alive through the call).
    let mut fresh: [Option<Tensor>; N] = std::array::from_fn(|_| None);
    let mut ret_bufs = [NO_BUFFER; N];
    let mut n_fresh = 0;
    let made: Vec<TensorInfo>;
    match op.out {
        None => {}
        Some(OutRule::Like(i)) => {
            // Argument i is a tensor (validate()): its place among the operands.
            let k = plain[sig.args()[..i]
                .iter()
                .filter(|(_, k)| matches!(k, ArgKind::Tensor | ArgKind::TensorMut))
                .count()];
            let t = torch.empty(dims[k], dtypes[k], TorchDevice::CPU)?;
            // The operand's buffer (its XLA dtype and extents, alive through the call) over the
            // fresh memory.
            ret_bufs[0] = XLA_FFI_Buffer { data: t.data_ptr()?, ..arg_bufs[k] };
            fresh[0] = Some(t);
            n_fresh = 1;
        }
        Some(OutRule::Fn(_) | OutRule::Dyn(_)) => {
            // The tensor arguments' (not the optional or list ones'), as the Meta kernel sees them.
            made = rule_results(op, args, &plain[..n_plain], &dims, &dtypes)?;
            n_fresh = fresh_results(torch, &made, &mut fresh, &mut ret_bufs)?;
        }
    }
    if n_fresh + n_aliased > N {
        return Err(too_many("results", n_fresh + n_aliased));
    }
    // Then the aliased operands again.
    for (j, &k) in aliased[..n_aliased].iter().enumerate() {
        // The same buffer (every field a plain copy): the handler sees the alias by its address.
        ret_bufs[n_fresh + j] = XLA_FFI_Buffer { ..arg_bufs[k] };
    }
    let n_rets = n_fresh + n_aliased;
    // Attributes: every scalar argument, as the handler reads it.
    let mut attr_names = [NO_SPAN; A];
    let mut kinds = [XLA_FFI_AttrType::SCALAR; A];
    let mut words = [[0u64; 1]; A];
    let mut scalar_types = [XLA_FFI_DataType::INVALID; A];
    let mut string_spans = [NO_SPAN; A];
    // Array attributes: int64, float64 and bool lists are lent from the arguments as they are;
    // int32 and float32 ones are narrowed into these (each inner buffer stays where it is as the
    // outer list grows; nothing is allocated for an op without such an attribute).
    let mut arrays = [NO_ARRAY; A];
    let mut n_attrs = 0;
    // (None for an op without scalar, optional or list arguments: call_handler picks A = 0 only
    // then, and this instance carries none of the code.)
    if A > 0 {
        for (i, &(name, kind)) in sig.args().iter().enumerate() {
            if matches!(kind, ArgKind::Tensor | ArgKind::TensorMut | ArgKind::OptTensor | ArgKind::TensorList)
            {
                continue;
            }
            if n_attrs == A {
                return Err(too_many("scalar arguments", n_attrs + 1));
            }
            let ty = op.attrs.iter().find(|(n, _)| *n == name).map(|&(_, t)| t);
            let ty = ty.ok_or_else(|| KernelError(format!("argument {name} has no attribute type")))?;
            attr_names[n_attrs] = XLA_FFI_ByteSpan { ptr: name.as_ptr().cast(), len: name.len() };
            let bytes = bytemuck_u64(&mut words[n_attrs]);
            scalar_types[n_attrs] = match ty {
                AttrType::F32 => {
                    bytes[..4].copy_from_slice(&(args.float(i)? as f32).to_ne_bytes());
                    XLA_FFI_DataType::F32
                }
                AttrType::F64 => {
                    bytes.copy_from_slice(&args.float(i)?.to_ne_bytes());
                    XLA_FFI_DataType::F64
                }
                AttrType::I32 => {
                    let v = args.int(i)?;
                    let v = i32::try_from(v)
                        .map_err(|_| KernelError(format!("{name}: {v} does not fit an int32")))?;
                    bytes[..4].copy_from_slice(&v.to_ne_bytes());
                    XLA_FFI_DataType::S32
                }
                AttrType::I64 => {
                    bytes.copy_from_slice(&args.int(i)?.to_ne_bytes());
                    XLA_FFI_DataType::S64
                }
                AttrType::Bool => {
                    bytes[0] = args.bool(i)? as u8;
                    XLA_FFI_DataType::PRED
                }
                AttrType::Str => {
                    let v = args.str(i)?;
                    string_spans[n_attrs] = XLA_FFI_ByteSpan { ptr: v.as_ptr().cast(), len: v.len() };
                    kinds[n_attrs] = XLA_FFI_AttrType::STRING;
                    XLA_FFI_DataType::INVALID
                }
                AttrType::I64s | AttrType::I32s | AttrType::F32s | AttrType::F64s | AttrType::Bools => {
                    // The handler only reads an array attribute (FromAttr lends `&[T]`): the
                    // pointers below are never written through.
                    let (dtype, size, data): (_, usize, *const c_void) = match ty {
                        AttrType::I64s => {
                            let v = args.int_list(i)?;
                            (XLA_FFI_DataType::S64, v.len(), v.as_ptr().cast())
                        }
                        AttrType::I32s => {
                            let v = args.int_list(i)?;
                            let mut narrowed = Vec::with_capacity(v.len());
                            for (j, &e) in v.iter().enumerate() {
                                narrowed.push(i32::try_from(e).map_err(|_| {
                                    KernelError(format!("{name}: element {j}, {e}, does not fit an int32"))
                                })?);
                            }
                            let (len, data) = (narrowed.len(), narrowed.as_ptr());
                            extras.get_or_insert_with(Default::default).narrowed_i32.push(narrowed);
                            (XLA_FFI_DataType::S32, len, data.cast())
                        }
                        AttrType::F32s => {
                            let narrowed: Vec<f32> = args.float_list(i)?.iter().map(|&e| e as f32).collect();
                            let (len, data) = (narrowed.len(), narrowed.as_ptr());
                            extras.get_or_insert_with(Default::default).narrowed_f32.push(narrowed);
                            (XLA_FFI_DataType::F32, len, data.cast())
                        }
                        AttrType::F64s => {
                            let v = args.float_list(i)?;
                            (XLA_FFI_DataType::F64, v.len(), v.as_ptr().cast())
                        }
                        _ => {
                            // A Rust bool is one byte, 0 or 1: XLA's PRED.
                            let v = args.bool_list(i)?;
                            (XLA_FFI_DataType::PRED, v.len(), v.as_ptr().cast())
                        }
                    };
                    arrays[n_attrs] = XLA_FFI_Array { dtype, size, data: data.cast_mut() };
                    kinds[n_attrs] = XLA_FFI_AttrType::ARRAY;
                    XLA_FFI_DataType::INVALID
                }
            };
            n_attrs += 1;
        }
        // The count of each optional or list argument: an int64 attribute `<name>.count`, as
        // dlbridge.kernels passes it under jax.jit (the handler declares it: xla::Operand).
        for (name, n) in extras.as_deref().map_or(&[][..], |e| &e.counts[..]) {
            if n_attrs == A {
                return Err(too_many("scalar arguments", n_attrs + 1));
            }
            attr_names[n_attrs] = XLA_FFI_ByteSpan { ptr: name.as_ptr().cast(), len: name.len() };
            bytemuck_u64(&mut words[n_attrs]).copy_from_slice(&n.to_ne_bytes());
            scalar_types[n_attrs] = XLA_FFI_DataType::S64;
            n_attrs += 1;
        }
    }
    // Every array is complete and stays where it is until the call returns: pointers into them
    // are taken only now.
    let mut scalars: [XLA_FFI_Scalar; A] = std::array::from_fn(|k| XLA_FFI_Scalar {
        dtype: scalar_types[k],
        value: words[k].as_mut_ptr().cast(),
    });
    let mut attr_values: [*mut c_void; A] = [null_mut(); A];
    let mut name_ptrs: [*mut XLA_FFI_ByteSpan; A] = [null_mut(); A];
    for k in 0..n_attrs {
        attr_values[k] = match kinds[k] {
            XLA_FFI_AttrType::STRING => (&raw mut string_spans[k]).cast(),
            XLA_FFI_AttrType::ARRAY => (&raw mut arrays[k]).cast(),
            _ => (&raw mut scalars[k]).cast(),
        };
        name_ptrs[k] = &raw mut attr_names[k];
    }
    let mut arg_types = [XLA_FFI_ArgType::BUFFER; N];
    let mut ret_types = [XLA_FFI_RetType::BUFFER; N];
    let mut arg_ptrs: [*mut c_void; N] = [null_mut(); N];
    let mut ret_ptrs: [*mut c_void; N] = [null_mut(); N];
    for k in 0..n_ops {
        arg_ptrs[k] = (&raw mut arg_bufs[k]).cast();
    }
    for k in 0..n_rets {
        ret_ptrs[k] = (&raw mut ret_bufs[k]).cast();
    }
    let ctx = NativeCtx { handler: op.handler };
    let mut frame = XLA_FFI_CallFrame {
        struct_size: XLA_FFI_CallFrame_STRUCT_SIZE,
        extension_start: null_mut(),
        api: api_table(),
        ctx: (&raw const ctx).cast_mut().cast(),
        stage: XLA_FFI_ExecutionStage::EXECUTE,
        args: XLA_FFI_Args {
            struct_size: XLA_FFI_Args_STRUCT_SIZE,
            extension_start: null_mut(),
            size: n_ops as i64,
            types: arg_types.as_mut_ptr(),
            args: arg_ptrs.as_mut_ptr(),
        },
        rets: XLA_FFI_Rets {
            struct_size: XLA_FFI_Rets_STRUCT_SIZE,
            extension_start: null_mut(),
            size: n_rets as i64,
            types: ret_types.as_mut_ptr(),
            rets: ret_ptrs.as_mut_ptr(),
        },
        attrs: XLA_FFI_Attrs {
            struct_size: XLA_FFI_Attrs_STRUCT_SIZE,
            extension_start: null_mut(),
            size: n_attrs as i64,
            types: kinds.as_mut_ptr(),
            names: name_ptrs.as_mut_ptr(),
            attrs: attr_values.as_mut_ptr(),
        },
        future: null_mut(),
    };
    // SAFETY: a complete frame of this module's making: every pointer in it points into the
    // arrays above (alive and unmoved through the call) or to tensors held here; buffers are
    // host memory of the extents and dtypes they state; the API table answers errors and the
    // stream. The handler's contract is XLA's, which this frame meets.
    let err = unsafe { (op.handler)(&mut frame) };
    if !err.is_null() {
        // SAFETY: a non-NULL error can only come from this table's error_create.
        return Err(unsafe { handler_error(err) });
    }
    if operands[..n_ops].iter().flatten().any(|o| matches!(o, Operand::Copied { .. })) {
        copy_back(args, &operands[..n_ops])?;
    }
    // What torch's ADInplaceOrView kernel would do after the call (a fallthrough for a native op).
    if let Some(hooks) = super::version_hooks() {
        for (i, &(_, kind)) in sig.args().iter().enumerate() {
            if kind == ArgKind::TensorMut {
                // SAFETY: a live handle (a Tensor's invariant) of a defined tensor (its device and
                // dtype were read above, which fails for an undefined one): all the installer's
                // contract asks.
                unsafe { (hooks.bump)(args.tensor(i)?.as_raw()) };
            }
        }
    }
    for (i, t) in fresh[..n_fresh].iter_mut().enumerate() {
        outs.set(i, Value::Tensor(t.take().expect("the first n_fresh are set")))?;
    }
    Ok(())
}

/// The count attribute of an optional or list argument (`<name>.count`), kept in `extras`.
#[inline(never)]
fn push_count(extras: &mut Option<Box<Extras>>, name: &str, n: usize) {
    let counts = &mut extras.get_or_insert_with(Default::default).counts;
    counts.push((format!("{name}{}", crate::xla::COUNT_SUFFIX), n as i64));
}

#[cold]
#[inline(never)]
fn not_on_cpu(name: &str, device: super::DeviceKind) -> KernelError {
    KernelError(format!("{name}: a {device:?} tensor (this kernel runs on the CPU)"))
}

#[cold]
#[inline(never)]
fn untracked_grad(name: &str) -> KernelError {
    KernelError(format!(
        "argument '{name}' requires grad in grad mode, but no autograd formula is registered for \
         this op, so its gradient would be lost: give the kernel a backward, call it under \
         torch.no_grad(), or detach() '{name}'"
    ))
}

#[cold]
#[inline(never)]
fn inference_write(name: &str) -> KernelError {
    KernelError(format!(
        "{name}: an inference tensor cannot be written in place outside inference mode (torch \
         refuses it too): write it under torch.inference_mode(), or clone it"
    ))
}

/// The contiguous copy of a non-contiguous tensor argument `i` of kind `kind` (copied back
/// after the call when the op writes it). A written argument whose elements share memory (a
/// stride of 0 over an extent above 1, as `expand` makes) is refused before the handler runs, as
/// torch refuses writing one in place.
#[inline(never)]
fn copied<'a>(
    torch: &'static Torch,
    t: &Tensor,
    kind: ArgKind,
    i: usize,
    name: &str,
) -> Result<Operand<'a>, KernelError> {
    let copy_back_into = (kind == ArgKind::TensorMut).then_some(i);
    if copy_back_into.is_some() {
        // SAFETY: read at once, while the caller holds `t` (torch's rule: see sizes_borrowed).
        let (sizes, strides) = unsafe { (t.sizes_borrowed()?, t.strides_borrowed()?) };
        if let Some(d) = sizes.iter().zip(strides).position(|(&n, &s)| n > 1 && s == 0) {
            return Err(KernelError(format!(
                "{name}: more than one element refers to the same memory (dimension {d}: extent \
                 {}, stride 0), so it cannot be written in place (torch refuses it too): clone() \
                 it first",
                sizes[d]
            )));
        }
    }
    Ok(Operand::Copied { tensor: torch.contiguous(t)?, copy_back_into })
}

/// Writes each copied operand of a written argument back into the argument's memory: a raw
/// strided copy ([`write_strided`]), not `aten::copy_`, whose dispatcher kernels would bump the
/// argument's version counter a second time (the kernel bumps it once, as torch's in-place ops
/// do: the version hooks).
#[inline(never)]
fn copy_back(args: &Args, operands: &[Option<Operand<'_>>]) -> Result<(), KernelError> {
    for o in operands.iter().flatten() {
        if let Operand::Copied { tensor, copy_back_into: Some(i) } = o {
            write_strided(args.tensor(*i)?, tensor)?;
        }
    }
    Ok(())
}

/// Copies `src`, the C-contiguous copy [`copied`] made of `dst` (same extents and dtype, its own
/// memory), into `dst`'s memory through `dst`'s strides, outside torch's dispatcher.
fn write_strided(dst: &Tensor, src: &Tensor) -> Result<(), KernelError> {
    // SAFETY: `dst` is a kernel argument held through the call and `src` a copy made here: by
    // torch's rule nothing changes their metadata meanwhile (see sizes_borrowed).
    let (sizes, strides, src_sizes) =
        unsafe { (dst.sizes_borrowed()?, dst.strides_borrowed()?, src.sizes_borrowed()?) };
    let dtype = dst.dtype()?;
    let bits = usize::from(dtype.bits()) * usize::from(dtype.lanes());
    if sizes != src_sizes || dtype != src.dtype()? || bits % 8 != 0 || !src.is_contiguous()? {
        return Err(KernelError(format!(
            "copy-back: {sizes:?} {dtype} from {src_sizes:?} {} (expected its contiguous copy)",
            src.dtype()?
        )));
    }
    if sizes.contains(&0) {
        return Ok(());
    }
    let (d, s) = (dst.data_ptr()?.cast::<u8>(), src.data_ptr()?.cast::<u8>().cast_const());
    // SAFETY: `d` is `dst`'s first element, and every offset `write_rows` forms is an index
    // within `sizes` times `strides`, inside `dst`'s storage (torch's invariant of a strided
    // tensor); `s` is `src`'s `sizes`-product elements of the same width, contiguous, in memory
    // of its own (a fresh tensor), so the two never overlap. No reference to either memory is
    // alive: the handler has returned, and the frame's buffers are raw pointers.
    unsafe {
        match bits / 8 {
            1 => write_rows::<u8>(d, s, sizes, strides),
            2 => write_rows::<u16>(d, s, sizes, strides),
            4 => write_rows::<u32>(d, s, sizes, strides),
            8 => write_rows::<u64>(d, s, sizes, strides),
            w => write_rows_bytes(d, s, sizes, strides, w),
        }
    }
    Ok(())
}

/// [`write_strided`]'s loop for elements of `T`'s width (read and written unaligned: torch
/// does not promise the alignment of memory it was given).
///
/// # Safety
///
/// As in `write_strided`: `d` with `sizes` and `strides` (in elements of `T`'s width) addresses
/// writable memory, `s` holds the product of `sizes` elements, the two do not overlap, and no
/// extent is 0.
unsafe fn write_rows<T: Copy>(d: *mut u8, s: *const u8, sizes: &[i64], strides: &[i64]) {
    let w = std::mem::size_of::<T>() as isize;
    let (inner, inner_stride) = last_row(sizes, strides, w);
    let mut s = s;
    for_each_row(sizes, strides, w, |row| {
        if inner_stride == w {
            // SAFETY: a contiguous row of `inner` elements on both sides (the caller's contract).
            unsafe { std::ptr::copy_nonoverlapping(s, d.offset(row), (inner * w) as usize) };
        } else {
            for j in 0..inner {
                // SAFETY: element j of the row (the caller's contract), unaligned access.
                unsafe {
                    let v = s.offset(j * w).cast::<T>().read_unaligned();
                    d.offset(row + j * inner_stride).cast::<T>().write_unaligned(v);
                }
            }
        }
        // SAFETY: `inner` elements were read, at most one past the end of `s`.
        s = unsafe { s.offset(inner * w) };
    });
}

/// [`write_rows`] for elements of any other width `w` (16: complex128), byte by byte.
///
/// # Safety
///
/// As [`write_rows`], with elements `w` bytes wide.
unsafe fn write_rows_bytes(d: *mut u8, s: *const u8, sizes: &[i64], strides: &[i64], w: usize) {
    let wi = w as isize;
    let (inner, inner_stride) = last_row(sizes, strides, wi);
    let mut s = s;
    for_each_row(sizes, strides, wi, |row| {
        for j in 0..inner {
            // SAFETY: element j of the row, `w` bytes on each side (the caller's contract).
            unsafe { std::ptr::copy_nonoverlapping(s.offset(j * wi), d.offset(row + j * inner_stride), w) };
        }
        // SAFETY: as in write_rows.
        s = unsafe { s.offset(inner * wi) };
    });
}

/// The extent of a row (the last dimension; 1 for 0-d) and its stride in bytes, for elements `w`
/// bytes wide. A stride of an extent of 1 is never applied, and torch lets it be anything (2^62
/// times the width overflows): such a row is taken as contiguous.
fn last_row(sizes: &[i64], strides: &[i64], w: isize) -> (isize, isize) {
    match (sizes.last(), strides.last()) {
        (Some(&n), Some(&st)) if n > 1 => (n as isize, st as isize * w),
        _ => (1, w),
    }
}

/// Calls `f` with the byte offset of each row (every index of the dimensions but the last, in C
/// order) of a tensor of `sizes` and `strides` (in elements `w` bytes wide); once for 0-d. No
/// offset is formed that the tensor's elements do not reach: a dimension of extent 1, whose
/// stride torch lets be anything, never steps.
fn for_each_row(sizes: &[i64], strides: &[i64], w: isize, mut f: impl FnMut(isize)) {
    let outer = sizes.len().saturating_sub(1);
    let mut index = [0i64; crate::managed::MAX_NDIM];
    let mut offset: isize = 0;
    loop {
        f(offset);
        // The next index: the last outer dimension that is not at its end steps on, the ones
        // after it go back to 0.
        let mut k = outer;
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            if index[k] + 1 < sizes[k] {
                index[k] += 1;
                offset += strides[k] as isize * w;
                break;
            }
            // At its end (extent - 1): back to 0, which an extent of 1 never left.
            offset -= index[k] as isize * strides[k] as isize * w;
            index[k] = 0;
        }
    }
}

/// The results an `Fn` or `Dyn` output rule makes from the tensor arguments (operands `plain`,
/// in order), as the Meta kernel sees them.
#[inline(never)]
fn rule_results(
    op: &XlaOp,
    args: &Args,
    plain: &[usize],
    dims: &[&[i64]],
    dtypes: &[DataType],
) -> Result<Vec<TensorInfo>, KernelError> {
    let infos: Vec<TensorInfo> =
        plain.iter().map(|&k| TensorInfo { dtype: dtypes[k], shape: dims[k].to_vec() }).collect();
    output_infos(op, &infos, args)
}

/// A fresh tensor and its buffer for each of `made` (whose extents the buffers point into), in
/// `fresh` and `bufs`; returns how many.
#[inline(never)]
fn fresh_results<const N: usize>(
    torch: &'static Torch,
    made: &[TensorInfo],
    fresh: &mut [Option<Tensor>; N],
    bufs: &mut [XLA_FFI_Buffer; N],
) -> Result<usize, KernelError> {
    for (n, o) in made.iter().enumerate() {
        if n == N {
            return Err(too_many("results", n + 1));
        }
        let t = torch.empty(&o.shape, o.dtype, TorchDevice::CPU)?;
        bufs[n] = buffer(t.data_ptr()?, o.dtype, &o.shape, "result")?;
        fresh[n] = Some(t);
    }
    Ok(made.len())
}

/// The handler's error as the kernel's.
///
/// # Safety
///
/// `err` is a non-NULL error of this module's table (`error_create`), not yet destroyed.
#[cold]
#[inline(never)]
unsafe fn handler_error(err: *mut XLA_FFI_Error) -> KernelError {
    // SAFETY: the caller's contract: a box this table made, taken once.
    let e = unsafe { Box::from_raw(err.cast::<AdapterError>()) };
    KernelError(e.message.to_string_lossy().into_owned())
}

/// The parts of a frame only some ops need (see `call_handler_in`): each inner narrowed
/// buffer stays where it is as its list grows, so pointers into it stay valid through the call.
#[derive(Default)]
struct Extras {
    /// `(<name>.count, count)` of each optional or list argument, in order.
    counts: Vec<(String, i64)>,
    narrowed_i32: Vec<Vec<i32>>,
    narrowed_f32: Vec<Vec<f32>>,
}

fn bytemuck_u64(w: &mut [u64; 1]) -> &mut [u8; 8] {
    // SAFETY: [u64; 1] and [u8; 8] have the same size, u8 has no alignment requirement, every
    // byte pattern is valid for both, and the borrow is carried over.
    unsafe { &mut *(w as *mut [u64; 1]).cast::<[u8; 8]>() }
}

/// An error the handler made through this module's API table.
struct AdapterError {
    message: CString,
}

unsafe extern "C" fn error_create(args: *mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error {
    // SAFETY: the handler passes its arguments (dlbridge's xla layer: a NUL-terminated message).
    let m = unsafe { (*args).message };
    let message = if m.is_null() {
        c"(no message)".to_owned()
    } else {
        // SAFETY: NUL-terminated (above), copied here.
        unsafe { CStr::from_ptr(m) }.to_owned()
    };
    Box::into_raw(Box::new(AdapterError { message })).cast()
}

unsafe extern "C" fn error_get_message(args: *mut XLA_FFI_Error_GetMessage_Args) {
    // SAFETY: an error error_create made, alive until destroyed; the message it owns.
    unsafe { (*args).message = (*(*args).error.cast::<AdapterError>()).message.as_ptr() };
}

unsafe extern "C" fn error_destroy(args: *mut XLA_FFI_Error_Destroy_Args) {
    // SAFETY: an error error_create made, destroyed once.
    drop(unsafe { Box::from_raw((*args).error.cast::<AdapterError>()) });
}

unsafe extern "C" fn stream_get(args: *mut XLA_FFI_Stream_Get_Args) -> *mut XLA_FFI_Error {
    // SAFETY: the handler's arguments; the CPU has no stream.
    unsafe { (*args).stream = null_mut() };
    null_mut()
}

/// The call frame's context on this path (what `ctx` points to): the handler being run, whose
/// state [`state_get`] makes at its first need.
struct NativeCtx {
    handler: XLA_FFI_Handler,
}

/// An error of this module's table saying `message`.
fn adapter_error(message: &str) -> *mut XLA_FFI_Error {
    let message = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    Box::into_raw(Box::new(AdapterError { message })).cast()
}

/// The types registered through this table (`XLA_FFI_Type_Register`): name and id, for the
/// process.
static TYPES: Mutex<Vec<(String, i64)>> = Mutex::new(Vec::new());

/// The states handlers made through this table: (handler, type id, state), kept for the process
/// (an op lives as long as the process: its state too, never freed).
static STATES: Mutex<Vec<(usize, i64, usize)>> = Mutex::new(Vec::new());

thread_local! {
    /// Whether this thread is inside a handler's instantiate stage run by [`state_get`] (a
    /// handler asking for its state while making it is refused, not recursed into).
    static INSTANTIATING: Cell<bool> = const { Cell::new(false) };
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

unsafe extern "C" fn type_register(args: *mut XLA_FFI_Type_Register_Args) -> *mut XLA_FFI_Error {
    // SAFETY: the handler's arguments (the C API's contract); their size is checked first.
    let a = unsafe { &mut *args };
    if a.struct_size < XLA_FFI_Type_Register_Args_STRUCT_SIZE || a.type_id.is_null() {
        return adapter_error("XLA_FFI_Type_Register: arguments too short or without a type id");
    }
    let name = if a.name.len == 0 {
        String::new()
    } else if a.name.ptr.is_null() {
        return adapter_error("XLA_FFI_Type_Register: a name without bytes");
    } else {
        // SAFETY: `len` bytes at `ptr` (the C API's contract), copied here.
        String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(a.name.ptr.cast::<u8>(), a.name.len) })
            .into_owned()
    };
    let mut types = lock(&TYPES);
    // SAFETY: non-NULL (checked), the handler's in-out id.
    let want = unsafe { (*a.type_id).type_id };
    if let Some(&(_, id)) = types.iter().find(|(n, _)| *n == name) {
        // As XLA: a name is registered once; again only with the same id.
        return if want == id {
            null_mut()
        } else {
            adapter_error(&format!("type name {name} already registered with type id {id}"))
        };
    }
    let id = if want != 0 { want } else { types.iter().map(|&(_, id)| id).max().unwrap_or(0) + 1 };
    types.push((name, id));
    // SAFETY: as above.
    unsafe { (*a.type_id).type_id = id };
    null_mut()
}

/// The handler of a frame's context ([`NativeCtx`]), or an error.
///
/// # Safety
///
/// `ctx` is NULL or the context of a frame this module made (alive for the call).
unsafe fn native_handler(ctx: *mut XLA_FFI_ExecutionContext) -> Result<XLA_FFI_Handler, *mut XLA_FFI_Error> {
    if ctx.is_null() {
        return Err(adapter_error("no execution context"));
    }
    // SAFETY: the caller's contract.
    Ok(unsafe { (*ctx.cast::<NativeCtx>()).handler })
}

unsafe extern "C" fn state_set(args: *mut XLA_FFI_State_Set_Args) -> *mut XLA_FFI_Error {
    // SAFETY: the handler's arguments (the C API's contract); their size is checked first.
    let a = unsafe { &*args };
    if a.struct_size < XLA_FFI_State_Set_Args_STRUCT_SIZE || a.type_id.is_null() {
        return adapter_error("XLA_FFI_State_Set: arguments too short or without a type id");
    }
    if a.stage != XLA_FFI_ExecutionStage::INSTANTIATE {
        return adapter_error(&format!("XLA_FFI_State_Set: stage {} has no state", a.stage.0));
    }
    // SAFETY: the context of the frame being run (this module's).
    let handler = match unsafe { native_handler(a.ctx) } {
        Ok(h) => h,
        Err(e) => return e,
    };
    // SAFETY: non-NULL (checked).
    let id = unsafe { (*a.type_id).type_id };
    let mut states = lock(&STATES);
    if states.iter().any(|&(h, t, _)| h == handler as usize && t == id) {
        // As XLA: not taken (the handler frees it).
        return adapter_error("XLA_FFI_State_Set: the state is already set");
    }
    states.push((handler as usize, id, a.state as usize));
    null_mut()
}

unsafe extern "C" fn state_get(args: *mut XLA_FFI_State_Get_Args) -> *mut XLA_FFI_Error {
    // SAFETY: the handler's arguments (the C API's contract); their size is checked first.
    let a = unsafe { &mut *args };
    if a.struct_size < XLA_FFI_State_Get_Args_STRUCT_SIZE || a.type_id.is_null() {
        return adapter_error("XLA_FFI_State_Get: arguments too short or without a type id");
    }
    if a.stage != XLA_FFI_ExecutionStage::INSTANTIATE {
        return adapter_error(&format!("XLA_FFI_State_Get: stage {} has no state", a.stage.0));
    }
    // SAFETY: the context of the frame being run (this module's).
    let handler = match unsafe { native_handler(a.ctx) } {
        Ok(h) => h,
        Err(e) => return e,
    };
    // SAFETY: non-NULL (checked).
    let id = unsafe { (*a.type_id).type_id };
    let find =
        || lock(&STATES).iter().find(|&&(h, t, _)| h == handler as usize && t == id).map(|&(_, _, s)| s);
    if let Some(state) = find() {
        a.state = state as *mut c_void;
        return null_mut();
    }
    // The op's first need of its state: the handler's instantiate stage, run here once (two
    // threads may both run it: the second State_Set is refused and its state freed).
    if INSTANTIATING.with(Cell::get) {
        return adapter_error("XLA_FFI_State_Get: called while the state is being made");
    }
    INSTANTIATING.with(|c| c.set(true));
    let err = instantiate(handler, a.ctx);
    INSTANTIATING.with(|c| c.set(false));
    match find() {
        Some(state) => {
            if !err.is_null() {
                // SAFETY: an error of this table (error_create or adapter_error), freed once.
                drop(unsafe { Box::from_raw(err.cast::<AdapterError>()) });
            }
            a.state = state as *mut c_void;
            null_mut()
        }
        None if !err.is_null() => err,
        None => adapter_error("the handler's instantiate stage made no state"),
    }
}

/// Runs `handler`'s instantiate stage (no operands, results or attributes) with this table.
fn instantiate(handler: XLA_FFI_Handler, ctx: *mut XLA_FFI_ExecutionContext) -> *mut XLA_FFI_Error {
    let mut frame = XLA_FFI_CallFrame {
        struct_size: XLA_FFI_CallFrame_STRUCT_SIZE,
        extension_start: null_mut(),
        api: api_table(),
        ctx,
        stage: XLA_FFI_ExecutionStage::INSTANTIATE,
        args: XLA_FFI_Args {
            struct_size: XLA_FFI_Args_STRUCT_SIZE,
            extension_start: null_mut(),
            size: 0,
            types: null_mut(),
            args: null_mut(),
        },
        rets: XLA_FFI_Rets {
            struct_size: XLA_FFI_Rets_STRUCT_SIZE,
            extension_start: null_mut(),
            size: 0,
            types: null_mut(),
            rets: null_mut(),
        },
        attrs: XLA_FFI_Attrs {
            struct_size: XLA_FFI_Attrs_STRUCT_SIZE,
            extension_start: null_mut(),
            size: 0,
            types: null_mut(),
            names: null_mut(),
            attrs: null_mut(),
        },
        future: null_mut(),
    };
    // SAFETY: a complete frame of this module's making, for the handler the op runs (its
    // contract is XLA's, which the frame meets: the instantiate stage has no buffers).
    unsafe { handler(&mut frame) }
}

/// The table, one for the process: a handler's state type is registered once per table (XLA's
/// is a static object too).
fn api_table() -> &'static XLA_FFI_Api {
    /// The table's functions and NULLs, shared by every thread (nothing in it is ever written).
    struct Table(XLA_FFI_Api);
    // SAFETY: read-only after it is made: its pointers are functions of this module and NULLs.
    unsafe impl Sync for Table {}
    // SAFETY: as Sync.
    unsafe impl Send for Table {}
    static TABLE: OnceLock<Table> = OnceLock::new();
    &TABLE.get_or_init(|| Table(make_api_table())).0
}

fn make_api_table() -> XLA_FFI_Api {
    XLA_FFI_Api {
        struct_size: XLA_FFI_Api_STRUCT_SIZE,
        extension_start: null_mut(),
        api_version: XLA_FFI_Api_Version {
            struct_size: XLA_FFI_Api_Version_STRUCT_SIZE,
            extension_start: null_mut(),
            major_version: XLA_FFI_API_MAJOR,
            minor_version: XLA_FFI_API_MINOR,
        },
        internal_api: std::ptr::null(),
        XLA_FFI_Error_Create: Some(error_create),
        XLA_FFI_Error_GetMessage: Some(error_get_message),
        XLA_FFI_Error_Destroy: Some(error_destroy),
        XLA_FFI_Handler_Register: std::ptr::null(),
        XLA_FFI_Stream_Get: Some(stream_get),
        XLA_FFI_Type_Register: Some(type_register),
        XLA_FFI_ExecutionContext_Get: std::ptr::null(),
        XLA_FFI_State_Set: Some(state_set),
        XLA_FFI_State_Get: Some(state_get),
        XLA_FFI_DeviceMemory_Allocate: None,
        XLA_FFI_DeviceMemory_Free: None,
        XLA_FFI_ThreadPool_Schedule: None,
        XLA_FFI_ThreadPool_NumThreads: None,
        XLA_FFI_Future_Create: std::ptr::null(),
        XLA_FFI_Future_SetAvailable: std::ptr::null(),
        XLA_FFI_Future_SetError: std::ptr::null(),
        XLA_FFI_RunId_Get: std::ptr::null(),
        XLA_FFI_DeviceOrdinal_Get: None,
    }
}
