"""Edge cases of affine_rowsum and stack_sums (several results with an optional tensor or a list
of tensors): empty extents, long lists, and what each mode does with them."""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge.kernels
import dlbridge_kernels as K


@pytest.fixture
def torch():
    t = pytest.importorskip("torch")
    dlbridge.kernels.torch_ready()
    return t


@pytest.fixture
def jax():
    return pytest.importorskip("jax")


@pytest.mark.parametrize("k", [2, 3, 5])
def test_zero_length_items_sum_to_zero_in_every_mode(torch, jax, k):
    """Each item of length 0: `stacked` is (k, 0) and every sum is 0. The sums were never
    written when the stacked rows were empty (the rows drove the loop), so the result buffer's
    old contents came back: the native op's and jax.jit's buffers are not zeroed."""
    jnp = jax.numpy
    zero = np.zeros(k, np.float32)
    for s, sums in (
        K.stack_sums([np.zeros(0, np.float32)] * k),
        K.stack_sums([torch.zeros(0)] * k),
        torch.ops.dlbridge_kernels.stack_sums([torch.zeros(0)] * k),
        jax.jit(K.stack_sums)([jnp.zeros(0, jnp.float32)] * k),
    ):
        assert tuple(s.shape) == (k, 0)
        np.testing.assert_array_equal(np.asarray(sums), zero)


@pytest.mark.parametrize("rows", [2, 3, 5])
def test_zero_columns_total_zero_in_every_mode(torch, jax, rows):
    """x of shape (rows, 0): y is (rows, 0) and every row's total is 0 (the totals were left
    unwritten, as above), with and without a bias; opcheck agrees with the Meta kernel."""
    jnp = jax.numpy
    zero = np.zeros(rows, np.float32)
    x, w = np.zeros((rows, 0), np.float32), np.zeros(0, np.float32)
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    for y, total in (
        K.affine_rowsum(x, w),
        K.affine_rowsum(x, w, w),
        torch.ops.dlbridge_kernels.affine_rowsum(tx, tw, None),
        torch.ops.dlbridge_kernels.affine_rowsum(tx, tw, tw),
        jax.jit(K.affine_rowsum)(jnp.asarray(x), jnp.asarray(w)),
        jax.jit(K.affine_rowsum)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(w)),
    ):
        assert tuple(y.shape) == (rows, 0)
        np.testing.assert_array_equal(np.asarray(total), zero)
    result = torch.library.opcheck(K.affine_rowsum._overload, (tx, tw, tw))
    assert set(result.values()) == {"SUCCESS"}, result


def test_a_none_item_in_a_list_is_refused_naming_the_item_in_every_mode(torch, jax):
    """None among a list's items: numpy and torch eagerly said "item 1: expected an array"
    (no kernel, no argument), a torch tensor that requires grad gave torch's schema error
    ("Expected a value of type 'List[Tensor]'"), and jax.jit "None is not a valid value for
    jnp.array"; each now names the kernel and the item."""
    jnp = jax.numpy
    match = r"stack_sums: argument 'xs'\[1\] is None, but 'xs' is a list of tensors"
    calls = [
        lambda: K.stack_sums([np.ones(5, np.float32), None]),
        lambda: K.stack_sums((torch.ones(5), None)),
        lambda: K.stack_sums([torch.ones(5, requires_grad=True), None]),
        lambda: torch.func.grad(lambda a: K.stack_sums([a, None])[1].sum())(torch.ones(5)),
        lambda: K.stack_sums([jnp.ones(5), None]),
        lambda: jax.jit(K.stack_sums)([jnp.ones(5), None]),
        lambda: jax.grad(lambda a: K.stack_sums([a, None])[1].sum())(jnp.ones(5)),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=match):
            call()


@pytest.mark.parametrize("n", [17, 30])
def test_a_list_past_the_native_frame_is_refused_naming_the_list_and_its_length(torch, n):
    """The native op's frame holds 16 operands. A longer list was refused as "stack_sums:
    stack_sums: 17 tensor operands (at most 16)": the op named twice, the count where the frame
    filled (17 for 30 items), the list not named. 16 items pass; eagerly any length does."""
    xs = [torch.ones(5) for _ in range(16)]
    torch.testing.assert_close(K.stack_sums([t.requires_grad_() for t in xs])[1], torch.full((16,), 5.0))
    xs = [torch.ones(5, requires_grad=True) for _ in range(n)]
    torch.testing.assert_close(K.stack_sums([t.detach() for t in xs])[1], torch.full((n,), 5.0))
    with pytest.raises(RuntimeError) as e:
        K.stack_sums(xs)
    message = str(e.value)
    assert f"{n} tensor operands (xs: a list of {n} tensors)" in message, message
    assert "at most 16" in message and "stack_sums: stack_sums" not in message, message


def scaled_by_count(xs, ys, w):
    """``w * (1 + len(xs) + len(ys))``: a kernel with two list parameters before a tensor."""
    return w * (1 + len(xs) + len(ys))


