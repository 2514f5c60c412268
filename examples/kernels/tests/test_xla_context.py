"""`center_rows`: a handler that uses what XLA lends besides buffers (`dlbridge::xla::Call`):
scratch memory for the call, a state made once at XLA's instantiate stage (once per compiled
executable; once per process for the native torch op), and XLA's intra-op thread pool. Checked
against numpy in every mode: eager numpy/torch/jax, `jax.jit` (and `vmap`), the native torch op and
`torch.compile(fullgraph=True)`; `center_rows_counters()` says how many states were made, how many
calls the last one served, how many threads the last call's pool had, and how many states were
freed."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import dlbridge_kernels as k


def reference(x):
    x = np.asarray(x)
    return x - x.mean(axis=-1, keepdims=True)


def made() -> int:
    return k.center_rows_counters()[0]


@pytest.fixture
def x():
    return np.random.default_rng(0).standard_normal((203, 37))


def test_eager_numpy_and_torch(x):
    np.testing.assert_allclose(k.center_rows(x), reference(x), atol=1e-12)
    np.testing.assert_allclose(k.center_rows(x.astype(np.float32)), reference(x), atol=1e-5)
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(x)
    got = k.center_rows(t)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_allclose(got.numpy(), reference(x), atol=1e-12)


def test_jax_jit_makes_the_state_once_per_compiled_executable(x):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    xs = jnp.asarray(x.astype(np.float32))
    np.testing.assert_allclose(np.asarray(k.center_rows(xs)), reference(xs), atol=1e-5)  # eager jax
    f = jax.jit(lambda a: k.center_rows(a) * 1.0)
    before = made()
    for n in (1, 2, 3):
        np.testing.assert_allclose(np.asarray(f(xs)), reference(xs), atol=1e-5)
        # One state for the executable, made at its instantiation; each call reads it.
        assert k.center_rows_counters()[:2] == (before + 1, n)
    # Another shape: another executable, another state.
    np.testing.assert_allclose(np.asarray(f(xs[:5])), reference(xs[:5]), atol=1e-5)
    assert k.center_rows_counters()[:2] == (before + 2, 1)
    # Two calls in one executable: a state each (XLA keeps a state per custom call).
    g = jax.jit(lambda a: k.center_rows(k.center_rows(a) + 1.0))
    np.testing.assert_allclose(np.asarray(g(xs)), reference(xs), atol=1e-5)
    assert made() == before + 4
    # vmap: the same executable's handler, per batch element.
    batch = jnp.stack([xs, 2 * xs])
    np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(k.center_rows))(batch)), reference(batch), atol=1e-4)


def test_xla_frees_the_state_with_its_executable(x):
    jax = pytest.importorskip("jax")
    xs = jax.numpy.asarray(x[:7].astype(np.float32))
    jax.clear_caches()  # the executables of earlier tests go first
    gc.collect()
    f = jax.jit(lambda a: k.center_rows(a) - 1.0)
    f(xs).block_until_ready()
    made_, _, _, freed = k.center_rows_counters()
    del f
    jax.clear_caches()
    gc.collect()
    # XLA's deleter (dlbridge's, registered with the state's type) dropped it, once.
    assert k.center_rows_counters()[3] == freed + 1
    assert k.center_rows_counters()[0] == made_


def test_jax_jit_runs_the_loop_on_xlas_intra_op_pool(x):
    jax = pytest.importorskip("jax")
    xs = jax.numpy.asarray(x.astype(np.float32))
    np.testing.assert_allclose(np.asarray(jax.jit(k.center_rows)(xs)), reference(xs), atol=1e-5)
    threads = k.center_rows_counters()[2]
    # XLA:CPU lends its intra-op pool (one thread per core) to the handler's loop.
    assert threads >= (2 if (os.cpu_count() or 1) >= 2 else 1)


def test_the_native_torch_op_makes_its_state_once_for_the_process(x):
    torch = pytest.importorskip("torch")
    op = getattr(torch.ops.dlbridge_kernels, "center_rows", None)
    if op is None:
        pytest.skip("no native torch op on this torch")
    t = torch.from_numpy(x)
    op(t)  # the state, made at the op's first call (any test may have made it)
    before, calls, _, _ = k.center_rows_counters()
    for n in (1, 2):
        np.testing.assert_allclose(op(t).numpy(), reference(x), atol=1e-12)
        got_made, got_calls, threads, _ = k.center_rows_counters()
        assert (got_made, got_calls) == (before, calls + n)
        assert threads == 1  # no pool on this path: the loop runs on the calling thread
    # torch.compile(fullgraph=True) calls the same op: the same state.
    f = torch.compile(lambda a: k.center_rows(a) * 2.0, fullgraph=True)
    np.testing.assert_allclose(f(t).numpy(), 2 * reference(x), atol=1e-12)
    assert made() == before


def test_a_handler_registered_without_the_instantiate_stage_says_so():
    # In a child process with a timeout: reading a state XLA never made must be an error, never a
    # crash.
    code = """
