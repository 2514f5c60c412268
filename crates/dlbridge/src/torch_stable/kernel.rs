//! Boxed kernels: an op's signature, its arguments taken off torch's stack, its outputs put on,
//! errors thrown to torch; and boxed dispatcher calls.

use std::ffi::{CString, c_char};
use std::fmt;
use std::mem::ManuallyDrop;
use std::panic::{AssertUnwindSafe, catch_unwind};

use super::signature::{ArgKind, OpSignature};
use super::sys::{AtenTensorHandle, StableIValue, StableListHandle, StringHandle};
use super::{EXTENSION_ABI_VERSION, Error, Result, Tensor, Torch};

/// An argument or result, owned.
#[derive(Debug)]
pub enum Value {
    /// A tensor (an owning handle).
    Tensor(Tensor),
    /// An `int`.
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `bool`.
    Bool(bool),
    /// A `str`.
    Str(String),
    /// An `int[]`.
    IntList(Vec<i64>),
    /// A `float[]`.
    FloatList(Vec<f64>),
    /// A `bool[]`.
    BoolList(Vec<bool>),
    /// A `Tensor?` argument: a tensor (an owning handle) or None.
    OptTensor(Option<Tensor>),
    /// A `Tensor[]` argument: its tensors (owning handles), in order.
    TensorList(Vec<Tensor>),
}

impl Value {
    fn kind_name(&self) -> &'static str {
        match self {
            Self::Tensor(_) => "Tensor",
            Self::Int(_) => "int",
            Self::Float(_) => "float",
            Self::Bool(_) => "bool",
            Self::Str(_) => "str",
            Self::IntList(_) => "int[]",
            Self::FloatList(_) => "float[]",
            Self::BoolList(_) => "bool[]",
            Self::OptTensor(_) => "Tensor?",
            Self::TensorList(_) => "Tensor[]",
        }
    }
}

/// Why a kernel failed: the message torch raises (`RuntimeError` in Python), after the op's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelError(pub String);

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KernelError {}

impl From<Error> for KernelError {
    fn from(e: Error) -> Self {
        Self(e.to_string())
    }
}

impl From<String> for KernelError {
    fn from(s: String) -> Self {
        Self(s)
    }
}

impl From<&str> for KernelError {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

impl From<crate::xla::FfiError> for KernelError {
    fn from(e: crate::xla::FfiError) -> Self {
        Self(e.message().to_owned())
    }
}

/// A kernel's argument or result values: inline for the usual op (no allocation per call),
/// on the heap past [`Slots::INLINE`].
// The inline variant is large on purpose: it lives in the boxed kernel's frame for one call
// (never in a collection), and boxing it would be the allocation it exists to avoid.
#[allow(clippy::large_enum_variant)]
enum Slots {
    /// Only the first `len` slots are ever set (`get_mut` lends no more), so only they are
    /// dropped (the drop of the whole array looked at all eight).
    Inline {
        len: usize,
        items: ManuallyDrop<[Option<Value>; Slots::INLINE]>,
    },
    Heap(Vec<Option<Value>>),
}

impl Drop for Slots {
    fn drop(&mut self) {
        if let Self::Inline { len, items } = self {
            // Every slot past `len` is None: nothing there to drop.
            for v in &mut items[..*len] {
                drop(v.take());
            }
        }
    }
}

impl fmt::Debug for Slots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.get()).finish()
    }
}

impl Slots {
    const INLINE: usize = 8;

    /// `n` empty slots.
    #[inline(always)]
    fn new(n: usize) -> Self {
        if n <= Self::INLINE {
            // Each slot's tag written (a `[None; 8]` constant was copied whole: a memcpy).
            Self::Inline { len: n, items: ManuallyDrop::new(std::array::from_fn(|_| None)) }
        } else {
            Self::Heap((0..n).map(|_| None).collect())
        }
    }

    fn get(&self) -> &[Option<Value>] {
        match self {
            Self::Inline { len, items } => &items[..*len],
            Self::Heap(v) => v,
        }
    }

    fn get_mut(&mut self) -> &mut [Option<Value>] {
        match self {
            Self::Inline { len, items } => &mut items[..*len],
            Self::Heap(v) => v,
        }
    }
}

/// A kernel's arguments, taken off torch's stack (owned: dropped tensors are deleted once).
#[derive(Debug)]
pub struct Args {
    sig: &'static [(&'static str, ArgKind)],
    values: Slots,
}

impl Args {
    /// The number of arguments.
    pub fn len(&self) -> usize {
        self.values.get().len()
    }

    /// Whether the op takes no arguments.
    pub fn is_empty(&self) -> bool {
        self.values.get().is_empty()
    }

    fn get(&self, i: usize, want: &str) -> Result<&Value, KernelError> {
        match self.values.get().get(i) {
            Some(Some(v)) => Ok(v),
            Some(None) => Err(KernelError(format!("argument {}: already taken", self.sig[i].0))),
            None => Err(KernelError(format!(
                "no argument {i} ({want}); the op takes {}",
                self.values.get().len()
            ))),
        }
    }

    #[cold]
    fn wrong(&self, i: usize, want: &str, got: &Value) -> KernelError {
        KernelError(format!("argument {}: a {}, not a {want}", self.sig[i].0, got.kind_name()))
    }

    /// Tensor argument `i`, borrowed.
    pub fn tensor(&self, i: usize) -> Result<&Tensor, KernelError> {
        match self.get(i, "Tensor")? {
            Value::Tensor(t) => Ok(t),
            v => Err(self.wrong(i, "Tensor", v)),
        }
    }

    /// Tensor argument `i`, taken (to return it as an output without a new handle).
    pub fn take_tensor(&mut self, i: usize) -> Result<Tensor, KernelError> {
        self.tensor(i)?;
        match self.values.get_mut()[i].take() {
            Some(Value::Tensor(t)) => Ok(t),
            _ => unreachable!("checked just above"),
        }
    }

    /// `int` argument `i`.
    pub fn int(&self, i: usize) -> Result<i64, KernelError> {
        match self.get(i, "int")? {
            &Value::Int(v) => Ok(v),
            v => Err(self.wrong(i, "int", v)),
        }
    }

