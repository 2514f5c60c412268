"""A producer's deleter never runs on a thread without the GIL (issue 20): a kernel that drops a
`ManagedTensor` on a scoped worker while its caller holds the GIL and joins the worker (what rayon
code that forgets `py.detach` does) deadlocked when the producer's deleter took the GIL (torch's
does, and so does any deleter written in Python through ctypes). The deleter is now queued and run
by the next GIL holder; these tests also check it runs promptly, not at some far-off call.

Each case runs in a child process with a timeout, so a regression fails instead of hanging."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from .libs import need

hooks = pytest.mark.hooks

# Every case: make `x` (and `deleted()`, which says whether the producer's deleter has run, or None
# where the producer gives no way to see it), drop it on a worker, then check promptness.
_CHILD = """
import sys, dlbridge
{make}
dlbridge._dlbridge._drop_on_worker(x)
print("returned", flush=True)
# The deleter was queued on the worker; the interpreter runs it at its next check (a few
# bytecodes), so a short loop is all it may take.
for _ in range(100):
    pass
d = deleted()
assert d in (None, True), d
print("ok", d)
"""

_CASES = {
    "torch": ("torch", """
import torch
t = torch.arange(5.0)
x = t
def deleted():
    return t._use_count() == 1  # the export's reference to the tensor was released
"""),
    "jax": ("jax", """
import jax.numpy as jnp
x = jnp.arange(5.0)
def deleted():
    return None
"""),
    "tensorflow": ("tensorflow", """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
x = tf.range(5.0)
def deleted():
    return None
"""),
    "legacy capsule": (None, """
from dlbridge.tests._dlpack_ctypes import FakeCapsule
fake = FakeCapsule(versioned=False)  # its deleter is a ctypes callback: it takes the GIL
x = fake.capsule
def deleted():
    return fake.deleted == 1
"""),
    "versioned capsule": (None, """
from dlbridge.tests._dlpack_ctypes import FakeCapsule
fake = FakeCapsule(versioned=True)
x = fake
def deleted():
    return fake.deleted == 1
"""),
}


@hooks
@pytest.mark.parametrize("case", list(_CASES))
def test_a_producer_deleter_dropped_on_a_worker_neither_deadlocks_nor_lingers(case: str) -> None:
    lib, make = _CASES[case]
    if lib is not None:
        need(lib)
    if not hasattr(__import__("dlbridge")._dlbridge, "_drop_on_worker"):
        pytest.skip("needs the test hooks (make test builds them)")
    code = _CHILD.format(make=textwrap.dedent(make))
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{case}: the drop on a worker deadlocked (stdout so far: {e.stdout!r})")
    assert r.returncode == 0, f"{case}: {r.stdout}\n{r.stderr}"
    lines = r.stdout.split("\n")
    assert "returned" in lines, r.stdout
    ok = [ln for ln in lines if ln.startswith("ok ")]
    assert ok, r.stdout
    if lib in ("torch", None):
        # Where the deleter can be seen, it ran before the loop was over.
        assert ok[0] == "ok True", r.stdout


@hooks
def test_a_deferred_deleter_runs_at_the_next_entry_point_too() -> None:
    # Another thread that holds the GIL and calls into dlbridge releases what a worker queued,
    # whichever thread that is (the pending call itself runs only on the main thread).
    code = textwrap.dedent(
        """
        import threading, dlbridge
        from dlbridge.tests._dlpack_ctypes import FakeCapsule
        fake = FakeCapsule(versioned=True)
        seen = []
        def worker():
            dlbridge._dlbridge._drop_on_worker(fake)
            dlbridge.asdlpack(b"x")  # an entry point on this (non-main) thread drains the queue
            seen.append(fake.deleted)
        th = threading.Thread(target=worker)
        th.start(); th.join()
        assert seen == [1], seen
        print("ok")
        """
    )
    if not hasattr(__import__("dlbridge")._dlbridge, "_drop_on_worker"):
        pytest.skip("needs the test hooks (make test builds them)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


# A tensor handed to a framework through its exchange table is the framework's: it frees it where
# it chooses (torch frees a tensor with the GIL released), and the producer's deleter runs there, as
# it would after the framework's own `from_dlpack` of that producer, with nothing queued.
_HANDED_BACK = """
import torch, dlbridge
from dlbridge.tests._dlpack_ctypes import FakeCapsule
hook = dlbridge._dlbridge._wrap_like
like = torch.zeros(1)
# torch's own export, back to torch: torch's deleter runs as the new tensor is freed.
x = torch.arange(4.0)
y = hook(like, x)
assert type(y) is torch.Tensor and y.data_ptr() == x.data_ptr(), y
y[0] = 7.0
assert x[0].item() == 7.0
assert x._use_count() == 2, x._use_count()
del y
n = x._use_count()
assert n == 1, ("torch's deleter did not run as torch freed the tensor", n)
# A deleter that takes the GIL (ctypes), run by torch on the thread that frees the tensor.
fake = FakeCapsule(versioned=True)
y = hook(like, fake)
assert fake.deleted == 0
del y
assert fake.deleted == 1, fake.deleted
print("ok")
"""


@hooks
def test_a_tensor_handed_back_to_torch_is_freed_where_torch_frees_it() -> None:
    need("torch")
    if not hasattr(__import__("dlbridge")._dlbridge, "_wrap_like"):
        pytest.skip("needs the test hooks (make test builds them)")
    try:
        r = subprocess.run([sys.executable, "-c", _HANDED_BACK], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"freeing a tensor handed back to torch deadlocked (stdout so far: {e.stdout!r})")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
