//! Native torch ops through torch's stable C ABI (feature `torch-stable`, Unix).
//!
//! libtorch exports C functions it keeps stable across releases (`aoti_torch_*`, `torch_*`: what
//! torch's own `STABLE_TORCH_LIBRARY` macros call). This module finds them at run time in the
//! libtorch the process already has ([`Torch::attach`]: `dlopen` of `libtorch_cpu.so` with
//! `RTLD_NOLOAD`, then `dlsym` of each), so the crate neither links torch nor needs its headers.
//! Every function is optional: one the running torch lacks is an [`Error::Missing`] naming it
//! and the torch version, when (and only when) something needs it.
//!
//! With it, a Rust kernel is a torch operator: [`Library`] declares a namespace and an op's
//! schema and registers boxed kernels for a dispatch key (`"CPU"`, `"Meta"`, ...); a kernel is an
//! `unsafe extern "C-unwind" fn(*mut StableIValue, u64, u64)` whose body runs through
//! [`run_boxed`] ([`NativeKernel`] and [`register_kernel`] make and register one safely), which takes the arguments off torch's stack as owned values ([`Value`],
//! [`Tensor`]), catches panics, and reports an error to torch the documented way (a C++
//! exception thrown by `aoti_torch_check` once every handle it held is freed: Python sees a
//! `RuntimeError`). [`Tensor`] is an owning `AtenTensorHandle` read through the stable
//! accessors; [`Torch::empty_strided`] allocates. [`xla`] runs an XLA FFI handler (the body a
//! kernel already has for `jax.jit`) as the op's CPU kernel, and its output rule as the Meta
//! kernel.
//!
//! ```no_run
//! use dlbridge::torch_stable::{
//!     ArgKind, Args, KernelError, NativeKernel, OpSignature, Outputs, Torch, Value, register_kernel,
//! };
//!
//! /// `my_ns::neg_f32(Tensor x) -> Tensor`.
//! struct Neg;
//! impl NativeKernel for Neg {
//!     const SIGNATURE: OpSignature = OpSignature::new("neg_f32", &[("x", ArgKind::Tensor)], &[ArgKind::Tensor]);
//!     fn run(args: &mut Args, out: &mut Outputs) -> Result<(), KernelError> {
//!         let x = args.tensor(0)?;
//!         let y = x.torch().empty_like_contiguous(x)?;
//!         // ... compute into y through y.data_ptr() ...
//!         out.set(0, Value::Tensor(y))
//!     }
//! }
//!
//! let torch = Torch::attach()?; // the libtorch the process has (after `import torch`)
//! register_kernel::<Neg>(torch, "my_ns", &["CPU"])?; // torch.ops.my_ns.neg_f32
//! # Ok::<(), dlbridge::torch_stable::Error>(())
//! ```
//!
//! **Ownership** (torch's rule: "the stack always has ownership"): every tensor argument arrives
//! as a new owning handle, taken by [`run_boxed`] into a [`Tensor`] that deletes it exactly once;
//! strings are copied and their handles freed; an output is a fresh owning handle torch takes.
//! [`Library`] handles are never deleted (deleting one de-registers what it registered), so a
//! registration lasts for the process.

mod borrowed;
mod kernel;
mod library;
mod signature;
pub mod sys;
mod tensor;
pub mod xla;

use std::ffi::{CStr, CString, c_void};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

pub use borrowed::Describer;
pub use kernel::{Args, KernelError, NativeKernel, Outputs, Value, boxed_kernel, register_kernel, run_boxed};
pub use library::Library;
pub use signature::{ArgKind, OpSignature};
/// Keeps a block for the process, reachable (leak checkers see it as such), for what an op needs.
pub(crate) use signature::{keep, string_literal};
pub use tensor::{DeviceKind, Tensor, TorchDevice};

use crate::DataType;
use sys::Symbols;

