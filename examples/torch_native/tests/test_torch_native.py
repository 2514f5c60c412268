"""Kernels registered as native torch ops through torch's stable C ABI (examples/torch_native).

The ops are defined and implemented from Rust through the C functions libtorch exports, found at
run time (no link-time torch): their CPU kernels are XLA FFI handlers (the bodies jax.jit runs)
run through dlbridge's adapter, their Meta kernels the output rule.
"""

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
native = pytest.importorskip("dlbridge_torch_native")


@pytest.fixture(scope="module")
def ops():
    assert native.register().startswith(torch.__version__.split("+")[0].rsplit(".", 1)[0])
    return torch.ops.dlbridge_native


def test_saxpy_matches_torch_for_each_dtype_and_layout(ops):
    x = torch.arange(5, dtype=torch.float32)
    y = torch.linspace(0, 1, 5)
    torch.testing.assert_close(ops.saxpy(x, y, 2.5), 2.5 * x + y)
    torch.testing.assert_close(ops.saxpy(x.double(), y.double(), -1.0), -x.double() + y.double())
    # A strided view with an offset: made contiguous for the handler.
    wide = torch.arange(12, dtype=torch.float32)
    torch.testing.assert_close(ops.saxpy(wide[1::2][:5], y, 1.0), wide[1::2][:5] + y)


def test_in_place_writes_the_callers_tensor(ops):
    x = torch.arange(4, dtype=torch.float32)
    y = torch.ones(4)
    assert ops.saxpy_(x, y, 2.0) is None
    torch.testing.assert_close(y, 2.0 * x + 1)
    base = torch.zeros(8)
    view = base[::2]
    ops.saxpy_(x, view, 1.0)
    torch.testing.assert_close(base, torch.tensor([0.0, 0, 1, 0, 2, 0, 3, 0]))


def test_in_place_bumps_the_version_counter(ops):
    # torch's ADInplaceOrView fallback is a fallthrough for a natively registered op, and the
    # stable ABI has no increment_version: the CPU kernel bumps through torch's C++ bump.
    y = torch.ones(3)
    view = y[1:]
    before = y._version
    ops.saxpy_(torch.ones(3), y, 1.0)
    assert y._version == before + 1 and view._version == y._version
    # Inside inference mode a plain tensor still counts (as y.add_ does there); an inference
    # tensor has no counter, and is written all the same.
    with torch.inference_mode():
        ops.saxpy_(torch.ones(3), y, 1.0)
        assert y._version == before + 2
        z = torch.ones(3)
        ops.saxpy_(torch.ones(3), z, 1.0)
    torch.testing.assert_close(z, torch.full((3,), 2.0))
    torch.testing.assert_close(y, torch.full((3,), 3.0))
    # Outside inference mode, an inference tensor is refused before anything is written (torch
    # refuses z.add_(1) there too).
    with pytest.raises(RuntimeError, match="saxpy_: y: an inference tensor cannot be written in place outside"):
        ops.saxpy_(torch.ones(3), z, 1.0)
    torch.testing.assert_close(z, torch.full((3,), 2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16], ids=str)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_an_in_place_call_bumps_the_version_once_as_torch_does(ops, dtype, strided):
    # A non-contiguous written argument is computed on a contiguous copy and written back; the
    # write-back is no torch op of its own (aten::copy_ bumped the version a second time).
    def operand():
        base = torch.arange(24, dtype=dtype).reshape(4, 6)
        return base, base[:, ::2] if strided else base

    (base, x), (ref_base, ref) = operand(), operand()
    assert x.is_contiguous() is not strided
    ops.increment_(x)
    ref.add_(1)
    assert (x._version, base._version) == (ref._version, ref_base._version) == (1, 1)
    torch.testing.assert_close(base, ref_base)
    with torch.no_grad():
        ops.increment_(x)
        ref.add_(1)
    with torch.inference_mode():  # a normal tensor counts there too
        ops.increment_(x)
        ref.add_(1)
    assert (x._version, base._version) == (ref._version, ref_base._version) == (3, 3)
    torch.testing.assert_close(base, ref_base)
    # saxpy_ (float32, two operands, a scalar): the same count.
    y = torch.zeros(8)[::2] if strided else torch.zeros(4)
    ops.saxpy_(torch.ones(4), y, 2.0)
    assert y._version == 1
    torch.testing.assert_close(y, torch.full((4,), 2.0))


def test_a_saved_tensor_the_op_overwrites_fails_backward_as_torch_does(ops):
    def backward_after(write):
        w = torch.randn(4, 3, requires_grad=True)
        v = torch.ones(4, 6)[:, ::2]
        out = (w * v).sum()  # saves v for w's gradient
        write(v)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as e:
            out.backward()
        return str(e.value)

    ours = backward_after(ops.increment_)
    assert "is at version 1; expected version 0 instead" in ours, ours
    assert ours == backward_after(lambda v: v.add_(1))


def test_writing_a_tensor_whose_elements_share_memory_is_refused_before_the_handler(ops):
    y = torch.zeros(1).expand(4)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch.zeros(1).expand(4).add_(1)  # torch's own refusal
    why = r"saxpy_: y: more than one element refers to the same memory \(dimension 0: extent 4, stride 0\)"
    with pytest.raises(RuntimeError, match=why):
        ops.saxpy_(torch.ones(4), y, 1.0)
    assert y._version == 0
    torch.testing.assert_close(y, torch.zeros(4))


