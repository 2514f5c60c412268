"""Several results with an optional tensor or a list of tensors (KernelDef.results with
KernelDef.optional / KernelDef.lists): affine_rowsum(x, weight, bias=None) -> (y, total) and
stack_sums(xs) -> (stacked, sums), their result shapes from Rust rules (ParamShapeFn) that read
bias as absent when None and xs as a list. In every mode: eager on numpy, torch and jax; jax.jit,
vmap and grad; torch autograd, torch.compile(fullgraph=True) with backward, torch.func; the native
torch op
(its Meta kernel, opcheck) and the Python custom op the same function gets when declared from
Python (its fake kernel, opcheck). Numbers against numpy, torch and jax computations."""

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


def items(n=3, seed=1):
    g = np.random.default_rng(seed)
    return [g.standard_normal(5).astype(np.float32) for _ in range(n)]


def ref_affine_rowsum(x, w, b=None):
    y = x * w + (0 if b is None else b)
    return y, y.sum(-1)


def ref_stack_sums(xs):
    s = np.stack(xs)
    return s, s.sum(-1)


def close(got, expect, rtol=1e-5, atol=1e-5):
    assert len(got) == len(expect)
    for g, e in zip(got, expect, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=rtol, atol=atol)


@pytest.fixture
def torch():
    t = pytest.importorskip("torch")
    dlbridge.kernels.torch_ready()
    return t


@pytest.fixture
def jax():
    return pytest.importorskip("jax")


# --- eager ---


@pytest.mark.parametrize("with_bias", [False, True])
def test_eager_numpy(with_bias):
    x, w, b = data()
    b = b if with_bias else None
    got = K.affine_rowsum(x, w, b)
    assert type(got) is tuple and all(type(a) is np.ndarray for a in got)
    assert got[1].shape == (4,) and got[1].dtype == np.float32
    close(got, ref_affine_rowsum(x, w, b))


@pytest.mark.parametrize("n", [1, 3])
def test_eager_numpy_list(n):
    xs = items(n)
    got = K.stack_sums(xs)
    assert got[0].shape == (n, 5) and got[1].shape == (n,)
    close(got, ref_stack_sums(xs))
    close(K.stack_sums(tuple(xs)), ref_stack_sums(xs))


def test_eager_torch_and_jax(torch, jax):
    x, w, b = data()
    got = K.affine_rowsum(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b))
    assert all(isinstance(a, torch.Tensor) for a in got)
    close(got, ref_affine_rowsum(x, w, b))
    jnp = jax.numpy
    got = K.affine_rowsum(jnp.asarray(x), jnp.asarray(w))
    assert all(isinstance(a, jax.Array) for a in got)
    close(got, ref_affine_rowsum(x, w))
    xs = items()
    close(K.stack_sums([torch.from_numpy(a) for a in xs]), ref_stack_sums(xs))
    close(K.stack_sums([jnp.asarray(a) for a in xs]), ref_stack_sums(xs))


def test_the_rules_refuse_in_the_authors_terms(torch, jax):
    x, w, b = data()
    with pytest.raises(ValueError, match=r"bias: expected shape \[3\] \(x's row length\), got \[2\]"):
        K.affine_rowsum(x, w, b[:2])
    with pytest.raises(ValueError, match=r"xs\[0\]: expected one 1-d tensor at least"):
        K.stack_sums([])
    with pytest.raises(ValueError, match=r"xs\[1\]: expected shape \[5\]"):
        K.stack_sums([np.ones(5, np.float32), np.ones(4, np.float32)])
    # Under jax.jit the rule runs when the call is traced; it names the kernel and the result.
    with pytest.raises(ValueError, match=r"affine_rowsum: result total: bias: expected shape \[3\]"):
        jax.jit(K.affine_rowsum)(x, w, b[:2])
    with pytest.raises(ValueError, match=r"stack_sums: result stacked: xs\[1\]: expected shape \[5\]"):
        jax.jit(K.stack_sums)([np.ones(5, np.float32), np.ones(4, np.float32)])
    # The native op's Meta kernel runs the same rule.
    with pytest.raises(RuntimeError, match=r"result total: bias: expected shape \[3\]"):
        torch.ops.dlbridge_kernels.affine_rowsum(
            torch.ones(4, 3, device="meta"), torch.ones(3, device="meta"), torch.ones(2, device="meta")
        )


