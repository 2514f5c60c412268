//! Tensor metadata validation: any ndim, shape, strides, dtype, device, byte_offset, flags and
//! version, through both doors. Invariants: no panic, no crash, the deleter runs exactly once.
#![no_main]

use std::sync::atomic::{AtomicUsize, Ordering};

use dlbridge::ffi::*;
use dlbridge::ManagedTensor;
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

static DELETED: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn deleter_v(_: *mut DLManagedTensorVersioned) {
    DELETED.fetch_add(1, Ordering::SeqCst);
}
unsafe extern "C" fn deleter_l(_: *mut DLManagedTensor) {
    DELETED.fetch_add(1, Ordering::SeqCst);
}

fuzz_target!(|data: &[u8]| {
    let mut inp = common::Input(data);
    let versioned = inp.u8() % 2 == 0;
    let ndim_raw = inp.u8();
    let ndim: i32 = match ndim_raw % 8 {
        0 => inp.u32() as i32,
        _ => i32::from(ndim_raw % 9),
    };
    let n = usize::try_from(ndim).unwrap_or(0).min(70);
    let mut shape: Vec<i64> = (0..n).map(|_| inp.i64()).collect();
    let mut strides: Vec<i64> = (0..n).map(|_| inp.i64()).collect();
    let null_shape = inp.u8() % 16 == 0;
    let null_strides = inp.u8() % 4 == 0;
    let dtype = DLDataType { code: DLDataTypeCode(inp.u8() % 20), bits: inp.u8(), lanes: u16::from(inp.u8() % 4) };
    let device = DLDevice { device_type: DLDeviceType(i32::from(inp.u8() % 24) - 2), device_id: i32::from(inp.u8()) };
    let data_ptr = match inp.u8() % 3 {
        0 => 0usize,
        1 => 0x1000,
        _ => inp.u64() as usize,
    };
    let tensor = DLTensor {
        data: data_ptr as *mut _,
        device,
        ndim,
        dtype,
        shape: if null_shape { std::ptr::null_mut() } else { shape.as_mut_ptr() },
        strides: if null_strides { std::ptr::null_mut() } else { strides.as_mut_ptr() },
        byte_offset: if inp.u8() % 2 == 0 { 0 } else { inp.u64() },
    };
    // A shape/strides array shorter than ndim would be the producer's memory error, not a
    // validation case: only hand over arrays with at least ndim entries.
    if ndim > 0 && (ndim as usize) > n {
        return;
    }
    let before = DELETED.load(Ordering::SeqCst);
    let result = if versioned {
        let mut m = Box::new(DLManagedTensorVersioned {
            version: DLPackVersion { major: if inp.u8() % 8 == 0 { inp.u32() } else { 1 }, minor: inp.u32() },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(deleter_v),
            flags: inp.u64(),
            dl_tensor: tensor,
        });
        // SAFETY: a live struct whose shape/strides hold ndim entries; ownership passes (the box
        // is leaked to the deleter, which only counts).
        let r = unsafe { ManagedTensor::from_raw_versioned(&mut *m) };
        std::mem::forget(m);
        r
    } else {
        let mut m = Box::new(DLManagedTensor { dl_tensor: tensor, manager_ctx: std::ptr::null_mut(), deleter: Some(deleter_l) });
        // SAFETY: as above.
        let r = unsafe { ManagedTensor::from_raw_legacy(&mut *m) };
        std::mem::forget(m);
        r
    };
    match result {
        Ok(t) => {
            // Every accessor is safe on an accepted tensor (the data is never read here: the
            // pointer is made up).
            let _ = (t.shape(), t.strides(), t.numel(), t.nbytes(), t.is_c_contiguous(), t.is_f_contiguous());
            let _ = (t.describe(), t.data_ptr(), t.flags(), t.version());
            assert_eq!(DELETED.load(Ordering::SeqCst), before, "deleted while alive");
            drop(t);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
    assert_eq!(DELETED.load(Ordering::SeqCst), before + 1, "the deleter must run exactly once");
});
