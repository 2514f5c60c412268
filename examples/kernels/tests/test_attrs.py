"""String and array attributes: reduce(x, axes: int64[], mode: str) sums or averages over the
axes, its result shaped by a Rust rule reading both; poly(x, coeffs: float64[]). In every mode:
eager on numpy, torch and jax; jax.jit and vmap; torch.compile(fullgraph=True); the native torch
op (its schema, opcheck, torch.func.vmap) and the Python custom op a kernel made from Python gets
(opcheck, compile). A wrong value names the attribute, its declared type and what was passed."""

from __future__ import annotations

import re

import numpy as np
import pytest

import dlbridge.kernels
import dlbridge_kernels as K


def data(shape=(2, 3, 4), dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def reference(x, axes, mode="sum"):
    return x.mean(axis=tuple(axes)) if mode == "mean" else x.sum(axis=tuple(axes))


def poly_reference(x, coeffs):
    return sum(c * x**k for k, c in enumerate(coeffs))


CASES = [([0, 2], "sum"), ((1,), "mean"), ([-1], "sum"), ([], "sum"), ([0, 1, 2], "mean")]


# --- eager ---


@pytest.mark.parametrize(("axes", "mode"), CASES)
def test_eager_numpy(axes, mode):
    x = data()
    y = K.reduce(x, axes, mode)
    assert type(y) is np.ndarray
    np.testing.assert_allclose(y, reference(x, axes, mode), rtol=1e-12)
    assert y.shape == reference(x, axes, mode).shape


def test_eager_defaults_keywords_float32_and_poly():
    x = data(dtype=np.float32)
    np.testing.assert_allclose(K.reduce(x, axes=[1]), x.sum(1), rtol=1e-5)
    np.testing.assert_allclose(K.reduce(x, mode="mean", axes=(0, 2)), x.mean((0, 2)), rtol=1e-5)
    # numpy integers (and a numpy array of them) are ints.
    np.testing.assert_allclose(K.reduce(x, np.array([0, 2])), x.sum((0, 2)), rtol=1e-5)
    np.testing.assert_allclose(K.reduce(x, [np.int32(1)]), x.sum(1), rtol=1e-5)
    np.testing.assert_allclose(K.poly(x, [1.0, -2, 0.5]), poly_reference(x, [1.0, -2, 0.5]), rtol=1e-5)
    np.testing.assert_allclose(K.poly(x, []), np.zeros_like(x))


def test_eager_torch_and_jax():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    x = data()
    yt = K.reduce(torch.from_numpy(x), [0, 2], "mean")
    assert type(yt) is torch.Tensor
    np.testing.assert_allclose(yt.numpy(), reference(x, [0, 2], "mean"), rtol=1e-12)
    yj = K.reduce(jnp.asarray(x, dtype=jnp.float32), (1,))
    assert yj.shape == (2, 4)
    np.testing.assert_allclose(np.asarray(yj), x.astype(np.float32).sum(1), rtol=1e-5)
    pt = K.poly(torch.from_numpy(x), (0.5, 1.5))
    np.testing.assert_allclose(pt.numpy(), poly_reference(x, (0.5, 1.5)), rtol=1e-12)


# --- wrong values, in the author's terms ---

WRONG = [
    ({"axes": [0.5]}, r"attribute 'axes' is declared 'int64\[\]', but the call passed a list \(\[0\.5\]\) \(element 0 is a float"),
    ({"axes": [True]}, r"attribute 'axes' is declared 'int64\[\]'.*element 0 is a bool"),
    ({"axes": 1}, r"attribute 'axes' is declared 'int64\[\]', but the call passed an int \(1\)"),
    ({"axes": "01"}, r"attribute 'axes' is declared 'int64\[\]', but the call passed a str"),
    ({"axes": [0], "mode": ["sum"]}, r"attribute 'mode' is declared 'str', but the call passed a list \(\['sum'\]\): pass a str"),
]


@pytest.mark.parametrize(("kw", "message"), WRONG)
def test_wrong_values_are_refused_eagerly_naming_the_attribute(kw, message):
    with pytest.raises(TypeError, match=message):
        K.reduce(data(), **kw)
    with pytest.raises(TypeError, match=r"attribute 'coeffs' is declared 'float64\[\]'.*element 1 is a str"):
        K.poly(data(), [1.0, "2"])


@pytest.mark.parametrize(("kw", "message"), WRONG)
def test_wrong_values_are_refused_under_jit_and_on_torch(kw, message):
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=message):
        jax.jit(lambda x: K.reduce(x, **kw))(data())
    with pytest.raises(TypeError, match=message):
        K.reduce(torch.from_numpy(data()).requires_grad_(), **kw)


