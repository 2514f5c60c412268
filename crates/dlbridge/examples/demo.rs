//! `make demo` at the foundation stage: a Rust buffer exported as a DLPack tensor, handed over
//! through the raw C ABI exactly as a C consumer receives it, taken back in through the validating
//! door, and written through, with pointers printed to show no copy happened.

use dlbridge::ffi::DLManagedTensorVersioned;
use dlbridge::{ManagedTensor, RawManagedTensor};

fn main() -> Result<(), dlbridge::Error> {
    println!("dlbridge demo: Rust buffer -> DLPack 1.3 (raw C ABI) -> Rust, no copy\n");

    let data: Vec<f32> = (0..6).map(|i| i as f32 * 1.5).collect();
    let vec_ptr = data.as_ptr();
    println!("1. a Rust Vec<f32> of 6 values at {vec_ptr:p}: {data:?}");

    let exported = ManagedTensor::from_vec(data, &[2, 3])?;
    let RawManagedTensor::Versioned(raw) = exported.into_raw() else { unreachable!("exports are versioned") };

    // What a C consumer sees: the struct fields, read straight from the pointer.
    // SAFETY: `raw` is a live DLManagedTensorVersioned that this program owns.
    let m: &DLManagedTensorVersioned = unsafe { &*raw };
    let t = &m.dl_tensor;
    // SAFETY: an exported tensor always carries ndim shape and strides entries.
    let (shape, strides) = unsafe {
        (std::slice::from_raw_parts(t.shape, 2).to_vec(), std::slice::from_raw_parts(t.strides, 2).to_vec())
    };
    println!("2. exported as DLManagedTensorVersioned at {raw:p} (80 bytes):");
    println!("     version      {}.{}", m.version.major, m.version.minor);
    println!("     flags        {:#x}", m.flags);
    println!("     data         {:p}", t.data);
    println!("     device       type {} id {}", t.device.device_type.0, t.device.device_id);
    println!("     dtype        code {} bits {} lanes {}", t.dtype.code.0, t.dtype.bits, t.dtype.lanes);
    println!("     ndim         {}", t.ndim);
    println!("     shape        {shape:?}");
    println!("     strides      {strides:?}");
    println!("     byte_offset  {}", t.byte_offset);

    // SAFETY: ownership of `raw` passes back to a ManagedTensor, which validates it.
    let mut imported = unsafe { ManagedTensor::from_raw_versioned(raw) }?;
    println!("3. re-imported and validated: {} ", imported.describe());
    println!(
        "     data_ptr {:p}  ==  Vec pointer {vec_ptr:p} ? {}",
        imported.data_ptr(),
        if imported.data_ptr().cast_const().cast::<f32>() == vec_ptr {
            "yes: zero-copy"
        } else {
            "NO: copied"
        }
    );

    imported.as_slice_mut::<f32>()?[4] = 100.0;
    println!("4. wrote 100.0 at [1, 1] through the imported tensor: {:?}", imported.as_slice::<f32>()?);
    println!("     element [1, 1] read back by index: {}", imported.get::<f32>(&[1, 1])?);

    let transposed = ManagedTensor::from_host_strided((0..6).collect::<Vec<i32>>(), &[3, 2], &[1, 3], 0)?;
    println!(
        "5. a strided export (transpose, Fortran order): {}  c-contiguous {}  f-contiguous {}  values {:?}",
        transposed.describe(),
        transposed.is_c_contiguous(),
        transposed.is_f_contiguous(),
        transposed.to_vec::<i32>()?
    );

    let refused = dlbridge::DataType::new(dlbridge::TypeCode::FLOAT6_E2M3FN, 8, 1).validate().unwrap_err();
    println!("6. a malformed dtype is refused with the field named: {refused}");

    drop(imported);
    println!("\ndropped: the deleter ran once and freed the Vec.");
    Ok(())
}
