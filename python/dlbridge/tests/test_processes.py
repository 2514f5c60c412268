"""Shared tensors across processes: shared_empty/share, pickles that carry a handle, the same
memory mapped in children started with spawn, fork and forkserver and in a ProcessPoolExecutor,
lifetime (nothing left behind, a SIGKILLed child, the parent exiting first) and hostile handles.

Every child is started with a bounded wait and reaped (joined, else killed and joined). Segments
are memfds: a segment exists while a process holds a descriptor or mapping of it, so "freed" is
checked as "no process on the machine holds its inode" (every /proc/<pid>/fd and /proc/<pid>/maps
scanned), and /dev/shm is listed before and after to show nothing is ever put there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import signal
import sys
import warnings

import pytest

import dlbridge

from .libs import CHILD_WAIT, have, need, reap

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="shared tensors are Linux memfds"),
]

WAIT = CHILD_WAIT
METHODS = [m for m in ("spawn", "fork", "forkserver") if m in mp.get_all_start_methods()]
MEMFD = "/memfd:dlbridge-shm"


def segment_inode(t: dlbridge.Tensor) -> int:
    """The inode of the dlbridge memfd this process maps at the tensor's data (from /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= t.data_ptr < hi and len(parts) >= 6 and parts[5].startswith(MEMFD):
                return int(parts[4])
    raise AssertionError(f"{t!r} is not in a dlbridge segment")