@pytest.mark.parametrize(("kw", "message"), WRONG)
def test_wrong_values_are_refused_under_torch_compile(kw, message):
    """Before: torch's schema check, "Expected a value of type 'List[int]' for argument 'axes' but
    instead found type 'immutable_list'" (dynamo quotes the refusal as its repr)."""
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    with pytest.raises(Exception) as e:
        torch.compile(lambda x: K.reduce(x, **kw), fullgraph=True)(torch.zeros(2, 3))
    text = str(e.value).replace("\\'", "'")
    assert re.search(message, text), text
    assert "Expected a value of type" not in text


def test_the_rule_refuses_a_wrong_mode_or_axis_in_every_mode():
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    x = data()
    with pytest.raises(ValueError, match=r'mode: expected "sum" or "mean", got "max"'):
        K.reduce(x, [0], "max")
    with pytest.raises(ValueError, match=r'mode: expected "sum" or "mean", got "max"'):
        jax.jit(lambda a: K.reduce(a, [0], "max"))(x)
    with pytest.raises(ValueError, match="axes: axis 3 is out of range for a 3-d x"):
        jax.jit(lambda a: K.reduce(a, [3]))(x)
    with pytest.raises(RuntimeError, match=r'mode: expected "sum" or "mean", got "max"'):
        torch.ops.dlbridge_kernels.reduce(torch.from_numpy(x), [0], "max")
    with pytest.raises(RuntimeError, match=r"reduce: result total: axes: axis -3 is named twice in \[0, -3\]"):
        torch.ops.dlbridge_kernels.reduce(torch.from_numpy(x).to("meta"), [0, -3])


# --- jax --- (float32: jax's default without x64)


@pytest.mark.parametrize(("axes", "mode"), CASES)
def test_jit(axes, mode):
    jax = pytest.importorskip("jax")
    x = data()
    y = jax.jit(lambda a: K.reduce(a, axes, mode))(x)
    np.testing.assert_allclose(np.asarray(y), reference(x, axes, mode), rtol=1e-5)


def test_jit_static_argnames_vmap_and_poly():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = jnp.asarray(data())
    f = jax.jit(K.reduce, static_argnames=("axes", "mode"))
    np.testing.assert_allclose(np.asarray(f(x, axes=(0, 2), mode="mean")), reference(np.asarray(x), [0, 2], "mean"), rtol=1e-5)
    # vmap over x's first axis: each element (3, 4) reduced over its axis 1.
    y = jax.vmap(lambda a: K.reduce(a, [1], "mean"))(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x).mean(2), rtol=1e-5)
    c = [0.5, -1.0, 2.0]
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a: K.poly(a, c))(x)), poly_reference(np.asarray(x), c), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.vmap(lambda a: K.poly(a, c))(x)), poly_reference(np.asarray(x), c), rtol=1e-5)
    # A traced value for an attribute is refused (it is static).
    with pytest.raises(TypeError, match="axes is an XLA attribute, static under jax.jit"):
        jax.jit(lambda a, ax: K.reduce(a, ax))(x, jnp.asarray([0]))


# --- torch ---


@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    dlbridge.kernels.torch_ready()
    return torch


