"""Every example kernel in every mode: eagerly, inside jax.jit (with vmap, mixed with jnp, under
jax.grad), inside torch.compile(fullgraph=True) (no graph break, under autograd): results equal to
the eager call's, of the caller's framework."""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge_kernels as k
from dlbridge.kernels import Kernel

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
torch = pytest.importorskip("torch")
# torch.compile's triton and tensorflow each load an LLVM; triton's aborts the process when
# tensorflow's came first (the other order works): load it now, before a later test imports
# tensorflow (python/dlbridge/tests/conftest.py does the same for the whole session).
import torch._dynamo  # noqa: E402, F401
jax.config.update("jax_enable_x64", True)

RNG = np.random.default_rng(22)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=tol, atol=tol)


def graph_breaks(fn, *args):
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_break_count


def test_the_module_functions_are_kernels():
    for name in ("saxpy", "saxpy_", "softmax", "softmax_backward", "layer_norm"):
        assert isinstance(getattr(k, name), Kernel), name
    assert k.softmax.__doc__ and "softmax" in k.softmax.__doc__.lower()


def test_the_author_names_the_ops_and_the_defaults_name_the_package_once():
    """KernelDef.namespace names layer_norm's torch op and XLA target; the others are the
    function's name in the module's package (before: dlbridge_kernels::k_dlbridge_kernels__softmax
    and dlbridge.dlbridge_kernels.softmax)."""
    assert k.layer_norm.torch_op is not None
    assert torch.ops.dlbridge_examples.layer_norm.default is k.layer_norm._overload
    assert k.layer_norm.target == "dlbridge_examples.layer_norm"
    assert torch.ops.dlbridge_kernels.softmax.default is k.softmax._overload
    assert torch.ops.dlbridge_kernels.saxpy_.default is k.saxpy_._overload
    assert k.softmax.target == "dlbridge_kernels.softmax" and k.saxpy_.target == "dlbridge_kernels.saxpy_"
    x = torch.randn(3, 4)
    w, b = torch.ones(4), torch.zeros(4)
    assert torch.allclose(torch.ops.dlbridge_examples.layer_norm(x, w, b, 1e-5), k.layer_norm(x, w, b))


def test_help_shows_the_signature_and_the_docs():
    import inspect
    import pydoc

    text = pydoc.render_doc(k.layer_norm, renderer=pydoc.plaintext)
    assert "layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float64 = 1e-05) -> Tensor" in text
    assert "Layer normalisation over the last axis" in text  # the function's own docs
    assert "torch.ops.dlbridge_examples.layer_norm" in text and "'dlbridge_examples.layer_norm'" in text
    sig = inspect.signature(k.saxpy_)
    assert list(sig.parameters) == ["a", "x", "y"]
    assert sig.parameters["a"].annotation == "float32"
    assert sig.parameters["y"].annotation == "Tensor (written in place)"
    assert "Backward: softmax_backward(out, grad) gives the gradient of x" in k.softmax.__doc__


# --- jax.jit ---


@pytest.mark.parametrize("dtype", [np.float32, np.float64, jnp.bfloat16])
def test_softmax_under_jit_equals_eager(dtype):
    x = jnp.asarray(rand(7, 33), dtype=dtype)
    eager = k.softmax(x)  # a jax array eagerly: no tracer, the kernel itself
    jitted = jax.jit(k.softmax)(x)
    assert isinstance(jitted, jax.Array) and jitted.dtype == jnp.dtype(dtype) and jitted.shape == (7, 33)
    close(jitted, eager, 1e-6 if dtype != jnp.bfloat16 else 1e-2)


def test_saxpy_and_layer_norm_under_jit_equal_eager():
    x, y = rand(100, dtype=np.float64), rand(100, dtype=np.float64)
    close(jax.jit(lambda x, y: k.saxpy(2.5, x, y))(x, y), k.saxpy(2.5, x, y))
    a, w, b = rand(5, 16), rand(16), rand(16)
    out = jax.jit(lambda a, w, b: k.layer_norm(a, w, b, eps=1e-3))(a, w, b)
    assert out.dtype == jnp.float32
    close(out, k.layer_norm(a, w, b, 1e-3), 1e-5)


def test_in_place_saxpy_is_functional_under_jit():
    x, y = jnp.arange(4.0, dtype=jnp.float32), jnp.ones(4, jnp.float32)
    out = jax.jit(lambda x, y: k.saxpy_(3.0, x, y))(x, y)
    close(out, [1.0, 4.0, 7.0, 10.0])
    close(y, np.ones(4))  # the caller's array is untouched: XLA aliased a copy, or a donated buffer


