"""Results in the caller's framework (dlbridge.python::Framework) and typed arguments, through the
test-only hooks (the Rust API has no Python surface of its own): each real library's object comes
back as its own kind of object, over the very memory Rust wrote (pointer equality), and typed
arguments refuse what they do not admit with a message naming the field."""

from __future__ import annotations

import pytest

import dlbridge

from .libs import have, need

pytestmark = pytest.mark.hooks


def hooks():
    return dlbridge._dlbridge


def address(obj) -> int:
    """The data address of any library's array, read through dlbridge's own import."""
    if have("tensorflow"):
        tf = need("tensorflow")
        if isinstance(obj, tf.Tensor):
            obj = tf.experimental.dlpack.to_dlpack(obj)
    return dlbridge.from_dlpack(obj).data_ptr


def makers():
    """(name, a 2x3 float32 array of that library, its array type) for each installed library."""
    out = []
    if have("numpy"):
        np = need("numpy")
        out.append(("numpy", np.zeros((2, 3), np.float32), np.ndarray, "numpy"))
    if have("torch"):
        torch = need("torch")
        out.append(("torch", torch.zeros(2, 3), torch.Tensor, "exchange table"))
    if have("jax"):
        jax = need("jax")
        out.append(("jax", jax.numpy.zeros((2, 3), "float32"), jax.Array, "jax.dlpack.from_dlpack"))
    if have("tensorflow"):
        tf = need("tensorflow")
        out.append(("tensorflow", tf.zeros((2, 3)), tf.Tensor, "tensorflow.experimental.dlpack.from_dlpack"))
    if have("array_api_strict"):
        xp = need("array_api_strict")
        out.append(("array_api_strict", xp.zeros((2, 3)), type(xp.zeros(1)), "array_api_strict.from_dlpack"))
    if have("numpy"):
        np = need("numpy")
        out.append(("dlbridge", dlbridge.asdlpack(np.zeros((2, 3), np.float32)), dlbridge.Tensor, "dlbridge"))
    return out


CASES = ["numpy", "torch", "jax", "tensorflow", "array_api_strict", "dlbridge"]


def case(name):
    for c in makers():
        if c[0] == name:
            return c
    pytest.skip(f"{name} is not installed")


@pytest.mark.parametrize("name", CASES)
def test_empty_like_returns_the_callers_type_over_the_memory_rust_wrote(name):
    _, x, kind, path = case(name)
    assert hooks()._framework_name(x) == path
    out, written = hooks()._empty_like_probe(x)
    assert isinstance(out, kind), type(out)
    assert address(out) == written  # zero-copy: the framework's object is over Rust's buffer
    np = need("numpy")
    assert np.asarray(out).ravel().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # Rust's writes seen


@pytest.mark.parametrize("name", CASES)
def test_a_rust_vec_comes_back_as_the_callers_type(name):
    _, x, kind, _ = case(name)
    out, vec = hooks()._from_vec_like(x, 5)
    assert isinstance(out, kind)
    np = need("numpy")
    assert np.asarray(out).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    if name == "jax":
        # jax adopts only 64-byte aligned host memory; a Vec<f64> is 8-byte aligned, so jax copies
        # it (its own rule). AlignedBuffer / Framework::empty memory is 256-byte aligned (above).
        if vec % 64:
            assert address(out) != vec
            return
    assert address(out) == vec


def test_writes_through_the_returned_object_reach_the_memory():
    torch = need("torch")
    np = need("numpy")
    for x in (torch.zeros(2, 3), np.zeros((2, 3), np.float32)):
        out, written = hooks()._empty_like_probe(x)
        out[1, 2] = 42.0
        again = dlbridge.from_dlpack(out)
        assert again.data_ptr == written
        assert np.asarray(again)[1, 2] == 42.0