def test_a_written_strided_argument_of_more_than_64_dimensions_is_refused_and_64_are_written(ops):
    # torch allows 70 dimensions; dlbridge reads at most 64 (the strided write-back walks that
    # many), so such an argument is refused before the handler runs (nothing written, no version
    # bump), with the reason.
    x = torch.zeros([1] * 69 + [4])[..., ::2]
    assert x.dim() == 70 and not x.is_contiguous()
    with pytest.raises(RuntimeError, match=r"increment_: aoti_torch_get_sizes: 70 dimensions \(at most 64\)"):
        ops.increment_(x)
    assert x._version == 0
    assert bool((x.reshape(-1) == 0).all())  # (torch's own assert_close takes at most 64 dimensions)
    y = torch.zeros([1] * 63 + [4])[..., ::2]
    ops.increment_(y)
    torch.testing.assert_close(y, torch.ones_like(y))
    assert y._version == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16], ids=str)
def test_a_written_argument_with_a_huge_stride_on_an_extent_of_one_is_written_as_torch_does(ops, dtype):
    # torch lets a dimension of extent 1 have any stride: it is never applied. The strided
    # write-back stepped through it (2^62 times the element width overflowed): the call failed
    # after the handler had run ("attempt to multiply with overflow") where x.add_ succeeds.
    def operand(sizes, strides):
        base = torch.zeros(2, 8, dtype=dtype)
        return base, base.as_strided(sizes, strides)

    huge = 1 << 62
    for sizes, strides in [((2, 1, 4), (8, huge, 2)), ((4, 2, 1), (2, 8, huge))]:
        (base, x), (ref_base, ref) = operand(sizes, strides), operand(sizes, strides)
        assert not x.is_contiguous()
        ops.increment_(x)
        ref.add_(1)
        torch.testing.assert_close(base, ref_base)
        assert x._version == ref._version == 1


def test_errors_are_runtime_errors_naming_the_op(ops):
    with pytest.raises(RuntimeError, match="fails: refused: not today"):
        ops.fails(torch.ones(2), "not today")
    # The handler's own refusal, word for word as under jax.jit.
    with pytest.raises(RuntimeError, match=r"saxpy: saxpy_xla: x: int32 \(float32 or float64\)"):
        ops.saxpy(torch.ones(2, dtype=torch.int32), torch.ones(2), 1.0)
    with pytest.raises(RuntimeError, match="saxpy: saxpy_xla: x and y: shapes"):
        ops.saxpy(torch.ones(2), torch.ones(3), 1.0)
    # The process goes on.
    torch.testing.assert_close(ops.saxpy(torch.ones(2), torch.ones(2), 1.0), torch.full((2,), 2.0))


def test_meta_and_fake_tensors_need_no_python(ops):
    m = ops.saxpy(torch.empty(7, device="meta"), torch.empty(7, device="meta"), 1.0)
    assert m.device.type == "meta" and m.shape == (7,)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(3, dtype=torch.float64)
        out = ops.saxpy(a, a, 1.0)
    assert out.shape == (3,) and out.dtype == torch.float64


def test_opcheck_passes(ops):
    x, y = torch.randn(6), torch.randn(6)
    for op, args in [(ops.saxpy.default, (x, y, 0.5)), (ops.saxpy_.default, (x, y.clone(), 0.5))]:
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, result


def test_no_python_function_runs_inside_the_op(ops):
    x, y = torch.randn(4), torch.randn(4)
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    def profiled():
        sys.setprofile(profile)
        try:
            ops.saxpy.default(x, y, 1.0)
        finally:
            sys.setprofile(None)

    profiled()  # grad mode on (no autograd formula registered in this process)
    with torch.inference_mode():
        profiled()
    assert len(calls) == 2
    # Only torch's own OpOverload.__call__ (the Python entry of every torch op), nothing else.
    assert all(c.endswith("torch/_ops.py:__call__") for c in calls), calls


def test_compiled_fullgraph(ops):
    @torch.compile(fullgraph=True, backend="inductor")
    def f(x, y):
        return ops.saxpy(x, y, 3.0) * 2

    x, y = torch.randn(5), torch.randn(5)
    torch.testing.assert_close(f(x, y), (3.0 * x + y) * 2)


def test_register_autograd_from_python():
    # Autograd has no stable C API: its formula stays Python, on the native op. In a child, so
    # the formula does not reach the other tests' calls.
    code = textwrap.dedent(
        """
        import torch, dlbridge_torch_native as n
        n.register()
        def backward(ctx, grad):
            return grad * ctx.a, grad, None
        def setup_context(ctx, inputs, output):
            ctx.a = inputs[2]
        torch.library.register_autograd("dlbridge_native::saxpy", backward, setup_context=setup_context)
        x = torch.randn(3, requires_grad=True)
        y = torch.randn(3, requires_grad=True)
        torch.ops.dlbridge_native.saxpy(x, y, 4.0).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((3,), 4.0))
        torch.testing.assert_close(y.grad, torch.ones(3))
        print("gradients ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "gradients ok" in out.stdout, out.stderr


def test_a_process_without_torch_is_told_so():
    # register() before torch is imported: dlbridge finds no libtorch in the process, and says so
    # (the Python op stays the fallback there).
    code = textwrap.dedent(
        """
        import dlbridge_torch_native as n
        try:
            n.register()
        except RuntimeError as e:
            print("refused:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused: libtorch (libtorch_cpu.so) is not available" in out.stdout, out.stdout
    assert "import torch first" in out.stdout


def test_a_kernel_made_by_add_kernel_is_a_native_op():
    # empty_like: add_kernel with a handler; dlbridge.kernels registers it natively by itself.
    k = native.empty_like
    assert k._native_fallback is None
    assert isinstance(k.torch_op, torch._ops.OpOverloadPacket)
    x = torch.ones(2, 3)
    with torch.inference_mode():
        out = k.torch_op(x)
    assert out.shape == (2, 3) and out.dtype == torch.float32 and out.data_ptr() != x.data_ptr()
