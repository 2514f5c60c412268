"""The real array libraries the tests exchange with: how each one makes arrays, consumes DLPack,
exposes its data pointer, and which dtypes and layouts it supports (as observed, not as hoped).

Libraries that are not installed are skipped, never faked.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any, Callable

import pytest

NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]
EXOTIC = ["bfloat16", "float8_e4m3fn", "float8_e5m2"]
SHAPES = ["0d", "1d", "3d", "size0", "sliced", "transposed", "negative", "broadcast"]


@cache
def have(name: str) -> bool:
    """Whether a library can be imported. DLBRIDGE_TEST_WITHOUT (comma-separated names) makes the
    tests treat those libraries as absent: `make test` uses it to check that the suite skips, and
    never fails, where a library is missing."""
    import os

    if name in os.environ.get("DLBRIDGE_TEST_WITHOUT", "").split(","):
        return False
    try:
        mod = importlib.import_module(name)
    except Exception:
        return False
    # A directory of that name on sys.path (Ray's /tmp/ray when the suite runs from /tmp) imports
    # as an empty namespace package: that is not the library.
    return getattr(mod, "__file__", None) is not None


def need(name: str) -> Any:
    """Imports a library or skips the test when it is absent."""
    if not have(name):
        pytest.skip(f"{name} is not installed")
    mod = importlib.import_module(name)
    if name == "jax":
        mod.config.update("jax_enable_x64", True)
    return mod


def torch_release() -> tuple[int, int]:
    """The installed torch's (major, minor)."""
    major, minor = need("torch").__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def skip_before_torch(release: tuple[int, int], why: str) -> None:
    """Skips the test on a torch older than `release` (`make matrix` also tests torch 2.11,
    python/requirements-torch-older.txt), naming both releases and the reason."""
    if torch_release() < release:
        pytest.skip(f"needs torch {release[0]}.{release[1]} or later (this is torch "
                    f"{need('torch').__version__}): {why}")


# torch.from_dlpack on negative strides: torch before 2.14 aborts the whole process (a c10::Error
# thrown through a noexcept function, TensorMaker::computeStorageSize: pytorch issue 188023; seen
# here on 2.11 and 2.13), 2.14 and later raise RuntimeError ("Storage size calculation overflowed").
TORCH_NEGATIVE_STRIDES_RAISE = ((2, 14), "torch.from_dlpack aborts the process on negative strides "
                                "(pytorch issue 188023), where later releases raise RuntimeError")


class Delegate:
    """A pure-Python DLPack producer over another object's protocol methods: dlbridge takes its
    protocol path (no numpy or exchange-table fast path). Subclass it for a class of your own."""

    def __init__(self, a: Any) -> None:
        self.a = a

    def __dlpack__(self, **kw: Any) -> Any:
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self) -> Any:
        return self.a.__dlpack_device__()


def rss_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def assert_no_growth(once: Callable[[], None], calls: int = 100_000, warmup: int = 20_000) -> None:
    """Runs `once` `calls` times after a warm-up and asserts the process grew by under 1 MiB."""
    import gc

    for _ in range(warmup):
        once()
    gc.collect()
    before = rss_bytes()
    for _ in range(calls):
        once()
    gc.collect()
    growth = rss_bytes() - before
    assert growth < 1 << 20, f"process memory grew by {growth} bytes over {calls} calls"


def np_dtype(name: str) -> Any:
    np = need("numpy")
    if name in NUMPY_DTYPES:
        return np.dtype(name)
    ml = need("ml_dtypes")
    return np.dtype(getattr(ml, name))


def reference(dtype: str, shape: str) -> Any:
    """The numpy array every producer reproduces for (dtype, shape): values then layout."""
    np = need("numpy")
    base = np.arange(24).reshape(2, 3, 4) % 7
    if dtype == "bool":
        base = base % 2
    a = base.astype(np.float32).astype(np_dtype(dtype))
    return {
        "0d": lambda: np.array(a[1, 2, 3]),
        "1d": lambda: a.reshape(-1).copy(),
        "3d": lambda: a,
        "size0": lambda: a[:, :0, :],
        "sliced": lambda: a[:, 1:, ::2],
        "transposed": lambda: a.transpose(2, 0, 1),
        "negative": lambda: a[:, ::-1, ::-1],
        "broadcast": lambda: np.broadcast_to(a[0, 0], (3, 4)),
    }[shape]()