/// The ABI version whose conventions this module implements, passed to the versioned entry
/// points (`torch_library_impl`, `torch_call_dispatcher`): torch 2.10, the first release with
/// them (`TORCH_ABI_VERSION` layout: major << 56 | minor << 48 | patch << 40). Every conversion
/// this module uses has the same encoding from 2.10 to 2.15.
pub const EXTENSION_ABI_VERSION: u64 = 0x020A_0000_0000_0000;

/// What can go wrong with torch's stable ABI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// libtorch could not be found or opened.
    NotLoaded {
        /// What was looked for (a path, or `libtorch_cpu.so`).
        library: String,
        /// Why it is not available.
        reason: String,
    },
    /// The running libtorch does not export a function this needs (an older torch).
    Missing {
        /// The C function's name.
        symbol: &'static str,
        /// The running torch's version (`aoti_torch_abi_version`), or why it is unknown.
        torch: String,
    },
    /// A torch function returned an error code.
    Call {
        /// The C function.
        function: &'static str,
        /// torch's message (torch 2.13+), or a note that this torch only logs it.
        message: String,
    },
    /// An argument this module was given is invalid (names the field and the value).
    Invalid(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotLoaded { library, reason } => {
                write!(f, "libtorch ({library}) is not available: {reason}")
            }
            Self::Missing { symbol, torch } => {
                write!(f, "torch {torch} does not export {symbol} (a newer torch has it)")
            }
            Self::Call { function, message } => write!(f, "{function} failed: {message}"),
            Self::Invalid(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}

impl Error {
    /// Whether this process cannot host the op natively, so that a caller with another way
    /// (a Python custom op) takes it: no libtorch loaded ([`Error::NotLoaded`]), a function this
    /// torch lacks ([`Error::Missing`]), or an op this module cannot express
    /// ([`Error::Invalid`]: too many arguments, a default it cannot write, the runtime slots
    /// used up). A torch call that failed ([`Error::Call`]) is not: torch refused the op.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Self::NotLoaded { .. } | Self::Missing { .. } | Self::Invalid(_))
    }
}

/// torch's version-counter rules for a tensor an op writes in place (`Tensor(a!)`), which the
/// stable ABI lacks; see [`set_version_hooks`]. Each function gets the tensor's
/// `AtenTensorHandle` (an `at::Tensor*`).
#[derive(Debug, Clone, Copy)]
pub struct VersionHooks {
    /// Whether the tensor may be written now: `false` for one without a version counter (an
    /// inference tensor) while inference mode is off, which torch refuses.
    pub may_write: unsafe fn(sys::AtenTensorHandle) -> bool,
    /// Adds one to the tensor's version counter, where it has one.
    pub bump: unsafe fn(sys::AtenTensorHandle),
    /// Whether autograd would lose track of the tensor in this call: it requires grad while grad
    /// mode is on (outside inference mode). An op's CPU kernel only sees that when no autograd
    /// formula is registered for it (a registered one runs the op with grad mode off), so its
    /// result would silently carry no gradient: the call is refused.
    pub untracked_grad: unsafe fn(sys::AtenTensorHandle) -> bool,
}

static VERSION_HOOKS: OnceLock<VersionHooks> = OnceLock::new();

/// Installs the functions the CPU kernel of an op that writes a `Tensor(a!)` argument calls on
/// that argument ([`xla`]): `may_write` before the handler runs (`false` refuses the call, as
/// torch refuses writing an inference tensor outside inference mode), `bump` after it succeeded;
/// and `untracked_grad`, which it calls on every tensor argument before the handler runs (`true`
/// refuses the call: gradients right or refused).
/// torch's `ADInplaceOrView` fallback is a fallthrough for natively registered ops, so without
/// them an eager in-place call leaves `_version` unchanged and writes an inference tensor
/// anywhere. Whoever can reach torch's C++ functions (dlbridge's Python layer, through its
/// verified symbols) installs them; without them nothing is checked or bumped. The first ones
/// installed stay; returns whether these were.
///
/// # Safety
///
/// Each function, given a live `AtenTensorHandle` of a defined tensor of this process's
/// libtorch, on any thread, with or without Python's GIL, must do nothing but what its field
/// says (read the tensor's counter, its `requires_grad` and the thread's grad and inference
/// modes; add one to the counter), and must neither unwind nor throw.
pub unsafe fn set_version_hooks(hooks: VersionHooks) -> bool {
    VERSION_HOOKS.set(hooks).is_ok()
}

