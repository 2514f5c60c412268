//! An example PyO3 extension with one small round trip per dlbridge bridge, each against a real
//! Python library on the other side (numpy, torch, pyarrow): tensors come in from Python without
//! copying, are seen as faer / nalgebra / arrow / image / candle / cudarc values, and Rust-made
//! values of those crates go back out as DLPack tensors. Each function returns the addresses it
//! saw, so the tests can prove zero-copy by pointer equality.

use arrow_array::ffi::{FFI_ArrowArray, FFI_ArrowSchema};
use arrow_array::types::Float64Type;
use arrow_array::{Array, FixedSizeListArray, Float64Array};
use arrow_schema::Field;
use dlbridge::ManagedTensor;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

// ---------------------------------------------------------------------------------------------
// faer

/// Doubles a 2-d float64 tensor in place through a faer `MatMut` (any strides); returns the
/// address of element (0, 0) faer saw.
#[pyfunction]
fn faer_double(mut t: ManagedTensor) -> PyResult<usize> {
    let mut g = t.as_faer_mut::<f64>()?;
    let mut m = g.mat_mut();
    for j in 0..m.ncols() {
        for i in 0..m.nrows() {
            m[(i, j)] *= 2.0;
        }
    }
    Ok(m.as_ptr() as usize)
}

/// A faer `Mat<f64>` of `10 * i + j`, exported without copying; with the matrix's address.
#[pyfunction]
fn faer_mat(nrows: usize, ncols: usize) -> PyResult<(ManagedTensor, usize)> {
    let m = faer::Mat::<f64>::from_fn(nrows, ncols, |i, j| (10 * i + j) as f64);
    let ptr = m.as_ptr() as usize;
    Ok((ManagedTensor::from_faer(m)?, ptr))
}

// ---------------------------------------------------------------------------------------------
// nalgebra

/// Adds 1 to every element of a 2-d float32 tensor through a strided `DMatrixViewMut`; returns
/// the view's address and its (row, column) strides.
#[pyfunction]
fn nalgebra_increment(mut t: ManagedTensor) -> PyResult<(usize, (usize, usize))> {
    let mut g = t.as_dmatrix_mut::<f32>()?;
    let mut v = g.view_mut();
    v.add_scalar_mut(1.0);
    Ok((v.as_ptr() as usize, v.strides()))
}

/// The sum of a 1-d float64 tensor through a `DVectorView` (any non-negative stride).
#[pyfunction]
fn nalgebra_vector_sum(t: ManagedTensor) -> PyResult<(f64, usize)> {
    let g = t.as_dvector::<f64>()?;
    let v = g.view();
    Ok((v.iter().sum(), v.as_ptr() as usize))
}

/// A `DMatrix<i32>` of `10 * i + j` (column-major), exported without copying; with its address.
#[pyfunction]
fn nalgebra_matrix(nrows: usize, ncols: usize) -> PyResult<(ManagedTensor, usize)> {
    let m = nalgebra::DMatrix::<i32>::from_fn(nrows, ncols, |i, j| (10 * i + j) as i32);
    let ptr = m.as_ptr() as usize;
    Ok((ManagedTensor::from_dmatrix(m)?, ptr))
}

// ---------------------------------------------------------------------------------------------
// arrow (pyarrow on the other side, through the Arrow C data interface)

/// The arrow-rs array and field behind a pyarrow array (`__arrow_c_array__`, zero-copy).
fn from_pyarrow(obj: &Bound<'_, PyAny>) -> PyResult<(arrow_array::ArrayRef, Field)> {
    let pair = obj.call_method0("__arrow_c_array__")?;
    let pair = pair.cast::<PyTuple>()?;
    let (schema_cap, array_cap) = (pair.get_item(0)?, pair.get_item(1)?);
    // SAFETY: the objects are capsules of these names (PyCapsule_GetPointer checks the name and
    // returns NULL with an exception set otherwise); they stay alive while `pair` does.
    let (schema, array) = unsafe {
        (
            pyo3::ffi::PyCapsule_GetPointer(schema_cap.as_ptr(), c"arrow_schema".as_ptr()),
            pyo3::ffi::PyCapsule_GetPointer(array_cap.as_ptr(), c"arrow_array".as_ptr()),
        )
    };
    if schema.is_null() || array.is_null() {
        return Err(PyErr::fetch(obj.py()));
    }
    // SAFETY: the capsules hold an ArrowSchema and an ArrowArray (the PyCapsule interface); the
    // array is moved out (its release set to NULL in the capsule, as the interface allows), the
    // schema is borrowed.
    let (ffi_array, ffi_schema) =
        unsafe { (FFI_ArrowArray::from_raw(array.cast()), &*schema.cast::<FFI_ArrowSchema>()) };
    let field = Field::try_from(ffi_schema).map_err(|e| PyValueError::new_err(e.to_string()))?;
    // SAFETY: a valid array of the schema's type, as the producer promises.
    let data = unsafe { arrow_array::ffi::from_ffi(ffi_array, ffi_schema) }
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((arrow_array::make_array(data), field))
}

