"""`make bench`: dlbridge side by side with every peer, in one process run.

Each case is timed as the median ns per call over REPEATS repeats (min and max shown). Cases that
are compared are interleaved: every repeat times each case of its group in turn, so the machine's
noise (2x swings between runs here) falls on all of them alike. Targets are ratios between cases
of the same run and print PASS or FAIL; nothing here is a timed test.

Also: per-call cost against tensor size (1e3 to 1e8 elements) for zero-copy paths against a
copying one, peak memory beyond the buffer when a 1e8-element tensor made in Rust is consumed by
numpy, torch and jax (each in a fresh subprocess), and instruction counts from callgrind, which
do not swing; and tensors sent to other processes (bench_processes.py: multiprocessing, torch's
queue, Ray); and the README's typed argument and result paths against the same functions written
with nanobind (bench_nanobind.py). Writes docs/BENCHMARKS.md and docs/bench_sizes.png.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 7
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def optional(name: str):
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def measure_group(cases: dict[str, str], env: dict, number: int, repeats: int = REPEATS) -> dict[str, dict]:
    """Times each statement `number` times per repeat, interleaving the cases of the group (in an
    order rotated every repeat)."""
    timers = {name: timeit.Timer(stmt, globals=env) for name, stmt in cases.items()}
    for t in timers.values():
        t.timeit(max(1, number // 10))  # warm up
    samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(timers)
    for r in range(repeats):
        # Each repeat starts at a different point of the list (spread over it), so no case always
        # runs first or last in a repeat: drift within a repeat would otherwise fall on the same
        # cases every time (the size sweep's largest sizes come last in the list).
        k = r * len(names) // repeats % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(timers[name].timeit(number) / number * 1e9)
    return {n: {"median": statistics.median(s), "min": min(s), "max": max(s)} for n, s in samples.items()}


NOOP = "noop: trivial PyO3 function (dlbridge shim)"
PTR_FLOOR = "floor: a PyO3 function returning the argument's address"
THREE_IMPORTS = "reference: three owned torch imports + one trivial call (3 x (import - noop) + noop)"


def tvm_identity():
    """tvm-ffi's strongest form: a C++ function taking a tensor and returning it, compiled with
    tvm_ffi.cpp.load_inline (ninja from bench/requirements-bench.txt, on PATH from the venv)."""
    try:
        os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
        import tvm_ffi.cpp

        mod = tvm_ffi.cpp.load_inline(
            name="dlbridge_bench_identity",
            cpp_sources="#include <tvm/ffi/container/tensor.h>\ntvm::ffi::Tensor identity(tvm::ffi::Tensor x) { return x; }\n",
            functions=["identity"],
        )
        return mod.identity
    except Exception as e:  # reported, and its target is then absent (not passed)
        print(f"  tvm-ffi load_inline failed: {e}", flush=True)
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer calls per repeat (a smoke run)")
    ap.add_argument("--no-callgrind", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs"))
    args = ap.parse_args()
    scale = 0.1 if args.quick else 1.0

    import numpy as np

    import dlbridge
    import dlbridge_bench as D

    torch = optional("torch")
    P = optional("shim_pyo3_dlpack")
    K = optional("shim_dlpark")
    pydlpack = optional("dlpack")
    missing = [n for n, m in [("torch", torch), ("shim_pyo3_dlpack", P), ("shim_dlpark", K), ("pydlpack (dlpack)", pydlpack)] if m is None]

    a = np.arange(1000, dtype=np.float32)
    x = torch.arange(1000, dtype=torch.float32) if torch else None
    t = dlbridge.from_dlpack(a)
    env = {"np": np, "torch": torch, "dlbridge": dlbridge, "D": D, "P": P, "K": K, "pydlpack": pydlpack, "a": a, "x": x, "t": t}
    n_fast = int(100_000 * scale)
    n_slow = int(10_000 * scale)

    results: dict[str, dict] = {}

    def group(title: str, cases: dict[str, str | None], number: int) -> None:
        live = {k: v for k, v in cases.items() if v is not None}
        print(f"\n== {title}", flush=True)
        r = measure_group(live, env, number)
        for name, v in r.items():
            print(f"  {name:<58} {v['median']:9.0f} ns  [{v['min']:.0f}..{v['max']:.0f}]", flush=True)
        results.update(r)

    group("import a numpy array (1000 f32) into Rust, read the pointer, drop", {
        NOOP: "D.noop(a)",
        "numpy.from_dlpack(numpy array)": "np.from_dlpack(a)",
        "dlbridge: owned import (ManagedTensor)": "D.import_ptr(a)",
        "dlbridge: borrowed view (TensorView)": "D.view_ptr(a)",
        PTR_FLOOR: "D.ptr_floor(a)",
        "pyo3-dlpack 0.3: import": "P.import_ptr(a)" if P else None,
        "dlpark 0.10: import": "K.import_ptr(a)" if K else None,
    }, n_fast)
    if torch:
        group("import a torch tensor (1000 f32) into Rust, read the pointer, drop", {
            "dlbridge: owned import (ManagedTensor), torch": "D.import_ptr(x)",
            "dlbridge: borrowed view (TensorView), torch": "D.view_ptr(x)",
            PTR_FLOOR + ", torch": "D.ptr_floor(x)",
            "pyo3-dlpack 0.3: import, torch": "P.import_ptr(x)" if P else None,
            "dlpark 0.10: import, torch": "K.import_ptr(x)" if K else None,
            "dlpark 0.10: borrowed view, torch": "K.view_ptr(x)" if K and hasattr(K, "view_ptr") else None,
            "floor: torch's own exchange export + deleter, no validation": "D.torch_floor_owned(x)",
            "floor: torch's own borrowed DLTensor, no validation": "D.torch_floor_view(x)",
        }, n_slow)
    group("Python-level import and export", {
        "dlbridge.from_dlpack(numpy array)": "dlbridge.from_dlpack(a)",
        "numpy.from_dlpack(numpy array) ": "np.from_dlpack(a)",
        "numpy.from_dlpack(dlbridge.Tensor)": "np.from_dlpack(t)",
    }, n_fast)
    if torch:
        group("torch as consumer", {
            "torch.from_dlpack(numpy array)": "torch.from_dlpack(a)",
            "torch.from_dlpack(dlbridge.Tensor)": "torch.from_dlpack(t)",
        }, n_slow)
    # The kernel author's kit (issue 14): typed arguments, results in the caller's framework.
    group("typed arguments (numpy, 1000 f32)", {
        "dlbridge: borrowed view (TensorView), numpy ": "D.view_ptr(a)",
        "dlbridge: typed argument (TensorRef<f32>), numpy": "D.typed_ptr(a)",
    }, n_fast)
    group("results in numpy: empty_like", {
        "numpy.empty_like(a)": "np.empty_like(a)",
        "dlbridge: f(a) returning empty_like(a), numpy": "D.empty_like(a)",
    }, n_fast)
    if torch:
        tvm = tvm_identity()
        env.update(y=torch.zeros(1000), z=torch.zeros(1000), tvm=tvm)
        group("typed arguments and results, torch (1000 f32)", {
            NOOP + " ": "D.noop(x)",
            "dlbridge: owned import (ManagedTensor), torch ": "D.import_ptr(x)",
            "dlbridge: borrowed view (TensorView), torch ": "D.view_ptr(x)",
            "dlbridge: typed argument (TensorRef<f32>), torch": "D.typed_ptr(x)",
            # The view targets compare with dlpark's view in this group, where the typed argument
            # is measured too: a ratio's two sides always come from one group (interleaved, the
            # same conditions). Across groups a load on the machine during one of them skews it.
            "dlpark 0.10: borrowed view, torch ": "K.view_ptr(x)" if K and hasattr(K, "view_ptr") else None,
            PTR_FLOOR + ", torch ": "D.ptr_floor(x)",
            "floor: torch's own borrowed DLTensor, no validation ": "D.torch_floor_view(x)",
            "dlbridge: empty body, three typed torch tensors": "D.typed3(x, y, z)",
        }, n_slow)
        group("results in torch", {
            "torch.empty_like(x)": "torch.empty_like(x)",
            "dlbridge: f(x) returning empty_like(x), torch": "D.empty_like(x)",
            "dlbridge: a Rust-made 1e3 f32 tensor returned as torch.Tensor": "D.rust_made_torch(1000)",
            "torch.from_dlpack(dlbridge.Tensor made in Rust, 1e3 f32)": "torch.from_dlpack(D.export_fresh(1000))",
        }, n_slow)
        group("against tvm-ffi: a function taking a torch tensor and returning it", {
            "tvm-ffi: identity(x) (load_inline)": "tvm(x)" if tvm else None,
            "dlbridge: identity(x) (typed argument, the caller's object back)": "D.identity(x)",
            "dlbridge: round trip (owned import, a new torch.Tensor back)": "D.round_trip(x)",
        }, n_slow)
        imp = results.get("dlbridge: owned import (ManagedTensor), torch ")
        nop = results.get(NOOP + " ")
        if imp and nop:
            ref = 3 * (imp["median"] - nop["median"]) + nop["median"]
            results[THREE_IMPORTS] = {"median": ref, "min": ref, "max": ref}

    group("asdlpack against pydlpack (numpy consumer)", {
        "numpy.from_dlpack(dlbridge.asdlpack(a))": "np.from_dlpack(dlbridge.asdlpack(a))",
        "numpy.from_dlpack(pydlpack asdlpack(a))": "np.from_dlpack(pydlpack.asdlpack(a))" if pydlpack else None,
    }, n_slow // 2)

    sizes = [10**k for k in range(3, 9)]
    sweep = size_sweep(np, dlbridge, D, torch, sizes, scale)
    memory = peak_memory()
    counts = {} if args.no_callgrind else callgrind_counts()
    targets = evaluate(results, sweep, memory)
    import bench_processes  # tensors to other processes (issue 23): bench/bench_processes.py

    targets += bench_processes.run(quick=args.quick)[1]
    import bench_modes  # one Rust kernel eagerly, in jax.jit, in torch.compile (issue 22): bench/bench_modes.py

    targets += bench_modes.run(quick=args.quick)[1]
    import bench_nanobind  # the README's argument and result paths against nanobind (issue 31): bench/bench_nanobind.py

    nb_results, nb_targets = bench_nanobind.run(quick=args.quick)
    results.update(nb_results)
    targets += nb_targets

    print("\n== targets")
    for tg in targets:
        print(f"  {'PASS' if tg['pass'] else 'FAIL'}  {tg['name']}: {tg['detail']}")
    if missing:
        print(f"\n  (not installed, so their rows and targets are absent: {', '.join(missing)})")
    write_report(Path(args.out), results, sweep, memory, counts, targets, missing, sizes)
    return 0


def size_sweep(np, dlbridge, D, torch, sizes, scale) -> dict[str, dict[int, float]]:
    """Per-call cost against element count. Zero-copy paths: every (path, size) pair is timed in
    one interleaved group with the same number of calls, so sizes are compared under the same
    machine conditions. The copying path, for contrast, is timed size by size with fewer calls."""
    print("\n== per-call cost against size (float32 elements)", flush=True)
    env = {"np": np, "dlbridge": dlbridge, "D": D, "torch": torch}
    zero_copy: dict[str, str] = {}
    for n in sizes:
        env[f"arr{n}"] = np.zeros(n, dtype=np.float32)
        env[f"t{n}"] = dlbridge.from_dlpack(env[f"arr{n}"])
        D.export_shared(n)  # made once, outside the timing
        zero_copy[f"Rust buffer -> numpy.from_dlpack (zero-copy)@{n}"] = f"np.from_dlpack(D.export_shared({n}))"
        zero_copy[f"numpy -> Rust owned import (zero-copy)@{n}"] = f"D.import_ptr(arr{n})"
        zero_copy[f"numpy -> dlbridge.from_dlpack (zero-copy)@{n}"] = f"dlbridge.from_dlpack(arr{n})"
        if torch is not None:
            zero_copy[f"Rust buffer -> torch.from_dlpack (zero-copy)@{n}"] = f"torch.from_dlpack(D.export_shared({n}))"
    out: dict[str, dict[int, float]] = {}
    for key, v in measure_group(zero_copy, env, max(200, int(5_000 * scale)), repeats=7).items():
        path, n = key.rsplit("@", 1)
        out.setdefault(path, {})[int(n)] = v["median"]
    for n in sizes:
        r = measure_group({"c": f"np.from_dlpack(t{n}, copy=True)"}, env, max(2, min(5_000, int(2e8 * scale / n))), repeats=5)
        out.setdefault("Tensor -> numpy.from_dlpack(copy=True) (copies)", {})[n] = r["c"]["median"]
    for path, by_size in out.items():
        print(f"  {path:<52} " + "  ".join(f"{n:.0e}:{v:.0f}" for n, v in sorted(by_size.items())), flush=True)
    return out


MEMORY_CHILD = r"""
import os, sys, json
import numpy as np
import dlbridge_bench as D

