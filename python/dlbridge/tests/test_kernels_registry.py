"""dlbridge.kernels, the registry that makes one callable run eagerly, inside torch.compile and
inside jax.jit. Here with plain Python functions as kernels (the XLA FFI path, which needs a
compiled handler, is tested by examples/kernels/tests/test_modes.py)."""

from __future__ import annotations

import itertools

import pytest

from dlbridge.kernels import Kernel, kernel

from .libs import have

_names = itertools.count()


def fresh(fn, **kw):
    """A kernel of a new name (torch ops are registered once per name)."""
    name = f"reg_{fn.__name__}_{next(_names)}"
    fn.__name__ = name
    return kernel(fn, **kw)


def scale(x, s=2.0):
    return x * s


def test_eager_calls_go_straight_to_the_function():
    seen = []

    def ident(x):
        seen.append(x)
        return x

    k = fresh(ident)
    obj = object()
    assert k(obj) is obj and seen == [obj]
    assert isinstance(k, Kernel) and k.__wrapped__ is ident and k.target.endswith(ident.__name__)


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="attrs names 'q', not a parameter"):
        fresh(scale, attrs={"q": "float32"})
    with pytest.raises(ValueError, match="attribute 's' has type 'half'"):
        fresh(scale, attrs={"s": "half"})
    with pytest.raises(ValueError, match="out='s' names no tensor parameter"):
        fresh(scale, attrs={"s": "float64"}, out="s")
    with pytest.raises(ValueError, match="mutates names 's'"):
        fresh(scale, attrs={"s": "float64"}, mutates=("s",))
    with pytest.raises(ValueError, match="needs out="):
        fresh(scale, out=None)


def test_arguments_bind_like_python():
    k = fresh(lambda x, s=2.0: (x, s))
    assert k(1) == (1, 2.0) and k(1, s=3) == (1, 3)


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_torch_compile_traces_the_custom_op_without_a_graph_break():
    import torch

    k = fresh(scale, attrs={"s": "float64"})
    x = torch.arange(6.0).reshape(2, 3)
    f = torch.compile(lambda a: k(a, 3.0) + 1, fullgraph=True)
    assert torch.equal(f(x), x * 3 + 1)
    explained = torch._dynamo.explain(lambda a: k(a, 3.0) + 1)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert k.torch_op is not None


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_torch_in_place_kernels_are_mutating_ops():
    import torch

    def add_(x, y):
        y += x
        return y

    k = fresh(add_, mutates=("y",))
    x, y = torch.ones(3), torch.zeros(3)
    f = torch.compile(lambda a, b: k(a, b) * 1, fullgraph=True)
    assert torch.equal(f(x, y), torch.ones(3)) and torch.equal(y, torch.ones(3))


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_torch_autograd_uses_the_named_backward():
    import torch

    def square(x):
        return x * x

    def square_grad(x, g):
        return 2 * x * g

    bw = fresh(square_grad)
    k = fresh(square, backward=(bw, ("x", "grad"), ("x",)))
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(k, (x,))


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_torch_refuses_the_backward_of_a_kernel_that_names_none():
    import torch

    # Eagerly the function ran alone and its result was cut off from autograd (x.grad 1, not 3).
    k = fresh(scale, attrs={"s": "float64"})
    x = torch.arange(3.0, requires_grad=True)
    y = k(x, 2.0) + x
    assert torch.equal(y, 3 * x)
    with pytest.raises(RuntimeError, match=r"reg_\w+: no autograd formula: the kernel names no backward"):
        y.sum().backward()
    with torch.no_grad():
        assert torch.equal(k(x, 2.0), 2 * x)


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_torch_in_place_kernels_refuse_arguments_that_require_grad():
    import torch

    def add_(x, y):
        y += x
        return y

    k = fresh(add_, mutates=("y",))
    x, y = torch.ones(3, requires_grad=True), torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"argument 'x' requires grad, but reg_\w+ writes 'y' in place"):
        k(x, y)
    assert torch.equal(y, torch.zeros(3))
    with torch.no_grad():
        k(x, y)
    assert torch.equal(y, torch.ones(3))


