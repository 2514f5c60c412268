//! From Rust tensors back to Python: `dlbridge.Tensor`'s methods, the producer side of DLPack
//! (`tensor.rs`), and results in the caller's framework (`framework.rs`). Knows the runtime,
//! import (the per-type cache, exchange tables, numpy's C API) and processes (pickling).

mod framework;
mod tensor;

pub use crate::python::import::Framework;
pub use framework::Output;
