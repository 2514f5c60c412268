"""Each dlbridge bridge in a round trip against a real Python library: zero-copy proven by
pointer equality (and a write seen on the other side where the memory is writable)."""

import numpy as np
import pytest

import dlbridge
import dlbridge_bridges as b


def _torch():
    return pytest.importorskip("torch")


def _cuda_torch():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


# faer ---------------------------------------------------------------------------------------


def test_faer_view_of_numpy_writes_in_place_any_strides():
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    view = a[::-1, ::2]  # negative row stride, column step 2
    ptr = b.faer_double(view)
    assert ptr == view.__array_interface__["data"][0]
    expect = np.arange(12, dtype=np.float64).reshape(3, 4)
    expect[::-1, ::2] *= 2
    assert (a == expect).all()


def test_faer_view_of_torch_fortran_order():
    torch = _torch()
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3).t()
    assert b.faer_double(x) == x.data_ptr()
    assert x.tolist() == (torch.arange(6, dtype=torch.float64).reshape(2, 3).t() * 2).tolist()


def test_faer_mat_exports_to_numpy_and_torch_without_copy():
    t, ptr = b.faer_mat(5, 3)
    a = np.from_dlpack(t)
    assert a.ctypes.data == ptr and a.shape == (5, 3) and a.strides[0] == 8
    assert a.tolist() == [[10 * i + j for j in range(3)] for i in range(5)]
    a[4, 2] = -1.0  # writable, and the same memory as faer's matrix
    torch = _torch()
    t2, ptr2 = b.faer_mat(2, 2)
    x = torch.from_dlpack(t2)
    assert x.data_ptr() == ptr2 and x[1, 1].item() == 11.0


def test_faer_refuses_read_only_and_wrong_ndim():
    a = np.zeros((2, 2))
    a.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        b.faer_double(a)
    with pytest.raises(TypeError, match="2-d tensor"):
        b.faer_double(np.zeros(3))


# nalgebra -----------------------------------------------------------------------------------


def test_nalgebra_strided_matrix_view_of_numpy():
    a = np.zeros((4, 6), dtype=np.float32)
    view = a[1:, ::3]
    ptr, strides = b.nalgebra_increment(view)
    assert ptr == view.__array_interface__["data"][0] and strides == (6, 3)
    assert a.sum() == view.size and (view == 1).all()


def test_nalgebra_vector_view_and_negative_strides_refused():
    torch = _torch()
    x = torch.arange(10, dtype=torch.float64)[::3]
    total, ptr = b.nalgebra_vector_sum(x)
    assert total == 0 + 3 + 6 + 9 and ptr == x.data_ptr()
    with pytest.raises(TypeError, match="non-negative strides"):
        b.nalgebra_increment(np.zeros((2, 2), dtype=np.float32)[:, ::-1])


def test_nalgebra_matrix_exports_column_major():
    t, ptr = b.nalgebra_matrix(3, 4)
    a = np.from_dlpack(t)
    assert a.ctypes.data == ptr and a.flags.f_contiguous and a.dtype == np.int32
    assert a.tolist() == [[10 * i + j for j in range(4)] for i in range(3)]


# arrow --------------------------------------------------------------------------------------


def _arrow():
    return pytest.importorskip("pyarrow")


def test_pyarrow_array_to_tensor_without_copy():
    pa = _arrow()
    arr = pa.array(np.arange(8, dtype=np.float64)).slice(2, 5)
    t = b.arrow_to_tensor(arr)
    a = np.from_dlpack(t)
    assert a.ctypes.data == arr.buffers()[1].address + 2 * 8
    assert a.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0] and not a.flags.writeable


def test_tensor_to_pyarrow_without_copy_keeps_the_tensor_alive():
    pa = _arrow()
    a = np.arange(5, dtype=np.float64)
    arr = b.tensor_to_arrow(a)
    assert isinstance(arr, pa.DoubleArray) and arr.null_count == 0
    assert arr.buffers()[1].address == a.ctypes.data
    a[0] = 42.0  # numpy still owns a writable view: the arrow array sees the same memory
    assert arr[0].as_py() == 42.0
    del a
    assert arr.to_pylist() == [42.0, 1.0, 2.0, 3.0, 4.0]
    # and back into numpy through the round trip: still the same memory
    assert np.from_dlpack(b.arrow_to_tensor(arr)).ctypes.data == arr.buffers()[1].address


