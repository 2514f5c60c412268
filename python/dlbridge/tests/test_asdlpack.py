"""dlbridge.asdlpack: one adapter for every array protocol.

The matrix feeds numpy arrays through each of the four protocols, and bytes, bytearray,
array.array, memoryview, mmap and numpy.memmap, to numpy, torch, jax and dlbridge, proving
zero-copy by pointer equality and by writes. Objects that expose only one protocol are thin
wrappers written for the test (numpy arrays expose all of them at once); CUDA producers are fake
(their pointers are never dereferenced) except in the tests marked `gpu`.
"""

from __future__ import annotations

import array
import gc
import mmap
import weakref

import pytest

import dlbridge

from ._dlpack_ctypes import READ_ONLY, read_capsule
from .libs import NUMPY_DTYPES, TORCH_NEGATIVE_STRIDES_RAISE, FakeCudaArray, assert_no_growth, need, skip_before_torch

SHAPES = ["0d", "1d", "3d", "size0", "negative"]


class ArrayInterfaceOnly:
    """Exposes a numpy array through `__array_interface__` alone (pointer form)."""

    def __init__(self, a):
        self._a = a
        self.__array_interface__ = a.__array_interface__


class BufferOnly:
    """Exposes a numpy array through the buffer protocol alone (a memoryview does exactly that)."""


def numpy_case(dtype: str, shape: str):
    np = need("numpy")
    base = (np.arange(24).reshape(2, 3, 4) % 7).astype(np.float32)
    if dtype == "bool":
        base = base % 2
    a = base.astype(dtype)
    return {
        "0d": lambda: np.array(a[1, 2, 3]),
        "1d": lambda: a.reshape(-1).copy(),
        "3d": lambda: a,
        "size0": lambda: a[:, :0, :],
        "negative": lambda: a[:, ::-1, ::-2],
    }[shape]()


SOURCES = {
    "numpy-dlpack": lambda a: a,
    "numpy-buffer": lambda a: memoryview(a),
    "numpy-array-interface": ArrayInterfaceOnly,
}


def first_address(a) -> int:
    return a.__array_interface__["data"][0]


def consume(consumer: str, t):
    if consumer == "numpy":
        return need("numpy").from_dlpack(t)
    if consumer == "torch":
        return need("torch").from_dlpack(t)
    if consumer == "jax":
        need("jax").config.update("jax_enable_x64", True)
        import jax.numpy as jnp
        return jnp.from_dlpack(t)
    return dlbridge.from_dlpack(t)


def consumer_pointer(consumer: str, y) -> int:
    return {"numpy": first_address, "torch": lambda y: y.data_ptr(), "jax": lambda y: y.unsafe_buffer_pointer(),
            "dlbridge": lambda y: y.data_ptr}[consumer](y)


def to_list(consumer: str, y):
    if consumer == "dlbridge":
        y = need("numpy").from_dlpack(y)
    if consumer == "jax":
        y = need("numpy").asarray(y)
    return y.tolist()


