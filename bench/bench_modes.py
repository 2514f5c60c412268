"""`make bench`, the every-mode group (issue 22): one Rust kernel eagerly, inside `jax.jit` (XLA
FFI) and inside `torch.compile` (a torch custom op), against the same work done the framework's own
way. Also runnable alone (`python bench/bench_modes.py [--quick] [--ffi] [--native]`, `--ffi`: the
two handler groups only); its targets join bench.py's
PASS/FAIL list and report.

- a jitted call of a Rust FFI handler with an empty body on a small array, against the same
  handler written with XLA's header-only C++ binding (`xla/ffi/api/ffi.h`), compiled here with the
  system C++ compiler against `jax.ffi.include_dir()`;
- the same two handlers, 1000 calls chained in one jitted function, per handler call (one call per
  jit hides the handler behind jax's dispatch): the fastest of many short interleaved samples of
  each (the handler's cost is all CPU; load only adds time), medians printed beside;
- a jitted softmax over 1e6 float32 through the Rust kernel, against the eager call of the kernel
  on the same data;
- a `torch.compile`d softmax over 1e6 float32 through the kernel, against the eager call;
- an empty-body kernel called from a `torch.compile`d function, against a custom op with an empty
  body registered from Python with `torch.library.custom_op`, compiled the same way;
- a kernel with two results, one a residual (`rms_norm`: y, and rstd saved for the backward),
  against the same forward declared with one result (`rms_norm_inference`), per jitted call and
  per `torch.compile`d call, on a small array (8 x 16 float32: the per-call cost, not the body);
- an empty kernel with a handler (a native torch op) against the same op written in C++ with
  `STABLE_TORCH_LIBRARY` (built here with the system C++ compiler against torch's headers) and
  against the kernel as a Python custom op: eager under `torch.inference_mode()`, eager in grad
  mode, and inside `torch.compile` (`--native`: this group only).

Cases compared are interleaved (each repeat times every case of its group in turn, in an order
rotated every repeat); medians are reported (and compared, but for the chained handler calls).
"""


import contextlib
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
# Handler calls chained in one jitted function for the per-call target.
CHAIN = 1000

CPP_EMPTY = r"""
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error EmptyImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CppEmpty, EmptyImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
"""


# The C++ twin of dlbridge's empty native kernel (`dlbridge_bench.native_empty_like`, a kernel with
# an XLA handler that add_kernel makes a native torch op): the same op written against torch's
# stable ABI with STABLE_TORCH_LIBRARY, doing the same work (x's extents, C-contiguous, its dtype
# and device, allocated with aoti_torch_empty_strided as dlbridge's adapter allocates; nothing
# computed). Built by the bench with the system C++ compiler against the venv torch's headers.
CPP_TORCH_EMPTY = r"""
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

using torch::stable::Tensor;

static Tensor empty_like_cpp(Tensor x) {
  int64_t ndim = x.dim();
  STD_TORCH_CHECK(ndim <= 16, "x: at most 16 dimensions");
  int64_t sizes[16], strides[16];
  int64_t* s = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(x.get(), &s));
  int64_t step = 1;
  for (int64_t i = ndim - 1; i >= 0; --i) {
    sizes[i] = s[i];
    strides[i] = step;
    step *= s[i] > 1 ? s[i] : 1;
  }
  int32_t dtype, device_type, device_index;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(x.get(), &dtype));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(x.get(), &device_type));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(x.get(), &device_index));
  AtenTensorHandle out;
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(ndim, sizes, strides, dtype, device_type, device_index, &out));
  return Tensor(out);
}

// The same, reading what an empty kernel's body is handed (dlbridge's handler gets its operand's
// and its result's buffers): x must be C-contiguous on the CPU (a raw loop over it would need
// that), and both data pointers are read, into a sink the compiler cannot drop. Nothing computed.
static void* volatile sink;

static Tensor empty_like_buffers_cpp(Tensor x) {
  bool contiguous = false;
  TORCH_ERROR_CODE_CHECK(aoti_torch_is_contiguous(x.get(), &contiguous));
  STD_TORCH_CHECK(contiguous, "x: not C-contiguous");
  void* in = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(x.get(), &in));
  Tensor out = empty_like_cpp(x);
  void* o = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(out.get(), &o));
  sink = in;
  sink = o;
  return out;
}

STABLE_TORCH_LIBRARY(dlbridge_bench_cpp, m) {
  m.def("empty_like(Tensor x) -> Tensor");
  m.def("empty_like_buffers(Tensor x) -> Tensor");
}
STABLE_TORCH_LIBRARY_IMPL(dlbridge_bench_cpp, CPU, m) {
  m.impl("empty_like", TORCH_BOX(&empty_like_cpp));
  m.impl("empty_like_buffers", TORCH_BOX(&empty_like_buffers_cpp));
}
STABLE_TORCH_LIBRARY_IMPL(dlbridge_bench_cpp, Meta, m) {
  m.impl("empty_like", TORCH_BOX(&empty_like_cpp));
  m.impl("empty_like_buffers", TORCH_BOX(&empty_like_cpp));
}
"""


