"""dlbridge.Tensor as a producer: what `__dlpack__` puts into its capsules (read back with ctypes,
independently of dlbridge), its argument rules, and the other protocols it speaks."""

from __future__ import annotations

import pytest

import dlbridge

from ._dlpack_ctypes import IS_COPIED, READ_ONLY, capsule_name, read_capsule
from .libs import need


@pytest.fixture
def np():
    return need("numpy")


def test_versioned_capsule_when_max_version_is_one_or_more(np) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = dlbridge.from_dlpack(a)
    for mv in [(1, 0), (1, 3), (1, 99), (2, 0)]:
        info = read_capsule(t.__dlpack__(max_version=mv))
        assert info.name == "dltensor_versioned"
        assert info.version == (1, 3)
        assert info.flags == 0
        assert info.pointer == a.ctypes.data
        assert (info.device, info.dtype, info.shape, info.strides) == ((1, 0), (2, 32, 1), (2, 3), (3, 1))


def test_legacy_capsule_when_max_version_is_none_or_below_one(np) -> None:
    t = dlbridge.from_dlpack(np.arange(3, dtype=np.int16))
    for mv in [None, (0, 8), (-1, 0)]:
        kwargs = {} if mv is None else {"max_version": mv}
        info = read_capsule(t.__dlpack__(**kwargs))
        assert (info.name, info.version) == ("dltensor", None)
        assert info.strides == (1,), "strides are always present for ndim > 0"


def test_zero_dim_capsule_has_no_shape_entries(np) -> None:
    info = read_capsule(dlbridge.from_dlpack(np.array(5.0)).__dlpack__(max_version=(1, 3)))
    assert (info.shape, info.strides) == ((), None)


def test_every_call_gives_a_fresh_independent_capsule(np) -> None:
    a = np.arange(4.0)
    t = dlbridge.from_dlpack(a)
    caps = [t.__dlpack__(max_version=(1, 3)) for _ in range(5)]
    assert len({id(c) for c in caps}) == 5
    assert {read_capsule(c).pointer for c in caps} == {a.ctypes.data}
    del caps  # unconsumed capsules free only their own struct
    b = np.from_dlpack(t)
    assert b.ctypes.data == a.ctypes.data


def test_read_only_is_flagged_and_refuses_legacy(np) -> None:
    a = np.arange(4.0)
    a.flags.writeable = False
    t = dlbridge.from_dlpack(a)
    assert t.readonly
    assert read_capsule(t.__dlpack__(max_version=(1, 0))).flags & READ_ONLY
    with pytest.raises(BufferError, match="read-only"):
        t.__dlpack__()
    b = np.from_dlpack(t)
    assert not b.flags.writeable, "a read-only numpy array must not come back writable"
    # A copy is the consumer's own, hence writable, and flagged as a copy.
    info = read_capsule(t.__dlpack__(max_version=(1, 0), copy=True))
    assert info.flags == IS_COPIED
    assert info.pointer != a.ctypes.data and info.pointer % 256 == 0
    assert capsule_name(t.__dlpack__(copy=True)) == "dltensor"


def test_copy_true_copies_into_aligned_memory_and_copy_false_never_copies(np) -> None:
    a = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::-2]
    t = dlbridge.from_dlpack(a)
    c = np.from_dlpack(t, copy=True)
    assert c.ctypes.data != a.ctypes.data and c.ctypes.data % 256 == 0
    assert (c == a).all() and c.flags.writeable and c.flags.c_contiguous
    c[0, 0] = -1
    assert a[0, 0] != -1
    same = np.from_dlpack(t, copy=False)
    assert same.ctypes.data == a.ctypes.data


def test_dl_device_own_or_cpu_is_accepted_anything_else_is_buffer_error(np) -> None:
    t = dlbridge.from_dlpack(np.zeros(2))
    assert read_capsule(t.__dlpack__(max_version=(1, 0), dl_device=(1, 0))).device == (1, 0)
    assert read_capsule(t.__dlpack__(max_version=(1, 0), dl_device=(dlbridge.DeviceType.CPU, 0))).device == (1, 0)
    with pytest.raises(BufferError, match="dl_device cuda:0"):
        t.__dlpack__(max_version=(1, 0), dl_device=(2, 0))
    with pytest.raises(BufferError, match="cuda:0"):
        dlbridge.from_dlpack(t, device="cuda:0")


