//! Reading a C exchange table: any version chain (newer majors linking to older ones, cycles
//! bounded), any NULL function pointers. Accepted only when major is 1 and every required function
//! is present.
#![no_main]

use dlbridge::ffi::*;
use dlbridge::python::ExchangeApi;
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

unsafe extern "C" fn alloc(_: *mut DLTensor, _: *mut *mut DLManagedTensorVersioned, _: *mut std::ffi::c_void, _: DLPackSetError) -> i32 {
    -1
}
unsafe extern "C" fn from_py(_: *mut std::ffi::c_void, _: *mut *mut DLManagedTensorVersioned) -> i32 {
    -1
}
unsafe extern "C" fn to_py(_: *mut DLManagedTensorVersioned, _: *mut *mut std::ffi::c_void) -> i32 {
    -1
}
unsafe extern "C" fn view(_: *mut std::ffi::c_void, _: *mut DLTensor) -> i32 {
    -1
}
unsafe extern "C" fn stream(_: DLDeviceType, _: i32, _: *mut *mut std::ffi::c_void) -> i32 {
    0
}

fuzz_target!(|data: &[u8]| {
    let mut inp = common::Input(data);
    let count = usize::from(inp.u8() % 12) + 1;
    let mut tables: Vec<Box<DLPackExchangeAPI>> = (0..count)
        .map(|_| {
            let bits = inp.u8();
            Box::new(DLPackExchangeAPI {
                header: DLPackExchangeAPIHeader {
                    version: DLPackVersion { major: u32::from(inp.u8() % 4), minor: u32::from(inp.u8()) },
                    prev_api: std::ptr::null_mut(),
                },
                managed_tensor_allocator: (bits & 1 != 0).then_some(alloc as _),
                managed_tensor_from_py_object_no_sync: (bits & 2 != 0).then_some(from_py as _),
                managed_tensor_to_py_object_no_sync: (bits & 4 != 0).then_some(to_py as _),
                dltensor_from_py_object_no_sync: (bits & 8 != 0).then_some(view as _),
                current_work_stream: (bits & 16 != 0).then_some(stream as _),
            })
        })
        .collect();
    // Link each table to another (possibly itself: a cycle) or to nothing.
    let ptrs: Vec<*mut DLPackExchangeAPIHeader> = tables.iter_mut().map(|t| &mut t.header as *mut _).collect();
    for t in tables.iter_mut() {
        let k = inp.u8() as usize;
        t.header.prev_api = if k % 3 == 0 { std::ptr::null_mut() } else { ptrs[k % ptrs.len()] };
    }
    // SAFETY: every pointer in the chain is a live table for the duration of the call.
    if let Some(api) = unsafe { ExchangeApi::validate_table(ptrs[0]) } {
        assert_eq!(api.header.version.major, 1);
        assert!(api.managed_tensor_allocator.is_some() && api.current_work_stream.is_some());
    }
    drop(tables);
});