def cube(x):
    return x * x * x


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_torch_double_backward_through_a_backward_with_its_own_backward_is_right():
    import torch

    def cube_grad(x, g):
        return 3 * x * x * g

    def cube_grad_backward(named):
        x, g, h = named["x"], named["g"], named["grad"]
        return {"x": 6 * x * g * h, "g": 3 * x * x * h}

    bw = fresh(cube_grad, backward=cube_grad_backward)
    k = fresh(cube, backward=(bw, ("x", "grad"), ("x",)))
    x = torch.linspace(-1.5, 2.0, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(k, (x,))
    # against torch's own second derivative of the same computation
    (g,) = torch.autograd.grad(k(x).sum() * 2, x, create_graph=True)
    (gg,) = torch.autograd.grad((g * g).sum(), x)
    (g_ref,) = torch.autograd.grad((x**3).sum() * 2, x, create_graph=True)
    (gg_ref,) = torch.autograd.grad((g_ref * g_ref).sum(), x)
    torch.testing.assert_close(gg, gg_ref)


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_torch_a_backward_of_torch_ops_keeps_its_graph_and_a_plain_one_is_first_order_only():
    import torch

    x = torch.linspace(-1.5, 2.0, 5, dtype=torch.float64, requires_grad=True)
    # torch ops: differentiable again, so a double backward is right
    k = fresh(cube, backward=lambda n: {"x": 3 * n["x"] ** 2 * n["grad"]})
    assert torch.autograd.gradgradcheck(k, (x,))

    # a plain computation (numpy): its result carries no graph; before, the second derivative
    # counted it as a constant, silently (gradgradcheck failed on the values)
    def numpy_backward(n):
        xs, g = n["x"].detach().numpy(), n["grad"].detach().numpy()
        return {"x": torch.from_numpy(3 * xs * xs * g)}

    k = fresh(cube, backward=numpy_backward)
    assert torch.autograd.gradcheck(k, (x,))
    with pytest.raises(RuntimeError, match=r"reg_\w+: its gradient is first order only"):
        torch.autograd.gradgradcheck(k, (x,))
    (g,) = torch.autograd.grad(k(x).sum(), x, create_graph=True)
    torch.testing.assert_close(g, 3 * x.detach() ** 2)  # the first order stays right
    with pytest.raises(RuntimeError, match="first order only"):
        g.sum().backward()


@pytest.mark.skipif(not have("jax"), reason="jax is not installed")
def test_jax_tracers_need_a_handler():
    import jax

    k = fresh(scale)
    with pytest.raises(TypeError, match="has no XLA FFI handler"):
        jax.jit(k)(jax.numpy.ones(3))


@pytest.mark.processes
@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_a_kernel_made_before_torch_is_imported_compiles():
    """The op is made right after torch's own import (dynamo cannot trace its creation)."""
    import subprocess
    import sys

    code = """
import dlbridge.kernels as K
def twice(x):
    return x * 2
k = K.kernel(twice)
import torch
x = torch.arange(3.0)
assert torch.equal(torch.compile(lambda a: k(a) + 1, fullgraph=True)(x), x * 2 + 1)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_a_kernel_made_twice_gets_a_second_op():
    import torch

    def plus_one(x):
        return x + 1

    plus_one.__name__ = f"plus_one_{next(_names)}"
    a, b = kernel(plus_one), kernel(plus_one)
    assert a.torch_op is not b.torch_op and a.target != b.target
    x = torch.zeros(2)
    for k in (a, b):
        assert torch.equal(torch.compile(lambda t, k=k: k(t) * 2, fullgraph=True)(x), torch.full((2,), 2.0))


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_the_author_names_the_op_and_its_namespace():
    import torch

    def twice(x):
        return x * 2

    n = next(_names)
    k = kernel(twice, name=f"twice_{n}", namespace="reg_named")
    assert k.namespace == "reg_named" and k.op_name == f"twice_{n}"
    assert k.target == f"reg_named.twice_{n}"
    op = getattr(torch.ops.reg_named, f"twice_{n}")
    assert op.default is k._overload and torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
    # A chosen name is never renamed (a jax.export or a saved graph names it): a second is refused.
    with pytest.raises(ValueError, match=f"'reg_named.twice_{n}' is taken by another kernel"):
        kernel(twice, name=f"twice_{n}", namespace="reg_named")
    with pytest.raises(ValueError, match="namespace='a.b' is not a valid op namespace"):
        kernel(twice, namespace="a.b")
    with pytest.raises(ValueError, match="name='9x' is not a valid op name"):
        kernel(twice, name="9x")
    with pytest.raises(ValueError, match="namespace='aten' is reserved by torch"):
        kernel(twice, namespace="aten")


def test_the_default_names_are_the_function_in_its_package():
    def twice(x):
        return x * 2

    twice.__module__ = "my_kernels.my_kernels"
    twice.__name__ = f"rms_norm_{next(_names)}"
    k = kernel(twice)
    assert (k.namespace, k.op_name) == ("my_kernels", twice.__name__)
    assert k.target == f"my_kernels.{twice.__name__}"
    assert repr(k) == f"<dlbridge kernel my_kernels.{twice.__name__}>"


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_optional_and_list_parameters_through_the_torch_op():
    """A Tensor? and a Tensor[] parameter (optional=, lists=): the op's schema, autograd with a
    gradient per list item and None for an absent optional, torch.compile, opcheck."""
    import torch

    def comb(x, xs, bias=None):
        out = x.clone()
        for t in xs:
            out = out + 2 * t
        return out if bias is None else out + bias

    def backward(named):
        g = named["grad"]
        assert isinstance(named["xs"], list) and (named["bias"] is None or named["bias"].shape == g.shape)
        return {"x": g, "xs": [2 * g for _ in named["xs"]], "bias": g}

    k = fresh(comb, optional=["bias"], lists=["xs"], backward=backward)
    schema = str(k._overload._schema)
    assert "Tensor[] xs" in schema and "Tensor? bias=None" in schema, schema
    x, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    xs = [torch.randn(3, requires_grad=True) for _ in range(2)]
    (k(x, xs, b) * 3).sum().backward()
    assert x.grad.tolist() == [3.0] * 3 and b.grad.tolist() == [3.0] * 3
    assert all(t.grad.tolist() == [6.0] * 3 for t in xs)
    x.grad = b.grad = None
    gx, g0 = torch.autograd.grad(k(x, xs).sum(), (x, xs[0]))
    assert gx.tolist() == [1.0] * 3 and g0.tolist() == [2.0] * 3
    f = torch.compile(lambda x, xs, b: k(x, xs, b) + 1, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(f(x, xs, None), comb(x, xs) + 1)
        torch.testing.assert_close(f(x, xs, b), comb(x, xs, b) + 1)
    for args in [(x, xs, b), (x.detach(), [t.detach() for t in xs], None), (x, [], None)]:
        result = torch.library.opcheck(k._overload, args)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_none_for_a_tensor_that_is_not_optional_is_said_in_the_authors_terms():
    import torch

    def add(x, y):
        return x + y

    k = fresh(add)
    with pytest.raises(TypeError, match=r"argument 'y' is None, but the kernel declares 'y' a tensor, not an optional one"):
        k(torch.ones(2, requires_grad=True), None)


def test_optional_and_list_declarations_are_checked():
    def f(x, bias, xs):
        return x

    with pytest.raises(ValueError, match="optional names 'nope', not a tensor parameter"):
        fresh(f, optional=["nope"])
    with pytest.raises(ValueError, match="out='bias': 'bias' is an optional tensor"):
        fresh(f, optional=["bias"], out="bias")


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_results_with_optional_and_list_parameters_read_each_parameters_shapes():
    """results= with optional= and lists= (refused before): the result rule gets one entry per
    tensor parameter, None for an absent optional and a list of shapes for a list, under
    torch.compile's fake kernel, and the op passes opcheck."""
    import torch

    seen = []

    def rule(shapes, dtypes, attrs):
        seen.append((shapes, dtypes))
        x, bias, xs = shapes
        return [(x, dtypes[0]), ((len(xs), *x), dtypes[0])]

    def stack_bias(x, bias, xs):
        y = x.clone() if bias is None else x + bias
        return y, torch.stack(list(xs)) if xs else x.new_zeros((0, *x.shape))

    k = fresh(stack_bias, optional=["bias"], lists=["xs"], results=["y", "stacked"], result_rule=rule)
    x, b = torch.ones(3), torch.full((3,), 2.0)
    xs = [torch.arange(3.0), torch.arange(3.0) * 2]
    f = torch.compile(lambda x, b, xs: k(x, b, xs), fullgraph=True, backend="aot_eager")
    y, st = f(x, None, xs)
    assert torch.equal(y, x) and torch.equal(st, torch.stack(xs))
    assert ([(3,), None, [(3,), (3,)]], ["float32", None, ["float32", "float32"]]) in seen
    y, st = f(x, b, xs[:1])
    assert torch.equal(y, x + b) and st.shape == (1, 3)
    assert ([(3,), (3,), [(3,)]], ["float32", "float32", ["float32"]]) in seen
    for args in [(x, b, xs), (x, None, [])]:
        result = torch.library.opcheck(k._overload, args)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.skipif(not have("torch"), reason="torch is not installed")
def test_an_optional_tensor_with_a_default_before_attributes_compiles():
    """`Tensor? bias=None` followed by attributes: torch passes the arguments after a defaulted one
    by keyword to the fake kernel, which bound them by position only (IndexError under
    torch.compile, and in opcheck's fake tensor check)."""
    import torch

    def summed(x, bias=None, axes=(0,), mode="sum"):
        r = x.sum(dim=tuple(axes)) if mode == "sum" else x.mean(dim=tuple(axes))
        return r if bias is None else r + bias

    k = fresh(summed, out=lambda x, bias: (x.shape[1:], str(x.dtype).replace("torch.", "")),
              attrs={"axes": "int64[]", "mode": "str"}, optional=["bias"])
    x = torch.arange(12.0).reshape(3, 4)
    f = torch.compile(lambda a, b: k(a, b, [0], "mean"), fullgraph=True)
    torch.testing.assert_close(f(x, None), x.mean(0))
    torch.testing.assert_close(f(x, torch.ones(4)), x.mean(0) + 1)
    for args in [(x, None, [0], "sum"), (x, torch.ones(4), [0], "mean")]:
        result = torch.library.opcheck(k._overload, args)
        assert set(result.values()) == {"SUCCESS"}, result
