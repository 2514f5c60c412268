//! The non-DLPack protocols' parsers: buffer formats, typestrs, and the array-interface /
//! CUDA-array-interface layout check (typestr, shape, byte strides, offset, buffer length).
#![no_main]

use dlbridge::interface;
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let mut inp = common::Input(data);
    let itemsize = usize::from(inp.u8());
    let n = usize::from(inp.u8() % 6);
    let shape: Vec<i64> = (0..n).map(|_| inp.i64()).collect();
    let strides: Vec<i64> = (0..n).map(|_| inp.i64()).collect();
    let with_strides = inp.u8() % 2 == 0;
    let offset = inp.u64() as usize % 4096;
    let buffer_len = if inp.u8() % 2 == 0 { None } else { Some(inp.u64() as usize % 65536) };
    let text = String::from_utf8_lossy(inp.0);
    let _ = interface::buffer_format(&text, itemsize);
    if let Ok(t) = interface::typestr(&text) {
        assert!(t.validate().is_ok());
    }
    if let Ok(l) = interface::array_layout(&text, &shape, with_strides.then_some(&strides[..]), offset, buffer_len) {
        if let Some(s) = &l.strides {
            assert_eq!(s.len(), shape.len());
        }
    }
});