@pytest.mark.parametrize("consumer", ["numpy", "torch", "jax", "dlbridge"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("source", list(SOURCES))
def test_numpy_through_each_protocol(source: str, dtype: str, shape: str, consumer: str) -> None:
    a = numpy_case(dtype, shape)
    t = dlbridge.asdlpack(SOURCES[source](a))
    assert (t.shape, str(t.dtype), t.readonly) == (a.shape, dtype, False)
    if a.size:
        assert t.data_ptr == first_address(a)
    if consumer == "torch" and shape == "negative":
        skip_before_torch(*TORCH_NEGATIVE_STRIDES_RAISE)
        with pytest.raises(RuntimeError, match="Storage size calculation overflowed"):
            consume(consumer, t)
        return
    if consumer == "jax" and shape == "negative":
        with pytest.raises(Exception, match="compact"):
            consume(consumer, t)
        return
    y = consume(consumer, t)
    assert to_list(consumer, y) == a.tolist()
    if a.size:
        zero_copy = consumer != "jax" or first_address(a) % 64 == 0
        assert (consumer_pointer(consumer, y) == first_address(a)) == zero_copy


@pytest.mark.parametrize("consumer", ["numpy", "torch", "dlbridge"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_writes_through_the_consumer_reach_the_source(source: str, consumer: str) -> None:
    base = numpy_case("float64", "3d")
    a = base[:, 1:, ::2]  # a strided view with an offset start (torch refuses negative strides)
    y = consume(consumer, dlbridge.asdlpack(SOURCES[source](a)))
    if consumer == "dlbridge":
        y = need("numpy").from_dlpack(y)
    y[1, 1, 1] = 123.0
    assert base[1, 2, 2] == 123.0


ARRAY_CODES = {"b": "int8", "B": "uint8", "h": "int16", "H": "uint16", "i": "int32", "I": "uint32",
               "l": "int64", "L": "uint64", "q": "int64", "Q": "uint64", "f": "float32", "d": "float64"}


@pytest.mark.parametrize("code", list(ARRAY_CODES))
def test_array_array_of_every_typecode(code: str) -> None:
    src = array.array(code, [1, 2, 3])
    t = dlbridge.asdlpack(src)
    assert (str(t.dtype), t.shape, t.readonly) == (ARRAY_CODES[code], (3,), False)
    assert t.data_ptr == src.buffer_info()[0]
    np = need("numpy")
    np.from_dlpack(t)[1] = 9
    assert src[1] == 9


def test_bytes_are_read_only_everywhere_that_reads_the_flag() -> None:
    np = need("numpy")
    b = b"hello world!"
    t = dlbridge.asdlpack(b)
    assert (t.readonly, str(t.dtype), t.shape) == (True, "uint8", (12,))
    assert read_capsule(t.__dlpack__(max_version=(1, 0))).flags & READ_ONLY
    with pytest.raises(BufferError, match="read-only"):
        t.__dlpack__()  # a legacy capsule could not say read-only
    assert not np.from_dlpack(t).flags.writeable
    assert np.from_dlpack(t).tobytes() == b


def test_pydlpack_readme_bytes_into_torch() -> None:
    # pydlpack's README example, with `from dlbridge import asdlpack`.
    torch = need("torch")
    from dlbridge import asdlpack

    data = b"\x00\x01\x02\x03"
    x = torch.from_dlpack(asdlpack(data))
    assert x.tolist() == [0, 1, 2, 3] and x.dtype == torch.uint8
    # torch ignores DLPack's READ_ONLY flag (its behaviour, not dlbridge's): the tensor it makes
    # is writable although dlbridge flagged the capsule read-only.
    assert read_capsule(asdlpack(data).__dlpack__(max_version=(1, 3))).flags & READ_ONLY


@pytest.mark.parametrize("make", [
    pytest.param(lambda: bytearray(range(8)), id="bytearray"),
    pytest.param(lambda: memoryview(bytearray(range(8))), id="memoryview"),
    pytest.param(lambda: memoryview(bytearray(range(8))).cast("i", (2, 1)), id="memoryview-cast"),
    pytest.param(lambda: _mmap(), id="mmap"),
])
def test_writable_buffer_exporters(make) -> None:
    src = make()
    t = dlbridge.asdlpack(src)
    assert not t.readonly
    np = need("numpy")
    arr = np.from_dlpack(t)
    arr.reshape(-1)[0] = 42
    assert memoryview(src).cast("B")[0] == 42


def _mmap():
    m = mmap.mmap(-1, 8)
    m.write(bytes(range(8)))
    return m


def test_memoryview_of_bytes_and_strided_views() -> None:
    np = need("numpy")
    assert dlbridge.asdlpack(memoryview(b"abcd")).readonly
    a = np.arange(24, dtype=np.int16).reshape(4, 6)
    m = memoryview(a[::2, ::-3])
    t = dlbridge.asdlpack(m)
    assert t.strides == (12, -3) and np.from_dlpack(t).tolist() == a[::2, ::-3].tolist()


def test_numpy_memmap(tmp_path) -> None:
    np = need("numpy")
    mm = np.memmap(tmp_path / "data.bin", dtype=np.float32, mode="w+", shape=(4, 5))
    mm[:] = np.arange(20).reshape(4, 5)
    t = dlbridge.asdlpack(mm[::-1])
    assert t.data_ptr == first_address(mm[::-1])
    np.from_dlpack(t)[0, 0] = -1
    assert mm[3, 0] == -1
    ro = np.memmap(tmp_path / "data.bin", dtype=np.float32, mode="r", shape=(4, 5))
    assert dlbridge.asdlpack(ro).readonly


def test_array_interface_with_buffer_data_offset_and_none() -> None:
    np = need("numpy")
    raw = bytearray(np.arange(6, dtype=np.float64).tobytes())

    class WithBuffer:
        __array_interface__ = {"version": 3, "shape": (2, 2), "typestr": "<f8", "data": raw, "offset": 16,
                               "strides": None, "descr": [("", "<f8")]}

    t = dlbridge.asdlpack(WithBuffer())
    assert np.from_dlpack(t).tolist() == [[2.0, 3.0], [4.0, 5.0]]
    np.from_dlpack(t)[0, 0] = 9.0
    assert np.frombuffer(raw)[2] == 9.0

    class SelfBuffer(bytearray):
        __array_interface__ = {"version": 3, "shape": (4,), "typestr": "|u1", "data": None}

    s = SelfBuffer(b"wxyz")
    assert np.from_dlpack(dlbridge.asdlpack(s)).tolist() == list(b"wxyz")

    class ZeroD:
        def __init__(self):
            self._a = np.array(3.5)
            self.__array_interface__ = self._a.__array_interface__

    assert dlbridge.asdlpack(ZeroD()).shape == ()


AI_BASE = {"version": 3, "shape": (3,), "typestr": "<f8", "data": (0x1000, False)}


def _ai(**kw):
    d = dict(AI_BASE)
    for k, v in kw.items():
        if v is ...:
            d.pop(k)
        else:
            d[k] = v
    return type("Producer", (), {"__array_interface__": d})()


@pytest.mark.parametrize(("kw", "exc", "field"), [
    ({"typestr": "|V8"}, BufferError, "typestr"),
    ({"typestr": "|O8"}, BufferError, "typestr"),
    ({"typestr": "<M8"}, BufferError, "typestr"),
    ({"typestr": "<m8"}, BufferError, "typestr"),
    ({"typestr": "|S4"}, BufferError, "typestr"),
    ({"typestr": "<U2"}, BufferError, "typestr"),
    ({"typestr": ">f8"}, BufferError, "typestr"),
    ({"typestr": 8}, TypeError, "typestr"),
    ({"version": 2}, ValueError, "version"),
    ({"version": "3"}, TypeError, "version"),
    ({"version": ...}, ValueError, "version"),
    ({"mask": object()}, BufferError, "mask"),
    ({"descr": [("a", "<f8"), ("b", "<f8")]}, BufferError, "descr"),
    ({"descr": [("", "<f4")]}, BufferError, "descr"),
    ({"strides": (12,)}, BufferError, "strides"),
    ({"strides": (8, 8)}, ValueError, "strides"),
    ({"strides": "8"}, TypeError, "strides"),
    ({"shape": [3]}, TypeError, "shape"),
    ({"shape": ("a",)}, TypeError, "shape"),
    ({"shape": ...}, ValueError, "shape"),
    ({"shape": (-2,)}, BufferError, "shape"),
    ({"shape": (2**62, 2**62)}, BufferError, "shape"),
    ({"data": "0x1000"}, TypeError, "data"),
    ({"data": (0x1000,)}, TypeError, "data"),
    ({"data": (-1, False)}, ValueError, "data"),
    ({"data": (2**70, False)}, ValueError, "data"),
    ({"data": (2**64 - 8, False)}, BufferError, "strides"),
    ({"data": (0, False)}, BufferError, "data"),
    ({"data": (0x1000, False), "offset": 8}, ValueError, "offset"),
])
def test_array_interface_refusals_name_the_field(kw, exc, field) -> None:
    with pytest.raises(exc, match=field):
        dlbridge.asdlpack(_ai(**kw))


def test_array_interface_that_is_not_a_dict() -> None:
    with pytest.raises(TypeError, match="must be a dict"):
        dlbridge.asdlpack(type("P", (), {"__array_interface__": [1, 2]})())


@pytest.mark.parametrize(("make", "field"), [
    pytest.param(lambda np: memoryview(np.arange(3, dtype=">i4")), "format", id="big-endian"),
    pytest.param(lambda np: memoryview(np.zeros(2, dtype=[("a", "i4"), ("b", "f8")])), "format", id="struct"),
    pytest.param(lambda np: memoryview(bytearray(16)).cast("P"), "format", id="pointer"),
    pytest.param(lambda np: memoryview(bytearray(4)).cast("c"), "format", id="char"),
    pytest.param(lambda np: memoryview(np.lib.stride_tricks.as_strided(np.zeros(10, np.int32), (3,), (6,))), "strides",
                 id="stride-not-multiple-of-itemsize"),
])
def test_buffer_refusals_name_the_field(make, field) -> None:
    np = need("numpy")
    with pytest.raises(BufferError, match=field):
        dlbridge.asdlpack(make(np))


def test_nothing_to_wrap() -> None:
    with pytest.raises(
        TypeError,
        match=r"^expected an array \(an object with __dlpack__, the buffer protocol, __array_interface__ or "
        r"__cuda_array_interface__\), got object$",
    ):
        dlbridge.asdlpack(object())


# --- CUDA array interface: fake producers (no GPU here; pointers are never dereferenced) -------

@pytest.mark.hooks
def test_cuda_pointer_without_a_driver_needs_device_id() -> None:
    from dlbridge._dlbridge import _cuda_driver_available
    if _cuda_driver_available():
        pytest.skip("a CUDA driver is present: the device comes from the pointer")
    with pytest.raises(BufferError, match=r"cannot tell which CUDA device.*no CUDA driver.*device_id="):
        dlbridge.asdlpack(FakeCudaArray())


@pytest.mark.parametrize("version", [2, 3])
def test_cuda_metadata_with_explicit_device(version: int) -> None:
    t = dlbridge.asdlpack(FakeCudaArray(version=version, strides=(4, 12), typestr="<f4"), device_id=1)
    assert (str(t.device), t.shape, t.strides, t.readonly) == ("cuda:1", (2, 3), (1, 3), False)
    assert t.__dlpack_device__() == (dlbridge.DeviceType.CUDA, 1)
    cai = t.__cuda_array_interface__
    assert (cai["data"], cai["shape"], cai["strides"], cai["version"]) == ((0x7F00_0000_0000, False), (2, 3), (4, 12), 3)
    info = read_capsule(t.__dlpack__(max_version=(1, 3), stream=-1))
    assert (info.device, info.pointer, info.strides) == ((2, 1), 0x7F00_0000_0000, (1, 3))
    with pytest.raises(BufferError, match="not host memory"):
        memoryview(t)
    with pytest.raises(AttributeError):
        t.__array_interface__  # noqa: B018
    with pytest.raises(BufferError, match="copy=True needs host memory"):
        t.__dlpack__(max_version=(1, 3), copy=True)
    with pytest.raises(BufferError, match="dl_device cpu is not available"):
        t.__dlpack__(max_version=(1, 3), dl_device=(1, 0))


@pytest.mark.hooks
def test_cuda_read_only_flag_and_stream_rules() -> None:
    t = dlbridge.asdlpack(FakeCudaArray(data=(0x7F00_0000_0000, True)), device_id=0)
    assert t.readonly and read_capsule(t.__dlpack__(max_version=(1, 0), stream=-1)).flags & READ_ONLY
    with pytest.raises(ValueError, match="stream 0"):
        t.__dlpack__(max_version=(1, 0), stream=0)
    s = dlbridge.asdlpack(FakeCudaArray(stream=0x1234), device_id=0)
    s.__dlpack__(max_version=(1, 0), stream=-1)  # -1: the consumer asks for no synchronisation
    from dlbridge._dlbridge import _cuda_driver_available
    if not _cuda_driver_available():
        with pytest.raises(BufferError, match="cannot make stream 7 wait.*no CUDA driver"):
            s.__dlpack__(max_version=(1, 0), stream=7)


@pytest.mark.parametrize(("kw", "exc", "field"), [
    ({"mask": object()}, BufferError, "mask"),
    ({"version": 1}, ValueError, "version"),
    ({"stream": 0}, ValueError, "stream"),
    ({"stream": "s"}, TypeError, "stream"),
    ({"data": (0x7F00_0000_0000,)}, TypeError, "data"),
    ({"typestr": "<U4"}, BufferError, "typestr"),
    ({"shape": (-1, 3)}, BufferError, "shape"),
])
def test_cuda_refusals_name_the_field(kw, exc, field) -> None:
    with pytest.raises(exc, match=field):
        dlbridge.asdlpack(FakeCudaArray(**kw), device_id=0)


# --- lifetimes --------------------------------------------------------------------------------

def test_source_deleted_first_and_tensor_deleted_first() -> None:
    np = need("numpy")
    src = array.array("d", range(100))
    gone = weakref.ref(src)
    t = dlbridge.asdlpack(src)
    del src
    gc.collect()
    assert gone() is not None and np.from_dlpack(t)[99] == 99.0
    y = np.from_dlpack(t)
    del t
    gc.collect()
    assert gone() is not None and y[5] == 5.0
    del y
    gc.collect()
    assert gone() is None


def test_unconsumed_and_doubly_consumed_capsules() -> None:
    np = need("numpy")
    src = bytearray(16)
    t = dlbridge.asdlpack(src)
    for _ in range(3):
        t.__dlpack__(max_version=(1, 3))
    cap = t.__dlpack__(max_version=(1, 3))
    dlbridge.from_dlpack(cap)
    with pytest.raises(ValueError, match="already consumed"):
        dlbridge.from_dlpack(cap)
    with pytest.raises(BufferError):
        src.append(1)  # the exporter is still locked by the live view: proof the buffer is held
    del t, cap
    gc.collect()
    src.append(1)  # released: the bytearray may resize again
    assert len(np.frombuffer(src, dtype=np.uint8)) == 17


def test_100k_asdlpack_calls_do_not_grow_memory() -> None:
    np = need("numpy")
    b, a = b"x" * 64, np.arange(16.0)
    ai = ArrayInterfaceOnly(a)

    def once() -> None:
        np.from_dlpack(dlbridge.asdlpack(b))
        np.from_dlpack(dlbridge.asdlpack(ai))
        dlbridge.asdlpack(memoryview(a)).__dlpack__(max_version=(1, 3))

    assert_no_growth(once)


# --- real GPU (run on a machine with CUDA; skipped elsewhere) ---------------------------------

def _cuda_torch():
    torch = need("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


@pytest.mark.gpu
def test_gpu_torch_cuda_array_interface_round_trip() -> None:
    torch = _cuda_torch()
    x = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    t = dlbridge.asdlpack(type("C", (), {"__cuda_array_interface__": x.__cuda_array_interface__, "x": x})())
    assert str(t.device) == f"cuda:{x.device.index}" and t.data_ptr == x.data_ptr()
    y = torch.from_dlpack(t)
    y[0, 0] = 42
    torch.cuda.synchronize()
    assert x[0, 0].item() == 42


@pytest.mark.gpu
def test_gpu_shared_by_torch_jax_and_cupy() -> None:
    torch = _cuda_torch()
    cupy = pytest.importorskip("cupy")
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    t = dlbridge.asdlpack(x)
    c = cupy.from_dlpack(t)
    assert c.data.ptr == x.data_ptr()
    jax = pytest.importorskip("jax")
    j = jax.dlpack.from_dlpack(t)
    assert j.unsafe_buffer_pointer() == x.data_ptr()


@pytest.mark.gpu
def test_gpu_numba_cuda_array() -> None:
    _cuda_torch()
    cuda = pytest.importorskip("numba.cuda")
    d = cuda.to_device(need("numpy").arange(6, dtype="float64"))
    t = dlbridge.asdlpack(d)
    assert t.data_ptr == d.__cuda_array_interface__["data"][0]
