// Benchmark shim: the README's tensor argument and result paths written with nanobind, the C++
// anchor. bench/shim-dlbridge has the same functions in Rust (arg_ref_1c, arg_mut_1c,
// numpy_from_vec, torch_from_vec, noop); bench/bench_nanobind.py times them side by side.
// Built by bench/shim-nanobind/build.py with the system C++ compiler against nanobind from PyPI.
#include <cstdint>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

namespace nb = nanobind;

// `TensorRef<'_, f32, Rank<1>, C>` (CPU by default) and `TensorMut<...>` in nanobind's terms.
using ArgRef = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using ArgMut = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A fresh zero-filled float32 buffer of n elements (what `vec![0f32; n]` is), owned by a capsule
// that frees it when the framework's array is dropped.
template <typename Framework> static nb::ndarray<Framework, float, nb::ndim<1>> from_new(size_t n) {
    float *data = new float[n]();
    nb::capsule owner(data, [](void *p) noexcept { delete[] static_cast<float *>(p); });
    return nb::ndarray<Framework, float, nb::ndim<1>>(data, {n}, owner);
}

NB_MODULE(shim_nanobind, m) {
    m.def("noop", [](nb::handle) { return (size_t) 0; }, "The floor: a trivial function taking one object.");
    // noconvert: a mismatched array is refused (as dlbridge refuses it), never copied into a match.
    m.def("arg_ref_1c", [](ArgRef x) { return (uintptr_t) x.data(); }, nb::arg("x").noconvert(),
          "A read-only 1-d C-contiguous float32 CPU argument: its address.");
    m.def("arg_mut_1c", [](ArgMut x) { return (uintptr_t) x.data(); }, nb::arg("x").noconvert(),
          "A writable 1-d C-contiguous float32 CPU argument: its address.");
    m.def("numpy_from_vec", &from_new<nb::numpy>, "A fresh n-element float32 buffer as a numpy.ndarray.");
    m.def("torch_from_vec", &from_new<nb::pytorch>, "A fresh n-element float32 buffer as a torch.Tensor.");
}
