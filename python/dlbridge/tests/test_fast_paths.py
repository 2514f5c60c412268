"""The fast paths give exactly what the slow ones give: the C exchange API (dlbridge's own table,
called function by function through ctypes, and torch's table as consumed by dlbridge), the
numpy struct fast path, and the borrowed view. Fake exchange tables are written for the test."""

from __future__ import annotations

import ctypes
import math

import pytest

import dlbridge
from dlbridge import _dlbridge

from ._dlpack_ctypes import DLManagedTensorVersioned, DLPackVersion, DLTensor, DLDevice, DLDataType, FakeVersionedCapsule
from .libs import need

Ptr = ctypes.c_void_p
ManagedPtr = ctypes.POINTER(DLManagedTensorVersioned)
SET_ERROR = ctypes.CFUNCTYPE(None, Ptr, ctypes.c_char_p, ctypes.c_char_p)
# PYFUNCTYPE: called with the GIL held, and a set Python exception is raised after the call.
ALLOCATOR = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.POINTER(DLTensor), ctypes.POINTER(ManagedPtr), Ptr, SET_ERROR)
FROM_PY = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(ManagedPtr))
TO_PY = ctypes.PYFUNCTYPE(ctypes.c_int, ManagedPtr, ctypes.POINTER(ctypes.py_object))
DLTENSOR_FROM_PY = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(DLTensor))
STREAM = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(Ptr))


class Header(ctypes.Structure):
    pass


Header._fields_ = [("version", DLPackVersion), ("prev_api", ctypes.POINTER(Header))]


class ExchangeAPI(ctypes.Structure):
    _fields_ = [("header", Header), ("managed_tensor_allocator", ALLOCATOR), ("managed_tensor_from_py_object_no_sync", FROM_PY),
                ("managed_tensor_to_py_object_no_sync", TO_PY), ("dltensor_from_py_object_no_sync", DLTENSOR_FROM_PY),
                ("current_work_stream", STREAM)]


def dlbridge_table() -> ExchangeAPI:
    cap = dlbridge.Tensor.__dlpack_c_exchange_api__
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ExchangeAPI.from_address(get(cap, b"dlpack_exchange_api"))


def test_dlbridge_publishes_a_1_3_table_with_all_five_functions() -> None:
    api = dlbridge_table()
    assert (api.header.version.major, api.header.version.minor) == (1, 3)
    assert not api.header.prev_api
    for f in ["managed_tensor_allocator", "managed_tensor_from_py_object_no_sync", "managed_tensor_to_py_object_no_sync",
              "dltensor_from_py_object_no_sync", "current_work_stream"]:
        assert ctypes.cast(getattr(api, f), Ptr).value, f


def test_exchange_from_py_object_and_back() -> None:
    np = need("numpy")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = dlbridge.from_dlpack(a)
    api = dlbridge_table()
    out = ManagedPtr()
    assert api.managed_tensor_from_py_object_no_sync(t, ctypes.byref(out)) == 0
    m = out.contents
    assert (m.version.major, m.dl_tensor.data, m.dl_tensor.ndim) == (1, a.ctypes.data, 2)
    assert [m.dl_tensor.shape[i] for i in range(2)] == [2, 3]
    back = ctypes.py_object()
    assert api.managed_tensor_to_py_object_no_sync(out, ctypes.byref(back)) == 0  # steals `out`
    u = back.value
    assert isinstance(u, dlbridge.Tensor) and u.data_ptr == a.ctypes.data
    assert np.from_dlpack(u).tolist() == a.tolist()


def test_exchange_borrowed_dltensor() -> None:
    np = need("numpy")
    a = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::-2]
    t = dlbridge.from_dlpack(a)
    d = DLTensor()
    assert dlbridge_table().dltensor_from_py_object_no_sync(t, ctypes.byref(d)) == 0
    assert (d.data + d.byte_offset, d.ndim, (d.dtype.code, d.dtype.bits)) == (a.ctypes.data, 2, (0, 16))
    assert [d.strides[i] for i in range(2)] == [4, -2]


