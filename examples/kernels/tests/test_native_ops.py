"""A kernel with an XLA handler is a native torch op (dlbridge::torch_stable): its CPU kernel is
the handler, its Meta kernel the output rule, registered through torch's stable C ABI under the
name the Python custom op would have. No Python runs inside the op (eagerly under inference mode,
compiled, exported); autograd stays Python (register_autograd on the native op). A kernel without
a handler keeps the Python custom op."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import dlbridge.kernels
import dlbridge_kernels as k

torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402, F401  (before tensorflow, as test_modes.py does)

KERNELS_PY = dlbridge.kernels.__file__


def python_frames(call):
    """The Python functions that run during ``call()`` (file:function, but this file's), seen by
    sys.setprofile."""
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename != __file__:
            seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("name", ["saxpy", "saxpy_", "softmax", "softmax_backward", "layer_norm"])
def test_every_kernel_with_a_handler_is_a_native_op(name):
    kern = getattr(k, name)
    assert kern._native_fallback is None
    op = kern.torch_op
    assert isinstance(op, torch._ops.OpOverloadPacket), type(op)
    assert op._qualified_op_name == f"{kern._namespace}::{op._qualified_op_name.split('::')[1]}"
    assert kern._namespace in ("dlbridge_kernels", "dlbridge_examples")  # layer_norm's is named
    # Not torch.library.custom_op's: no Python kernel behind the dispatcher.
    assert torch._library.custom_ops._maybe_get_opdef(op._qualified_op_name) is None


def test_no_python_runs_inside_an_eager_call_under_inference_mode():
    x, y = torch.randn(5), torch.randn(5)
    op = k.saxpy._overload
    with torch.inference_mode():
        out = op(2.0, x, y)
        frames = python_frames(lambda: op(2.0, x, y))
    torch.testing.assert_close(out, 2.0 * x + y)
    # Only torch's own OpOverload.__call__ (the Python entry of every torch op), nothing else.
    assert frames and all(f.endswith("torch/_ops.py:__call__") for f in frames), frames
    softmax = k.softmax._overload
    with torch.inference_mode():
        frames = python_frames(lambda: softmax(torch.randn(3, 4)))
    assert all(f.endswith("torch/_ops.py:__call__") for f in frames), frames


def test_no_python_of_the_kernel_runs_inside_a_compiled_call():
    f = torch.compile(lambda x, y: k.saxpy(0.5, x, y) * 2, fullgraph=True)
    x, y = torch.randn(6), torch.randn(6)
    torch.testing.assert_close(f(x, y), (0.5 * x + y) * 2)
    frames = python_frames(lambda: f(x, y))
    # The compiled wrapper is Python; the op inside it is not (the Python op ran kernels.py's
    # impl and torch's custom-op machinery on each call). With grad mode on, the op's autograd
    # kernel is Python (autograd has no stable C API: torch.library.register_autograd), and
    # runs before the native kernel even when no input requires grad.
    assert not [f for f in frames if f.startswith(KERNELS_PY) or "custom_ops.py" in f], frames
    assert [f for f in frames if f.endswith("torch/_library/autograd.py:autograd_impl")], frames
    # Under inference mode there is no autograd key: nothing of torch.library runs either.
    with torch.inference_mode():
        g = torch.compile(lambda x, y: k.saxpy(0.5, x, y) * 2, fullgraph=True)
        xi, yi = torch.randn(6), torch.randn(6)
        torch.testing.assert_close(g(xi, yi), (0.5 * xi + yi) * 2)
        frames = python_frames(lambda: g(xi, yi))
    assert not [f for f in frames if f.startswith(KERNELS_PY) or "torch/_library/" in f], frames


def test_opcheck_passes_on_the_native_ops():
    x, y = torch.randn(8), torch.randn(8)
    cases = [
        (k.saxpy, (0.5, x, y)),
        (k.saxpy_, (0.5, x, y.clone())),
        (k.softmax, (torch.randn(3, 5, dtype=torch.float64, requires_grad=True),)),
        (k.layer_norm, (torch.randn(2, 6), torch.randn(6), torch.randn(6), 1e-3)),
    ]
    for kern, args in cases:
        result = torch.library.opcheck(kern._overload, args)
        assert set(result.values()) == {"SUCCESS"}, (kern, result)


def test_a_default_is_in_the_native_schema():
    x, w, b = torch.randn(2, 4), torch.ones(4), torch.zeros(4)
    schema = str(k.layer_norm._overload._schema)
    assert "float eps=1" in schema, schema
    torch.testing.assert_close(k.layer_norm._overload(x, w, b), k.layer_norm(x, w, b, eps=1e-5))


def test_the_in_place_native_op_bumps_the_version_counter():
    x, y = torch.arange(3.0), torch.ones(3)
    before = y._version
    k.saxpy_._overload(2.0, x, y)
    assert y._version == before + 1
    torch.testing.assert_close(y, 2.0 * x + 1)
    with torch.inference_mode():
        z = torch.ones(3)
    # An inference tensor outside inference mode: refused before the write, as torch refuses
    # z.add_(1) (the Python op's wrapper refused it too).
    with pytest.raises(RuntimeError, match="inference tensor"):
        k.saxpy_._overload(2.0, x, z)
    torch.testing.assert_close(z, torch.ones(3))


def test_the_raw_in_place_op_refuses_an_argument_autograd_would_lose():
    # Called directly (not through the kernel, whose wrapper refuses it first), the op has no
    # autograd formula: torch's fallback ran it and y's gradient silently lost x's part (x.grad
    # stayed None). Its autograd kernel refuses that, naming the argument (the CPU kernel refuses
    # it too, behind: tests/torch_stable.rs); nothing is written.
    x = torch.ones(3, requires_grad=True)
    y = torch.ones(3, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="argument 'x' requires grad"):
        k.saxpy_._overload(2.0, x, y)
    torch.testing.assert_close(y.detach(), torch.full((3,), 2.0))
    # Outside grad mode, or detached, it runs; the kernel's own call refuses as before.
    with torch.no_grad():
        k.saxpy_._overload(2.0, x, y)
    k.saxpy_._overload(2.0, x.detach(), y.detach())
    torch.testing.assert_close(y.detach(), torch.full((3,), 6.0))
    with pytest.raises(RuntimeError, match="requires grad"):
        k.saxpy_(2.0, x, y)
    # Nor under torch.compile (AOTAutograd traces the op's autograd kernel) or torch.func (whose
    # transforms hand the CPU kernel unwrapped tensors): x.grad was None, torch.func.grad zeros.
    op = k.saxpy_._overload

    def f(x, w):
        y = w * 2
        op(2.0, x, y)
        return (y * y).sum()

    x, w = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    with pytest.raises(Exception, match="requires grad"):
        torch.compile(f, fullgraph=True)(x, w).backward()
    assert x.grad is None
    with pytest.raises(Exception, match="requires grad"):
        torch.func.grad(f)(torch.ones(3), torch.ones(3))
    # A kernel with a backward still differentiates (its formula runs the op with grad mode off).
    s = torch.randn(2, 4, requires_grad=True)
    k.softmax(s).sum().backward()
    assert s.grad is not None


def test_export_calls_the_native_op_without_python():
    class M(torch.nn.Module):
        def forward(self, x, y):
            return k.saxpy(2.0, x, y) + k.softmax(x.reshape(2, 3)).reshape(6)

    x, y = torch.randn(6), torch.randn(6)
    ep = torch.export.export(M(), (x, y))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert str(k.saxpy._overload) in targets and str(k.softmax._overload) in targets, targets
    m = ep.module()
    expected = M()(x, y)
    torch.testing.assert_close(m(x, y), expected)
    frames = python_frames(lambda: m(x, y))
    assert not [f for f in frames if f.startswith(KERNELS_PY) or "custom_ops.py" in f], frames


def test_a_kernel_without_a_handler_keeps_the_python_op():
    def double(x):
        return x * 2

    kern = dlbridge.kernels.kernel(double, out="x", name="double_without_handler")
    assert not hasattr(kern, "_native_fallback")
    assert isinstance(kern.torch_op, torch._library.custom_ops.CustomOpDef)
    f = torch.compile(lambda x: kern(x) + 1, fullgraph=True)
    torch.testing.assert_close(f(torch.ones(3)), torch.full((3,), 3.0))


def test_kernels_made_before_torch_become_native_when_torch_comes():
    code = textwrap.dedent(
        """
        import sys
        import dlbridge_kernels as k
        assert "torch" not in sys.modules
        import torch
        op = k.saxpy.torch_op
        assert isinstance(op, torch._ops.OpOverloadPacket), type(op)
        assert k.saxpy._native_fallback is None
        x = torch.ones(3)
        torch.testing.assert_close(op(2.0, x, x), torch.full((3,), 3.0))
        y = torch.ones(3)
        k.saxpy_._overload(1.0, x, y)
        assert y._version == 1, y._version
        print("native after import")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "native after import" in out.stdout, out.stderr


def test_an_aoti_package_runs_the_native_op_in_a_fresh_process(tmp_path):
    # Built in one process, run in another that imported the extension (which registers the op:
    # the package calls it through torch's dispatcher); no Python of the kernel runs inside.
    package = str(tmp_path / "saxpy.pt2")
    build = textwrap.dedent(
        f"""
        import torch, dlbridge_kernels as k
        class M(torch.nn.Module):
            def forward(self, x, y):
                return k.saxpy(2.0, x, y) * 3
        x, y = torch.randn(6), torch.randn(6)
        ep = torch.export.export(M(), (x, y))
        torch._inductor.aoti_compile_and_package(ep, package_path={package!r})
        torch.save((x, y, M()(x, y)), {package!r} + ".inputs")
        """
    )
    out = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    run = textwrap.dedent(
        f"""
        import sys, torch, dlbridge_kernels, dlbridge.kernels
        x, y, expected = torch.load({package!r} + ".inputs")
        m = torch._inductor.aoti_load_package({package!r})
        torch.testing.assert_close(m(x, y), expected)
        seen = []
        def profile(frame, event, arg):
            if event == "call":
                seen.append(frame.f_code.co_filename)
        sys.setprofile(profile)
        m(x, y)
        sys.setprofile(None)
        assert dlbridge.kernels.__file__ not in seen and not [f for f in seen if "custom_ops.py" in f], seen
        # Under inference mode not even torch.library's autograd kernel (Python) runs.
        seen.clear()
        with torch.inference_mode():
            sys.setprofile(profile)
            m(x, y)
            sys.setprofile(None)
        assert not [f for f in seen if "torch/_library/" in f or f == dlbridge.kernels.__file__], seen
        print("package ran")
        """
    )
    out = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "package ran" in out.stdout, out.stderr[-3000:]
