"""Optional tensors and lists of tensors (KernelDef.optional, KernelDef.lists): scale_shift(x,
weight, bias=None) and accumulate(x, xs, weights), in every mode: eager on numpy, torch and jax;
jax.jit, vmap and grad; torch autograd, torch.compile(fullgraph=True), the torch op called
directly and torch.library.opcheck; help(); errors in the author's terms."""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge.kernels
import dlbridge_kernels as K


def data(seed=0):
    g = np.random.default_rng(seed)
    x = g.standard_normal((4, 3)).astype(np.float32)
    w = g.standard_normal(3).astype(np.float32)
    b = g.standard_normal(3).astype(np.float32)
    return x, w, b


def ref_scale_shift(x, w, b=None):
    return x * w + (0 if b is None else b)


def ref_accumulate(x, xs, ws):
    return x + sum(wi * xi for wi, xi in zip(ws, xs))


def terms(n=3, seed=1):
    g = np.random.default_rng(seed)
    x = g.standard_normal((2, 5)).astype(np.float32)
    xs = [g.standard_normal((2, 5)).astype(np.float32) for _ in range(n)]
    return x, xs, g.standard_normal(n).astype(np.float32)


# --- eager ---


@pytest.mark.parametrize("with_bias", [False, True])
def test_eager_numpy_optional(with_bias):
    x, w, b = data()
    b = b if with_bias else None
    got = K.scale_shift(x, w, b) if with_bias else K.scale_shift(x, w)
    assert type(got) is np.ndarray
    np.testing.assert_allclose(got, ref_scale_shift(x, w, b), rtol=1e-6)
    np.testing.assert_allclose(K.scale_shift(x, w, bias=b), ref_scale_shift(x, w, b), rtol=1e-6)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_eager_numpy_list_and_tuple(n):
    x, xs, ws = terms(n)
    np.testing.assert_allclose(K.accumulate(x, xs, ws), ref_accumulate(x, xs, ws), rtol=1e-6)
    np.testing.assert_allclose(K.accumulate(x, tuple(xs), ws), ref_accumulate(x, xs, ws), rtol=1e-6)


def test_eager_torch_and_jax():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    x, w, b = data()
    t = K.scale_shift(torch.from_numpy(x), torch.from_numpy(w), None)
    assert isinstance(t, torch.Tensor)
    np.testing.assert_allclose(t.numpy(), ref_scale_shift(x, w), rtol=1e-6)
    j = K.scale_shift(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b))
    np.testing.assert_allclose(np.asarray(j), ref_scale_shift(x, w, b), rtol=1e-6)
    x, xs, ws = terms()
    t = K.accumulate(torch.from_numpy(x), [torch.from_numpy(a) for a in xs], torch.from_numpy(ws))
    np.testing.assert_allclose(t.numpy(), ref_accumulate(x, xs, ws), rtol=1e-6)
    j = K.accumulate(jnp.asarray(x), [jnp.asarray(a) for a in xs], jnp.asarray(ws))
    np.testing.assert_allclose(np.asarray(j), ref_accumulate(x, xs, ws), rtol=1e-6)


def test_eager_errors_name_the_argument_and_the_item():
    x, w, b = data()
    with pytest.raises(TypeError, match=r"argument 'weight' is None, but the kernel declares 'weight' a tensor, not an optional one"):
        K.scale_shift(x, None)
    with pytest.raises(TypeError, match="bias"):
        K.scale_shift(x, w, b.astype(np.float64))
    x, xs, ws = terms()
    xs[1] = xs[1].astype(np.float64)
    with pytest.raises(TypeError, match=r"(?s)item 1: expected float32.*'xs'"):
        K.accumulate(x, xs, ws)
    with pytest.raises(TypeError, match="list or tuple"):
        K.accumulate(x, xs[0], ws)


# --- jax ---


