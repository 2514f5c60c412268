"""Soundness of dlbridge's safe Rust API as Python reaches it (issue 12): each test is the
regression test of a defect reproduced on b6eae83. The hooks are Rust functions with the shapes
an extension author writes (a view argument, two views of one array, a drop on a worker thread)."""

from __future__ import annotations

import gc
import mmap
import subprocess
import sys
import textwrap

import pytest

import dlbridge

from .libs import Delegate, need

hooks = pytest.mark.hooks


def _second_extension():
    """The example extension (examples/scale), a second module embedding its own copy of dlbridge:
    what the cross-extension tests need. `make test` installs it; elsewhere they skip."""
    return pytest.importorskip("dlbridge_scale", reason="needs examples/scale installed (make test does)")


def _churn_the_stack(depth: int = 300) -> int:
    """Deep C recursion (repr of a nested list) with large live values: overwrites the C stack
    slots a dead `Py_buffer` used (Python-to-Python calls no longer recurse on the C stack)."""
    nested: list = []
    for _ in range(depth):
        nested = [nested, 12345678901234567890]
    return len(repr(nested))


@hooks
@pytest.mark.parametrize("make", [lambda: b"abc", lambda: bytearray(b"abc"), lambda: memoryview(b"abc")])
def test_a_view_of_a_fill_info_exporter_keeps_its_shape(make) -> None:
    # bytes / bytearray point the buffer's shape at its own `len` field: the view used to copy the
    # Py_buffer off the stack, so shape() read a dead slot once the stack was reused (on b6eae83
    # this churn made a 3-byte bytes object report shape [7984]).
    obj = make()
    seen = dlbridge._dlbridge._view_then(obj, _churn_the_stack)
    assert seen[1:] == ([3], [1], "uint8", not isinstance(obj, bytearray))


@hooks
def test_a_view_of_mmap_keeps_its_shape() -> None:
    m = mmap.mmap(-1, 5)
    m.write(b"hello")
    seen = dlbridge._dlbridge._view_then(m, _churn_the_stack)
    assert seen[1:4] == ([5], [1], "uint8")
    del seen
    m.close()  # the view's export was released: closing works


@hooks
def test_the_same_array_twice_cannot_be_written_while_read() -> None:
    np = need("numpy")
    a = np.zeros(4)
    msg = dlbridge._dlbridge._view_twice(a, a, 1.0)
    assert "already borrowed" in msg and a.tolist() == [0.0] * 4
    # Overlapping slices of one buffer conflict too; disjoint arrays do not.
    assert "already borrowed" in dlbridge._dlbridge._view_twice(a[1:], a[:2], 1.0)
    b = np.zeros(4)
    assert dlbridge._dlbridge._view_twice(a, b, 2.0) == "written" and b.tolist() == [2.0] * 4
    # Through torch's exchange table and a dlbridge.Tensor, the same memory is the same memory.
    t = dlbridge.asdlpack(a)
    assert "already borrowed" in dlbridge._dlbridge._view_twice(t, a, 1.0)


def test_overlapping_strides_refuse_mutable_access() -> None:
    np = need("numpy")
    dlbridge_scale = _second_extension()

    base = np.zeros(3)
    o = np.lib.stride_tricks.as_strided(base, (2, 2), (8, 8), writeable=True)
    assert o.flags.writeable
    with pytest.raises(TypeError, match="do not overlap"):
        dlbridge_scale.fill(o, 1.0)
    with pytest.raises(TypeError, match="do not overlap"):
        dlbridge_scale.scale(o, 2.0)
    assert base.tolist() == [0.0, 0.0, 0.0]
    # A disjoint strided layout is written.
    d = np.zeros((3, 4))[:, ::2]
    dlbridge_scale.fill(d, 1.0)
    assert d.tolist() == [[1.0, 1.0]] * 3


def test_no_extension_writes_what_another_is_reading() -> None:
    np = need("numpy")
    dlbridge_scale = _second_extension()

    a = np.zeros(4)
    # The same extension...
    with pytest.raises(BufferError, match="already borrowed"):
        dlbridge_scale.while_reading(a, lambda: dlbridge_scale.fill(a, 1.0))
    # ...and, through the process-wide registry, another extension embedding dlbridge.
    if hasattr(dlbridge._dlbridge, "_view_add"):
        with pytest.raises(BufferError, match="already borrowed"):
            dlbridge_scale.while_reading(a, lambda: dlbridge._dlbridge._view_add(a, 1.0))
    assert a.tolist() == [0.0] * 4
    # Once the reader is done, writes go through.
    dlbridge_scale.fill(a, 3.0)
    assert a.tolist() == [3.0] * 4
    assert dlbridge_scale.while_reading(a, lambda: 7) == 7


SYS_ATTACK = """
import sys
import numpy as np
import dlbridge
dlbridge.asdlpack(b"x")  # dlbridge's module has run an entry point
ATTACK
import dlbridge_scale   # a second copy of the crate, first run after the attack
a = np.zeros(4)
try:
    dlbridge_scale.while_reading(a, lambda: dlbridge._dlbridge._view_add(a, 1.0))
except BufferError as e:
    assert "already borrowed" in str(e), e
    print("refused", a.tolist())
else:
    print("written", a.tolist())
"""


@hooks
@pytest.mark.parametrize(
    "attack",
    [
        "sys._dlbridge_borrow_registry_v1 = object()",
        "sys.__dict__.pop('_dlbridge_borrow_registry_v1', None)",
        "import types; sys._dlbridge_borrow_registry_v1 = types.SimpleNamespace()",
    ],
)
def test_no_write_lands_under_another_copys_slice_whatever_user_code_does_to_sys(attack: str) -> None:
    # The copies of the crate used to find one registry through a capsule on `sys`: replacing or
    # deleting it before a second copy's first run split the registry, and extension A wrote under
    # a live slice of extension B. The registry is found through the loaded objects now.
    need("numpy")
    _second_extension()
    out = subprocess.run(
        [sys.executable, "-c", SYS_ATTACK.replace("ATTACK", attack)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "refused [0.0, 0.0, 0.0, 0.0]", out.stdout + out.stderr[-2000:]


TWO_COPIES = """
import importlib.machinery, importlib.util, shutil, sys, tempfile, os
import dlbridge

# A second copy of the crate in this process: dlbridge's own extension loaded again from another
# path (its own statics, as any extension embedding the crate has).
import numpy as np
x = np.zeros(8)
dlbridge._dlbridge._view_add(x, 0.0)  # the first copy has found its registry
d = tempfile.mkdtemp()
path = os.path.join(d, "_dlbridge.so")
shutil.copy(dlbridge._dlbridge.__file__, path)
flags = sys.getdlopenflags()
sys.setdlopenflags(FLAGS)
loader = importlib.machinery.ExtensionFileLoader("_dlbridge", path)
spec = importlib.util.spec_from_file_location("_dlbridge", path, loader=loader)
copy = importlib.util.module_from_spec(spec)
loader.exec_module(copy)
sys.setdlopenflags(flags)
assert copy is not dlbridge._dlbridge

t = dlbridge.shared_empty((4,), "float64")
rebuild, args = t.__reduce_ex__(5)
assert rebuild is dlbridge._dlbridge._rebuild_shared, rebuild
t2 = copy._rebuild_shared(*args)  # the other copy maps the handle
print("same", t2.data_ptr == t.data_ptr)
print(dlbridge._dlbridge._view_twice(t, t2, 1.0))
print(copy._view_twice(t2, t, 1.0))
"""


@hooks
@pytest.mark.parametrize("flags", ["os.RTLD_NOW", "os.RTLD_GLOBAL | os.RTLD_NOW"])
def test_two_copies_of_the_crate_map_one_segment_once(flags: str) -> None:
    # Each copy of the crate kept its own list of live segments, so a second copy rebuilding a
    # handle of the first mapped the memfd again, at another address: the borrow registry, keyed
    # by address, then let a mutable slice of one mapping coexist with a shared one of the other.
    # A second copy loaded RTLD_GLOBAL answered the lookup of the main program's handle (dlsym
    # there searches the global scope) and split the registries (review).
    need("numpy")
    if not hasattr(dlbridge, "shared_empty"):
        pytest.skip("shared tensors need Linux")
    code = TWO_COPIES.replace("FLAGS", flags)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "same True", out.stdout
    assert "already borrowed" in lines[1] and "already borrowed" in lines[2], out.stdout


def test_read_only_survives_a_second_extension() -> None:
    # Extension B (dlbridge_scale) views extension A's (dlbridge._dlbridge) read-only Tensor
    # through A's exchange table, whose borrowed function cannot carry READ_ONLY: B used to write
    # into an immutable bytes object.
    dlbridge_scale = _second_extension()

    raw = bytes(24)
    t = dlbridge.asdlpack(memoryview(raw).cast("d"))
    assert t.readonly
    with pytest.raises(TypeError, match="writable"):
        dlbridge_scale.fill(t, 1.0)
    assert raw == bytes(24)
    assert dlbridge_scale.total(t) == 0.0  # reading is fine


@hooks
def test_a_drop_never_waits_for_the_gil() -> None:
    # A scoped worker drops the last reference while this thread holds the GIL and joins it: a
    # deleter that took the GIL deadlocked. Run in a child with a timeout, so a regression fails.
    need("numpy")
    code = textwrap.dedent(
        """
        import sys, numpy as np, dlbridge
        a = np.ones(3)
        before = sys.getrefcount(a)
        dlbridge._dlbridge._drop_while_caller_holds_the_gil(a)
        dlbridge.asdlpack(b"x")  # any entry point releases what the worker queued
        assert sys.getrefcount(a) == before, (sys.getrefcount(a), before)
        ba = bytearray(4)
        dlbridge._dlbridge._drop_while_caller_holds_the_gil(ba)
        dlbridge.asdlpack(b"x")
        ba.append(1)  # the buffer export was released: the bytearray can resize again
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_an_integer_exchange_table_is_never_dereferenced() -> None:
    # DLPack 1.2's integer form: any class can hold any integer there. dlbridge used to read the
    # address; now it takes the protocol path (or says the object speaks no DLPack).
    np = need("numpy")

    class Liar(Delegate):
        __c_dlpack_exchange_api__ = 0x1000  # aligned, unmapped

    a = np.arange(3.0)
    t = dlbridge.from_dlpack(Liar(a))
    assert t.data_ptr == a.ctypes.data

    class OnlyTheInteger:
        __c_dlpack_exchange_api__ = 0x1000

    with pytest.raises(TypeError):
        dlbridge.from_dlpack(OnlyTheInteger())
    gc.collect()


def test_test_hooks_are_absent_without_the_feature() -> None:
    # What `make test` checks on a build without the feature (see the Makefile's `hooks-absent`):
    # here, only that the shipped stubs do not declare them.
    import pathlib

    stubs = pathlib.Path(dlbridge.__file__).with_name("_dlbridge.pyi").read_text()
    for name in ("_HostileBuffer", "_view", "_drop_on_native_thread", "_numpy_fast_path"):
        assert f"def {name}(" not in stubs and f"class {name}" not in stubs, name