def test_a_rule_given_the_wrong_count_of_shapes_is_refused_naming_the_kernel():
    """The Python face of the Rust rules reads one entry per tensor parameter (a shape, None for
    an absent optional, a list for a list); another count is refused naming the kernel."""
    rule = K.affine_rowsum._result_rule
    assert rule([(4, 3), (3,), None], ["float32", "float32", None], {}) == [([4, 3], "float32"), ([4], "float32")]
    with pytest.raises(ValueError, match=r"affine_rowsum: the result rule got 2 shapes for 3 tensor parameters"):
        rule([(4, 3), (3,)], ["float32", "float32"], {})
    rule = K.stack_sums._result_rule
    assert rule([[(5,), (5,)]], [["float32", "float32"]], {}) == [([2, 5], "float32"), ([2], "float32")]
    with pytest.raises(ValueError, match=r"stack_sums: the result rule got 2 shapes for 1 tensor parameters"):
        rule([[(5,)], [(5,)]], [["float32"], ["float32"]], {})


def test_a_python_rule_giving_the_wrong_count_of_results_is_refused_naming_the_kernel(torch):
    k = dlbridge.kernels.kernel(
        K.affine_rowsum.__wrapped__,
        name="affine_rowsum_wrong",
        namespace="dlbridge_results_params_test",
        optional=["bias"],
        results=("y", "total"),
        result_rule=lambda shapes, dtypes, attrs: [(shapes[0], dtypes[0])],
    )
    x, w, _ = data()
    torch._dynamo.reset()
    c = torch.compile(lambda x, w: k(x, w), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"affine_rowsum_wrong: result_rule gave 1 results, the kernel declares 2"):
        c(torch.from_numpy(x), torch.from_numpy(w))


# --- jax ---


@pytest.mark.parametrize("with_bias", [False, True])
def test_jax_jit_vmap_grad_optional(jax, with_bias):
    jnp = jax.numpy
    x, w, b = (jnp.asarray(a) for a in data())
    b = b if with_bias else None
    close(jax.jit(K.affine_rowsum)(x, w, b), ref_affine_rowsum(*map(np.asarray, (x, w)), None if b is None else np.asarray(b)))
    xb = jnp.stack([x, 2 * x, -x])
    got = jax.vmap(K.affine_rowsum, in_axes=(0, None, None))(xb, w, b)
    expect = jax.vmap(lambda x: (x * w + (0 if b is None else b), (x * w + (0 if b is None else b)).sum(-1)))(xb)
    close(got, expect)

    def loss(f, x, w, b):
        y, total = f(x, w, b)
        return (y * jnp.cos(x)).sum() + (total**2).sum()

    def ref(x, w, b):
        y = x * w + (0 if b is None else b)
        return y, y.sum(-1)

    argnums = (0, 1, 2) if with_bias else (0, 1)
    got = jax.jit(jax.grad(lambda *a: loss(K.affine_rowsum, *a), argnums=argnums))(x, w, b)
    expect = jax.grad(lambda *a: loss(ref, *a), argnums=argnums)(x, w, b)
    close(got, expect)


def test_jax_jit_vmap_grad_list(jax):
    jnp = jax.numpy
    xs = [jnp.asarray(a) for a in items()]
    close(jax.jit(K.stack_sums)(xs), ref_stack_sums([np.asarray(a) for a in xs]))
    batched = [jnp.stack([a, 2 * a]) for a in xs]
    got = jax.vmap(K.stack_sums)(batched)
    assert got[0].shape == (2, 3, 5) and got[1].shape == (2, 3)
    close(got, jax.vmap(lambda l: (jnp.stack(l), jnp.stack(l).sum(-1)))(batched))

    def loss(f, xs):
        s, sums = f(xs)
        return (s * s).sum() + (jnp.sin(sums)).sum()

    got = jax.jit(jax.grad(lambda l: loss(K.stack_sums, l)))(xs)
    expect = jax.grad(lambda l: loss(lambda l: (jnp.stack(l), jnp.stack(l).sum(-1)), l))(xs)
    assert len(got) == len(xs)
    close(got, expect)


# --- torch ---


def torch_loss(torch, y, total, x):
    return (y * x.cos()).sum() + (total**2).sum()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_torch_autograd_and_compile_optional(torch, compiled, with_bias):
    x, w, b = (torch.from_numpy(a) for a in data())
    f = K.affine_rowsum
    if compiled:
        torch._dynamo.reset()
        f = torch.compile(lambda x, w, b: K.affine_rowsum(x, w, b), fullgraph=True)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    xa, wa, ba = leaves
    y, total = f(xa, wa, ba if with_bias else None)
    torch_loss(torch, y, total, xa).backward()
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    yr = xr * wr + (br if with_bias else 0)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(total, yr.sum(-1))
    torch_loss(torch, yr, yr.sum(-1), xr).backward()
    torch.testing.assert_close(xa.grad, xr.grad)
    torch.testing.assert_close(wa.grad, wr.grad)
    if with_bias:
        torch.testing.assert_close(ba.grad, br.grad)
    else:
        assert ba.grad is None