def hwm():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024
import re
consumer = sys.argv[1]
n = 10**8
t = D.export_fresh_aligned(n)            # 400 MB made in Rust, 256-byte aligned
if consumer == "torch":
    import torch
elif consumer == "jax":
    import jax, jax.numpy as jnp
    jax.config.update("jax_enable_x64", True)
# Warm the consumer up on a small tensor first (jax initialises its backend on first use).
small = D.export_fresh_aligned(1000)
if consumer == "numpy":
    np.from_dlpack(small)
elif consumer == "torch":
    torch.from_dlpack(small)
else:
    jnp.from_dlpack(small).block_until_ready()
open("/proc/self/clear_refs", "w").write("5")   # reset the peak (VmHWM) to the current RSS
before = hwm()
if consumer == "numpy":
    y = np.from_dlpack(t); ptr = y.ctypes.data
elif consumer == "torch":
    y = torch.from_dlpack(t); ptr = y.data_ptr()
else:
    y = jnp.from_dlpack(t); ptr = y.unsafe_buffer_pointer()
print(json.dumps({"peak_beyond_buffer": hwm() - before, "zero_copy": ptr == t.data_ptr}))
"""


def peak_memory() -> dict[str, dict]:
    print("\n== peak memory beyond the buffer, 1e8 float32 made in Rust", flush=True)
    out = {}
    for consumer in ["numpy", "torch", "jax"]:
        if optional(consumer) is None:
            continue
        r = subprocess.run([sys.executable, "-c", MEMORY_CHILD, consumer], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            out[consumer] = {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"rc {r.returncode}"}
        else:
            out[consumer] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"  {consumer:<6} {out[consumer]}", flush=True)
    return out


CALLGRIND_CHILD = r"""
import sys
import numpy as np, dlbridge, dlbridge_bench as D
a = np.arange(1000, dtype=np.float32)
t = dlbridge.from_dlpack(a)
case, n = sys.argv[1], int(sys.argv[2])
f = {"import": lambda: D.import_ptr(a), "view": lambda: D.view_ptr(a),
     "from_dlpack": lambda: dlbridge.from_dlpack(a), "export": lambda: np.from_dlpack(t),
     "numpy": lambda: np.from_dlpack(a)}[case]