def test_the_native_ops_schema_and_calls(torch):
    assert K.reduce._native_fallback is None and K.poly._native_fallback is None
    op = torch.ops.dlbridge_kernels.reduce
    assert str(op.default._schema) == 'dlbridge_kernels::reduce(Tensor x, int[] axes, str mode="sum") -> Tensor'
    assert str(torch.ops.dlbridge_kernels.poly.default._schema) == "dlbridge_kernels::poly(Tensor x, float[] coeffs) -> Tensor"
    x = torch.from_numpy(data())
    torch.testing.assert_close(op(x, [0, 2], "mean"), x.mean((0, 2)))
    torch.testing.assert_close(op(x, [1]), x.sum(1))  # the default mode
    torch.testing.assert_close(op(x, []), x)
    torch.testing.assert_close(torch.ops.dlbridge_kernels.poly(x, [1.0, 2.0]), 1 + 2 * x)
    torch.testing.assert_close(torch.ops.dlbridge_kernels.poly(x, []), torch.zeros_like(x))
    # The Meta kernel: the Rust rule reads the list and the string.
    m = op(x.to("meta"), [-1], "mean")
    assert m.shape == (2, 3) and m.device.type == "meta"


def test_opcheck_on_the_native_ops(torch):
    x = torch.from_numpy(data())
    torch.library.opcheck(torch.ops.dlbridge_kernels.reduce.default, (x, [0, 2], "mean"))
    torch.library.opcheck(torch.ops.dlbridge_kernels.reduce.default, (x, [1]))
    torch.library.opcheck(torch.ops.dlbridge_kernels.poly.default, (x, [0.5, 1.0, -2.0]))


@pytest.mark.parametrize(("axes", "mode"), CASES)
def test_compile_fullgraph(torch, axes, mode):
    torch._dynamo.reset()
    x = torch.from_numpy(data())
    c = torch.compile(lambda a: K.reduce(a, axes, mode) * 2, fullgraph=True)
    y = c(x)
    # (One result: the op returns it alone, which the kernel returns as it is, not its rows.)
    assert y.shape == reference(x.numpy(), axes, mode).shape
    torch.testing.assert_close(y, torch.from_numpy(np.asarray(reference(x.numpy(), axes, mode))) * 2)


def test_numpy_scalars_in_an_array_attribute_compile_as_torch_takes_them(torch):
    """numpy integers written in the compiled function (dynamo traces them as arrays, values
    unknown) reach the op as torch's own custom ops take them, for the native op and for the
    Python custom op of a kernel made from Python; before, the check refused them and building
    its message broke the graph ("repr() on tensor")."""
    x = torch.from_numpy(data())
    py = dlbridge.kernels.kernel(
        K.reduce.__wrapped__,
        name="reduce_np_scalars",
        namespace="dlbridge_attrs_test",
        attrs={"axes": "int64[]", "mode": "str"},
        ffi=K.reduce._ffi,
        results=("total",),
        result_rule=K.reduce._result_rule,
    )
    for k in (K.reduce, py):
        torch._dynamo.reset()
        c = torch.compile(lambda a: k(a, [np.int64(0)], "sum"), fullgraph=True)
        torch.testing.assert_close(c(x), x.sum(0))
        torch._dynamo.reset()
        c = torch.compile(lambda a: k(a, (np.int32(1), -1), "mean"), fullgraph=True)
        torch.testing.assert_close(c(x), x.mean((1, 2)))


def test_compile_poly_and_torch_func_vmap(torch):
    torch._dynamo.reset()
    x = torch.from_numpy(data())
    c = torch.compile(lambda a: K.poly(a, [1.0, 0.0, 3.0]).sum(-1), fullgraph=True)
    torch.testing.assert_close(c(x), (1 + 3 * x**2).sum(-1))
    y = torch.func.vmap(lambda a: K.reduce(a, [0], "mean"))(x)
    torch.testing.assert_close(y, x.mean(1))


def test_help_shows_the_attribute_types():
    import inspect

    sig = str(inspect.signature(K.reduce))
    assert sig == "(x: 'Tensor', axes: 'int64[]', mode: 'str' = 'sum') -> 'Tensor total'", sig
    assert "Attributes (static under jax.jit): axes: int64[], mode: str." in K.reduce.__doc__
    assert "coeffs: float64[]" in K.poly.__doc__


