//! The candle bridge: CPU tensors exported as a copy (candle writes its storage through `&Tensor`,
//! so nothing of it may be shared), imported with one copy.
#![cfg(feature = "candle")]

use candle_core::{CpuStorage, Device, Storage, Tensor};
use dlbridge::{ManagedTensor, RawManagedTensor};

fn through_abi(t: ManagedTensor) -> ManagedTensor {
    let RawManagedTensor::Versioned(p) = t.into_raw() else { panic!("exports are versioned") };
    // SAFETY: a pointer just given up by a ManagedTensor.
    unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap()
}

/// The address range of a CPU f32 candle tensor's whole storage.
fn storage_range(t: &Tensor) -> std::ops::Range<usize> {
    let (s, _) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(v)) = &*s else { panic!("a CPU f32 tensor") };
    v.as_ptr_range().start.addr()..v.as_ptr_range().end.addr()
}

#[test]
fn export_copies_the_elements_of_any_layout_in_c_order() {
    let base = Tensor::arange(0f32, 24., &Device::Cpu).unwrap().reshape((4, 6)).unwrap();
    let storage = storage_range(&base);
    // Rows 1..3, every column, transposed: candle's start offset 6, strides (1, 6).
    let view = base.narrow(0, 1, 2).unwrap().t().unwrap();
    let t = through_abi(ManagedTensor::from_candle(&view).unwrap());
    drop((base, view)); // the export owns its copy
    assert!(!storage.contains(&t.data_ptr().addr()), "a copy, not candle's storage");
    assert_eq!(t.data_ptr().addr() % 256, 0);
    assert_eq!((t.shape(), t.strides()), (&[6i64, 2][..], &[2i64, 1][..]));
    assert!(!t.is_read_only());
    assert_eq!(t.get::<f32>(&[5, 1]).unwrap(), 17.0);
    assert_eq!(
        t.as_slice::<f32>().unwrap(),
        [6.0, 12.0, 7.0, 13.0, 8.0, 14.0, 9.0, 15.0, 10.0, 16.0, 11.0, 17.0]
    );
    // A broadcast (stride 0) arrives as its values, writable (no element shares memory now).
    let b = Tensor::new(&[1.5f32, 2.5], &Device::Cpu).unwrap().broadcast_as((3, 2)).unwrap();
    let mut bt = ManagedTensor::from_candle(&b).unwrap();
    assert_eq!((bt.strides(), bt.is_read_only()), (&[2i64, 1][..], false));
    bt.as_slice_mut::<f32>().unwrap()[0] = 9.0;
    assert_eq!(bt.to_vec::<f32>().unwrap(), [9.0, 2.5, 1.5, 2.5, 1.5, 2.5]);
    assert_eq!(
        b.to_vec2::<f32>().unwrap(),
        [[1.5, 2.5], [1.5, 2.5], [1.5, 2.5]],
        "candle's own is unchanged"
    );
    // Permuted 3-d, a narrowed contiguous run (one memcpy from its offset), a scalar, and empty.
    let c = Tensor::arange(0i64, 24, &Device::Cpu).unwrap().reshape((2, 3, 4)).unwrap();
    let p = c.permute((2, 0, 1)).unwrap();
    let pt = ManagedTensor::from_candle(&p).unwrap();
    assert_eq!(pt.shape(), &[4, 2, 3]);
    assert_eq!(pt.to_vec::<i64>().unwrap(), p.flatten_all().unwrap().to_vec1::<i64>().unwrap());
    let n = c.narrow(0, 1, 1).unwrap();
    assert_eq!(
        ManagedTensor::from_candle(&n).unwrap().to_vec::<i64>().unwrap(),
        (12..24).collect::<Vec<_>>()
    );
    let s = Tensor::new(7u32, &Device::Cpu).unwrap();
    let st = ManagedTensor::from_candle(&s).unwrap();
    assert_eq!((st.shape(), st.get::<u32>(&[]).unwrap()), (&[][..], 7));
    let e = Tensor::zeros((2, 0, 3), candle_core::DType::F64, &Device::Cpu).unwrap().t().unwrap();
    let et = ManagedTensor::from_candle(&e).unwrap();
    assert_eq!((et.shape(), et.numel()), (&[2i64, 3, 0][..], 0));
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
    let f = ManagedTensor::from_vec(vec![1f32, 2.0], &[2]).unwrap();
    assert!(!storage_range(&f.to_candle().unwrap()).contains(&f.data_ptr().addr()), "candle's own copy");
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
    // Strided float8 arrives in C order too.
    let r = c.reshape((3, 1)).unwrap().broadcast_as((3, 2)).unwrap().t().unwrap();
    let rt = ManagedTensor::from_candle(&r).unwrap();
    assert_eq!((rt.shape(), rt.strides(), rt.nbytes()), (&[2i64, 3][..], &[3i64, 1][..], 6));
    // SAFETY: as above, six one-byte elements.
    let bytes = unsafe { std::slice::from_raw_parts(rt.data_ptr().cast::<u8>(), 6) };
    assert_eq!(bytes, [0x38, 0xC0, 0x30, 0x38, 0xC0, 0x30]);
    let e = t.to_candle().unwrap_err().to_string();
    assert!(e.contains("a dtype candle has"), "{e}");
}

// Issue 20, item 5: candle writes into its storage through `&Tensor` (`one_set`, `const_set`,
// `slice_set`). These two sequences were undefined behaviour while the export shared candle's
// storage (Miri, Stacked and Tree Borrows: the live slice's tag, and in the second the export's
// pointer, invalidated by candle's `&mut` write); with the copy they are defined (`make miri`).

#[test]
fn candle_writing_through_a_shared_tensor_leaves_a_live_slice_unchanged() {
    let c = Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu).unwrap();
    let t = ManagedTensor::from_candle(&c).unwrap();
    let s = t.as_slice::<f32>().unwrap();
    c.one_set().unwrap();
    assert_eq!(s, [0.0; 4]);
    assert_eq!(c.to_vec1::<f32>().unwrap(), [1.0; 4]);
}

#[test]
fn candle_writing_through_a_shared_tensor_leaves_the_export_readable() {
    let c = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
    let t = ManagedTensor::from_candle(&c).unwrap();
    c.one_set().unwrap();
    assert_eq!(t.get::<f32>(&[1, 2]).unwrap(), 0.0);
    assert_eq!(t.to_vec::<f32>().unwrap(), [0.0; 6]);
    // And the other in-place writes candle offers through `&Tensor`.
    c.slice_set(&Tensor::ones((1, 3), candle_core::DType::F32, &Device::Cpu).unwrap(), 0, 1).unwrap();
    c.const_set(candle_core::scalar::Scalar::F32(2.0)).unwrap();
    assert_eq!(t.as_slice::<f32>().unwrap(), [0.0; 6]);
}
