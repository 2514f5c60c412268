"""Gradients through the example kernels are right or refused, never silently wrong: eagerly,
under torch.compile and under jax.grad, each case checked against the same computation written
with the framework's own operations (or, for a refusal, against what the framework does with its
own custom op that has no autograd formula)."""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge_kernels as K
from dlbridge.tests.libs import skip_before_torch

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
import torch._dynamo  # noqa: E402, F401  (before tensorflow: see test_modes.py)

# AOTAutograd traces the backward with anomaly mode on, which warns before our refusal propagates.
pytestmark = pytest.mark.filterwarnings("ignore:Error detected in:UserWarning")

jax.config.update("jax_enable_x64", True)

NO_BACKWARD = r"saxpy: no autograd formula: the kernel names no backward"
FIRST_ORDER = r"softmax_backward: no autograd formula: softmax_backward is the backward of softmax .* first order only"


def f64(*shape, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_(requires_grad)


# torch's own answer for a custom op without an autograd formula: the call works, backward raises.
@torch.library.custom_op("dlbridge_grad_tests::saxpy_ref", mutates_args=())
def saxpy_ref(a: float, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return a * x + y


@saxpy_ref.register_fake
def _(a, x, y):
    return torch.empty_like(x)


# --- a kernel without a backward ---


def test_a_kernel_without_a_backward_refuses_the_backward_as_torchs_own_custom_op_does():
    # The reproducer: y = saxpy(2, x, z) + x gave x.grad == 1 (the saxpy term cut off), not 3.
    x, z = f64(5, requires_grad=True), f64(5, seed=1)
    y = K.saxpy(2.0, x, z) + x
    torch.testing.assert_close(y, 3 * x + z)  # the forward is right, and the call is allowed
    assert y.requires_grad
    with pytest.raises(RuntimeError, match=NO_BACKWARD):
        y.sum().backward()
    assert x.grad is None  # nothing half-accumulated
    # torch's own custom op without an autograd formula: the same place, the same words
    ref = saxpy_ref(2.0, x, z) + x
    with pytest.raises(RuntimeError, match="no autograd formula"):
        ref.sum().backward()
    # an input that requires grad in any position, passed by keyword too
    with pytest.raises(RuntimeError, match=NO_BACKWARD):
        K.saxpy(2.0, z, y=x).sum().backward()
    with pytest.raises(RuntimeError, match="layer_norm: no autograd formula"):
        K.layer_norm(f64(3, 4, requires_grad=True), f64(4), f64(4)).sum().backward()


def test_a_kernel_without_a_backward_is_refused_under_torch_compile():
    x, z = f64(5, requires_grad=True), f64(5, seed=1)
    for fullgraph in (False, True):
        torch._dynamo.reset()
        f = torch.compile(lambda x, z: K.saxpy(2.0, x, z) + x, fullgraph=fullgraph)
        # AOTAutograd traces the backward when it compiles: the refusal comes at the first call,
        # as it does for torch's own custom op without autograd
        with pytest.raises(Exception, match=NO_BACKWARD):
            f(x, z).sum().backward()
        assert x.grad is None
    torch._dynamo.reset()
    with pytest.raises(Exception, match="no autograd formula"):
        torch.compile(lambda x, z: saxpy_ref(2.0, x, z) + x)(x, z).sum().backward()


def test_an_nn_module_with_parameters_is_refused_not_left_untrained():
    class Norm(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, n, dtype=torch.float64))
            self.bias = torch.nn.Parameter(torch.linspace(-1, 1, n, dtype=torch.float64))

        def forward(self, x):
            return K.layer_norm(x, self.weight, self.bias, eps=1e-5)

    m, x = Norm(6), f64(4, 6)
    ref = torch.nn.functional.layer_norm(x, (6,), m.weight, m.bias, eps=1e-5)
    torch.testing.assert_close(m(x), ref)
    # Before, loss.backward() passed and left weight.grad None: an optimizer never moved them.
    with pytest.raises(RuntimeError, match="layer_norm: no autograd formula"):
        (m(x) ** 2).sum().backward()
    assert m.weight.grad is None and m.bias.grad is None
    # inference needs no gradient: no error, torch's values
    with torch.no_grad():
        out = m(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, ref.detach())
    with torch.inference_mode():
        torch.testing.assert_close(m(x), ref.detach())
    # compiled: refused as well (AOTAutograd traces the backward at the first call)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="layer_norm: no autograd formula"):
        (torch.compile(m)(x) ** 2).sum().backward()
    assert m.weight.grad is None and m.bias.grad is None


def test_an_nn_module_calling_softmax_trains_as_torchs_softmax_does():
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, 7, dtype=torch.float64))

        def forward(self, x, sm):
            return sm(x * self.scale) @ torch.arange(7.0, dtype=torch.float64)

    ours, compiled, theirs = Attn(), Attn(), Attn()
    x = f64(5, 7)
    torch._dynamo.reset()
    step = torch.compile(lambda m, x: (m(x, K.softmax) ** 2).sum(), fullgraph=True)
    for loss, m in (
        (lambda m: (m(x, K.softmax) ** 2).sum(), ours),
        (lambda m: step(m, x), compiled),
        (lambda m: (m(x, lambda t: torch.softmax(t, -1)) ** 2).sum(), theirs),
    ):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            loss(m).backward()
            opt.step()
    for m in (ours, compiled):
        torch.testing.assert_close(m.scale.grad, theirs.scale.grad)
        torch.testing.assert_close(m.scale, theirs.scale)
    assert not torch.equal(ours.scale.detach(), torch.linspace(0.5, 2.0, 7, dtype=torch.float64))


