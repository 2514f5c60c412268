"""The example extension: scale() works in place on tensors from every library that allows writes."""

import numpy as np
import pytest

import dlbridge
import dlbridge_scale


def test_scale_numpy_in_place_any_strides():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = a[:, ::-2]
    dlbridge_scale.scale(view, 10)
    expect = np.arange(12, dtype=np.float32).reshape(3, 4)
    expect[:, ::-2] *= 10
    assert (a == expect).all()


def test_scale_torch_in_place():
    torch = pytest.importorskip("torch")
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3).t()
    dlbridge_scale.scale(x, 0.5)
    assert x.tolist() == (torch.arange(6, dtype=torch.float64).reshape(2, 3).t() * 0.5).tolist()


def test_scale_ints_and_dlbridge_tensors():
    a = np.arange(5, dtype=np.int64)
    dlbridge_scale.scale(dlbridge.from_dlpack(a), 3)
    assert a.tolist() == [0, 3, 6, 9, 12]


def test_scale_refuses_read_only_and_unsupported():
    a = np.arange(3.0)
    a.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        dlbridge_scale.scale(a, 2)
    with pytest.raises(TypeError, match="unsupported dtype uint8"):
        dlbridge_scale.scale(np.zeros(3, np.uint8), 2)


def test_rust_made_buffer_is_shared_with_numpy_and_torch():
    torch = pytest.importorskip("torch")
    t = dlbridge_scale.arange(8)
    assert t.data_ptr % 256 == 0
    a = np.from_dlpack(t)
    x = torch.from_dlpack(t)
    assert a.ctypes.data == x.data_ptr() == t.data_ptr
    a[3] = 100
    assert x[3].item() == 100
    assert dlbridge_scale.total(x) == sum(range(8)) - 3 + 100
    info = dlbridge_scale.describe(x)
    assert info["data_ptr"] == t.data_ptr and info["shape"] == [8] and info["dtype"] == "float32"


def test_a_downstream_tensor_says_what_class_it_is():
    # Each extension embedding dlbridge has its own Tensor class: it is not dlbridge.Tensor and
    # does not print as if it were; every DLPack consumer takes it.
    t = dlbridge_scale.arange(3)
    assert type(t).__module__ == "dlbridge.embedded" and type(t).__name__ == "Tensor"
    assert not isinstance(t, dlbridge.Tensor)
    assert repr(t).startswith("dlbridge.embedded.Tensor(shape=(3,)")
    assert np.from_dlpack(dlbridge.from_dlpack(t)).tolist() == [0.0, 1.0, 2.0]
    assert type(dlbridge.asdlpack(b"x")).__module__ == "dlbridge"