    /// `float` argument `i`.
    pub fn float(&self, i: usize) -> Result<f64, KernelError> {
        match self.get(i, "float")? {
            &Value::Float(v) => Ok(v),
            v => Err(self.wrong(i, "float", v)),
        }
    }

    /// `bool` argument `i`.
    pub fn bool(&self, i: usize) -> Result<bool, KernelError> {
        match self.get(i, "bool")? {
            &Value::Bool(v) => Ok(v),
            v => Err(self.wrong(i, "bool", v)),
        }
    }

    /// `Tensor?` argument `i`: the tensor, or `None`.
    pub fn opt_tensor(&self, i: usize) -> Result<Option<&Tensor>, KernelError> {
        match self.get(i, "Tensor?")? {
            Value::OptTensor(t) => Ok(t.as_ref()),
            v => Err(self.wrong(i, "Tensor?", v)),
        }
    }

    /// `Tensor[]` argument `i`: its tensors, in order.
    pub fn tensor_list(&self, i: usize) -> Result<&[Tensor], KernelError> {
        match self.get(i, "Tensor[]")? {
            Value::TensorList(t) => Ok(t),
            v => Err(self.wrong(i, "Tensor[]", v)),
        }
    }

    /// `str` argument `i`.
    pub fn str(&self, i: usize) -> Result<&str, KernelError> {
        match self.get(i, "str")? {
            Value::Str(v) => Ok(v),
            v => Err(self.wrong(i, "str", v)),
        }
    }

    /// `int[]` argument `i`.
    pub fn int_list(&self, i: usize) -> Result<&[i64], KernelError> {
        match self.get(i, "int[]")? {
            Value::IntList(v) => Ok(v),
            v => Err(self.wrong(i, "int[]", v)),
        }
    }

    /// `float[]` argument `i`.
    pub fn float_list(&self, i: usize) -> Result<&[f64], KernelError> {
        match self.get(i, "float[]")? {
            Value::FloatList(v) => Ok(v),
            v => Err(self.wrong(i, "float[]", v)),
        }
    }

    /// `bool[]` argument `i`.
    pub fn bool_list(&self, i: usize) -> Result<&[bool], KernelError> {
        match self.get(i, "bool[]")? {
            Value::BoolList(v) => Ok(v),
            v => Err(self.wrong(i, "bool[]", v)),
        }
    }
}

/// A kernel's outputs, held until the body succeeds, then put on torch's stack (dropped, so
/// deleted, when it fails).
#[derive(Debug)]
pub struct Outputs {
    kinds: &'static [ArgKind],
    values: Slots,
}

impl Outputs {
    /// Sets output `i` (of the kind the signature declares).
    #[inline]
    pub fn set(&mut self, i: usize, value: Value) -> Result<(), KernelError> {
        let ok = match self.kinds.get(i) {
            Some(&kind) => matches!(
                (kind, &value),
                (ArgKind::Tensor, Value::Tensor(_))
                    | (ArgKind::Int, Value::Int(_))
                    | (ArgKind::Float, Value::Float(_))
                    | (ArgKind::Bool, Value::Bool(_))
            ),
            None => false,
        };
        if !ok {
            return Err(self.refusal(i, &value));
        }
        self.values.get_mut()[i] = Some(value);
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn refusal(&self, i: usize, value: &Value) -> KernelError {
        match self.kinds.get(i) {
            None => KernelError(format!("no output {i}: the op returns {}", self.kinds.len())),
            Some(kind) => KernelError(format!("output {i}: a {}, not a {kind:?}", value.kind_name())),
        }
    }
}

/// Runs a boxed kernel's `body` over torch's stack: what an `unsafe extern "C-unwind" fn(*mut
/// StableIValue, u64, u64)` registered with [`Library::register`](super::Library::register) calls.
///
/// It takes every argument off the stack as `signature` declares them (tensors as owning
/// [`Tensor`]s, strings copied and their handles freed), runs `body` (a panic is caught), puts the
/// outputs on the stack, and on any failure (a count that does not match `signature`, a NULL
/// tensor, the body's error or panic, an output left unset) drops everything it holds, then
/// throws the message to torch through `aoti_torch_check`: Python sees `RuntimeError:
/// <op>: <message>`, a dispatcher call from C returns an error code. The throw passes through
/// the kernel's frame, which is why it is `C-unwind`; it needs `panic = "unwind"` (the default).
///
/// # Safety
///
/// Called by torch's boxed kernel wrapper for an op whose schema is `signature.schema()`:
/// `stack` points to `max(num_args, num_outputs)` entries, the first `num_args` the op's arguments
/// as torch encodes them (owned by the callee). Torch's libtorch is [`Torch::get`]'s (the kernel
/// was registered through it).
pub unsafe fn run_boxed<F>(
    stack: *mut StableIValue,
    num_args: u64,
    num_outputs: u64,
    signature: &OpSignature,
    body: F,
) where
    F: FnOnce(&mut Args, &mut Outputs) -> Result<(), KernelError>,
{
    let Some(torch) = Torch::get() else { no_torch() };
    let run = || -> Result<(), KernelError> {
        // The arguments and outputs are made here and filled in place (each holds up to 8 values
        // inline: moved through returns, they were copied whole, a memcpy a move).
        let mut outs = Outputs { kinds: signature.rets(), values: Slots::new(signature.rets().len()) };
        {
            // (Dropped in place at the block's end: `drop(args)` moved it, a memcpy.)
            let mut args = Args { sig: signature.args(), values: Slots::new(signature.args().len()) };
            // SAFETY: the caller's contract.
            unsafe { take_args(torch, stack, num_args, num_outputs, signature, &mut args.values) }?;
            body(&mut args, &mut outs)?;
        }
        // SAFETY: the stack has room for num_outputs == rets.len() entries (checked in take_args).
        unsafe { put_outputs(stack, &mut outs) }
    };
    let failure = match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e,
        Err(panic) => KernelError(format!("panicked: {}", crate::xla::panic_message(&*panic))),
    };
    // Everything the kernel held is dropped by now; the throw happens outside catch_unwind (a
    // foreign exception caught there is unspecified behaviour).
    throw(torch, signature.name(), &failure)
}

