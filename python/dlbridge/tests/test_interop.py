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
    need,
    pointer,
    reference,
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
    pa = need("pyarrow")
    t = dlbridge.from_dlpack(reference(dtype, "1d"))
    if dtype not in PYARROW_DTYPES:
        with pytest.raises(pa.ArrowInvalid, match="unsupported DLPack type"):
            pa.Array.from_dlpack(t)
        return
    y = pa.Array.from_dlpack(t)
    assert pointer(y) == t.data_ptr
    assert values_equal(y, dtype, "1d")