def test_stream_rules_for_cpu(np) -> None:
    t = dlbridge.from_dlpack(np.zeros(2))
    t.__dlpack__(stream=None)
    t.__dlpack__(stream=-1)
    with pytest.raises(ValueError, match="stream must be None"):
        t.__dlpack__(stream=1)
    with pytest.raises(TypeError, match="stream"):
        t.__dlpack__(stream="default")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_version": [1, 0]}, "max_version"),
        ({"max_version": (1,)}, "max_version"),
        ({"max_version": ("1", "0")}, "max_version"),
        ({"copy": 1}, "copy"),
        ({"copy": "yes"}, "copy"),
        ({"dl_device": "cpu"}, "dl_device"),
        ({"dl_device": (1,)}, "dl_device"),
    ],
)
def test_wrong_argument_types_are_type_errors_naming_the_field(np, kwargs, field) -> None:
    t = dlbridge.from_dlpack(np.zeros(2))
    with pytest.raises(TypeError, match=field):
        t.__dlpack__(**kwargs)


def test_arguments_are_keyword_only(np) -> None:
    t = dlbridge.from_dlpack(np.zeros(2))
    with pytest.raises(TypeError):
        t.__dlpack__(None)


def test_dlpack_device_and_properties(np) -> None:
    a = np.arange(24, dtype=np.int32).reshape(2, 3, 4)[:, ::-1, ::2]
    t = dlbridge.from_dlpack(a)
    dev = t.__dlpack_device__()
    assert dev == (1, 0) and dev[0] is dlbridge.DeviceType.CPU
    assert t.shape == (2, 3, 2) and t.strides == (12, -4, 2) and t.ndim == 3 and t.size == 12
    assert t.dtype == dlbridge.int32 and str(t.dtype) == "int32" and t.itemsize == 4 and t.nbytes == 48
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes, t.dtype.name) == (0, 32, 1, "int32")
    assert str(t.device) == "cpu" and t.device.type is dlbridge.DeviceType.CPU and t.device.id == 0
    assert t.data_ptr == a.ctypes.data and t.byte_offset == 0
    assert not t.readonly and not t.is_c_contiguous and not t.is_f_contiguous
    assert repr(t) == "dlbridge.Tensor(shape=(2, 3, 2), dtype=int32, device=cpu, strides=(12, -4, 2), readonly=False)"
    f = dlbridge.from_dlpack(np.asfortranarray(np.zeros((2, 3))))
    assert f.is_f_contiguous and not f.is_c_contiguous


def test_buffer_protocol_and_array_interface(np) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = dlbridge.from_dlpack(a)
    m = memoryview(t)
    assert (m.format, m.shape, m.strides, m.readonly) == ("f", (3, 4), (16, 4), False)
    m[1, 2] = 99.0
    assert a[1, 2] == 99.0
    b = np.asarray(t)
    assert b.ctypes.data == a.ctypes.data
    ai = t.__array_interface__
    assert ai["typestr"] == "<f4" and ai["data"] == (a.ctypes.data, False) and ai["strides"] is None
    s = dlbridge.from_dlpack(a[:, ::-2])
    assert s.__array_interface__["strides"] == (16, -8)
    ms = memoryview(s)
    assert ms.strides == (16, -8) and ms.tolist() == a[:, ::-2].tolist()
    ro = a.copy()
    ro.flags.writeable = False
    r = dlbridge.from_dlpack(ro)
    assert memoryview(r).readonly
    assert r.__array_interface__["data"][1] is True
    assert not np.asarray(r).flags.writeable


def test_dtypes_without_a_buffer_format_say_so() -> None:
    torch = need("torch")
    t = dlbridge.from_dlpack(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(BufferError, match="bfloat16 has no buffer format"):
        memoryview(t)
    with pytest.raises(AttributeError, match="bfloat16"):
        t.__array_interface__  # noqa: B018
    assert not hasattr(t, "__cuda_array_interface__")


def test_module_constants() -> None:
    assert dlbridge.__dlpack_version__ == (1, 3)
    assert dlbridge.float32 == dlbridge.DType("float32") == dlbridge.DType(2, 32)
    assert repr(dlbridge.bfloat16) == "dlbridge.bfloat16" and str(dlbridge.float8_e4m3fn) == "float8_e4m3fn"
    assert dlbridge.float4_e2m1fn_x2.lanes == 2
    assert {m.name: int(m) for m in dlbridge.DeviceType}["TRN"] == 18
    assert len(dlbridge.DeviceType) == 19
    assert str(dlbridge.Device("cuda:1")) == "cuda:1" and dlbridge.Device(2, 1) == dlbridge.Device("cuda:1")
    assert dlbridge.Device("cpu").__dlpack_device__() == (1, 0)
    with pytest.raises(ValueError, match="float12"):
        dlbridge.DType("float12")
    with pytest.raises(ValueError, match="gpu"):
        dlbridge.Device("gpu")
    with pytest.raises(BufferError, match="dtype.bits"):
        dlbridge.DType(2, 8)


def test_importing_dlbridge_imports_no_array_library() -> None:
    import subprocess
    import sys

    code = "import sys, dlbridge; print(sorted(m for m in ('numpy','torch','jax','tensorflow','pyarrow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_version_matches_the_installed_distribution() -> None:
    from importlib.metadata import version

    assert dlbridge.__version__ == version("dlbridge")