def test_exchange_borrowed_dltensor_refuses_read_only_tensors() -> None:
    # A borrowed DLTensor has no flags: a consumer (another extension embedding dlbridge, say)
    # would take the memory as writable. The owning function carries READ_ONLY instead.
    ro = dlbridge.asdlpack(b"abc")
    with pytest.raises(BufferError, match="read-only"):
        dlbridge_table().dltensor_from_py_object_no_sync(ro, ctypes.byref(DLTensor()))
    out = ManagedPtr()
    assert dlbridge_table().managed_tensor_from_py_object_no_sync(ro, ctypes.byref(out)) == 0
    assert out.contents.flags & 1  # READ_ONLY
    out.contents.deleter(out)


def test_exchange_borrowed_dltensor_refuses_padded_sub_byte_tensors() -> None:
    # A borrowed DLTensor cannot say IS_SUBBYTE_TYPE_PADDED: a consumer would read 8 padded float4
    # bytes as 4 packed ones (other values, half the memory).
    t = dlbridge.from_dlpack(FakeVersionedCapsule(shape=(8,), strides=(1,), dtype=(17, 4, 1), flags=4))
    with pytest.raises(BufferError, match="padded"):
        dlbridge_table().dltensor_from_py_object_no_sync(t, ctypes.byref(DLTensor()))
    out = ManagedPtr()
    assert dlbridge_table().managed_tensor_from_py_object_no_sync(t, ctypes.byref(out)) == 0
    assert out.contents.flags & 4  # the owning form carries the flag
    out.contents.deleter(out)


def test_exchange_refuses_tensors_whose_producer_queues_on_a_stream() -> None:
    # A no-sync export cannot wait for the producer's CUDA stream; __dlpack__(stream=) can.
    class FakeCuda:  # a made-up device pointer, never dereferenced
        __cuda_array_interface__ = {
            "shape": (2,), "typestr": "<f4", "data": (0x7F00_0000_0000, False), "version": 3,
            "strides": None, "stream": 0x1234,
        }

    t = dlbridge.asdlpack(FakeCuda(), device_id=0)
    with pytest.raises(BufferError, match="stream 0x1234"):
        dlbridge_table().managed_tensor_from_py_object_no_sync(t, ctypes.byref(ManagedPtr()))
    with pytest.raises(BufferError, match="stream 0x1234"):
        dlbridge_table().dltensor_from_py_object_no_sync(t, ctypes.byref(DLTensor()))


def test_exchange_allocator_and_stream() -> None:
    api = dlbridge_table()
    shape = (ctypes.c_int64 * 2)(3, 5)
    proto = DLTensor(device=DLDevice(1, 0), ndim=2, dtype=DLDataType(2, 32, 1), shape=ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)))
    out = ManagedPtr()
    assert api.managed_tensor_allocator(ctypes.byref(proto), ctypes.byref(out), None, SET_ERROR()) == 0
    m = out.contents
    assert m.dl_tensor.data % 256 == 0 and [m.dl_tensor.shape[i] for i in range(2)] == [3, 5]
    m.deleter(out)
    errors = []
    on_error = SET_ERROR(lambda ctx, kind, msg: errors.append((kind.decode(), msg.decode())))
    proto.device = DLDevice(2, 0)
    assert api.managed_tensor_allocator(ctypes.byref(proto), ctypes.byref(out), None, on_error) == -1
    assert errors and errors[0][0] == "BufferError" and "host" in errors[0][1]
    stream = Ptr(1234)
    assert api.current_work_stream(2, 0, ctypes.byref(stream)) == 0 and not stream.value


def test_exchange_functions_refuse_other_objects_with_a_python_error() -> None:
    api = dlbridge_table()
    with pytest.raises(TypeError):
        api.managed_tensor_from_py_object_no_sync([1, 2], ctypes.byref(ManagedPtr()))
    with pytest.raises(TypeError):
        api.dltensor_from_py_object_no_sync("x", ctypes.byref(DLTensor()))