def test_torch_autograd_leaving_the_optional_out(torch):
    """A call without bias at all (the trailing defaulted argument left out)."""
    x, w, _ = (torch.from_numpy(a) for a in data())
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, total = K.affine_rowsum(xa, wa)
    gx, gw = torch.autograd.grad(torch_loss(torch, y, total, xa), (xa, wa))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = xr * wr
    rx, rw = torch.autograd.grad(torch_loss(torch, yr, yr.sum(-1), xr), (xr, wr))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


@pytest.mark.parametrize("compiled", [False, True])
def test_torch_autograd_and_compile_list(torch, compiled):
    xs = [torch.from_numpy(a) for a in items()]
    f = K.stack_sums
    if compiled:
        torch._dynamo.reset()
        f = torch.compile(lambda l: K.stack_sums(l), fullgraph=True)
    la = [t.clone().requires_grad_() for t in xs]
    s, sums = f(la)
    ((s * s).sum() + sums.sin().sum()).backward()
    lr = [t.clone().requires_grad_() for t in xs]
    sr = torch.stack(lr)
    torch.testing.assert_close(s, sr)
    torch.testing.assert_close(sums, sr.sum(-1))
    ((sr * sr).sum() + sr.sum(-1).sin().sum()).backward()
    for a, r in zip(la, lr, strict=True):
        torch.testing.assert_close(a.grad, r.grad)


@pytest.mark.parametrize("with_bias", [False, True])
def test_torch_func_grad_and_vmap_of_grad_optional(torch, with_bias):
    x, w, b = (torch.from_numpy(a) for a in data())

    def loss(f, w, b):
        y, total = f(x, w, b if with_bias else None)
        return (y * x.cos()).sum() + (total**2).sum()

    def ref(x, w, b):
        y = x * w + (0 if b is None else b)
        return y, y.sum(-1)

    got = torch.func.grad(lambda w, b: loss(K.affine_rowsum, w, b), argnums=(0, 1))(w, b)
    expect = torch.func.grad(lambda w, b: loss(ref, w, b), argnums=(0, 1))(w, b)
    torch.testing.assert_close(got[0], expect[0])
    torch.testing.assert_close(got[1], expect[1] if with_bias else torch.zeros_like(b))
    ws = torch.stack([w, 2 * w])
    got = torch.func.vmap(torch.func.grad(lambda w: loss(K.affine_rowsum, w, b)))(ws)
    torch.testing.assert_close(got, torch.func.vmap(torch.func.grad(lambda w: loss(ref, w, b)))(ws))


def test_torch_func_vmap(torch):
    x, w, b = (torch.from_numpy(a) for a in data())
    xb = torch.stack([x, 2 * x])
    y, total = torch.func.vmap(K.affine_rowsum, in_dims=(0, None, None))(xb, w, b)
    torch.testing.assert_close(y, xb * w + b)
    torch.testing.assert_close(total, (xb * w + b).sum(-1))


# --- the native torch op and the Python custom op ---


def test_the_ops_are_native_and_their_meta_kernels_read_the_rules(torch):
    for k in (K.affine_rowsum, K.stack_sums, K.affine_rowsum_backward, K.stack_sums_backward):
        k.torch_op  # made
        assert k._native_fallback is None, k._native_fallback
    meta = lambda *s: torch.ones(*s, device="meta")  # noqa: E731
    y, total = torch.ops.dlbridge_kernels.affine_rowsum(meta(4, 3), meta(3), None)
    assert y.shape == (4, 3) and total.shape == (4,) and total.dtype == torch.float32
    y, total = torch.ops.dlbridge_kernels.affine_rowsum(meta(6, 3), meta(3), meta(3))
    assert total.shape == (6,)
    s, sums = torch.ops.dlbridge_kernels.stack_sums([meta(5), meta(5)])
    assert s.shape == (2, 5) and sums.shape == (2,)
    # The CPU kernel: the handler, its result buffers made by the same rules.
    xs = items(2)
    s, sums = torch.ops.dlbridge_kernels.stack_sums([torch.from_numpy(a) for a in xs])
    close((s, sums), ref_stack_sums(xs))


