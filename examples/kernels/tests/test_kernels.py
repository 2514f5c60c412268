"""The example kernels, called from numpy, torch and jax as their users would: each result is the
caller's own kind of array with the right values, inputs are borrowed without copying (in-place
writes land in the caller's memory), and every refusal says what was expected and what came."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import dlbridge
import dlbridge_kernels as K


def torch():
    return pytest.importorskip("torch")


def jax():
    j = pytest.importorskip("jax")
    j.config.update("jax_enable_x64", True)
    return j


def frameworks():
    """(name, to_array(np_array) -> the framework's array, its array type)."""
    out = [("numpy", lambda a: a, np.ndarray)]
    try:
        import torch as t

        out.append(("torch", lambda a: t.from_numpy(np.ascontiguousarray(a) if a.ndim else a.copy()), t.Tensor))
    except ImportError:
        pass
    try:
        import jax as j

        j.config.update("jax_enable_x64", True)
        out.append(("jax", lambda a: j.numpy.asarray(a), j.Array))
    except ImportError:
        pass
    return out


FRAMEWORKS = [f[0] for f in frameworks()]


def fw(name):
    return next(f for f in frameworks() if f[0] == name)


def host(x) -> np.ndarray:
    return np.asarray(dlbridge.from_dlpack(x)) if not isinstance(x, np.ndarray) else x


def notes(e) -> list:
    return getattr(e, "__notes__", []) if sys.version_info >= (3, 11) else []


# --- saxpy ---


@pytest.mark.parametrize("name", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_saxpy_returns_the_callers_type(name, dtype):
    _, make, kind = fw(name)
    x, y = np.arange(5, dtype=dtype), np.full(5, 0.5, dtype=dtype)
    out = K.saxpy(2.0, make(x), make(y))
    assert isinstance(out, kind)
    assert str(host(out).dtype) == dtype
    assert host(out).tolist() == (2.0 * x + y).tolist()


def test_saxpy_refusals_say_expected_and_found():
    x = np.arange(4, dtype=np.float32)
    with pytest.raises(TypeError, match=r"^saxpy: x: expected float32 or float64, got int64"):
        K.saxpy(1.0, np.arange(4), np.arange(4))
    with pytest.raises(TypeError) as e:
        K.saxpy(1.0, x, np.arange(4.0))
    assert str(e.value) == "expected float32 1-d C-contiguous cpu tensor, got float64 (4,) on cpu"
    if sys.version_info >= (3, 11):
        assert notes(e.value) == ["while processing 'y'"]
    with pytest.raises(TypeError, match=r"^expected float32 1-d C-contiguous cpu tensor, got float32 \(2,\) strides \(2,\) on cpu"):
        K.saxpy(1.0, x[::2], x[:2])
    with pytest.raises(ValueError, match=r"^saxpy: x and y have lengths 4 and 3"):
        K.saxpy(1.0, x, x[:3])


# --- saxpy_: in place, typed arguments in the signature ---


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_saxpy_in_place_writes_the_callers_memory(name):
    _, make, kind = fw(name)
    x = make(np.arange(4, dtype=np.float32))
    y = make(np.ones(4, dtype=np.float32))
    before = dlbridge.from_dlpack(y).data_ptr
    out = K.saxpy_(3.0, x, y)
    assert out is y  # the caller's own object back
    assert dlbridge.from_dlpack(y).data_ptr == before  # no copy: the same memory
    assert host(y).tolist() == [1.0, 4.0, 7.0, 10.0]  # Rust's write seen by the caller
    y[0] = 100.0  # the caller's write seen by the next Rust call
    K.saxpy_(1.0, x, y)
    assert host(y).tolist() == [100.0, 5.0, 9.0, 13.0]


def test_saxpy_in_place_refusals():
    x = np.arange(4, dtype=np.float32)
    with pytest.raises(TypeError) as e:
        K.saxpy_(1.0, x, np.ones(4))
    assert str(e.value) == "expected writable float32 1-d C-contiguous cpu tensor, got float64 (4,) on cpu"
    if sys.version_info >= (3, 11):
        assert notes(e.value) == ["while processing 'y'"]
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match=r"^expected writable float32 1-d C-contiguous cpu tensor, got read-only float32 \(4,\) on cpu"):
        K.saxpy_(1.0, x, ro)
    with pytest.raises(TypeError, match=r"got float32 \(2, 2\) on cpu"):
        K.saxpy_(1.0, x, np.ones((2, 2), np.float32))
    # The same array as x and y: the second guard is refused instead of aliasing.
    with pytest.raises(BufferError, match="already borrowed"):
        K.saxpy_(1.0, x, x)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_list_is_refused_saying_what_an_argument_takes():
    """Not "from_dlpack: ..." (a function the caller never called): what is accepted, and the
    argument named in the note."""
    with pytest.raises(TypeError) as e:
        K.saxpy_(1.0, [1.0, 2.0], np.ones(2, np.float32))
    assert str(e.value) == (
        "expected an array (an object with __dlpack__ or the buffer protocol), got list; "
        "dlbridge.asdlpack(x) makes a DLPack tensor of any object with __dlpack__, the buffer protocol, "
        "__array_interface__ or __cuda_array_interface__"
    )
    if sys.version_info >= (3, 11):
        assert notes(e.value) == ["while processing 'x'"]
    with pytest.raises(TypeError, match=r"^expected an array .*, got list"):
        K.softmax([[1.0]])


def test_saxpy_in_place_refuses_jax_arrays_which_are_immutable():
    j = jax()
    x = j.numpy.arange(4, dtype="float32")
    with pytest.raises(TypeError, match=r"^expected writable float32 1-d C-contiguous cpu tensor, got read-only float32 \(4,\) on cpu"):
        K.saxpy_(1.0, x, x)


# --- softmax ---


def softmax_ref(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("name", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_softmax_rows(name, dtype):
    _, make, kind = fw(name)
    a = np.random.default_rng(0).standard_normal((64, 33)).astype(dtype)
    out = K.softmax(make(a))
    assert isinstance(out, kind)
    np.testing.assert_allclose(host(out), softmax_ref(a.astype(np.float64)), rtol=1e-5 if dtype == "float32" else 1e-12)


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_softmax_bfloat16(name):
    lib = torch() if name == "torch" else jax()
    a = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    x = lib.tensor(a).bfloat16() if name == "torch" else lib.numpy.asarray(a, dtype="bfloat16")
    out = K.softmax(x)
    assert isinstance(out, fw(name)[2])
    assert str(out.dtype).endswith("bfloat16")
    got = out.float().numpy() if name == "torch" else np.asarray(out.astype("float32"))
    np.testing.assert_allclose(got, softmax_ref(a.astype(np.float64)), atol=1e-2)


def test_softmax_refusals():
    with pytest.raises(TypeError) as e:
        K.softmax(np.zeros((3, 2), np.float32).T)
    assert str(e.value) == "expected float32 2-d C-contiguous cpu tensor, got float32 (2, 3) strides (1, 2) on cpu"
    if sys.version_info >= (3, 11):
        assert notes(e.value) == ["while processing 'x'"]
    with pytest.raises(TypeError, match=r"^softmax: x: expected float32, float64 or bfloat16, got int32"):
        K.softmax(np.zeros((2, 2), np.int32))
    with pytest.raises(TypeError, match=r"^expected float64 2-d C-contiguous cpu tensor, got float64 \(4,\) on cpu"):
        K.softmax(np.zeros(4))


def test_softmax_runs_without_the_gil():
    """Another Python thread makes progress while a large softmax runs (the GIL is released)."""
    import threading
    import time

    a = np.random.default_rng(2).standard_normal((4000, 2000))
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.01)
    start = len(ticks)
    out = K.softmax(a)
    during = len(ticks) - start
    stop.set()
    t.join()
    np.testing.assert_allclose(out, softmax_ref(a), rtol=1e-12)
    assert during > 10, during


def test_softmax_of_an_empty_matrix():
    assert K.softmax(np.zeros((0, 3))).shape == (0, 3)
    assert K.softmax(np.zeros((3, 0))).shape == (3, 0)


# --- layer_norm ---


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_layer_norm_any_strides(name):
    _, make, kind = fw(name)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((6, 8))
    w, b = rng.standard_normal(8), rng.standard_normal(8)
    mean = a.mean(1, keepdims=True)
    expect = (a - mean) / np.sqrt(a.var(1, keepdims=True) + 1e-5) * w + b
    out = K.layer_norm(make(a), make(w), make(b))
    assert isinstance(out, kind)
    np.testing.assert_allclose(host(out), expect, rtol=1e-10)
    if name == "numpy":  # strided inputs, no copy made by the caller
        at = np.asfortranarray(a)
        np.testing.assert_allclose(K.layer_norm(at, w[::-1][::-1], b), expect, rtol=1e-10)


def test_layer_norm_refusals():
    a = np.zeros((2, 3))
    with pytest.raises(ValueError, match=r"^layer_norm: weight and bias need length 3 \(x's rows\), got 2 and 3"):
        K.layer_norm(a, np.ones(2), np.ones(3))
    with pytest.raises(TypeError) as e:
        K.layer_norm(a, np.ones(3, np.float32), np.ones(3))
    assert str(e.value) == "expected float64 1-d cpu tensor, got float32 (3,) on cpu"
    if sys.version_info >= (3, 11):
        assert notes(e.value) == ["while processing 'weight'"]


# --- add_transposed ---


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_add_transposed(name):
    _, make, kind = fw(name)
    a = np.arange(12.0).reshape(3, 4)
    b = np.arange(12.0).reshape(4, 3) * 10
    out = K.add_transposed(make(a), make(b))
    assert isinstance(out, kind)
    assert host(out).tolist() == (a + b.T).tolist()


def test_add_transposed_strided_views():
    base = np.arange(40.0).reshape(5, 8)
    a = base[::2, 1::2]  # (3, 4), gapped strides
    b = base[::-1, ::-1][:4, :3]  # (4, 3), negative strides
    assert K.add_transposed(a, b).tolist() == (a + b.T).tolist()
    t = torch()
    ta = t.arange(12.0, dtype=t.float64).reshape(4, 3).t()  # (3, 4) transposed
    tb = t.ones(4, 3, dtype=t.float64)
    out = K.add_transposed(ta, tb)
    assert isinstance(out, t.Tensor) and out.tolist() == (ta + tb.t()).tolist()


def test_add_transposed_refusals():
    with pytest.raises(ValueError, match=r"^add_transposed: b must have shape \(4, 3\) for a of shape \(3, 4\), got \(3, 4\)"):
        K.add_transposed(np.zeros((3, 4)), np.zeros((3, 4)))
    with pytest.raises(TypeError) as e:
        K.add_transposed(np.zeros((3, 4), np.float32), np.zeros((4, 3)))
    assert str(e.value) == "expected float64 2-d cpu tensor, got float32 (3, 4) on cpu"
    if sys.version_info >= (3, 11):
        assert notes(e.value) == ["while processing 'a'"]


def test_writing_a_torch_tensor_bumps_its_version_so_autograd_refuses_stale_graphs():
    t = torch()
    w = t.tensor([2.0], requires_grad=True)
    x = t.tensor([3.0])
    y = (w * x).sum()
    before = x._version
    K.saxpy_(1.0, t.ones(1), x)
    assert x._version == before + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_a_huge_broadcast_input_is_a_memory_error():
    x = np.broadcast_to(np.float64(0), (1 << 20, 1 << 20))
    with pytest.raises(MemoryError):
        K.add_transposed(x, x)


def test_layer_norm_of_empty_rows():
    out = K.layer_norm(np.ones((2, 0)), np.ones(0), np.ones(0))
    assert out.shape == (2, 0)