/// A kernel known at compile time: its op's signature and body. [`register_kernel`] defines the
/// op and registers [`boxed_kernel::<Self>`](boxed_kernel) for dispatch keys, safely (the kernel
/// decodes the stack with the signature the op was defined from).
pub trait NativeKernel: 'static {
    /// The op's name, arguments and results.
    const SIGNATURE: OpSignature;

    /// The body (see [`run_boxed`]).
    fn run(args: &mut Args, outs: &mut Outputs) -> Result<(), KernelError>;
}

/// The boxed kernel of `K`: [`run_boxed`] with `K`'s signature and body.
///
/// # Safety
///
/// As [`run_boxed`], for an op of schema `K::SIGNATURE.schema()`.
pub unsafe extern "C-unwind" fn boxed_kernel<K: NativeKernel>(
    stack: *mut StableIValue,
    num_args: u64,
    num_outputs: u64,
) {
    // SAFETY: the caller's contract.
    unsafe { run_boxed(stack, num_args, num_outputs, &K::SIGNATURE, K::run) }
}

/// Defines `K`'s op in namespace `ns` and registers its kernel for each of `dispatch_keys`
/// (`"CPU"`, `"Meta"`, ...). The libraries are kept for the process.
pub fn register_kernel<K: NativeKernel>(
    torch: &'static Torch,
    ns: &str,
    dispatch_keys: &[&str],
) -> Result<()> {
    super::Library::fragment(torch, ns)?.define(&K::SIGNATURE)?;
    for key in dispatch_keys {
        let lib = super::Library::implementation(torch, ns, key)?;
        // SAFETY: the op was just defined from K's signature (a definition by anyone else would
        // have made define() fail), which is what boxed_kernel::<K> decodes the stack with.
        unsafe { lib.register(K::SIGNATURE.name(), boxed_kernel::<K>) }?;
    }
    Ok(())
}

/// Takes every argument off the stack into `values` (one slot per argument, empty), each owning
/// one held there before any error returns (the caller's drop frees them).
///
/// # Safety
///
/// As [`run_boxed`].
unsafe fn take_args(
    torch: &'static Torch,
    stack: *mut StableIValue,
    num_args: u64,
    num_outputs: u64,
    sig: &OpSignature,
    values: &mut Slots,
) -> Result<(), KernelError> {
    if num_args != sig.args().len() as u64 || num_outputs != sig.rets().len() as u64 {
        // Nothing can be freed without knowing the arguments' kinds: a kernel registered for
        // another op (a programming error) leaks its arguments, never frees them wrongly.
        return Err(KernelError(format!(
            "called with {num_args} arguments and {num_outputs} results; its signature has {} and {}",
            sig.args().len(),
            sig.rets().len()
        )));
    }
    if stack.is_null() && (num_args > 0 || num_outputs > 0) {
        return Err(KernelError("a NULL stack".into()));
    }
    let mut first_error: Option<KernelError> = None;
    for (i, &(name, kind)) in sig.args().iter().enumerate() {
        // SAFETY: entry i < num_args of torch's stack.
        let raw = unsafe { stack.add(i).read() };
        let v = match kind {
            ArgKind::Tensor | ArgKind::TensorMut => {
                // SAFETY: a Tensor argument is a new owning handle (torch's from_ivalue).
                match unsafe { Tensor::from_raw(torch, raw as usize as AtenTensorHandle) } {
                    Some(t) => Some(Value::Tensor(t)),
                    None => {
                        first_error
                            .get_or_insert_with(|| KernelError(format!("argument {name}: a NULL tensor")));
                        None
                    }
                }
            }
            ArgKind::Int => Some(Value::Int(raw as i64)),
            ArgKind::Float => Some(Value::Float(f64::from_bits(raw))),
            ArgKind::Bool => Some(Value::Bool(raw.to_ne_bytes()[0] != 0)),
            // SAFETY: a str argument is an owning std::string handle.
            ArgKind::Str => match unsafe { take_string(torch, raw as usize as StringHandle) } {
                Ok(s) => Some(Value::Str(s)),
                Err(e) => {
                    first_error.get_or_insert_with(|| KernelError(format!("argument {name}: {e}")));
                    None
                }
            },
            ArgKind::IntList | ArgKind::FloatList | ArgKind::BoolList => {
                // SAFETY: a list argument is an owning list handle of plain values.
                match unsafe { take_plain_list(&torch, raw) } {
                    Ok(words) => Some(match kind {
                        ArgKind::IntList => Value::IntList(words.into_iter().map(|w| w as i64).collect()),
                        ArgKind::FloatList => {
                            Value::FloatList(words.into_iter().map(f64::from_bits).collect())
                        }
                        _ => Value::BoolList(words.into_iter().map(|w| w.to_ne_bytes()[0] != 0).collect()),
                    }),
                    Err(e) => {
                        first_error.get_or_insert_with(|| KernelError(format!("argument {name}: {e}")));
                        None
                    }
                }
            }
            // SAFETY: a Tensor? argument is 0 or an owning box of an owning handle.
            ArgKind::OptTensor => match unsafe { take_optional(&torch, raw) } {
                Ok(t) => Some(Value::OptTensor(t)),
                Err(e) => {
                    first_error.get_or_insert_with(|| KernelError(format!("argument {name}: {e}")));
                    None
                }
            },
            // SAFETY: a Tensor[] argument is an owning list of owning handles.
            ArgKind::TensorList => match unsafe { take_list(&torch, raw) } {
                Ok(t) => Some(Value::TensorList(t)),
                Err(e) => {
                    first_error.get_or_insert_with(|| KernelError(format!("argument {name}: {e}")));
                    None
                }
            },
        };
        values.get_mut()[i] = v;
    }
    // Every owning argument is now held (and freed by the caller's drop) before any error returns.
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Copies and frees an owning string handle.
///
/// # Safety
///
/// `h` is NULL or an owning `StringHandle` of `torch` nothing else frees.
unsafe fn take_string(torch: &Torch, h: StringHandle) -> Result<String> {
    if h.is_null() {
        return Err(Error::Invalid("a NULL string".into()));
    }
    let delete = torch.need(torch.syms.torch_delete_string, "torch_delete_string")?;
    let read = || -> Result<String> {
        let len_f = torch.need(torch.syms.torch_string_length, "torch_string_length")?;
        let data_f = torch.need(torch.syms.torch_string_c_str, "torch_string_c_str")?;
        let (mut len, mut data): (usize, *const c_char) = (0, std::ptr::null());
        // SAFETY: a live string handle and places for the results.
        torch.check(unsafe { len_f(h, &mut len) }, "torch_string_length")?;
        // SAFETY: as above.
        torch.check(unsafe { data_f(h, &mut data) }, "torch_string_c_str")?;
        if len == 0 {
            return Ok(String::new());
        }
        if data.is_null() {
            return Err(Error::Invalid("a string without bytes".into()));
        }
        // SAFETY: the string's `len` bytes, alive until it is deleted below.
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) };
        String::from_utf8(bytes.to_vec()).map_err(|e| Error::Invalid(format!("not UTF-8 ({e})")))
    };
    let s = read();
    // SAFETY: the owning handle, freed once, after its bytes were copied.
    let _ = unsafe { delete(h) };
    s
}