def test_a_kernel_made_from_python_gets_a_custom_op_with_the_same_attributes(torch):
    """The same function and handler declared from Python (no native registrar): the Python
    custom op (torch passes it the list and the str), its fake result from the Rust rule, and
    the handler under jax.jit."""
    jax = pytest.importorskip("jax")
    k = dlbridge.kernels.kernel(
        K.reduce.__wrapped__,
        name="reduce_py",
        namespace="dlbridge_attrs_test",
        attrs={"axes": "int64[]", "mode": "str"},
        ffi=K.reduce._ffi,
        results=("total",),
        result_rule=K.reduce._result_rule,
    )
    assert str(k.torch_op._opoverload._schema).endswith('reduce_py(Tensor x, int[] axes, str mode="sum") -> Tensor')
    x = torch.from_numpy(data())
    torch.library.opcheck(k.torch_op, (x, [0, 2], "mean"))
    torch.testing.assert_close(k.torch_op(x, [1]), x.sum(1))
    torch._dynamo.reset()
    c = torch.compile(lambda a: k(a, (0, -1), "mean"), fullgraph=True)
    torch.testing.assert_close(c(x), x.mean((0, 2)))
    y = jax.jit(lambda a: k(a, [2], "mean"))(x.numpy())
    np.testing.assert_allclose(np.asarray(y), x.numpy().mean(2), rtol=1e-5)


def test_array_and_string_attributes_of_every_declared_type_from_python():
    """A kernel made from Python with an attribute of each new type: each value reaches the
    function checked and as the declared type (arrays as tuples of Python numbers), a wrong one
    (an int32 out of range, a float for a bool) refused naming it."""
    seen = {}

    def f(x, s, i64, i32, f32, f64, b):
        seen.update(s=s, i64=i64, i32=i32, f32=f32, f64=f64, b=b)
        return x

    types = {"s": "str", "i64": "int64[]", "i32": "int32[]", "f32": "float32[]", "f64": "float64[]", "b": "bool[]"}
    k = dlbridge.kernels.kernel(f, name="every_attr", namespace="dlbridge_attrs_test", attrs=types, out="x")
    x = np.zeros(2)
    k(x, "é\"\\", [2**40], np.array([-3], dtype=np.int32), [1], (0.25,), [True, np.True_])
    assert seen == {"s": "é\"\\", "i64": (2**40,), "i32": (-3,), "f32": (1.0,), "f64": (0.25,), "b": (True, True)}
    assert type(seen["f32"][0]) is float and type(seen["i32"][0]) is int
    with pytest.raises(TypeError, match=r"attribute 'i32' is declared 'int32\[\]'.*element 0, 2147483648, does not fit an int32"):
        k(x, "", [], [2**31], [], [], [])
    with pytest.raises(TypeError, match=r"attribute 'b' is declared 'bool\[\]'.*element 0 is a float"):
        k(x, "", [], [], [], [], [1.0])
    with pytest.raises(TypeError, match=r"attribute 'f64' is declared 'float64\[\]'.*element 0 is a bool"):
        k(x, "", [], [], [], [False], [])
    with pytest.raises(TypeError, match=r"(?s)attribute 'i64' is declared 'int64\[\]'.*one sequence of values"):
        k(x, "", np.zeros((2, 2), dtype=np.int64), [], [], [], [])
    with pytest.raises(ValueError, match=r"attribute 'x' has type 'int8\[\]' \(allowed: .*str, int64\[\], int32\[\]"):
        dlbridge.kernels.kernel(f, attrs={"x": "int8[]"})


# --- float32[], int32[] and bool[]: channel_affine ---

SCALE, SHIFT, SKIP = [0.5, 2.0, -1.0, 3.0], [1, -2, 0, 7], [False, True, False, False]


def affine_reference(x, scale=SCALE, shift=SHIFT, skip=SKIP):
    s = np.asarray(scale, dtype=np.float32).astype(np.float64)
    out = x * s + np.asarray(shift, dtype=np.float64)
    return np.where(np.asarray(skip), x, out)