def holders(ino: int) -> set[int]:
    """Every process on the machine holding a descriptor or a mapping of memfd inode `ino`."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(MEMFD) and os.stat(
                        f"/proc/{pid}/fd/{fd}"
                    ).st_ino == ino:
                        found.add(int(pid))
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 6 and parts[5].startswith(MEMFD) and int(parts[4]) == ino:
                        found.add(int(pid))
        except OSError:
            pass  # gone, or not ours to read
    return found


def eventually(check, what: str) -> None:
    """Waits (at most WAIT seconds) until `check()` is true: a sender releases the pin of a pickled
    segment a few milliseconds after a receiver has opened it (its sweeper thread)."""
    import time

    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def dev_shm() -> set[str]:
    """The files in /dev/shm that hold a dlbridge segment (its header's magic): there must be none,
    ever. (Other programs on the machine may come and go there meanwhile: they are not counted.)"""
    found = set()
    for n in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
        try:
            with open(os.path.join("/dev/shm", n), "rb") as f:
                if f.read(8) == b"DLBRSHM1":
                    found.add(n)
        except OSError:
            pass
    return found


def floats(t: dlbridge.Tensor) -> memoryview:
    return memoryview(t).cast("B").cast("f")


# ---- children (module level: spawn and forkserver import them) ------------------------------------


def child_write(t: dlbridge.Tensor, q: mp.Queue, more: mp.Queue) -> None:
    """Reports what it sees of `t` and of the tensor sent through `more`, writes 7.0 at index 1."""
    u = more.get(timeout=WAIT)
    m = floats(t)
    q.put((t.shape, t.strides, str(t.dtype), t.readonly, t.byte_offset, m[0], u.data_ptr == t.data_ptr))
    m[1] = 7.0
    q.put("written")


def child_readonly(t: dlbridge.Tensor, q: mp.Queue) -> None:
    try:
        memoryview(t).cast("B")[0] = 1
        q.put(("wrote", t.readonly))
    except (TypeError, BufferError) as e:
        q.put((type(e).__name__, t.readonly))


def child_libraries(t: dlbridge.Tensor, q: mp.Queue) -> None:
    """numpy, torch and jax read the tensor in place; numpy writes through."""
    out = {}
    import numpy as np

    a = np.from_dlpack(t)
    out["numpy"] = a.ctypes.data == t.data_ptr
    a[2] = 3.0
    if have("torch"):
        import torch

        out["torch"] = torch.from_dlpack(t).data_ptr() == t.data_ptr
    if have("jax"):
        import jax

        out["jax"] = jax.numpy.from_dlpack(t).unsafe_buffer_pointer() == t.data_ptr
    q.put(out)


def pool_task(t: dlbridge.Tensor) -> float:
    m = floats(t)
    m[0] = m[0] + 1.0
    return m[0]


def child_hold_until_killed(t: dlbridge.Tensor, q: mp.Queue) -> None:
    floats(t)[0] = 5.0
    q.put(os.getpid())
    signal.pause()


def orphan_child(t: dlbridge.Tensor, mapped, parent_gone, q: mp.Queue) -> None:
    """Waits until its parent exited, then reads and writes the memory and reports."""
    mapped.set()  # `t` was unpickled (mapped) before this function ran
    parent_gone.wait(WAIT)
    m = floats(t)
    m[1] = m[0] + 1.0
    q.put(("orphan", os.getpid(), m[0], m[1]))


def parent_that_exits(q: mp.Queue, parent_gone) -> None:
    """Makes a shared tensor, hands it to a child of its own, and exits without waiting for it."""
    t = dlbridge.shared_empty(4, "float32")
    floats(t)[0] = 41.0
    ctx = mp.get_context("spawn")
    mapped = ctx.Event()
    c = ctx.Process(target=orphan_child, args=(t, mapped, parent_gone, q))
    c.start()
    mapped.wait(WAIT)
    q.put(("parent", os.getpid(), c.pid, segment_inode(t)))
    q.close()
    q.join_thread()
    # Exit now: the child outlives its parent. (os._exit: multiprocessing would otherwise join it.)
    os._exit(0)


def subreaper(q: mp.Queue, parent_gone) -> None:
    """Adopts orphans (PR_SET_CHILD_SUBREAPER) so the orphaned grandchild is reaped here."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=parent_that_exits, args=(q, parent_gone))
    p.start()
    p.join(WAIT)
    pid, status = os.waitpid(-1, 0)  # the orphan, once it exits
    q.put(("reaped", pid, os.waitstatus_to_exitcode(status)))


# ---- the API in one process -----------------------------------------------------------------------


def test_shared_empty_is_zeroed_writable_c_contiguous_and_aligned():
    t = dlbridge.shared_empty((3, 4), "float32")
    assert (t.shape, t.strides, t.dtype, t.readonly) == ((3, 4), (4, 1), dlbridge.float32, False)
    assert t.is_c_contiguous and t.data_ptr % 256 == 0
    assert bytes(memoryview(t)) == bytes(48)
    assert dlbridge.shared_empty(5, dlbridge.bfloat16).shape == (5,)
    assert dlbridge.shared_empty((0, 3), "int8").size == 0
    with pytest.raises(TypeError, match="dtype"):
        dlbridge.shared_empty(3, 4)
    with pytest.raises(ValueError, match="negative"):
        dlbridge.shared_empty((2, -1), "float32")
    with pytest.raises(ValueError):
        dlbridge.shared_empty(3, "float33")


def test_share_copies_once_and_not_when_already_shared():
    src = bytearray(b"\x01\x02\x03\x04")
    s = dlbridge.share(src)
    assert bytes(memoryview(s)) == bytes(src) and s.data_ptr != dlbridge.asdlpack(src).data_ptr
    src[0] = 9
    assert bytes(memoryview(s))[0] == 1  # a copy
    again = dlbridge.share(s)
    assert again.data_ptr == s.data_ptr  # no second copy
    # A copy is new memory only dlbridge holds: writable, whatever the source was.
    c = dlbridge.share(b"\x01\x02")
    assert not c.readonly and bytes(memoryview(c)) == b"\x01\x02"
    with pytest.raises(TypeError):
        dlbridge.share(object())


def test_share_of_a_view_into_shared_memory_is_not_copied():
    np = need("numpy")
    t = dlbridge.shared_empty((4, 6), "float64")
    v = np.from_dlpack(t)[1:, ::2].T  # strided, offset, transposed: still inside the segment
    s = dlbridge.share(v)
    assert s.data_ptr == v.ctypes.data and s.strides == tuple(x // 8 for x in v.strides)
    c = dlbridge.share(np.arange(12.0).reshape(3, 4).T)  # not shared: one C-contiguous copy
    assert c.is_c_contiguous and np.from_dlpack(c).tolist() == np.arange(12.0).reshape(3, 4).T.tolist()


def test_deepcopy_is_new_shared_memory_and_copy_the_same():
    import copy

    t = dlbridge.shared_empty((2, 3), "float32")
    floats(t)[4] = 1.5
    d = copy.deepcopy(t)
    assert d.data_ptr != t.data_ptr and bytes(memoryview(d)) == bytes(memoryview(t))
    assert (d.shape, d.strides, d.dtype, d.readonly) == (t.shape, t.strides, t.dtype, False)
    assert segment_inode(d) != segment_inode(t) and len(pickle.dumps(d)) < 1024  # shared too
    floats(d)[0] = 2.0
    assert floats(t)[0] == 0.0
    assert copy.copy(t).data_ptr == t.data_ptr  # a shallow copy: the same memory


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_shared_pickle_is_a_small_handle(protocol):
    t = dlbridge.shared_empty((1 << 24,), "float32")  # 64 MiB
    p = pickle.dumps(t, protocol=protocol)
    assert len(p) < 1024
    u = pickle.loads(p)
    assert u.data_ptr == t.data_ptr  # the same mapping (this process maps it once)
    assert (u.shape, u.strides, u.dtype) == (t.shape, t.strides, t.dtype)


def test_dropping_the_last_tensor_frees_the_segment():
    shm_before = dev_shm()
    t = dlbridge.shared_empty(1000, "float32")
    ino = segment_inode(t)
    assert holders(ino) == {os.getpid()}
    u = pickle.loads(pickle.dumps(t))
    del t
    gc.collect()
    assert holders(ino) == {os.getpid()}  # u still holds it
    del u
    gc.collect()
    assert holders(ino) == set()  # the pickle's pin was claimed by the loads in this process
    assert dev_shm() == shm_before == set()


# ---- other processes ------------------------------------------------------------------------------

FORK_WITH_THREADS = "is multi-threaded, use of fork() may lead to deadlocks"
JAX_FORK = "os.fork() was called. os.fork() is incompatible with multithreaded code, and JAX"


@contextlib.contextmanager
def starting(method):
    """Starts children with `method`. A fork in a process with other threads warns: CPython from
    3.12 on (a DeprecationWarning; the suite makes it an error everywhere else), and jax, once
    imported, on every fork (a RuntimeWarning). By now numpy's, torch's, jax's and Ray's threads run
    in this process, and what a forked child inherits is the point of the fork cases, so there
    those warnings are expected: they are the only ones starting the children may give."""
    if method != "fork":
        yield
        return
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    for w in seen:
        cpython = issubclass(w.category, DeprecationWarning) and FORK_WITH_THREADS in str(w.message)
        jax = issubclass(w.category, RuntimeWarning) and str(w.message).startswith(JAX_FORK)
        assert (cpython and sys.version_info >= (3, 12)) or (jax and "jax" in sys.modules), w


@pytest.mark.parametrize("method", METHODS)
def test_a_child_maps_the_same_memory(method):
    ctx = mp.get_context(method)
    t = dlbridge.shared_empty((2, 3), "float32")
    floats(t)[0] = 2.5
    q, more = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child_write, args=(t, q, more))
    with starting(method):
        p.start()
    try:
        more.put(t)  # a second copy of the handle through a queue (pickled in every method)
        seen = q.get(timeout=WAIT)
        assert seen == ((2, 3), (3, 1), "float32", False, 0, 2.5, True)
        assert q.get(timeout=WAIT) == "written"
        assert floats(t)[1] == 7.0  # the child's write, seen here
    finally:
        reap(p)
    assert p.exitcode == 0


@pytest.mark.parametrize("method", METHODS)
def test_read_only_and_layout_survive(method):
    np = need("numpy")
    ctx = mp.get_context(method)
    a = np.from_dlpack(dlbridge.shared_empty(6, "float32"))
    a.flags.writeable = False
    ro = dlbridge.share(a)  # a read-only view of shared memory: itself, read-only
    assert ro.readonly and ro.data_ptr == a.ctypes.data
    q = ctx.Queue()
    p = ctx.Process(target=child_readonly, args=(ro, q))
    with starting(method):
        p.start()
    try:
        assert q.get(timeout=WAIT) in {("TypeError", True), ("BufferError", True)}
    finally:
        reap(p)
    # A strided view of shared memory keeps its strides and offset through a pickle.
    t = dlbridge.shared_empty((4, 6), "float64")
    v = dlbridge.share(np.from_dlpack(t)[1:, ::2].T)
    u = pickle.loads(pickle.dumps(v))
    assert (u.shape, u.strides, u.data_ptr, u.byte_offset) == (v.shape, v.strides, v.data_ptr, v.byte_offset)


def child_report(t: dlbridge.Tensor, q: mp.Queue) -> None:
    q.put((t.byte_offset, t.shape, t.strides, list(floats(t))))


@pytest.mark.parametrize("method", METHODS)
def test_byte_offset_survives(method):
    """A producer's (data, byte_offset) pair into shared memory reaches the child as it was."""
    from ._dlpack_ctypes import FakeCapsule

    ctx = mp.get_context(method)
    t = dlbridge.shared_empty(8, "float32")
    m = floats(t)
    for i in range(8):
        m[i] = float(i)
    fake = FakeCapsule(data=t.data_ptr, byte_offset=8, shape=(3,), strides=(1,), dtype=(2, 32, 1))
    v = dlbridge.from_dlpack(fake)
    assert v.byte_offset == 8
    q = ctx.Queue()
    p = ctx.Process(target=child_report, args=(v, q))
    with starting(method):
        p.start()
    try:
        assert q.get(timeout=WAIT) == (8, (3,), (1,), [2.0, 3.0, 4.0])
    finally:
        reap(p)
    del v
    gc.collect()
    assert fake.deleted == 1


@pytest.mark.parametrize("method", METHODS)
def test_numpy_torch_jax_read_it_in_place_in_the_child(method):
    need("numpy")
    ctx = mp.get_context(method)
    t = dlbridge.shared_empty(8, "float32")
    q = ctx.Queue()
    p = ctx.Process(target=child_libraries, args=(t, q))
    with starting(method):
        p.start()
    try:
        out = q.get(timeout=WAIT)
    finally:
        reap(p)
    assert out == {lib: True for lib in ("numpy", "torch", "jax") if have(lib)}
    assert floats(t)[2] == 3.0


@pytest.mark.parametrize("method", METHODS)
def test_process_pool_executor(method):
    t = dlbridge.shared_empty(4, "float32")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        with starting(method):  # a fork context starts every worker here
            task = ex.submit(pool_task, t)
        assert task.result(timeout=WAIT) == 1.0
    assert floats(t)[0] == 1.0


# ---- lifetime -------------------------------------------------------------------------------------


def test_a_sigkilled_child_leaves_nothing():
    shm_before = dev_shm()
    ctx = mp.get_context("spawn")
    t = dlbridge.shared_empty(1 << 20, "float32")
    ino = segment_inode(t)
    q = ctx.Queue()
    p = ctx.Process(target=child_hold_until_killed, args=(t, q))
    p.start()
    try:
        pid = q.get(timeout=WAIT)
        assert holders(ino) == {os.getpid(), pid}
        assert floats(t)[0] == 5.0
        del t
        gc.collect()
        eventually(lambda: holders(ino) == {pid}, "only the child keeps it now")
        os.kill(pid, signal.SIGKILL)
        p.join(WAIT)
        assert p.exitcode == -signal.SIGKILL
    finally:
        reap(p)
    assert holders(ino) == set()
    assert dev_shm() == shm_before == set()


def test_the_parent_exiting_first_leaves_nothing():
    shm_before = dev_shm()
    ctx = mp.get_context("spawn")
    q, parent_gone = ctx.Queue(), ctx.Event()
    s = ctx.Process(target=subreaper, args=(q, parent_gone))
    s.start()
    try:
        _, parent_pid, child_pid, ino = q.get(timeout=WAIT)
        # Wait for the parent to be gone (it exits right after reporting), then let the child go on.
        for _ in range(WAIT * 100):
            if parent_pid not in holders(ino):
                break
            os.sched_yield()
        assert holders(ino) == {child_pid}  # the orphan alone keeps the memory
        parent_gone.set()
        assert q.get(timeout=WAIT) == ("orphan", child_pid, 41.0, 42.0)
        assert q.get(timeout=WAIT) == ("reaped", child_pid, 0)
    finally:
        parent_gone.set()
        reap(s)
    assert s.exitcode == 0
    assert holders(ino) == set()
    assert dev_shm() == shm_before == set()


# ---- handles from elsewhere -----------------------------------------------------------------------


def handle_of(t: dlbridge.Tensor) -> tuple:
    f, (h,) = t.__reduce_ex__(5)
    assert f is dlbridge._dlbridge._rebuild_shared
    return h


def with_field(h: tuple, part: int, i: int, value) -> tuple:
    p = list(h[part])
    p[i] = value
    return tuple(tuple(p) if k == part else x for k, x in enumerate(h))


def rebuild(h):
    return dlbridge._dlbridge._rebuild_shared(h)


def test_hostile_handles_are_clear_errors():
    t = dlbridge.shared_empty((4, 4), "float32")
    h = handle_of(t)
    assert rebuild(h).data_ptr == t.data_ptr
    cases = [
        (with_field(h, 0, 0, "other"), "handle.version"),
        (with_field(h, 0, 2, "1"), "handle.pid"),
        (with_field(h, 0, 6, b"short"), "handle.token"),
        (with_field(h, 0, 6, bytes(16)), "handle.token"),  # opened via /proc: the header differs
        (with_field(h, 1, 0, 1 << 40), "handle.size"),
        (with_field(h, 2, 1, [5, 4]), "handle.shape/strides/offsets"),
        (with_field(h, 2, 2, [4, -1]), "handle.shape/strides/offsets"),
        (with_field(h, 1, 1, 60), "handle.shape/strides/offsets"),
        (with_field(h, 2, 0, (2, 33, 1)), "dtype"),
        (with_field(h, 2, 1, [4, 4, 4]), "strides"),
        (with_field(h, 0, 7, 28), "handle.pin_slot"),
        (with_field(with_field(h, 0, 7, 0), 0, 8, 0), "handle.pin_slot"),  # a pin's tag is never 0
        (with_field(h, 0, 8, -1), "handle.pin_tag"),
        ((h[0],), "handle"),
        ("nonsense", "handle"),
    ]
    for bad, field in cases:
        with pytest.raises(BufferError, match=f"unpickling a dlbridge Tensor: {field}"):
            rebuild(bad)


def test_handles_to_what_is_not_a_dlbridge_segment():
    t = dlbridge.shared_empty(16, "uint8")
    h = handle_of(t)
    other = dlbridge.shared_empty(16, "uint8")
    ho = handle_of(other)
    # The right descriptor of another segment under this one's identity (reused number), and
    # descriptors of things that are no segment: a pipe, a file, a memfd with dlbridge's name but
    # no seals, one with seals and no header.
    r, w = os.pipe()
    f = open("/proc/self/stat", "rb")
    plain = os.memfd_create("dlbridge-shm")
    os.ftruncate(plain, 256 + 16)
    sealed = os.memfd_create("dlbridge-shm", os.MFD_ALLOW_SEALING)
    os.ftruncate(sealed, 256 + 16)
    import fcntl

    fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    try:
        fake_token = with_field(h, 0, 6, bytes(range(16)))  # not in the registry: opened for real
        assert "handle.inode" in err(with_field(fake_token, 0, 3, ho[0][3]))
        assert "not a dlbridge segment" in err(with_field(fake_token, 0, 3, r))
        assert "not a dlbridge segment" in err(with_field(fake_token, 0, 3, f.fileno()))
        st = os.fstat(plain)
        assert "not sealed" in err(with_field(with_field(fake_token, 0, 3, plain), 0, 5, st.st_ino))
        st = os.fstat(sealed)
        assert "no dlbridge header" in err(with_field(with_field(fake_token, 0, 3, sealed), 0, 5, st.st_ino))
        assert "handle.size" in err(with_field(with_field(with_field(fake_token, 0, 3, sealed), 0, 5, st.st_ino), 1, 0, 17))
        assert "handle.fd" in err(with_field(fake_token, 0, 2, 2**31 - 1))  # no such process
    finally:
        for fd in (r, w, plain, sealed):
            os.close(fd)
        f.close()


def err(h) -> str:
    with pytest.raises(BufferError) as e:
        rebuild(h)
    return str(e.value)


def test_a_pickle_keeps_the_memory_until_its_first_load_then_is_stale():
    t = dlbridge.shared_empty(16, "uint8")
    memoryview(t)[3] = 7
    ino = segment_inode(t)
    p = pickle.dumps(t)
    del t
    gc.collect()
    assert holders(ino) == {os.getpid()}  # pinned for the receiver
    u = pickle.loads(p)  # the first load claims the pin
    assert memoryview(u)[3] == 7
    del u
    gc.collect()
    assert holders(ino) == set()
    # The descriptor is closed (or its number reused by something else): either way, refused.
    with pytest.raises(BufferError, match="handle.fd: .*stale handle"):
        pickle.loads(p)


def test_a_stale_handle_from_an_exited_child_is_an_error():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child_pickles, args=(q,))
    p.start()
    try:
        data = q.get(timeout=WAIT)
    finally:
        reap(p)
    with pytest.raises(BufferError, match=f"handle.fd: .*stale handle: process {p.pid}, which pickled the tensor, has exited"):
        pickle.loads(data)


