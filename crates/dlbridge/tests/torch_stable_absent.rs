//! Where torch's stable ABI is not there: a process without libtorch, and a library that is not
//! libtorch. Each is an error naming what is missing (the caller then keeps the Python op), and
//! nothing is remembered: a later attempt may still succeed. This test binary never loads torch.
#![cfg(all(feature = "torch-stable", target_os = "linux"))]

use std::path::Path;

use dlbridge::torch_stable::{Error, Torch};

#[test]
fn a_process_without_torch_gets_not_loaded() {
    let err = Torch::attach().unwrap_err();
    assert!(
        matches!(&err, Error::NotLoaded { library, reason } if library == "libtorch_cpu.so" && reason.contains("import torch first")),
        "{err:?}"
    );
    // RTLD_NOLOAD: a path the process has not loaded is refused, not loaded.
    let err = Torch::attach_path(Path::new("/nonexistent/torch/lib/libtorch_cpu.so")).unwrap_err();
    assert!(matches!(&err, Error::NotLoaded { library, .. } if library.contains("/nonexistent/")), "{err:?}");
    assert!(Torch::get().is_none());
}

#[test]
fn a_library_without_the_stable_functions_names_the_first_missing() {
    // libc is a real shared library exporting none of torch's functions.
    let err = Torch::open(Path::new("libc.so.6")).unwrap_err();
    match &err {
        Error::Missing { symbol, torch } => {
            assert_eq!(*symbol, "aoti_torch_delete_tensor_object");
            assert!(torch.contains("unknown"), "{torch}");
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("does not export aoti_torch_delete_tensor_object"), "{err}");
    assert!(Torch::get().is_none());
}
