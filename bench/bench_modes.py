"""`make bench`, the every-mode group (issue 22): one Rust kernel eagerly, inside `jax.jit` (XLA
FFI) and inside `torch.compile` (a torch custom op), against the same work done the framework's own
way. Also runnable alone (`python bench/bench_modes.py [--quick]`); its targets join bench.py's
PASS/FAIL list and report.

- a jitted call of a Rust FFI handler with an empty body on a small array, against the same
  handler written with XLA's header-only C++ binding (`xla/ffi/api/ffi.h`), compiled here with the
  system C++ compiler against `jax.ffi.include_dir()`;
- a jitted softmax over 1e6 float32 through the Rust kernel, against the eager call of the kernel
  on the same data;
- a `torch.compile`d softmax over 1e6 float32 through the kernel, against the eager call;
- an empty-body kernel called from a `torch.compile`d function, against a custom op with an empty
  body registered from Python with `torch.library.custom_op`, compiled the same way.

Cases compared are interleaved (each repeat times every case of its group in turn, in an order
rotated every repeat); medians are reported.
"""


import os
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

# Many short repeats, interleaved: this machine's load (other builds) swings by 2x within seconds,
# and a median over short alternating samples keeps both cases under the same conditions.
REPEATS = 31

CPP_EMPTY = r"""
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error EmptyImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CppEmpty, EmptyImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
"""


