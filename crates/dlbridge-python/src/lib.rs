//! The `dlbridge._dlbridge` extension module. Only the `#[pymodule]` lives here; everything it
//! exposes is defined in the `dlbridge` crate's `python` module.

use pyo3::prelude::*;

/// The compiled part of the `dlbridge` Python package. It declares that it needs the GIL
/// (`gil_used`): its caches and numpy's struct reads assume one thread at a time, so a
/// free-threaded CPython re-enables the GIL when importing it.
#[pymodule(gil_used = true)]
fn _dlbridge(m: &Bound<'_, PyModule>) -> PyResult<()> {
    dlbridge::python::init_module(m)
}