def test_tvm_ffi_imports_a_tensor_through_the_exchange_table(monkeypatch) -> None:
    """apache-tvm-ffi, a real consumer, tries `__dlpack_c_exchange_api__` first and falls back to
    the legacy `__dlpack__()`. dlbridge refuses a legacy capsule for a read-only tensor (it could
    not say so), so a read-only Tensor reaching tvm-ffi proves the table was used."""
    np = need("numpy")
    # tvm-ffi would JIT-compile a helper for a torch without an exchange table; never here.
    monkeypatch.setenv("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    tvm_ffi = need("tvm_ffi")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    a.flags.writeable = False
    t = dlbridge.from_dlpack(a)
    with pytest.raises(BufferError, match="read-only"):
        t.__dlpack__()  # the fallback tvm-ffi would take
    x = tvm_ffi.from_dlpack(t)
    assert (tuple(x.shape), str(x.dtype)) == ((2, 3), "float32")
    back = np.from_dlpack(x)
    assert back.ctypes.data == a.ctypes.data  # zero-copy both ways
    a.flags.writeable = True
    a[1, 2] = 42.0
    assert back[1, 2] == 42.0  # a write on one side is seen on the other
    # And tvm-ffi's tensors as a producer for dlbridge (through their __dlpack__).
    assert dlbridge.from_dlpack(x).data_ptr == a.ctypes.data


@pytest.mark.hooks
def test_a_table_without_the_borrowed_function_from_tvm_ffi(monkeypatch) -> None:
    # tvm-ffi's DLTensorTestWrapper publishes a table whose dltensor_from_py_object_no_sync is
    # NULL: the owned import and the view must both still see the same memory.
    np = need("numpy")
    monkeypatch.setenv("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    tvm_ffi = need("tvm_ffi")
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    w = tvm_ffi.core.DLTensorTestWrapper(tvm_ffi.from_dlpack(a))
    t = dlbridge.from_dlpack(w)
    assert (t.data_ptr, t.shape, t.strides) == (a.ctypes.data, (3, 4), (4, 1))
    assert _dlbridge._view(w) == (a.ctypes.data, [3, 4], [4, 1], "int32", False)


@pytest.mark.hooks
def test_torch_exchange_table_is_consumed_with_the_same_result() -> None:
    torch = need("torch")
    x = torch.arange(10, dtype=torch.float32)[::2]
    assert hasattr(type(x), "__dlpack_c_exchange_api__")
    t = dlbridge.from_dlpack(x)
    assert (t.data_ptr, t.shape, t.strides, t.readonly) == (x.data_ptr(), (5,), (2,), False)
    via_protocol = dlbridge.from_dlpack(x, stream=None, copy=False)
    assert via_protocol.data_ptr == t.data_ptr
    assert _dlbridge._view(x) == (x.data_ptr(), [5], [2], "float32", False)


@pytest.mark.hooks
@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 4, 5), (1,) * 8, (2,) * 9])
def test_torch_views_copy_every_rank(shape) -> None:
    # Up to 8 dimensions the view copies the dims inline; 0 and 9 take the checked copy.
    torch = need("torch")
    x = torch.arange(float(math.prod(shape)), dtype=torch.float32).reshape(shape)
    if x.dim() >= 2:
        x = x.transpose(0, x.dim() - 1)  # non-trivial strides
    want = (x.data_ptr(), list(x.shape), list(x.stride()), "float32", False)
    assert _dlbridge._view(x) == want