def test_in_place_saxpy_writes_a_donated_buffer_in_place():
    x, y = jnp.arange(4.0, dtype=jnp.float32), jnp.ones(4, jnp.float32)
    where = y.unsafe_buffer_pointer()
    out = jax.jit(lambda x, y: k.saxpy_(3.0, x, y), donate_argnums=1)(x, y)
    close(out, [1.0, 4.0, 7.0, 10.0])
    assert y.is_deleted() and out.unsafe_buffer_pointer() == where  # no copy: y's memory, written


def test_kernels_mix_with_jnp_in_one_jit():
    a, w, b = rand(8, 10), rand(10), rand(10)

    @jax.jit
    def f(a):
        h = k.layer_norm(jnp.tanh(a), w, b)
        return jnp.sum(k.softmax(h * 2.0), axis=1) + k.saxpy(1.0, a[0].astype(jnp.float64), jnp.zeros(10))[0]

    ref = np.sum(k.softmax(k.layer_norm(np.tanh(a), w, b) * 2.0), axis=1) + float(a[0, 0])
    close(f(a), ref, 1e-5)


def test_vmap_equals_stacked_eager_calls():
    # vmap_method="sequential": the handler is called once per batch element.
    xs = rand(3, 4, 6)
    out = jax.vmap(k.softmax)(xs)
    close(out, np.stack([k.softmax(x) for x in xs]))
    ys = rand(3, 5, dtype=np.float64)
    close(jax.vmap(lambda y: k.saxpy(2.0, y, y))(ys), 3 * ys)


def test_vmap_broadcast_all_hands_the_whole_batch_to_one_call():
    # vmap_method="broadcast_all": the handler gets the batch axis in front, in one call. softmax's
    # handler is row-wise over a 2-d operand, so a kernel of the same body and handler declared
    # this way maps over the rows of a matrix (a batch of vectors) in one call; a batch of
    # matrices reaches the handler as a 3-d operand, which its declared rank refuses.
    from dlbridge.kernels import kernel

    rows = kernel(k.softmax.__wrapped__, name="softmax_rows", out="x", ffi=k.softmax._ffi, vmap_method="broadcast_all")
    xs = rand(5, 7, dtype=np.float64)
    out = jax.jit(jax.vmap(rows))(xs)
    assert out.shape == (5, 7) and out.dtype == jnp.float64
    close(out, k.softmax(xs))
    with pytest.raises(Exception, match=r"x: expected float64 2-d C-contiguous cpu tensor, got float64 \(3, 4, 6\)"):
        jax.vmap(rows)(rand(3, 4, 6, dtype=np.float64))


def test_refusals_inside_jit_name_the_argument():
    with pytest.raises(Exception, match=r"softmax_xla: x: expected float64 2-d C-contiguous cpu tensor, got float64 \(2, 3, 4\)"):
        jax.jit(k.softmax)(jnp.ones((2, 3, 4)))
    with pytest.raises(Exception, match="x: expected float32, float64 or bfloat16, got int32"):
        jax.jit(k.softmax)(jnp.ones((2, 3), jnp.int32))
    with pytest.raises(Exception, match=r"layer_norm_xla: weight and bias need length 4"):
        jax.jit(lambda a: k.layer_norm(a, jnp.ones(3), jnp.ones(4)))(jnp.ones((2, 4)))
    with pytest.raises(TypeError, match="a is an XLA attribute, static under jax.jit"):
        jax.jit(k.saxpy)(2.0, jnp.ones(3), jnp.ones(3))