def child_pickles(q: mp.Queue) -> None:
    q.put(pickle.dumps(dlbridge.shared_empty(16, "uint8")))


def test_mutated_handles_never_crash():
    """Every field of a real handle replaced by values from a hostile list (seeded, 3000 cases):
    each rebuild either gives a tensor that lies inside the segment or raises BufferError."""
    import random

    t = dlbridge.shared_empty((4, 8), "float32")
    h = handle_of(t)
    lo, hi = t.data_ptr, t.data_ptr + 4 * 8 * 4
    values = [0, 1, -1, 3, 7, 8, 31, 32, 64, 2**31 - 1, 2**32, 2**63 - 1, 2**63, -(2**63), 2**64,
              None, "x", b"", bytes(16), 1.5, [], [0], [4, 8], [8, 1], [-1, 1], [2**62, 1], [1] * 70,
              (2, 32, 1), (2, 8, 1), (1, 64, 1), (0, 1, 1), (2, 32, 0), (4, 16, 1)]
    rng = random.Random(23)
    made = 0
    for _ in range(3000):
        bad = h
        for _ in range(rng.randint(1, 3)):
            part = rng.randrange(3)
            bad = with_field(bad, part, rng.randrange(len(h[part])), rng.choice(values))
        try:
            u = rebuild(bad)
        except BufferError:
            continue
        made += 1
        if u.size:  # whatever was accepted lies inside the segment, every element of it
            item = u.itemsize or 1
            first = sum(min(0, (d - 1) * s) for d, s in zip(u.shape, u.strides))
            last = sum(max(0, (d - 1) * s) for d, s in zip(u.shape, u.strides))
            assert lo <= u.data_ptr + first * item and u.data_ptr + (last + 1) * item <= hi, (bad, u)
    assert 0 < made < 3000