def test_opcheck_on_the_native_ops(torch):
    x, w, b = (torch.from_numpy(a) for a in data())
    xs = [torch.from_numpy(a) for a in items()]
    g = lambda t: t.clone().requires_grad_()  # noqa: E731
    cases = [
        (K.affine_rowsum, (x, w, b)),
        (K.affine_rowsum, (x, w, None)),
        (K.affine_rowsum, (g(x), g(w), g(b))),
        (K.affine_rowsum, (g(x), g(w), None)),
        (K.stack_sums, (xs,)),
        (K.stack_sums, ([g(t) for t in xs],)),
        (K.affine_rowsum_backward, (x, w, torch.ones_like(x), torch.ones(4))),
    ]
    for kern, args in cases:
        result = torch.library.opcheck(kern._overload, args)
        assert set(result.values()) == {"SUCCESS"}, (kern, result)


def test_declared_from_python_the_custom_ops_fake_kernel_reads_the_same_rules(torch):
    """The same functions, handlers, rules and backwards declared from Python (no native
    registrar): the Python custom op, its fake results from result_rule (bias None, xs a list)."""
    affine = dlbridge.kernels.kernel(
        K.affine_rowsum.__wrapped__,
        name="affine_rowsum_py",
        namespace="dlbridge_results_params_test",
        optional=["bias"],
        ffi=K.affine_rowsum._ffi,
        results=("y", "total"),
        result_rule=K.affine_rowsum._result_rule,
        backward=K.affine_rowsum._backward,
    )
    stack = dlbridge.kernels.kernel(
        K.stack_sums.__wrapped__,
        name="stack_sums_py",
        namespace="dlbridge_results_params_test",
        lists=["xs"],
        ffi=K.stack_sums._ffi,
        results=("stacked", "sums"),
        result_rule=K.stack_sums._result_rule,
        backward=K.stack_sums._backward,
    )
    assert not isinstance(affine.torch_op, type(torch.ops.dlbridge_kernels.affine_rowsum))  # the custom op
    x, w, b = (torch.from_numpy(a) for a in data())
    xs = [torch.from_numpy(a) for a in items()]
    g = lambda t: t.clone().requires_grad_()  # noqa: E731
    for kern, args in [
        (affine, (g(x), g(w), g(b))),
        (affine, (g(x), g(w), None)),
        (stack, ([g(t) for t in xs],)),
    ]:
        result = torch.library.opcheck(kern._overload, args)
        assert set(result.values()) == {"SUCCESS"}, (kern, result)
    torch._dynamo.reset()
    c = torch.compile(lambda x, w, l: (affine(x, w, None), stack(l)), fullgraph=True)
    xa, wa, la = g(x), g(w), [g(t) for t in xs]
    (y, total), (s, sums) = c(xa, wa, la)
    (torch_loss(torch, y, total, xa) + (s * s).sum() + sums.sum()).backward()
    xr, wr, lr = g(x), g(w), [g(t) for t in xs]
    yr, sr = xr * wr, torch.stack(lr)
    (torch_loss(torch, yr, yr.sum(-1), xr) + (sr * sr).sum() + sr.sum(-1).sum()).backward()
    torch.testing.assert_close(xa.grad, xr.grad)
    torch.testing.assert_close(wa.grad, wr.grad)
    for a, r in zip(la, lr, strict=True):
        torch.testing.assert_close(a.grad, r.grad)


def test_help_shows_both_results():
    sig = str(K.affine_rowsum.__signature__).replace("'", "")
    assert "bias: Tensor | None = None" in sig and sig.endswith("-> (Tensor y, Tensor total)"), sig
    sig = str(K.stack_sums.__signature__).replace("'", "")
    assert "xs: list[Tensor]" in sig and sig.endswith("-> (Tensor stacked, Tensor sums)"), sig


# --- torch.func through a list: each item an input of its own ---


def stack_ref(torch, l):
    s = torch.stack(l)
    return s, s.sum(-1)