def test_numpy_c_api_path_agrees_with_numpy_from_dlpack():
    """The numpy results path (numpy's C API, no Python call) is a twin of numpy.from_dlpack: for
    every dtype, layout and writability, the same dtype, shape, strides, address and flags."""
    np = need("numpy")
    from .libs import NUMPY_DTYPES

    like = np.zeros(1)
    for dtype in NUMPY_DTYPES:
        base = (np.arange(24) % 2).astype(dtype).reshape(2, 3, 4)
        for a in (base, base[:, ::2], base.transpose(2, 0, 1), base[::-1], base[..., 0], base[:, :0],
                  np.broadcast_to(base[:1], (3, 3, 4)), base.reshape(-1)[5:6].reshape(()), base.copy(order="F")):
            for readonly in (False, True):
                src = a.copy() if readonly and a.flags.writeable else a
                if readonly:
                    src.flags.writeable = False
                t = dlbridge.from_dlpack(src)
                ours = hooks()._wrap_like(like, t)
                theirs = np.from_dlpack(t)
                assert type(ours) is np.ndarray
                assert (ours.dtype, ours.shape, ours.strides) == (theirs.dtype, theirs.shape, theirs.strides), (dtype, a.strides)
                assert ours.__array_interface__["data"] == theirs.__array_interface__["data"]
                assert ours.flags.writeable == theirs.flags.writeable == (not readonly and src.flags.writeable)
                assert ours.flags.c_contiguous == theirs.flags.c_contiguous
                assert ours.flags.f_contiguous == theirs.flags.f_contiguous
                assert (ours == src).all()


def test_numpy_results_base_cannot_be_consumed_by_another_library():
    """The numpy array's base owns the tensor under a private capsule name: a DLPack consumer
    handed the base cannot take the tensor (and free the memory) out from under the array."""
    np = need("numpy")
    out, _ = hooks()._from_vec_like(np.zeros(1), 4)
    base = out.base
    assert type(base).__name__ == "PyCapsule" and "dlbridge.tensor_owner" in repr(base)
    with pytest.raises(TypeError, match="expected a DLPack capsule|capsule"):
        dlbridge.from_dlpack(base)
    if have("torch"):
        torch = need("torch")
        with pytest.raises(Exception):
            torch.utils.dlpack.from_dlpack(base)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_numpy_path_keeps_the_producer_alive_and_releases_it_once():
    np = need("numpy")
    import gc
    import weakref

    class Owner(np.ndarray):
        pass

    src = np.arange(6.0).view(Owner)
    ref = weakref.ref(src)
    out = hooks()._wrap_like(np.zeros(1), dlbridge.from_dlpack(src))
    del src
    gc.collect()
    assert ref() is not None  # the numpy result keeps the producer's array alive
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    del out
    gc.collect()
    assert ref() is None  # and lets it go with the last reference


def test_dtypes_numpy_cannot_hold_fall_back_to_numpy_from_dlpack():
    np = need("numpy")
    torch = need("torch")
    t = dlbridge.from_dlpack(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(Exception) as e:
        np.from_dlpack(t)
    with pytest.raises(type(e.value)):
        hooks()._wrap_like(np.zeros(1), t)


def test_read_only_memory_is_refused_as_a_torch_result_and_kept_read_only_elsewhere():
    """torch has no read-only tensors and its table ignores the flag: a read-only tensor is refused
    rather than handed to torch writable. numpy keeps the flag."""
    torch = need("torch")
    np = need("numpy")
    a = np.arange(4.0)
    a.flags.writeable = False
    with pytest.raises(BufferError, match=r"cannot return this tensor as a torch.Tensor \(torch tensors are always writable\)"):
        hooks()._wrap_like(torch.zeros(1), dlbridge.from_dlpack(a))
    out = hooks()._wrap_like(np.zeros(1), dlbridge.from_dlpack(a))
    assert not out.flags.writeable and out.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_current_work_stream_of_torch_on_cpu_is_none():
    torch = need("torch")
    assert hooks()._current_work_stream(torch.zeros(1), dlbridge.Device("cpu")) == 0


def test_frameworks_without_a_table_report_no_stream():
    np = need("numpy")
    assert hooks()._current_work_stream(np.zeros(1), dlbridge.Device("cpu")) == 0


def test_typed_argument_accepts_what_it_states():
    np = need("numpy")
    assert hooks()._typed_probe(np.zeros((4, 3), np.float32)) == [4, 3]
    if have("torch"):
        torch = need("torch")
        assert hooks()._typed_probe(torch.zeros(2, 3)) == [2, 3]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda np: np.zeros((4, 2), np.float32), "got float32 (4, 2) on cpu"),
        (lambda np: np.zeros((4, 3)), "got float64 (4, 3) on cpu"),
        (lambda np: np.zeros((3, 4), np.float32).T, "got float32 (4, 3) strides (1, 4) on cpu"),
        (lambda np: np.zeros((2, 4, 3), np.float32), "got float32 (2, 4, 3) on cpu"),
    ],
)
def test_typed_argument_refusals_name_expected_and_found(make, message):
    np = need("numpy")
    with pytest.raises(TypeError) as e:
        hooks()._typed_probe(make(np))
    assert str(e.value) == f"expected float32 (*, 3) C-contiguous cpu tensor, {message}"
    import sys

    if sys.version_info >= (3, 11):
        assert e.value.__notes__ == ["while processing 'x'"]