def test_no_error_without_a_gradient_to_compute():
    x, z = f64(5, requires_grad=True), f64(5, seed=1)
    # inputs that do not require grad, in grad mode
    out = K.saxpy(2.0, x.detach(), z)
    assert not out.requires_grad
    torch.testing.assert_close(out, 2 * x.detach() + z)
    # under no_grad and inference_mode, inputs that require grad included
    with torch.no_grad():
        torch.testing.assert_close(K.saxpy(2.0, x, z), 2 * x + z)
        y = torch.zeros(5)
        K.saxpy_(2.0, x.float(), y)
        torch.testing.assert_close(y, 2 * x.float())
    with torch.inference_mode():
        torch.testing.assert_close(K.layer_norm(x.reshape(1, 5), x, z), torch.nn.functional.layer_norm(x.reshape(1, 5), (5,), x, z))
    # compiled, no gradient needed
    torch._dynamo.reset()
    f = torch.compile(lambda x, z: K.saxpy(2.0, x, z) + x, fullgraph=True)
    torch.testing.assert_close(f(x.detach(), z), 3 * x.detach() + z)
    with torch.no_grad():
        torch.testing.assert_close(f(x, z), 3 * x + z)


# --- in place ---


def test_an_in_place_kernel_refuses_an_argument_that_requires_grad():
    # Autograd cannot record the kernel's write: y = t * 1; saxpy_(2, x, y); y.sum().backward()
    # gave t.grad right and x.grad None (2 expected), silently. torch's own in-place custom op
    # without autograd does the same, so the kernel refuses at the call instead.
    t = torch.ones(4, requires_grad=True)
    x = torch.ones(4, requires_grad=True)
    for xs, y in ((x, t * 1), (x, torch.zeros(4)), (x.detach(), t * 1)):
        before = y.detach().clone()
        with pytest.raises(RuntimeError, match=r"saxpy_: argument '[xy]' requires grad, but saxpy_ writes 'y' in place"):
            K.saxpy_(2.0, xs, y)
        assert torch.equal(y.detach(), before)  # refused before writing
        for fullgraph in (False, True):
            torch._dynamo.reset()
            g = torch.compile(lambda a, b: K.saxpy_(2.0, a, b), fullgraph=fullgraph)
            with pytest.raises(Exception, match=r"argument '[xy]' requires grad, but saxpy_ writes 'y' in place"):
                g(xs, y)
            assert torch.equal(y.detach(), before)
    assert t.grad is None and x.grad is None


# --- a backward, and its backward ---


def test_softmax_gradients_equal_torchs_eager_and_compiled():
    w = torch.arange(12.0, dtype=torch.float64).reshape(3, 4)
    xk, xt, xc = f64(3, 4, requires_grad=True), f64(3, 4, requires_grad=True), f64(3, 4, requires_grad=True)
    ((K.softmax(xk) * w) ** 2).sum().backward()
    ((torch.softmax(xt, -1) * w) ** 2).sum().backward()
    torch._dynamo.reset()
    torch.compile(lambda x: ((K.softmax(x) * w) ** 2).sum(), fullgraph=True)(xc).backward()
    torch.testing.assert_close(xk.grad, xt.grad)
    torch.testing.assert_close(xc.grad, xt.grad)


def test_softmax_double_backward_is_refused_as_first_order_only():
    x = f64(3, 4, requires_grad=True)
    # The reproducer: gradgradcheck failed (the backward kernel's result carried no graph, so the
    # second derivative came out as if the gradient were constant).
    with pytest.raises(RuntimeError, match=FIRST_ORDER):
        torch.autograd.gradgradcheck(K.softmax, (x,))
    # create_graph=True: the first-order gradient is still right (torch's), the second refused
    w = torch.arange(4.0, dtype=torch.float64)
    (gk,) = torch.autograd.grad(((K.softmax(x) * w) ** 2).sum(), x, create_graph=True)
    (gt,) = torch.autograd.grad(((torch.softmax(x, -1) * w) ** 2).sum(), x, create_graph=True)
    torch.testing.assert_close(gk, gt)
    assert gk.requires_grad
    with pytest.raises(RuntimeError, match=FIRST_ORDER):
        (gk**2).sum().backward()
    assert x.grad is None
    # without create_graph: first order, no error
    torch.autograd.grad(((K.softmax(x) * w) ** 2).sum(), x)


