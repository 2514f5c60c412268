"""CUDA tensors across processes: a CUDA Tensor pickles as a CUDA IPC handle (the allocation's
64-byte handle, the data's offset in it, the device ordinal, the pid, dtype/shape/strides/flags),
which another process opens on the same device and the same process maps back to the original.

Without a GPU: the refusals (fake device pointers that are never dereferenced, crafted handles),
and the whole path against a fake libcuda.so.1 compiled for the test (device memory that is shared
host memory), in a subprocess. The tests marked `gpu` need torch with CUDA (and cupy for one) and
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

from .libs import CHILD_WAIT, FakeCudaArray, need, reap

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pickling is built on Linux")

WAIT = CHILD_WAIT
rebuild_cuda = dlbridge._dlbridge._rebuild_cuda


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


# ---- the whole path through a fake driver (a C compiler needed; no GPU) -----------------------------

# A libcuda.so.1 for this test only: "device memory" is shared host memory (a memfd), an IPC handle
# names the exporter's descriptor, and every call that needs a current context checks that one was
# pushed. It lets the export, open-once-per-process, close-on-drop and same-process paths run here.
FAKE_DRIVER = r"""
// A fake CUDA driver for test_cuda_ipc.py: "device memory" is shared host memory (memfd).
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/mman.h>
typedef unsigned long long u64;
typedef struct { char reserved[64]; } H;
struct hd { char magic[8]; int pid; int fd; u64 size; };
struct alloc { u64 base; u64 size; int fd; int imported; int live; };
static struct alloc A[256]; static int nA;
static __thread int depth;
static int retains; int fake_syncs, fake_opens, fake_closes, fake_ctx_errors;
int fake_retains(void) { return retains; }
static struct alloc *find(u64 p) { for (int i = 0; i < nA; i++) if (A[i].live && p >= A[i].base && p < A[i].base + A[i].size) return &A[i]; return 0; }
int cuInit(unsigned f) { return 0; }
int cuDeviceGet(int *d, int o) { if (o != 0) return 101; *d = 0; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)0x1; retains++; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { retains--; return 0; }
int cuCtxPushCurrent_v2(void *c) { depth++; return 0; }
int cuCtxPopCurrent_v2(void **c) { if (!depth) return 201; depth--; *c = (void *)1; return 0; }
int cuEventCreate(void **e, unsigned f) { *e = (void *)2; return 0; }
int cuEventRecord(void *e, void *s) { return 0; }
int cuStreamWaitEvent(void *s, void *e, unsigned f) { return 0; }
int cuEventDestroy_v2(void *e) { return 0; }
int cuCtxSynchronize(void) { if (!depth) { fake_ctx_errors++; return 201; } fake_syncs++; return 0; }
int cuPointerGetAttribute(void *data, int attr, u64 p) {
  if (!find(p)) return 1;
  if (attr == 9) *(int *)data = 0; else if (attr == 8) *(unsigned *)data = 0; else return 1;
  return 0;
}
int cuMemAlloc_v2(u64 *p, size_t size) {
  int fd = memfd_create("fakecuda", 0); ftruncate(fd, size);
  void *m = mmap(0, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  A[nA++] = (struct alloc){(u64)m, size, fd, 0, 1}; *p = (u64)m; return 0;
}
int cuMemGetAddressRange_v2(u64 *b, size_t *s, u64 p) {
  if (!depth) { fake_ctx_errors++; return 201; }
  struct alloc *a = find(p); if (!a) return 1; *b = a->base; *s = a->size; return 0;
}
int cuIpcGetMemHandle(H *h, u64 p) {
  if (!depth) { fake_ctx_errors++; return 201; }
  struct alloc *a = find(p); if (!a || a->base != p || a->imported) return 1;
  struct hd d = {"FAKEIPC", getpid(), a->fd, a->size}; memset(h, 0, 64); memcpy(h, &d, sizeof d); return 0;
}
int cuIpcOpenMemHandle_v2(u64 *p, H h, unsigned flags) {
  if (!depth) { fake_ctx_errors++; return 201; }
  struct hd d; memcpy(&d, &h, sizeof d);
  if (memcmp(d.magic, "FAKEIPC", 8)) return 400;
  if (d.pid == getpid()) return 201;
  for (int i = 0; i < nA; i++) if (A[i].live && A[i].imported && A[i].fd == d.fd) return 208; // already mapped
  char path[64]; snprintf(path, sizeof path, "/proc/%d/fd/%d", d.pid, d.fd);
  int fd = open(path, O_RDWR); if (fd < 0) return 400;
  void *m = mmap(0, d.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0); close(fd);
  A[nA++] = (struct alloc){(u64)m, d.size, d.fd, 1, 1}; *p = (u64)m; fake_opens++; return 0;
}
int cuIpcCloseMemHandle(u64 p) {
  if (!depth) { fake_ctx_errors++; return 201; }
  struct alloc *a = find(p); if (!a || !a->imported || a->base != p) return 1;
  munmap((void *)a->base, a->size); a->live = 0; fake_closes++; return 0;
}
"""

FAKE_CHECK = r"""
import ctypes, gc, multiprocessing as mp, pickle
import dlbridge
from dlbridge._dlbridge import _cuda_ipc_mappings

lib = ctypes.CDLL("libcuda.so.1")

def count(name):
    return ctypes.c_int.in_dll(lib, name).value

class CAI:
    def __init__(self, ptr, ro=False, shape=(4, 4), strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (ptr, ro), "version": 3,
                                         "strides": strides, "stream": None}

def floats(ptr, n):
    return (ctypes.c_float * n).from_address(ptr)

def child(q, data):
    try:
        assert _cuda_ipc_mappings() == []
        t = pickle.loads(data)
        u = pickle.loads(data)
        f = floats(t.data_ptr, 2)
        q.put((str(t.device), t.shape, t.strides, t.readonly, f[0], len(_cuda_ipc_mappings()),
               u.data_ptr == t.data_ptr, count("fake_opens")))
        f[1] = 7.0
        del f, t, u
        gc.collect()
        q.put((_cuda_ipc_mappings(), count("fake_closes"), lib.fake_retains()))
        for _ in range(5):
            v = pickle.loads(data)
            del v
        q.put((_cuda_ipc_mappings(), count("fake_opens"), count("fake_closes"), lib.fake_retains(),
               count("fake_ctx_errors")))
    except BaseException:
        import traceback
        q.put(("error", traceback.format_exc()))

def run(ctx, data):
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q, data))
    p.start()
    out = [q.get(timeout=60) for _ in range(3)]
    p.join(60)
    assert p.exitcode == 0 and "error" not in out[0], out
    return out