# ---- the rest of the contract: limits, descriptors, permissions, what the README says ------------


def run_script(code: str, *args: str, input: str | None = None) -> str:
    """Runs `code` in a fresh Python (this one), bounded; returns its stdout (asserting exit 0)."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", code, *args], input=input, capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_more_than_the_machine_can_back_is_a_memory_error():
    """4 TiB used to succeed on a 24 GiB machine (the OOM killer came later); numpy raises
    MemoryError for the same. The message names the size and the limit."""
    with pytest.raises(MemoryError, match=r"4398046511360 bytes \(4\.0 TiB\).* can ever back \(\d+ bytes"):
        dlbridge.shared_empty(2**40, "float32")
    with pytest.raises(MemoryError, match="memory plus swap|memory cgroup"):
        dlbridge.shared_empty((2**20, 2**20), "int8")
    assert dlbridge.shared_empty(1 << 22, "float32").size == 1 << 22  # 16 MiB: below every limit


def test_a_memfd_file_size_limit_is_a_memory_error():
    """RLIMIT_FSIZE limits a memfd as any file (a child sets it): MemoryError naming it, where
    ftruncate's EFBIG used to be a BufferError about the size."""
    out = run_script(
        "import resource, dlbridge\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "assert dlbridge.shared_empty(8 << 20, 'float32').size == 8 << 20\n"
        "try:\n"
        "    dlbridge.shared_empty(32 << 20, 'float32')\n"
        "except MemoryError as e:\n"
        "    print('MemoryError', e)\n"
    )
    assert out.startswith("MemoryError") and "134217984 bytes" in out and "RLIMIT_FSIZE" in out, out


