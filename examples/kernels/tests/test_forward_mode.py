"""Forward-mode derivatives (a kernel's jvp): softmax names a jvp kernel (softmax_jvp), and its
backward and jvp name one of their own (softmax_backward_jvp), so torch's forward AD (dual
tensors, torch.func.jvp, jacfwd, hessian) and jax's (jvp, jacfwd, hessian, under jit and vmap) go
through the kernels, each checked against the framework's own softmax and against finite
differences (gradcheck with check_forward_ad, jax.test_util.check_grads). What no kernel computes
is refused in the author's terms (the kernel that lacks a jvp or a backward, first order only),
never a dropped tangent or a silent zero. (Before: jax said "can't apply forward-mode autodiff
(jvp) to a custom_vjp function", torch refused every dual tensor.)"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import dlbridge
import dlbridge_kernels as K

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
import torch._dynamo  # noqa: E402, F401  (before tensorflow: see test_modes.py)
from jax.test_util import check_grads  # noqa: E402

jax.config.update("jax_enable_x64", True)

func = torch.func
fwAD = torch.autograd.forward_ad
t_softmax = functools.partial(torch.softmax, dim=-1)
W = np.arange(4.0)


def f64(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g)


def rng(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def t_loss(sm):
    w = torch.arange(4.0, dtype=torch.float64)
    return lambda x: ((sm(x) * w) ** 2).sum()


def j_loss(sm):
    return lambda x: jnp.sum((sm(x) * W) ** 2)


# --- torch ---


def test_eager_dual_tensors_go_through_the_jvp_kernel():
    x, t = f64(3, 4), f64(3, 4, seed=1)
    with fwAD.dual_level():
        y = fwAD.unpack_dual(K.softmax(fwAD.make_dual(x, t)))
        ref = fwAD.unpack_dual(t_softmax(fwAD.make_dual(x, t)))
        torch.testing.assert_close(y.primal, ref.primal)
        torch.testing.assert_close(y.tangent, ref.tangent)
        # requiring grad too: forward and reverse on one call
        xr = x.clone().requires_grad_()
        y = K.softmax(fwAD.make_dual(xr, t))
        torch.testing.assert_close(fwAD.unpack_dual(y).tangent, ref.tangent)
        (g,) = torch.autograd.grad(fwAD.unpack_dual(y).primal.sum(), xr)
        torch.testing.assert_close(g, torch.zeros_like(x), atol=1e-12, rtol=0)


def test_torch_func_jvp_jacfwd_and_hessian_equal_torchs():
    x, t = f64(3, 4), f64(3, 4, seed=1)
    out, tan = func.jvp(K.softmax, (x,), (t,))
    rout, rtan = func.jvp(t_softmax, (x,), (t,))
    torch.testing.assert_close(out, rout)
    torch.testing.assert_close(tan, rtan)
    torch.testing.assert_close(func.jacfwd(K.softmax)(x), func.jacfwd(t_softmax)(x))
    torch.testing.assert_close(func.jacfwd(K.softmax)(x), func.jacrev(K.softmax)(x))
    # second order: forward over reverse (softmax_backward's jvp) and forward over forward
    # (softmax_jvp's jvp)
    torch.testing.assert_close(func.hessian(t_loss(K.softmax))(x), func.hessian(t_loss(t_softmax))(x))
    torch.testing.assert_close(
        func.jacfwd(func.jacfwd(t_loss(K.softmax)))(x), func.hessian(t_loss(t_softmax))(x)
    )
    torch.testing.assert_close(func.vmap(func.jacfwd(K.softmax))(x[:, None]), func.vmap(func.jacfwd(t_softmax))(x[:, None]))


def test_torch_gradcheck_forward_and_reverse_against_finite_differences():
    x = f64(3, 4).requires_grad_()
    assert torch.autograd.gradcheck(K.softmax, (x,), check_forward_ad=True, check_backward_ad=True)
    y = torch.softmax(f64(3, 4, seed=2), -1).requires_grad_()
    g = f64(3, 4, seed=3).requires_grad_()
    # softmax_backward and softmax_jvp: forward mode by their jvp (softmax_backward_jvp);
    # reverse mode would need a backward, which neither names
    for k in (K.softmax_backward, K.softmax_jvp):
        assert torch.autograd.gradcheck(k, (y, g), check_forward_ad=True, check_backward_ad=False)


def test_torch_forward_mode_without_a_jvp_is_refused_in_its_words():
    x, w = f64(3, 4), torch.ones(4, dtype=torch.float64)
    no_jvp = r"rms_norm: no forward-mode derivative \(jvp\): the kernel names no jvp.* give rms_norm a jvp"
    with pytest.raises(RuntimeError, match=no_jvp):
        func.jvp(lambda a: K.rms_norm(a, w, 1e-5), (x,), (x,))
    with pytest.raises(RuntimeError, match=no_jvp):
        func.jacfwd(lambda a: K.rms_norm(a, w, 1e-5))(x)
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match=r"rms_norm: argument 'x' is a dual tensor .* names no jvp"):
            K.rms_norm(fwAD.make_dual(x, x), w, 1e-5)
        # requiring grad too: the op's autograd, refused the same way (was torch's "jvp" error)
        with pytest.raises(RuntimeError, match=r"layer_norm: argument 'x' is a dual tensor .* names no jvp"):
            K.layer_norm(fwAD.make_dual(x.clone().requires_grad_(), x), w, w)


def test_torch_third_order_is_refused_as_first_order_only():
    x = f64(3, 4)
    # jacfwd of the hessian: softmax_backward_jvp would need a jvp of its own
    with pytest.raises(RuntimeError, match=r"softmax_backward_jvp: no forward-mode derivative .* first order only"):
        func.jacfwd(func.hessian(t_loss(K.softmax)))(x)
    # double backward stays refused: softmax_backward names no backward
    xr = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"softmax_backward: no autograd formula: .* first order only"):
        torch.autograd.gradgradcheck(K.softmax, (xr,))


# --- jax ---


def test_jax_jvp_jacfwd_and_hessian_under_jit_equal_jnp():
    x, t = rng(3, 4), rng(3, 4, seed=1)
    out, tan = jax.jit(lambda x, t: jax.jvp(K.softmax, (x,), (t,)))(x, t)
    rout, rtan = jax.jvp(jax.nn.softmax, (x,), (t,))
    np.testing.assert_allclose(out, rout, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(tan, rtan, rtol=1e-10, atol=1e-14)
    ref_jac = jax.jacfwd(jax.nn.softmax)(x)
    for jac in (jax.jacfwd, jax.jacrev):
        np.testing.assert_allclose(jax.jit(jac(K.softmax))(x), ref_jac, rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(jac(K.softmax)(x), ref_jac, rtol=1e-10, atol=1e-14)
    ref_hess = jax.hessian(j_loss(jax.nn.softmax))(x)
    np.testing.assert_allclose(jax.jit(jax.hessian(j_loss(K.softmax)))(x), ref_hess, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(jax.hessian(j_loss(K.softmax))(x), ref_hess, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(
        jax.jit(jax.jacfwd(jax.jacfwd(j_loss(K.softmax))))(x), ref_hess, rtol=1e-9, atol=1e-12
    )
    # batched: vmap of each transform (the kernels' own vmap rules underneath)
    xs = rng(2, 3, 4, seed=4)
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.jacfwd(K.softmax)))(xs), jax.vmap(jax.jacfwd(jax.nn.softmax))(xs), rtol=1e-10, atol=1e-14
    )
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.hessian(j_loss(K.softmax))))(xs),
        jax.vmap(jax.hessian(j_loss(jax.nn.softmax)))(xs),
        rtol=1e-9,
        atol=1e-12,
    )
    # reverse mode still: grad is the transpose of the jvp, computed by softmax_backward
    np.testing.assert_allclose(
        jax.jit(jax.grad(j_loss(K.softmax)))(x), jax.grad(j_loss(jax.nn.softmax))(x), rtol=1e-10, atol=1e-14
    )


def test_jax_check_grads_against_finite_differences():
    x = rng(3, 4)
    check_grads(K.softmax, (x,), order=1, modes=("fwd", "rev"))
    check_grads(jax.jit(K.softmax), (x,), order=1, modes=("fwd", "rev"))
    check_grads(j_loss(K.softmax), (x,), order=2, modes=("fwd",))
    y, g = np.asarray(jax.nn.softmax(rng(3, 4, seed=2))), rng(3, 4, seed=3)
    check_grads(K.softmax_backward, (y, g), order=1, modes=("fwd",))
    check_grads(jax.jit(K.softmax_jvp), (y, g), order=1, modes=("fwd",))


def test_jax_what_no_kernel_computes_is_refused_in_its_words():
    x = rng(3, 4)
    # a kernel with a backward and no jvp: forward mode names what to add
    no_jvp = r"rms_norm: no forward-mode derivative \(jvp\): the kernel names no jvp.* give rms_norm a jvp"
    for f in (
        lambda: jax.jvp(lambda a: K.rms_norm(a, jnp.ones(4), 1e-5), (x,), (x,)),
        lambda: jax.jit(jax.jacfwd(lambda a: K.rms_norm(a, jnp.ones(4), 1e-5)))(x),
        lambda: jax.hessian(lambda a: jnp.sum(K.rms_norm(a, jnp.ones(4), 1e-5) ** 2))(x),
    ):
        with pytest.raises(TypeError, match=no_jvp):
            f()
    # reverse over reverse: softmax_backward names a jvp but no backward
    first_order = r"softmax_backward: no backward: the kernel names a jvp only.* softmax are first order only"
    with pytest.raises(TypeError, match=first_order):
        jax.grad(lambda x: jnp.sum(jax.grad(j_loss(K.softmax))(x) ** 2))(x)
    # third order: softmax_backward_jvp names no jvp
    with pytest.raises(TypeError, match=r"softmax_backward_jvp: no forward-mode derivative .* first order only"):
        jax.jacfwd(jax.hessian(j_loss(K.softmax)))(x)
    # a jvp kernel without a backward: reverse mode through it refused
    y = np.asarray(jax.nn.softmax(x))
    with pytest.raises(TypeError, match=r"softmax_jvp: no backward: the kernel names a jvp only"):
        jax.grad(lambda g: jnp.sum(K.softmax_jvp(y, g)))(x)


# --- declaration ---


def test_help_names_the_jvp():
    assert "Jvp: softmax_jvp(out, tangent_x) gives the tangent of the result." in K.softmax.__doc__
    assert "No jvp: forward-mode derivatives through it are refused." in K.rms_norm.__doc__


def test_a_jvp_is_declared_with_known_names():
    def f(x, w):
        return x

    with pytest.raises(ValueError, match=r"jvp argument 'tangent_v' is unknown .* tangent_x, tangent_w"):
        dlbridge.kernels.kernel(f, jvp=(K.softmax_jvp, ("out", "tangent_v")))
    with pytest.raises(ValueError, match=r"jvp=.*give \(kernel, args\) or a callable"):
        dlbridge.kernels.kernel(f, jvp=(K.softmax_jvp,))
    with pytest.raises(ValueError, match="jvp= with mutates="):
        dlbridge.kernels.kernel(f, mutates=("x",), jvp=lambda named: named["tangent_x"])
    # with several results, the jvp reads them by name too (tests/test_jvp_results.py)
    with pytest.raises(ValueError, match=r"jvp argument 'tangent_a' is unknown \(a parameter, 'out', 'a', 'b', or"):
        dlbridge.kernels.kernel(
            f, results=("a", "b"), result_rule=lambda s, d, a: [(s[0], d[0])] * 2, jvp=(K.softmax_jvp, ("a", "tangent_a"))
        )


def test_a_callable_jvp_serves_torch_forward_mode():
    """A kernel made from Python with a callable jvp (no handler: torch only)."""

    def cube(x):
        return x**3

    k = dlbridge.kernels.kernel(
        cube,
        name="cube",
        namespace="dlbridge_forward_tests",
        jvp=lambda n: 3 * n["x"] ** 2 * n["tangent_x"],
        backward=lambda n: {"x": 3 * n["x"] ** 2 * n["grad"]},
    )
    x, t = f64(5), f64(5, seed=1)
    _, tan = func.jvp(k, (x,), (t,))
    torch.testing.assert_close(tan, 3 * x**2 * t)
    torch.testing.assert_close(func.jacfwd(k)(x), torch.diag(3 * x**2))
    assert torch.autograd.gradcheck(k, (x.clone().requires_grad_(),), check_forward_ad=True)