/// What decoding a `Tensor?` or `Tensor[]` argument asks of torch (a trait, so the decoding and
/// every free it makes can be tested with counters).
pub(crate) trait Unbox {
    /// What an owning handle becomes (dropping it deletes the handle).
    type Tensor;
    /// The tensor of an owning handle (`None` for NULL).
    ///
    /// # Safety
    ///
    /// `raw` is NULL or an owning tensor handle nothing else deletes.
    unsafe fn tensor(&self, raw: StableIValue) -> Option<Self::Tensor>;
    /// Frees an optional argument's box (`Err`: it cannot be freed here; it is leaked).
    ///
    /// # Safety
    ///
    /// `b` is a box torch made for an optional argument, freed once.
    unsafe fn free_box(&self, b: *mut StableIValue) -> Result<(), String>;
    /// A list's length.
    ///
    /// # Safety
    ///
    /// `l` is a live list.
    unsafe fn list_size(&self, l: StableListHandle) -> Result<usize, String>;
    /// A list's item `i` (below its length), its encoding copied out.
    ///
    /// # Safety
    ///
    /// `l` is a live list.
    unsafe fn list_item(&self, l: StableListHandle, i: usize) -> Result<StableIValue, String>;
    /// Frees a list (not what its items own).
    ///
    /// # Safety
    ///
    /// `l` is an owning list, freed once.
    unsafe fn free_list(&self, l: StableListHandle);
}

impl Unbox for &'static Torch {
    type Tensor = Tensor;

    unsafe fn tensor(&self, raw: StableIValue) -> Option<Tensor> {
        // SAFETY: the caller's contract.
        unsafe { Tensor::from_raw(self, raw as usize as AtenTensorHandle) }
    }

    unsafe fn free_box(&self, b: *mut StableIValue) -> Result<(), String> {
        // torch 2.13+ frees it with its own function (a plain `delete`); before, torch made it
        // with C++ `new`, so C++ `delete` frees it.
        if let Some(f) = self.syms.torch_delete_stable_ivalue {
            // SAFETY: the caller's contract: torch's box, freed once.
            return if unsafe { f(b) } == 0 {
                Ok(())
            } else {
                Err("torch_delete_stable_ivalue failed".into())
            };
        }
        match self.syms._ZdlPv {
            Some(f) => {
                // SAFETY: as above: a `new StableIValue` of this libtorch's C++ runtime.
                unsafe { f(b.cast()) };
                Ok(())
            }
            None => Err("this torch exports no function to free an optional argument's box".into()),
        }
    }

    unsafe fn list_size(&self, l: StableListHandle) -> Result<usize, String> {
        let f = self.need(self.syms.torch_list_size, "torch_list_size").map_err(|e| e.to_string())?;
        let mut n = 0usize;
        // SAFETY: a live list and a place for its length.
        self.check(unsafe { f(l, &mut n) }, "torch_list_size").map_err(|e| e.to_string())?;
        Ok(n)
    }

    unsafe fn list_item(&self, l: StableListHandle, i: usize) -> Result<StableIValue, String> {
        let f = self.need(self.syms.torch_list_get_item, "torch_list_get_item").map_err(|e| e.to_string())?;
        let mut v: StableIValue = 0;
        // SAFETY: a live list, an index below its length, a place for the item.
        self.check(unsafe { f(l, i, &mut v) }, "torch_list_get_item").map_err(|e| e.to_string())?;
        Ok(v)
    }

    unsafe fn free_list(&self, l: StableListHandle) {
        if let Some(f) = self.syms.torch_delete_list {
            // SAFETY: the caller's contract: an owning list, freed once.
            let _ = unsafe { f(l) };
        }
    }
}

/// A `Tensor?` argument taken off the stack: `raw` is 0 (None) or a box holding an owning
/// tensor handle; the box is freed here (once), the tensor owned by the result.
///
/// # Safety
///
/// `raw` is a `Tensor?` argument torch put on a kernel's stack (owned by the kernel).
pub(crate) unsafe fn take_optional<U: Unbox>(u: &U, raw: StableIValue) -> Result<Option<U::Tensor>, String> {
    if raw == 0 {
        return Ok(None);
    }
    let b = raw as usize as *mut StableIValue;
    if !b.is_aligned() {
        return Err("a misaligned optional box".into());
    }
    // SAFETY: a box of one StableIValue (the caller's contract), read before it is freed.
    let inner = unsafe { b.read() };
    // SAFETY: the inner value is an owning handle, now the result's.
    let t = unsafe { u.tensor(inner) };
    // SAFETY: the box, freed once (its content was copied out above).
    let freed = unsafe { u.free_box(b) };
    match (t, freed) {
        (Some(t), Ok(())) => Ok(Some(t)),
        (None, _) => Err("a NULL tensor in its optional box".into()),
        (Some(_), Err(e)) => Err(e),
    }
}

/// A `Tensor[]` argument taken off the stack: every item's owning handle is taken (a NULL item
/// is an error, the others are still taken, so dropped), then the list is freed (once).
///
/// # Safety
///
/// `raw` is a `Tensor[]` argument torch put on a kernel's stack (owned by the kernel).
pub(crate) unsafe fn take_list<U: Unbox>(u: &U, raw: StableIValue) -> Result<Vec<U::Tensor>, String> {
    // SAFETY: the caller's contract; each item of a `Tensor[]` is an owning tensor handle, taken
    // once (by the closure) and now the result's.
    unsafe { take_list_of(u, raw, |item| u.tensor(item)) }
}

