//! The candle bridge: CPU tensors exported zero-copy with their layout, imported with one copy.
#![cfg(feature = "candle")]

use candle_core::{CpuStorage, Device, Storage, Tensor};
use dlbridge::{ManagedTensor, RawManagedTensor};

fn through_abi(t: ManagedTensor) -> ManagedTensor {
    let RawManagedTensor::Versioned(p) = t.into_raw() else { panic!("exports are versioned") };
    // SAFETY: a pointer just given up by a ManagedTensor.
    unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap()
}

fn storage_ptr(t: &Tensor) -> *const f32 {
    let (s, _) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(v)) = &*s else { panic!("a CPU f32 tensor") };
    v.as_ptr()
}

#[test]
fn export_shares_candle_storage_with_its_offset_and_strides() {
    let base = Tensor::arange(0f32, 24., &Device::Cpu).unwrap().reshape((4, 6)).unwrap();
    let ptr = storage_ptr(&base);
    // Rows 1..3, every column, transposed: start offset 6, strides (1, 6).
    let view = base.narrow(0, 1, 2).unwrap().t().unwrap();
    let t = through_abi(ManagedTensor::from_candle(&view).unwrap());
    drop((base, view)); // the export keeps the storage alive
    assert_eq!(t.data_ptr().cast_const().cast::<f32>(), ptr.wrapping_add(6));
    assert_eq!((t.shape(), t.strides()), (&[6i64, 2][..], &[1i64, 6][..]));
    assert!(t.is_read_only());
    assert_eq!(t.get::<f32>(&[5, 1]).unwrap(), 17.0);
    let b = Tensor::new(&[1.5f32, 2.5], &Device::Cpu).unwrap().broadcast_as((3, 2)).unwrap();
    let bt = ManagedTensor::from_candle(&b).unwrap();
    assert_eq!(
        (bt.strides(), bt.to_vec::<f32>().unwrap()),
        (&[0i64, 1][..], vec![1.5, 2.5, 1.5, 2.5, 1.5, 2.5])
    );
}

#[test]
fn every_candle_dtype_with_a_rust_type_exports() {
    use candle_core::DType;
    for (dtype, name) in [
        (DType::U8, "uint8"),
        (DType::U32, "uint32"),
        (DType::I64, "int64"),
        (DType::BF16, "bfloat16"),
        (DType::F16, "float16"),
        (DType::F32, "float32"),
        (DType::F64, "float64"),
    ] {
        let c = Tensor::ones((2, 2), dtype, &Device::Cpu).unwrap();
        let t = ManagedTensor::from_candle(&c).unwrap();
        assert_eq!(t.dtype().to_string(), name);
        assert_eq!(t.to_candle().unwrap().dtype(), dtype);
    }
}

#[test]
fn import_copies_once_whatever_the_strides() {
    let t = ManagedTensor::from_host_strided((0..6).collect::<Vec<i64>>(), &[3, 2], &[-2, 1], 4).unwrap();
    let c = t.to_candle().unwrap();
    assert_eq!(c.to_vec2::<i64>().unwrap(), [[4, 5], [2, 3], [0, 1]]);
    assert_ne!(
        storage_ptr(&Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu).unwrap()),
        std::ptr::null()
    );
    let e = ManagedTensor::from_vec(vec![true, false], &[2]).unwrap().to_candle().unwrap_err().to_string();
    assert!(e.contains("a dtype candle has") && e.contains("got bool"), "{e}");
}

#[test]
fn float8_exports_as_the_dlpack_float8_dtype() {
    let c = Tensor::new(&[1.0f32, -2.0, 0.5], &Device::Cpu)
        .unwrap()
        .to_dtype(candle_core::DType::F8E4M3)
        .unwrap();
    let t = ManagedTensor::from_candle(&c).unwrap();
    assert_eq!(t.dtype().to_string(), "float8_e4m3fn");
    // E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits.
    assert!(t.is_c_contiguous() && t.nbytes() == 3);
    // SAFETY: a live, compact host tensor of three one-byte elements; nothing writes it.
    let bytes = unsafe { std::slice::from_raw_parts(t.data_ptr().cast::<u8>(), 3) };
    assert_eq!(bytes, [0x38, 0xC0, 0x30]);
    let e = t.to_candle().unwrap_err().to_string();
    assert!(e.contains("a dtype candle has"), "{e}");
}
