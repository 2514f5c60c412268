"""The interop matrix: every producer's array goes into dlbridge, and the dlbridge.Tensor goes into
every consumer, for every dtype both sides support and every layout that matters.

Each case asserts the library's real behaviour as observed with the versions `make test` installs:
zero-copy (pointer equality) and equal values where the consumer can take the tensor, and the
consumer's own error where it cannot (jax and tensorflow accept only compact layouts, tensorflow
only legacy capsules, torch refuses negative strides, pyarrow imports only 1-d arrays, jax copies
data that is not 64-byte aligned).
"""

from __future__ import annotations

import re

import pytest

import dlbridge

from .libs import (
    CAN_MAKE,
    COMPACT,
    CONSUMERS,
    EXOTIC,
    NUMPY_DTYPES,
    PRODUCERS,
    PYARROW_DTYPES,
    SHAPES,
    TORCH_NEGATIVE_STRIDES_RAISE,
    need,
    need_pyarrow_consumer,
    pointer,
    reference,
    skip_before_torch,
    to_numpy,
)

CASES = [(d, "3d") for d in NUMPY_DTYPES + EXOTIC] + [("float32", s) for s in SHAPES if s != "3d"] + [
    ("int64", s) for s in ("0d", "1d", "negative", "transposed")
]


def expectation(consumer: str, t: dlbridge.Tensor, dtype: str, shape: str) -> tuple[str, str]:
    """('zero-copy' | 'copy' | 'error', detail) for handing `t` to `consumer`."""
    producer_read_only = t.readonly and not _legacy_sourced(t)
    if consumer == "numpy":
        return ("zero-copy", "") if dtype in NUMPY_DTYPES else ("error", "Unsupported dtype")
    if consumer == "torch":
        return ("error", "Storage size calculation overflowed") if shape == "negative" else ("zero-copy", "")
    if consumer == "jax":
        if producer_read_only:
            return ("error", "read-only")
        if shape not in COMPACT | {"transposed"}:
            return ("error", "trivial (compact) striding")
        aligned = t.data_ptr % 64 == 0 or t.size == 0
        return ("zero-copy", "") if aligned else ("copy", "jax copies data that is not 64-byte aligned")
    if consumer == "tensorflow":
        if producer_read_only:
            return ("error", "read-only")
        if dtype in ("float8_e4m3fn", "float8_e5m2"):
            return ("error", "Unsupported Type Codes")
        if shape not in COMPACT:
            return ("error", "Invalid strides array")
        return ("zero-copy", "")
    if consumer == "array_api_strict":
        if dtype == "float16":
            return ("error", "does not support the dtype 'float16'")
        return ("zero-copy", "") if dtype in NUMPY_DTYPES else ("error", "Unsupported dtype")
    if consumer == "pyarrow":
        if t.ndim != 1 or not t.is_c_contiguous:
            return ("error", "Only contiguous one dimensional tensor")
        return ("zero-copy", "") if dtype in PYARROW_DTYPES else ("error", "")
    return ("zero-copy", "")


def _legacy_sourced(t: dlbridge.Tensor) -> bool:
    # A tensor from a legacy capsule still hands out legacy capsules (jax, tensorflow sources).
    try:
        t.__dlpack__()
    except BufferError:
        return False
    return True


def values_equal(y, dtype: str, shape: str) -> bool:
    np = need("numpy")
    got = to_numpy(y)
    want = reference(dtype, shape)
    if dtype in EXOTIC:
        want = want.astype(np.float32)
    return got.shape == want.shape and np.array_equal(got, want)


MATRIX = [(p, c, d, s) for p in PRODUCERS for c in CONSUMERS for d, s in CASES if CAN_MAKE[p](d, s)]