def test_torch_func_grad_vmap_and_jacrev_through_a_list(torch):
    xs = [torch.from_numpy(a) for a in items()]

    def loss(f, l):
        s, sums = f(l)
        return (s * s).sum() + sums.sin().sum()

    got = torch.func.grad(lambda l: loss(K.stack_sums, l))(xs)
    expect = torch.func.grad(lambda l: loss(lambda l: stack_ref(torch, l), l))(xs)
    assert len(got) == len(xs)
    for a, r in zip(got, expect, strict=True):
        torch.testing.assert_close(a, r)
    batched = [torch.stack([t, 2 * t]) for t in xs]
    got = torch.func.vmap(torch.func.grad(lambda l: loss(K.stack_sums, l)))(batched)
    expect = torch.func.vmap(torch.func.grad(lambda l: loss(lambda l: stack_ref(torch, l), l)))(batched)
    for a, r in zip(got, expect, strict=True):
        torch.testing.assert_close(a, r)
    s, sums = torch.func.vmap(K.stack_sums)(batched)
    torch.testing.assert_close(s, torch.stack(batched, 1))
    torch.testing.assert_close(sums, torch.stack(batched, 1).sum(-1))
    jac = torch.func.jacrev(lambda l: K.stack_sums(l)[1])(xs)
    expect = torch.func.jacrev(lambda l: stack_ref(torch, l)[1])(xs)
    for a, r in zip(jac, expect, strict=True):
        torch.testing.assert_close(a, r)
    # Forward mode needs a jvp: refused in the kernel's terms, a list's dual items too.
    tangents = [torch.ones(5) for _ in xs]
    with pytest.raises(RuntimeError, match="stack_sums: no forward-mode derivative"):
        torch.func.jvp(K.stack_sums, (xs,), (tangents,))
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level(), pytest.raises(RuntimeError, match="argument 'xs' is a dual tensor"):
        K.stack_sums([fwAD.make_dual(a, t) for a, t in zip(xs, tangents, strict=True)])


def stack_sums_with_jvp(name):
    """stack_sums declared with a jvp: it is linear, so its jvp is itself applied to the tangents
    (a list, one per item)."""
    return dlbridge.kernels.kernel(
        K.stack_sums.__wrapped__,
        name=name,
        namespace="dlbridge_results_params_test",
        lists=["xs"],
        ffi=K.stack_sums._ffi,
        results=("stacked", "sums"),
        result_rule=K.stack_sums._result_rule,
        backward=K.stack_sums._backward,
        jvp=lambda named: K.stack_sums(named["tangent_xs"]),
    )


def test_jax_forward_mode_through_a_list_with_a_jvp(jax):
    jnp = jax.numpy
    k = stack_sums_with_jvp("stack_sums_jvp_jax")
    xs = [jnp.asarray(a) for a in items()]
    ts = [jnp.full(5, float(i), jnp.float32) for i in range(len(xs))]
    (s, sums), (ds, dsums) = jax.jvp(k, (xs,), (ts,))
    close((s, sums, ds, dsums), (*ref_stack_sums([np.asarray(a) for a in xs]), np.stack(ts), np.stack(ts).sum(-1)))
    got = jax.jit(jax.jacfwd(lambda l: jnp.sin(k(l)[1])))(xs)
    expect = jax.jacfwd(lambda l: jnp.sin(jnp.stack(l).sum(-1)))(xs)
    close(got, expect)
    with pytest.raises(TypeError, match="stack_sums: no forward-mode derivative"):
        jax.jvp(K.stack_sums, (xs,), (ts,))


def test_torch_forward_mode_through_a_list_with_a_jvp(torch):
    k = stack_sums_with_jvp("stack_sums_jvp")
    g = np.random.default_rng(3)
    xs = [torch.from_numpy(a) for a in items()]
    ts = [torch.from_numpy(g.standard_normal(5).astype(np.float32)) for _ in xs]
    (s, sums), (ds, dsums) = torch.func.jvp(k, (xs,), (ts,))
    torch.testing.assert_close(s, torch.stack(xs))
    torch.testing.assert_close(ds, torch.stack(ts))
    torch.testing.assert_close(dsums, torch.stack(ts).sum(-1))
    jac = torch.func.jacfwd(lambda l: k(l)[1].sin())(xs)
    expect = torch.func.jacfwd(lambda l: stack_ref(torch, l)[1].sin())(xs)
    for a, r in zip(jac, expect, strict=True):
        torch.testing.assert_close(a, r)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        out = k([fwAD.make_dual(a, t) for a, t in zip(xs, ts, strict=True)])
        torch.testing.assert_close(fwAD.unpack_dual(out[1]).tangent, torch.stack(ts).sum(-1))
    # Second order needs a jvp of the backward's kernel: refused in its terms.
    with pytest.raises(RuntimeError, match="stack_sums_backward: no forward-mode derivative"):
        torch.func.hessian(lambda x: k([x, x])[1].sin().sum())(xs[0])
