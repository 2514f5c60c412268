"""The CUDA side of dlbridge's XLA FFI layer (issue 22), on a real GPU: a handler made with
`xla_handler! { cuda fn ... }` registered for platform "CUDA" runs inside `jax.jit` on device
buffers, on the call's stream. The handler (a test hook) queues a device-to-device copy through the
CUDA driver, so no device code is needed. Marked `gpu`: skipped where jax has no GPU."""

from __future__ import annotations

import pytest

import dlbridge

from .libs import need

TARGET = "dlbridge_test_copy_cuda"


def _jax_gpu():
    jax = need("jax")
    if not hasattr(dlbridge._dlbridge, "_xla_copy_cuda"):
        pytest.skip("needs the test hooks (make test builds them)")
    gpus = [d for d in jax.devices() if d.platform == "gpu"] if _has_gpu_backend(jax) else []
    if not gpus:
        pytest.skip("jax has no GPU here")
    if TARGET not in _registered:
        jax.ffi.register_ffi_target(TARGET, dlbridge._dlbridge._xla_copy_cuda(), platform="CUDA")
        _registered.add(TARGET)
    return jax, gpus


_registered: set[str] = set()


def _has_gpu_backend(jax) -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_a_cuda_handler_runs_inside_jit_on_device_buffers(dtype: str) -> None:
    jax, gpus = _jax_gpu()
    import jax.numpy as jnp
    import numpy as np

    for dev in gpus[:2]:  # the device ordinal comes from the call frame
        x = jax.device_put(jnp.arange(4096).astype(dtype).reshape(64, 64), dev)

        def f(x):
            y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
            return y + 1  # ordered after the copy on the same stream

        y = jax.jit(f)(x)
        assert y.devices() == {dev} and y.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(y, dtype=np.float64), np.asarray(x, dtype=np.float64) + 1)


@pytest.mark.gpu
def test_a_cuda_handler_refusal_reaches_python_naming_the_argument() -> None:
    jax, gpus = _jax_gpu()
    import jax.numpy as jnp

    x = jax.device_put(jnp.ones((8,), jnp.float32), gpus[0])
    with pytest.raises(Exception, match="out: expected float32"):
        jax.jit(lambda x: jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((4,), jnp.float32))(x))(x).block_until_ready()
