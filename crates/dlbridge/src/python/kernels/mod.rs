//! The kernel author's kit: borrowed views (`view.rs`), typed arguments (`typed.rs`), and one kernel
//! in every mode (`kernel.rs`; several results and their rules: `results.rs`). Knows the runtime,
//! import and export.

mod kernel;
#[cfg(all(feature = "torch-stable", unix))]
mod native;
mod results;
mod typed;
mod view;

pub use kernel::{KernelDef, add_kernel, xla_capsule};
#[cfg(all(feature = "torch-stable", unix))]
pub use native::install_torch_version_hooks;
pub use results::{AttrValue, Attrs, ParamShape, ParamShapeFn, ResultDType, ResultDef, ResultShape, ShapeFn};
pub use typed::{HostSpec, TensorList, TensorMut, TensorRef};
pub use view::TensorView;