def cpp_torch_op(torch) -> None:
    """Builds CPP_TORCH_EMPTY into target/ (g++ against the venv torch's headers, linked to its
    libtorch_cpu, which the process has already loaded) and loads it: torch.ops.dlbridge_bench_cpp."""
    root = Path(__file__).resolve().parent.parent / "target" / "bench-torch-cpp"
    root.mkdir(parents=True, exist_ok=True)
    src, lib = root / "empty_like.cc", root / "libdlbridge_bench_cpp.so"
    src.write_text(CPP_TORCH_EMPTY)
    tdir = Path(torch.__file__).resolve().parent
    cxx = os.environ.get("CXX", "g++")
    subprocess.run(
        [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", "-I", str(tdir / "include"), str(src), "-o", str(lib),
         "-L", str(tdir / "lib"), "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{tdir / 'lib'}"],
        check=True,
    )
    torch.ops.load_library(str(lib))


# How many calls of the empty op one compiled function makes, for the compiled targets.
TORCH_CHAIN = 32


def torch_native(torch, kernels, D, scale: float, results: dict, targets: list) -> None:
    """dlbridge's empty native kernel (a kernel with a handler: a native torch op) against the same
    op in C++ through STABLE_TORCH_LIBRARY and against the same kernel as a Python custom op
    (what dlbridge made before kernels were native ops), eagerly and compiled."""
    nat = D.native_empty_like
    if nat._native_fallback is not None:
        print(f"  (native torch op rows skipped: the kernel is a Python op here: {nat._native_fallback})")
        return
    cpp_torch_op(torch)
    py = kernels.kernel(nat.__wrapped__, name="native_empty_like_py", out="x")
    n_op, p_op = nat._overload, py._overload
    c_op = torch.ops.dlbridge_bench_cpp.empty_like_buffers.default
    c_plain = torch.ops.dlbridge_bench_cpp.empty_like.default
    x = torch.zeros(16)
    n = int(2000 * scale)

    # The target's C++ op reads what dlbridge's empty handler is handed (its operand's and its
    # result's buffers: x C-contiguous, both data pointers); the plain one reads neither, for the
    # record.
    with torch.inference_mode():
        xi = torch.zeros(16)
        r = interleaved({
            "eager, inference_mode: dlbridge native kernel op (16 f32)": lambda: n_op(xi),
            "eager, inference_mode: C++ STABLE_TORCH_LIBRARY op reading its buffers (16 f32)": lambda: c_op(xi),
            "eager, inference_mode: C++ STABLE_TORCH_LIBRARY op reading no pointer (16 f32)": lambda: c_plain(xi),
        }, n)
    results.update(r)
    a, b, p = r.values()
    targets.append(target("empty kernel, eager under inference_mode: dlbridge native op vs the C++ STABLE_TORCH_LIBRARY op",
                          a / b, 1.1, a, b, "dlbridge", "C++"))
    print(f"  (eager, inference_mode: against the C++ op reading no pointer {a / p:.3f} x)")

    r = interleaved({
        "eager, grad mode: dlbridge native kernel op (16 f32)": lambda: n_op(x),
        "eager, grad mode: the kernel as a Python custom op (16 f32)": lambda: p_op(x),
    }, n)
    results.update(r)
    a, b = r["eager, grad mode: dlbridge native kernel op (16 f32)"], r["eager, grad mode: the kernel as a Python custom op (16 f32)"]
    targets.append(target("empty kernel, eager in grad mode: dlbridge native op vs the kernel as a Python custom op",
                          a / b, 1.0, a, b, "native", "Python op"))

    # Compiled and called under inference_mode (the targets: no autograd kernel runs), and, for
    # the record, in grad mode (where torch.library's Python autograd kernel of the dlbridge op
    # runs on every call: autograd has no stable C API; the C++ op has no autograd kernel).
    # The targets time what the op costs inside a compiled graph: a compiled function calling it
    # TORCH_CHAIN times in a row (inductor calls each as an extern kernel). One call per compiled
    # function measures torch.compile's own call (guards, the wrapper: ~13 us here, the same for
    # every op) more than the op: those rows are printed for the record.
    def chained(op):
        def f(x):
            for _ in range(TORCH_CHAIN):
                x = op(x)
            return x
        return f

    compiled, single = {}, {}
    for mode in ("inference_mode", "grad mode"):
        with torch.inference_mode() if mode == "inference_mode" else torch.enable_grad():
            xc = torch.zeros(16)
            cpp = torch.ops.dlbridge_bench_cpp.empty_like_buffers
            fn, fc, fp = (torch.compile(chained(f), fullgraph=True) for f in (nat, cpp, py))
            gn, gc, gp = (torch.compile(f, fullgraph=True) for f in (nat, cpp, py))
            for f in (fn, fc, fp, gn, gc, gp):
                f(xc)
            r = interleaved({
                f"torch.compile, {mode}, {TORCH_CHAIN} calls: dlbridge native kernel op (16 f32)": lambda: fn(xc),
                f"torch.compile, {mode}, {TORCH_CHAIN} calls: C++ STABLE_TORCH_LIBRARY op (16 f32)": lambda: fc(xc),
                f"torch.compile, {mode}, {TORCH_CHAIN} calls: the kernel as a Python custom op (16 f32)": lambda: fp(xc),
            }, max(1, n // 40))
            r1 = interleaved({
                f"torch.compile, {mode}, one call: dlbridge native kernel op (16 f32)": lambda: gn(xc),
                f"torch.compile, {mode}, one call: C++ STABLE_TORCH_LIBRARY op (16 f32)": lambda: gc(xc),
                f"torch.compile, {mode}, one call: the kernel as a Python custom op (16 f32)": lambda: gp(xc),
            }, max(1, n // 10))
        results.update(r)
        results.update(r1)
        compiled[mode] = list(r.values())
        single[mode] = list(r1.values())
    a, b, c = compiled["inference_mode"]
    targets.append(target(f"empty kernel in torch.compile (inference_mode, {TORCH_CHAIN} calls in one compiled function): dlbridge native op vs the C++ STABLE_TORCH_LIBRARY op",
                          a / b, 1.1, a, b, "dlbridge", "C++"))
    targets.append(target(f"empty kernel in torch.compile (inference_mode, {TORCH_CHAIN} calls in one compiled function): dlbridge native op vs the kernel as a Python custom op",
                          a / c, 0.6, a, c, "native", "Python op"))
    print(f"  (torch.compile, inference_mode, {TORCH_CHAIN} calls: per call native {a / TORCH_CHAIN * 1e6:.2f} us, "
          f"C++ {b / TORCH_CHAIN * 1e6:.2f} us, Python op {c / TORCH_CHAIN * 1e6:.2f} us; the C++ op / the Python op {b / c:.3f} x: "
          f"the floor of the 0.6 x target with inductor's Python wrapper, ~1.3 us a call)")
    a, b, c = single["inference_mode"]
    print(f"  (torch.compile, inference_mode, one call per compiled function: native / C++ {a / b:.3f} x, "
          f"native / Python op {a / c:.3f} x; the C++ op / the Python op {b / c:.3f} x: no op gets below that there)")
    a, b, c = compiled["grad mode"]
    print(f"  (grad mode, compiled, {TORCH_CHAIN} calls: native / C++ {a / b:.2f} x, native / Python op {a / c:.2f} x; no target)")


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


def fastest(cases: dict[str, object], number: int, repeats: int) -> dict[str, tuple[float, float]]:
    """(minimum, median) seconds per call of each callable over `repeats` short samples of `number`
    calls, the cases interleaved. For work that is all CPU (no I/O, no allocation that grows), the
    minimum is the least-disturbed sample: other processes' load only ever adds time."""
    for f in cases.values():
        for _ in range(max(1, number // 2)):
            f()
    samples: dict[str, list[float]] = {n: [] for n in cases}
    names = list(cases)
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            samples[n].append(timeit.timeit(cases[n], number=number) / number)
    return {n: (min(s), statistics.median(s)) for n, s in samples.items()}


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
    unit, k = ("ns", 1e9) if max(a, b) < 1e-6 else ("us", 1e6)
    return {
        "name": name,
        "pass": ratio <= limit,
        "detail": f"{ratio:.3f} (<= {limit}): {what_a} {a * k:.2f} {unit}, {what_b} {b * k:.2f} {unit}",
    }


def run(quick: bool = False, ffi_only: bool = False, native_only: bool = False) -> tuple[dict[str, float], list[dict]]:
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
    if native_only:
        torch_native(torch, kernels, D, scale, results, targets)
        return report(results, targets)

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

    # 1b. the handler alone: CHAIN empty-body calls chained in one jitted function (each call's
    # result is the next one's operand), Rust against C++, per handler call. One call per jit hides
    # the handler behind jax's dispatch; here the dispatch is shared by CHAIN calls and nothing is
    # subtracted. Both handlers check what XLA's binding checks (operand and result counts, the
    # attributes, the frame's and the buffers' sizes).
    jax.ffi.register_ffi_target("dlbridge_bench_rust_empty", D.empty_xla_capsule(), platform="cpu")

    def chained(target_name):
        def f(x):
            for _ in range(CHAIN):
                x = jax.ffi.ffi_call(target_name, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
            return x
        return jax.jit(f)

    c_rust, c_cpp = chained("dlbridge_bench_rust_empty"), chained("dlbridge_bench_cpp_empty")
    rust_name = f"jax.jit: {CHAIN} chained Rust FFI handler calls, empty body (16 f32)"
    cpp_name = f"jax.jit: {CHAIN} chained C++ FFI handler calls, empty body (16 f32)"
    r = fastest({
        rust_name: lambda: c_rust(small).block_until_ready(),
        cpp_name: lambda: c_cpp(small).block_until_ready(),
    }, max(4, int(10 * scale)), repeats=2 * REPEATS + 1)
    results.update({n: med for n, (_, med) in r.items()})
    (a, a_med), (b, b_med) = r[rust_name], r[cpp_name]
    tg = target(f"per handler call, {CHAIN} empty-body calls in one jit: Rust vs XLA's C++ binding (fastest samples)",
                a / b, 1.1, a / CHAIN, b / CHAIN, "Rust", "C++")
    tg["detail"] += f" (medians {a_med / CHAIN * 1e9:.2f} and {b_med / CHAIN * 1e9:.2f} ns)"
    targets.append(tg)
    del keep
    if ffi_only:
        return report(results, targets)

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

    # 5. several results and a residual against one result: the same rms_norm forward, declared
    # with results (y, and the residual rstd) and with out="x" (y only), small enough that the
    # per-call cost shows, not the body. Both are all CPU (no I/O): compared on the fastest of many
    # short interleaved samples (load only adds time), medians printed beside.
    xr = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    wr = np.linspace(0.5, 1.5, 16, dtype=np.float32)
    xj, wj = jnp.asarray(xr), jnp.asarray(wr)
    xt, wt = torch.from_numpy(xr), torch.from_numpy(wr)
    j_two, j_one = jax.jit(K.rms_norm), jax.jit(K.rms_norm_inference)
    np.testing.assert_allclose(np.asarray(j_two(xj, wj)), np.asarray(j_one(xj, wj)), rtol=0)
    # torch: compiled and called under inference_mode. rms_norm has a backward and its one-result
    # twin has none, so in grad mode only rms_norm's op runs torch.library's Python autograd kernel
    # (autograd has no stable C API), a cost of having a backward, not of results: printed below
    # for the record, beside the target.
    with torch.inference_mode():
        xi, wi = torch.from_numpy(xr), torch.from_numpy(wr)
        c_two = torch.compile(lambda a, b: K.rms_norm(a, b), fullgraph=True)
        c_one = torch.compile(lambda a, b: K.rms_norm_inference(a, b), fullgraph=True)
        torch.testing.assert_close(c_two(xi, wi), c_one(xi, wi), rtol=0, atol=0)
    g_two = torch.compile(lambda a, b: K.rms_norm(a, b), fullgraph=True)
    g_one = torch.compile(lambda a, b: K.rms_norm_inference(a, b), fullgraph=True)
    torch.testing.assert_close(g_two(xt, wt), g_one(xt, wt), rtol=0, atol=0)
    groups = (
        ("jax.jit", "jitted", contextlib.nullcontext,
         lambda: j_two(xj, wj).block_until_ready(), lambda: j_one(xj, wj).block_until_ready()),
        ("torch.compile", "torch.compile'd (inference_mode)", torch.inference_mode,
         lambda: c_two(xi, wi), lambda: c_one(xi, wi)),
    )
    r = fastest({"two": lambda: g_two(xt, wt), "one": lambda: g_one(xt, wt)},
                max(10, int(100 * scale)), repeats=2 * REPEATS + 1)
    print(f"  (torch.compile'd in grad mode, two results with a backward / one result without: "
          f"{r['two'][0] / r['one'][0]:.3f} x, fastest {r['two'][0] * 1e6:.2f} / {r['one'][0] * 1e6:.2f} us; no target)")
    for mode, adjective, context, f_two, f_one in groups:
        two = f"{mode}: rms_norm, 2 results (1 residual), 8x16 f32"
        one = f"{mode}: rms_norm, 1 result, 8x16 f32"
        with context():
            r = fastest({two: f_two, one: f_one}, max(10, int(100 * scale)), repeats=2 * REPEATS + 1)
        results.update({n: med for n, (_, med) in r.items()})
        (a, a_med), (b, b_med) = r[two], r[one]
        tg = target(f"{adjective} call of a kernel with a residual and two results vs one result (fastest samples)",
                    a / b, 1.1, a, b, "two", "one")
        tg["detail"] += f" (medians {a_med * 1e6:.2f} and {b_med * 1e6:.2f} us)"
        targets.append(tg)

    # 6. the empty native kernel against the same op in C++ (STABLE_TORCH_LIBRARY) and against the
    # kernel as a Python custom op, eagerly and compiled.
    torch_native(torch, kernels, D, scale, results, targets)

    return report(results, targets)


def report(results: dict[str, float], targets: list[dict]) -> tuple[dict[str, float], list[dict]]:
    for name, v in results.items():
        print(f"  {name:<60} {v * 1e6:12.2f} us", flush=True)
    return results, targets


if __name__ == "__main__":
    _, targets = run(quick="--quick" in sys.argv, ffi_only="--ffi" in sys.argv, native_only="--native" in sys.argv)
    print("\n== targets (every mode)")
    for tg in targets:
        print(f"  {'PASS' if tg['pass'] else 'FAIL'}  {tg['name']}: {tg['detail']}")
    sys.exit(0)
