//! `center_rows`: what a handler can ask of XLA besides its buffers: scratch memory for the call
//! ([`Call::scratch`]), a state made once per compiled executable ([`Call::state`], declared
//! `state: Type = init`), and XLA's intra-op thread pool ([`Call::thread_pool`]).
//!
//! `center_rows(x)` subtracts each row's mean: `x - x.mean(axis=1, keepdims=True)`, for a 2-d
//! float32 or float64 matrix. The handler computes the row means in parallel into scratch memory,
//! then writes the rows in parallel; the reciprocals `1 / n` it divides by come from a table in
//! its state. Counters (read from Python) show how often a state was made and freed, and how
//! many calls the last state served.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use dlbridge::python::{KernelDef, add_kernel};
use dlbridge::spec::{C, Cpu, Rank};
use dlbridge::xla::{Call, FfiError, Result};
use dlbridge::{DataType, TensorView, argument_error};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::Real;

/// How many states the handler made (once per compiled executable; once per process for the
/// native torch op).
static STATES_MADE: AtomicUsize = AtomicUsize::new(0);
/// How many calls the state of the last call has served.
static LAST_CALLS: AtomicU64 = AtomicU64::new(0);
/// The number of threads of the last call's pool (1: the calling thread alone).
static LAST_THREADS: AtomicUsize = AtomicUsize::new(0);
/// How many states XLA freed (with their executables).
static STATES_DROPPED: AtomicUsize = AtomicUsize::new(0);

/// The reciprocals the table holds: `1 / n` for rows of up to this many elements.
const TABLE_LEN: usize = 1024;

/// The handler's state: a table made once, and a count of the calls it served.
pub(crate) struct Reciprocals {
    inv: Vec<f64>,
    calls: AtomicU64,
}

impl Reciprocals {
    fn new() -> Self {
        STATES_MADE.fetch_add(1, Ordering::Relaxed);
        Self {
            inv: (0..=TABLE_LEN).map(|n| if n == 0 { 0.0 } else { 1.0 / n as f64 }).collect(),
            calls: AtomicU64::new(0),
        }
    }

    /// `1 / n` (0 for 0).
    fn inv(&self, n: usize) -> f64 {
        self.inv.get(n).copied().unwrap_or(1.0 / n as f64)
    }
}

impl Drop for Reciprocals {
    /// Counts. XLA drops the state where the executable goes (a thread that may hold the GIL):
    /// nothing here blocks.
    fn drop(&mut self) {
        STATES_DROPPED.fetch_add(1, Ordering::Relaxed);
    }
}

/// The mean of a row, given `1 / len`.
fn mean<T: Real>(row: &[T], inv: f64) -> f64 {
    row.iter().map(|v| v.get()).sum::<f64>() * inv
}

/// `out = row - mean`.
fn center<T: Real>(row: &[T], mean: f64, out: &mut [T]) {
    for (o, v) in out.iter_mut().zip(row) {
        *o = T::put(v.get() - mean);
    }
}

// --- eager ---

/// Each row of a 2-d C-contiguous float32 or float64 matrix minus its mean, as a new array of
/// the caller's framework.
#[pyfunction]
fn center_rows<'py>(py: Python<'py>, x: TensorView<'_>) -> PyResult<Bound<'py, PyAny>> {
    match x.dtype() {
        DataType::FLOAT32 => center_rows_typed::<f32>(py, x),
        DataType::FLOAT64 => center_rows_typed::<f64>(py, x),
        other => {
            Err(PyTypeError::new_err(format!("center_rows: x: expected float32 or float64, got {other}")))
        }
    }
}