def test_channel_affine_eager_and_jit():
    jax = pytest.importorskip("jax")
    x = data()
    np.testing.assert_allclose(K.channel_affine(x, SCALE, SHIFT, SKIP), affine_reference(x), rtol=1e-12)
    y = jax.jit(lambda a: K.channel_affine(a, SCALE, SHIFT, SKIP))(x)
    np.testing.assert_allclose(np.asarray(y), affine_reference(x.astype(np.float32)), rtol=1e-5)
    yv = jax.vmap(lambda a: K.channel_affine(a, SCALE, SHIFT, SKIP))(x)
    np.testing.assert_allclose(np.asarray(yv), affine_reference(x.astype(np.float32)), rtol=1e-5)
    with pytest.raises(ValueError, match="one entry per channel"):
        K.channel_affine(x, SCALE[:3], SHIFT, SKIP)
    with pytest.raises(Exception, match="one entry per channel"):
        jax.jit(lambda a: K.channel_affine(a, SCALE, SHIFT[:3], SKIP))(x)
    with pytest.raises(TypeError, match=r"attribute 'skip' is declared 'bool\[\]'.*element 0 is an int"):
        K.channel_affine(x, SCALE, SHIFT, [0, 1, 0, 0])
    with pytest.raises(TypeError, match=r"attribute 'shift' is declared 'int32\[\]'.*does not fit an int32"):
        jax.jit(lambda a: K.channel_affine(a, SCALE, [2**31, 0, 0, 0], SKIP))(x)


def test_channel_affine_native_op_compile_and_opcheck(torch):
    """The native op's CPU kernel narrows torch's int[] and float[] into the int32 and float32
    arrays the handler reads, and lends the bool[] as XLA's PRED array."""
    assert K.channel_affine._native_fallback is None
    op = torch.ops.dlbridge_kernels.channel_affine
    assert str(op.default._schema).endswith("channel_affine(Tensor x, float[] scale, int[] shift, bool[] skip) -> Tensor")
    x = torch.from_numpy(data())
    torch.testing.assert_close(op(x, SCALE, SHIFT, SKIP), torch.from_numpy(affine_reference(x.numpy())))
    # An int out of int32's range reaches the native op (torch's int is 64-bit): refused there.
    with pytest.raises(RuntimeError, match=r"shift: element 0, 2147483648, does not fit an int32"):
        op(x, SCALE, [2**31, 0, 0, 0], SKIP)
    torch.library.opcheck(op.default, (x, SCALE, SHIFT, SKIP))
    torch._dynamo.reset()
    c = torch.compile(lambda a: K.channel_affine(a, SCALE, SHIFT, SKIP) + 1, fullgraph=True)
    torch.testing.assert_close(c(x), torch.from_numpy(affine_reference(x.numpy())) + 1)


# --- hostile values: each refused in the author's terms, in every mode ---


def _refused_in_every_mode(kw, message, torch, compiled=True):
    """`K.reduce(x, **kw)` refused with `message` (a TypeError naming the attribute) eagerly on
    numpy and torch (through the op: x requires grad), under jax.jit and torch.compile."""
    jax = pytest.importorskip("jax")
    with pytest.raises(TypeError, match=message):
        K.reduce(data(), **kw)
    with pytest.raises(TypeError, match=message):
        K.reduce(torch.from_numpy(data()), **kw)
    with pytest.raises(TypeError, match=message):
        K.reduce(torch.from_numpy(data()).requires_grad_(), **kw)
    with pytest.raises(TypeError, match=message):
        jax.jit(lambda x: K.reduce(x, **kw))(data())
    if not compiled:
        return
    torch._dynamo.reset()
    with pytest.raises(Exception) as e:
        torch.compile(lambda x: K.reduce(x, **kw), fullgraph=True)(torch.zeros(2, 3))
    text = str(e.value).replace("\\'", "'")
    assert re.search(message, text), text


@pytest.mark.parametrize("big", [2**63, -(2**63) - 1, np.uint64(2**64 - 1)])
def test_an_int64_array_element_out_of_range_is_refused_naming_it(torch, big):
    """Before: eagerly an OverflowError "Python int too large to convert to C long" naming
    nothing; under jit "passed a tuple ((9223372036854775808,))"; compiled, torch's schema error."""
    message = rf"attribute 'axes' is declared 'int64\[\]'.*element 0, {int(big)}, does not fit an int64"
    # (Compiled, dynamo makes a numpy scalar a tensor: numpy values are not checked there.)
    _refused_in_every_mode({"axes": [big]}, message, torch, compiled=type(big) is int)


def test_a_str_that_utf8_cannot_encode_is_refused_naming_it(torch):
    """A lone surrogate: before, eagerly a UnicodeEncodeError naming nothing, under jit "passed a
    str ('\\ud800')" without saying what is wrong with it."""
    message = r"attribute 'mode' is declared 'str'.*not UTF-8 encodable"
    _refused_in_every_mode({"axes": [0], "mode": "s\ud800"}, message, torch)


