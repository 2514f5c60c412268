"""CUDA tensors across processes: a CUDA Tensor pickles as a CUDA IPC handle (the allocation's
64-byte handle, the data's offset in it, the device ordinal, the pid, dtype/shape/strides/flags),
which another process opens on the same device and the same process maps back to the original.

Without a GPU (here, and in CI) only the refusals run: fake device pointers that are never
dereferenced, crafted handles. The tests marked `gpu` need torch with CUDA (and cupy for one) and
are skipped elsewhere.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import random
import sys

import pytest

import dlbridge

from .libs import need

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pickling is built on Linux")

WAIT = 120  # seconds: the most any child is waited for before it is killed (never a pass/fail bound)
rebuild_cuda = dlbridge._dlbridge._rebuild_cuda


class FakeCudaArray:
    """A CUDA producer written for the test: a made-up device pointer that is never dereferenced."""

    def __init__(self, **overrides):
        self.__cuda_array_interface__ = {
            "shape": (2, 3),
            "typestr": "<f4",
            "data": (0x7F00_0000_0000, False),
            "version": 3,
            "strides": None,
            "stream": None,
        } | overrides


def driver_available() -> bool:
    from dlbridge._dlbridge import _cuda_driver_available

    return _cuda_driver_available()


def crafted(pid=1, device=0, ipc=bytes(64), size=4096, offset=0, byte_offset=0, dtype=(2, 32, 1),
            shape=(4, 4), strides=(4, 1), readonly=False, padded=False, tag="dlbridge-cuda", version=1):
    """A CUDA handle as a pickle carries it (pid 1 is never this test's process)."""
    return ((tag, version, pid, device, ipc), (size, offset, byte_offset),
            (dtype, list(shape), list(strides), readonly, padded))


# ---- without a GPU: refusals ------------------------------------------------------------------------


@pytest.mark.hooks
def test_pickling_a_cuda_tensor_without_a_driver_names_the_cause():
    t = dlbridge.asdlpack(FakeCudaArray(), device_id=0)
    assert str(t.device) == "cuda:0"
    why = "does not know pointer" if driver_available() else "no CUDA driver: libcuda.so.1 could not be loaded"
    for protocol in (2, 4, 5):
        with pytest.raises(BufferError, match=f"cannot pickle a dlbridge Tensor: a tensor on cuda:0: {why}"):
            pickle.dumps(t, protocol=protocol)
    with pytest.raises(BufferError, match=f"share\\(\\): a tensor on cuda:0: {why}"):
        dlbridge.share(t)
    with pytest.raises(BufferError, match=why):
        dlbridge.share(FakeCudaArray())  # asdlpack itself needs the driver for the device


def test_deepcopy_of_a_cuda_tensor_is_refused():
    """Its pickle would give the same memory back, not a copy."""
    import copy

    t = dlbridge.asdlpack(FakeCudaArray(), device_id=0)
    with pytest.raises(TypeError, match="cannot deepcopy a dlbridge Tensor on cuda:0"):
        copy.deepcopy(t)


@pytest.mark.hooks
def test_a_crafted_handle_without_a_driver_is_a_buffer_error():
    h = crafted()
    if driver_available():  # a handle of zeros: the driver refuses it
        with pytest.raises(BufferError, match="unpickling a dlbridge Tensor: handle.ipc_handle: "):
            rebuild_cuda(h)
    else:
        with pytest.raises(BufferError, match="unpickling a dlbridge Tensor: handle: cannot open a CUDA IPC "
                           "handle: no CUDA driver"):
            rebuild_cuda(h)


@pytest.mark.parametrize(("kw", "field"), [
    ({"ipc": bytes(63)}, "handle.ipc_handle: 63 bytes, expected 64"),
    ({"ipc": bytes(65)}, "handle.ipc_handle: 65 bytes, expected 64"),
    ({"ipc": "x" * 64}, "handle.ipc_handle"),
    ({"offset": -1}, "handle.offset"),
    ({"byte_offset": -8}, "handle.byte_offset"),
    ({"offset": 2**64 - 1, "byte_offset": 1}, "handle.offset: offset overflow"),
    ({"offset": 8192}, "handle.shape/strides/offsets"),
    ({"offset": 4096 - 60}, "handle.shape/strides/offsets"),  # the last elements run past the end
    ({"shape": (33, 32), "strides": (32, 1)}, "handle.shape/strides/offsets"),  # too big
    ({"strides": (4, -1)}, "handle.shape/strides/offsets"),  # before the allocation
    ({"size": -1}, "handle.size"),
    ({"size": 0}, "handle.shape/strides/offsets"),
    ({"device": -1}, "handle.device"),
    ({"device": "0"}, "handle.device"),
    ({"pid": -1}, "handle.pid"),
    ({"tag": "dlbridge-shm"}, "handle.version"),
    ({"version": 2}, "handle.version"),
    ({"dtype": (2, 33, 1)}, "dtype"),
    ({"strides": (4, 1, 1)}, "strides"),
    ({"shape": (-1, 4)}, "shape"),
])
def test_a_crafted_handle_names_the_field(kw, field):
    with pytest.raises(BufferError, match=f"unpickling a dlbridge Tensor: {field}"):
        rebuild_cuda(crafted(**kw))


def test_malformed_handles_are_buffer_errors():
    h = crafted()
    for bad in [(h[0],), "nonsense", (h[0], h[1], h[2], 1), (h[0][:4], h[1], h[2]), (h[0], h[1][:2], h[2]), None]:
        with pytest.raises(BufferError, match="unpickling a dlbridge Tensor: handle"):
            rebuild_cuda(bad)


def test_a_handle_of_this_process_with_nothing_pickled_is_refused():
    """CUDA cannot open a process's own handle: the same process maps back only to a tensor it
    pickled that is still alive."""
    with pytest.raises(BufferError, match="handle.pid: a CUDA handle this process made, of memory no Tensor"):
        rebuild_cuda(crafted(pid=os.getpid(), ipc=bytes(range(64))))


def with_field(h: tuple, part: int, i: int, value) -> tuple:
    p = list(h[part])
    p[i] = value
    return tuple(tuple(p) if k == part else x for k, x in enumerate(h))


def test_mutated_handles_never_crash():
    """Every field of a crafted handle replaced by values from a hostile list (seeded, 2000 cases):
    each is a BufferError (no driver opens a handle of zeros), never a crash."""
    h = crafted()
    values = [0, 1, -1, 3, 7, 8, 63, 64, 65, 4096, 2**31 - 1, 2**32, 2**63 - 1, 2**63, -(2**63), 2**64,
              None, "x", b"", bytes(16), bytes(64), bytes(65), 1.5, [], [0], [4, 4], [4, 1], [-1, 1],
              [2**62, 1], [1] * 70, (2, 32, 1), (2, 8, 1), (1, 64, 1), (0, 1, 1), (2, 32, 0), True]
    rng = random.Random(23)
    for _ in range(2000):
        bad = h
        for _ in range(rng.randint(1, 3)):
            part = rng.randrange(3)
            bad = with_field(bad, part, rng.randrange(len(h[part])), rng.choice(values))
        if bad[0][2] == os.getpid():
            continue
        with pytest.raises(BufferError):
            rebuild_cuda(bad)


# ---- real GPU (run on a machine with CUDA; skipped elsewhere) --------------------------------------


def _cuda_torch():
    torch = need("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


def reap(*procs: mp.process.BaseProcess) -> None:
    for p in procs:
        p.join(WAIT)
        if p.is_alive():
            p.kill()
            p.join(WAIT)


def run_child(target, *args):
    """Runs `target(q, *args)` in a spawn child; returns what it put on the queue, in order, up to
    and including "done" (an exception in the child is re-raised here as AssertionError)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, *args))
    p.start()
    out = []
    try:
        while True:
            item = q.get(timeout=WAIT)
            if isinstance(item, tuple) and item and item[0] == "error":
                raise AssertionError(f"child failed: {item[1]}")
            if item == "done":
                break
            out.append(item)
    finally:
        reap(p)
    assert p.exitcode == 0, p.exitcode
    return out


def _guard(q, f):
    try:
        f()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        import traceback

        q.put(("error", "".join(traceback.format_exception(e))))
        return
    q.put("done")


# Children (module level: spawn imports them). Each receives the pickle as bytes, so it can look
# at what this process holds before and after unpickling.


def child_torch_write(q, data: bytes):
    def go():
        import torch

        from dlbridge._dlbridge import _cuda_ipc_mappings

        assert _cuda_ipc_mappings() == []
        t = pickle.loads(data)
        x = torch.from_dlpack(t)
        (_, ptr, size), = _cuda_ipc_mappings()
        q.put((str(t.device), t.shape, t.strides, t.readonly, x.device.index, x[0].item(),
               ptr <= t.data_ptr < ptr + size))
        x[1] = 7.0
        torch.cuda.synchronize()  # the write is done before the parent is told
        q.put("written")
        # Opened once per process: a second unpickle reuses the mapping.
        u = pickle.loads(data)
        q.put(len(_cuda_ipc_mappings()) == 1 and u.data_ptr == t.data_ptr)
        del x, t, u
        gc.collect()
        q.put(_cuda_ipc_mappings())  # the last tensor dropped: the mapping is closed
        for _ in range(20):  # open and close again and again: nothing accumulates
            v = torch.from_dlpack(pickle.loads(data))
            assert v[0].item() == 1.0
            del v
        gc.collect()
        q.put(_cuda_ipc_mappings())

    _guard(q, go)


def child_cupy_write(q, data: bytes):
    def go():
        import cupy

        t = pickle.loads(data)
        c = cupy.from_dlpack(t)
        q.put((str(t.device), float(c[0])))
        c[2] = 9.0
        cupy.cuda.Device(t.device.id).synchronize()

    _guard(q, go)


def child_readonly(q, data: bytes):
    def go():
        t = pickle.loads(data)
        q.put((t.readonly, str(t.device)))

    _guard(q, go)


@pytest.mark.gpu
@pytest.mark.processes
@pytest.mark.hooks
def test_gpu_torch_tensor_shared_with_a_spawn_child():
    torch = _cuda_torch()
    dev = torch.cuda.device_count() - 1  # the last device: the ordinal must survive
    before = torch.cuda.memory_allocated(dev)
    x = torch.ones(1000, dtype=torch.float32, device=f"cuda:{dev}")
    t = dlbridge.share(x)
    assert t.data_ptr == x.data_ptr() and str(t.device) == f"cuda:{dev}"
    data = pickle.dumps(t)
    assert len(data) < 1024
    seen, written, reused, closed, still_closed = run_child(child_torch_write, data)
    assert seen == (f"cuda:{dev}", (1000,), (1,), False, dev, 1.0, True)
    assert written == "written" and reused is True and closed == [] and still_closed == []
    torch.cuda.synchronize(dev)
    assert x[1].item() == 7.0 and x[0].item() == 1.0
    del t, x
    gc.collect()
    assert torch.cuda.memory_allocated(dev) == before  # dlbridge kept no reference to the memory


@pytest.mark.gpu
def test_gpu_an_offset_view_and_strides_survive():
    torch = _cuda_torch()
    x = torch.arange(64, dtype=torch.float32, device="cuda").reshape(8, 8)
    v = x[2:, 1:].t()  # an offset into the allocation, transposed strides
    t = dlbridge.share(v)
    u = pickle.loads(pickle.dumps(t))  # same process: the original memory
    assert (u.data_ptr, u.shape, u.strides) == (t.data_ptr, t.shape, t.strides)
    assert torch.equal(torch.from_dlpack(u), v)


@pytest.mark.gpu
@pytest.mark.processes
def test_gpu_cupy_array_shared_with_a_spawn_child():
    _cuda_torch()
    cupy = pytest.importorskip("cupy")
    a = cupy.arange(16, dtype=cupy.float32) + 1
    cupy.cuda.Device().synchronize()
    data = pickle.dumps(dlbridge.share(a))
    assert len(data) < 1024
    (seen,) = run_child(child_cupy_write, data)
    assert seen == (f"cuda:{a.device.id}", 1.0)
    cupy.cuda.Device().synchronize()
    assert float(a[2]) == 9.0


@pytest.mark.gpu
@pytest.mark.processes
def test_gpu_read_only_survives():
    torch = _cuda_torch()
    x = torch.zeros(4, device="cuda")
    cai = dict(x.__cuda_array_interface__)
    cai["data"] = (cai["data"][0], True)
    t = dlbridge.asdlpack(type("C", (), {"__cuda_array_interface__": cai, "x": x})())
    assert t.readonly
    assert run_child(child_readonly, pickle.dumps(t)) == [(True, f"cuda:{x.device.index}")]
    assert pickle.loads(pickle.dumps(t)).readonly


@pytest.mark.gpu
def test_gpu_same_process_maps_back_only_while_the_tensor_lives():
    torch = _cuda_torch()
    x = torch.ones(8, device="cuda")
    t = dlbridge.share(x)
    data = pickle.dumps(t)
    u = pickle.loads(data)
    assert u.data_ptr == x.data_ptr() and u.device == t.device
    del t, u
    gc.collect()
    with pytest.raises(BufferError, match="handle.pid"):
        pickle.loads(data)
