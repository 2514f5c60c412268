"""The names dlpack.h has merged since the 1.3 tag (the ABI and minor version unchanged): type code
18 `kDLBcomplex` (a pair of bfloat16, so 32 bits only), device types 19 `kDLTPU`, 20 `kDLTPUHost`
(pinned host memory of a TPU runtime, the header's mirror of `kDLCUDAHost`: jax sends it for its
`pinned_host` memory kind) and 21 `kDLAscend`. Each is named, accepted from a producer, and the first
codes after them are still refused."""

from __future__ import annotations

import pytest

import dlbridge
from dlbridge import _dlbridge

from ._dlpack_ctypes import FakeCapsule


def test_device_type_members_have_the_headers_codes() -> None:
    members = {m.name: int(m) for m in dlbridge.DeviceType}
    assert {k: members[k] for k in ("TPU", "TPU_HOST", "ASCEND")} == {"TPU": 19, "TPU_HOST": 20, "ASCEND": 21}
    assert dlbridge.DeviceType(20) is dlbridge.DeviceType.TPU_HOST
    for name, member in [("tpu", "TPU"), ("tpu_host", "TPU_HOST"), ("ascend", "ASCEND")]:
        d = dlbridge.Device(f"{name}:1")
        assert d.type is getattr(dlbridge.DeviceType, member) and d.id == 1 and str(d) == f"{name}:1"
        assert dlbridge.Device(int(d.type), 1) == d
    assert str(dlbridge.Device("tpu_host")) == "tpu_host"  # host memory prints without ordinal 0
    with pytest.raises(ValueError, match="22"):
        dlbridge.Device(22, 0)


def test_bcomplex32_is_a_pair_of_bfloat16() -> None:
    t = dlbridge.DType("bcomplex32")
    assert (t.code, t.bits, t.lanes, t.itemsize, str(t)) == (18, 32, 1, 4, "bcomplex32")
    assert t == dlbridge.DType(18, 32) == _dlbridge.bcomplex32
    with pytest.raises(BufferError, match="dtype.bits"):
        dlbridge.DType(18, 64)
    with pytest.raises(ValueError, match="bcomplex64"):
        dlbridge.DType("bcomplex64")


@pytest.mark.parametrize("versioned", [True, False])
def test_a_bcomplex32_tensor_is_accepted(versioned: bool) -> None:
    fake = FakeCapsule(versioned=versioned, dtype=(18, 32, 1))
    t = dlbridge.from_dlpack(fake.capsule)
    assert (str(t.dtype), t.shape, t.nbytes) == ("bcomplex32", (4,), 16)
    del t
    assert fake.deleted == 1


def test_tpu_host_memory_is_read_like_cuda_host_memory() -> None:
    fake = FakeCapsule(device=(20, 0))
    t = dlbridge.from_dlpack(fake.capsule)
    assert t.__dlpack_device__() == (dlbridge.DeviceType.TPU_HOST, 0) and str(t.device) == "tpu_host"
    assert memoryview(t).tolist() == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(("code", "name"), [(19, "tpu:1"), (21, "ascend:1")])
def test_tpu_and_ascend_device_memory_is_accepted_and_never_read(code: int, name: str) -> None:
    fake = FakeCapsule(device=(code, 1))
    t = dlbridge.from_dlpack(fake.capsule)
    assert str(t.device) == name and int(t.__dlpack_device__()[0]) == code
    with pytest.raises(BufferError):
        memoryview(t)
    del t
    assert fake.deleted == 1