IN_A_CGROUP = r"""
import os, sys
open(os.path.join(sys.argv[1], "cgroup.procs"), "w").write(str(os.getpid()))
import dlbridge
assert dlbridge.shared_empty(4 << 20, "float32").size == 4 << 20
try:
    dlbridge.shared_empty(1 << 28, "float32")
    print("made 1 GiB")
except MemoryError as e:
    print("MemoryError", e)
"""


def memory_cgroup_dir() -> str | None:
    """A new child of this process's memory cgroup (v1 or v2) limited to 512 MiB, if this process
    may make one (root with a writable cgroup file system), else None."""
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for hid, ctrls, path in lines:
        v2 = hid == "0" and ctrls == ""
        if not v2 and "memory" not in ctrls.split(","):
            continue
        base = ("/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory") + path
        limit_file = "memory.max" if v2 else "memory.limit_in_bytes"
        d = os.path.join(base, f"dlbridge-test-{os.getpid()}")
        try:
            os.mkdir(d)
        except OSError:
            continue
        try:
            with open(os.path.join(d, limit_file), "w") as f:
                f.write(str(512 << 20))
            return d
        except OSError:
            os.rmdir(d)
    return None


def test_a_memory_cgroup_limit_is_a_memory_error():
    """A child in a memory cgroup of 512 MiB asks for 1 GiB: MemoryError naming the cgroup's file
    (the cgroup is made for the test; skipped where this process may not make one)."""
    d = memory_cgroup_dir()
    if d is None:
        pytest.skip("cannot make a memory cgroup here (needs root and a writable cgroup file system)")
    try:
        out = run_script(IN_A_CGROUP, d)
    finally:
        os.rmdir(d)
    assert out.startswith("MemoryError") and "memory cgroup" in out and d in out and "536870912 bytes" in out, out