/// Whether version hooks are installed ([`set_version_hooks`]).
pub fn has_version_hooks() -> bool {
    VERSION_HOOKS.get().is_some()
}

/// The installed version hooks, if any.
fn version_hooks() -> Option<VersionHooks> {
    VERSION_HOOKS.get().copied()
}

/// The result of this module's functions.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// dtype and device codes, asked of torch once (their values are not part of the ABI).
#[derive(Debug, Clone, Copy)]
struct Codes {
    dtypes: [(i32, DataType); 15],
    cpu: i32,
    cuda: Option<i32>,
    meta: Option<i32>,
}

/// The stable C functions of the process's libtorch, found at run time. One per process
/// ([`Torch::attach`], [`Torch::open`]); every [`Tensor`] and [`Library`] refers to it.
pub struct Torch {
    syms: Symbols,
    codes: Codes,
    library: PathBuf,
}

impl fmt::Debug for Torch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Torch").field("library", &self.library).field("version", &self.version()).finish()
    }
}

static TORCH: OnceLock<Torch> = OnceLock::new();
static LOADING: Mutex<()> = Mutex::new(());

/// The file name of the library that exports the stable functions.
#[cfg(target_os = "macos")]
pub const LIBTORCH_CPU: &str = "libtorch_cpu.dylib";
/// The file name of the library that exports the stable functions.
#[cfg(not(target_os = "macos"))]
pub const LIBTORCH_CPU: &str = "libtorch_cpu.so";