def _torch_dtype(name: str) -> Any:
    torch = need("torch")
    return getattr(torch, name)


# --- producers: (dtype, shape) -> object, or raise pytest.skip when the library cannot make it ----

def make_numpy(dtype: str, shape: str) -> Any:
    return reference(dtype, shape)


def make_torch(dtype: str, shape: str) -> Any:
    torch = need("torch")
    base = torch.arange(24).reshape(2, 3, 4) % 7
    if dtype == "bool":
        base = base % 2
    a = base.to(torch.float32).to(_torch_dtype(dtype))
    return {
        "0d": lambda: a[1, 2, 3].clone(),
        "1d": lambda: a.reshape(-1).clone(),
        "3d": lambda: a,
        "size0": lambda: a[:, :0, :],
        "sliced": lambda: a[:, 1:, ::2],
        "transposed": lambda: a.permute(2, 0, 1),
        "broadcast": lambda: a[0, 0].expand(3, 4),
    }[shape]()


def make_jax(dtype: str, shape: str) -> Any:
    need("jax")
    import jax.numpy as jnp
    return jnp.asarray(reference(dtype, shape))


def make_tensorflow(dtype: str, shape: str) -> Any:
    tf = need("tensorflow")
    return tf.constant(reference(dtype, shape))


def make_pyarrow(dtype: str, shape: str) -> Any:
    pa = need("pyarrow")
    return pa.array(reference(dtype, shape))


def make_xp(dtype: str, shape: str) -> Any:
    xp = need("array_api_strict")
    np = need("numpy")
    ref = reference(dtype, shape)
    if shape in ("negative", "broadcast", "sliced", "transposed"):
        base = xp.asarray(np.ascontiguousarray(reference(dtype, "3d")))
        return {
            "negative": lambda: xp.flip(base, axis=(1, 2)),
            "broadcast": lambda: xp.broadcast_to(base[0, 0, ...], (3, 4)),
            "sliced": lambda: base[:, 1:, ::2],
            "transposed": lambda: xp.permute_dims(base, (2, 0, 1)),
        }[shape]()
    return xp.asarray(ref)


def make_dlbridge(dtype: str, shape: str) -> Any:
    import dlbridge
    if dtype in NUMPY_DTYPES:
        return dlbridge.from_dlpack(make_numpy(dtype, shape))
    return dlbridge.from_dlpack(make_torch(dtype, shape))


COMPACT = {"0d", "1d", "3d", "size0"}
PYARROW_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"]

# What each producer can make at all (dtype, layout): cases outside these are not generated.
CAN_MAKE: dict[str, Callable[[str, str], bool]] = {
    "numpy": lambda d, s: d in NUMPY_DTYPES,  # numpy exports no ml_dtypes dtype through DLPack
    "torch": lambda d, s: s != "negative",  # torch tensors have no negative strides
    "jax": lambda d, s: s in COMPACT,  # jax arrays are compact row-major
    "tensorflow": lambda d, s: d in NUMPY_DTYPES + ["bfloat16"] and s in COMPACT,  # no float8 in tf
    "pyarrow": lambda d, s: d in PYARROW_DTYPES and s == "1d",
    "array_api_strict": lambda d, s: d in NUMPY_DTYPES and d != "float16",
    "dlbridge": lambda d, s: d in NUMPY_DTYPES or s != "negative",
}

PRODUCERS: dict[str, Callable[[str, str], Any]] = {
    "numpy": make_numpy,
    "torch": make_torch,
    "jax": make_jax,
    "tensorflow": make_tensorflow,
    "pyarrow": make_pyarrow,
    "array_api_strict": make_xp,
    "dlbridge": make_dlbridge,
}


# --- data pointers, read by each library's own means ------------------------------------------

