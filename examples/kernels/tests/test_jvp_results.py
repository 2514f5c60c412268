"""Forward mode for a kernel with several results: rms_norm_fm is rms_norm (results y and the
residual rstd) with the jvp kernel rms_norm_tangent, which gives one tangent per result, the
residual's included (the backward reads rstd, so a second derivative, forward over reverse, goes
through rstd's tangent), and the backward rms_norm_fm_backward, whose own jvp
(rms_norm_backward_tangent) makes the layer twice differentiable. jax.jvp, jacfwd, hessian (under
jit and vmap) and torch.func.jvp, jacfwd, hessian and forward_ad dual tensors are each checked
against the framework's own rms_norm and against finite differences; the residual is never shown;
a jvp giving the wrong number of tangents is refused naming the kernel. (Before: a kernel with
results= could not name a jvp at all.)"""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge.kernels
import dlbridge_kernels as K

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
import torch._dynamo  # noqa: E402, F401  (before tensorflow: see test_modes.py)
from jax.test_util import check_grads  # noqa: E402

jax.config.update("jax_enable_x64", True)

func = torch.func
fwAD = torch.autograd.forward_ad
EPS = 1e-5
TANGENT_ARGS = ("x", "weight", "rstd", "tangent_x", "tangent_weight")


def data(rows=3, cols=5, seed=0, dtype=np.float64):
    g = np.random.default_rng(seed)
    return tuple(a.astype(dtype) for a in (g.standard_normal((rows, cols)), g.standard_normal(cols)))