/// An `int[]`, `float[]` or `bool[]` argument taken off the stack: its items' words copied (plain
/// values, nothing owned inside), then the list freed (once). The same walk as [`take_list`].
///
/// # Safety
///
/// `raw` is such an argument torch put on a kernel's stack (owned by the kernel).
pub(crate) unsafe fn take_plain_list<U: Unbox>(
    u: &U,
    raw: StableIValue,
) -> Result<Vec<StableIValue>, String> {
    // SAFETY: the caller's contract; a plain item owns nothing, so copying its word is all.
    unsafe { take_list_of(u, raw, Some) }
}

/// The walk of every list argument: each item's encoding handed to `take` (`None`: a NULL
/// tensor; an error, the other items still taken), then the list freed once, whatever failed. A
/// list whose length cannot be read is freed and its items (unreachable) leak, never freed twice.
///
/// # Safety
///
/// `raw` is a list argument torch put on a kernel's stack (owned by the kernel), and `take` may
/// be given each of its items' encodings once.
unsafe fn take_list_of<U: Unbox, T>(
    u: &U,
    raw: StableIValue,
    mut take: impl FnMut(StableIValue) -> Option<T>,
) -> Result<Vec<T>, String> {
    let l = raw as usize as StableListHandle;
    if l.is_null() {
        return Err("a NULL list".into());
    }
    // SAFETY: a live list (the caller's contract).
    let n = match unsafe { u.list_size(l) } {
        Ok(n) => n,
        Err(e) => {
            // SAFETY: the owning list, freed once.
            unsafe { u.free_list(l) };
            return Err(e);
        }
    };
    // A count torch reported, yet never trusted for an allocation up front.
    let mut items = Vec::with_capacity(n.min(1024));
    let mut first_error = None;
    for i in 0..n {
        // SAFETY: a live list, `i` below its length.
        match unsafe { u.list_item(l, i) } {
            Ok(raw) => match take(raw) {
                Some(t) => items.push(t),
                None => {
                    first_error.get_or_insert_with(|| format!("item {i}: a NULL tensor"));
                }
            },
            Err(e) => {
                first_error.get_or_insert_with(|| format!("item {i}: {e}"));
            }
        }
    }
    // SAFETY: the owning list, freed once, after its items were taken.
    unsafe { u.free_list(l) };
    match first_error {
        Some(e) => Err(e),
        None => Ok(items),
    }
}

/// Puts the outputs on the stack, all or none (an unset one fails before anything is written).
///
/// # Safety
///
/// `stack` has room for `outs.kinds.len()` entries.
unsafe fn put_outputs(stack: *mut StableIValue, outs: &mut Outputs) -> Result<(), KernelError> {
    if let Some(i) = outs.values.get().iter().position(Option::is_none) {
        return Err(KernelError(format!("output {i} was not set")));
    }
    for (i, v) in outs.values.get_mut().iter_mut().enumerate() {
        let raw = match v.take().expect("checked above") {
            Value::Tensor(t) => t.into_raw() as usize as u64,
            Value::Int(v) => v as u64,
            Value::Float(v) => v.to_bits(),
            Value::Bool(v) => bool_word(v),
            Value::Str(_)
            | Value::IntList(_)
            | Value::FloatList(_)
            | Value::BoolList(_)
            | Value::OptTensor(_)
            | Value::TensorList(_) => {
                unreachable!("Outputs::set refuses str, lists and Tensor?")
            }
        };
        // SAFETY: entry i < num_outputs of torch's stack; torch takes the handle.
        unsafe { stack.add(i).write(raw) };
    }
    Ok(())
}

/// A bool as the stack holds it: one byte at the u64's lowest address (torch memcpy's it into
/// a zeroed word).
fn bool_word(v: bool) -> StableIValue {
    let mut b = [0u8; 8];
    b[0] = v as u8;
    u64::from_ne_bytes(b)
}

/// Throws `op: message` to torch as a `c10::Error` (through `aoti_torch_check`).
#[cold]
#[inline(never)]
fn throw(torch: &Torch, op: &str, e: &KernelError) -> ! {
    let msg = CString::new(format!("{op}: {}", e.0).replace('\0', "\\0")).expect("NUL bytes replaced");
    match torch.syms.aoti_torch_check {
        Some(check) => {
            // SAFETY: static NUL-terminated strings and the message, alive through the call
            // (c10::Error copies it). `check(false, ..)` throws: the exception unwinds through
            // this frame (dropping `msg`) and the kernel's `C-unwind` frame into torch.
            unsafe {
                check(
                    false,
                    c"dlbridge::torch_stable kernel".as_ptr(),
                    c"dlbridge/torch_stable".as_ptr(),
                    0,
                    msg.as_ptr(),
                )
            };
            eprintln!("dlbridge: aoti_torch_check returned instead of throwing: {}", msg.to_string_lossy());
        }
        None => {
            eprintln!("dlbridge: a kernel failed and this torch cannot be told: {}", msg.to_string_lossy())
        }
    }
    std::process::abort()
}

#[cold]
fn no_torch() -> ! {
    eprintln!("dlbridge: a torch_stable kernel ran before dlbridge found torch (register through Library)");
    std::process::abort()
}

