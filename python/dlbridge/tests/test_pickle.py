"""Pickling a Tensor that is not shared: protocol 5 with a buffer_callback carries one out-of-band
PickleBuffer over the tensor's own memory (no copy at pickling), in-band otherwise; protocols 0-4
carry bytes. Every dtype, shape and stride survives; a layout with gaps is made C-contiguous.
"""

from __future__ import annotations

import pickle
import sys

import pytest

import dlbridge

from .libs import need

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pickling is built on Linux")

rebuild_buffer = dlbridge._dlbridge._rebuild_buffer


def tensor_over(data: bytearray | bytes, dtype: dlbridge.DType, shape, strides=None, first=0, readonly=False):
    """A non-shared Tensor of any dtype over `data` (the rebuild function pickles name)."""
    if strides is None:
        strides, n = [], 1
        for d in reversed(shape):
            strides.insert(0, n)
            n *= d
    return rebuild_buffer(data, (dtype.code, dtype.bits, dtype.lanes), list(shape), list(strides), first, readonly, False)


def oob(t, **kw):
    bufs: list[pickle.PickleBuffer] = []
    p = pickle.dumps(t, protocol=5, buffer_callback=bufs.append, **kw)
    return p, bufs


def raw(t) -> bytes:
    """The bytes a tensor's elements span, as its protocol-5 buffer holds them."""
    _, bufs = oob(t)
    return bytes(bufs[0].raw())


WHOLE_BYTE = [getattr(dlbridge, n) for n in dlbridge.__all__ if isinstance(getattr(dlbridge, n), dlbridge.DType)]
WHOLE_BYTE = [d for d in WHOLE_BYTE if d.itemsize is not None]


def test_protocol_5_is_one_out_of_band_buffer_over_the_tensor():
    data = bytearray(range(256)) * 4096  # 1 MiB
    t = tensor_over(data, dlbridge.float32, (1024, 256))
    p, bufs = oob(t)
    assert len(bufs) == 1 and len(p) < 1024
    m = bufs[0].raw()
    assert m.nbytes == len(data) and not m.readonly
    data[0] = 77
    assert m[0] == 77  # the buffer is the tensor's memory, not a copy
    u = pickle.loads(p, buffers=bufs)
    assert (u.shape, u.strides, u.dtype, u.readonly) == (t.shape, t.strides, t.dtype, False)
    assert u.data_ptr == t.data_ptr  # loaded over the same buffer: zero-copy both ways


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_protocol_round_trips_in_band(protocol):
    data = bytearray(range(24))
    t = tensor_over(data, dlbridge.int16, (3, 4))
    p = pickle.dumps(t, protocol=protocol)
    assert len(p) > 24  # the bytes are in the pickle
    u = pickle.loads(p)
    assert (u.shape, u.strides, u.dtype, u.readonly) == ((3, 4), (4, 1), dlbridge.int16, False)
    assert bytes(memoryview(u)) == bytes(data) and u.data_ptr != t.data_ptr
    if protocol < 5:
        assert u.data_ptr % 256 == 0  # bytes are copied once into aligned memory


@pytest.mark.parametrize("dtype", WHOLE_BYTE, ids=str)
@pytest.mark.parametrize("how", ["oob", "inband5", "protocol4", "protocol2"])
def test_every_dtype(dtype, how):
    n = 2 * 3 * dtype.itemsize
    data = bytearray(i % 251 for i in range(n))
    if dtype == dlbridge.bool:
        data = bytearray(i % 2 for i in range(n))
    t = tensor_over(data, dtype, (2, 3))
    if how == "oob":
        p, bufs = oob(t)
        u = pickle.loads(p, buffers=bufs)
    else:
        u = pickle.loads(pickle.dumps(t, protocol={"inband5": 5, "protocol4": 4, "protocol2": 2}[how]))
    assert (u.dtype, u.shape, u.strides) == (dtype, (2, 3), (3, 1))
    assert raw(u) == bytes(data)


def test_read_only_stays_read_only():
    t = tensor_over(b"abcdefgh", dlbridge.uint8, (8,), readonly=True)
    assert t.readonly
    p, bufs = oob(t)
    assert bufs[0].raw().readonly
    for u in (pickle.loads(p, buffers=bufs), pickle.loads(pickle.dumps(t, protocol=5)), pickle.loads(pickle.dumps(t, protocol=4))):
        assert u.readonly and bytes(memoryview(u)) == b"abcdefgh"