/// An arrow-rs array (with its field, for extension types) as a pyarrow array, zero-copy.
fn to_pyarrow<'py>(py: Python<'py>, array: &dyn Array, field: Option<&Field>) -> PyResult<Bound<'py, PyAny>> {
    let data = array.to_data();
    let ffi_array = FFI_ArrowArray::new(&data);
    let ffi_schema = match field {
        Some(f) => FFI_ArrowSchema::try_from(f),
        None => FFI_ArrowSchema::try_from(data.data_type()),
    }
    .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let mut ffi_array = Box::new(ffi_array);
    let mut ffi_schema = Box::new(ffi_schema);
    let pa = py.import("pyarrow")?;
    let a = std::ptr::from_mut::<FFI_ArrowArray>(&mut ffi_array) as usize;
    let s = std::ptr::from_mut::<FFI_ArrowSchema>(&mut ffi_schema) as usize;
    // pyarrow moves both structs out (setting their release callbacks to NULL), so dropping the
    // boxes afterwards frees only the boxes; on failure their release callbacks free the rest.
    pa.getattr("Array")?.call_method1("_import_from_c", (a, s))
}

/// A pyarrow float64 array (no nulls) as a read-only dlbridge tensor, without copying.
#[pyfunction]
fn arrow_to_tensor(arr: &Bound<'_, PyAny>) -> PyResult<ManagedTensor> {
    let (array, _) = from_pyarrow(arr)?;
    let a = array.as_any().downcast_ref::<Float64Array>().ok_or_else(|| {
        PyTypeError::new_err(format!("expected a float64 array, got {}", array.data_type()))
    })?;
    Ok(ManagedTensor::from_arrow(a)?)
}

/// A 1-d float64 tensor (numpy, torch) as a pyarrow array, without copying: the arrow buffer
/// keeps the tensor alive.
#[pyfunction]
fn tensor_to_arrow<'py>(py: Python<'py>, t: ManagedTensor) -> PyResult<Bound<'py, PyAny>> {
    let a = t.into_arrow::<Float64Type>()?;
    to_pyarrow(py, &a, None)
}

/// A float64 tensor of 2 or more dimensions as a pyarrow `FixedShapeTensorArray`
/// (`arrow.fixed_shape_tensor`), without copying.
#[pyfunction]
fn tensor_to_arrow_tensor<'py>(py: Python<'py>, t: ManagedTensor) -> PyResult<Bound<'py, PyAny>> {
    let (field, list) = t.into_arrow_tensor::<Float64Type>()?;
    to_pyarrow(py, &list, Some(&field))
}

/// A pyarrow `FixedShapeTensorArray` (or plain fixed-size list array) of float64 as a read-only
/// dlbridge tensor, without copying.
#[pyfunction]
fn arrow_tensor_to_tensor(arr: &Bound<'_, PyAny>) -> PyResult<ManagedTensor> {
    let (array, field) = from_pyarrow(arr)?;
    let list = array.as_any().downcast_ref::<FixedSizeListArray>().ok_or_else(|| {
        PyTypeError::new_err(format!("expected a fixed-size list array, got {}", array.data_type()))
    })?;
    Ok(ManagedTensor::from_arrow_tensor::<Float64Type>(list, Some(&field))?)
}

// ---------------------------------------------------------------------------------------------
// image

/// Inverts an RGB uint8 HWC tensor in place through an `ImageBuffer<Rgb<u8>, &mut [u8]>`;
/// returns the image's (width, height) and address.
#[pyfunction]
fn image_invert(mut t: ManagedTensor) -> PyResult<((u32, u32), usize)> {
    let mut g = t.as_image_mut::<image::Rgb<u8>>()?;
    let mut im = g.image_mut();
    for p in im.pixels_mut() {
        p.0 = p.0.map(|c| 255 - c);
    }
    Ok((im.dimensions(), im.as_raw().as_ptr() as usize))
}

/// An RGB uint8 HWC tensor as an owned `ImageBuffer` (the container owns the tensor); returns the
/// image's size, the address of its samples and the mean of its red channel.
#[pyfunction]
fn image_owned(t: ManagedTensor) -> PyResult<((u32, u32), usize, f64)> {
    let img = t.into_image::<image::Rgb<u8>>()?;
    let n = f64::from(img.width() * img.height());
    let red = img.pixels().map(|p| f64::from(p.0[0])).sum::<f64>() / n;
    Ok((img.dimensions(), img.as_raw().as_ptr() as usize, red))
}

/// An RGBA uint8 `ImageBuffer` (`x`, `y`, 7, 255 per pixel) exported as an HWC tensor without
/// copying; with the image's address.
#[pyfunction]
fn image_make(width: u32, height: u32) -> PyResult<(ManagedTensor, usize)> {
    let img = image::RgbaImage::from_fn(width, height, |x, y| image::Rgba([x as u8, y as u8, 7, 255]));
    let ptr = img.as_raw().as_ptr() as usize;
    Ok((ManagedTensor::from_image(img)?, ptr))
}