impl Torch {
    /// Calls op `op` (e.g. `"aten::add"`, `"my_ns::my_op"`), overload `overload` (`""` for the
    /// default) through the dispatcher with `args`, and returns its results decoded as `rets`
    /// (`torch_call_dispatcher`, or `aoti_torch_call_dispatcher` before torch 2.10). `int[]`,
    /// `float[]` and `bool[]` arguments, and list or optional results, are refused
    /// ([`Error::Invalid`]).
    ///
    /// `Tensor?` arguments go in a new box, `Tensor[]` arguments in a new list (torch frees both).
    /// Torch takes the arguments (tensor handles, strings, boxes and lists) once it found the op; when it
    /// fails before that (no such op) it frees none of them, and which it took is not said, so
    /// they are leaked rather than risk a double free. An error the op (or its kernel) threw is
    /// [`Error::Call`] with its message (torch 2.13+).
    ///
    /// # Safety
    ///
    /// When the op exists, `args` match its schema's arguments one for one (a `Tensor` where it
    /// takes a `Tensor`, an `Int` for `int`/`SymInt`, ...: torch decodes each word as the schema
    /// says, and has no way to check) and `rets` its returns. The stack carries no types.
    pub unsafe fn call(
        &'static self,
        op: &str,
        overload: &str,
        args: Vec<Value>,
        rets: &[ArgKind],
    ) -> Result<Vec<Value>> {
        let c_op = CString::new(op).map_err(|_| Error::Invalid(format!("op: {op:?} contains a NUL byte")))?;
        let c_ov = CString::new(overload)
            .map_err(|_| Error::Invalid(format!("overload: {overload:?} contains a NUL byte")))?;
        if let Some(k) = rets.iter().find(|k| {
            matches!(
                k,
                ArgKind::TensorMut
                    | ArgKind::IntList
                    | ArgKind::FloatList
                    | ArgKind::BoolList
                    | ArgKind::OptTensor
                    | ArgKind::TensorList
            )
        }) {
            return Err(Error::Invalid(format!("rets: a result of kind {k:?}")));
        }
        // (Lists are kernel arguments only: a dispatcher call takes none.)
        if let Some(v) =
            args.iter().find(|v| matches!(v, Value::IntList(_) | Value::FloatList(_) | Value::BoolList(_)))
        {
            return Err(Error::Invalid(format!(
                "args: a {} (lists are not passed to dispatcher calls)",
                v.kind_name()
            )));
        }
        // Found before anything is encoded, so a missing function leaks nothing.
        let call_new = self.syms.torch_call_dispatcher;
        let call_old = match call_new {
            Some(_) => None,
            None => Some(self.need(self.syms.aoti_torch_call_dispatcher, "aoti_torch_call_dispatcher")?),
        };
        let mut stack: Vec<StableIValue> = vec![0; args.len().max(rets.len())];
        // Strings first (the only encoding that can fail), so a failure frees what it made.
        let mut strings: Vec<(usize, StringHandle)> = Vec::new();
        for (i, v) in args.iter().enumerate() {
            if let Value::Str(s) = v {
                match self.new_string(s) {
                    Ok(h) => strings.push((i, h)),
                    Err(e) => {
                        for (_, h) in strings {
                            // SAFETY: handles made just above, not given to torch.
                            unsafe { self.delete_string(h) };
                        }
                        return Err(e);
                    }
                }
            }
        }
        // Then optional boxes and lists (their items the tensors' handles, still owned by `args`
        // until every encoding succeeded): a failure frees what was made, strings included.
        let boxed = match self.box_and_list(&args, &mut stack) {
            Ok(made) => made,
            Err(e) => {
                for (_, h) in strings {
                    // SAFETY: handles made just above, not given to torch.
                    unsafe { self.delete_string(h) };
                }
                return Err(e);
            }
        };
        debug_assert!(boxed <= args.len());
        for (i, h) in strings {
            stack[i] = h as usize as u64;
        }
        for (i, v) in args.into_iter().enumerate() {
            stack[i] = match v {
                Value::Tensor(t) => t.into_raw() as usize as u64,
                Value::Int(v) => v as u64,
                Value::Float(v) => v.to_bits(),
                Value::Bool(v) => bool_word(v),
                Value::Str(_) => stack[i],
                Value::IntList(_) | Value::FloatList(_) | Value::BoolList(_) => unreachable!("refused above"),
                // The box or list (made above) holds the handles, which torch now owns.
                Value::OptTensor(t) => {
                    t.map(Tensor::into_raw);
                    stack[i]
                }
                Value::TensorList(ts) => {
                    ts.into_iter().for_each(|t| {
                        t.into_raw();
                    });
                    stack[i]
                }
            };
        }
        let code = match (call_new, call_old) {
            // SAFETY: NUL-terminated names and a stack of max(args, rets) entries encoded as the
            // schema's types (the caller's values; a mismatch is torch's error to report).
            (Some(f), _) => unsafe {
                f(c_op.as_ptr(), c_ov.as_ptr(), stack.as_mut_ptr(), EXTENSION_ABI_VERSION)
            },
            // SAFETY: as above.
            (None, Some(f)) => unsafe { f(c_op.as_ptr(), c_ov.as_ptr(), stack.as_mut_ptr()) },
            (None, None) => unreachable!("one was found above"),
        };
        self.check(code, "torch_call_dispatcher")?;
        let mut out = Vec::with_capacity(rets.len());
        let mut first_error = None;
        for (i, &k) in rets.iter().enumerate() {
            let raw = stack[i];
            out.push(match k {
                ArgKind::Tensor => {
                    // SAFETY: a Tensor result is a new owning handle (torch's from_ivalue).
                    let t = unsafe { Tensor::from_raw(self, raw as usize as AtenTensorHandle) };
                    match t {
                        Some(t) => Value::Tensor(t),
                        None => {
                            first_error
                                .get_or_insert_with(|| Error::Invalid(format!("result {i}: a NULL tensor")));
                            continue;
                        }
                    }
                }
                ArgKind::Int => Value::Int(raw as i64),
                ArgKind::Float => Value::Float(f64::from_bits(raw)),
                ArgKind::Bool => Value::Bool(raw.to_ne_bytes()[0] != 0),
                // SAFETY: a str result is an owning string handle.
                ArgKind::Str => match unsafe { take_string(self, raw as usize as StringHandle) } {
                    Ok(s) => Value::Str(s),
                    Err(e) => {
                        first_error.get_or_insert(e);
                        continue;
                    }
                },
                ArgKind::TensorMut
                | ArgKind::IntList
                | ArgKind::FloatList
                | ArgKind::BoolList
                | ArgKind::OptTensor
                | ArgKind::TensorList => {
                    unreachable!("refused above")
                }
            });
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Encodes each `Tensor?` argument with a tensor as a new box and each `Tensor[]` argument
    /// as a new list, holding the tensors' handles (still owned by `args`), into `stack`; returns
    /// how many it made. A failure frees every box and list made, and nothing else.
    fn box_and_list(&'static self, args: &[Value], stack: &mut [StableIValue]) -> Result<usize> {
        enum Made {
            Box(*mut StableIValue),
            List(StableListHandle),
        }
        let mut made: Vec<Made> = Vec::new();
        let free = |made: Vec<Made>| {
            for m in made {
                match m {
                    // SAFETY: a box made below, not given to torch.
                    Made::Box(b) => unsafe {
                        let _ = Unbox::free_box(&self, b);
                    },
                    // SAFETY: a list made below, not given to torch (its items are borrowed handles).
                    Made::List(l) => unsafe { Unbox::free_list(&self, l) },
                }
            }
        };
        for (i, v) in args.iter().enumerate() {
            let mut step = || -> Result<Option<Made>> {
                match v {
                    Value::OptTensor(Some(t)) => {
                        let new = self.need(self.syms.torch_new_stable_ivalue, "torch_new_stable_ivalue")?;
                        self.need(self.syms.torch_delete_stable_ivalue, "torch_delete_stable_ivalue")?;
                        let mut b: *mut StableIValue = std::ptr::null_mut();
                        // SAFETY: a place for the new box.
                        self.check(unsafe { new(&mut b) }, "torch_new_stable_ivalue")?;
                        if b.is_null() || !b.is_aligned() {
                            return Err(Error::Call {
                                function: "torch_new_stable_ivalue",
                                message: "returned NULL".into(),
                            });
                        }
                        // SAFETY: a new box of one StableIValue.
                        unsafe { b.write(t.as_raw() as usize as u64) };
                        stack[i] = b as usize as u64;
                        Ok(Some(Made::Box(b)))
                    }
                    Value::OptTensor(None) => {
                        stack[i] = 0;
                        Ok(None)
                    }
                    Value::TensorList(ts) => {
                        let new =
                            self.need(self.syms.torch_new_list_reserve_size, "torch_new_list_reserve_size")?;
                        let push = self.need(self.syms.torch_list_push_back, "torch_list_push_back")?;
                        self.need(self.syms.torch_delete_list, "torch_delete_list")?;
                        let mut l: StableListHandle = std::ptr::null_mut();
                        // SAFETY: a place for the new list.
                        self.check(unsafe { new(ts.len(), &mut l) }, "torch_new_list_reserve_size")?;
                        if l.is_null() {
                            return Err(Error::Call {
                                function: "torch_new_list_reserve_size",
                                message: "returned NULL".into(),
                            });
                        }
                        for t in ts {
                            // SAFETY: a live list; the handle stays owned by its Tensor until the call.
                            let code = unsafe { push(l, t.as_raw() as usize as u64) };
                            if let Err(e) = self.check(code, "torch_list_push_back") {
                                // SAFETY: the list made above, freed once (its items are borrowed).
                                unsafe { Unbox::free_list(&self, l) };
                                return Err(e);
                            }
                        }
                        stack[i] = l as usize as u64;
                        Ok(Some(Made::List(l)))
                    }
                    _ => Ok(None),
                }
            };
            match step() {
                Ok(Some(m)) => made.push(m),
                Ok(None) => {}
                Err(e) => {
                    free(made);
                    return Err(e);
                }
            }
        }
        Ok(made.len())
    }

    fn new_string(&self, s: &str) -> Result<StringHandle> {
        let f = self.need(self.syms.torch_new_string_handle, "torch_new_string_handle")?;
        self.need(self.syms.torch_delete_string, "torch_delete_string")?;
        let mut h: StringHandle = std::ptr::null_mut();
        // SAFETY: `s.len()` bytes (torch copies them) and a place for the handle.
        let code = unsafe { f(s.as_ptr().cast(), s.len(), &mut h) };
        self.check(code, "torch_new_string_handle")?;
        if h.is_null() {
            return Err(Error::Call { function: "torch_new_string_handle", message: "returned NULL".into() });
        }
        Ok(h)
    }

    /// # Safety
    ///
    /// `h` is an owning string handle nothing else frees.
    unsafe fn delete_string(&self, h: StringHandle) {
        if let Some(f) = self.syms.torch_delete_string {
            // SAFETY: the caller's contract.
            let _ = unsafe { f(h) };
        }
    }
}

#[cfg(test)]
mod unbox_tests {
    //! The decoding of `Tensor?` and `Tensor[]` arguments and what it frees, counted: each box,
    //! list and tensor handle freed exactly once, whatever fails.

    use std::cell::Cell;

    use super::{StableIValue, StableListHandle, Unbox, take_list, take_optional, take_plain_list};

    /// Handles are boxed ids; boxes are `Box<u64>`; lists `Box<Vec<u64>>`. Every free counted.
    #[derive(Default)]
    struct Counting {
        tensors_deleted: Cell<usize>,
        boxes_freed: Cell<usize>,
        lists_freed: Cell<usize>,
        /// Make list_item fail at this index.
        fail_item: Option<usize>,
    }

    /// An owning fake handle: deleting it counts.
    #[derive(Debug)]
    struct Handle<'c>(Box<u32>, &'c Cell<usize>);

    impl Drop for Handle<'_> {
        fn drop(&mut self) {
            self.1.set(self.1.get() + 1);
        }
    }

