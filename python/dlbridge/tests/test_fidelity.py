"""Fidelity to each producer's own rules (issue 13): what torch's or numpy's own `__dlpack__`
refuses, dlbridge refuses too; a copy asked for is writable; `stream` goes only to device
producers; error paths hold no memory. Each test is the regression test of a reproduced defect."""

from __future__ import annotations

import ctypes
import sys

import pytest

import dlbridge

from ._dlpack_ctypes import FakeVersionedCapsule, read_capsule
from .libs import Delegate, assert_no_growth, have, need

hooks = pytest.mark.hooks


@pytest.mark.parametrize(
    "call",
    [
        lambda: dlbridge.asdlpack(5),
        lambda: dlbridge.from_dlpack(object()),
        lambda: dlbridge.from_dlpack(b"x", copy="yes"),
        lambda: dlbridge.Tensor.__dlpack__(dlbridge.asdlpack(b"ab"), stream=0, dl_device=(2, 0)),
    ],
    ids=["asdlpack", "from_dlpack", "bad-keyword", "__dlpack__"],
)
def test_error_paths_hold_no_memory(call) -> None:
    # Each raised error used to park its type and value in PyO3's deferred pool (17 MiB per 1e5).
    def once():
        try:
            call()
        except (TypeError, ValueError, BufferError):
            pass

    assert_no_growth(once, calls=50_000, warmup=5_000)


def test_a_numpy_subclass_that_overrides_dlpack_is_asked() -> None:
    np = need("numpy")

    class NoExport(np.ndarray):
        def __dlpack__(self, **kw):
            raise BufferError("NoExport refuses")

    with pytest.raises(BufferError, match="NoExport refuses"):
        dlbridge.from_dlpack(np.arange(3.0).view(NoExport))

    class LegacyOnly(np.ndarray):
        def __dlpack__(self, stream=None):  # a pre-2023 producer: legacy capsule, read-only
            return np.asarray(self).__dlpack__()

    t = dlbridge.from_dlpack(np.arange(3.0).view(LegacyOnly))
    assert t.readonly
    # A subclass that keeps numpy's own method still takes the fast path, writable.
    class Plain(np.ndarray):
        pass

    a = np.arange(3.0).view(Plain)
    t = dlbridge.from_dlpack(a)
    assert not t.readonly and t.data_ptr == a.ctypes.data


def test_a_torch_subclass_that_overrides_dlpack_is_asked() -> None:
    torch = need("torch")

    class NoExport(torch.Tensor):
        def __dlpack__(self, **kw):
            raise BufferError("NoExport refuses")

    with pytest.raises(BufferError, match="NoExport refuses"):
        dlbridge.from_dlpack(torch.arange(3.0).as_subclass(NoExport))


def test_a_name_alone_does_not_make_a_numpy_array() -> None:
    # A class named like numpy's ndarray used to be read as numpy's struct (out of bounds).
    class Spoof:
        pass

    Spoof.__name__ = Spoof.__qualname__ = "numpy.ndarray"
    Spoof.__module__ = "numpy"
    for f in (dlbridge.from_dlpack, dlbridge.asdlpack):
        with pytest.raises(TypeError):
            f(Spoof())


# torch's notice that its CSR layout is beta (given once per process, wherever a CSR tensor is made)
# is about torch's API, not dlbridge's: the suite's warnings-as-errors filter does not apply to it.
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
@pytest.mark.parametrize("layout", ["sparse", "sparse_csr"])
def test_torch_table_failures_are_torchs_buffer_errors(layout) -> None:
    torch = need("torch")
    x = torch.eye(3).to_sparse() if layout == "sparse" else torch.eye(3).to_sparse_csr()
    with pytest.raises(BufferError, match="layout"):
        dlbridge.from_dlpack(x)