fn center_rows_typed<'py, T: Real>(py: Python<'py>, x: TensorView<'_>) -> PyResult<Bound<'py, PyAny>> {
    let x = x.typed::<T, Rank<2>, C, Cpu>().map_err(|e| argument_error("x", e))?;
    let cols = x.shape()[1] as usize;
    let mut out = x.empty_like::<T>(py)?;
    {
        let xs = x.as_slice()?;
        let mut os = out.as_slice_mut()?;
        let inv = if cols == 0 { 0.0 } else { 1.0 / cols as f64 };
        if cols > 0 {
            for (o, row) in os.chunks_mut(cols).zip(xs.chunks(cols)) {
                center(row, mean(row, inv), o);
            }
        }
    }
    out.into_object(py)
}

// --- inside jax.jit (and as the native torch op) ---

dlbridge::xla_handler! {
    /// `center_rows` inside `jax.jit`: row means into scratch memory, rows in parallel on XLA's
    /// pool, `1 / cols` from the state's table.
    pub(crate) fn center_rows_xla(call, operands: 1, results: 1, state: Reciprocals = Reciprocals::new()) {
        match call.input_any(0, "x")?.dtype() {
            DataType::FLOAT32 => center_rows_ffi::<f32>(call),
            DataType::FLOAT64 => center_rows_ffi::<f64>(call),
            other => Err(FfiError::invalid_argument(format!("x: expected float32 or float64, got {other}"))),
        }
    }
}

/// Rows per item of the parallel loops.
const ROWS_PER_TASK: usize = 16;

fn center_rows_ffi<T: Real>(call: &Call<'_>) -> Result<()> {
    let state = call.state::<Reciprocals>()?;
    LAST_CALLS.store(state.calls.fetch_add(1, Ordering::Relaxed) + 1, Ordering::Relaxed);
    let x = call.input::<T, Rank<2>>(0, "x")?;
    let mut out = call.output::<T, Rank<2>>(0, "out")?;
    if x.shape() != out.shape() {
        return Err(FfiError::invalid_argument(format!(
            "x and out: shapes {:?} and {:?}",
            x.shape(),
            out.shape()
        )));
    }
    let (rows, cols) = (x.shape()[0] as usize, x.shape()[1] as usize);
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let inv = state.inv(cols);
    let xs = x.as_slice()?;
    let xs: &[T] = &xs;
    let pool = call.thread_pool();
    LAST_THREADS.store(pool.num_threads(), Ordering::Relaxed);
    // Pass 1: the means, ROWS_PER_TASK rows per item, into scratch memory.
    let means = call.scratch::<f64>(rows)?;
    pool.for_each_chunk_mut(means, ROWS_PER_TASK, |i, chunk| {
        for (k, m) in chunk.iter_mut().enumerate() {
            let r = i * ROWS_PER_TASK + k;
            *m = mean(&xs[r * cols..(r + 1) * cols], inv);
        }
    })?;
    // Pass 2: the rows.
    let means: &[f64] = means;
    let mut os = out.as_slice_mut()?;
    pool.for_each_chunk_mut(&mut os, ROWS_PER_TASK * cols, |i, chunk| {
        for (k, o) in chunk.chunks_mut(cols).enumerate() {
            let r = i * ROWS_PER_TASK + k;
            center(&xs[r * cols..(r + 1) * cols], means[r], o);
        }
    })
}

/// `(states made, calls the last state served, threads of the last call's pool, states freed)`.
#[pyfunction]
fn center_rows_counters() -> (usize, u64, usize, usize) {
    (
        STATES_MADE.load(Ordering::Relaxed),
        LAST_CALLS.load(Ordering::Relaxed),
        LAST_THREADS.load(Ordering::Relaxed),
        STATES_DROPPED.load(Ordering::Relaxed),
    )
}

/// Adds `center_rows` (a kernel of every mode) and `center_rows_counters`.
pub(crate) fn add_kernels(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(center_rows_counters, m)?)?;
    add_kernel(
        m,
        wrap_pyfunction!(center_rows, m)?.into_any(),
        &KernelDef { out: Some("x"), ffi: Some(center_rows_xla), ..KernelDef::default() },
        None,
    )?;
    Ok(())
}