def j_ref(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * w


def t_ref(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * w


def j_fm(x, w):
    return K.rms_norm_fm(x, w, EPS)


def t_fm(x, w):
    return K.rms_norm_fm(x, w, EPS)


# --- the jvp kernel itself ---


def test_help_names_the_tangents_of_every_result():
    doc = K.rms_norm_fm.__doc__
    assert "Jvp: rms_norm_tangent(x, weight, rstd, tangent_x, tangent_weight) gives the tangents of y, rstd." in doc
    assert str(K.rms_norm_fm.__signature__).endswith("-> 'Tensor y'")


def test_the_jvp_kernel_equals_finite_differences_of_both_results():
    x, w = data()
    tx, tw = data(seed=1)
    y, rstd = K.rms_norm_fm.__wrapped__(x, w, EPS)
    dy, drstd = K.rms_norm_tangent(x, w, rstd, tx, tw)
    h = 1e-6
    (yp, rp), (ym, rm) = (K.rms_norm_fm.__wrapped__(x + s * h * tx, w + s * h * tw, EPS) for s in (1, -1))
    np.testing.assert_allclose(dy, (yp - ym) / (2 * h), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(drstd, (rp - rm) / (2 * h), rtol=1e-6, atol=1e-8)
    assert drstd.shape == rstd.shape == (3,)


# --- jax ---


def test_jax_jvp_under_jit_and_vmap_equals_jaxs_and_shows_no_residual():
    x, w = data()
    tx, tw = data(seed=1)
    y, dy = jax.jvp(j_fm, (x, w), (tx, tw))
    ry, rdy = jax.jvp(j_ref, (x, w), (tx, tw))
    # The caller sees y and its tangent alone (rstd is a residual).
    assert not isinstance(y, tuple) and not isinstance(dy, tuple) and dy.shape == x.shape
    np.testing.assert_allclose(y, ry, rtol=1e-12)
    np.testing.assert_allclose(dy, rdy, rtol=1e-10, atol=1e-12)
    jitted = jax.jit(lambda a, b, c, d: jax.jvp(j_fm, (a, b), (c, d)))
    np.testing.assert_allclose(jitted(x, w, tx, tw)[1], rdy, rtol=1e-10, atol=1e-12)
    xs, txs = np.stack([x, 2 * x]), np.stack([tx, -tx])
    batched = jax.vmap(lambda a, t: jax.jvp(lambda b: j_fm(b, w), (a,), (t,))[1])(xs, txs)
    expected = jax.vmap(lambda a, t: jax.jvp(lambda b: j_ref(b, w), (a,), (t,))[1])(xs, txs)
    np.testing.assert_allclose(batched, expected, rtol=1e-10, atol=1e-12)


def test_jax_float32():
    x, w = data(dtype=np.float32)
    tx, tw = data(seed=1, dtype=np.float32)
    _, dy = jax.jit(lambda *a: jax.jvp(j_fm, a[:2], a[2:]))(x, w, tx, tw)
    _, rdy = jax.jvp(j_ref, (x, w), (tx, tw))
    assert dy.dtype == np.float32
    np.testing.assert_allclose(dy, rdy, rtol=1e-4, atol=1e-5)


def test_jax_jacfwd_equals_jacrev_and_jaxs():
    x, w = data()
    for argnums in (0, 1):
        fwd = jax.jit(jax.jacfwd(j_fm, argnums=argnums))(x, w)
        np.testing.assert_allclose(fwd, jax.jacfwd(j_ref, argnums=argnums)(x, w), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(fwd, jax.jacrev(j_fm, argnums=argnums)(x, w), rtol=1e-10, atol=1e-12)


def test_jax_hessian_goes_through_the_residuals_tangent():
    """hessian is forward over reverse: the backward reads rstd, whose tangent (the jvp's second
    result) enters the second derivative; a zero there would make it silently wrong."""
    x, w = data()
    c = np.arange(5.0)

    def loss(f):
        return lambda a, b: jnp.sum(f(a, b) ** 2 * c)

    for argnums in ((0,), (0, 1)):
        got = jax.jit(jax.hessian(loss(j_fm), argnums=argnums))(x, w)
        ref = jax.hessian(loss(j_ref), argnums=argnums)(x, w)
        for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref), strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-10)


def test_jax_check_grads_against_finite_differences():
    x, w = data()
    check_grads(j_fm, (x, w), order=1, modes=("fwd", "rev"))
    c = np.arange(5.0)
    # the gradient's jvp (forward over reverse) against finite differences of the gradient
    check_grads(jax.grad(lambda a, b: jnp.sum(j_fm(a, b) ** 2 * c), argnums=(0, 1)), (x, w), order=1, modes=("fwd",))


def test_jax_forward_over_forward_is_refused_as_first_order_only():
    x, w = data()
    with pytest.raises(TypeError, match=r"rms_norm_tangent: no forward-mode derivative .* first order only"):
        jax.jacfwd(jax.jacfwd(lambda a: j_fm(a, w)))(x)


# --- torch ---


def t_data(seed=0):
    return tuple(torch.from_numpy(a) for a in data(seed=seed))


def test_torch_func_jvp_and_dual_tensors_equal_torchs_and_show_no_residual():
    (x, w), (tx, tw) = t_data(), t_data(seed=1)
    y, dy = func.jvp(t_fm, (x, w), (tx, tw))
    ry, rdy = func.jvp(t_ref, (x, w), (tx, tw))
    assert isinstance(y, torch.Tensor) and isinstance(dy, torch.Tensor)
    torch.testing.assert_close(y, ry)
    torch.testing.assert_close(dy, rdy)
    rdx = func.jvp(lambda a: t_ref(a, w), (x,), (tx,))[1]
    xs = x.clone().requires_grad_()
    (rg,) = torch.autograd.grad(t_ref(xs, w).sum(), xs)
    with fwAD.dual_level():
        out = K.rms_norm_fm(fwAD.make_dual(x, tx), fwAD.make_dual(w, tw), EPS)
        assert isinstance(out, torch.Tensor)
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, rdy)
        # requiring grad too: forward and reverse on one call
        xr = x.clone().requires_grad_()
        out = K.rms_norm_fm(fwAD.make_dual(xr, tx), w, EPS)
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, rdx)
        (g,) = torch.autograd.grad(fwAD.unpack_dual(out).primal.sum(), xr)
        torch.testing.assert_close(g, rg)


def test_torch_gradcheck_forward_and_reverse_against_finite_differences():
    x, w = (t.clone().requires_grad_() for t in t_data())
    assert torch.autograd.gradcheck(t_fm, (x, w), check_forward_ad=True, check_backward_ad=True)


def test_torch_func_jacfwd_vmap_and_hessian_equal_torchs():
    x, w = t_data()
    torch.testing.assert_close(func.jacfwd(t_fm, argnums=(0, 1))(x, w), func.jacfwd(t_ref, argnums=(0, 1))(x, w))
    xs, txs = torch.stack([x, 2 * x]), torch.stack([x.cos(), -x])
    got = func.vmap(lambda a, t: func.jvp(lambda b: t_fm(b, w), (a,), (t,))[1])(xs, txs)
    ref = func.vmap(lambda a, t: func.jvp(lambda b: t_ref(b, w), (a,), (t,))[1])(xs, txs)
    torch.testing.assert_close(got, ref)
    c = torch.arange(5.0, dtype=torch.float64)

    def loss(f):
        return lambda a, b: (f(a, b) ** 2 * c).sum()

    # forward over reverse, through rstd's tangent (see the jax test)
    got = func.hessian(loss(t_fm), argnums=(0, 1))(x, w)
    ref = func.hessian(loss(t_ref), argnums=(0, 1))(x, w)
    for g, r in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(ref), strict=True):
        torch.testing.assert_close(g, r)