class _FakeTableProducer:
    """A producer type whose exchange table is broken (written for the test); its __dlpack__ works."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return (1, 0)


def _fake_table(major: int, null_functions: bool):
    api = ExchangeAPI()
    api.header.version = DLPackVersion(major, 0)
    keep = []
    if not null_functions:
        def boom(*args):
            raise AssertionError("a table dlbridge should not use was called")
        for name, ftype in ExchangeAPI._fields_[1:]:
            f = ftype(boom)
            keep.append(f)
            setattr(api, name, f)
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(api), b"dlpack_exchange_api", None), (api, keep)


@pytest.mark.parametrize(("major", "nulls"), [(2, False), (0, False), (1, True)])
def test_unusable_exchange_tables_are_ignored(major: int, nulls: bool) -> None:
    np = need("numpy")
    cap, keep = _fake_table(major, nulls)
    cls = type(f"Table{major}{nulls}", (_FakeTableProducer,), {"__dlpack_c_exchange_api__": cap, "_keep": keep})
    a = np.arange(4.0)
    t = dlbridge.from_dlpack(cls(a))
    assert t.data_ptr == a.ctypes.data


@pytest.mark.hooks
def test_numpy_fast_path_matches_the_dlpack_path() -> None:
    np = need("numpy")
    cases = [np.arange(24, dtype=np.float64).reshape(2, 3, 4)[:, ::-1, 1::2], np.array(5, dtype=np.int8),
             np.zeros((0, 3), np.complex64), np.asfortranarray(np.ones((3, 2), np.float16)), np.arange(5, dtype=np.uint64)]
    ro = np.arange(3.0)
    ro.flags.writeable = False
    cases.append(ro)
    for a in cases:
        fast = dlbridge.from_dlpack(a)
        slow = dlbridge.from_dlpack(a, copy=False, stream=None)  # negotiated: always the DLPack path
        assert (fast.data_ptr, fast.shape, fast.strides, str(fast.dtype), fast.readonly) == \
               (slow.data_ptr, slow.shape, slow.strides, str(slow.dtype), slow.readonly)
        assert _dlbridge._view(a) == (fast.data_ptr, list(fast.shape), list(fast.strides), str(fast.dtype), fast.readonly)
    assert _dlbridge._numpy_fast_path()


def test_numpy_refusals_are_numpy_s_own() -> None:
    np = need("numpy")
    odd = np.lib.stride_tricks.as_strided(np.zeros(10, np.int32), (3,), (6,))
    with pytest.raises(BufferError):
        dlbridge.from_dlpack(odd)
    with pytest.raises(BufferError):
        dlbridge.from_dlpack(np.arange(3, dtype=">i4"))


@pytest.mark.hooks
def test_borrowed_view_of_buffers_and_dlbridge_tensors() -> None:
    np = need("numpy")
    b = bytearray(8)
    assert _dlbridge._view(b)[1:] == ([8], [1], "uint8", False)
    assert _dlbridge._view(b"abc")[4] is True
    t = dlbridge.from_dlpack(np.arange(6.0).reshape(2, 3).T)
    assert _dlbridge._view(t) == (t.data_ptr, [3, 2], [1, 3], "float64", False)


@pytest.mark.hooks
def test_an_unreadable_first_numpy_array_does_not_turn_the_fast_path_off() -> None:
    import subprocess
    import sys

    code = (
        "import numpy as np, dlbridge\n"
        "from dlbridge import _dlbridge\n"
        "try:\n    dlbridge.from_dlpack(np.arange(3, dtype='>i4'))\nexcept BufferError:\n    pass\n"
        "dlbridge.from_dlpack(np.arange('2020-01', '2020-03', dtype='datetime64[M]').astype('M8[D]').view('i8'))\n"
        "print(_dlbridge._numpy_fast_path())\n"
    )
    need("numpy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


@pytest.mark.parametrize("address", [0, 3, "not an int"])
def test_integer_form_tables_that_cannot_be_tables_are_ignored(address) -> None:
    np = need("numpy")
    cls = type("IntTable", (_FakeTableProducer,), {"__c_dlpack_exchange_api__": address})
    a = np.arange(3.0)
    assert dlbridge.from_dlpack(cls(a)).data_ptr == a.ctypes.data


@pytest.mark.hooks
def test_torch_lazy_conjugates_are_refused_not_misread() -> None:
    """torch's exchange table exports a lazily conjugated tensor as if its memory held the result
    (torch's own __dlpack__ refuses it): dlbridge refuses it on every path, naming the bit."""
    torch = need("torch")
    z = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64)
    lazy = {"is_conj": z.conj(), "is_neg": torch._neg_view(z)}
    for bit, x in lazy.items():
        assert getattr(x, bit)()
        for f in (dlbridge.from_dlpack, _dlbridge._view, dlbridge.asdlpack):
            with pytest.raises(BufferError, match=bit):
                f(x)
    resolved = dlbridge.from_dlpack(z.conj().resolve_conj())
    np = need("numpy")
    assert np.from_dlpack(resolved).tolist() == [1 - 2j, 3 - 4j]


