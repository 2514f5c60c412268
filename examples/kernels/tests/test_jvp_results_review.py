"""Forward mode of a kernel with several results (rms_norm_fm: y and the residual rstd), attacked:
every tangent compared with the framework's own rms_norm under the transforms and layouts a
caller uses (non-contiguous and stride-0 inputs, zeros, the same array twice, vmap with in_dims on
the weight, an nn.Parameter under functional_call, linearize and linear_transpose), the residual
never shown, and what cannot be right refused in the kernel's words: forward mode under
torch.compile (which ran the custom op, whose tangent torch drops: a silent zero tangent), and a
jvp giving a tangent of the wrong dtype (torch kept a float32 tangent of a float64 result), the
wrong shape (jit said "Cannot lower jaxpr with verifier errors") or None (torch: INTERNAL ASSERT)."""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge.kernels
import dlbridge_kernels as K

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
import torch._dynamo  # noqa: E402, F401  (before tensorflow: see test_modes.py)

jax.config.update("jax_enable_x64", True)

func = torch.func
fwAD = torch.autograd.forward_ad
EPS = 1e-5
TANGENT_ARGS = ("x", "weight", "rstd", "tangent_x", "tangent_weight")


def rand(*shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def t(*shape, seed=0, dtype=torch.float64):
    return torch.from_numpy(rand(*shape, seed=seed)).to(dtype)


def t_ref(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * w


def j_ref(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * w


def fm(x, w):
    return K.rms_norm_fm(x, w, EPS)


def close(a, b, **kw):
    for p, q in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert np.shape(p) == np.shape(q)
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), **({"rtol": 1e-9, "atol": 1e-11} | kw))


# --- torch: layouts, zeros, aliasing, partial tangents ---


@pytest.mark.parametrize(("rows", "cols", "dtype"), [(1, 1, torch.float64), (4, 6, torch.float64), (7, 3, torch.float32)])
def test_torch_jvp_of_strided_inputs_and_tangents_equals_torchs(rows, cols, dtype):
    x, w, tx, tw = t(rows, 2 * cols, dtype=dtype), t(2 * cols, seed=1, dtype=dtype), t(rows, 2 * cols, seed=2, dtype=dtype), t(2 * cols, seed=3, dtype=dtype)
    tol = {} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    # every other column: non-contiguous primals and tangents
    args = ((x[:, ::2], w[::2]), (tx[:, ::2], tw[::2]))
    got = func.jvp(fm, *args)
    ref = func.jvp(t_ref, *args)
    assert got[1].dtype == dtype
    torch.testing.assert_close(got, ref, **tol)
    # a transposed (column-major) x, a stride-0 weight and a stride-0 zero tangent
    xt = x.t().contiguous().t()
    w0 = torch.tensor([1.5], dtype=dtype).expand(2 * cols)
    tw0 = torch.tensor([-0.5], dtype=dtype).expand(2 * cols)
    z = torch.zeros((), dtype=dtype).expand(rows, 2 * cols)
    torch.testing.assert_close(func.jvp(fm, (xt, w0), (z, tw0)), func.jvp(t_ref, (x, w0), (z, tw0)), **tol)


def test_torch_jvp_of_a_zero_row_equals_torchs():
    """rstd is 1/sqrt(eps) there (large): the tangent still matches torch's."""
    x = t(3, 5)
    x[1] = 0
    args = ((x, t(5, seed=1)), (t(3, 5, seed=2), t(5, seed=3)))
    torch.testing.assert_close(func.jvp(fm, *args), func.jvp(t_ref, *args))


def test_torch_the_same_tensor_twice_and_a_tangent_for_weight_only():
    x, tx, w, tw = t(4, 4), t(4, 4, seed=1), t(4, seed=2), t(4, seed=3)
    # x's row as the weight: one tangent flows in through both arguments
    torch.testing.assert_close(func.jvp(lambda a: fm(a, a[1]), (x,), (tx,)), func.jvp(lambda a: t_ref(a, a[1]), (x,), (tx,)))
    with fwAD.dual_level():
        d = fwAD.make_dual(x, tx)
        got = fwAD.unpack_dual(fm(d, d[0])).tangent
    torch.testing.assert_close(got, func.jvp(lambda a: t_ref(a, a[0]), (x,), (tx,))[1])
    # a tangent for weight alone: x's tangent is zero
    with fwAD.dual_level():
        got = fwAD.unpack_dual(fm(x, fwAD.make_dual(w, tw))).tangent
    torch.testing.assert_close(got, func.jvp(lambda b: t_ref(x, b), (w,), (tw,))[1])


def test_torch_dual_with_a_parameter_that_requires_grad_then_backward():
    """Forward and reverse on one call: the primal's backward is right; a backward through the
    tangent (made by rms_norm_tangent, which has no backward) is refused in its words."""
    x, tx, w = t(3, 4), t(3, 4, seed=1), t(4, seed=2)

    def run(f):
        p = torch.nn.Parameter(w.clone())
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(f(fwAD.make_dual(x, tx), p))
        primal.pow(2).sum().backward()
        return tangent.detach(), p.grad

    torch.testing.assert_close(run(fm), run(t_ref))
    p = torch.nn.Parameter(w.clone())
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(fm(fwAD.make_dual(x, tx), p)).tangent
    # (before: "the kernel names no backward ... call it under torch.no_grad()", of a kernel the
    # caller never called)
    with pytest.raises(RuntimeError, match=r"rms_norm_tangent: no autograd formula: rms_norm_tangent is the jvp of rms_norm_fm .* a tangent of rms_norm_fm cannot be differentiated in reverse mode"):
        tangent.sum().backward()
    with pytest.raises(RuntimeError, match=r"rms_norm_tangent is the jvp of rms_norm_fm"):
        func.grad(lambda a: (func.jvp(lambda b: fm(b, w), (a,), (tx,))[1] ** 2).sum())(x)


# --- torch.func: vmap with in_dims on the weight, a module's parameter ---


def test_torch_vmap_of_jvp_batched_on_the_weight_equals_torchs():
    x, tx = t(4, 6), t(4, 6, seed=1)
    ws, tws = t(3, 6, seed=2), t(3, 6, seed=3)
    def batched(f):
        both = func.vmap(lambda w, tw: func.jvp(lambda b: f(x, b), (w,), (tw,)), in_dims=(0, 0))(ws, tws)
        primal_only = func.vmap(lambda w: func.jvp(f, (x, w), (tx, tws[0]))[1])(ws)
        return both, primal_only

    torch.testing.assert_close(batched(fm), batched(t_ref))


def test_torch_functional_call_of_a_module_with_a_parameter_weight():
    class Norm(torch.nn.Module):
        def __init__(self, f):
            super().__init__()
            self.weight = torch.nn.Parameter(t(6, seed=2))
            self.f = f

        def forward(self, x):
            return self.f(x, self.weight)

    x, tx, tw = t(4, 6), t(4, 6, seed=1), t(6, seed=3)

    def run(f):
        m = Norm(f)
        params = {"weight": m.weight.detach()}
        by_param = func.jvp(lambda p: func.functional_call(m, p, (x,)), (params,), ({"weight": tw},))
        by_input = func.jvp(m, (x,), (tx,))
        return by_param, by_input

    torch.testing.assert_close(run(fm), run(t_ref))


def test_torch_jvp_of_grad_and_hvp_through_the_jvp():
    x, w, tx, tw = t(3, 5), t(5, seed=1), t(3, 5, seed=2), t(5, seed=3)

    def jvp_of_grad(f):
        return func.jvp(func.grad(lambda a, b: (f(a, b) ** 3).sum(), argnums=(0, 1)), (x, w), (tx, tw))

    torch.testing.assert_close(jvp_of_grad(fm), jvp_of_grad(t_ref))
    # autograd.functional.jvp/hvp are reverse over reverse (the double-vjp trick): first order only
    with pytest.raises(RuntimeError, match=r"rms_norm_fm_backward: no autograd formula: .* first order only"):
        torch.autograd.functional.hvp(lambda a: (fm(a, w) ** 2).sum(), x, tx)


# --- torch.compile with forward mode ---


@pytest.mark.parametrize("kernel", ["rms_norm_fm", "softmax"])
def test_torch_compile_of_forward_mode_is_right_or_refused_in_the_kernels_words(kernel):
    """Under torch.compile a kernel runs its torch op, whose autograd (register_autograd) has no
    jvp: torch dropped the tangent, a silent zero (before: 3.9 off for rms_norm_fm). Forward mode
    now runs the kernel eagerly (a graph break), which fullgraph=True refuses naming the kernel."""
    x, w, tx, tw = t(4, 6), t(6, seed=1), t(4, 6, seed=2), t(6, seed=3)
    if kernel == "softmax":
        f, ref, primals, tangents = K.softmax, lambda a: torch.softmax(a, -1), (x,), (tx,)
    else:
        f, ref, primals, tangents = fm, t_ref, (x, w), (tx, tw)
    expected = func.jvp(ref, primals, tangents)

    def jvp(*a):
        return func.jvp(f, a[: len(primals)], a[len(primals) :])

    def jacfwd(*a):
        return func.jacfwd(f, argnums=0)(*a)

    def dual(*a):
        with fwAD.dual_level():
            return fwAD.unpack_dual(f(*[fwAD.make_dual(p, q) for p, q in zip(a[: len(primals)], a[len(primals) :])])).tangent

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(jvp)(*primals, *tangents), expected)
    torch.testing.assert_close(torch.compile(dual)(*primals, *tangents), expected[1])
    torch.testing.assert_close(torch.compile(jacfwd)(*primals), func.jacfwd(ref, argnums=0)(*primals))
    for g in (jvp, dual):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=rf"{kernel}: forward-mode AD .* under torch\.compile"):
            torch.compile(g, fullgraph=True)(*primals, *tangents)
    # a kernel without a jvp: refused as eagerly (before: its tangent dropped, a silent zero)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"rms_norm: no forward-mode derivative|rms_norm: argument 'x' is a dual tensor"):
        torch.compile(lambda a, b, c: func.jvp(lambda p: K.rms_norm(p, b, EPS), (a,), (c,)))(x, w, tx)
    # reverse mode still compiles into one graph, with no graph break
    torch._dynamo.reset()
    xr = x.clone().requires_grad_()
    torch.compile(lambda a: (f(a, w) if kernel != "softmax" else f(a)).pow(2).sum(), fullgraph=True)(xr).backward()
    assert xr.grad is not None


