"""Threads: imports and exports of the same objects from 8 Python threads at once, a capsule raced
for by 8 threads (exactly one wins, the deleter runs once), tensors dropped on native threads that
never held the GIL, and live tensors and capsules at interpreter exit."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref

import pytest

import dlbridge

from ._dlpack_ctypes import FakeCapsule
from .libs import need

THREADS = 8


def run_threads(target, n: int = THREADS) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def wrapped(i: int) -> None:
        try:
            start.wait()
            target(i)
        except BaseException as e:  # noqa: BLE001 - collected and asserted on
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "deadlock: a thread did not finish"
    return errors


def test_same_objects_from_eight_threads() -> None:
    np = need("numpy")
    torch = need("torch")
    a = np.arange(64, dtype=np.float32)
    x = torch.arange(64, dtype=torch.float32)
    shared = dlbridge.from_dlpack(a)
    b = bytearray(64)

    def work(i: int) -> None:
        for _ in range(2000):
            t = dlbridge.from_dlpack(a)
            assert t.data_ptr == a.ctypes.data
            assert np.from_dlpack(shared).ctypes.data == a.ctypes.data
            assert torch.from_dlpack(shared).data_ptr() == a.ctypes.data
            assert dlbridge.from_dlpack(x).data_ptr == x.data_ptr()
            shared.__dlpack__(max_version=(1, 3))  # unconsumed
            assert dlbridge.asdlpack(b).size == 64

    assert run_threads(work) == []


def test_one_capsule_raced_by_eight_threads_is_consumed_exactly_once() -> None:
    for _ in range(20):
        fake = FakeCapsule()
        wins: list[dlbridge.Tensor] = []
        lock = threading.Lock()

        def take(i: int) -> None:
            try:
                t = dlbridge.from_dlpack(fake.capsule)
            except ValueError as e:
                assert "already consumed" in str(e)
                return
            with lock:
                wins.append(t)

        assert run_threads(take) == []
        assert len(wins) == 1
        assert fake.deleted == 0
        wins.clear()
        gc.collect()
        assert fake.deleted == 1


@pytest.mark.hooks
def test_drops_on_native_threads_from_many_python_threads() -> None:
    np = need("numpy")
    torch = need("torch")
    arrays = [np.arange(10.0) for _ in range(THREADS)]
    tensors = [torch.arange(10.0) for _ in range(THREADS)]
    refs = [weakref.ref(o) for o in arrays + tensors]

    def work(i: int) -> None:
        for _ in range(50):
            dlbridge._dlbridge._drop_on_native_thread(arrays[i])
            dlbridge._dlbridge._drop_on_native_thread(tensors[i])

    assert run_threads(work) == []
    del arrays, tensors
    gc.collect()
    assert all(r() is None for r in refs), "every producer's deleter ran"


def test_exit_with_tensors_capsules_and_threads_alive() -> None:
    need("numpy")
    need("torch")
    code = """
import threading, numpy as np, torch, dlbridge
a = np.arange(10.0); x = torch.arange(10.0)
keep = [dlbridge.from_dlpack(a), dlbridge.from_dlpack(x), dlbridge.asdlpack(bytearray(8))]
caps = [keep[0].__dlpack__(), keep[1].__dlpack__(max_version=(1, 3))]
def spin():
    while True:
        dlbridge.from_dlpack(a)
threading.Thread(target=spin, daemon=True).start()
print("bye", flush=True)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "bye"), r.stderr[-2000:]


FORK_WHILE_DROPPING = """
import os, time
import numpy as np
import dlbridge

stop = False

a = np.ones(4)
hung = 0
for i in range(FORKS):
    # A native thread without the GIL drops 100000 imported tensors, queueing each release under the
    # deferred-release lock, while this thread forks.
    dlbridge._dlbridge._drop_many_on_native_thread(a, 100_000)
    pid = os.fork()
    if pid == 0:
        # The child queues a release of its own (takes the queue's lock), drains the queue at an
        # entry point and views memory (takes the borrow registry's lock).
        dlbridge._dlbridge._drop_on_native_thread(a)
        dlbridge.asdlpack(b"x")
        dlbridge._dlbridge._view_add(np.zeros(2), 1.0)
        os._exit(0)
    # A healthy child takes milliseconds; a deadlocked one never ends (one child ran past 20 s).
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert status == 0, status
            break
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.001)
print("hung", hung)
"""


@pytest.mark.hooks
def test_a_child_forked_while_native_threads_drop_tensors_does_not_hang() -> None:
    # A forked child inherited the deferred-release queue's lock held by a native thread that was
    # queueing a release at that moment, and hung at its first use of it (4 forks in 100 here
    # without the fork handlers; 50 forks miss that with odds of about 1 in 8 per interpreter, and
    # make test runs this on six). And with them, while they were installed at the lock's first
    # use: the native thread's first drop installed them during the first fork (glibc runs only
    # the handlers registered when the fork began), so that child could still inherit the lock
    # held (about 1 fresh interpreter in 20, more with release builds; the Rust test
    # `the_handlers_are_installed_at_load_before_any_lock_is_used` pins the cause). They are
    # installed when the library loads now.
    need("numpy")
    code = FORK_WHILE_DROPPING.replace("FORKS", "50")
    out = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["hung", "0"], out.stdout + out.stderr[-2000:]