import jax, jax.numpy as jnp, dlbridge_kernels as k
jax.ffi.register_ffi_target("test_xla_context.execute_only", k.center_rows._ffi, platform="cpu")
x = jnp.ones((4, 3), jnp.float32)
call = jax.ffi.ffi_call("test_xla_context.execute_only", jax.ShapeDtypeStruct(x.shape, x.dtype))
try:
    call(x).block_until_ready()
except jax.errors.JaxRuntimeError as e:
    print("ERROR", e)
"""
    pytest.importorskip("jax")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ERROR FAILED_PRECONDITION: center_rows_xla: state: none was made" in r.stdout, r.stdout
    assert '{"instantiate": capsule, "execute": capsule}' in r.stdout


def test_a_kernel_made_in_python_registers_the_stage_bundle_it_is_given():
    # dlbridge.kernels.kernel(ffi=...) of a handler with a state: jax's stage dict, registered as
    # it is (a process without torch: a torch op needs the capsule itself).
    code = """
import sys
import numpy as np, jax, jax.numpy as jnp
import dlbridge.kernels as dk, dlbridge_kernels as k
cap = k.center_rows._ffi
def center(x):
    return k.center_rows(x)
c = dk.kernel(center, name="center_bundle", namespace="test_xla_context", out="x",
              ffi={"instantiate": cap, "execute": cap})
x = np.arange(12.0, dtype=np.float32).reshape(4, 3)
made = k.center_rows_counters()[0]
y = jax.jit(c)(jnp.asarray(x))
assert np.allclose(y, x - x.mean(axis=1, keepdims=True)), y
assert k.center_rows_counters()[0] == made + 1
assert "torch" not in sys.modules
print("OK")
"""
    pytest.importorskip("jax")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr


def test_the_native_ops_first_calls_from_several_threads_keep_one_state():
    # A fresh process: the op's first calls race to make its state; one is kept, any other made
    # meanwhile is freed, and every call reads the kept one.
    code = """
import threading
import numpy as np, torch
import dlbridge_kernels as k
op = torch.ops.dlbridge_kernels.center_rows
x = torch.from_numpy(np.random.default_rng(1).standard_normal((64, 9)))
want = (x - x.mean(dim=1, keepdim=True)).numpy()
start, errors = threading.Barrier(4), []
def run():
    start.wait()
    for _ in range(20):
        if not np.allclose(op(x).numpy(), want):
            errors.append("wrong")
threads = [threading.Thread(target=run) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
made, calls, _, freed = k.center_rows_counters()
assert not errors, errors
assert made - freed == 1 and calls == 80, (made, freed, calls)
print("OK")
"""
    torch = pytest.importorskip("torch")
    if getattr(torch.ops.dlbridge_kernels, "center_rows", None) is None:
        pytest.skip("no native torch op on this torch")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr


def test_a_stage_bundle_kernel_made_before_torch_and_other_native_ops_lets_torch_import():
    # A kernel made in Python with a stage bundle (a dict) as ffi, then an extension whose native
    # ops wait for torch, then torch: importing torch makes every pending op, the bundle's kernel's
    # too (a Python custom op: no native registrar is looked up for a dict), and works.
    code = """
import numpy as np
import dlbridge.kernels as dk, dlbridge_kernels as k
cap = k.center_rows._ffi
def center(x):
    return k.center_rows(x)
c = dk.kernel(center, name="center_bundle_torch", namespace="test_xla_context", out="x",
              ffi={"instantiate": cap, "execute": cap})
import dlbridge_torch_native
assert dk._NATIVE_OPS, "native ops still wait for torch"
import torch
x = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
assert torch.allclose(c(x), x - x.mean(dim=1, keepdim=True))
assert torch.allclose(torch.ops.test_xla_context.center_bundle_torch(x), x - x.mean(dim=1, keepdim=True))
print("OK")
"""
    pytest.importorskip("torch")
    pytest.importorskip("dlbridge_torch_native")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr
