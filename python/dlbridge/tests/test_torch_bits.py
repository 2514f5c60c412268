"""torch's negative and conjugate bits read through ATen's native kernels (issue 20: the methods'
generated bindings release and retake the GIL, most of a torch import's cost). The kernels are used
only after they agree with the methods on probe tensors; these tests check that every path still
refuses exactly the tensors whose memory holds other values than they show, whichever source
answered, and that the cheap source is the one in use where torch allows it."""

from __future__ import annotations

import os

import pytest

import dlbridge

from .libs import need

hooks = pytest.mark.hooks


def _kinds(torch):
    """(name, tensor) over the ways a bit comes and goes: views, detach, .data, slices, dtypes."""
    z = torch.arange(6.0).reshape(2, 3)
    c = torch.complex(torch.arange(4.0), torch.ones(4))
    neg = torch._neg_view(z)
    out = {
        "plain": z,
        "neg view": neg,
        "neg detach": neg.detach(),
        "neg .data": neg.data,
        "neg slice": neg[:, 1:],
        "neg transposed": neg.t(),
        "neg resolved": neg.resolve_neg(),
        "conj": c.conj(),
        "conj resolved": c.conj().resolve_conj(),
        "conj imag (neg)": c.conj().imag,
        "conj real": c.conj().real,
        "neg of conj": torch._neg_view(c.conj()),
        "int64 neg": torch._neg_view(torch.arange(3)),
        "bfloat16": torch.zeros(3, dtype=torch.bfloat16),
        "0-d neg": torch._neg_view(torch.tensor(2.0)),
        "empty": torch.zeros(0, 2),
    }
    flipped = torch.arange(3.0)
    torch._C._set_neg(flipped, True)  # a live tensor's bit set in place: nothing may be cached
    out["set_neg in place"] = flipped
    return out


@pytest.mark.parametrize("path", ["from_dlpack", "view"])
def test_every_kind_is_refused_exactly_when_its_memory_differs(path: str) -> None:
    torch = need("torch")
    if path == "view" and not hasattr(dlbridge._dlbridge, "_view"):
        pytest.skip("needs the test hooks (make test builds them)")
    call = dlbridge.from_dlpack if path == "from_dlpack" else dlbridge._dlbridge._view
    for name, t in _kinds(torch).items():
        lazy = t.is_neg() or t.is_conj()
        if lazy:
            with pytest.raises(BufferError, match="resolve_neg|resolve_conj"):
                call(t)
        else:
            call(t)  # accepted
    t = torch.arange(3.0)
    call(t)
    torch._C._set_neg(t, True)
    with pytest.raises(BufferError, match="resolve_neg"):
        call(t)
    torch._C._set_neg(t, False)
    call(t)


@hooks
def test_the_bits_come_from_aten_for_torch_tensors() -> None:
    need("torch")
    # Verified once per process against the methods; where this torch allows it, used.
    assert dlbridge._dlbridge._torch_bits_from_aten() is True


def test_a_subclass_is_asked_through_its_methods() -> None:
    torch = need("torch")

    class Sub(torch.Tensor):
        pass

    s = torch._neg_view(torch.arange(3.0)).as_subclass(Sub)
    assert s.is_neg()
    with pytest.raises(BufferError, match="resolve_neg"):
        dlbridge.from_dlpack(s)
    dlbridge.from_dlpack(torch.arange(3.0).as_subclass(Sub))


@hooks
def test_a_duck_typed_tensor_seen_before_torch_is_imported_decides_nothing() -> None:
    # A type with torch's accessors (requires_grad, is_neg) imported before torch must not fix
    # the choice for the whole process: the kernels are looked for once torch is there.
    need("torch")
    need("numpy")
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys, numpy as np, dlbridge
        class Duck:
            requires_grad = False
            def is_neg(self): return False
            def is_conj(self): return False
            def __init__(self): self.a = np.arange(3.0)
            def __dlpack__(self, **kw): return self.a.__dlpack__(**kw)
            def __dlpack_device__(self): return self.a.__dlpack_device__()
        assert "torch" not in sys.modules
        dlbridge.from_dlpack(Duck())
        import torch
        assert dlbridge._dlbridge._torch_bits_from_aten() is True
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@hooks
def test_writes_go_through_aten_for_torch_tensors() -> None:
    torch = need("torch")
    torch.zeros(1)
    dlbridge.from_dlpack(torch.zeros(1))  # torch's functions are looked for once torch is seen
    assert dlbridge._dlbridge._torch_writes_from_aten() is True


class _Sub:  # made a torch.Tensor subclass lazily (torch may be absent)
    cls = None


def _subclass(torch):
    if _Sub.cls is None:
        _Sub.cls = type("Sub", (torch.Tensor,), {})
    return _Sub.cls


@hooks
@pytest.mark.parametrize("kind", ["tensor", "subclass"])
def test_a_write_bumps_the_version_once_through_either_path(kind: str) -> None:
    # Exactly torch.Tensor: ATen's bump_version; a subclass: torch._C._increment_version.
    torch = need("torch")
    w = torch.ones(4, dtype=torch.float64)
    if kind == "subclass":
        w = w.as_subclass(_subclass(torch))
    view = w[1:]
    v, vv = w._version, view._version
    dlbridge._dlbridge._typed_mut_probe(w)
    assert (w._version, view._version) == (v + 1, vv + 1)  # a view shares its base's counter
    dlbridge._dlbridge._typed_mut_probe(view)
    assert w._version == v + 2


@hooks
@pytest.mark.parametrize("kind", ["tensor", "subclass"])
def test_an_inference_tensor_is_written_only_in_inference_mode(kind: str) -> None:
    # torch refuses x.add_(1) on an inference tensor outside inference mode; so does every
    # mutable access (torch._C._increment_version alone would skip it silently).
    torch = need("torch")
    with torch.inference_mode():
        x, y = torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    if kind == "subclass":
        x = x.as_subclass(_subclass(torch))
    assert x.is_inference()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        y.add_(1.0)  # torch's own rule, for comparison (torch raises after writing; dlbridge before)
    with pytest.raises(TypeError, match="is_inference: an inference tensor .* outside inference mode"):
        dlbridge._dlbridge._typed_mut_probe(x)
    with pytest.raises(TypeError, match="is_inference: an inference tensor"):
        dlbridge._dlbridge._view_add(x, 1.0)
    assert x.tolist() == [1.0, 1.0, 1.0]
    with torch.inference_mode():
        dlbridge._dlbridge._typed_mut_probe(x)
        dlbridge._dlbridge._view_add(x, 1.0)
        x.add_(1.0)
    assert x.tolist() == [3.0, 3.0, 3.0]
    # Reading stays allowed anywhere, as torch allows it.
    assert dlbridge._dlbridge._view(x) is not None


@hooks
def test_grad_mode_is_read_per_thread() -> None:
    # torch's grad mode is thread-local: a worker thread starts with it on, whatever the caller's.
    torch = need("torch")
    import threading

    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    seen = []

    def worker() -> None:
        try:
            dlbridge._dlbridge._typed_mut_probe(w)
            seen.append("accepted")
        except BufferError as e:
            seen.append(str(e))

    with torch.no_grad():
        dlbridge._dlbridge._typed_mut_probe(w)  # allowed here
        th = threading.Thread(target=worker)
        th.start()
        th.join()
    assert len(seen) == 1 and "requires_grad: this tensor requires grad and grad mode is on" in seen[0], seen


def _child(code: str) -> str:
    """Runs `code` in a fresh interpreter (an abort there fails the test instead of the session)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


@hooks
@pytest.mark.parametrize("kind", ["tensor", "subclass"])
def test_a_tensor_holding_an_inference_tensor_as_data_is_refused_not_aborted(kind: str) -> None:
    # Its keys no longer say inference, but it has no version counter: torch's bump throws a C++
    # exception for it, which crossing into Rust would abort the process (the review found it).
    need("torch")
    out = _child(
        f"""
import torch, dlbridge
H = dlbridge._dlbridge
with torch.inference_mode():
    y = torch.zeros(3, dtype=torch.float64)
    if {kind!r} == "subclass":
        y = y.as_subclass(type("Sub", (torch.Tensor,), {{}}))
y.data = torch.ones(3, dtype=torch.float64)
assert not y.is_inference()
for f in (H._typed_mut_probe, H._typed_mut_of_view, lambda t: H._view_add(t, 1.0)):
    try:
        f(y)
        raise SystemExit("accepted")
    except TypeError as e:
        assert "is_inference: an inference tensor" in str(e), e
assert y.tolist() == [1.0, 1.0, 1.0]
with torch.inference_mode():
    H._typed_mut_probe(y)  # allowed there, nothing to bump
    H._view_add(y, 1.0)
assert y.tolist() == [2.0, 2.0, 2.0]
print("ok")
"""
    )
    assert out.strip() == "ok"


@hooks
def test_writes_are_verified_when_torch_is_first_seen_inside_inference_mode() -> None:
    # The probes are made outside inference mode whatever mode dlbridge first meets torch in (an
    # inference server), so the fast write path is not given up for the whole process.
    need("torch")
    out = _child(
        """
import torch, dlbridge
H = dlbridge._dlbridge
with torch.inference_mode():
    H._typed_mut_probe(torch.ones(4, dtype=torch.float64))
    assert torch.is_inference_mode_enabled()
print(H._torch_writes_from_aten(), torch.is_inference_mode_enabled(), torch.is_grad_enabled())
"""
    )
    assert out.split() == ["True", "False", "True"]


@hooks
def test_a_view_made_typed_for_writing_bumps_the_version_too() -> None:
    torch = need("torch")
    w = torch.ones(3, dtype=torch.float64)
    v = w._version
    dlbridge._dlbridge._typed_mut_of_view(w)
    assert w._version == v + 1
    g = torch.ones(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(BufferError, match="requires_grad: this tensor requires grad and grad mode is on"):
        dlbridge._dlbridge._typed_mut_of_view(g)
    f = torch.ones(3)
    v = f._version
    with pytest.raises(TypeError, match="expected writable float64 1-d C-contiguous"):
        dlbridge._dlbridge._typed_mut_of_view(f)
    assert f._version == v  # a mismatch bumps nothing


@hooks
def test_python_run_by_the_write_rules_cannot_leave_a_view_on_freed_memory() -> None:
    # torch's requires_grad getter calls an active TorchFunctionMode; one that replaces the
    # tensor's storage there (swap_tensors, set_, .data =) would leave a borrowed view pointing into
    # freed memory (the review's segfault). For exactly torch.Tensor the rules read requires_grad
    # through c10 now: no getter, no mode, nothing swapped. For a subclass the getter runs: a
    # view's mutable access reads the table's description again after the rules and refuses a
    # change, or the rules ran before the view was taken; either way the write lands in live
    # memory (the tensor's new storage), never in the freed one.
    need("torch")
    out = _child(
        """
import torch, dlbridge._dlbridge as D
from torch.overrides import TorchFunctionMode
class Sub(torch.Tensor):
    pass
D._typed_mut_probe(torch.zeros(3, dtype=torch.float64))
N = 1 << 16
class Swapper(TorchFunctionMode):
    armed = True
    target = None
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if Swapper.armed and getattr(func, "__name__", "") == "__get__" and args and args[0] is Swapper.target:
            Swapper.armed = False
            torch.utils.swap_tensors(Swapper.target, spare[0])
            spare.clear()  # the target's old storage is freed
        return func(*args, **(kwargs or {}))
for kind in (torch.Tensor, Sub):
    x = torch.zeros(N, dtype=torch.float64).as_subclass(kind)
    spare = [torch.zeros(N, dtype=torch.float64).as_subclass(kind)]
    Swapper.armed, Swapper.target = True, x
    with Swapper():
        try:
            D._view_add(x, 7.0)
            written = True
        except TypeError as e:
            assert "data: the tensor's memory was replaced" in str(e), e
            written = False
    # Exactly torch.Tensor: no Python ran in the rules. A subclass: the getter swapped.
    assert Swapper.armed == (kind is torch.Tensor), (kind, Swapper.armed)
    assert float(x.sum()) == (7.0 * N if written else 0.0), (kind, float(x.sum()))
    y = torch.zeros(N, dtype=torch.float64).as_subclass(kind)
    spare = [torch.zeros(N, dtype=torch.float64).as_subclass(kind)]
    Swapper.armed, Swapper.target = True, y
    with Swapper():
        v = y._version if kind is torch.Tensor else spare[0]._version
        D._typed_mut_probe(y)  # the rules ran (and swapped, for the subclass) before the view
    assert y._version == v + 1, (kind, y._version, v)  # y's tensor (the spare's, swapped in), bumped once
print("ok")
"""
    )
    assert out.strip() == "ok"


@hooks
def test_a_views_mutable_access_bumps_the_version() -> None:
    # Else a backward through a value saved before the write computes a wrong gradient silently.
    torch = need("torch")
    a = torch.ones(3, dtype=torch.float64, requires_grad=True)
    x = torch.ones(3, dtype=torch.float64)
    y = (a * x).sum()  # saves x
    v = x._version
    dlbridge._dlbridge._view_add(x, 100.0)
    assert x._version == v + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@hooks
def test_a_leaf_requiring_grad_is_written_inside_inference_mode_as_torch_allows() -> None:
    # Autograd records nothing there, even under enable_grad: torch's add_ accepts such a leaf.
    torch = need("torch")
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    with torch.inference_mode(), torch.enable_grad():
        assert torch.is_grad_enabled()
        dlbridge._dlbridge._typed_mut_probe(w)
        assert dlbridge._dlbridge._view(w)[0] == w.data_ptr()  # nothing for autograd to lose here
        w.add_(1.0)
    with pytest.raises(BufferError, match="requires_grad: this tensor requires grad and grad mode is on"):
        dlbridge._dlbridge._typed_mut_probe(w)


@hooks
def test_first_use_under_user_modes_runs_none_of_their_code_and_keeps_the_fast_path() -> None:
    # The one-time search's probes run with the caller's torch function and dispatch modes set
    # aside: a user's mode sees no probe operation, FakeTensorMode or make_fx do not turn the
    # probes into fake or traced tensors (which disabled the fast path for good).
    need("torch")
    out = _child(
        """
import torch, dlbridge._dlbridge as D
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
seen = []
class F(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))
class S(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return func(*args, **(kwargs or {}))
x = torch.zeros(3, dtype=torch.float64)
with F(), S():
    D._typed_mut_probe(x)
probe_ops = [s for s in seen if s not in ("__get__",)]
assert probe_ops == [], probe_ops
assert D._torch_writes_from_aten() and D._torch_bits_from_aten()
print("ok")
"""
    )
    assert out.strip() == "ok"


@hooks
def test_a_call_into_dlbridge_during_the_search_does_not_wait_for_itself() -> None:
    # The search runs Python (its probes); dlbridge called from there (here from a profile hook,
    # deterministically; a finalizer or another thread in real code) takes the slow path instead
    # of waiting for the search's own lock (it hung).
    need("torch")
    out = _child(
        """
import sys, torch, dlbridge._dlbridge as D
t = torch.ones(2, dtype=torch.float64)
calls = []
def hook(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "quiet" and not calls:
        calls.append(D._view(t))
sys.setprofile(hook)
D._typed_mut_probe(torch.zeros(3, dtype=torch.float64))
sys.setprofile(None)
assert len(calls) == 1, calls
print("ok", D._torch_writes_from_aten())
"""
    )
    assert out.strip() == "ok True"


@hooks
def test_writes_into_views_follow_torchs_in_place_check() -> None:
    # torch refuses an in-place write, in grad mode, into a view of a leaf that requires grad and
    # into a view it cannot rebase (a multi-output view, one made in a custom Function); it writes
    # a plain view of a non-leaf, and records that write in the graph. A plain function's write
    # would not be recorded (the gradient through it silently wrong), so in grad mode dlbridge
    # refuses every one of them when the view is taken, before writing; under torch.no_grad()
    # both write every one. (The write rules, TorchState::refuse_write, still answer as torch for a
    # view taken with grad mode off and written after it was turned on.)
    torch = need("torch")

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    def cases():
        a = torch.ones(4, dtype=torch.float64, requires_grad=True)
        b = a * 2
        p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
        return {
            "view of a leaf": a[1:],
            "Parameter view": p.view(-1),
            "unbind output": b.view(2, 2).unbind()[0],
            "split output": b.split(2)[0],
            "custom Function view": Identity.apply(b),
            "view of a non-leaf": b[1:],
            "non-leaf": b,
        }

    torch_refuses = {}
    for name, t in cases().items():
        try:
            t.add_(1.0)
            torch_refuses[name] = False
        except RuntimeError:
            torch_refuses[name] = True
    assert torch_refuses == {
        "view of a leaf": True, "Parameter view": True, "unbind output": True, "split output": True,
        "custom Function view": True, "view of a non-leaf": False, "non-leaf": False,
    }, torch_refuses
    for probe in (dlbridge._dlbridge._typed_mut_probe, dlbridge._dlbridge._typed_mut_of_view,
                  lambda t: dlbridge._dlbridge._view_add(t, 1.0)):
        for name, t in cases().items():
            before = t.detach().clone()
            with pytest.raises(BufferError, match="requires_grad: this tensor requires grad and grad mode is on"):
                probe(t)
            assert torch.equal(t.detach(), before), name  # refused before writing
    with torch.no_grad():  # torch writes every one of them there, and so does dlbridge
        for t in cases().values():
            dlbridge._dlbridge._typed_mut_probe(t)


@hooks
def test_a_tensor_cleared_by_the_gc_is_refused_not_aborted() -> None:
    # A finalizer of a cyclic collection can reach a torch.Tensor the GC has already cleared (its
    # cdata is the undefined tensor). ATen's functions throw a C++ exception on it, which crossing
    # into Rust aborts the process (the write rules are read before the view, which would refuse
    # it): they are never called on an undefined tensor.
    need("torch")
    out = _child(
        """
import gc, weakref, torch, dlbridge._dlbridge as D
D._typed_mut_probe(torch.zeros(3, dtype=torch.float64))
seen = []
class N:
    def __del__(self):
        t = self.wr()
        if t is None:
            return
        for f in (D._typed_mut_probe, D._view, D._typed_mut_of_view):
            try:
                f(t)
                seen.append("accepted")
            except BaseException as e:
                seen.append(type(e).__name__)
class B:
    def __del__(self):
        n = N(); n.wr = weakref.ref(self.t); self.n = n
def make():
    t = torch.zeros(3, dtype=torch.float64); t.me = t
    b = B(); b.n = None; b.t = t; b.me = b
make()
gc.collect()
print(seen)
"""
    )
    assert out.strip() in ("[]", "['BufferError', 'BufferError', 'BufferError']"), out


_STAND_IN = """
import sys, types, torch as real, dlbridge._dlbridge as D
# A pure-Python stand-in for sys.modules["torch"] whose Tensor has a slot where THPVariable keeps
# cdata, and whose probes agree with ATen's reads of the objects in that slot: the bytes objects
# are read as TensorImpls (all keys set, none set, or a version counter at an address the stand-in
# chose). Taken for torch's own, the search's bump writes through that address (SIGSEGV).
FF, ZERO = bytes([0xFF]) * 4096, bytes(4096)
WILD = (0x4141414141414140).to_bytes(8, "little") * 512
class FakeT:
    __slots__ = ("impl",)
    def __init__(self, impl): self.impl = impl
    @property
    def _cdata(self): return id(self.impl)
    def is_neg(self): return self.impl is FF
    def is_conj(self): return self.impl is FF
    def conj(self): return FakeT(FF)
    @property
    def imag(self): return FakeT(FF)
    def detach(self): return FakeT(self.impl)
    def __getitem__(self, k): return FakeT(self.impl)
    @property
    def _version(self):
        if self.impl is ZERO: raise RuntimeError("no counter")
        return 0
    @property
    def data(self): return self
    @data.setter
    def data(self, v): self.impl = ZERO
inference = [False]
class Inference:
    def __init__(self, on=True): self.on = on
    def __enter__(self): self.was, inference[0] = inference[0], self.on
    def __exit__(self, *a): inference[0] = self.was
fake = types.ModuleType("torch")
fake.__dict__.update(real.__dict__)
fake.Tensor, fake.inference_mode = FakeT, Inference
fake.arange = fake.ones = fake.complex = fake.zeros = (
    lambda *a, **k: FakeT(WILD if a == (4,) and not inference[0] else ZERO))
fake._neg_view = lambda t: FakeT(FF)
sys.modules["torch"] = fake
x = real.zeros(3, dtype=real.float64)
D._typed_mut_fill(x, 2.0)  # the first torch write: the one-time search runs now
assert x.tolist() == [2.0, 2.0, 2.0]
try:
    D._typed_mut_fill(FakeT(WILD), 1.0)
    raise SystemExit("the stand-in's object was accepted")
except TypeError:
    pass
print("ok", D._torch_bits_from_aten())
"""


@hooks
def test_a_stand_in_for_the_torch_module_is_never_taken_for_torch() -> None:
    # The type whose instances are read as THPVariables is torch's own (libtorch_python's
    # THPVariableClass, based on a type inside libtorch_python), never sys.modules["torch"].Tensor:
    # the stand-in's probes are not torch tensors, so the fast path stays off, and nothing is
    # written through the stand-in's pointer (SIGSEGV before).
    need("torch")
    assert _child(_STAND_IN).split() == ["ok", "False"]


# 64 MiB of float64: above glibc's largest mmap threshold, so freeing it unmaps it and a write
# there faults at once (a smaller block may stay mapped and hide the use after free).
_BIG = 1 << 23


@hooks
@pytest.mark.parametrize("kernel", ["TensorMut", "view"])
def test_torchs_python_version_bump_cannot_free_what_a_kernel_writes(kernel: str) -> None:
    # Where ATen's bump is not used (a subclass here; a torch whose functions were not verified
    # alike), torch._C._increment_version is called: Python, which may replace the storage (here
    # set_ frees it). The bump now runs before the view the kernel writes through is taken (a
    # TensorMut argument), or before the view is checked against the tensor (a view's mutable
    # access): the kernel wrote freed memory before (SIGSEGV).
    need("torch")
    out = _child(
        f"""
import torch, dlbridge._dlbridge as D
class Sub(torch.Tensor):
    pass
x = torch.zeros({_BIG}, dtype=torch.float64)
x.__class__ = Sub  # (as_subclass would leave a second owner of the storage behind)
bump = torch._C._increment_version
def swapping_bump(ts):
    for t in ts:
        if t.numel():
            t.set_(torch.zeros(0, dtype=torch.float64))  # x's storage is freed here
    return bump(ts)
torch._C._increment_version = swapping_bump
if {kernel!r} == "TensorMut":
    D._typed_mut_fill(x, 7.0)  # the view is taken after the bump: x is empty now
    print("ok", x.numel())
else:
    try:
        D._view_add(x, 7.0)
        raise SystemExit("accepted")
    except TypeError as e:
        assert "data: the tensor's memory was replaced" in str(e), e
    print("ok", x.numel())
"""
    )
    assert out.split() == ["ok", "0"]


@hooks
@pytest.mark.parametrize(
    "frees", ["set_", "resize_", "share_memory_", "untyped_storage().resize_(0)", "swap_tensors", "del"]
)
def test_python_a_kernel_runs_cannot_free_the_memory_under_its_slice(frees: str) -> None:
    # A kernel holding a slice of a borrowed torch view calls back into Python, which frees the
    # tensor's memory: set_ and swap_tensors give the tensor other memory and drop its storage;
    # resize_, share_memory_ and storage.resize_ give the same storage other memory. Holding the
    # tensor (or torch's own DLPack export) or its StorageImpl keeps none of it alive. The view keeps
    # the storage's DataPtr (the owner of the memory) valid until it is dropped, then the memory
    # is freed as torch would have (the kernel wrote freed memory before: SIGSEGV).
    need("torch")
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("reads /proc/self/maps")
    out = _child(
        f"""
import torch, dlbridge._dlbridge as D
def mapped(p):
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= p < hi:
                return True
    return False
N = {_BIG}
x = torch.ones(N, dtype=torch.float64)
p = x.data_ptr()
seen = []
def callback():
    global x
    kind = {frees!r}
    if kind == "set_":
        x.set_(torch.zeros(0, dtype=torch.float64))
    elif kind == "resize_":
        x.resize_(4 * N)
    elif kind == "share_memory_":
        x.share_memory_()
    elif kind == "untyped_storage().resize_(0)":
        x.untyped_storage().resize_(0)
    elif kind == "swap_tensors":
        y = torch.zeros(1, dtype=torch.float64)
        torch.utils.swap_tensors(x, y)
        del y
    seen.append(x.data_ptr() != p)
    if kind == "del":
        x = None  # the caller's reference is the argument's: the view borrows it
    seen.append(mapped(p))
total = D._slice_across_call(x, callback, 5.0)
print(seen, total == 5.0 * N, mapped(p))
"""
    )
    moved = frees != "del"
    assert out.strip() == f"[{moved}, True] True False", out


@hooks
def test_a_view_gives_the_storage_its_own_memory_owner_back() -> None:
    # While a view lives, the storage's DataPtr holds dlbridge's keeper; the last view of it gives
    # the storage its own deleter back (torch tells shared memory by it), however many views of
    # the storage lived at once.
    torch = need("torch")
    s = torch.zeros(8, dtype=torch.float64).share_memory_()
    assert s.is_shared()
    assert dlbridge._dlbridge._view_twice(s[:4], s[4:], 1.0) == "written"
    assert s.is_shared() and s.tolist() == [0.0] * 4 + [1.0] * 4
    seen = []
    assert dlbridge._dlbridge._slice_across_call(s, lambda: seen.append(s.is_shared()), 2.0) == 16.0
    assert seen == [False] and s.is_shared()  # the keeper inside the call only
    x = torch.ones(4, dtype=torch.float64)
    dlbridge._dlbridge._view(x)
    x.add_(1.0)  # torch frees and reallocates as before
    assert x.tolist() == [2.0] * 4
    assert dlbridge._dlbridge._torch_views_keep_memory() is True


@hooks
def test_another_thread_cannot_free_the_memory_under_a_kernel_running_without_the_gil() -> None:
    # The kernel releases the GIL while it holds its slice; another Python thread replaces the
    # tensor's storage meanwhile. The view's keeper keeps the memory valid until the kernel is done
    # (torch's own operations have no such keeper: an owned import does not either).
    need("torch")
    out = _child(
        f"""
import threading, time, torch, dlbridge._dlbridge as D
N = {_BIG}
x = torch.ones(N, dtype=torch.float64)
def replace():
    time.sleep(0.1)
    x.set_(torch.zeros(0, dtype=torch.float64))
    x.resize_(0)
th = threading.Thread(target=replace)
th.start()
total = D._slice_across_detach(x, 0.5, 3.0)
th.join()
print(total == 3.0 * N, x.numel())
"""
    )
    assert out.split() == ["True", "0"]


@hooks
def test_keepers_of_two_extensions_on_one_storage_chain() -> None:
    # Each extension embedding dlbridge has its own keeper (its own deleter): a view made by one
    # while the other's view lives wraps the other's keeper, gives it back when it goes, and the
    # memory stays valid until the last view of either is gone, then is freed.
    need("torch")
    pytest.importorskip("dlbridge_scale", reason="needs examples/scale installed (make test does)")
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("reads /proc/self/maps")
    out = _child(
        f"""
import torch, dlbridge._dlbridge as D, dlbridge_scale as S
def mapped(p):
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= p < hi:
                return True
    return False
x = torch.ones({_BIG}, dtype=torch.float64)
p = x.data_ptr()
def inner():
    assert D._view(x)[0] == p  # a second keeper over the first, given back
    x.set_(torch.zeros(0, dtype=torch.float64))
    return mapped(p)
print(S.while_reading(x, inner), mapped(p))
y = torch.zeros(4, dtype=torch.float64).share_memory_()
S.while_reading(y, lambda: D._view(y))
print(y.is_shared())
"""
    )
    assert out.split() == ["True", "False", "True"]


def _described(torch):
    """(name, tensor): layouts and dtypes a borrowed view reads through torch's stable accessors
    (or, for a dtype they have no code for, through the exchange table)."""
    base = torch.arange(24.0).reshape(2, 3, 4)
    with torch.inference_mode():
        inference = torch.arange(3.0)
    return {
        "offset strided slice": torch.arange(10.0)[2:9:3],
        "transposed": base[1].t(),
        "permuted": base.permute(2, 0, 1),
        "expanded (stride 0)": torch.ones(3, 1).expand(3, 4),
        "0-d": torch.tensor(5.0),
        "empty": torch.zeros(0, 3),
        "bool": torch.tensor([True, False]),
        "bfloat16": torch.zeros(2, dtype=torch.bfloat16),
        "float16": torch.zeros(2, dtype=torch.float16),
        "float64": torch.zeros(2, dtype=torch.float64),
        "int8 at an offset": torch.arange(8, dtype=torch.int8)[3:],
        "uint8": torch.zeros(5, dtype=torch.uint8),
        "int64": torch.arange(4),
        "complex64": torch.zeros(2, dtype=torch.complex64),
        "complex128 slice": torch.zeros(4, dtype=torch.complex128)[1::2],
        "uint16": torch.zeros(3, dtype=torch.uint16),
        "float8 (the table's)": torch.zeros(3, dtype=torch.float8_e4m3fn),
        "inference tensor": inference,
        "requires grad, detached": torch.ones(2, requires_grad=True).detach(),
    }


@hooks
@pytest.mark.parametrize("name", [
    "offset strided slice", "transposed", "permuted", "expanded (stride 0)", "0-d", "empty", "bool",
    "bfloat16", "float16", "float64", "int8 at an offset", "uint8", "int64", "complex64",
    "complex128 slice", "uint16", "float8 (the table's)", "inference tensor", "requires grad, detached",
])
def test_a_torch_view_sees_what_torch_shows(name: str) -> None:
    # The view of exactly torch.Tensor reads its description through torch's stable accessors on
    # the tensor's own at::Tensor (verified once against the exchange table); whatever it reads must
    # be what torch itself shows: the first element's address, extents, strides, dtype, writable.
    torch = need("torch")
    t = _described(torch)[name]
    ptr, shape, strides, dtype, readonly = dlbridge._dlbridge._view(t)
    assert (shape, strides) == (list(t.shape), list(t.stride()))
    assert dtype == str(t.dtype).removeprefix("torch.") and readonly is False
    assert ptr == t.data_ptr()
    assert dlbridge._dlbridge._torch_views_from_stable_abi() is True


@hooks
def test_a_torch_view_of_a_lazy_clone_copies_it_first_as_torchs_own_export_does() -> None:
    # A copy-on-write storage (torch._lazy_clone) is copied when a writable pointer is asked for,
    # as torch's DLPack export asks: the view must not point into the memory the clone shares.
    torch = need("torch")
    src = torch.arange(4.0, dtype=torch.float64)
    lazy = torch._lazy_clone(src)
    ptr = dlbridge._dlbridge._view(lazy)[0]
    assert ptr != src.data_ptr() and ptr == lazy.data_ptr()
    assert dlbridge._dlbridge._view_add(lazy, 1.0) == 4.0 + 6.0
    assert src.tolist() == [0.0, 1.0, 2.0, 3.0] and lazy.tolist() == [1.0, 2.0, 3.0, 4.0]


@hooks
def test_torch_tensors_the_stable_accessors_do_not_describe_are_refused_as_before() -> None:
    # Not on the CPU, not strided, no sizes or storage: the accessors leave them to the exchange
    # table and torch's __dlpack__, whose refusals name the reason (nothing printed, no abort).
    torch = need("torch")
    cases = {
        "sparse": (torch.zeros(3).to_sparse(), "layout other than torch.strided"),
        "meta": (torch.zeros(3, device="meta"), "meta"),
        "mkldnn": (torch.zeros(2, 2).to_mkldnn(), "OpaqueTensorImpl"),
    }
    for name, (t, why) in cases.items():
        with pytest.raises(BufferError, match=why):
            dlbridge._dlbridge._view(t)
    assert dlbridge._dlbridge._view(torch.arange(3.0))[1] == [3]