@pytest.mark.parametrize("order", ["extension first", "jax first"])
def test_a_jax_export_runs_in_a_fresh_process_that_never_traced_the_kernels(tmp_path, order):
    # The reproducer: targets were registered at the first traced call, so a deserialized export
    # failed with "No FFI handler registered". They are registered when the kernel is made (jax
    # imported first) or right after jax's own import (the extension imported first).
    import subprocess
    import sys

    x = rand(3, 4, dtype=np.float64)
    f = jax.jit(lambda x: k.softmax(k.layer_norm(x, jnp.ones(4), jnp.zeros(4), eps=1e-3)) + k.saxpy(2.0, x[0], x[1]))
    checks = [jax.export.DisabledSafetyCheck.custom_call(kk.target) for kk in (k.softmax, k.layer_norm, k.saxpy)]
    (tmp_path / "f.bin").write_bytes(jax.export.export(f, disabled_checks=checks)(x).serialize())
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "want.npy", np.asarray(f(x)))
    imports = (
        "import sys\nimport dlbridge_kernels\nassert 'jax' not in sys.modules  # the hook imports nothing\nimport jax"
        if order == "extension first"
        else "import jax\nimport dlbridge_kernels"
    )
    code = f"""
{imports}
import numpy as np
jax.config.update("jax_enable_x64", True)
exp = jax.export.deserialize(bytearray(open({str(tmp_path / "f.bin")!r}, "rb").read()))
got = np.asarray(exp.call(np.load({str(tmp_path / "x.npy")!r})))
np.testing.assert_allclose(got, np.load({str(tmp_path / "want.npy")!r}), rtol=1e-12)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# --- torch.compile ---


def test_softmax_and_layer_norm_compile_without_graph_breaks():
    x, w, b = torch.randn(6, 20), torch.randn(20), torch.randn(20)

    def f(x):
        return k.softmax(k.layer_norm(x, w, b, eps=1e-4) * 3) + 1

    compiled = torch.compile(f, fullgraph=True)
    out = compiled(x)
    assert type(out) is torch.Tensor and out.dtype == torch.float32 and out.shape == (6, 20)
    torch.testing.assert_close(out, f(x))
    assert graph_breaks(f, x) == 0


def test_saxpy_compiles_and_the_in_place_one_mutates():
    x, y = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    f = torch.compile(lambda x, y: k.saxpy(0.5, x, y) * 2, fullgraph=True)
    torch.testing.assert_close(f(x, y), k.saxpy(0.5, x, y) * 2)
    assert graph_breaks(lambda x, y: k.saxpy(0.5, x, y) * 2, x, y) == 0
    xs, ys = torch.ones(4), torch.arange(4.0)
    g = torch.compile(lambda x, y: k.saxpy_(2.0, x, y) + 0, fullgraph=True)
    torch.testing.assert_close(g(xs, ys), torch.tensor([2.0, 3.0, 4.0, 5.0]))
    torch.testing.assert_close(ys, torch.tensor([2.0, 3.0, 4.0, 5.0]))


def test_torch_export_keeps_the_op():
    class M(torch.nn.Module):
        def forward(self, x):
            return k.softmax(x) * 2

    x = torch.randn(3, 4)
    ep = torch.export.export(M(), (x,))
    assert "dlbridge_kernels" in ep.graph_module.code
    torch.testing.assert_close(ep.module()(x), k.softmax(x) * 2)


# --- autograd ---


def finite_differences(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        g[i] = (f(x + d) - f(x - d)) / (2 * eps)
    return g


def test_jax_grad_of_softmax_matches_finite_differences():
    x = rand(3, 5, dtype=np.float64)
    weights = np.arange(15.0).reshape(3, 5)
    grad = jax.grad(lambda x: jnp.sum(k.softmax(x) * weights))(x)
    ref = finite_differences(lambda x: float(np.sum(k.softmax(x) * weights)), x)
    close(grad, ref, 1e-6)
    jitted = jax.jit(jax.grad(lambda x: jnp.sum(k.softmax(jnp.sin(x)) * weights)))(x)
    close(jitted, finite_differences(lambda x: float(np.sum(k.softmax(np.sin(x)) * weights)), x), 1e-6)


def test_torch_gradcheck_of_softmax():
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(k.softmax, (x,))  # first order (no double backward is claimed)


def test_torch_compile_backward_equals_eager():
    weights = torch.arange(12.0).reshape(3, 4)
    xc = torch.randn(3, 4, requires_grad=True)
    xe = xc.detach().clone().requires_grad_()
    torch.compile(lambda x: (k.softmax(x) * weights).sum(), fullgraph=True)(xc).backward()
    (k.softmax(xe) * weights).sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad)


def test_eager_results_are_unchanged():
    x = rand(2, 3)
    assert type(k.softmax(x)) is np.ndarray
    assert type(k.softmax(torch.from_numpy(x))) is torch.Tensor
    assert isinstance(k.softmax(jnp.asarray(x)), jax.Array)


def test_a_compiled_in_place_kernel_refuses_a_leaf_that_requires_grad_as_eager_does():
    # Under torch.compile the kernel only sees AOTAutograd's functional copy; the wrapper checks
    # torch's in-place rule where dynamo traces it (eager refuses it at argument conversion).
    x = torch.arange(4.0)
    g = torch.ones(4, requires_grad=True)
    with pytest.raises(TypeError, match="requires_grad: a leaf tensor"):
        k.saxpy_(2.0, x, g)
    for fullgraph in (False, True):
        f = torch.compile(lambda x, y: k.saxpy_(2.0, x, y), fullgraph=fullgraph)
        # fullgraph wraps the refusal in dynamo's Unsupported, whose message quotes it
        with pytest.raises(Exception, match="requires_grad: a leaf tensor that requires grad"):
            f(x, g)
        assert g.tolist() == [1.0, 1.0, 1.0, 1.0]
    f = torch.compile(lambda x, y: k.saxpy_(2.0, x, y), fullgraph=True)
    with torch.no_grad():
        assert f(x, g).tolist() == [1.0, 3.0, 5.0, 7.0]  # allowed there, as torch allows y.add_
