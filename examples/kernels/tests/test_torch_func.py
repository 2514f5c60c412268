"""torch.func over the example kernels (vmap through the op's vmap rule, grad/jacrev through an
autograd.Function with setup_context), each checked against the same computation written with
torch's own operations; a kernel without a backward is refused in dlbridge's words. (Before:
vmap raised "Batching rule not implemented for aten::is_pinned", grad "must override
setup_context".)"""

from __future__ import annotations

import functools

import pytest

import dlbridge_kernels as K

torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402, F401  (before tensorflow: see test_modes.py)

func = torch.func
softmax = functools.partial(torch.softmax, dim=-1)


def f64(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g)


def test_vmap_equals_torch():
    x = f64(5, 3, 4)
    torch.testing.assert_close(func.vmap(K.softmax)(x), softmax(x))
    # a batch dimension that is not the first: each element is a strided slice
    torch.testing.assert_close(func.vmap(K.softmax, in_dims=1)(x), softmax(x.transpose(0, 1)))
    a, b = f64(5, 7, seed=1), f64(5, 7, seed=2)
    torch.testing.assert_close(func.vmap(lambda p, q: K.saxpy(2.0, p, q))(a, b), 2 * a + b)
    # only one argument batched
    torch.testing.assert_close(func.vmap(lambda p: K.saxpy(2.0, p, b[0]))(a), 2 * a + b[0])
    w, bias = f64(4, seed=3), f64(4, seed=4)
    ref = torch.nn.functional.layer_norm(x, (4,), w, bias, eps=1e-5)
    torch.testing.assert_close(func.vmap(lambda t: K.layer_norm(t, w, bias))(x), ref)
    # nested
    torch.testing.assert_close(func.vmap(func.vmap(K.softmax))(f64(2, 5, 3, 4)), softmax(f64(2, 5, 3, 4)))


def test_vmap_of_an_in_place_kernel_writes_each_element():
    x = torch.arange(12.0).reshape(3, 4)
    y = torch.ones(3, 4)
    func.vmap(lambda p, q: K.saxpy_(2.0, p, q))(x, y)
    assert torch.equal(y, 2 * torch.arange(12.0).reshape(3, 4) + 1)
    yt = torch.ones(4, 3)  # batched along dimension 1: strided elements, written back
    func.vmap(lambda p, q: K.saxpy_(2.0, p, q), in_dims=(0, 1))(x, yt)
    assert torch.equal(yt, (2 * torch.arange(12.0).reshape(3, 4) + 1).T)
    with pytest.raises(RuntimeError, match="'y' is written in place but is not batched while 'x' is"):
        func.vmap(lambda p: K.saxpy_(2.0, p, torch.ones(4)))(x)


def test_grad_and_jacrev_equal_torch():
    x = f64(3, 4)
    wt = f64(3, 4, seed=5)
    torch.testing.assert_close(
        func.grad(lambda a: (K.softmax(a) * wt).sum())(x), func.grad(lambda a: (softmax(a) * wt).sum())(x)
    )
    torch.testing.assert_close(func.jacrev(K.softmax)(x), func.jacrev(softmax)(x))
    xs = f64(6, 3, 4, seed=6)
    torch.testing.assert_close(
        func.vmap(func.grad(lambda a: (K.softmax(a) * wt).sum()))(xs),
        func.vmap(func.grad(lambda a: (softmax(a) * wt).sum()))(xs),
    )
    # grad of a function mixing the kernel with torch ops, and the eager autograd still agrees
    g = func.grad(lambda a: K.softmax(a.sin() * 2)[:, 0].sum())(x)
    xr = x.clone().requires_grad_()
    K.softmax(xr.sin() * 2)[:, 0].sum().backward()
    torch.testing.assert_close(g, xr.grad)


def test_grad_through_a_kernel_without_a_backward_is_refused_in_its_words():
    x, w, b = f64(3, 4), torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="layer_norm: no autograd formula: the kernel names no backward"):
        func.grad(lambda a: K.layer_norm(a, w, b).sum())(x)
    with pytest.raises(RuntimeError, match="layer_norm: no autograd formula"):
        func.jacrev(lambda a: K.layer_norm(a, w, b))(x)


def test_second_order_through_a_first_order_backward_is_refused():
    """softmax's backward kernel names no backward: grad of grad says so (never zeros)."""
    x = f64(3, 4)
    with pytest.raises(RuntimeError, match="softmax_backward: no autograd formula: softmax_backward is the backward of softmax"):
        func.grad(lambda a: func.grad(lambda b: K.softmax(b)[:, 0].sum())(a).sum())(x)


def test_opcheck_passes_on_every_op():
    x = f64(3, 4).requires_grad_()
    w, b = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    cases = [
        (K.softmax, (x,)),
        (K.softmax_backward, (x.detach(), f64(3, 4, seed=1))),
        (K.saxpy, (2.0, f64(4), f64(4, seed=1))),
        (K.saxpy_, (2.0, torch.ones(3), torch.ones(3))),
        (K.layer_norm, (x.detach(), w, b, 1e-5)),
    ]
    for k, args in cases:
        result = torch.library.opcheck(k.torch_op, args)
        assert set(result.values()) == {"SUCCESS"}, (k, result)


def test_gradcheck_with_batched_grad():
    """gradcheck's check_batched_grad differentiates through torch's legacy vmap
    (torch._vmap_internals), whose batched tensors are not torch.func's: the kernel's op takes them
    too (torch's per-example fallback), so the batched gradients equal the unbatched ones. (Before:
    BufferError "Batching rule not implemented for aten::is_pinned" from the backward kernel.)"""
    x = f64(3, 4).requires_grad_()
    assert torch.autograd.gradcheck(K.softmax, (x,), check_batched_grad=True)
    w = f64(4, seed=6).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: K.rms_norm(a, b, 1e-6), (x, w), check_batched_grad=True)