impl Torch {
    /// The process's torch, once one of [`attach`](Self::attach), [`attach_path`](Self::attach_path)
    /// or [`open`](Self::open) succeeded.
    pub fn get() -> Option<&'static Torch> {
        TORCH.get()
    }

    /// The libtorch this process has already loaded (after `import torch`, or a C++ program linked
    /// against it), found among the loaded objects (Linux: `dl_iterate_phdr`) and reached with
    /// `dlopen(RTLD_NOLOAD)`: nothing is loaded. [`Error::NotLoaded`] when the process has none.
    #[cfg(target_os = "linux")]
    pub fn attach() -> Result<&'static Torch> {
        if let Some(t) = TORCH.get() {
            return Ok(t);
        }
        let Some(path) = loaded_libtorch() else {
            return Err(Error::NotLoaded {
                library: LIBTORCH_CPU.into(),
                reason: "this process has not loaded it (import torch first)".into(),
            });
        };
        Self::attach_path(&path)
    }

    /// The libtorch at `path` (torch's `lib/libtorch_cpu.so`), which the process must already
    /// have loaded (`dlopen(RTLD_NOLOAD)`: nothing is loaded; [`Error::NotLoaded`] otherwise).
    pub fn attach_path(path: &Path) -> Result<&'static Torch> {
        Self::load(path, libc::RTLD_NOW | libc::RTLD_NOLOAD)
    }

    /// Loads the libtorch at `path` (`dlopen(RTLD_NOW | RTLD_LOCAL)`), for a process without
    /// Python's torch: a Rust program or test, a C++ runner. Its static initialisers register
    /// torch's own operators. It stays loaded for the process.
    ///
    /// Like [`attach_path`](Self::attach_path), once a torch was found this returns that one,
    /// whatever `path` says (a process has one libtorch).
    pub fn open(path: &Path) -> Result<&'static Torch> {
        Self::load(path, libc::RTLD_NOW | libc::RTLD_LOCAL)
    }

    fn load(path: &Path, flags: i32) -> Result<&'static Torch> {
        if let Some(t) = TORCH.get() {
            return Ok(t);
        }
        let _guard = LOADING.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = TORCH.get() {
            return Ok(t);
        }
        let shown = path.display().to_string();
        let c = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::Invalid(format!("path: {shown:?} contains a NUL byte")))?;
        // SAFETY: a NUL-terminated path; dlopen has no other precondition. The handle is never
        // closed: the functions found in it are used for the rest of the process.
        let handle = unsafe { libc::dlopen(c.as_ptr(), flags) };
        if handle.is_null() {
            return Err(Error::NotLoaded { library: shown, reason: dlerror() });
        }
        // SAFETY: a live handle of libtorch_cpu, whose exports of these names have the signatures
        // of torch's stable C ABI (torch promises them).
        let syms = unsafe { Symbols::resolve(handle) };
        // Without these nothing this module makes could be freed or typed.
        let codes = syms
            .aoti_torch_delete_tensor_object
            .ok_or("aoti_torch_delete_tensor_object")
            .and_then(|_| Codes::ask(&syms))
            .map_err(|symbol| Error::Missing { symbol, torch: version_of(&syms) })?;
        let torch = Torch { syms, codes, library: path.to_path_buf() };
        Ok(TORCH.get_or_init(|| torch))
    }

    /// The path of the libtorch found.
    pub fn library(&self) -> &Path {
        &self.library
    }

    /// The running torch's ABI version (`aoti_torch_abi_version`: major << 56 | minor << 48 |
    /// patch << 40), `None` when this torch does not export it.
    pub fn abi_version(&self) -> Option<u64> {
        // SAFETY: a function of torch's stable ABI taking nothing.
        self.syms.aoti_torch_abi_version.map(|f| unsafe { f() })
    }

    /// The running torch's version as `"2.15.0"` (from [`abi_version`](Self::abi_version)).
    pub fn version(&self) -> String {
        version_of(&self.syms)
    }

    /// Whether this torch exports the C function `name`, one of those this module uses
    /// ([`sys`]'s table; `false` for any other name).
    pub fn has(&self, name: &str) -> bool {
        self.syms.has(name)
    }

    /// `f` if present, else [`Error::Missing`] naming `name`.
    #[inline]
    fn need<F>(&self, f: Option<F>, name: &'static str) -> Result<F> {
        match f {
            Some(f) => Ok(f),
            None => Err(self.missing(name)),
        }
    }

    #[cold]
    fn missing(&self, symbol: &'static str) -> Error {
        Error::Missing { symbol, torch: self.version() }
    }

    /// Turns a torch error code into [`Error::Call`] with torch's message where it keeps one.
    #[inline]
    fn check(&self, code: sys::AOTITorchError, function: &'static str) -> Result<()> {
        if code == 0 { Ok(()) } else { Err(self.call_error(function)) }
    }

    #[cold]
    #[inline(never)]
    fn call_error(&self, function: &'static str) -> Error {
        let message = match self.syms.torch_exception_get_what_without_backtrace {
            // SAFETY: returns a borrowed, NUL-terminated string (or NULL) of this thread's last
            // shim error, copied here before any other torch call.
            Some(what) => match unsafe { what() } {
                p if p.is_null() => "(no message)".to_owned(),
                // SAFETY: non-NULL and NUL-terminated, alive until the next error on this thread.
                p => unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned(),
            },
            None => format!(
                "(torch {} keeps no message: it logged it to stderr; torch 2.13+ keeps it)",
                self.version()
            ),
        };
        Error::Call { function, message }
    }

    /// The dlbridge data type of torch dtype code `code` (`None`: a dtype DLPack lacks, or
    /// unknown).
    pub fn data_type(&self, code: i32) -> Option<DataType> {
        self.codes.dtypes.iter().find(|&&(c, _)| c == code).map(|&(_, d)| d)
    }

    /// torch's dtype code for `dtype` ([`Error::Invalid`] for one torch has no code for here).
    pub fn dtype_code(&self, dtype: DataType) -> Result<i32> {
        match self.codes.dtypes.iter().find(|&&(_, d)| d == dtype) {
            Some(&(c, _)) => Ok(c),
            None => Err(Error::Invalid(format!("dtype: {dtype} has no torch dtype code here"))),
        }
    }
}

