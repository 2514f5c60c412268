"""The XLA FFI layer checks every call against what the handler declared (`xla_handler!`'s
`operands`, `results`, `attrs`) before its body runs, as XLA's C++ binding does: a
`jax.ffi.ffi_call` of an example kernel's handler with one operand, result or attribute more is
refused with an error naming what differs, never run with a result left unwritten."""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge_kernels as k

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def target(kernel, fn, *args) -> str:
    """The kernel's XLA FFI target, registered by a first jitted call of `fn` (which calls it)."""
    jax.jit(fn)(*args).block_until_ready()
    return kernel._target


def test_an_extra_result_is_refused():
    x = jnp.ones((2, 3), jnp.float32)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    call = jax.ffi.ffi_call(target(k.softmax, k.softmax, x), (out, out))
    with pytest.raises(jax.errors.JaxRuntimeError, match="softmax_xla: wrong number of results: expected 1, got 2"):
        jax.block_until_ready(jax.jit(call)(x))


def test_an_extra_operand_is_refused():
    x = jnp.ones((2, 3), jnp.float32)
    call = jax.ffi.ffi_call(target(k.softmax, k.softmax, x), jax.ShapeDtypeStruct(x.shape, x.dtype))
    with pytest.raises(jax.errors.JaxRuntimeError, match="softmax_xla: wrong number of operands: expected 1, got 2"):
        jax.block_until_ready(jax.jit(call)(x, x))


def test_an_extra_or_missing_attribute_is_refused():
    x = jnp.ones(3, jnp.float32)
    name = target(k.saxpy, lambda x, y: k.saxpy(2.0, x, y), x, x)
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(x.shape, x.dtype))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"saxpy_xla: wrong attributes: .*\(unexpected: b\)"):
        jax.block_until_ready(call(x, x, a=np.float64(2.0), b=np.float64(1.0)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"saxpy_xla: wrong attributes: .*\(missing: a\)"):
        jax.block_until_ready(call(x, x))
    # What the handler declared: it runs.
    np.testing.assert_allclose(np.asarray(call(x, x, a=np.float64(2.0))), [3.0, 3.0, 3.0])
