"""Several results and residuals (KernelDef.results): rms_norm returns y and saves the residual
rstd for its backward, rms_norm_backward returns dx and dweight. In every mode: eager on numpy,
torch and jax; jax.jit, vmap, grad (check_grads); torch autograd (gradcheck), torch.compile with
backward, torch.func; the native torch op (opcheck) and the Python custom op a kernel made from
Python gets (opcheck). Each result's shape comes from the Rust rule, in every mode."""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge.kernels
import dlbridge_kernels as K

EPS = 1e-6


def reference(x, w, eps=EPS):
    """rms_norm in numpy: (y, rstd)."""
    rstd = 1.0 / np.sqrt((x * x).mean(-1) + eps)
    return x * rstd[:, None] * w, rstd


def data(rows=5, cols=7, dtype=np.float64, seed=0):
    g = np.random.default_rng(seed)
    return g.standard_normal((rows, cols)).astype(dtype), g.standard_normal(cols).astype(dtype)


# --- eager ---


def test_eager_numpy_returns_y_only_and_the_function_returns_the_residual_too():
    x, w = data()
    y = K.rms_norm(x, w)
    assert type(y) is np.ndarray and y.shape == x.shape
    np.testing.assert_allclose(y, reference(x, w)[0], rtol=1e-12)
    # The function underneath (what the raw op runs) returns every result, the residual too.
    y2, rstd = K.rms_norm.__wrapped__(x, w)
    np.testing.assert_allclose(rstd, reference(x, w)[1], rtol=1e-12)
    assert rstd.shape == (5,) and rstd.dtype == x.dtype
    dx, dw = K.rms_norm_backward(x, w, rstd, np.ones_like(x))
    assert dx.shape == x.shape and dw.shape == w.shape


def test_eager_float32_and_one_result_twin():
    x, w = data(dtype=np.float32)
    np.testing.assert_allclose(K.rms_norm(x, w), reference(x, w)[0], rtol=1e-5)
    np.testing.assert_allclose(K.rms_norm_inference(x, w), K.rms_norm(x, w), rtol=0)


def test_eager_torch_and_jax():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    x, w = data()
    yt = K.rms_norm(torch.from_numpy(x), torch.from_numpy(w))
    assert type(yt) is torch.Tensor
    np.testing.assert_allclose(yt.numpy(), reference(x, w)[0], rtol=1e-12)
    yj = K.rms_norm(jnp.asarray(x, dtype=jnp.float32), jnp.asarray(w, dtype=jnp.float32))
    assert not isinstance(yj, tuple) and yj.shape == x.shape
    np.testing.assert_allclose(np.asarray(yj), reference(x.astype(np.float32), w.astype(np.float32))[0], rtol=1e-5)


def test_help_shows_the_visible_result_and_the_residual():
    assert str(K.rms_norm.__signature__).endswith("-> 'Tensor y'")
    assert str(K.rms_norm_backward.__signature__).endswith("-> '(Tensor dx, Tensor dweight)'")
    assert "residuals (saved for the backward, never returned): rstd" in K.rms_norm.__doc__


# --- jax ---


@pytest.fixture
def jax():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    return jax


def jax_reference(jax, x, w, eps=EPS):
    jnp = jax.numpy
    return x * jax.lax.rsqrt((x * x).mean(-1) + eps)[:, None] * w


def test_jit_vmap_and_the_shape_rule(jax):
    jnp = jax.numpy
    x, w = map(jnp.asarray, data())
    np.testing.assert_allclose(jax.jit(K.rms_norm)(x, w), jax_reference(jax, x, w), rtol=1e-12)
    # The raw results' types in the jaxpr: y (5, 7) and the residual rstd (5,), by the Rust rule.
    jaxpr = str(jax.make_jaxpr(K.rms_norm)(x, w))
    assert "f64[5]" in jaxpr and "f64[5,7]" in jaxpr
    xs = jnp.stack([x, 2 * x, -x])
    np.testing.assert_allclose(
        jax.jit(jax.vmap(K.rms_norm, in_axes=(0, None)))(xs, w),
        jax.vmap(lambda a: jax_reference(jax, a, w))(xs),
        rtol=1e-12,
    )
    dx, dw = jax.jit(K.rms_norm_backward)(x, w, jnp.ones(5), jnp.ones_like(x))
    assert dx.shape == (5, 7) and dw.shape == (7,)


def test_the_shape_rule_refuses_in_the_authors_terms(jax):
    jnp = jax.numpy
    with pytest.raises(ValueError, match=r"rms_norm: result rstd: x: expected 2 dimensions, got shape \[2, 3, 4\]"):
        jax.jit(K.rms_norm)(jnp.ones((2, 3, 4)), jnp.ones(4))