def test_a_float_array_element_past_float64_is_refused_naming_it(torch):
    """An int past float64's range: before, an OverflowError "int too large to convert to float"
    naming nothing (eagerly), or torch's schema error."""
    message = r"attribute 'coeffs' is declared 'float64\[\]'.*element 1 does not fit a float64"
    jax = pytest.importorskip("jax")
    for call in (
        lambda: K.poly(data(), [1.0, 10**400]),
        lambda: K.poly(torch.from_numpy(data()).requires_grad_(), [1.0, 10**400]),
        lambda: jax.jit(lambda x: K.poly(x, [1.0, 10**400]))(data()),
    ):
        with pytest.raises(TypeError, match=message):
            call()


def test_a_set_for_an_array_is_refused(torch):
    """A set has no order (poly's coefficients, channel_affine's channels are positional): torch's
    list schema refuses one; so does the kernel, in every mode, instead of taking its iteration
    order."""
    message = r"attribute 'axes' is declared 'int64\[\]', but the call passed a set"
    _refused_in_every_mode({"axes": {0, 2}}, message, torch)


def test_an_array_reaches_the_function_and_backward_as_a_tuple_in_every_mode(torch):
    """The kernel documents arrays as tuples of Python numbers for the function, its backward
    and jvp. Before: through the torch op (a tensor requiring grad, torch.compile, torch.func)
    torch handed the function and the backward a list, so `axes + (-1,)` raised TypeError."""
    seen = []

    def f(x, axes, mode):
        seen.append(("fn", type(axes)))
        assert (axes + (-1,))[-1] == -1  # tuple concatenation: a list refuses it
        return x * len(axes)

    def bw(n):
        seen.append(("bw", type(n["axes"])))
        return {"x": n["grad"] * len(n["axes"])}

    def jvp(n):
        seen.append(("jvp", type(n["axes"])))
        return n["tangent_x"] * len(n["axes"])

    k = dlbridge.kernels.kernel(
        f, name="tuples", namespace="dlbridge_attrs_test", attrs={"axes": "int64[]", "mode": "str"},
        out="x", backward=bw, jvp=jvp,
    )
    x = torch.ones(3, dtype=torch.float64)
    k(x, [0, 1], "m")
    xg = x.clone().requires_grad_()
    k(xg, [0, 1], "m").sum().backward()
    torch.testing.assert_close(xg.grad, torch.full_like(x, 2.0))
    torch._dynamo.reset()
    torch.compile(lambda a: k(a, [0, 1], "m"), fullgraph=True)(x)
    torch.func.grad(lambda a: k(a, [0, 1], "m").sum())(x)
    torch.func.jvp(lambda a: k(a, [0, 1], "m"), (x,), (x,))
    torch.func.vmap(lambda a: k(a, [0, 1], "m"))(torch.ones(2, 3, dtype=torch.float64))
    kinds = {who for who, _ in seen}
    assert kinds == {"fn", "bw", "jvp"}, seen
    assert all(t is tuple for _, t in seen), seen


def test_a_subclass_of_kernel_with_str_and_array_attributes():
    """Before: KeyError (the checking class was looked up for Kernel and its several-results
    class only), so a subclass of the public Kernel with a str or array attribute could not be
    made. Now its attributes are checked and it stays an instance of the subclass."""

    class Logged(dlbridge.kernels.Kernel):
        def describe(self):
            return f"logged {self.__name__}"

    def f(x, mode, w):
        assert type(w) is tuple
        return x * len(w) if mode == "n" else x

    k = Logged(f, attrs={"mode": "str", "w": "float64[]"}, out="x")
    assert isinstance(k, Logged) and k.describe() == "logged f"
    np.testing.assert_allclose(k(np.ones(2), "n", [1.0, 2.0]), [2.0, 2.0])
    with pytest.raises(TypeError, match=r"attribute 'w' is declared 'float64\[\]'.*element 0 is a str"):
        k(np.ones(2), "n", ["a"])
    with pytest.raises(TypeError, match=r"attribute 'mode' is declared 'str', but the call passed a list"):
        k(np.ones(2), ["n"], [1.0])