@hooks
def test_tensors_that_require_grad_follow_each_paths_rule() -> None:
    # Owned imports follow torch's __dlpack__ (refused: "use tensor.detach()"). A borrowed view is
    # what a plain #[pyfunction] reads, and such a function is invisible to autograd: while grad mode
    # is on, a tensor that requires grad is refused (before, the view was taken and the function's
    # result silently carried no gradient back: review). Under torch.no_grad(), in inference mode
    # and inside an op's body (how kernels run on such tensors) grad mode is off and the view is
    # taken; an in-place write into a leaf is then allowed, as torch allows x.add_(1) there.
    torch = need("torch")
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    for f in (dlbridge.from_dlpack, dlbridge.asdlpack):
        with pytest.raises(BufferError, match="detach"):
            f(x)
    for f in (dlbridge._dlbridge._view, lambda t: dlbridge._dlbridge._view_add(t, 1.0)):
        with pytest.raises(BufferError, match="requires_grad: this tensor requires grad and grad mode is on"):
            f(x)
        with pytest.raises(BufferError, match="invisible to autograd"):
            f(x * 1)  # a non-leaf too: a write there would be hidden from autograd as well
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x.add_(1.0)  # torch's own rule on in-place writes, for comparison
    assert x.grad is None and x.tolist() == [1.0, 1.0, 1.0]
    ptr, shape, _strides, dtype, _ro = dlbridge._dlbridge._view(x.detach())
    assert (ptr, shape, dtype) == (x.data_ptr(), [3], "float64")
    with torch.no_grad():
        ptr, shape, _strides, dtype, _ro = dlbridge._dlbridge._view(x)
        assert (ptr, shape, dtype) == (x.data_ptr(), [3], "float64")
        dlbridge._dlbridge._view_add(x, 1.0)  # allowed, as torch allows x.add_(1) here
    assert x.tolist() == [2.0, 2.0, 2.0]
    with torch.inference_mode():
        assert dlbridge._dlbridge._view(x)[0] == x.data_ptr()
    # Inside an op's body grad mode is off: a custom op reading the tensor takes the view.
    seen = []

    @torch.library.custom_op("dlbridge_test::view_in_op", mutates_args=(), schema="(Tensor t) -> Tensor")
    def view_in_op(t):
        seen.append(dlbridge._dlbridge._view(t)[0])
        return t.clone()

    view_in_op(x)
    assert seen == [x.data_ptr()]


@hooks
def test_a_typed_mutable_argument_follows_torchs_in_place_rule() -> None:
    torch = need("torch")
    probe = dlbridge._dlbridge._typed_mut_probe
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(BufferError, match="requires_grad: this tensor requires grad and grad mode is on") as e:
        probe(w)
    assert "_x" in str(e.value) or any("_x" in n for n in getattr(e.value, "__notes__", [])), e.value
    v = w._version
    with torch.no_grad():
        probe(w)  # allowed, and the write is announced to autograd
    assert w._version == v + 1
    # A non-leaf too: torch's own in-place operations record themselves in the graph, a plain
    # function's write would not (the gradient through it would silently be wrong).
    with pytest.raises(BufferError, match="invisible to autograd"):
        probe(w * 2)
    probe(torch.ones(3, dtype=torch.float64))


def test_lazily_negated_real_tensors_are_refused() -> None:
    torch = need("torch")
    z = torch.tensor([1 + 2j, 3 - 4j])
    im = z.conj().imag  # float32 with the negative bit: memory holds [2, -4], it shows [-2, 4]
    assert im.is_neg()
    with pytest.raises(BufferError, match="resolve_neg"):
        dlbridge.from_dlpack(im)
    np = need("numpy")
    assert np.from_dlpack(dlbridge.from_dlpack(im.resolve_neg())).tolist() == [-2.0, 4.0]


def test_copy_true_from_tensorflow_is_made_by_dlbridge() -> None:
    tf = need("tensorflow")
    np = need("numpy")
    x = tf.constant([1.0, 2.0, 3.0])
    t = dlbridge.from_dlpack(x, copy=True)
    assert not t.readonly
    a = np.from_dlpack(t)
    a[0] = 9.0
    assert x.numpy().tolist() == [1.0, 2.0, 3.0] and a.tolist() == [9.0, 2.0, 3.0]


def test_copy_true_is_writable_whoever_copied() -> None:
    jnp = need("jax").numpy
    np = need("numpy")
    x = jnp.arange(3.0)
    t = dlbridge.from_dlpack(x, copy=True)
    assert not t.readonly
    a = np.from_dlpack(t)
    a[0] = 5.0
    assert np.asarray(x).tolist() == [0.0, 1.0, 2.0]
    # Without copy=, jax's legacy capsule stays read-only.
    assert dlbridge.from_dlpack(x).readonly


def test_stream_goes_only_to_device_producers() -> None:
    np = need("numpy")

    a = np.arange(3.0)
    for x in (a, Delegate(a)):  # numpy's struct path, and the protocol path
        assert dlbridge.from_dlpack(x, stream=-1).data_ptr == a.ctypes.data
        with pytest.raises(ValueError, match="stream 5 for a cpu tensor"):
            dlbridge.from_dlpack(x, stream=5)


def test_buffers_with_null_strides_are_c_contiguous() -> None:
    # ctypes arrays export strides NULL (PEP 3118: C-contiguous); they used to be refused.
    arr = (ctypes.c_int * 3)(1, 2, 3)
    t = dlbridge.asdlpack(arr)
    assert (t.shape, t.strides, str(t.dtype)) == ((3,), (1,), "int32")
    assert t.data_ptr == ctypes.addressof(arr)
    m = (ctypes.c_double * 2 * 3)()
    t2 = dlbridge.asdlpack(m)
    assert (t2.shape, t2.strides, str(t2.dtype)) == ((3, 2), (2, 1), "float64")
    if have("numpy"):
        np = need("numpy")
        np.from_dlpack(t)[1] = 7
        assert arr[1] == 7