def test_torch_table_allocator_gives_what_was_asked():
    """Framework::empty takes device memory from the table's allocator (torch's caching allocator
    on CUDA); on this machine its CPU form exercises the same call, validation and error path."""
    torch = need("torch")
    t = hooks()._table_allocate(torch.zeros(1), [3, 5], dlbridge.Device("cpu"))
    assert (t.shape, str(t.dtype), t.readonly, t.strides) == ((3, 5), "float32", False, (5, 1))
    out = torch.from_dlpack(t)
    out.fill_(2.0)
    assert dlbridge.from_dlpack(out).data_ptr == t.data_ptr


def test_torch_table_allocator_errors_come_back_as_exceptions():
    torch = need("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the allocation would succeed")
    with pytest.raises(Exception, match="managed_tensor_allocator: "):
        hooks()._table_allocate(torch.zeros(1), [3], dlbridge.Device("cuda", 0))


def test_negative_strides_are_refused_as_a_torch_result_and_the_producer_released():
    torch = need("torch")
    np = need("numpy")
    import gc
    import weakref

    class Owner(np.ndarray):
        pass

    a = np.arange(5.0).view(Owner)
    ref = weakref.ref(a)
    t = dlbridge.from_dlpack(a[::-1])
    del a
    with pytest.raises(BufferError, match=r"cannot return this tensor as a torch.Tensor \(torch tensors cannot have negative strides\)"):
        hooks()._wrap_like(torch.zeros(1), t)
    del t
    gc.collect()
    assert ref() is None  # the producer's deleter ran (once: a second run would crash or warn)


def test_a_table_refusal_releases_the_tensor_exactly_once():
    """torch's table throws without releasing what it refused (a float8_e4m3b11fnuz tensor, code 9,
    which no installed library exports, so a counted fake producer makes it): dlbridge then runs
    the producer's deleter itself, exactly once."""
    torch = need("torch")
    from ._dlpack_ctypes import FakeCapsule

    fake = FakeCapsule(dtype=(9, 8, 1), shape=(4,), strides=(1,))
    t = dlbridge.from_dlpack(fake)
    with pytest.raises(Exception, match="9|[Uu]nsupported"):
        hooks()._wrap_like(torch.zeros(1), t)
    assert fake.deleted == 0  # the Tensor still holds its own reference
    del t
    import gc

    gc.collect()
    assert fake.deleted == 1


def test_empty_with_a_zero_extent_has_no_elements_whatever_the_others_are():
    # The element count is 0 even where the product of the other extents overflows (a fake
    # buffer producer: numpy and torch refuse such shapes themselves).
    x = hooks()._HostileBuffer(shape=[2**62, 4, 0], strides=[0, 0, 0], itemsize=4, format="f", length=0)
    out, _ = hooks()._empty_like_probe(x)
    assert (out.shape, out.dtype) == ((2**62, 4, 0), dlbridge.float32)


def test_empty_of_an_impossible_size_is_a_memory_error_not_an_abort():
    np = need("numpy")
    x = np.broadcast_to(np.float32(0), (1 << 20, 1 << 20))
    with pytest.raises(MemoryError, match="empty: shape"):
        hooks()._empty_like_probe(x)


def test_framework_numpy_imports_numpy_once():
    """`Framework::numpy(py)?.from_vec(...)`, the README's one line, looks numpy up once: later
    calls import nothing (an import per call cost about 330 ns here, twice the rest of the call).
    Seen from Python: with numpy's import halted (None in sys.modules), the call still works."""
    import sys

    np = need("numpy")
    assert type(hooks()._numpy_from_vec(3)) is np.ndarray
    saved = sys.modules["numpy"]
    sys.modules["numpy"] = None  # type: ignore[assignment]
    try:
        out = hooks()._numpy_from_vec(4)
    finally:
        sys.modules["numpy"] = saved
    assert type(out) is np.ndarray and out.tolist() == [0.0] * 4 and out.dtype == np.float32
