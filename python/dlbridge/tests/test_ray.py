"""Ray (a local cluster, `ray.init(num_cpus=2)`): a Tensor passed to a task or an actor arrives
zero-copy from the object store (read-only, inside the store's memory, where Ray's own numpy
arrays arrive), a shared Tensor maps the same memory in the worker (a write there is seen by the
driver), and torch and jax read them in place in the worker.

Ray is a test dependency of the main virtualenv only; elsewhere these tests skip. Every `ray.get`
is bounded (a hung worker fails the test instead of hanging the suite).
"""

from __future__ import annotations

import sys
import warnings

import pytest

import dlbridge

from .libs import have, need

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="shared tensors are Linux memfds"),
]

WAIT = 300  # seconds: the most any ray.get waits (never a pass/fail bound on speed)


@pytest.fixture(scope="module")
def ray():
    import shutil
    import tempfile

    ray = need("ray")
    need("numpy")
    # Ray's own temp dir is /tmp/ray, which shadows the library as a namespace package for any
    # Python started in /tmp without Ray installed: keep the session's files in a dir of our own.
    tmp = tempfile.mkdtemp(prefix="dlbridge-ray-")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
    for w in seen:
        # jax, once imported (by earlier tests), warns on every fork, and Ray starts its processes
        # with subprocess (a fork, then exec): that is the only warning starting Ray may give.
        assert issubclass(w.category, RuntimeWarning) and "JAX is multithreaded" in str(w.message), w
        assert "jax" in sys.modules, w
    yield ray
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def region(addr: int) -> tuple[int, int, str]:
    """The mapping of this process that holds `addr`: (start, end, path)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return lo, hi, parts[5] if len(parts) >= 6 else ""
    raise AssertionError(f"{addr:#x} is not mapped")


def inspect(t: dlbridge.Tensor, a) -> dict:
    """What a worker sees of a Tensor and of a numpy array that came with it."""
    import numpy as np

    out = {
        "readonly": t.readonly,
        "shape": t.shape,
        "dtype": str(t.dtype),
        "same_region_as_numpy": region(t.data_ptr) == region(a.ctypes.data),
        "numpy_readonly": not a.flags.writeable,
        "numpy_in_place": np.from_dlpack(t).ctypes.data == t.data_ptr,
        "first": float(np.from_dlpack(t)[0]),
    }
    if have("torch"):
        import torch

        out["torch_in_place"] = torch.from_dlpack(t).data_ptr() == t.data_ptr
    return out


def write_shared(t: dlbridge.Tensor) -> dict:
    """Writes 9.0 at index 1 of a shared tensor, and reads it in place through torch and jax."""
    import numpy as np

    np.from_dlpack(t)[1] = 9.0
    out = {"readonly": t.readonly, "first": float(np.from_dlpack(t)[0])}
    if have("torch"):
        import torch

        out["torch_in_place"] = torch.from_dlpack(t).data_ptr() == t.data_ptr
    if have("jax"):
        import jax

        out["jax_in_place"] = jax.numpy.from_dlpack(t).unsafe_buffer_pointer() == t.data_ptr
    return out


def make_tensor(n: int) -> dlbridge.Tensor:
    import numpy as np

    return dlbridge.asdlpack(np.arange(n, dtype=np.float32))


def test_a_tensor_arrives_zero_copy_from_the_object_store(ray):
    np = need("numpy")
    t = dlbridge.asdlpack(np.arange(1 << 20, dtype=np.float32) + 1)
    a = np.zeros(1 << 20)
    out = ray.get(ray.remote(inspect).remote(t, a), timeout=WAIT)
    assert out["readonly"] and out["numpy_readonly"]
    assert out["same_region_as_numpy"]  # inside the object store, where Ray's numpy arrays are
    assert out["numpy_in_place"] and out["first"] == 1.0
    assert out.get("torch_in_place", True)
    assert out["shape"] == (1 << 20,) and out["dtype"] == "float32"


def test_a_tensor_through_an_actor(ray):
    np = need("numpy")

    @ray.remote
    class Holder:
        def look(self, t, a):
            return inspect(t, a)

    h = Holder.remote()
    t = dlbridge.asdlpack(np.full(1 << 18, 2.0))
    out = ray.get(h.look.remote(t, np.zeros(1 << 18)), timeout=WAIT)
    assert out["readonly"] and out["same_region_as_numpy"] and out["first"] == 2.0
    ray.kill(h)


def test_ray_get_of_a_tensor_made_in_a_task(ray):
    np = need("numpy")
    u = ray.get(ray.remote(make_tensor).remote(1 << 20), timeout=WAIT)
    assert isinstance(u, dlbridge.Tensor) and u.readonly and u.shape == (1 << 20,)
    ref = np.zeros(1 << 20, dtype=np.float32) + 3
    r = ray.put(ref)
    b = ray.get(r, timeout=WAIT)
    store = region(b.ctypes.data)[2]
    assert store, "numpy's array is in a named mapping (Ray's store)"
    assert region(u.data_ptr)[2] == store  # the store, as numpy's
    assert np.from_dlpack(u)[5] == 5.0


def test_a_shared_tensor_maps_the_same_memory_in_a_task(ray):
    np = need("numpy")
    t = dlbridge.shared_empty(1 << 20, "float32")
    np.from_dlpack(t)[0] = 4.0
    out = ray.get(ray.remote(write_shared).remote(t), timeout=WAIT)
    assert out["first"] == 4.0 and not out["readonly"]
    assert np.from_dlpack(t)[1] == 9.0  # the worker's write, seen by the driver
    assert out.get("torch_in_place", True) and out.get("jax_in_place", True)
    # Through ray.put too: the object store holds only the handle.
    out = ray.get(ray.remote(write_shared).remote(ray.put(t)), timeout=WAIT)
    assert out["first"] == 4.0


def make_shared(n: int) -> dlbridge.Tensor:
    """A shared tensor made in the worker (0, 1, 2, ...), returned: the worker drops it."""
    import numpy as np

    t = dlbridge.shared_empty(n, "float32")
    np.from_dlpack(t)[:] = np.arange(n, dtype=np.float32)
    return t


def sum_and_write(t: dlbridge.Tensor) -> float:
    import numpy as np

    a = np.from_dlpack(t)
    a[0] = 5.0
    return float(a.sum())


def test_a_task_returns_a_shared_tensor(ray):
    """The worker drops the tensor once Ray has pickled it; its pin keeps the memory until the
    driver has unpickled it (before, a stale handle: ray.get raised)."""
    np = need("numpy")
    u = ray.get(ray.remote(make_shared).remote(1000), timeout=WAIT)
    assert isinstance(u, dlbridge.Tensor) and not u.readonly
    assert np.from_dlpack(u).tolist() == list(range(1000))
    assert region(u.data_ptr)[2].startswith("/memfd:dlbridge-shm")  # shared memory, not the store
    np.from_dlpack(u)[0] = 7.0


def test_a_temporary_shared_tensor_as_a_task_argument(ray):
    """`f.remote(shared_empty(...))`: the driver drops the temporary once the argument is pickled;
    the pin keeps it until the worker has it (before, the task raised)."""
    import gc

    need("numpy")
    f = ray.remote(sum_and_write)
    assert ray.get(f.remote(dlbridge.shared_empty(10, "float32")), timeout=WAIT) == 5.0
    # Dropped for sure before the task is even submitted: a ray.put of a temporary.
    ref = ray.put(dlbridge.shared_empty(10, "float32"))
    gc.collect()
    assert ray.get(f.remote(ref), timeout=WAIT) == 5.0


@pytest.fixture
def exited_worker_result(ray):
    """A shared tensor an actor returned, whose actor has exited before the driver reads it."""
    import os
    import time

    @ray.remote
    class Maker:
        def make(self):
            return os.getpid(), make_shared(4)

    m = Maker.remote()
    ref = m.make.remote()
    ready, _ = ray.wait([ref], timeout=WAIT)
    assert ready
    pid = ray.get(m.make.remote(), timeout=WAIT)[0]  # the actor's pid (this result is read here)
    ray.kill(m)
    deadline = time.monotonic() + WAIT
    while os.path.exists(f"/proc/{pid}/fd") and time.monotonic() < deadline:
        time.sleep(0.05)
    return ref, pid


def test_a_shared_tensor_from_an_exited_worker_is_a_clear_error(ray, exited_worker_result):
    """The memory cannot reach the driver once the process that pickled it has exited: the error
    says so and says what to do (never a hang, never someone else's memory)."""
    ref, pid = exited_worker_result
    with pytest.raises(Exception) as e:
        ray.get(ref, timeout=WAIT)
    msg = str(e.value)
    assert f"stale handle: process {pid}, which pickled the tensor, has exited" in msg, msg
    assert "keep the sending process" in msg and "copy=True" in msg, msg