def test_device_takes_its_id() -> None:
    assert str(dlbridge.Device("cuda", 1)) == "cuda:1"
    assert str(dlbridge.Device("cuda:2")) == "cuda:2"
    assert str(dlbridge.Device("cuda:2", 2)) == "cuda:2"
    with pytest.raises(ValueError, match="ordinal"):
        dlbridge.Device("cuda:2", 1)
    assert dlbridge.Device(2, 3).id == 3


def test_nbytes_is_exact_past_2_to_the_64() -> None:
    torch = need("torch")
    x = torch.zeros(1, dtype=torch.float64).expand(2**62)  # stride 0: 2^62 elements, 8 bytes of memory
    t = dlbridge.from_dlpack(x)
    assert t.nbytes == 2**65


def test_a_reexport_puts_byte_offset_into_data() -> None:
    fake = FakeVersionedCapsule(shape=(2,), strides=(1,), byte_offset=8)
    t = dlbridge.from_dlpack(fake)
    info = read_capsule(t.__dlpack__(max_version=(1, 3)))
    assert info.data == t.data_ptr and info.byte_offset == 0


def test_cuda_array_interface_reports_the_producer_stream() -> None:
    class FakeCuda:  # a made-up device pointer, never dereferenced
        __cuda_array_interface__ = {
            "shape": (2,), "typestr": "<f4", "data": (0x7F00_0000_0000, False), "version": 3,
            "strides": None, "stream": 0x1234,
        }

    class NoStream:
        __cuda_array_interface__ = {**FakeCuda.__cuda_array_interface__, "stream": None}

    t = dlbridge.asdlpack(FakeCuda(), device_id=0)
    assert t.__cuda_array_interface__["stream"] == 0x1234
    assert dlbridge.asdlpack(NoStream(), device_id=0).__cuda_array_interface__["stream"] is None


@hooks
def test_the_type_cache_hits_on_every_python() -> None:
    # On 3.13 CPython no longer sets Py_TPFLAGS_VALID_VERSION_TAG: the cache never hit (100 type
    # lookups for 100 imports) and a legacy producer paid a failing keyword call every time.
    np = need("numpy")

    class Producer(Delegate):  # a class of its own, for the cache to key on
        pass

    a = np.arange(3.0)
    dlbridge.from_dlpack(Producer(a))
    before = dlbridge._dlbridge._type_cache_misses()
    for _ in range(100):
        dlbridge.from_dlpack(Producer(a))
    assert dlbridge._dlbridge._type_cache_misses() - before == 0

    keyword_calls = []

    class Legacy:
        def __dlpack__(self, stream=None, **kw):
            if kw:  # what a pre-2023 producer's signature rejects
                keyword_calls.append(kw)
                raise TypeError(f"__dlpack__() got an unexpected keyword argument '{next(iter(kw))}'")
            return a.__dlpack__()

        def __dlpack_device__(self):
            return (1, 0)

    for _ in range(10):
        assert dlbridge.from_dlpack(Legacy()).readonly
    assert len(keyword_calls) == 1  # the failing keyword call happened once, not per import
    # A modified type misses once, then hits again.
    Producer.extra = 1
    before = dlbridge._dlbridge._type_cache_misses()
    for _ in range(10):
        dlbridge.from_dlpack(Producer(a))
    assert dlbridge._dlbridge._type_cache_misses() - before == 1


def test_a_negated_torch_tensor_is_refused_on_the_protocol_path_too() -> None:
    # With stream= (or for device tensors) torch's own __dlpack__ is called, which exports the
    # negative bit with the wrong sign; a copy resolves it.
    torch = need("torch")
    np = need("numpy")
    im = torch.tensor([1 + 2j, 3 + 4j]).conj().imag  # shows [-2, -4], memory holds [2, 4]
    with pytest.raises(BufferError, match="resolve_neg"):
        dlbridge.from_dlpack(im, stream=-1)
    assert np.from_dlpack(dlbridge.from_dlpack(im, copy=True)).tolist() == [-2.0, -4.0]


def test_copy_true_never_swallows_an_interrupt() -> None:
    calls = []

    class Interrupted:
        def __dlpack__(self, **kw):
            calls.append(kw.get("copy"))
            if kw.get("copy"):
                raise KeyboardInterrupt
            return need("numpy").arange(3.0).__dlpack__(**kw)

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(KeyboardInterrupt):
        dlbridge.from_dlpack(Interrupted(), copy=True)
    assert calls == [True]


def test_an_error_raised_while_python_shuts_down_does_not_abort() -> None:
    # An entry point raising from a __del__ run during interpreter finalization used to make PyO3
    # panic inside an extern "C" function: the process aborted (SIGABRT).
    import subprocess

    code = (
        "import dlbridge\n"
        "class Late:\n"
        "    def __del__(self):\n"
        "        try:\n"
        "            dlbridge.from_dlpack(42)\n"
        "        except TypeError:\n"
        "            print('refused at shutdown')\n"
        "late = Late()\n"
        "print('main done')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["main", "done", "refused", "at", "shutdown"], r.stdout