def test_torch_func_grad_after_two_empty_lists_is_right(torch):
    """Under torch.func each list's items are inputs of their own, so two empty lists make fewer
    inputs (the lists' lengths, then w) than parameters (xs, ys, w). The backward's gradients, one
    per parameter, were cut to the inputs' count as for a call leaving out a trailing default:
    w's gradient was dropped and torch.func.grad gave zeros, silently."""

    def backward(named):
        g, k = named["grad"], 1 + len(named["xs"]) + len(named["ys"])
        zeros = lambda ts: [torch.zeros_like(t) for t in ts]  # noqa: E731
        return {"w": g * k, "xs": zeros(named["xs"]), "ys": zeros(named["ys"])}

    k = dlbridge.kernels.kernel(
        scaled_by_count,
        name="scaled_by_count",
        namespace="dlbridge_review_test",
        lists=["xs", "ys"],
        out="w",
        backward=backward,
    )
    w = torch.tensor([1.0, -2.0, 3.0])
    for xs, ys in (([], []), ([torch.ones(2)], []), ([], [torch.ones(2)] * 2)):
        n = 1 + len(xs) + len(ys)
        torch.testing.assert_close(torch.func.grad(lambda w: k(xs, ys, w).sum())(w), torch.full((3,), float(n)))
        torch.testing.assert_close(torch.func.jacrev(lambda w: k(xs, ys, w))(w), n * torch.eye(3))
        wr = w.clone().requires_grad_()
        k(xs, ys, wr).sum().backward()
        torch.testing.assert_close(wr.grad, torch.full((3,), float(n)))


BAD_RULES = {
    "negative": (lambda s, d, a: [((-1, 5), "float32"), ((2,), "float32")], r"\(-1, 5\), a negative extent"),
    "overflow": (
        lambda s, d, a: [((2**40, 2**40), "float32"), ((2,), "float32")],
        r"\(1099511627776, 1099511627776\), whose element count overflows a 64-bit integer",
    ),
    "fraction": (lambda s, d, a: [((2.5, 5), "float32"), ((2,), "float32")], r"\(2.5, 5\): a shape is a sequence of integers"),
}


def stack_sums_with_rule(name):
    rule = BAD_RULES[name][0]
    return dlbridge.kernels.kernel(
        K.stack_sums.__wrapped__,
        name=f"stack_sums_{name}",
        namespace="dlbridge_review_test",
        lists=["xs"],
        ffi=K.stack_sums._ffi,
        results=("stacked", "sums"),
        result_rule=rule,
    )


@pytest.mark.parametrize("name", ["negative", "fraction"])
def test_a_python_rule_giving_a_bad_shape_is_refused_naming_the_kernel_and_the_result(torch, jax, name):
    """A Python result_rule's shape is checked as a Rust rule's is: jax.jit said "MLIRError:
    invalid tensor dimension size" (a negative extent), naming neither the kernel nor the result."""
    k = stack_sums_with_rule(name)
    match = rf"stack_sums_{name}: result stacked: result_rule gave the shape {BAD_RULES[name][1]}"
    xs = [np.ones(5, np.float32)] * 2
    with pytest.raises(ValueError, match=match):
        jax.jit(k)([jax.numpy.asarray(a) for a in xs])
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(k, fullgraph=True)([torch.from_numpy(a) for a in xs])


def test_a_python_rule_whose_element_count_overflows_is_refused_not_an_abort():
    """Under jax.jit, XLA aborted the whole process ("terminate called after throwing an instance
    of 'absl::BadStatusOrAccess' ... overflow in static extent product"): run in a child."""
    pytest.importorskip("jax")
    code = f"""
import numpy as np, jax
import sys; sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
from test_results_params_review import stack_sums_with_rule
k = stack_sums_with_rule("overflow")
try:
    jax.jit(k)([jax.numpy.ones(5, jax.numpy.float32)] * 2)
except ValueError as e:
    print("refused:", e)
"""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    expect = "refused: stack_sums_overflow: result stacked: result_rule gave the shape (1099511627776, 1099511627776)"
    assert expect in p.stdout, p.stdout + p.stderr[-2000:]


def test_a_python_number_in_a_list_is_refused_naming_the_item(torch):
    """A Python number among a list's items: torch eagerly said "item 0: expected an array", and
    with a tensor that requires grad torch's schema error; each now names the kernel and the item.
    (Under jax a number is a 0-d array, which the rule refuses in its own terms.)"""
    match = r"stack_sums: argument 'xs'\[0\] is a Python float \(1.0\), but 'xs' is a list of tensors"
    for call in (
        lambda: K.stack_sums([1.0, np.ones(5, np.float32)]),
        lambda: K.stack_sums([1.0, torch.ones(5)]),
        lambda: K.stack_sums([1.0, torch.ones(5, requires_grad=True)]),
    ):
        with pytest.raises(TypeError, match=match):
            call()
