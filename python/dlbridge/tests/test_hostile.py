"""Hostile producers: every malformed tensor, capsule, protocol answer or deleter ends in a clear
Python exception naming the field, with the process alive and the producer's deleter called
exactly once (counted). The producers are fakes written for these tests (no real library hands
out malformed tensors on purpose), each named for what it does wrong."""

from __future__ import annotations

import ctypes
import datetime
import gc

import pytest

import dlbridge

from ._dlpack_ctypes import FakeCapsule, capsule_name
from .libs import need

BOTH = [pytest.param(True, id="versioned"), pytest.param(False, id="legacy")]


@pytest.mark.parametrize("versioned", BOTH)
@pytest.mark.parametrize(("fields", "field"), [
    pytest.param({"ndim": -1}, "ndim", id="ndim-negative"),
    pytest.param({"ndim": 10**6}, "ndim", id="ndim-1e6"),
    pytest.param({"ndim": 65, "shape": (1,) * 65, "strides": (1,) * 65}, "ndim", id="ndim-65"),
    pytest.param({"ndim": 2, "shape": (2, 2), "null_shape": True}, "shape", id="null-shape"),
    pytest.param({"shape": (-4,)}, "shape[0]", id="negative-dim"),
    pytest.param({"ndim": 2, "shape": (2**62, 8), "strides": (8, 1)}, "shape", id="element-count-overflow"),
    pytest.param({"ndim": 2, "shape": (4, 2), "strides": (2**61, 1)}, "strides", id="stride-span-overflow"),
    pytest.param({"strides": (-(2**62),)}, "strides", id="negative-span-below-zero"),
    pytest.param({"byte_offset": 2**64 - 1}, "byte_offset", id="byte-offset-overflow"),
    pytest.param({"data": 0}, "data", id="null-data-with-elements"),
    pytest.param({"dtype": (19, 8, 1)}, "dtype.code", id="unknown-type-code"),
    pytest.param({"dtype": (255, 32, 1)}, "dtype.code", id="type-code-255"),
    pytest.param({"dtype": (15, 8, 1)}, "dtype.bits", id="float6-with-8-bits"),
    pytest.param({"dtype": (17, 8, 1)}, "dtype.bits", id="float4-with-8-bits"),
    pytest.param({"dtype": (18, 64, 1)}, "dtype.bits", id="bcomplex-with-64-bits"),
    pytest.param({"dtype": (6, 1, 1)}, "dtype.bits", id="bool-with-1-bit"),
    pytest.param({"dtype": (2, 8, 1)}, "dtype.bits", id="float-with-8-bits"),
    pytest.param({"dtype": (2, 32, 0)}, "dtype.lanes", id="zero-lanes"),
    pytest.param({"device": (22, 0)}, "device.device_type", id="unknown-device-type-22"),
    pytest.param({"device": (0, 0)}, "device.device_type", id="device-type-0"),
    pytest.param({"device": (-7, 0)}, "device.device_type", id="device-type-negative"),
])
def test_malformed_tensors_are_refused_and_deleted_once(versioned: bool, fields: dict, field: str) -> None:
    fake = FakeCapsule(versioned=versioned, **fields)
    with pytest.raises(BufferError, match=field.replace("[", r"\[")):
        dlbridge.from_dlpack(fake.capsule)
    assert fake.deleted == 1
    assert capsule_name(fake.capsule).startswith("used_")


@pytest.mark.parametrize("major", [0, 2, 2**32 - 1])
def test_other_major_versions(major: int) -> None:
    fake = FakeCapsule(major=major)
    with pytest.raises(BufferError, match="version"):
        dlbridge.from_dlpack(fake)
    assert fake.deleted == 1


@pytest.mark.parametrize("versioned", BOTH)
def test_null_deleter_is_never_called(versioned: bool) -> None:
    ok = FakeCapsule(versioned=versioned, null_deleter=True)
    t = dlbridge.from_dlpack(ok.capsule)
    del t
    gc.collect()
    bad = FakeCapsule(versioned=versioned, null_deleter=True, ndim=-1)
    with pytest.raises(BufferError):
        dlbridge.from_dlpack(bad.capsule)
    assert ok.deleted == bad.deleted == 0


def test_a_deleter_that_raises_runs_once_and_the_process_goes_on(monkeypatch) -> None:
    import sys

    reported: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))
    fake = FakeCapsule(deleter_behaviour="raise")
    t = dlbridge.from_dlpack(fake.capsule)
    del t
    gc.collect()
    assert fake.deleted == 1
    refused = FakeCapsule(deleter_behaviour="raise", ndim=-1)
    with pytest.raises(BufferError, match="ndim"):
        dlbridge.from_dlpack(refused.capsule)
    assert refused.deleted == 1
    # The producer's exception is reported as unraisable (by ctypes, its caller), not propagated.
    assert len(reported) == 2 and all("a deleter that raises" in str(e) for e in reported)


def test_a_slow_deleter_runs_once() -> None:
    fake = FakeCapsule(deleter_behaviour="slow")
    t = dlbridge.from_dlpack(fake.capsule)
    u = dlbridge.from_dlpack(t)
    del t, u
    gc.collect()
    assert fake.deleted == 1


