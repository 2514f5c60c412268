"""Errors that say what to change, in the kernel author's terms (each reproduced with the
example's own handlers and functions)."""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge_kernels as k
from dlbridge.kernels import kernel

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402, F401

_n = iter(range(10**6))


def test_an_attribute_declared_float32_for_a_handler_reading_f64_names_the_declaration():
    """saxpy's handler reads `a` as f64; a kernel declaring it float32 passes numpy.float32 for
    the caller's Python float. Before: 'expected a f64 scalar, got float32 (pass
    numpy.float64(value))', to a caller who passed a Python float."""
    bad = kernel(
        k.saxpy.__wrapped__,
        name=f"saxpy_f32_{next(_n)}",
        namespace="errors",
        attrs={"a": "float32"},
        out="x",
        ffi=k.saxpy._ffi,
    )
    with pytest.raises(Exception, match="attribute a: the handler reads a f64 scalar, but the call passed float32") as e:
        jax.jit(lambda x, y: bad(2.0, x, y))(np.ones(3), np.ones(3))
    assert 'declare the attribute "float64" where the kernel is declared (KernelDef.attrs' in str(e.value)


def missing_attr():
    """layer_norm with its eps left out of attrs: a tensor parameter to the op."""
    return kernel(
        k.layer_norm.__wrapped__, name=f"ln_noattrs_{next(_n)}", namespace="errors", out="x", ffi=k.layer_norm._ffi
    )


WHAT_TO_DO = r"argument 'eps' is a Python float \(1e-05\), but the kernel declares 'eps' a tensor"
# dynamo quotes the refusal as the repr of the exception (its quotes escaped)
COMPILED = r"argument \\?'eps\\?' is a Python float \(1e-05\), but the kernel declares \\?'eps\\?' a tensor"


def test_a_scalar_missing_from_attrs_says_so_under_torch_compile():
    """Before: "Expected a value of type 'Tensor' for argument 'eps'" (the op's schema)."""
    ln = missing_attr()
    x, w, b = torch.randn(2, 4), torch.ones(4), torch.zeros(4)
    f = torch.compile(lambda x: ln(x, w, b, 1e-5), fullgraph=True)
    with pytest.raises(Exception, match=COMPILED) as e:
        f(x)
    assert """(Rust: KernelDef { attrs: &[("eps", "float64")], .. })""" in str(e.value)
    assert "Expected a value of type 'Tensor'" not in str(e.value)
    # keyword, and the eager op path (a tensor that requires grad goes through the op)
    with pytest.raises(Exception, match=COMPILED):
        torch.compile(lambda x: ln(x, w, b, eps=1e-5), fullgraph=True)(x)
    with pytest.raises(TypeError, match=WHAT_TO_DO):
        ln(x.clone().requires_grad_(), w, b, 1e-5)
    # the declared kernel is fine in the same places
    assert torch.compile(lambda x: k.layer_norm(x, w, b, 1e-5), fullgraph=True)(x).shape == (2, 4)


def test_a_scalar_missing_from_attrs_says_so_under_jax_jit():
    ln = missing_attr()
    with pytest.raises(TypeError, match=WHAT_TO_DO):
        jax.jit(lambda x: ln(x, np.ones(4), np.zeros(4), 1e-5))(np.ones((2, 4)))


def test_a_plain_function_under_jit_says_to_register_it_as_a_kernel():
    """Before: 'DynamicJaxprTracer.__dlpack__() refused the export (ConcretizationTypeError...)'."""
    plain = k.saxpy.__wrapped__  # the #[pyfunction] itself
    with pytest.raises(BufferError, match="got a jax tracer") as e:
        jax.jit(lambda x: plain(2.0, x, x))(np.ones(3))
    msg = str(e.value)
    assert "register the function as a kernel to use it inside jax.jit" in msg
    assert "dlbridge::python::add_kernel" in msg
    assert type(e.value.__cause__).__name__ == "ConcretizationTypeError"
    # A refusal by any other producer keeps its message.
    class Refuses:
        def __dlpack__(self, **kw):
            raise RuntimeError("no")

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(BufferError, match=r"Refuses.__dlpack__\(\) refused the export \(RuntimeError: no\)"):
        plain(2.0, Refuses(), np.ones(3))