# --- jax: vmap with in_axes on the weight, linearize, linear_transpose ---


def test_jax_jit_vmap_of_jvp_with_in_axes_on_the_weight_equals_jaxs():
    x, tx = rand(4, 6), rand(4, 6, seed=1)
    ws, tws = rand(3, 6, seed=2), rand(3, 6, seed=3)

    def run(f):
        both = jax.jit(jax.vmap(lambda w, tw: jax.jvp(f, (x, w), (tx, tw)), in_axes=(0, 0)))(ws, tws)
        tangent_only = jax.vmap(lambda tw: jax.jvp(f, (x, ws[0]), (tx, tw)))(tws)
        x_on_axis_1 = jax.vmap(lambda a, w: jax.jvp(f, (a, w), (jnp.ones_like(a), w)), in_axes=(1, None))(np.stack([x, 2 * x], 1), ws[0])
        return both, tangent_only, x_on_axis_1

    close(run(fm), run(j_ref))


def test_jax_linearize_and_linear_transpose_show_no_residual():
    x, w, tx, tw = rand(4, 6), rand(6, seed=1), rand(4, 6, seed=2), rand(6, seed=3)
    y, lin = jax.linearize(fm, x, w)
    ry, rlin = jax.linearize(j_ref, x, w)
    # the caller sees y and its tangent alone (rstd is a residual)
    assert isinstance(y, jax.Array) and isinstance(lin(tx, tw), jax.Array)
    close((y, lin(tx, tw)), (ry, rlin(tx, tw)))
    close(jax.jit(lambda *a: jax.linearize(fm, *a[:2])[1](*a[2:]))(x, w, tx, tw), rlin(tx, tw))
    close(jax.linear_transpose(lin, x, w)(tx), jax.linear_transpose(rlin, x, w)(tx))
    zero = np.zeros_like(w)
    close(
        jax.jit(jax.linear_transpose(lambda a: jax.jvp(fm, (x, w), (a, zero))[1], x))(tx),
        jax.linear_transpose(lambda a: jax.jvp(j_ref, (x, w), (a, zero))[1], x)(tx),
    )