def pointer(obj: Any) -> int:
    """The address of an array's first element, from the library itself (not from dlbridge)."""
    mod = type(obj).__module__.split(".")[0]
    if mod == "numpy":
        return obj.__array_interface__["data"][0]
    if mod == "torch":
        return obj.data_ptr()
    if mod in ("jax", "jaxlib"):
        return obj.unsafe_buffer_pointer()
    if mod == "tensorflow":
        from ._dlpack_ctypes import read_capsule
        return read_capsule(need("tensorflow").experimental.dlpack.to_dlpack(obj)).pointer
    if mod == "pyarrow":
        buf = obj.buffers()[1]
        return buf.address + obj.offset * obj.type.byte_width
    if mod == "array_api_strict":
        return obj._array.__array_interface__["data"][0]
    if mod == "dlbridge":
        return obj.data_ptr
    raise TypeError(f"no pointer reader for {type(obj)}")


def to_numpy(obj: Any) -> Any:
    """An array's values as numpy (exotic dtypes as float32), for comparison."""
    np = need("numpy")
    mod = type(obj).__module__.split(".")[0]
    if mod == "torch":
        torch = need("torch")
        if obj.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            obj = obj.to(torch.float32)
        return obj.numpy()
    if mod in ("jax", "jaxlib", "tensorflow"):
        arr = np.asarray(obj)
        return arr.astype(np.float32) if str(arr.dtype) in EXOTIC else arr
    if mod == "pyarrow":
        return obj.to_numpy(zero_copy_only=False)
    if mod == "array_api_strict":
        return np.asarray(obj._array)
    if mod == "dlbridge":
        return np.from_dlpack(obj)
    return np.asarray(obj)


# --- consumers: Tensor -> the library's array ----------------------------------------------------

def consume_numpy(t: Any) -> Any:
    return need("numpy").from_dlpack(t)


def consume_torch(t: Any) -> Any:
    return need("torch").from_dlpack(t)


def consume_jax(t: Any) -> Any:
    need("jax")
    import jax.numpy as jnp
    return jnp.from_dlpack(t)


def consume_tensorflow(t: Any) -> Any:
    # tf.experimental.dlpack.from_dlpack takes only a bare legacy capsule.
    return need("tensorflow").experimental.dlpack.from_dlpack(t.__dlpack__())


def consume_xp(t: Any) -> Any:
    return need("array_api_strict").from_dlpack(t)


def need_pyarrow_consumer() -> Any:
    """pyarrow, if it can consume DLPack (`Array.from_dlpack`, pyarrow 26 on); else the test skips."""
    pa = need("pyarrow")
    if not hasattr(pa.Array, "from_dlpack"):
        pytest.skip(f"pyarrow {pa.__version__} has no Array.from_dlpack (added in pyarrow 26)")
    return pa


def consume_pyarrow(t: Any) -> Any:
    return need_pyarrow_consumer().Array.from_dlpack(t)


def consume_dlbridge(t: Any) -> Any:
    import dlbridge
    return dlbridge.from_dlpack(t)


CONSUMERS: dict[str, Callable[[Any], Any]] = {
    "numpy": consume_numpy,
    "torch": consume_torch,
    "jax": consume_jax,
    "tensorflow": consume_tensorflow,
    "array_api_strict": consume_xp,
    "pyarrow": consume_pyarrow,
    "dlbridge": consume_dlbridge,
}


class FakeCudaArray:
    """A CUDA producer written for the tests: a made-up device pointer that is never dereferenced
    (no real library can produce one on a machine without a GPU)."""

    def __init__(self, **overrides: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": (2, 3),
            "typestr": "<f4",
            "data": (0x7F00_0000_0000, False),
            "version": 3,
            "strides": None,
            "stream": None,
        } | overrides


CHILD_WAIT = 120  # seconds: the most a test's child process is waited for before it is killed


def reap(*procs: Any) -> None:
    """Joins child processes, killing any still alive after CHILD_WAIT (never a pass/fail bound)."""
    for p in procs:
        p.join(CHILD_WAIT)
        if p.is_alive():
            p.kill()
            p.join(CHILD_WAIT)