def test_a_read_only_buffer_gives_a_read_only_tensor():
    """Out-of-band buffers that arrive read-only (Ray's object store) give read-only tensors, as
    numpy's arrays from them are, without copying."""
    t = tensor_over(bytearray(16), dlbridge.float32, (4,))
    p, _ = oob(t)
    ro = memoryview(bytes(16))
    u = pickle.loads(p, buffers=[ro])
    assert u.readonly and u.shape == (4,)


@pytest.mark.parametrize(
    "make",
    ["transposed", "negative", "broadcast", "offset"],
)
def test_strides_survive(make):
    np = need("numpy")
    a = np.arange(24, dtype=np.float64).reshape(4, 6)
    v = {
        "transposed": a.T,
        "negative": a[::-1, ::-1],
        "broadcast": np.broadcast_to(a[0], (5, 6)),
        "offset": a[1:3],
    }[make]
    t = dlbridge.asdlpack(v)
    p, bufs = oob(t)
    u = pickle.loads(p, buffers=bufs)
    assert (u.shape, u.strides, u.readonly) == (t.shape, t.strides, t.readonly)
    assert np.from_dlpack(u).tolist() == v.tolist()
    if make == "broadcast":
        assert bufs[0].raw().nbytes == 6 * 8  # only the row it repeats
    w = pickle.loads(pickle.dumps(t, protocol=4))
    assert (w.shape, w.strides) == (t.shape, t.strides) and np.from_dlpack(w).tolist() == v.tolist()


def test_a_layout_with_gaps_is_made_c_contiguous():
    np = need("numpy")
    a = np.arange(100, dtype=np.int32)[::10]
    t = dlbridge.asdlpack(a)
    p, bufs = oob(t)
    assert bufs[0].raw().nbytes == 10 * 4  # the elements, not the 91 the slice spans
    u = pickle.loads(p, buffers=bufs)
    assert u.strides == (1,) and np.from_dlpack(u).tolist() == a.tolist()


def test_a_buffer_that_does_not_fit_is_refused():
    with pytest.raises(BufferError, match="shape/strides"):
        tensor_over(bytearray(15), dlbridge.float32, (4,))
    with pytest.raises(BufferError, match="shape/strides"):
        tensor_over(bytearray(16), dlbridge.float32, (4,), strides=[-1])
    with pytest.raises(BufferError, match="dtype"):
        rebuild_buffer(bytearray(16), (2, 33, 1), [4], [1], 0, False, False)
    with pytest.raises(BufferError, match="strides"):
        rebuild_buffer(bytearray(16), (2, 32, 1), [4], [1, 1], 0, False, False)
    with pytest.raises(BufferError, match="buffer"):
        rebuild_buffer(object(), (2, 32, 1), [4], [1], 0, False, False)


def test_a_misaligned_buffer_is_copied():
    data = bytearray(17)
    view = memoryview(data)[1:]
    t = tensor_over(view, dlbridge.float32, (4,))
    assert t.data_ptr % 4 == 0


def test_deepcopy_copies():
    import copy

    np = need("numpy")
    a = np.arange(12.0).reshape(3, 4).T
    t = dlbridge.asdlpack(a)
    d = copy.deepcopy(t)
    assert d.data_ptr != t.data_ptr and (d.shape, d.strides) == (t.shape, t.strides)
    assert np.from_dlpack(d).tolist() == a.tolist() and not d.readonly


def test_a_tensor_on_another_device_refuses_to_pickle_and_to_share():
    """Host and CUDA memory pickle (CUDA: test_cuda_ipc.py); other devices say so (a ctypes capsule
    that claims rocm:0; its address is never dereferenced)."""
    from ._dlpack_ctypes import FakeCapsule

    fake = FakeCapsule(device=(10, 0), data=0x7F00_0000_0000)
    t = dlbridge.from_dlpack(fake.capsule)
    for protocol in (2, 5):
        with pytest.raises(TypeError, match="rocm:0: only host and CUDA memory pickle"):
            pickle.dumps(t, protocol=protocol)
    with pytest.raises(BufferError, match="rocm:0; only host and CUDA memory can be shared"):
        dlbridge.share(t)
