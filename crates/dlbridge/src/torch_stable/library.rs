//! [`Library`]: a `torch::Library` made through the stable ABI, to define ops and register
//! kernels.

use std::ffi::{CStr, CString};
use std::fmt;
use std::panic::Location;
use std::ptr::NonNull;

use super::signature::OpSignature;
use super::sys::{BoxedKernel, TorchLibraryHandle, TorchLibraryOpaque};
use super::{EXTENSION_ABI_VERSION, Error, Result, Torch};

/// Every library handle made, never deleted (see [`Library`]).
static KEPT: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

/// A `torch::Library` (a namespace's definitions, or its kernels for one dispatch key) made
/// through `aoti_torch_library_init_*`. Its handle is never deleted: deleting it would
/// de-register every definition and kernel it registered, so they last for the process (as
/// `STABLE_TORCH_LIBRARY`'s static objects do until unload).
pub struct Library {
    handle: NonNull<TorchLibraryOpaque>,
    torch: &'static Torch,
    namespace: String,
    dispatch_key: Option<String>,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library")
            .field("namespace", &self.namespace)
            .field("dispatch_key", &self.dispatch_key)
            .finish()
    }
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Invalid(format!("{what}: {s:?} contains a NUL byte")))
}

impl Library {
    /// A fragment of namespace `ns` (`TORCH_LIBRARY_FRAGMENT`): defines ops in a namespace that
    /// other fragments may define in too.
    #[track_caller]
    pub fn fragment(torch: &'static Torch, ns: &str) -> Result<Self> {
        let f =
            torch.need(torch.syms.aoti_torch_library_init_fragment, "aoti_torch_library_init_fragment")?;
        let (c_ns, (file, line)) = (cstring("namespace", ns)?, caller()?);
        let mut h: TorchLibraryHandle = std::ptr::null_mut();
        // SAFETY: NUL-terminated strings (torch copies them) and a place for the handle.
        let code = unsafe { f(c_ns.as_ptr(), file.as_ptr(), line, &mut h) };
        Self::made(torch, code, h, "aoti_torch_library_init_fragment", ns, None)
    }

    /// The one definition of namespace `ns` (`TORCH_LIBRARY`: torch refuses a second).
    #[track_caller]
    pub fn definition(torch: &'static Torch, ns: &str) -> Result<Self> {
        let f = torch.need(torch.syms.aoti_torch_library_init_def, "aoti_torch_library_init_def")?;
        let (c_ns, (file, line)) = (cstring("namespace", ns)?, caller()?);
        let mut h: TorchLibraryHandle = std::ptr::null_mut();
        // SAFETY: as in fragment().
        let code = unsafe { f(c_ns.as_ptr(), file.as_ptr(), line, &mut h) };
        Self::made(torch, code, h, "aoti_torch_library_init_def", ns, None)
    }

    /// Kernels of namespace `ns` for `dispatch_key` (`TORCH_LIBRARY_IMPL(ns, key, m)`): `"CPU"`,
    /// `"Meta"`, `"CUDA"`, `"CompositeExplicitAutograd"`, ...
    #[track_caller]
    pub fn implementation(torch: &'static Torch, ns: &str, dispatch_key: &str) -> Result<Self> {
        let f = torch.need(torch.syms.aoti_torch_library_init_impl, "aoti_torch_library_init_impl")?;
        let (c_ns, key, (file, line)) =
            (cstring("namespace", ns)?, cstring("dispatch_key", dispatch_key)?, caller()?);
        let mut h: TorchLibraryHandle = std::ptr::null_mut();
        // SAFETY: as in fragment().
        let code = unsafe { f(c_ns.as_ptr(), key.as_ptr(), file.as_ptr(), line, &mut h) };
        Self::made(torch, code, h, "aoti_torch_library_init_impl", ns, Some(dispatch_key))
    }

    fn made(
        torch: &'static Torch,
        code: i32,
        h: TorchLibraryHandle,
        function: &'static str,
        ns: &str,
        key: Option<&str>,
    ) -> Result<Self> {
        torch.check(code, function)?;
        let handle = NonNull::new(h)
            .ok_or_else(|| Error::Call { function, message: "returned no library handle".into() })?;
        // Kept for the process, reachable (a leak checker sees it held, not lost).
        KEPT.lock().unwrap_or_else(|e| e.into_inner()).push(handle.as_ptr() as usize);
        Ok(Self { handle, torch, namespace: ns.to_owned(), dispatch_key: key.map(str::to_owned) })
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Defines an op from its schema string (`m.def("name(Tensor x, float a) -> Tensor")`).
    /// Defining one twice is an [`Error::Call`].
    pub fn def(&self, schema: &str) -> Result<()> {
        let f = self.torch.need(self.torch.syms.aoti_torch_library_def, "aoti_torch_library_def")?;
        let s = cstring("schema", schema)?;
        // SAFETY: a live library handle and a NUL-terminated schema (torch copies it).
        let code = unsafe { f(self.handle.as_ptr(), s.as_ptr()) };
        self.torch.check(code, "aoti_torch_library_def")
    }

    /// Defines the op `signature` describes (its [`OpSignature::schema`]).
    pub fn define(&self, signature: &OpSignature) -> Result<()> {
        self.def(&signature.schema()?)
    }

    /// Registers `kernel` as op `name`'s kernel for this library's dispatch key, through
    /// `torch_library_impl` (passing [`EXTENSION_ABI_VERSION`]) or, on a torch before 2.10,
    /// `aoti_torch_library_impl`. Refused when the torch lacks `aoti_torch_check`, without which a
    /// kernel could not report an error. [`xla::register`](super::xla::register) is the safe
    /// composite (it defines the op from the same signature its kernels decode).
    ///
    /// # Safety
    ///
    /// `kernel` is sound to call with torch's boxed stack for op `name` of this namespace, as
    /// defined (its schema's arguments and returns: a kernel through [`run_boxed`](super::run_boxed)
    /// whose [`OpSignature`] made that schema), from any thread, for the rest of the process.
    pub unsafe fn register(&self, name: &str, kernel: BoxedKernel) -> Result<()> {
        self.torch.need(self.torch.syms.aoti_torch_check, "aoti_torch_check")?;
        let n = cstring("name", name)?;
        let code = if let Some(f) = self.torch.syms.torch_library_impl {
            // SAFETY: a live library handle, a NUL-terminated name, a kernel valid for the
            // process (a function).
            unsafe { f(self.handle.as_ptr(), n.as_ptr(), kernel, EXTENSION_ABI_VERSION) }
        } else {
            let f = self.torch.need(self.torch.syms.aoti_torch_library_impl, "aoti_torch_library_impl")?;
            // SAFETY: as above.
            unsafe { f(self.handle.as_ptr(), n.as_ptr(), kernel) }
        };
        self.torch.check(code, "torch_library_impl")
    }
}

/// The registering caller's file and line (torch shows them in its registration errors). The
/// file name is leaked: `torch::Library` keeps the `const char*` for its lifetime, the process's.
#[track_caller]
fn caller() -> Result<(&'static CStr, u32)> {
    let l = Location::caller();
    Ok((super::signature::keep(cstring("file", l.file())?.into_boxed_c_str()), l.line()))
}