if __name__ == "__main__":
    p = ctypes.c_ulonglong()
    assert lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(4096)) == 0
    base = p.value
    f = floats(base + 256, 16)
    for i in range(16):
        f[i] = i + 1.0
    t = dlbridge.asdlpack(CAI(base + 256))
    assert str(t.device) == "cuda:0"
    assert dlbridge.share(t).data_ptr == t.data_ptr
    data = pickle.dumps(t)
    assert len(data) < 1024 and count("fake_syncs") == 1
    (tag, version, pid, device, ipc), place, desc = t.__reduce_ex__(5)[1][0]
    assert (tag, version, device, len(ipc), place) == ("dlbridge-cuda", 1, 0, 64, (4096, 256, 0))
    assert desc == ((2, 32, 1), [4, 4], [4, 1], False, False)
    u = pickle.loads(data)  # the same process: the original memory
    assert u.data_ptr == t.data_ptr and str(u.device) == "cuda:0"
    view = dlbridge.asdlpack(CAI(base + 260, ro=True, shape=(3, 4), strides=(4, 16)))
    w = pickle.loads(pickle.dumps(view))
    assert w.readonly and w.strides == view.strides and w.data_ptr == view.data_ptr
    ctx = mp.get_context("spawn")
    seen, dropped, cycles = run(ctx, data)
    assert seen == ("cuda:0", (4, 4), (4, 1), False, 1.0, 1, True, 1), seen
    assert dropped == ([], 1, 0), dropped  # closed, the primary context released
    assert cycles == ([], 6, 6, 0, 0), cycles  # opened and closed once per cycle; contexts current
    assert f[1] == 7.0  # the child's write
    seen, _, _ = run(ctx, pickle.dumps(view))
    assert seen == ("cuda:0", (3, 4), (1, 4), True, 7.0, 1, True, 1), seen
    assert count("fake_ctx_errors") == 0 and lib.fake_retains() == 0
    del t, u, w, view
    gc.collect()
    try:
        pickle.loads(data)
        raise AssertionError("a handle of this process's dropped tensor was loaded")
    except BufferError as e:
        assert "handle.pid" in str(e), e
    print("fake driver: OK")
"""


@pytest.mark.processes
@pytest.mark.hooks
def test_the_whole_path_through_a_fake_driver(tmp_path):
    """Pickle (handle, synchronise), same-process map-back, a spawn child that opens once, writes,
    closes on the last drop and reopens; the stale same-process handle; against a fake libcuda."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the fake driver")
    (tmp_path / "fake.c").write_text(FAKE_DRIVER)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "fake.c")],
                   check=True, capture_output=True, timeout=WAIT)
    (tmp_path / "check.py").write_text(FAKE_CHECK)
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, str(tmp_path / "check.py")], env=env, capture_output=True, text=True,
                       timeout=WAIT, cwd=tmp_path)
    assert r.returncode == 0 and "fake driver: OK" in r.stdout, r.stdout + r.stderr


# ---- real GPU (run on a machine with CUDA; skipped elsewhere) --------------------------------------


def _cuda_torch():
    torch = need("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


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
    assert u.data_ptr == x.data_ptr() and str(u.device) == str(t.device)
    del t, u
    gc.collect()
    with pytest.raises(BufferError, match="handle.pid"):
        pickle.loads(data)
