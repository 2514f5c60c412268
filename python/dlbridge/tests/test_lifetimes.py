"""Lifetimes: whichever side goes first, the data lives exactly as long as someone refers to it,
and round trips leave no memory behind."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

import dlbridge

from .libs import assert_no_growth, need


@pytest.fixture
def np():
    return need("numpy")


def test_source_deleted_first(np) -> None:
    a = np.arange(1000.0)
    gone = weakref.ref(a)
    t = dlbridge.from_dlpack(a)
    del a
    gc.collect()
    assert gone() is not None, "the source stays alive while the Tensor needs its data"
    assert np.from_dlpack(t)[999] == 999.0
    del t
    gc.collect()
    assert gone() is None, "the producer's deleter ran: the source was released"


def test_tensor_deleted_first(np) -> None:
    a = np.arange(10.0)
    gone = weakref.ref(a)
    t = dlbridge.from_dlpack(a)
    b = np.from_dlpack(t)
    del t, a
    gc.collect()
    assert gone() is not None and b[9] == 9.0
    del b
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("max_version", [None, (1, 3)])
def test_unconsumed_capsules_free_only_themselves(np, max_version) -> None:
    a = np.arange(10.0)
    gone = weakref.ref(a)
    t = dlbridge.from_dlpack(a)
    del a
    for _ in range(3):
        t.__dlpack__(max_version=max_version)  # dropped unconsumed
    assert gone() is not None and np.from_dlpack(t)[3] == 3.0
    del t
    gc.collect()
    assert gone() is None


def test_buffer_view_released_when_numpy_drops_the_last_array(np) -> None:
    # The buffer view is released inside numpy's deallocation, on the thread that holds the GIL
    # (the direct path, without PyGILState_Ensure): the bytearray can resize again afterwards.
    ba = bytearray(b"abcdefgh")
    b = np.from_dlpack(dlbridge.asdlpack(ba))
    with pytest.raises(BufferError):
        ba.append(1)  # exported: resizing is refused while the view is held
    assert bytes(b[:3]) == b"abc"
    del b
    ba.append(1)  # released: no BufferError
    assert len(ba) == 9


@pytest.mark.hooks
def test_deleter_runs_when_dropped_on_a_native_thread(np) -> None:
    a = np.arange(10.0)
    gone = weakref.ref(a)
    dlbridge._dlbridge._drop_on_native_thread(a)
    del a
    gc.collect()
    assert gone() is None


@pytest.mark.hooks
def test_torch_deleter_on_a_native_thread() -> None:
    torch = need("torch")
    x = torch.arange(10.0)
    gone = weakref.ref(x)
    dlbridge._dlbridge._drop_on_native_thread(x)
    del x
    gc.collect()
    assert gone() is None


def test_100k_round_trips_do_not_grow_memory(np) -> None:
    a = np.arange(100, dtype=np.float32)
    torch = need("torch")
    x = torch.arange(100, dtype=torch.float32)

    def once() -> None:
        t = dlbridge.from_dlpack(a)
        np.from_dlpack(t)
        t.__dlpack__(max_version=(1, 3))  # unconsumed
        torch.from_dlpack(dlbridge.from_dlpack(x))

    assert_no_growth(once)


def test_live_tensors_and_capsules_at_interpreter_exit(np) -> None:
    code = """
import numpy as np, dlbridge
a = np.arange(10.0)
t = dlbridge.from_dlpack(a)
caps = [t.__dlpack__(), t.__dlpack__(max_version=(1, 3))]
keep = np.from_dlpack(t)
import atexit
atexit.register(lambda: dlbridge.from_dlpack(t))
print("bye")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "bye"), r.stderr