RECEIVE_WITHOUT_DESCRIPTORS = r"""
import os, pickle, resource, sys
import dlbridge
blob = bytes.fromhex(sys.stdin.readline())
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
top = max(int(x) for x in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
held = []
while True:
    try:
        held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        break
try:
    pickle.loads(blob)
    print("opened")
except BufferError as e:
    print(e)
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print("then", list(memoryview(pickle.loads(blob)).cast("B").cast("f")))  # claims the pin
"""


def test_a_receiver_out_of_descriptors_is_told_so():
    """Not "stale handle": the receiver (a child at its RLIMIT_NOFILE) is out of descriptors."""
    t = dlbridge.shared_empty(2, "float32")
    floats(t)[1] = 3.0
    out = run_script(RECEIVE_WITHOUT_DESCRIPTORS, input=pickle.dumps(t).hex() + "\n").splitlines()
    assert "this process is out of file descriptors" in out[0] and "RLIMIT_NOFILE" in out[0], out
    assert "stale" not in out[0], out
    assert out[1] == "then [0.0, 3.0]"


# Both sides drop CAP_SYS_PTRACE when run as root, so that ptrace's access rules apply to them as
# to any user (root with CAP_SYS_PTRACE may open any process's descriptors).
DROP_PTRACE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
if os.geteuid() == 0:
    class H(ctypes.Structure):
        _fields_ = [("v", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class D(ctypes.Structure):
        _fields_ = [("e", ctypes.c_uint32), ("p", ctypes.c_uint32), ("i", ctypes.c_uint32)]
    h, d = H(0x20080522, 0), (D * 2)()
    assert libc.capget(ctypes.byref(h), d) == 0
    for f in ("e", "p", "i"):
        setattr(d[0], f, getattr(d[0], f) & ~(1 << 19))  # CAP_SYS_PTRACE
    assert libc.capset(ctypes.byref(h), d) == 0, ctypes.get_errno()
"""
SEND_AND_WAIT = DROP_PTRACE + r"""
import pickle, sys
import dlbridge
if sys.argv[1] == "0":
    assert libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE, 0
t = dlbridge.shared_empty(4, "float32")
sys.stdout.write(pickle.dumps(t).hex() + "\n")
sys.stdout.flush()
sys.stdin.readline()
"""
RECEIVE = DROP_PTRACE + r"""
import pickle, sys
import dlbridge
try:
    print("opened", pickle.loads(bytes.fromhex(sys.stdin.readline())).shape)
except BufferError as e:
    print(e)
"""


@pytest.mark.parametrize("dumpable", [True, False])
def test_a_sender_that_is_not_dumpable_cannot_be_opened_and_the_error_says_why(dumpable):
    """Linux opens /proc/<pid>/fd of another process only with ptrace read access: a same-user
    sender that made itself non-dumpable is refused, and the error names the rule."""
    import subprocess

    s = subprocess.Popen([sys.executable, "-c", SEND_AND_WAIT, "1" if dumpable else "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        blob = s.stdout.readline()
        out = run_script(RECEIVE, input=blob)
    finally:
        s.communicate("\n", timeout=WAIT)
    if dumpable:
        assert out == "opened (4,)\n", out
    else:
        assert "handle.fd" in out and "permission denied" in out and "dumpable" in out and "PR_SET_DUMPABLE" in out, out
        assert "stale" not in out, out


def test_a_strided_view_of_shared_memory_pickles_as_a_handle():
    """`a[::2]` of a shared tensor is shared memory too: a handle, the same memory, its strides
    (the README said by value; a copy would silently cut the view off from the memory)."""
    np = need("numpy")
    t = dlbridge.shared_empty(10, "float32")
    v = dlbridge.asdlpack(np.from_dlpack(t)[::2])
    p = pickle.dumps(v)
    assert len(p) < 1024
    u = pickle.loads(p)
    assert (u.data_ptr, u.shape, u.strides) == (t.data_ptr, (5,), (2,))
    np.from_dlpack(u)[1] = 4.0
    assert floats(t)[2] == 4.0
    # By value when asked: a copy is private memory, which pickles its bytes.
    c = dlbridge.from_dlpack(v, copy=True)
    assert len(pickle.dumps(c, protocol=4)) > 5 * 4 and pickle.loads(pickle.dumps(c)).data_ptr != t.data_ptr


def test_share_of_a_jax_array_is_writable_and_goes_to_jax():
    """jax arrays are read-only; share() copies into new memory only dlbridge holds, so the copy is
    writable, and jax (which refuses read-only tensors) takes it."""
    jax = need("jax")
    np = need("numpy")
    x = jax.numpy.arange(6.0, dtype=jax.numpy.float32).reshape(2, 3)
    s = dlbridge.share(x)
    assert not s.readonly
    np.from_dlpack(s)[0, 0] = 9.0
    y = jax.numpy.from_dlpack(s)
    assert y.tolist() == [[9.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert float(x[0, 0]) == 0.0  # a copy