def test_torch_tensors_that_require_grad_are_refused_as_torch_refuses_them() -> None:
    """torch's __dlpack__ refuses tensors that require grad; its exchange table (what dlbridge uses
    for host tensors) exports them. dlbridge follows the producer's rule on both paths: a write
    through it would change a leaf of the autograd graph behind torch's back."""
    torch = need("torch")
    x = torch.arange(3.0, requires_grad=True)
    with pytest.raises(BufferError):
        x.__dlpack__()
    with pytest.raises(BufferError, match="detach"):
        dlbridge.from_dlpack(x)
    with pytest.raises(BufferError, match="detach"):
        dlbridge.asdlpack(torch.nn.Parameter(torch.ones(2)))
    # Detached, the same memory comes through, zero-copy.
    assert dlbridge.from_dlpack(x.detach()).data_ptr == x.data_ptr()

def _view_sources():
    """(name, make) for every kind of source a view reads, each making a float64 array of 6."""
    out = [("numpy", lambda: need("numpy").arange(6.0)),
           ("numpy strided", lambda: need("numpy").arange(12.0)[::2]),
           ("numpy 2-d transposed", lambda: need("numpy").arange(6.0).reshape(2, 3).T),
           ("numpy size 0", lambda: need("numpy").zeros((0, 3))),
           ("numpy 0-d", lambda: need("numpy").array(2.5)),
           ("numpy 9-d", lambda: need("numpy").arange(6.0).reshape((1,) * 8 + (6,))),
           ("dlbridge.Tensor", lambda: dlbridge.from_dlpack(need("numpy").arange(6.0))),
           ("torch", lambda: need("torch").arange(6.0, dtype=need("torch").float64)),
           ("torch size 0", lambda: need("torch").zeros((3, 0), dtype=need("torch").float64)),
           ("bytes-like (buffer protocol)", lambda: __import__("array").array("d", range(6)))]
    return out