class ReturnsNonCapsule:
    def __dlpack__(self, **kw):
        return 42


class ReturnsForeignCapsule:
    def __dlpack__(self, **kw):
        return datetime.datetime_CAPI


class ReturnsUsedCapsule:
    def __init__(self):
        self.fake = FakeCapsule()
        dlbridge.from_dlpack(self.fake.capsule)

    def __dlpack__(self, **kw):
        return self.fake.capsule


class RaisesBufferError:
    def __dlpack__(self, **kw):
        raise BufferError("cannot export (producer's words)")


class RaisesValueError:
    def __dlpack__(self, **kw):
        raise ValueError("bad value (producer's words)")


class RaisesTypeErrorInside:
    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        raise TypeError("internal type error (producer's words)")


class ProducerInterrupt(BaseException):
    """A KeyboardInterrupt-like BaseException."""


class RaisesBaseException:
    def __dlpack__(self, **kw):
        raise ProducerInterrupt("interrupted")


@pytest.mark.parametrize(("producer", "exc", "match"), [
    (ReturnsNonCapsule, TypeError, "expected a DLPack capsule, got int"),
    (ReturnsForeignCapsule, TypeError, "not a DLPack tensor"),
    (ReturnsUsedCapsule, ValueError, "already consumed"),
    (RaisesBufferError, BufferError, "producer's words"),
    # The error contract: a producer's refusal is the cause of a BufferError that quotes it.
    (RaisesValueError, BufferError, "refused the export \\(ValueError: .*producer's words"),
    (RaisesTypeErrorInside, BufferError, "refused the export \\(TypeError: .*producer's words"),
    (RaisesBaseException, ProducerInterrupt, "interrupted"),
])
def test_misbehaving_dlpack_methods(producer, exc, match) -> None:
    with pytest.raises(exc, match=match):
        dlbridge.from_dlpack(producer())
    with pytest.raises(exc, match=match):
        dlbridge.asdlpack(producer())


def test_a_null_capsule_pointer_cannot_exist() -> None:
    # CPython refuses to make a capsule around NULL, so no producer can hand one over.
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    with pytest.raises(ValueError):
        new(None, b"dltensor", None)


class JunkDevice:
    def __init__(self, answer):
        self.answer = answer
        self.np = need("numpy")

    def __dlpack__(self, **kw):
        return self.np.zeros(2).__dlpack__(**kw)

    def __dlpack_device__(self):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer", ["cpu", (1,), None, ("a", "b"), (1, 0, 0), 3.5])
def test_dlpack_device_returning_junk(answer) -> None:
    with pytest.raises(TypeError, match="__dlpack_device__"):
        dlbridge.from_dlpack(JunkDevice(answer))


def test_dlpack_device_raising_surfaces() -> None:
    with pytest.raises(BufferError, match="__dlpack_device__.*device query failed") as e:
        dlbridge.from_dlpack(JunkDevice(RuntimeError("device query failed")))
    assert isinstance(e.value.__cause__, RuntimeError)


@pytest.mark.hooks
def test_hostile_buffer_exporters() -> None:
    from dlbridge._dlbridge import _HostileBuffer

    with pytest.raises(BufferError, match="len"):
        dlbridge.asdlpack(_HostileBuffer(shape=[4], strides=[4], itemsize=4, format="f", length=8))
    with pytest.raises(BufferError, match="strides"):
        dlbridge.asdlpack(_HostileBuffer(shape=[4], strides=[3], itemsize=4, format="f", length=16))
    with pytest.raises(BufferError, match="format"):
        dlbridge.asdlpack(_HostileBuffer(shape=[4], strides=[4], itemsize=8, format="f", length=32))
    with pytest.raises(BufferError, match="ndim"):
        dlbridge.asdlpack(_HostileBuffer(shape=[1] * 70, strides=[1] * 70, itemsize=1, format="B", length=1))
    with pytest.raises(BufferError, match="strides"):
        dlbridge.asdlpack(_HostileBuffer(shape=[3], strides=[2**62], itemsize=1, format="B", length=3))
    with pytest.raises(BufferError, match="shape"):
        dlbridge.asdlpack(_HostileBuffer(shape=[-3], strides=[1], itemsize=1, format="B", length=0))
    ok = dlbridge.asdlpack(_HostileBuffer(shape=[2, 2], strides=[8, 4], itemsize=4, format="i", length=16))
    assert ok.shape == (2, 2) and str(ok.dtype) == "int32"


@pytest.mark.hooks
def test_hostile_buffer_exporters_are_refused_by_the_borrowed_view_too() -> None:
    from dlbridge._dlbridge import _HostileBuffer, _view

    for kw, field in [({"length": 8}, "len"), ({"strides": [3]}, "strides"), ({"itemsize": 8}, "format")]:
        args = {"shape": [4], "strides": [4], "itemsize": 4, "format": "f", "length": 16} | kw
        with pytest.raises(BufferError, match=field):
            _view(_HostileBuffer(**args))