def test_torch_compile_and_backward_are_unchanged_by_the_jvp():
    x, w = (t.clone().requires_grad_() for t in t_data())
    torch._dynamo.reset()
    c = torch.compile(lambda a, b: (t_fm(a, b) * a.cos()).sum(), fullgraph=True)
    c(x, w).backward()
    xr, wr = (t.clone().requires_grad_() for t in t_data())
    (t_ref(xr, wr) * xr.cos()).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


# --- declared from Python: the jvp's forms and its errors ---


def declare(name, jvp, residuals=("rstd",)):
    return dlbridge.kernels.kernel(
        K.rms_norm_fm.__wrapped__,
        name=name,
        namespace="dlbridge_jvp_results_test",
        attrs={"eps": "float64"},
        ffi=K.rms_norm_fm._ffi,
        results=("y", "rstd"),
        residuals=residuals,
        result_rule=K.rms_norm_fm._result_rule,
        jvp=jvp,
    )


def one_tangent(named):
    return K.rms_norm_tangent(*[named[n] for n in TANGENT_ARGS])[0]


SHORT = declare("rms_norm_short_jvp", one_tangent)
# both results visible, the jvp a callable reading the results by name
BOTH = declare("rms_norm_both_jvp", lambda named: K.rms_norm_tangent(*[named[n] for n in TANGENT_ARGS]), residuals=())


def test_a_jvp_giving_the_wrong_number_of_tangents_is_refused_naming_the_kernel():
    x, w = data()
    short = r"rms_norm_short_jvp: its jvp gave one .*, but the kernel declares 2 results \(y, rstd\): .* one tangent per result, residuals included"
    with pytest.raises(ValueError, match=short):
        jax.jvp(lambda a: SHORT(a, w, EPS), (x,), (x,))
    with pytest.raises(ValueError, match=short):
        func.jvp(lambda a: SHORT(a, torch.from_numpy(w), EPS), (torch.from_numpy(x),), (torch.from_numpy(x),))
    three = declare("rms_norm_three_jvp", lambda named: (one_tangent(named),) * 3)
    with pytest.raises(ValueError, match=r"rms_norm_three_jvp: its jvp gave 3 tangents, but the kernel declares 2 results"):
        jax.jit(jax.jacfwd(lambda a: three(a, w, EPS)))(x)


def test_several_visible_results_each_get_their_tangent():
    x, w = data()
    tx, tw = data(seed=1)
    (y, rstd), (dy, drstd) = jax.jvp(lambda a, b: BOTH(a, b, EPS), (x, w), (tx, tw))
    rstd_ref = lambda a: jax.lax.rsqrt(jnp.mean(a * a, -1) + EPS)  # noqa: E731
    np.testing.assert_allclose(dy, jax.jvp(j_ref, (x, w), (tx, tw))[1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(drstd, jax.jvp(rstd_ref, (x,), (tx,))[1], rtol=1e-10, atol=1e-12)
    (X, W), (TX, TW) = t_data(), t_data(seed=1)
    (_, _), (dy, drstd) = func.jvp(lambda a, b: BOTH(a, b, EPS), (X, W), (TX, TW))
    torch.testing.assert_close(dy, func.jvp(t_ref, (X, W), (TX, TW))[1])
    torch.testing.assert_close(drstd, func.jvp(lambda a: torch.rsqrt((a * a).mean(-1) + EPS), (X,), (TX,))[1])


def test_a_jvp_argument_is_a_parameter_a_result_or_a_tangent():
    with pytest.raises(
        ValueError,
        match=r"kernel rms_norm_bad_jvp: jvp argument 'tangent_rstd' is unknown \(a parameter, 'out', 'y', 'rstd', or .*tangent_x, tangent_weight\)",
    ):
        declare("rms_norm_bad_jvp", (K.rms_norm_tangent, ("x", "weight", "rstd", "tangent_x", "tangent_rstd")))