impl Codes {
    /// Asks torch for every code (`Err`: the name of a getter it lacks; the CUDA and Meta device
    /// codes are optional).
    fn ask(s: &Symbols) -> std::result::Result<Self, &'static str> {
        macro_rules! code {
            ($f:ident) => {
                // SAFETY: a getter of torch's stable ABI taking nothing.
                unsafe { s.$f.ok_or(stringify!($f))?() }
            };
        }
        macro_rules! opt {
            ($f:ident) => {
                // SAFETY: as above.
                s.$f.map(|f| unsafe { f() })
            };
        }
        Ok(Self {
            // The commonest first (both lookups search the table in order).
            dtypes: [
                (code!(aoti_torch_dtype_float32), DataType::FLOAT32),
                (code!(aoti_torch_dtype_int64), DataType::INT64),
                (code!(aoti_torch_dtype_float64), DataType::FLOAT64),
                (code!(aoti_torch_dtype_int32), DataType::INT32),
                (code!(aoti_torch_dtype_bfloat16), DataType::BFLOAT16),
                (code!(aoti_torch_dtype_float16), DataType::FLOAT16),
                (code!(aoti_torch_dtype_bool), DataType::BOOL),
                (code!(aoti_torch_dtype_uint8), DataType::UINT8),
                (code!(aoti_torch_dtype_int8), DataType::INT8),
                (code!(aoti_torch_dtype_uint16), DataType::UINT16),
                (code!(aoti_torch_dtype_uint32), DataType::UINT32),
                (code!(aoti_torch_dtype_uint64), DataType::UINT64),
                (code!(aoti_torch_dtype_int16), DataType::INT16),
                (code!(aoti_torch_dtype_complex64), DataType::COMPLEX64),
                (code!(aoti_torch_dtype_complex128), DataType::COMPLEX128),
            ],
            cpu: code!(aoti_torch_device_type_cpu),
            cuda: opt!(aoti_torch_device_type_cuda),
            meta: opt!(aoti_torch_device_type_meta),
        })
    }
}

fn version_of(s: &Symbols) -> String {
    match s.aoti_torch_abi_version {
        Some(f) => {
            // SAFETY: a function of torch's stable ABI taking nothing.
            let v = unsafe { f() };
            format!("{}.{}.{}", v >> 56, (v >> 48) & 0xff, (v >> 40) & 0xff)
        }
        None => "(unknown: no aoti_torch_abi_version, older than 2.7)".into(),
    }
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated message owned by libc, copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "dlopen failed".into()
    } else {
        // SAFETY: non-NULL and NUL-terminated (above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// The path of the `libtorch_cpu` among the objects this process has loaded.
#[cfg(target_os = "linux")]
fn loaded_libtorch() -> Option<PathBuf> {
    unsafe extern "C" fn visit(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> i32 {
        // SAFETY: dl_iterate_phdr passes a valid info for the call and our `data` (the Option).
        let (info, found) = unsafe { (&*info, &mut *data.cast::<Option<PathBuf>>()) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: a NUL-terminated path owned by the loader, copied before returning.
        let name = unsafe { CStr::from_ptr(info.dlpi_name) };
        let path = Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name.to_bytes()));
        if path.file_name().is_some_and(|f| f.as_encoded_bytes() == LIBTORCH_CPU.as_bytes()) {
            *found = Some(path.to_path_buf());
            return 1;
        }
        0
    }
    let mut found: Option<PathBuf> = None;
    // SAFETY: `visit` matches the callback type and only touches `found`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&raw mut found).cast()) };
    found
}