def test_jax_grad_matches_jax_and_check_grads(jax):
    from jax.test_util import check_grads

    jnp = jax.numpy
    x, w = map(jnp.asarray, data())

    def loss(f):
        return lambda x, w: (f(x, w) * jnp.cos(x)).sum()

    got = jax.jit(jax.grad(loss(K.rms_norm), argnums=(0, 1)))(x, w)
    want = jax.grad(loss(lambda a, b: jax_reference(jax, a, b)), argnums=(0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)
    check_grads(K.rms_norm, (x, w), order=1, modes=["rev"])
    # Per-example gradients: vmap of grad.
    xs = jnp.stack([x, 2 * x])
    per = jax.vmap(jax.grad(loss(K.rms_norm), argnums=1), in_axes=(0, None))(xs, w)
    per_ref = jax.vmap(jax.grad(loss(lambda a, b: jax_reference(jax, a, b)), argnums=1), in_axes=(0, None))(xs, w)
    np.testing.assert_allclose(per, per_ref, rtol=1e-10, atol=1e-12)


def test_jax_second_order_is_refused_not_wrong(jax):
    jnp = jax.numpy
    x, w = map(jnp.asarray, data())
    with pytest.raises(Exception, match="cannot be differentiated|differentiat"):
        jax.grad(lambda a: jax.grad(lambda b: K.rms_norm(b, w).sum())(a).sum())(x)


# --- torch ---


@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    dlbridge.kernels.torch_ready()
    return torch


def torch_reference(torch, x, w, eps=EPS):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_the_ops_are_native_and_return_every_result(torch):
    for k in (K.rms_norm, K.rms_norm_backward):
        assert k._native_fallback is None, k._native_fallback
    x, w = (torch.from_numpy(a) for a in data())
    y, rstd = torch.ops.dlbridge_kernels.rms_norm(x, w, EPS)
    torch.testing.assert_close(rstd, torch.from_numpy(reference(x.numpy(), w.numpy())[1]))
    # The Meta kernel: the same Rust rule, no Python.
    ym, rm = torch.ops.dlbridge_kernels.rms_norm(x.to("meta"), w.to("meta"), EPS)
    assert ym.shape == (5, 7) and rm.shape == (5,) and rm.dtype == torch.float64
    with pytest.raises(RuntimeError, match="x: expected 2 dimensions"):
        torch.ops.dlbridge_kernels.rms_norm(torch.ones(2, 3, 4, device="meta"), torch.ones(4, device="meta"), EPS)


def test_opcheck_on_the_native_ops(torch):
    x, w = (torch.from_numpy(a) for a in data())
    rstd = torch.from_numpy(reference(x.numpy(), w.numpy())[1])
    torch.library.opcheck(torch.ops.dlbridge_kernels.rms_norm.default, (x, w, EPS))
    torch.library.opcheck(
        torch.ops.dlbridge_kernels.rms_norm.default, (x.clone().requires_grad_(), w.clone().requires_grad_(), EPS)
    )
    torch.library.opcheck(torch.ops.dlbridge_kernels.rms_norm_backward.default, (x, w, rstd, torch.ones_like(x)))
    torch.library.opcheck(torch.ops.dlbridge_kernels.rms_norm_inference.default, (x, w, EPS))


def test_gradcheck_and_the_reference(torch):
    x, w = (torch.from_numpy(a).requires_grad_() for a in data())
    assert torch.autograd.gradcheck(K.rms_norm, (x, w))
    y = K.rms_norm(x, w)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape
    g = torch.autograd.grad((y * x.cos()).sum(), (x, w))
    r = torch.autograd.grad((torch_reference(torch, x, w) * x.cos()).sum(), (x, w))
    for a, b in zip(g, r, strict=True):
        torch.testing.assert_close(a, b)


def test_double_backward_is_refused_as_first_order_only(torch):
    x, w = (torch.from_numpy(a).requires_grad_() for a in data())
    with pytest.raises(RuntimeError, match="first order only"):
        torch.autograd.gradgradcheck(K.rms_norm, (x, w))


def test_compile_fullgraph_with_backward(torch):
    x, w = (torch.from_numpy(a) for a in data())
    torch._dynamo.reset()

    def loss(f, x, w):
        return (f(x, w) * x.cos()).sum()

    c = torch.compile(lambda x, w: loss(K.rms_norm, x, w), fullgraph=True)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    c(xa, wa).backward()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss(lambda a, b: torch_reference(torch, a, b), xb, wb).backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(wa.grad, wb.grad)
    # Without grad, compiled: y alone.
    y = torch.compile(K.rms_norm, fullgraph=True)(x, w)
    torch.testing.assert_close(y, torch_reference(torch, x, w))


def test_torch_func_grad_and_vmap(torch):
    x, w = (torch.from_numpy(a) for a in data())
    gw = torch.func.grad(lambda w: (K.rms_norm(x, w) * x.cos()).sum())(w)
    gw_ref = torch.func.grad(lambda w: (torch_reference(torch, x, w) * x.cos()).sum())(w)
    torch.testing.assert_close(gw, gw_ref)
    xs = torch.stack([x, 2 * x, -x])
    torch.testing.assert_close(
        torch.func.vmap(K.rms_norm, in_dims=(0, None))(xs, w),
        torch.func.vmap(lambda a: torch_reference(torch, a, w))(xs),
    )


def test_torch_func_vmap_of_a_kernel_with_two_results(torch):
    x, w = (torch.from_numpy(a) for a in data())
    xs = torch.stack([x, 2 * x])
    rstd = torch.rsqrt((xs * xs).mean(-1) + EPS)
    g = torch.ones_like(xs)
    dx, dw = torch.func.vmap(K.rms_norm_backward, in_dims=(0, None, 0, 0))(xs, w, rstd, g)
    assert dx.shape == (2, 5, 7) and dw.shape == (2, 7)
    for b in range(2):
        want = K.rms_norm_backward(xs[b], w, rstd[b], g[b])
        torch.testing.assert_close(dx[b], want[0])
        torch.testing.assert_close(dw[b], want[1])


def test_a_kernel_made_from_python_gets_a_custom_op_with_the_same_rules(torch):
    """The same function and handler declared from Python (no native registrar): the Python
    custom op, its fake results from result_rule, the residual dropped, the backward fed."""
    rule = K.rms_norm._result_rule
    bw = K.rms_norm._backward
    k = dlbridge.kernels.kernel(
        K.rms_norm.__wrapped__,
        name="rms_norm_py",
        namespace="dlbridge_results_test",
        attrs={"eps": "float64"},
        ffi=K.rms_norm._ffi,
        results=("y", "rstd"),
        residuals=("rstd",),
        result_rule=rule,
        backward=bw,
    )
    assert not isinstance(k.torch_op, type(torch.ops.dlbridge_kernels.rms_norm))  # the custom op
    x, w = (torch.from_numpy(a) for a in data())
    torch.library.opcheck(k.torch_op, (x.clone().requires_grad_(), w.clone().requires_grad_(), EPS))
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    assert torch.autograd.gradcheck(k, (xa, wa))
    torch._dynamo.reset()
    c = torch.compile(lambda a, b: (k(a, b) * a.cos()).sum(), fullgraph=True)
    c(xa, wa).backward()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    (torch_reference(torch, xb, wb) * xb.cos()).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(wa.grad, wb.grad)


# --- several visible results, each with its cotangent ---


def both_visible():
    """rms_norm's function and handler declared with both results visible (no residual): the
    backward gets each one's cotangent, grad_y and grad_rstd (written with array operations both
    torch and jax have)."""

    def backward(named):
        x, w, rstd = named["x"], named["weight"], named["rstd"]
        dx, dw = K.rms_norm_backward(x, w, rstd, named["grad_y"])
        # d rstd / d x = -rstd**3 * x / n, row by row.
        dx = dx - (rstd**3 * named["grad_rstd"])[:, None] * x / x.shape[-1]
        return {"x": dx, "weight": dw}

    return dlbridge.kernels.kernel(
        K.rms_norm.__wrapped__,
        name="rms_norm_both",
        namespace="dlbridge_results_test",
        attrs={"eps": "float64"},
        ffi=K.rms_norm._ffi,
        results=("y", "rstd"),
        result_rule=K.rms_norm._result_rule,
        backward=backward,
    )


BOTH = both_visible()


def test_several_visible_results_torch_gradients(torch):
    x, w = (torch.from_numpy(a).requires_grad_() for a in data())
    y, rstd = BOTH(x, w)
    torch.testing.assert_close(rstd.detach(), torch.rsqrt((x * x).mean(-1) + EPS).detach())
    assert torch.autograd.gradcheck(lambda a, b: BOTH(a, b), (x, w))
    # Only one of the two used: the other's cotangent is zero.
    assert torch.autograd.gradcheck(lambda a, b: BOTH(a, b)[1], (x, w))
    assert torch.autograd.gradcheck(lambda a, b: BOTH(a, b)[0], (x, w))
    torch.library.opcheck(BOTH.torch_op, (x, w, EPS))
    torch._dynamo.reset()
    c = torch.compile(lambda a, b: (lambda y, r: (y * a.cos()).sum() + (r * r).sum())(*BOTH(a, b)), fullgraph=True)
    xa, wa = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    c(xa, wa).backward()
    xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rb = torch.rsqrt((xb * xb).mean(-1) + EPS)
    ((torch_reference(torch, xb, wb) * xb.cos()).sum() + (rb * rb).sum()).backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(wa.grad, wb.grad)


def test_several_visible_results_jax_gradients(jax):
    from jax.test_util import check_grads

    jnp = jax.numpy
    x, w = map(jnp.asarray, data())
    y, rstd = jax.jit(BOTH)(x, w)
    np.testing.assert_allclose(rstd, reference(np.asarray(x), np.asarray(w))[1], rtol=1e-12)
    check_grads(BOTH, (x, w), order=1, modes=["rev"])

    def loss(f):
        return lambda a, b: (lambda y, r: (y * jnp.cos(a)).sum() + (r * r).sum())(*f(a, b))

    def ref(a, b):
        return jax_reference(jax, a, b), jax.lax.rsqrt((a * a).mean(-1) + EPS)

    got = jax.jit(jax.grad(loss(BOTH), argnums=(0, 1)))(x, w)
    want = jax.grad(loss(ref), argnums=(0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)


def test_a_function_that_does_not_return_every_result_is_refused(torch):
    """A result count that differs from the declaration is an error, never a row of an array
    taken for a result."""

    def one(x):
        return x * 2

    k = dlbridge.kernels.kernel(
        one, name="returns_one", namespace="dlbridge_results_test", results=("a", "b"), residuals=("b",),
        result_rule=lambda shapes, dtypes, attrs: [(shapes[0], dtypes[0])] * 2,
    )
    msg = r"returns_one: the function returned ndarray, but the kernel declares 2 results \(a, b\)"
    with pytest.raises(TypeError, match=msg):
        k(np.ones((2, 3)))
    with pytest.raises(TypeError, match="the function returned Tensor"):
        k(torch.ones(2, 3, requires_grad=True))


# --- declarations refused ---


def test_results_declarations_are_checked():
    def f(x, w):
        return x, w

    rule = K.rms_norm._result_rule
    with pytest.raises(ValueError, match="every result is a residual"):
        dlbridge.kernels.kernel(f, results=("a",), residuals=("a",), result_rule=rule)
    with pytest.raises(ValueError, match="residuals names 'b', not one of results"):
        dlbridge.kernels.kernel(f, results=("a",), residuals=("b",), result_rule=rule)
    with pytest.raises(ValueError, match="out='x' and results="):
        dlbridge.kernels.kernel(f, out="x", results=("a",), result_rule=rule)
    with pytest.raises(ValueError, match="needs result_rule="):
        dlbridge.kernels.kernel(f, results=("a",))
    with pytest.raises(ValueError, match="result name 'x' is taken"):
        dlbridge.kernels.kernel(f, results=("x",), result_rule=rule)
    with pytest.raises(ValueError, match="residuals= and result_rule= need results="):
        dlbridge.kernels.kernel(f, residuals=("a",))


# --- one declared result ---


def test_a_kernel_declaring_one_result_returns_it_not_its_rows(torch):
    """torch returns an op's one result alone (a schema "-> (Tensor)" returns a Tensor). Before,
    the kernel picked element 0 of what the op returned: under torch.compile the first row of the
    result, and the Python custom op refused the function's 1-tuple ("Unable to cast")."""
    k = dlbridge.kernels.kernel(
        K.rms_norm_inference.__wrapped__,
        name="rms_norm_one_result",
        namespace="dlbridge_results_test",
        attrs={"eps": "float64"},
        ffi=K.rms_norm_inference._ffi,
        results=("y",),
        result_rule=lambda shapes, dtypes, attrs: [(shapes[0], dtypes[0])],
    )
    x, w = (torch.from_numpy(a) for a in data())
    want = torch_reference(torch, x, w)
    torch.testing.assert_close(k.torch_op(x, w, EPS), want)
    torch.library.opcheck(k.torch_op, (x, w, EPS))
    torch._dynamo.reset()
    y = torch.compile(lambda a, b: k(a, b), fullgraph=True)(x, w)
    assert y.shape == x.shape
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(k(x.clone().requires_grad_(), w), want)  # through the op, eagerly
    yv = torch.func.vmap(lambda a: k(a, w))(torch.stack([x, 2 * x]))
    torch.testing.assert_close(yv[1], torch_reference(torch, 2 * x, w))