@pytest.mark.parametrize(("producer", "consumer", "dtype", "shape"), MATRIX, ids=["-".join(m) for m in MATRIX])
def test_producer_to_dlbridge_to_consumer(producer: str, consumer: str, dtype: str, shape: str) -> None:
    x = PRODUCERS[producer](dtype, shape)
    t = dlbridge.from_dlpack(x)
    # Into dlbridge: always zero-copy, same layout and dtype.
    if t.size:
        assert t.data_ptr == pointer(x), "dlbridge.from_dlpack copied"
    assert t.shape == reference(dtype, shape).shape
    assert str(t.dtype) == dtype
    kind, detail = expectation(consumer, t, dtype, shape)
    if consumer == "torch" and shape == "negative":
        skip_before_torch(*TORCH_NEGATIVE_STRIDES_RAISE)
    if kind == "error":
        with pytest.raises(Exception, match=re.escape(detail) if detail else None):
            CONSUMERS[consumer](t)
        return
    y = CONSUMERS[consumer](t)
    if consumer != "dlbridge" or dtype in NUMPY_DTYPES:
        assert values_equal(y, dtype, shape)
    else:
        assert (y.shape, str(y.dtype)) == (t.shape, dtype)
    if t.size:
        same = pointer(y) == t.data_ptr
        assert same == (kind == "zero-copy"), f"{kind}: {detail}"


@pytest.mark.parametrize("dtype", PYARROW_DTYPES + ["bool", "complex64"])
def test_one_dimensional_arrays_into_pyarrow(dtype: str) -> None:
    pa = need_pyarrow_consumer()
    t = dlbridge.from_dlpack(reference(dtype, "1d"))
    if dtype not in PYARROW_DTYPES:
        with pytest.raises(pa.ArrowInvalid, match="unsupported DLPack type"):
            pa.Array.from_dlpack(t)
        return
    y = pa.Array.from_dlpack(t)
    assert pointer(y) == t.data_ptr
    assert values_equal(y, dtype, "1d")


WRITABLE_PRODUCERS = ["numpy", "torch", "array_api_strict", "dlbridge"]
WRITABLE_CONSUMERS = ["numpy", "torch", "dlbridge"]


def write_through(consumer: str, y) -> None:
    """Writes 99 at the first element through the consumer's own array."""
    if consumer == "dlbridge":
        y = need("numpy").from_dlpack(y)
    y[(0,) * y.ndim] = 99


def read_first(producer: str, x) -> float:
    if producer == "array_api_strict":
        x = x._array
    if producer == "dlbridge":
        x = need("numpy").from_dlpack(x)
    return float(x[(0,) * x.ndim])


@pytest.mark.parametrize("shape", ["3d", "transposed", "sliced"])
@pytest.mark.parametrize("consumer", WRITABLE_CONSUMERS)
@pytest.mark.parametrize("producer", WRITABLE_PRODUCERS)
def test_a_write_on_the_consumer_side_is_seen_by_the_producer(producer: str, consumer: str, shape: str) -> None:
    x = PRODUCERS[producer]("float32", shape)
    t = dlbridge.from_dlpack(x)
    assert not t.readonly
    y = CONSUMERS[consumer](t)
    assert read_first(producer, x) != 99
    write_through(consumer, y)
    assert read_first(producer, x) == 99


def test_tensorflow_takes_only_legacy_capsules() -> None:
    tf = need("tensorflow")
    t = dlbridge.from_dlpack(reference("float32", "1d"))
    with pytest.raises(Exception, match="versioned|dltensor"):
        tf.experimental.dlpack.from_dlpack(t.__dlpack__(max_version=(1, 0)))
    assert tf.experimental.dlpack.from_dlpack(t.__dlpack__()).numpy().tolist() == reference("float32", "1d").tolist()


def test_jax_and_tensorflow_sources_round_trip_through_dlbridge_as_legacy() -> None:
    need("jax")
    import jax.numpy as jnp

    x = jnp.arange(8.0)
    t = dlbridge.from_dlpack(x)
    assert t.readonly, "a legacy capsule cannot say it is writable"
    y = jnp.from_dlpack(t)
    assert y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    w = need("numpy").from_dlpack(t)
    assert not w.flags.writeable
