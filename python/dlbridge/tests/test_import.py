"""dlbridge.from_dlpack as a consumer: negotiation with producers old and new, bare capsules, and
the errors the standard names. Fake producers here are written for the test (no real library
behaves this way on purpose) and are named for what they do."""

from __future__ import annotations

import pytest

import dlbridge

from ._dlpack_ctypes import FakeVersionedCapsule, capsule_name
from .libs import need


@pytest.fixture
def np():
    return need("numpy")


class RecordingProducer:
    """A new-style producer that records the keywords it is called with and returns numpy's capsule."""

    def __init__(self, array):
        self.array, self.calls = array, []

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version, "dl_device": dl_device, "copy": copy})
        return self.array.__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class LegacyOnlyProducer:
    """A pre-2023 producer: `__dlpack__(self, stream=None)`, legacy capsules only (like pydlpack)."""

    def __init__(self, array):
        self.array, self.bodies = array, 0

    def __dlpack__(self, stream=None):
        self.bodies += 1
        return self.array.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return (1, 0)


class TypeErrorInsideProducer:
    """A new-style producer whose body raises TypeError for its own reasons."""

    def __init__(self):
        self.bodies = 0

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.bodies += 1
        raise TypeError("producer-internal failure")


class NotACapsuleProducer:
    """Returns an int from `__dlpack__`."""

    def __dlpack__(self, **kwargs):
        return 42


