"""The guide's chapter 10 code path: rms_norm with an affine weight as a layer, an nn.Module with
an nn.Parameter under torch.compile(fullgraph=True) with loss.backward(), and a jax training step
under jit(grad(...)), each checked against the framework's own implementation (torch.nn.RMSNorm,
the same layer in jax.numpy)."""

from __future__ import annotations

import pytest

import dlbridge.kernels
import dlbridge_kernels as K


def test_torch_module_compiled_with_backward_matches_torch_rmsnorm():
    torch = pytest.importorskip("torch")
    dlbridge.kernels.torch_ready()

    class RMSNorm(torch.nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, dim, dtype=torch.float64))
            self.eps = eps

        def forward(self, x):
            return K.rms_norm(x, self.weight, self.eps)

    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(16, 16, dtype=torch.float64), RMSNorm(16))
    theirs = torch.nn.Sequential(
        torch.nn.Linear(16, 16, dtype=torch.float64), torch.nn.RMSNorm(16, eps=1e-6, dtype=torch.float64)
    )
    theirs.load_state_dict(ours.state_dict())
    x, target = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    torch._dynamo.reset()
    loss = torch.compile(lambda m, x: torch.nn.functional.mse_loss(m(x), target), fullgraph=True)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for _ in range(3):  # a few training steps: the same parameters all the way
        opt_ours.zero_grad()
        opt_theirs.zero_grad()
        a = loss(ours, x)
        a.backward()
        b = torch.nn.functional.mse_loss(theirs(x), target)
        b.backward()
        torch.testing.assert_close(a, b)
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert p.grad is not None and p.grad.abs().sum() > 0
            torch.testing.assert_close(p.grad, q.grad)
        opt_ours.step()
        opt_theirs.step()
    assert torch._dynamo.explain(lambda m, x: m(x).sum())(ours, x).graph_break_count == 0


def test_jax_training_step_under_jit_grad_matches_jax_numpy():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def rms_norm_jnp(x, w, eps=1e-6):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def loss(params, x, target, norm):
        return jnp.mean((norm(x @ params["dense"], params["weight"]) - target) ** 2)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"dense": jax.random.normal(k1, (16, 16)) / 4, "weight": jnp.linspace(0.5, 1.5, 16)}
    x, target = jax.random.normal(k2, (8, 16)), jax.random.normal(k3, (8, 16))

    def step(norm):
        @jax.jit
        def train_step(params, x, target):
            value, grads = jax.value_and_grad(loss)(params, x, target, norm)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

        return train_step

    ours, theirs = step(K.rms_norm), step(rms_norm_jnp)
    p_ours, p_theirs = params, params
    tol = 1e-10 if p_ours["weight"].dtype == jnp.float64 else 1e-5
    for _ in range(3):
        p_ours, v_ours = ours(p_ours, x, target)
        p_theirs, v_theirs = theirs(p_theirs, x, target)
        assert jnp.allclose(v_ours, v_theirs, rtol=tol)
        for name in params:
            assert jnp.allclose(p_ours[name], p_theirs[name], rtol=tol, atol=tol), name
    assert not jnp.allclose(p_ours["weight"], params["weight"])  # it trained