@pytest.mark.hooks
@pytest.mark.parametrize("name,make", _view_sources(), ids=[n for n, _ in _view_sources()])
def test_a_view_and_its_managed_tensor_agree_for_every_source(name, make) -> None:
    # What the view reports, what its ManagedTensor (through Deref) reports, and what numpy
    # makes of the same source all describe the same memory, for every path a view takes
    # (struct read, exchange table, buffer protocol, 0-d, size 0, more than 8 dims).
    x = make()
    seen = _dlbridge._view(x)
    via_deref, described = _dlbridge._view_deref(x)
    assert via_deref == seen
    assert described == f"float64 shape {tuple(seen[1])} strides {tuple(seen[2])} on cpu"
    np = need("numpy")
    ref = np.from_dlpack(x) if not isinstance(x, __import__("array").array) else np.frombuffer(x)
    assert seen[1] == list(ref.shape)
    if ref.size:  # an empty tensor's address and strides mean nothing (each library picks its own)
        assert seen[0] == ref.__array_interface__["data"][0]
        assert seen[2] == [s // ref.itemsize for s in ref.strides]
    assert seen[3] == "float64" and seen[4] is False


@pytest.mark.hooks
def test_typed_access_through_a_view_writes_the_source() -> None:
    np = need("numpy")
    a = np.arange(4.0)
    assert _dlbridge._view_add(a, 1.0) == 10.0  # as_slice_mut, then as_slice
    assert a.tolist() == [1.0, 2.0, 3.0, 4.0]  # the write is seen by numpy: zero-copy
    torch = need("torch")
    x = torch.arange(4.0, dtype=torch.float64)
    assert _dlbridge._view_add(x, 2.0) == 14.0 and x.tolist() == [2.0, 3.0, 4.0, 5.0]
    t = dlbridge.from_dlpack(np.arange(3.0))
    assert _dlbridge._view_add(t, 0.5) == 4.5


@pytest.mark.hooks
def test_typed_access_through_a_view_refuses_what_it_must() -> None:
    np = need("numpy")
    r = np.arange(4.0)
    r.flags.writeable = False
    with pytest.raises(Exception, match="writable"):
        _dlbridge._view_add(r, 1.0)
    assert r.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(Exception, match="C-contiguous"):
        _dlbridge._view_add(np.arange(8.0)[::2], 1.0)
    with pytest.raises(Exception, match="float64"):
        _dlbridge._view_add(np.arange(4, dtype=np.float32), 1.0)


@pytest.mark.hooks
def test_a_view_keeps_its_shape_when_python_reshapes_the_source_during_the_call() -> None:
    np = need("numpy")
    a = np.arange(6.0)

    def reshape():
        # In place, numpy reallocating the dimensions array (the same bytes, so the data stays;
        # `a.shape = ...` does the same but is deprecated from numpy 2.5).
        a.resize((2, 3))

    seen = _dlbridge._view_then(a, reshape)
    assert seen == (a.ctypes.data, [6], [1], "float64", False)
    assert a.shape == (2, 3)
    torch = need("torch")
    x = torch.arange(6.0)
    seen = _dlbridge._view_then(x, lambda: x.unsqueeze_(0))
    assert seen == (x.data_ptr(), [6], [1], "float32", False)
    assert tuple(x.shape) == (1, 6)


# --- the fastcall entry points (Tensor.__dlpack__, from_dlpack, asdlpack) --------------------------


def _tensor() -> dlbridge.Tensor:
    return dlbridge.asdlpack(bytearray(b"\x01\x02\x03"))


def test_dlpack_keyword_names_built_at_run_time_are_matched_by_text():
    # Names made at run time are not interned, so the pointer match misses and the text
    # comparison must find them.
    name = "".join(["max_", "version"])
    interned = "max_version"
    assert name == interned and name is not interned
    cap = _tensor().__dlpack__(**{name: (1, 0)})
    assert '"dltensor_versioned"' in repr(cap)
    assert '"dltensor"' in repr(_tensor().__dlpack__(**{"".join(["max_", "version"]): None}))


def test_fastcall_entry_points_name_the_bad_argument():
    t = _tensor()
    with pytest.raises(TypeError, match=r"__dlpack__\(\) takes 0 positional arguments but 1 were given"):
        t.__dlpack__((1, 0))
    with pytest.raises(TypeError, match=r"__dlpack__\(\) got an unexpected keyword argument 'maxversion'"):
        t.__dlpack__(maxversion=(1, 0))
    with pytest.raises(TypeError, match=r"from_dlpack\(\) takes 1 positional argument but 0 were given"):
        dlbridge.from_dlpack()
    with pytest.raises(TypeError, match=r"from_dlpack\(\): argument 'copy'"):
        dlbridge.from_dlpack(t, copy=3)
    with pytest.raises(TypeError, match=r"from_dlpack\(\): argument 'legacy_writable'"):
        dlbridge.from_dlpack(t, legacy_writable="yes")
    with pytest.raises(TypeError, match=r"asdlpack\(\): argument 'device_id'"):
        dlbridge.asdlpack(t, device_id="0")
    with pytest.raises(TypeError, match=r"asdlpack\(\) takes 1 positional argument but 2 were given"):
        dlbridge.asdlpack(t, 0)
    with pytest.raises(TypeError, match=r"from_dlpack\(\) got an unexpected keyword argument 'devise'"):
        dlbridge.from_dlpack(t, devise="cpu")


def test_fastcall_entry_points_keep_their_signatures():
    import inspect

    assert str(inspect.signature(dlbridge.Tensor.__dlpack__)) == "(self, /, *, stream=None, max_version=None, dl_device=None, copy=None)"
    assert str(inspect.signature(dlbridge.from_dlpack)) == "(x, /, *, device=None, copy=None, stream=None, legacy_writable=False)"
    assert str(inspect.signature(dlbridge.asdlpack)) == "(obj, /, *, device_id=None)"
    assert type(dlbridge.Tensor.__dict__["__dlpack__"]).__name__ == "method_descriptor"
    # Keywords given explicitly as None are the defaults.
    t = dlbridge.from_dlpack(_tensor(), device=None, copy=None, stream=None, legacy_writable=False)
    assert t.shape == (3,)
    assert dlbridge.asdlpack(t, device_id=None).shape == (3,)