def test_jax_zero_rows_the_same_array_twice_and_jacfwd_of_grad():
    x = rand(3, 4)
    x[2] = 0
    tx, w, tw = rand(3, 4, seed=1), rand(4, seed=2), rand(4, seed=3)
    close(jax.jit(lambda *a: jax.jvp(fm, a[:2], a[2:]))(x, w, tx, tw), jax.jvp(j_ref, (x, w), (tx, tw)))
    close(jax.jit(lambda a, b: jax.jvp(lambda c: fm(c, c[1]), (a,), (b,)))(x, tx), jax.jvp(lambda c: j_ref(c, c[1]), (x,), (tx,)))

    def jac_of_grad(f):
        return jax.jacfwd(jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), argnums=(0, 1)), argnums=(0, 1))(x, w)

    close(jax.jit(lambda: jac_of_grad(fm))(), jac_of_grad(j_ref))
    # reverse over forward differentiates the jvp kernel, which has no jvp: refused
    with pytest.raises(TypeError, match=r"rms_norm_tangent: no forward-mode derivative .* first order only"):
        jax.grad(lambda a: jnp.sum(jax.jvp(fm, (a, w), (tx, tw))[1] ** 2))(x)


# --- a jvp giving the wrong tangents ---


def declare(name, jvp):
    return dlbridge.kernels.kernel(
        K.rms_norm_fm.__wrapped__,
        name=name,
        namespace="dlbridge_jvp_review_test",
        attrs={"eps": "float64"},
        ffi=K.rms_norm_fm._ffi,
        results=("y", "rstd"),
        residuals=("rstd",),
        result_rule=K.rms_norm_fm._result_rule,
        backward=(K.rms_norm_fm_backward, ("x", "weight", "rstd", "grad"), ("x", "weight")),
        jvp=jvp,
    )


