"""Reading DLPack capsules with ctypes, independently of dlbridge, and making hostile ones.

Tests use this to check what dlbridge puts into its capsules (version, flags, device, strides)
without trusting dlbridge to describe itself, and to build capsules no real library produces
(a major version of 2, a counted deleter). Everything here is written for the tests.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
PyCapsule_GetPointer.restype = ctypes.c_void_p
PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
PyCapsule_GetName = ctypes.pythonapi.PyCapsule_GetName
PyCapsule_GetName.restype = ctypes.c_char_p
PyCapsule_GetName.argtypes = [ctypes.py_object]
PyCapsule_New = ctypes.pythonapi.PyCapsule_New
PyCapsule_New.restype = ctypes.py_object
PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


LEGACY_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", LEGACY_DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


VERSIONED_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", VERSIONED_DELETER),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", DLTensor),
]

READ_ONLY, IS_COPIED = 1, 2


@dataclass
class CapsuleInfo:
    """What a capsule holds, read without consuming it."""

    name: str
    version: tuple[int, int] | None
    flags: int
    data: int
    byte_offset: int
    device: tuple[int, int]
    dtype: tuple[int, int, int]
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None

    @property
    def pointer(self) -> int:
        return self.data + self.byte_offset


def capsule_name(cap: object) -> str:
    return PyCapsule_GetName(cap).decode()


def read_capsule(cap: object) -> CapsuleInfo:
    """Decodes a fresh DLPack capsule (either name) without consuming it."""
    name = capsule_name(cap)
    p = PyCapsule_GetPointer(cap, name.encode())
    if name == "dltensor_versioned":
        m = DLManagedTensorVersioned.from_address(p)
        version, flags, t = (m.version.major, m.version.minor), m.flags, m.dl_tensor
    elif name == "dltensor":
        m = DLManagedTensor.from_address(p)
        version, flags, t = None, 0, m.dl_tensor
    else:
        raise ValueError(f"not a fresh DLPack capsule: {name}")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = None if not t.strides else tuple(t.strides[i] for i in range(t.ndim))
    return CapsuleInfo(
        name,
        version,
        flags,
        t.data or 0,
        t.byte_offset,
        (t.device.device_type, t.device.device_id),
        (t.dtype.code, t.dtype.bits, t.dtype.lanes),
        shape,
        strides,
    )


class FakeCapsule:
    """A hostile or unusual capsule (versioned or legacy) built field by field, with a counted deleter.

    The capsule has no destructor: the test consumes it, and `deleted` counts how often the
    deleter ran. `deleter_behaviour` may be "count" (default), "raise" (the Python callback raises;
    ctypes reports it as unraisable and returns) or "slow" (sleeps 50 ms first).
    """

    def __init__(self, *, versioned=True, major=1, minor=3, ndim=1, shape=(4,), strides=(1,), dtype=(2, 32, 1),
                 device=(1, 0), data: int | None = None, byte_offset=0, flags=0, null_deleter=False,
                 deleter_behaviour="count", null_shape=False):
        self.deleted = 0
        self.behaviour = deleter_behaviour
        self.buffer = (ctypes.c_float * 16)()
        self.shape_arr = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides_arr = None if strides is None else (ctypes.c_int64 * max(len(strides), 1))(*strides)
        if versioned:
            self.m = DLManagedTensorVersioned()
            self.m.version = DLPackVersion(major, minor)
            self.m.flags = flags
            self._deleter = VERSIONED_DELETER(self._on_delete)
            name = b"dltensor_versioned"
        else:
            self.m = DLManagedTensor()
            self._deleter = LEGACY_DELETER(self._on_delete)
            name = b"dltensor"
        if not null_deleter:
            self.m.deleter = self._deleter
        t = self.m.dl_tensor
        t.data = ctypes.addressof(self.buffer) if data is None else data
        t.device = DLDevice(*device)
        t.ndim = ndim
        t.dtype = DLDataType(*dtype)
        t.shape = ctypes.POINTER(ctypes.c_int64)() if null_shape else ctypes.cast(self.shape_arr, ctypes.POINTER(ctypes.c_int64))
        t.strides = (ctypes.cast(self.strides_arr, ctypes.POINTER(ctypes.c_int64))
                     if self.strides_arr is not None else ctypes.POINTER(ctypes.c_int64)())
        t.byte_offset = byte_offset
        self.capsule = PyCapsule_New(ctypes.addressof(self.m), name, None)

    def _on_delete(self, _ptr):
        if self.behaviour == "slow":
            import time
            time.sleep(0.05)
        self.deleted += 1
        if self.behaviour == "raise":
            raise RuntimeError("a deleter that raises (written for the test)")

    def __dlpack__(self, **_kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (self.m.dl_tensor.device.device_type, self.m.dl_tensor.device.device_id)


def FakeVersionedCapsule(**kw) -> FakeCapsule:  # noqa: N802 - kept for the existing tests
    return FakeCapsule(versioned=True, **kw)
