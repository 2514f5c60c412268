"""The error contract (issue 20): whatever a producer raises when it refuses an export, the caller
of `from_dlpack` (or `asdlpack`, or a kernel taking a `ManagedTensor`) gets a `BufferError` whose
`__cause__` is the producer's exception; a producer's own `BufferError` passes as it is, and
interrupts, exits and `MemoryError` pass untouched (they are not refusals)."""

from __future__ import annotations

import pytest

import dlbridge

from .libs import need


def _refused(call, cause_type: type[BaseException]) -> BufferError:
    with pytest.raises(BufferError) as info:
        call()
    e = info.value
    assert isinstance(e.__cause__, cause_type), (type(e.__cause__), e)
    assert cause_type.__name__ in str(e), str(e)  # the message names what the producer raised
    return e


def test_torch_meta_tensor_is_a_buffer_error() -> None:
    torch = need("torch")
    m = torch.empty(3, device="meta")
    # torch's own __dlpack_device__ raises ValueError for a meta tensor.
    for f in (dlbridge.from_dlpack, dlbridge.asdlpack):
        e = _refused(lambda f=f: f(m), ValueError)
        assert "meta" in str(e)


def test_torch_mkldnn_tensor_is_a_buffer_error() -> None:
    torch = need("torch")
    try:
        k = torch.randn(2, 2).to_mkldnn()
    except RuntimeError as e:  # a torch build without oneDNN
        pytest.skip(f"this torch has no mkldnn tensors: {e}")
    with pytest.raises(BufferError) as info:
        dlbridge.from_dlpack(k)
    # torch 2.15 raises NotImplementedError from __dlpack_device__ (then it is the cause); a torch
    # whose __dlpack_device__ answers refuses in __dlpack__ with its own BufferError about the layout.
    cause = info.value.__cause__
    assert isinstance(cause, NotImplementedError) or (cause is None and "layout" in str(info.value)), info.value


def test_numpy_refusing_a_device_is_a_buffer_error() -> None:
    np = need("numpy")
    # numpy 2.2 (the last for CPython 3.10) raises ValueError here, newer numpy BufferError.
    with pytest.raises(BufferError) as info:
        dlbridge.from_dlpack(np.arange(3.0), device=(2, 0))
    cause = info.value.__cause__
    assert cause is None or isinstance(cause, ValueError), repr(cause)


class FakeRefusingProducer:
    """A producer whose __dlpack__ (or __dlpack_device__) raises what it is given: no real library
    raises each of these on demand."""

    def __init__(self, exc: BaseException, where: str = "__dlpack__") -> None:
        self.exc, self.where = exc, where

    def __dlpack__(self, **_kw):
        raise self.exc

    def __dlpack_device__(self):
        if self.where == "__dlpack_device__":
            raise self.exc
        return (1, 0)


@pytest.mark.parametrize("where", ["__dlpack__", "__dlpack_device__"])
@pytest.mark.parametrize("exc", [ValueError("no"), RuntimeError("no"), NotImplementedError("no"), TypeError("bad dtype")])
def test_any_refusal_becomes_a_buffer_error_with_its_cause(exc: Exception, where: str) -> None:
    p = FakeRefusingProducer(exc, where)
    e = _refused(lambda: dlbridge.from_dlpack(p), type(exc))
    assert e.__cause__ is exc
    assert f"FakeRefusingProducer.{where}()" in str(e)
    _refused(lambda: dlbridge.asdlpack(p), type(exc))


class FakePropertyRefusal:
    """A producer whose __dlpack_device__ is a property that refuses when it is looked up."""

    @property
    def __dlpack_device__(self):
        raise ValueError("refused at lookup")

    def __dlpack__(self, **_kw):
        raise AssertionError("never reached")


def test_a_refusal_when_dlpack_device_is_looked_up_is_wrapped_too() -> None:
    e = _refused(lambda: dlbridge.from_dlpack(FakePropertyRefusal()), ValueError)
    assert "refused at lookup" in str(e)


def test_a_refusal_under_copy_true_keeps_the_first_cause() -> None:
    first = RuntimeError("cannot copy")
    p = FakeRefusingProducer(first)
    e = _refused(lambda: dlbridge.from_dlpack(p, copy=True), RuntimeError)
    assert e.__cause__ is first


def test_a_producer_buffer_error_passes_as_it_is() -> None:
    own = BufferError("the producer's own words")
    with pytest.raises(BufferError) as info:
        dlbridge.from_dlpack(FakeRefusingProducer(own))
    assert info.value is own


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), MemoryError("out"), SystemExit(3)])
@pytest.mark.parametrize("where", ["__dlpack__", "__dlpack_device__"])
def test_interrupts_exits_and_memory_errors_pass_untouched(exc: BaseException, where: str) -> None:
    with pytest.raises(type(exc)) as info:
        dlbridge.from_dlpack(FakeRefusingProducer(exc, where))
    assert info.value is exc


def test_an_object_without_dlpack_is_still_a_type_error() -> None:
    with pytest.raises(TypeError):
        dlbridge.from_dlpack(object())
