//! The `dlbridge._dlbridge` extension module. Only the `#[pymodule]` lives here; everything it
//! exposes is defined in the `dlbridge` crate's `python` module.

use pyo3::prelude::*;

/// The compiled part of the `dlbridge` Python package.
#[pymodule]
fn _dlbridge(m: &Bound<'_, PyModule>) -> PyResult<()> {
    dlbridge::python::init_module(m)
}
