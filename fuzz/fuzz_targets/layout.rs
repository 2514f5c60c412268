//! Layout arithmetic on any shape and strides: never panics (overflow is an error, not a wrap).
#![no_main]

use dlbridge::layout;
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let mut inp = common::Input(data);
    let n = usize::from(inp.u8() % 10);
    let shape: Vec<i64> = (0..n).map(|_| inp.i64()).collect();
    let strides: Vec<i64> = (0..n).map(|_| inp.i64()).collect();
    let bits = u64::from(inp.u8()) * u64::from(inp.u8() % 5);
    let _ = layout::element_count(&shape);
    let _ = layout::c_strides(&shape);
    let _ = layout::f_strides(&shape);
    let c = layout::is_c_contiguous(&shape, &strides);
    let _ = layout::is_f_contiguous(&shape, &strides);
    if let Ok((lo, hi)) = layout::element_span(&shape, &strides) {
        if layout::element_count(&shape).is_ok_and(|n| n > 0) {
            assert!(lo <= 0 && hi >= 0);
            if c {
                assert_eq!(lo, 0);
            }
        }
    }
    let _ = layout::byte_span(&shape, &strides, bits);
    let _ = layout::compact_byte_size(inp.u64(), bits);
});