def test_fixed_shape_tensor_both_ways_without_copy():
    pa = _arrow()
    a = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    arr = b.tensor_to_arrow_tensor(a)
    assert isinstance(arr.type, pa.FixedShapeTensorType) and arr.type.shape == [3, 4]
    assert arr.storage.values.buffers()[1].address == a.ctypes.data
    n = arr.to_numpy_ndarray()
    assert (n == a).all() and n.ctypes.data == a.ctypes.data
    src = pa.FixedShapeTensorArray.from_numpy_ndarray(np.arange(12, dtype=np.float64).reshape(3, 2, 2))
    t = np.from_dlpack(b.arrow_tensor_to_tensor(src))
    assert t.shape == (3, 2, 2) and t.ctypes.data == src.storage.values.buffers()[1].address
    assert t[2, 1, 0] == 10.0


def test_arrow_nulls_are_refused_with_an_error_that_says_so():
    pa = _arrow()
    with pytest.raises(TypeError, match="without nulls.*null_count 1 of 3"):
        b.arrow_to_tensor(pa.array([1.0, None, 3.0]))


# image --------------------------------------------------------------------------------------


def test_image_over_numpy_hwc_in_place():
    img = np.zeros((2, 3, 3), dtype=np.uint8)
    img[1, 2] = [10, 20, 30]
    (w, h), ptr = b.image_invert(img)
    assert (w, h) == (3, 2) and ptr == img.ctypes.data
    assert img[1, 2].tolist() == [245, 235, 225] and img[0, 0].tolist() == [255, 255, 255]
    with pytest.raises(TypeError, match=r"\(height, width, 3\)"):
        b.image_invert(np.zeros((2, 3, 4), dtype=np.uint8))
    with pytest.raises(TypeError, match="C-contiguous"):
        b.image_invert(np.zeros((3, 2, 3), dtype=np.uint8).transpose(1, 0, 2))


def test_owned_image_over_a_torch_tensor():
    torch = _torch()
    x = torch.zeros((2, 4, 3), dtype=torch.uint8)
    x[..., 0] = 8
    (w, h), ptr, red = b.image_owned(x)
    assert (w, h) == (4, 2) and ptr == x.data_ptr() and red == 8.0


def test_image_buffer_exports_hwc_to_torch():
    torch = _torch()
    t, ptr = b.image_make(4, 2)
    x = torch.from_dlpack(t)
    assert x.shape == (2, 4, 4) and x.dtype == torch.uint8 and x.data_ptr() == ptr
    assert x[1, 3].tolist() == [3, 1, 7, 255]


# candle -------------------------------------------------------------------------------------


def test_candle_tensor_exports_as_a_c_contiguous_copy():
    t, ptr = b.candle_transposed(2, 3)
    a = np.from_dlpack(t)
    # candle writes its storage through &Tensor, so the export is a copy the tensor owns alone
    assert a.ctypes.data != ptr and a.ctypes.data % 256 == 0
    assert a.shape == (3, 2) and a.strides == (8, 4)
    assert a.tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    assert a.flags.writeable


def test_into_candle_is_one_copy():
    torch = _torch()
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    sums, ptr = b.candle_row_sums(x)
    assert sums == [3.0, 5.0, 7.0]
    assert ptr != x.data_ptr()  # candle cannot hold foreign memory: its own copy


# cudarc -------------------------------------------------------------------------------------


def test_cuda_view_refuses_host_tensors_without_a_driver():
    with pytest.raises(TypeError, match="CUDA tensor on cuda:0.*on cpu"):
        b.cuda_view_check(np.zeros(3, dtype=np.float32), 0)


@pytest.mark.gpu
def test_cudarc_view_of_a_torch_cuda_tensor_in_place():
    torch = _cuda_torch()
    x = torch.arange(4, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    ptr, seen = b.cuda_double(x)
    assert ptr == x.data_ptr() and seen == [0.0, 1.0, 2.0, 3.0]
    assert x.tolist() == [0.0, 2.0, 4.0, 6.0]
    with pytest.raises(TypeError, match="CUDA tensor on cuda:0"):
        b.cuda_view_check(x[::2], 0)


@pytest.mark.gpu
def test_cudarc_slice_exports_to_torch_without_copy():
    torch = _cuda_torch()
    t, ptr = b.cuda_arange(5)
    x = torch.from_dlpack(t)
    assert x.device.type == "cuda" and x.data_ptr() == ptr
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