@pytest.mark.parametrize("with_bias", [False, True])
def test_jax_jit_vmap_grad_optional(with_bias):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x, w, b = (jnp.asarray(a) for a in data())
    args = (x, w, b) if with_bias else (x, w)
    ref = ref_scale_shift(*(np.asarray(a) for a in args))
    np.testing.assert_allclose(jax.jit(K.scale_shift)(*args), ref, rtol=1e-6)
    batched = jax.vmap(K.scale_shift, in_axes=(0,) + (None,) * (len(args) - 1))(jnp.stack([x, 2 * x]), *args[1:])
    np.testing.assert_allclose(batched[1], ref_scale_shift(2 * np.asarray(x), *(np.asarray(a) for a in args[1:])), rtol=1e-6)
    grads = jax.jit(jax.grad(lambda *a: (K.scale_shift(*a) ** 2).sum(), argnums=tuple(range(len(args)))))(*args)
    expect = jax.grad(lambda *a: (ref_scale_shift(*a) ** 2).sum(), argnums=tuple(range(len(args))))(*args)
    assert len(grads) == len(args)
    for g, e in zip(grads, expect):
        np.testing.assert_allclose(g, e, rtol=1e-5)
    from jax.test_util import check_grads

    check_grads(lambda *a: K.scale_shift(*a), args, order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_jax_jit_vmap_list():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x, xs, ws = terms()
    jx, jxs, jws = jnp.asarray(x), [jnp.asarray(a) for a in xs], jnp.asarray(ws)
    np.testing.assert_allclose(jax.jit(K.accumulate)(jx, jxs, jws), ref_accumulate(x, xs, ws), rtol=1e-6)
    # Lists of other lengths: a count attribute each, one compilation each.
    np.testing.assert_allclose(jax.jit(K.accumulate)(jx, jxs[:1], jws[:1]), ref_accumulate(x, xs[:1], ws[:1]), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(K.accumulate)(jx, [], jws[:0]), x, rtol=1e-6)
    # vmap: one list item batched, the others not.
    stacked = jnp.stack([jxs[0], 3 * jxs[0]])
    out = jax.vmap(K.accumulate, in_axes=(None, [0, None, None], None))(jx, [stacked, jxs[1], jxs[2]], jws)
    np.testing.assert_allclose(out[1], ref_accumulate(x, [3 * xs[0], xs[1], xs[2]], ws), rtol=1e-5)


def test_jax_errors_name_the_argument_and_the_item():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x, w, _ = data()
    with pytest.raises(TypeError, match=r"argument 'weight' is None.*optional=\['weight'\]"):
        jax.jit(K.scale_shift)(jnp.asarray(x), None)
    x, xs, ws = terms()
    bad = [jnp.asarray(xs[0]), jnp.asarray(xs[1]).astype(jnp.int32), jnp.asarray(xs[2])]
    with pytest.raises(Exception, match=r"xs\[1\]: expected float32"):
        jax.jit(K.accumulate)(jnp.asarray(x), bad, jnp.asarray(ws))


def test_jax_grad_through_a_list_with_a_python_backward():
    """A list parameter's gradient is a list, one per item (a backward written in the kernel's
    own terms, here a callable over jax or torch arrays)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def backward(named):
        g = named["grad"]
        return {
            "x": g,
            "xs": [named["weights"][i] * g for i in range(len(named["xs"]))],
            "weights": jnp.stack([(g * t).sum() for t in named["xs"]]),
        }

    kern = dlbridge.kernels.kernel(
        K.accumulate.__wrapped__, name="accumulate_grad_jax", lists=["xs"], ffi=K.accumulate._ffi, backward=backward
    )
    x, xs, ws = terms()
    args = (jnp.asarray(x), [jnp.asarray(a) for a in xs], jnp.asarray(ws))
    got = jax.jit(jax.grad(lambda *a: (kern(*a) ** 2).sum(), argnums=(0, 1, 2)))(*args)
    expect = jax.grad(lambda *a: (ref_accumulate(*a) ** 2).sum(), argnums=(0, 1, 2))(*args)
    np.testing.assert_allclose(got[0], expect[0], rtol=1e-5)
    assert len(got[1]) == len(xs)
    for g, e in zip(got[1], expect[1]):
        np.testing.assert_allclose(g, e, rtol=1e-5)
    np.testing.assert_allclose(got[2], expect[2], rtol=1e-5)


# --- torch ---


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def test_torch_autograd_optional(torch):
    x, w, b = (torch.from_numpy(a).double().requires_grad_() for a in data())
    # float32 kernel: gradcheck in float64 cannot run it; compare with torch's own gradients.
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    (K.scale_shift(x32, w32, b32) ** 2).sum().backward()
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    ((xr * wr + br) ** 2).sum().backward()
    for a, r in ((x32, xr), (w32, wr), (b32, br)):
        torch.testing.assert_close(a.grad, r.grad)
    # No bias: its gradient is None, the others right.
    x32.grad = w32.grad = None
    gx, gw = torch.autograd.grad((K.scale_shift(x32, w32) ** 2).sum(), (x32, w32))
    rx, rw = torch.autograd.grad(((xr * wr) ** 2).sum(), (xr, wr))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


def test_torch_autograd_list_with_a_python_backward(torch):
    def backward(named):
        g = named["grad"]
        return {
            "x": g,
            "xs": [named["weights"][i] * g for i in range(len(named["xs"]))],
            "weights": torch.stack([(g * t).sum() for t in named["xs"]]),
        }

    kern = dlbridge.kernels.kernel(
        K.accumulate.__wrapped__, name="accumulate_grad_torch", lists=["xs"], ffi=K.accumulate._ffi, backward=backward
    )
    x, xs, ws = terms()
    tx, tw = torch.from_numpy(x).requires_grad_(), torch.from_numpy(ws).requires_grad_()
    txs = [torch.from_numpy(a).requires_grad_() for a in xs]
    (kern(tx, txs, tw) ** 2).sum().backward()
    rx, rw = tx.detach().clone().requires_grad_(), tw.detach().clone().requires_grad_()
    rxs = [t.detach().clone().requires_grad_() for t in txs]
    ((rx + sum(rw[i] * rxs[i] for i in range(len(rxs)))) ** 2).sum().backward()
    torch.testing.assert_close(tx.grad, rx.grad)
    torch.testing.assert_close(tw.grad, rw.grad)
    for a, r in zip(txs, rxs):
        torch.testing.assert_close(a.grad, r.grad)
    # Compiled, with the backward.
    for t in (tx, tw, *txs):
        t.grad = None
    f = torch.compile(lambda x, xs, w: (kern(x, xs, w) ** 2).sum(), fullgraph=True)
    f(tx, txs, tw).backward()
    torch.testing.assert_close(tx.grad, rx.grad)
    for a, r in zip(txs, rxs):
        torch.testing.assert_close(a.grad, r.grad)


def test_torch_compile_fullgraph(torch):
    x, w, b = (torch.from_numpy(a) for a in data())
    f = torch.compile(lambda x, w, b: K.scale_shift(x, w, b) * 2, fullgraph=True)
    torch.testing.assert_close(f(x, w, b), (x * w + b) * 2)
    torch.testing.assert_close(f(x, w, None), (x * w) * 2)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    g = torch.compile(lambda x, w, b: (K.scale_shift(x, w, b) ** 2).sum(), fullgraph=True)
    g(xr, wr, br).backward()
    xe, we, be = (t.clone().requires_grad_() for t in (x, w, b))
    ((xe * we + be) ** 2).sum().backward()
    torch.testing.assert_close(wr.grad, we.grad)
    torch.testing.assert_close(br.grad, be.grad)
    x, xs, ws = terms()
    h = torch.compile(lambda x, xs, w: K.accumulate(x, xs, w) + 1, fullgraph=True)
    got = h(torch.from_numpy(x), [torch.from_numpy(a) for a in xs], torch.from_numpy(ws))
    np.testing.assert_allclose(got.numpy(), ref_accumulate(x, xs, ws) + 1, rtol=1e-6)


def test_the_torch_op_directly_and_its_schema(torch):
    x, w, b = (torch.from_numpy(a) for a in data())
    op = K.scale_shift._overload
    schema = str(op._schema)
    assert "Tensor? bias=None" in schema, schema
    torch.testing.assert_close(op(x, w, b), x * w + b)
    torch.testing.assert_close(op(x, w), x * w)
    x, xs, ws = terms()
    op = K.accumulate._overload
    assert "Tensor[] xs" in str(op._schema), op._schema
    got = op(torch.from_numpy(x), [torch.from_numpy(a) for a in xs], torch.from_numpy(ws))
    np.testing.assert_allclose(got.numpy(), ref_accumulate(x, xs, ws), rtol=1e-6)


def test_opcheck(torch):
    x, w, b = (torch.from_numpy(a) for a in data())
    x, xs, ws = terms()
    cases = [
        (K.scale_shift, (torch.from_numpy(data()[0]), w, b)),
        (K.scale_shift, (torch.from_numpy(data()[0]), w, None)),
        (K.scale_shift, (torch.from_numpy(data()[0]).requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_())),
        (K.accumulate, (torch.from_numpy(x), [torch.from_numpy(a) for a in xs], torch.from_numpy(ws))),
        (K.accumulate, (torch.from_numpy(x), [], torch.from_numpy(ws[:0]))),
    ]
    for kern, args in cases:
        result = torch.library.opcheck(kern._overload, args)
        assert set(result.values()) == {"SUCCESS"}, (kern, result)


def test_torch_func_optional_and_list(torch):
    x, w, b = (torch.from_numpy(a) for a in data())
    gw = torch.func.grad(lambda w: K.scale_shift(x, w, None).sum())(w)
    torch.testing.assert_close(gw, x.sum(0))
    gb = torch.func.grad(lambda b: K.scale_shift(x, w, b).sum())(b)
    torch.testing.assert_close(gb, torch.full_like(b, x.shape[0]))
    # A list's items are inputs of their own to torch.func (refused before: an autograd.Function
    # saw no tensor inside a list). accumulate names no backward: refused as any such kernel.
    x, xs, ws = terms()
    x, xs, ws = torch.from_numpy(x), [torch.from_numpy(a) for a in xs], torch.from_numpy(ws)
    with pytest.raises(RuntimeError, match="accumulate: no autograd formula"):
        torch.func.grad(lambda xs: K.accumulate(x, xs, ws).sum())(xs)
    def backward(named):
        g = named["grad"]
        return {
            "x": g,
            "xs": [named["weights"][i] * g for i in range(len(named["xs"]))],
            "weights": torch.stack([(g * t).sum() for t in named["xs"]]),
        }

    kern = dlbridge.kernels.kernel(
        K.accumulate.__wrapped__, name="accumulate_grad_func", lists=["xs"], ffi=K.accumulate._ffi, backward=backward
    )
    got = torch.func.grad(lambda x, xs, ws: (kern(x, xs, ws) ** 2).sum(), argnums=(0, 1, 2))(x, xs, ws)
    ref = lambda x, xs, ws: ((x + sum(ws[i] * xs[i] for i in range(len(xs)))) ** 2).sum()  # noqa: E731
    expect = torch.func.grad(ref, argnums=(0, 1, 2))(x, xs, ws)
    torch.testing.assert_close(got[0], expect[0])
    torch.testing.assert_close(got[2], expect[2])
    assert len(got[1]) == len(xs)
    for a, r in zip(got[1], expect[1], strict=True):
        torch.testing.assert_close(a, r)
    out = torch.func.vmap(K.accumulate, in_dims=(None, [0, None, None], None))(x, [torch.stack([xs[0], 2 * xs[0]]), xs[1], xs[2]], ws)
    torch.testing.assert_close(out[1], x + 2 * ws[0] * xs[0] + ws[1] * xs[1] + ws[2] * xs[2])


def test_torch_errors_in_the_authors_terms(torch):
    x, w, b = (torch.from_numpy(a) for a in data())
    with pytest.raises(TypeError, match=r"argument 'weight' is None"):
        K.scale_shift(x.requires_grad_(), None)
    x, xs, ws = terms()
    txs = [torch.from_numpy(a) for a in xs]
    txs[2] = txs[2].double()
    with pytest.raises(TypeError, match=r"item 2: expected float32"):
        K.accumulate(torch.from_numpy(x), txs, torch.from_numpy(ws))


# --- declaration ---


def test_help_shows_the_kinds():
    sig = str(K.scale_shift.__signature__)
    assert "bias: Tensor | None = None" in sig.replace("'", ""), sig
    assert "xs: list[Tensor]" in str(K.accumulate.__signature__).replace("'", "")
    assert "list[Tensor]" in K.accumulate.__doc__


def test_declarations_are_checked():
    def f(x, bias, xs):
        return x

    for kw, words in [
        (dict(optional=["nope"]), "not a tensor parameter"),
        (dict(optional=["bias"], lists=["bias"]), "optional and lists"),
        (dict(optional=["bias"], out="bias"), "optional tensor"),
        (dict(lists=["xs"], out="xs"), "list of tensors"),
        (dict(optional="bias"), "not a string"),
        (dict(attrs={"bias": "float32"}, optional=["bias"]), "not a tensor parameter"),
        (dict(mutates=["x"], out=None, optional=["x"]), "writes in place"),
    ]:
        with pytest.raises(ValueError, match=words):
            dlbridge.kernels.kernel(f, **kw)


# --- the native torch op (torch's stable C ABI: Tensor? boxes and Tensor[] lists decoded in Rust) ---


def test_the_kernels_are_native_ops(torch):
    for kern in (K.scale_shift, K.accumulate):
        kern.torch_op  # made
        assert kern._native_fallback is None, kern._native_fallback
        assert type(kern.torch_op).__name__ == "OpOverloadPacket"


def test_the_native_op_frees_every_box_list_and_handle(torch):
    """Each handle torch gives the kernel (inside an optional's box, a list's items) is deleted
    once: a leaked one would hold its tensor's storage (its use count would grow by one a call);
    one deleted twice would crash. Failing calls (an item of another dtype) free them too."""
    uses = lambda t: torch._C._storage_Use_Count(t.untyped_storage()._cdata)  # noqa: E731
    x, w, b = (torch.from_numpy(a) for a in data())
    x2, xs, ws = terms()
    x2, ws = torch.from_numpy(x2), torch.from_numpy(ws)
    xs = [torch.from_numpy(a) for a in xs]
    every = [x, w, b, x2, ws, *xs]
    before = [uses(t) for t in every]
    bad = [xs[0], xs[1].double(), xs[2]]
    for _ in range(50):
        K.scale_shift._overload(x, w, b)
        K.scale_shift._overload(x, w, None)
        K.accumulate._overload(x2, xs, ws)
        K.accumulate._overload(x2, [], ws[:0])
        with pytest.raises(RuntimeError, match=r"xs\[1\]: expected float32"):
            K.accumulate._overload(x2, bad, ws)
        with pytest.raises(RuntimeError, match="bias: expected float32"):
            K.scale_shift._overload(x, w, b.double())
    assert [uses(t) for t in every] == before


def test_the_native_op_runs_no_python_under_inference_mode(torch):
    import sys

    x, w, b = (torch.from_numpy(a) for a in data())
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename != __file__:
            seen.append(frame.f_code.co_filename)

    with torch.inference_mode():
        sys.setprofile(profile)
        try:
            K.scale_shift._overload(x, w, b)
            K.accumulate._overload(x, [x, x], torch.ones(2))
        finally:
            sys.setprofile(None)
    assert not [f for f in seen if f == dlbridge.kernels.__file__ or "torch/_library/" in f], seen


def test_jax_tracers_inside_a_list_route_the_call_to_jax():
    """Only the list's items are tracers (x and weights are numpy): still the XLA call."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x, xs, ws = terms()
    got = jax.jit(lambda xs: K.accumulate(x, xs, ws))([jnp.asarray(a) for a in xs])
    np.testing.assert_allclose(got, ref_accumulate(x, xs, ws), rtol=1e-6)


def test_torch_func_vmap_with_an_optional(torch):
    x, w, b = (torch.from_numpy(a) for a in data())
    xb = torch.stack([x, 2 * x])
    got = torch.func.vmap(K.scale_shift, in_dims=(0, None, None))(xb, w, b)
    torch.testing.assert_close(got, xb * w + b)
    got = torch.func.vmap(lambda x: K.scale_shift(x, w))(xb)
    torch.testing.assert_close(got, xb * w)


def test_jax_vmap_of_a_batched_optional_and_of_the_gradient():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x, w, b = (jnp.asarray(a) for a in data())
    bb = jnp.stack([b, 2 * b])
    got = jax.jit(jax.vmap(K.scale_shift, in_axes=(None, None, 0)))(x, w, bb)
    np.testing.assert_allclose(got[1], ref_scale_shift(np.asarray(x), np.asarray(w), 2 * np.asarray(b)), rtol=1e-6)
    # vmap of grad: the backward batched through the linear call's rule.
    g = jax.vmap(jax.grad(lambda b: (K.scale_shift(x, w, b) ** 2).sum()))(bb)
    want = jax.vmap(jax.grad(lambda b: (ref_scale_shift(x, w, b) ** 2).sum()))(bb)
    np.testing.assert_allclose(g, want, rtol=1e-5)