import gc
gc.disable()          # no collection at a run-dependent moment
for _ in range(2000):  # warm-up: caches, free lists, the numpy verification
    f()
for _ in range(n):
    f()
"""


def callgrind_counts() -> dict[str, float]:
    """Instructions per call: (Ir at N2 - Ir at N1) / (N2 - N1), so startup cancels out."""
    if subprocess.run(["which", "valgrind"], capture_output=True).returncode != 0:
        print("\n== callgrind: valgrind not installed, skipped")
        return {}
    print("\n== instructions per call (callgrind)", flush=True)
    out = {}
    n1, n2 = 2000, 12000
    # Deterministic start-up, so it cancels out: a fixed hash seed, and one BLAS thread (OpenBLAS
    # worker threads spin a run-dependent number of instructions under valgrind).
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as d:
        for case in ["numpy", "import", "view", "from_dlpack", "export"]:
            irs = []
            for n in (n1, n2):
                f = Path(d) / f"cg.{case}.{n}"
                subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={f}", sys.executable, "-c", CALLGRIND_CHILD, case, str(n)],
                               capture_output=True, text=True, timeout=900, env=env)
                m = re.search(r"^summary:\s+(\d+)", f.read_text(), re.M) if f.exists() else None
                irs.append(int(m.group(1)) if m else None)
            if None not in irs:
                out[case] = (irs[1] - irs[0]) / (n2 - n1)
                print(f"  {case:<12} {out[case]:10.0f} instructions/call", flush=True)
    return out


def ratio(results, a, b):
    if a in results and b in results:
        return results[a]["median"] / results[b]["median"]
    return None


def evaluate(results, sweep, memory) -> list[dict]:
    checks = [
        ("numpy import into Rust <= 1.0 x numpy.from_dlpack", "dlbridge: owned import (ManagedTensor)", "numpy.from_dlpack(numpy array)", 1.0),
        ("numpy import into Rust <= 0.35 x pyo3-dlpack import", "dlbridge: owned import (ManagedTensor)", "pyo3-dlpack 0.3: import", 0.35),
        ("torch import into Rust <= 0.8 x dlpark import", "dlbridge: owned import (ManagedTensor), torch", "dlpark 0.10: import, torch", 0.8),
        ("torch import into Rust <= 0.1 x pyo3-dlpack import", "dlbridge: owned import (ManagedTensor), torch", "pyo3-dlpack 0.3: import, torch", 0.1),
        ("borrowed view of a numpy array <= 0.8 x owned import", "dlbridge: borrowed view (TensorView)", "dlbridge: owned import (ManagedTensor)", 0.8),
        ("borrowed view of a numpy array <= 2.2 x the call floor", "dlbridge: borrowed view (TensorView)", PTR_FLOOR, 2.2),
        ("borrowed view of a torch tensor <= 0.8 x dlpark's view", "dlbridge: borrowed view (TensorView), torch ", "dlpark 0.10: borrowed view, torch ", 0.8),
        ("typed torch argument (borrowed view) <= 0.8 x dlpark's view", "dlbridge: typed argument (TensorRef<f32>), torch", "dlpark 0.10: borrowed view, torch ", 0.8),
        ("dlbridge.from_dlpack(numpy) <= 1.2 x numpy.from_dlpack(numpy)", "dlbridge.from_dlpack(numpy array)", "numpy.from_dlpack(numpy array) ", 1.2),
        ("numpy.from_dlpack(Tensor) <= 1.5 x numpy.from_dlpack(numpy)", "numpy.from_dlpack(dlbridge.Tensor)", "numpy.from_dlpack(numpy array) ", 1.5),
        ("torch.from_dlpack(Tensor) <= 1.0 x torch.from_dlpack(numpy)", "torch.from_dlpack(dlbridge.Tensor)", "torch.from_dlpack(numpy array)", 1.0),
        ("numpy.from_dlpack(asdlpack(a)) <= 0.013 x pydlpack's", "numpy.from_dlpack(dlbridge.asdlpack(a))", "numpy.from_dlpack(pydlpack asdlpack(a))", 0.013),
        ("typed argument conversion <= 1.1 x untyped view, numpy", "dlbridge: typed argument (TensorRef<f32>), numpy", "dlbridge: borrowed view (TensorView), numpy ", 1.1),
        ("typed argument conversion <= 1.1 x untyped view, torch", "dlbridge: typed argument (TensorRef<f32>), torch", "dlbridge: borrowed view (TensorView), torch ", 1.1),
        ("empty body, three typed torch tensors <= 1.1 x three owned imports + one call", "dlbridge: empty body, three typed torch tensors", THREE_IMPORTS, 1.1),
        ("f(x) returning empty_like(x) as torch.Tensor <= 1.2 x torch.empty_like(x)", "dlbridge: f(x) returning empty_like(x), torch", "torch.empty_like(x)", 1.2),
        ("f(a) returning empty_like(a) as numpy.ndarray <= 1.2 x numpy.empty_like(a)", "dlbridge: f(a) returning empty_like(a), numpy", "numpy.empty_like(a)", 1.2),
        ("a Rust-made 1e3 tensor to torch <= 0.5 x torch.from_dlpack(dlbridge.Tensor)", "dlbridge: a Rust-made 1e3 f32 tensor returned as torch.Tensor", "torch.from_dlpack(dlbridge.Tensor made in Rust, 1e3 f32)", 0.5),
        ("identity(torch tensor) <= 1.0 x tvm-ffi's", "dlbridge: identity(x) (typed argument, the caller's object back)", "tvm-ffi: identity(x) (load_inline)", 1.0),
        ("round trip (new torch.Tensor back) <= 1.0 x tvm-ffi's identity", "dlbridge: round trip (owned import, a new torch.Tensor back)", "tvm-ffi: identity(x) (load_inline)", 1.0),
    ]
    out = []
    for name, num, den, limit in checks:
        r = ratio(results, num, den)
        if r is None:
            continue
        detail = f"{r:.3f} ({results[num]['median']:.0f} / {results[den]['median']:.0f} ns)"
        extra = context(name, results, num, den)
        out.append({"name": name, "pass": r <= limit, "detail": detail + (f"; {extra}" if extra else "")})
    for path, by_size in sweep.items():
        if "zero-copy" not in path or 10**8 not in by_size:
            continue
        r = by_size[10**8] / by_size[10**3]
        out.append({"name": f"1e8 <= 1.2 x 1e3: {path}", "pass": r <= 1.2, "detail": f"{r:.2f} ({by_size[10**8]:.0f} / {by_size[10**3]:.0f} ns)"})
    for consumer, m in memory.items():
        if "error" in m:
            out.append({"name": f"peak memory, 1e8 f32 from Rust into {consumer} <= 2 MiB", "pass": False, "detail": m["error"]})
            continue
        mib = m["peak_beyond_buffer"] / 2**20
        out.append({"name": f"peak memory, 1e8 f32 from Rust into {consumer} <= 2 MiB", "pass": mib <= 2 and m["zero_copy"],
                    "detail": f"{fmt_mib(m['peak_beyond_buffer'])}, zero-copy {m['zero_copy']}"})
    return out


def fmt_mib(n: int) -> str:
    """Bytes as MiB; a peak a few KiB under the baseline (allocator noise) prints 0.00, not -0.00."""
    v = n / 2**20
    return f"{0.0 if abs(v) < 0.005 else v:.2f} MiB"


def context(name: str, results, num: str, den: str) -> str:
    """What bounds a ratio from below, measured in the same run (context, never the verdict)."""
    med = lambda k: results[k]["median"] if k in results else None  # noqa: E731
    if "borrowed view" in name:
        torch_case = "torch" in name
        parts = []
        sfx = " " if den.endswith(" ") else ""  # the floors measured in the same group as `den`
        pf = med(PTR_FLOOR + (", torch" if torch_case else "") + sfx)
        if pf:
            parts.append(f"a view costing nothing (a function returning the address: {pf:.0f} ns) would be {pf / med(den):.3f}x")
        tv = med("floor: torch's own borrowed DLTensor, no validation" + sfx)
        if torch_case and tv:
            parts.append(f"torch's own borrowed DLTensor alone {tv / med(den):.3f}x")
        return "; ".join(parts)
    if "dlpark" in name and med("floor: torch's own exchange export + deleter, no validation"):
        f = med("floor: torch's own exchange export + deleter, no validation")
        v = med("floor: torch's own borrowed DLTensor, no validation")
        return f"torch's own functions alone: owning export {f / med(den):.3f}x, borrowed DLTensor {v / med(den):.3f}x of dlpark"
    if "asdlpack" in name and med("numpy.from_dlpack(dlbridge.Tensor)"):
        return f"numpy.from_dlpack(Tensor) alone is {med('numpy.from_dlpack(dlbridge.Tensor)') / med(den):.4f}x, numpy.from_dlpack(numpy) {med('numpy.from_dlpack(numpy array) ') / med(den):.4f}x"
    return ""


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    v = {"python": platform.python_version()}
    for dist in ["numpy", "torch", "jax", "pydlpack", "nanobind", "dlbridge"]:
        try:
            v[dist] = version(dist)
        except PackageNotFoundError:
            pass
    v["pyo3-dlpack"] = "0.3 (bench/shim-pyo3-dlpack, pyo3 0.28)"
    v["dlpark"] = "0.10 (bench/shim-dlpark, pyo3 0.30)"
    v["dlbridge shim"] = "bench/shim-dlbridge (pyo3 0.30)"
    return v


def machine() -> str:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except Exception:
        pass
    return f"{os.cpu_count()} cores, {cpu or platform.processor()}, {platform.system()} {platform.release()}"


def write_report(out: Path, results, sweep, memory, counts, targets, missing, sizes) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# dlbridge benchmarks",
        "",
        f"Generated by `make bench` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. "
        "Medians of 7 interleaved repeats in one process run ([min..max] shown); only ratios within one run are "
        "meaningful (this machine swings 2x between runs). Reproduce with `make bench`.",
        "",
        f"Machine: {machine()}.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()) + ".",
        "",
        "## Targets",
        "",
        "| target | result | ratio |",
        "|---|---|---|",
    ]
    lines += [f"| {t['name']} | {'PASS' if t['pass'] else '**FAIL**'} | {t['detail']} |" for t in targets]
    lines += ["", "The numpy borrowed-view targets compare a view with dlbridge's own owned import, which already skips "
              "the capsule (the array struct read directly), and with the call floor (a function that only returns "
              "its argument's address). The torch view is compared with dlpark's view: torch's exchange table looked up "
              "once per type, its borrowed DLTensor asked through dlpark's public call for it (`with_tensor_view_no_sync`, "
              "which also asks the table's current_work_stream) and nothing checked. dlbridge's view of exactly "
              "torch.Tensor reads the description through torch's stable accessors instead of that table and checks "
              "torch's negative and conjugate bits, requires_grad and grad mode, and keeps the memory valid "
              "(see python/import/torch_bits.rs). The third column gives the floors measured in this run."]
    if missing:
        lines += ["", f"Not installed during this run (their rows and targets are absent): {', '.join(missing)}."]
    lines += ["", "## Per-call cost", "", "| case | median ns | [min..max] |", "|---|---:|---|"]
    lines += [f"| {k} | {v['median']:.0f} | [{v['min']:.0f}..{v['max']:.0f}] |" for k, v in results.items()]
    if counts:
        lines += ["", "## Instructions per call (callgrind, repeatable)", "",
                  "| path | instructions/call |", "|---|---:|"]
        names = {"numpy": "numpy.from_dlpack(numpy array) (reference)", "import": "numpy array -> Rust, owned import",
                 "view": "numpy array -> Rust, borrowed view", "from_dlpack": "dlbridge.from_dlpack(numpy array)",
                 "export": "numpy.from_dlpack(dlbridge.Tensor)"}
        lines += [f"| {names[k]} | {v:.0f} |" for k, v in counts.items()]
    crit = ROOT / "bench/rust-core/target/criterion.txt"
    if crit.exists():
        rows = re.findall(r"^(\S+)\s*\n?\s*time:\s+\[([^\]]+)\]", crit.read_text(), re.M)
        if rows:
            lines += ["", "## Rust core (criterion, no Python)", "", "| benchmark | time [low median high] |", "|---|---|"]
            lines += [f"| {name} | {t} |" for name, t in rows]
    lines += ["", "## Cost against size", "", "![per-call cost against size](bench_sizes.png)", "",
              "| path | " + " | ".join(f"{n:.0e}" for n in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    lines += [f"| {p} | " + " | ".join(f"{v.get(n, float('nan')):.0f}" for n in sizes) + " |" for p, v in sweep.items()]
    lines += ["", "## Peak memory beyond the buffer (1e8 float32 made in Rust)", "", "| consumer | peak beyond buffer | zero-copy |", "|---|---:|---|"]
    for c, m in memory.items():
        lines.append(f"| {c} | {fmt_mib(m['peak_beyond_buffer'])} | {m['zero_copy']} |" if "error" not in m else f"| {c} | error: {m['error']} | |")
    (out / "BENCHMARKS.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for path, by_size in sweep.items():
            xs = sorted(by_size)
            ax.plot(xs, [by_size[n] / 1000 for n in xs], marker="o", linestyle="-" if "zero-copy" in path else "--", label=path)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (float32 elements)")
        ax.set_ylabel("per-call cost (µs, median)")
        ax.set_title("dlbridge: zero-copy paths stay flat, copying grows with size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "bench_sizes.png", dpi=110)
    except Exception as e:  # the report stays useful without the plot
        print(f"  (plot not written: {e})")
    print(f"\nwrote {out / 'BENCHMARKS.md'}")


if __name__ == "__main__":
    sys.exit(main())