    fn handle(id: u32) -> StableIValue {
        Box::into_raw(Box::new(id)) as usize as u64
    }

    impl<'c> Unbox for &'c Counting {
        type Tensor = Handle<'c>;

        unsafe fn tensor(&self, raw: StableIValue) -> Option<Handle<'c>> {
            let p = raw as usize as *mut u32;
            // SAFETY: made by handle() (an owning box), taken once.
            (!p.is_null()).then(|| Handle(unsafe { Box::from_raw(p) }, &self.tensors_deleted))
        }

        unsafe fn free_box(&self, b: *mut StableIValue) -> Result<(), String> {
            // SAFETY: made by Box::into_raw in the test, freed once.
            drop(unsafe { Box::from_raw(b) });
            self.boxes_freed.set(self.boxes_freed.get() + 1);
            Ok(())
        }

        unsafe fn list_size(&self, l: StableListHandle) -> Result<usize, String> {
            // SAFETY: a live Box<Vec<u64>> of the test.
            Ok(unsafe { (&*l.cast::<Vec<u64>>()).len() })
        }

        unsafe fn list_item(&self, l: StableListHandle, i: usize) -> Result<StableIValue, String> {
            if self.fail_item == Some(i) {
                return Err("refused".into());
            }
            // SAFETY: as above; i below the length.
            Ok(unsafe { (&*l.cast::<Vec<u64>>())[i] })
        }