class DeviceLiarProducer:
    """Says CUDA in `__dlpack_device__` but hands over a CPU capsule."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (2, 0)


def test_new_style_negotiation_forwards_every_keyword(np) -> None:
    p = RecordingProducer(np.arange(4.0))
    t = dlbridge.from_dlpack(p)
    assert p.calls == [{"stream": None, "max_version": (1, 3), "dl_device": None, "copy": None}]
    assert not t.readonly and t.data_ptr == p.array.ctypes.data
    dlbridge.from_dlpack(p, device="cpu", copy=False)
    assert p.calls[-1] == {"stream": None, "max_version": (1, 3), "dl_device": (1, 0), "copy": False}
    c = dlbridge.from_dlpack(p, device=(1, 0), copy=True)
    assert p.calls[-1]["copy"] is True and c.data_ptr != p.array.ctypes.data
    dlbridge.from_dlpack(p, device=dlbridge.Device("cpu"), stream=None)
    assert p.calls[-1]["dl_device"] == (1, 0)


def test_legacy_producer_falls_back_and_is_read_only_unless_opted_in(np) -> None:
    p = LegacyOnlyProducer(np.arange(4.0))
    t = dlbridge.from_dlpack(p)
    assert p.bodies == 1, "the keyword call fails at the call site; only the legacy call runs the body"
    assert t.readonly and t.data_ptr == p.array.ctypes.data
    w = dlbridge.from_dlpack(p, legacy_writable=True)
    assert not w.readonly
    np.from_dlpack(w)[0] = 7.0
    assert p.array[0] == 7.0


def test_copy_true_with_a_legacy_producer_is_done_by_dlbridge(np) -> None:
    p = LegacyOnlyProducer(np.arange(6.0).reshape(2, 3)[:, ::2])
    t = dlbridge.from_dlpack(p, copy=True)
    assert t.data_ptr != p.array.ctypes.data and t.data_ptr % 256 == 0
    assert not t.readonly and t.is_c_contiguous
    assert np.from_dlpack(t).tolist() == p.array.tolist()


def test_a_type_error_inside_a_new_style_producer_surfaces(np) -> None:
    p = TypeErrorInsideProducer()
    # The error contract: the producer's refusal is the cause of a BufferError (not retried the
    # legacy way: it is not a complaint about the keywords).
    with pytest.raises(BufferError, match="producer-internal failure") as e:
        dlbridge.from_dlpack(p)
    assert isinstance(e.value.__cause__, TypeError)
    assert p.bodies == 1, "no legacy retry"


def test_non_capsule_result_is_a_type_error_naming_the_producer() -> None:
    with pytest.raises(TypeError, match=r"NotACapsuleProducer.__dlpack__\(\).*expected a DLPack capsule, got int"):
        dlbridge.from_dlpack(NotACapsuleProducer())


def test_object_without_protocol_is_a_type_error_naming_its_type() -> None:
    with pytest.raises(TypeError, match=r"^expected an array \(an object with __dlpack__ or a DLPack capsule\), got list; dlbridge.asdlpack\(x\)"):
        dlbridge.from_dlpack([1, 2, 3])


def test_bare_capsules_of_both_names(np) -> None:
    a = np.arange(3, dtype=np.int8)
    legacy = a.__dlpack__()
    t = dlbridge.from_dlpack(legacy)
    assert capsule_name(legacy) == "used_dltensor"
    assert t.readonly and t.data_ptr == a.ctypes.data
    versioned = a.__dlpack__(max_version=(1, 0))
    v = dlbridge.from_dlpack(versioned)
    assert capsule_name(versioned) == "used_dltensor_versioned"
    assert not v.readonly


def test_a_capsule_consumed_twice_is_a_clear_error(np) -> None:
    cap = np.arange(3.0).__dlpack__(max_version=(1, 0))
    dlbridge.from_dlpack(cap)
    with pytest.raises(ValueError, match="already consumed.*used_dltensor_versioned"):
        dlbridge.from_dlpack(cap)


def test_a_capsule_of_another_name_is_refused() -> None:
    import datetime
    cap = datetime.datetime_CAPI
    with pytest.raises(TypeError, match="datetime.datetime_CAPI.*not a DLPack tensor"):
        dlbridge.from_dlpack(cap)


@pytest.mark.parametrize("major", [0, 2])
def test_a_versioned_capsule_of_another_major_is_refused_after_its_deleter_ran(major: int) -> None:
    fake = FakeVersionedCapsule(major=major)
    with pytest.raises(BufferError, match=f"version: DLPack {major}.3 is not supported"):
        dlbridge.from_dlpack(fake)
    assert fake.deleted == 1
    assert capsule_name(fake.capsule) == "used_dltensor_versioned"


def test_a_well_formed_fake_capsule_is_deleted_exactly_once() -> None:
    fake = FakeVersionedCapsule()
    t = dlbridge.from_dlpack(fake)
    assert fake.deleted == 0
    t2 = dlbridge.from_dlpack(t)
    del t
    assert fake.deleted == 0, "t2 still shares the data"
    del t2
    assert fake.deleted == 1


def test_device_announced_and_capsule_disagree(np) -> None:
    with pytest.raises(BufferError, match=r"says cuda:0 but its capsule holds a tensor on cpu"):
        dlbridge.from_dlpack(DeviceLiarProducer(np.zeros(2)))


def test_device_argument_forms(np) -> None:
    a = np.zeros(2)
    for dev in ["cpu", dlbridge.Device("cpu"), (1, 0), (dlbridge.DeviceType.CPU, 0)]:
        assert dlbridge.from_dlpack(a, device=dev).data_ptr == a.ctypes.data
    with pytest.raises(TypeError, match="device: expected"):
        dlbridge.from_dlpack(a, device=1.5)
    with pytest.raises(ValueError, match="unknown name"):
        dlbridge.from_dlpack(a, device="gpu")


def test_dlbridge_tensor_round_trip_shares_data(np) -> None:
    a = np.arange(5.0)
    t = dlbridge.from_dlpack(a)
    u = dlbridge.from_dlpack(t)
    assert u.data_ptr == t.data_ptr == a.ctypes.data


def test_torch_tensor_in_and_out_without_copy() -> None:
    torch = need("torch")
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = dlbridge.from_dlpack(x)
    assert t.data_ptr == x.data_ptr() and not t.readonly
    y = torch.from_dlpack(t)
    y[0, 0] = 42
    assert x[0, 0] == 42