def interleaved(cases: dict[str, object], number: int, repeats: int = REPEATS) -> dict[str, float]:
    """Median seconds per call of each callable, the cases of the group interleaved."""
    for f in cases.values():
        for _ in range(max(1, number // 10)):
            f()
    samples: dict[str, list[float]] = {n: [] for n in cases}
    names = list(cases)
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            samples[n].append(timeit.timeit(cases[n], number=number) / number)
    return {n: statistics.median(s) for n, s in samples.items()}


def cpp_handler(jax):
    """The C++ twin of the empty handler, compiled with the system C++ compiler, as a capsule."""
    import ctypes

    out = Path(tempfile.mkdtemp(prefix="dlbridge-bench-ffi-"))
    src, lib = out / "empty.cc", out / "libempty.so"
    src.write_text(CPP_EMPTY)
    cxx = os.environ.get("CXX", "g++")
    subprocess.run(
        [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", "-I", jax.ffi.include_dir(), str(src), "-o", str(lib)],
        check=True,
    )
    handle = ctypes.cdll.LoadLibrary(str(lib))
    return jax.ffi.pycapsule(handle.CppEmpty), handle


def target(name: str, ratio: float, limit: float, a: float, b: float, what_a: str, what_b: str) -> dict:
    return {
        "name": name,
        "pass": ratio <= limit,
        "detail": f"{ratio:.3f} (<= {limit}): {what_a} {a * 1e6:.2f} us, {what_b} {b * 1e6:.2f} us",
    }


def run(quick: bool = False) -> tuple[dict[str, float], list[dict]]:
    """Every case (median seconds) and every target of this group."""
    print("\n== every mode: one Rust kernel eagerly, in jax.jit, in torch.compile (interleaved medians)", flush=True)
    import numpy as np

    try:
        import jax
        import jax.numpy as jnp
        import torch

        import dlbridge.kernels as kernels
        import dlbridge_bench as D
        import dlbridge_kernels as K
    except ImportError as e:
        print(f"  (skipped: {e})")
        return {}, []
    scale = 0.2 if quick else 1.0
    results: dict[str, float] = {}
    targets: list[dict] = []

    # 1. jitted empty-body handler: Rust (xla_handler!) against C++ (ffi.h), 16 float32.
    capsule, keep = cpp_handler(jax)
    jax.ffi.register_ffi_target("dlbridge_bench_cpp_empty", capsule, platform="cpu")
    rust_empty = kernels.kernel(D.noop, name="bench_empty", ffi=D.empty_xla_capsule(), out="_x")
    small = jnp.arange(16, dtype=jnp.float32)
    f_rust = jax.jit(rust_empty)
    f_cpp = jax.jit(lambda x: jax.ffi.ffi_call("dlbridge_bench_cpp_empty", jax.ShapeDtypeStruct(x.shape, x.dtype))(x))
    r = interleaved({
        "jax.jit: Rust FFI handler, empty body (16 f32)": lambda: f_rust(small).block_until_ready(),
        "jax.jit: C++ FFI handler (ffi.h), empty body (16 f32)": lambda: f_cpp(small).block_until_ready(),
    }, int(400 * scale))
    results.update(r)
    a, b = r["jax.jit: Rust FFI handler, empty body (16 f32)"], r["jax.jit: C++ FFI handler (ffi.h), empty body (16 f32)"]
    targets.append(target("jitted empty-body Rust FFI kernel vs the same handler in XLA's C++ binding",
                          a / b, 1.1, a, b, "Rust", "C++"))
    del keep

    # 2. jitted softmax over 1e6 float32 against the eager call of the same kernel on the same data.
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1000, 1000)).astype(np.float32))
    f_soft = jax.jit(K.softmax)
    np.testing.assert_allclose(np.asarray(f_soft(x)), np.asarray(K.softmax(x)), rtol=1e-6, atol=1e-7)
    r = interleaved({
        "jax: softmax 1e6 f32, eager kernel": lambda: K.softmax(x).block_until_ready(),
        "jax: softmax 1e6 f32, jax.jit(kernel)": lambda: f_soft(x).block_until_ready(),
    }, max(2, int(6 * scale)))
    results.update(r)
    a, b = r["jax: softmax 1e6 f32, jax.jit(kernel)"], r["jax: softmax 1e6 f32, eager kernel"]
    targets.append(target("jitted softmax (1e6 f32) through the Rust kernel vs its eager call",
                          a / b, 1.1, a, b, "jit", "eager"))

    # 3. torch.compile'd softmax over 1e6 float32 against the eager call.
    t = torch.from_numpy(np.asarray(x).copy())
    c_soft = torch.compile(lambda a: K.softmax(a), fullgraph=True)
    torch.testing.assert_close(c_soft(t), K.softmax(t))
    r = interleaved({
        "torch: softmax 1e6 f32, eager kernel": lambda: K.softmax(t),
        "torch: softmax 1e6 f32, torch.compile(kernel)": lambda: c_soft(t),
    }, max(2, int(6 * scale)))
    results.update(r)
    a, b = r["torch: softmax 1e6 f32, torch.compile(kernel)"], r["torch: softmax 1e6 f32, eager kernel"]
    targets.append(target("torch.compile'd softmax (1e6 f32) through the kernel vs its eager call",
                          a / b, 1.1, a, b, "compiled", "eager"))

    # 4. an empty-body kernel in a compiled function against an empty Python custom op.
    rust_inplace = kernels.kernel(D.empty_inplace, name="bench_empty_inplace", mutates=("x",), out=None)

    @torch.library.custom_op("dlbridge_bench::py_empty_inplace", mutates_args=("x",))
    def py_empty(x: torch.Tensor) -> None:
        pass

    # The same function around each (a statement, no result): what differs is the op alone.
    def call_rust(a):
        rust_inplace(a)

    def call_py(a):
        py_empty(a)

    ts = torch.zeros(16)
    c_rust = torch.compile(call_rust, fullgraph=True)
    c_py = torch.compile(call_py, fullgraph=True)
    c_rust(ts)
    c_py(ts)
    r = interleaved({
        "torch.compile: dlbridge kernel, empty body (16 f32)": lambda: c_rust(ts),
        "torch.compile: Python custom_op, empty body (16 f32)": lambda: c_py(ts),
    }, int(200 * scale))
    results.update(r)
    a, b = r["torch.compile: dlbridge kernel, empty body (16 f32)"], r["torch.compile: Python custom_op, empty body (16 f32)"]
    targets.append(target("torch.compile'd empty-body dlbridge kernel vs an empty torch.library.custom_op",
                          a / b, 1.1, a, b, "dlbridge", "custom_op"))

    for name, v in results.items():
        print(f"  {name:<60} {v * 1e6:12.2f} us", flush=True)
    return results, targets


if __name__ == "__main__":
    _, targets = run(quick="--quick" in sys.argv)
    print("\n== targets (every mode)")
    for tg in targets:
        print(f"  {'PASS' if tg['pass'] else 'FAIL'}  {tg['name']}: {tg['detail']}")
    sys.exit(0)