        unsafe fn free_list(&self, l: StableListHandle) {
            // SAFETY: made by Box::into_raw in the test, freed once.
            drop(unsafe { Box::from_raw(l.cast::<Vec<u64>>()) });
            self.lists_freed.set(self.lists_freed.get() + 1);
        }
    }

    fn list(items: Vec<u64>) -> StableIValue {
        Box::into_raw(Box::new(items)) as usize as u64
    }

    #[test]
    fn an_optional_tensor_frees_its_box_once_and_owns_the_tensor() {
        let c = Counting::default();
        // SAFETY: 0 is None.
        assert!(unsafe { take_optional(&&c, 0) }.unwrap().is_none());
        assert_eq!(c.boxes_freed.get(), 0);
        let boxed = Box::into_raw(Box::new(handle(7))) as usize as u64;
        // SAFETY: a box of an owning handle.
        let t = unsafe { take_optional(&&c, boxed) }.unwrap().unwrap();
        assert_eq!((*t.0, c.boxes_freed.get(), c.tensors_deleted.get()), (7, 1, 0));
        drop(t);
        assert_eq!(c.tensors_deleted.get(), 1);
        // A box holding NULL: an error, the box still freed once.
        let boxed = Box::into_raw(Box::new(0u64)) as usize as u64;
        // SAFETY: as above.
        assert!(unsafe { take_optional(&&c, boxed) }.unwrap_err().contains("NULL tensor"));
        assert_eq!((c.boxes_freed.get(), c.tensors_deleted.get()), (2, 1));
    }

    #[test]
    fn a_list_frees_itself_once_and_owns_each_tensor() {
        let c = Counting::default();
        let l = list(vec![handle(1), handle(2), handle(3)]);
        // SAFETY: an owning list of owning handles.
        let items = unsafe { take_list(&&c, l) }.unwrap();
        assert_eq!(items.iter().map(|h| *h.0).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!((c.lists_freed.get(), c.tensors_deleted.get()), (1, 0));
        drop(items);
        assert_eq!(c.tensors_deleted.get(), 3);
        // SAFETY: an empty list.
        assert!(unsafe { take_list(&&c, list(vec![])) }.unwrap().is_empty());
        assert_eq!(c.lists_freed.get(), 2);
        // SAFETY: NULL is refused before anything is read.
        assert!(unsafe { take_list(&&c, 0) }.unwrap_err().contains("NULL list"));
    }

    #[test]
    fn a_bad_item_fails_the_list_and_every_other_item_is_still_deleted() {
        let c = Counting::default();
        let l = list(vec![handle(1), 0, handle(3)]);
        // SAFETY: an owning list of owning handles (one NULL).
        let e = unsafe { take_list(&&c, l) }.unwrap_err();
        assert!(e.contains("item 1: a NULL tensor"), "{e}");
        assert_eq!((c.lists_freed.get(), c.tensors_deleted.get()), (1, 2));
        let c = Counting { fail_item: Some(0), ..Counting::default() };
        let leaked = handle(9);
        let l = list(vec![leaked, handle(2)]);
        // SAFETY: as above; item 0 cannot be read (it stays unreachable, never freed twice).
        let e = unsafe { take_list(&&c, l) }.unwrap_err();
        assert!(e.contains("item 0: refused"), "{e}");
        assert_eq!((c.lists_freed.get(), c.tensors_deleted.get()), (1, 1));
        // SAFETY: the unreadable item's handle, freed by the test (not leaked under Miri).
        drop(unsafe { Box::from_raw(leaked as usize as *mut u32) });
    }

    #[test]
    fn a_plain_list_copies_its_words_and_frees_itself_once() {
        let c = Counting::default();
        let words = vec![3u64, u64::MAX, 0];
        // SAFETY: an owning list of plain words.
        assert_eq!(unsafe { take_plain_list(&&c, list(words.clone())) }.unwrap(), words);
        assert_eq!((c.lists_freed.get(), c.tensors_deleted.get()), (1, 0));
        // SAFETY: NULL is refused before anything is read.
        assert!(unsafe { take_plain_list(&&c, 0) }.unwrap_err().contains("NULL list"));
        // An item that cannot be read fails the list, which is still freed once.
        let c = Counting { fail_item: Some(1), ..Counting::default() };
        // SAFETY: as above.
        let e = unsafe { take_plain_list(&&c, list(vec![1, 2])) }.unwrap_err();
        assert!(e.contains("item 1: refused"), "{e}");
        assert_eq!(c.lists_freed.get(), 1);
    }
}

#[cfg(test)]
mod slots_tests {
    //! The values a kernel's argument and output slots hold are each dropped exactly once
    //! (Miri reports a leak or a double free): inline slots drop only their first `len`, the
    //! only ones ever set.

    use super::{Slots, Value};

    fn filled(n: usize, set: &[usize]) -> Slots {
        let mut s = Slots::new(n);
        for &i in set {
            s.get_mut()[i] = Some(Value::Str(format!("value {i}")));
        }
        s
    }

    #[test]
    fn inline_slots_drop_what_they_hold() {
        assert!(matches!(Slots::new(3), Slots::Inline { len: 3, .. }));
        drop(filled(3, &[0, 2]));
        drop(filled(8, &[0, 1, 2, 3, 4, 5, 6, 7]));
        drop(filled(0, &[]));
    }

    #[test]
    fn taken_and_replaced_values_drop_once() {
        let mut s = filled(4, &[1, 3]);
        let taken = s.get_mut()[1].take();
        assert!(matches!(taken, Some(Value::Str(ref v)) if v == "value 1"));
        s.get_mut()[3] = Some(Value::IntList(vec![1, 2, 3]));
        assert_eq!(s.get().iter().filter(|v| v.is_some()).count(), 1);
        drop(s);
        drop(taken);
    }

    #[test]
    fn heap_slots_drop_what_they_hold() {
        let s = filled(Slots::INLINE + 1, &[0, Slots::INLINE]);
        assert!(matches!(s, Slots::Heap(ref v) if v.len() == Slots::INLINE + 1));
        drop(s);
    }
}