def test_compiled_double_backward_is_refused_as_torch_refuses_its_own():
    # Before 2.13, torch.compile hands back a custom op's first-order gradient (create_graph=True)
    # without a graph: torch's own custom_op too (seen on 2.11 and 2.12), so the double backward
    # fails on a gradient that "does not require grad" instead of being refused.
    skip_before_torch((2, 13), "torch.compile drops the graph of a custom op's create_graph "
                      "gradient (torch.library.custom_op's too), where later releases refuse the "
                      "double backward")
    w = torch.arange(4.0, dtype=torch.float64)
    for sm in (K.softmax, lambda t: torch.softmax(t, -1)):
        torch._dynamo.reset()
        x = f64(3, 4, requires_grad=True)
        r = torch.compile(lambda x: ((sm(x) * w) ** 2).sum())(x)
        (g,) = torch.autograd.grad(r, x, create_graph=True)
        with pytest.raises(RuntimeError, match="does not currently support double backward"):
            (g**2).sum().backward()


def test_forward_mode_ad_without_a_jvp_is_refused_not_dropped():
    # A dual tensor's tangent was dropped silently (the result had none), as torch's own custom
    # op without a jvp drops it; a kernel that names no jvp refuses it (softmax names one:
    # test_forward_mode.py).
    import torch.autograd.forward_ad as fwAD

    x, z, m = f64(4), f64(4, seed=1), f64(2, 4, seed=2)
    w, b = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    with fwAD.dual_level():
        d = fwAD.make_dual(x, torch.ones(4, dtype=torch.float64))
        with pytest.raises(RuntimeError, match=r"saxpy: argument 'x' is a dual tensor \(forward-mode AD\).* names no jvp"):
            K.saxpy(2.0, d, z)
        dm = fwAD.make_dual(m, torch.ones(2, 4, dtype=torch.float64))
        with pytest.raises(RuntimeError, match=r"layer_norm: argument 'x' is a dual tensor"):
            K.layer_norm(dm, w, b)
        # requiring grad too: refused in the same words (was torch's NotImplementedError "jvp")
        dr = fwAD.make_dual(m.clone().requires_grad_(), torch.ones(2, 4, dtype=torch.float64))
        with pytest.raises(RuntimeError, match=r"layer_norm: argument 'x' is a dual tensor"):
            K.layer_norm(dr, w, b)
        # a tensor without a tangent, inside the level: the kernel, as usual
        torch.testing.assert_close(K.softmax(m), torch.softmax(m, -1))
    with pytest.raises(RuntimeError, match=r"saxpy: no forward-mode derivative \(jvp\): the kernel names no jvp"):
        torch.func.jvp(lambda x: K.saxpy(2.0, x, z), (x,), (torch.ones(4, dtype=torch.float64),))


# --- jax ---


def test_jax_grad_of_a_kernel_without_a_backward_raises_not_zeros():
    x, z = np.arange(4.0), np.ones(4)
    cases = [
        lambda x: jnp.sum(K.saxpy(2.0, x, z) + x),
        lambda x: jnp.sum(K.layer_norm(x.reshape(2, 2), jnp.ones(2), jnp.zeros(2)) ** 2),
        lambda x: jnp.sum(K.saxpy_(2.0, x, jnp.zeros(4))),
    ]
    for f in cases:
        for grad in (jax.grad(f), jax.jit(jax.grad(f))):
            with pytest.raises(ValueError, match=r"FFI call to `dlbridge_(kernels|examples)\..*` cannot be differentiated"):
                grad(x)


def test_jax_grad_of_softmax_equals_jnp_and_reverse_over_reverse_raises():
    x = np.random.default_rng(3).standard_normal((3, 4))
    w = np.arange(4.0)

    def loss(sm):
        return lambda x: jnp.sum((sm(x) * w) ** 2)

    np.testing.assert_allclose(jax.grad(loss(K.softmax))(x), jax.grad(loss(jax.nn.softmax))(x), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(
        jax.jit(jax.grad(loss(K.softmax)))(x), jax.grad(loss(jax.nn.softmax))(x), rtol=1e-10, atol=1e-12
    )
    # second order: forward over reverse through the kernels' jvps (test_forward_mode.py);
    # reverse over reverse needs a backward of softmax's backward, which names none
    np.testing.assert_allclose(jax.hessian(loss(K.softmax))(x), jax.hessian(loss(jax.nn.softmax))(x), rtol=1e-9, atol=1e-12)
    with pytest.raises(TypeError, match="softmax_backward: no backward.* softmax are first order only"):
        jax.grad(lambda x: jnp.sum(jax.grad(loss(K.softmax))(x) ** 2))(x)