// ---------------------------------------------------------------------------------------------
// candle

/// A candle `arange(rows * cols)` reshaped and transposed, exported as a C-contiguous copy (candle
/// writes its storage through `&Tensor`, so nothing of it is shared); with the address of candle's
/// storage (never the tensor's).
#[pyfunction]
fn candle_transposed(rows: usize, cols: usize) -> PyResult<(ManagedTensor, usize)> {
    let err = |e: candle_core::Error| PyValueError::new_err(e.to_string());
    let c = candle_core::Tensor::arange(0f32, (rows * cols) as f32, &candle_core::Device::Cpu)
        .and_then(|c| c.reshape((rows, cols)))
        .and_then(|c| c.t())
        .map_err(err)?;
    let ptr = {
        let (s, _) = c.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.as_ptr() as usize,
            _ => return Err(PyValueError::new_err("expected a CPU f32 candle tensor")),
        }
    };
    Ok((ManagedTensor::from_candle(&c)?, ptr))
}

/// A tensor copied into candle (one copy), then its row sums computed by candle; with the
/// address of candle's storage (never the tensor's).
#[pyfunction]
fn candle_row_sums(t: ManagedTensor) -> PyResult<(Vec<f32>, usize)> {
    let err = |e: candle_core::Error| PyValueError::new_err(e.to_string());
    let c = t.to_candle()?;
    let sums = c.sum(1).and_then(|s| s.to_vec1::<f32>()).map_err(err)?;
    let (s, _) = c.storage_and_layout();
    let ptr = match &*s {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.as_ptr() as usize,
        _ => return Err(PyValueError::new_err("expected a CPU f32 candle tensor")),
    };
    Ok((sums, ptr))
}

// ---------------------------------------------------------------------------------------------
// cudarc

/// Checks a tensor as `as_cuda_view::<f32>` would for a stream on `ordinal`, without a driver.
#[pyfunction]
fn cuda_view_check(t: ManagedTensor, ordinal: usize) -> PyResult<()> {
    Ok(t.cuda_view_check::<f32>(ordinal, true)?)
}

/// Doubles a CUDA float32 tensor (torch, cupy) in place through cudarc (a copy to the host and
/// back on the tensor's stream, as a kernel would run there); returns the device address cudarc
/// used and the values read.
#[pyfunction]
fn cuda_double(mut t: ManagedTensor) -> PyResult<(u64, Vec<f32>)> {
    use cudarc::driver::DevicePtr;
    let err = |e: cudarc::driver::DriverError| PyValueError::new_err(e.to_string());
    let ordinal = usize::try_from(t.device().id()).map_err(|_| PyValueError::new_err("device id"))?;
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(err)?;
    let stream = ctx.default_stream();
    let mut g = t.as_cuda_view_mut::<f32>(&stream)?;
    let host: Vec<f32> = stream.clone_dtoh(&g.view()).map_err(err)?;
    let doubled: Vec<f32> = host.iter().map(|x| x * 2.0).collect();
    stream.memcpy_htod(&doubled, &mut g.view_mut()).map_err(err)?;
    stream.synchronize().map_err(err)?;
    let view = g.view();
    let ptr = view.device_ptr(&stream).0;
    Ok((ptr, host))
}

/// A cudarc `CudaSlice<f32>` of `0..n` on device 0, exported without copying (the stream
/// handshake synchronizes the slice's stream); with its device address.
#[pyfunction]
fn cuda_arange(n: usize) -> PyResult<(ManagedTensor, u64)> {
    use cudarc::driver::DevicePtr;
    let err = |e: cudarc::driver::DriverError| PyValueError::new_err(e.to_string());
    let ctx = cudarc::driver::CudaContext::new(0).map_err(err)?;
    let stream = ctx.default_stream();
    let host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let slice = stream.clone_htod(&host).map_err(err)?;
    let ptr = slice.device_ptr(&stream).0;
    Ok((ManagedTensor::from_cuda_slice(slice, None)?, ptr))
}

/// The example module (it needs the GIL, as every module embedding dlbridge does).
#[pymodule(gil_used = true)]
fn dlbridge_bridges(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(faer_double, m)?)?;
    m.add_function(wrap_pyfunction!(faer_mat, m)?)?;
    m.add_function(wrap_pyfunction!(nalgebra_increment, m)?)?;
    m.add_function(wrap_pyfunction!(nalgebra_vector_sum, m)?)?;
    m.add_function(wrap_pyfunction!(nalgebra_matrix, m)?)?;
    m.add_function(wrap_pyfunction!(arrow_to_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_to_arrow, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_to_arrow_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(arrow_tensor_to_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(image_invert, m)?)?;
    m.add_function(wrap_pyfunction!(image_make, m)?)?;
    m.add_function(wrap_pyfunction!(image_owned, m)?)?;
    m.add_function(wrap_pyfunction!(candle_transposed, m)?)?;
    m.add_function(wrap_pyfunction!(candle_row_sums, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_view_check, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_double, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_arange, m)?)?;
    Ok(())
}