def tangents(named):
    return K.rms_norm_tangent(*[named[n] for n in TANGENT_ARGS])


def as_float32(a):
    return a.float() if isinstance(a, torch.Tensor) else a.astype(np.float32)


SWAPPED = declare("rms_norm_swapped_jvp", lambda named: tangents(named)[::-1])
FLOAT32 = declare("rms_norm_float32_jvp", lambda named: tuple(as_float32(a) for a in tangents(named)))
ONE_RSTD = declare("rms_norm_one_rstd_jvp", lambda named: (tangents(named)[0], tangents(named)[1][:1]))
NO_RSTD = declare("rms_norm_no_rstd_jvp", lambda named: (tangents(named)[0], None))


def attempts(k):
    """Forward mode of ``k`` in every framework: eager, under jit, forward over reverse."""
    x, w, tx, tw = rand(4, 6), rand(6, seed=1), rand(4, 6, seed=2), rand(6, seed=3)
    X, W, TX, TW = (torch.from_numpy(a) for a in (x, w, tx, tw))

    def dual():
        with fwAD.dual_level():
            return fwAD.unpack_dual(k(fwAD.make_dual(X, TX), W, EPS)).tangent

    return {
        "jax.jvp": lambda: jax.jvp(lambda a, b: k(a, b, EPS), (x, w), (tx, tw)),
        "jit(jax.jvp)": lambda: jax.jit(lambda *a: jax.jvp(lambda p, q: k(p, q, EPS), a[:2], a[2:]))(x, w, tx, tw),
        "jit(jax.hessian)": lambda: jax.jit(jax.hessian(lambda b: jnp.sum(k(x, b, EPS) ** 2)))(w),
        "torch.func.jvp": lambda: func.jvp(lambda a, b: k(a, b, EPS), (X, W), (TX, TW)),
        "dual tensors": dual,
        "torch.func.hessian": lambda: func.hessian(lambda b: (k(X, b, EPS) ** 2).sum())(W),
    }


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        (SWAPPED, r"rms_norm_swapped_jvp: its jvp gave the tangent of 'y' with shape \(4,\) and dtype float64, but 'y' has shape \(4, 6\)"),
        (FLOAT32, r"rms_norm_float32_jvp: its jvp gave the tangent of 'y' with shape \(4, 6\) and dtype float32, but 'y' has shape \(4, 6\) and dtype float64"),
        (ONE_RSTD, r"rms_norm_one_rstd_jvp: its jvp gave the tangent of 'rstd' with shape \(1,\) and dtype float64, but 'rstd' has shape \(4,\)"),
        (NO_RSTD, r"rms_norm_no_rstd_jvp: its jvp gave None for the tangent of 'rstd'"),
    ],
    ids=["swapped", "float32", "broadcastable", "none"],
)
def test_a_jvp_tangent_of_the_wrong_shape_or_dtype_is_refused_naming_the_kernel_and_result(kernel, message):
    """Before: torch kept a float32 tangent of a float64 result, jit said "Cannot lower jaxpr
    with verifier errors", torch hit an INTERNAL ASSERT for None, and jax's and torch's own
    messages named neither the kernel nor the result."""
    for where, attempt in attempts(kernel).items():
        with pytest.raises(ValueError, match=message):
            attempt()
            pytest.fail(f"{where}: not refused")
