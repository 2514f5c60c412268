"""Against nanobind, the C++ anchor for tensor arguments and results (issue 31): the README's
argument and result paths in dlbridge (bench/shim-dlbridge) against the same functions written
with nanobind (bench/shim-nanobind, built with the system C++ compiler at -O3 against nanobind
from PyPI, into target/bench-nanobind). Part of `make bench`; runnable alone once the dlbridge
shim is installed (`python bench/bench_nanobind.py [--quick]`; it builds the nanobind shim if
needed).

Each target is the median of paired ratios: every repeat times the dlbridge case and its
nanobind twin back to back (their order alternating), in the same process, and takes their
ratio; the pairs of a run are interleaved too. A load swing then falls on both halves of a pair,
and the median drops the repeats it hit in the middle of one.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIM_DIR = ROOT / "target" / "bench-nanobind"
REPEATS = 201

NB_NOOP = "nanobind: trivial function (floor)"
DL_NOOP = "dlbridge shim: trivial PyO3 function (floor)"

# (target, dlbridge case, its statement, nanobind case, its statement, limit, needs torch, slow)
PAIRS = [
    ("numpy argument, read-only, <= 0.7 x nanobind",
     "dlbridge: TensorRef<f32, Rank<1>, C> argument, numpy", "D.arg_ref_1c(a)",
     "nanobind: ndarray<const float, ndim<1>, c_contig, cpu> argument, numpy", "N.arg_ref_1c(a)", 0.7, False, False),
    ("numpy argument, writable, <= 0.9 x nanobind",
     "dlbridge: TensorMut<f32, Rank<1>, C> argument, numpy", "D.arg_mut_1c(a)",
     "nanobind: ndarray<float, ndim<1>, c_contig, cpu> argument, numpy", "N.arg_mut_1c(a)", 0.9, False, False),
    ("numpy result, 1e3 f32 (Framework::numpy(py)?.from_vec), <= 0.6 x nanobind",
     "dlbridge: Framework::numpy(py)?.from_vec(vec![0f32; 1000])", "D.numpy_from_vec(1000)",
     "nanobind: ndarray<numpy, float>(new float[1000](), capsule)", "N.numpy_from_vec(1000)", 0.6, False, False),
    ("torch argument, read-only, <= 0.12 x nanobind",
     "dlbridge: TensorRef<f32, Rank<1>, C> argument, torch", "D.arg_ref_1c(x)",
     "nanobind: ndarray<const float, ndim<1>, c_contig, cpu> argument, torch", "N.arg_ref_1c(x)", 0.12, True, True),
    ("torch argument, writable, <= 0.12 x nanobind",
     "dlbridge: TensorMut<f32, Rank<1>, C> argument, torch", "D.arg_mut_1c(x)",
     "nanobind: ndarray<float, ndim<1>, c_contig, cpu> argument, torch", "N.arg_mut_1c(x)", 0.12, True, True),
    ("torch result, 1e3 f32 (Framework::torch(py)?.from_vec), <= 0.7 x nanobind",
     "dlbridge: Framework::torch(py)?.from_vec(vec![0f32; 1000])", "D.torch_from_vec(1000)",
     "nanobind: ndarray<pytorch, float>(new float[1000](), capsule)", "N.torch_from_vec(1000)", 0.7, True, True),
]


def load_shim():
    """The nanobind shim, built first if it is missing or stale (bench/shim-nanobind/build.py)."""
    spec = importlib.util.spec_from_file_location("shim_nanobind_build", ROOT / "bench" / "shim-nanobind" / "build.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    sys.path.insert(0, str(builder.build(SHIM_DIR)))
    import nanobind
    import shim_nanobind

    return shim_nanobind, nanobind.__version__


def paired(pairs: list[tuple[str, str, str, str, int]], env: dict, repeats: int) -> dict[str, dict]:
    """Per pair (key, stmt_a, stmt_b, ...): the median of the per-repeat ratios a/b and each side's
    ns per call (median, min, max). Every repeat visits every pair (from a rotating start), and
    within a pair alternates which side runs first."""
    timers = {key: (timeit.Timer(sa, globals=env), timeit.Timer(sb, globals=env), n) for key, sa, sb, n in pairs}
    for ta, tb, n in timers.values():  # warm up
        ta.timeit(max(1, n // 10))
        tb.timeit(max(1, n // 10))
    ratios: dict[str, list[float]] = {k: [] for k in timers}
    ns: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in timers}
    keys = list(timers)
    for r in range(repeats):
        k0 = r % len(keys)
        for key in keys[k0:] + keys[:k0]:
            ta, tb, n = timers[key]
            if r % 2:
                b = tb.timeit(n) / n
                a = ta.timeit(n) / n
            else:
                a = ta.timeit(n) / n
                b = tb.timeit(n) / n
            ratios[key].append(a / b)
            ns[key][0].append(a * 1e9)
            ns[key][1].append(b * 1e9)
    stat = lambda s: {"median": statistics.median(s), "min": min(s), "max": max(s)}  # noqa: E731
    return {k: {"ratio": statistics.median(ratios[k]), "a": stat(ns[k][0]), "b": stat(ns[k][1])} for k in keys}


def run(quick: bool = False) -> tuple[dict[str, dict], list[dict]]:
    """Every case (ns per call: median, min, max over the repeats) and every target."""
    print("\n== against nanobind (C++): the README's argument and result paths (medians of paired ratios)", flush=True)
    try:
        N, nb_version = load_shim()
    except Exception as e:  # a missing anchor is a visible failure, never an absent target
        print(f"  nanobind shim not available: {e}", flush=True)
        return {}, [{"name": "against nanobind: the nanobind shim builds and loads", "pass": False, "detail": str(e)}]
    import numpy as np

    import dlbridge_bench as D

    try:
        import torch
    except ImportError:
        torch = None
    env = {"D": D, "N": N, "a": np.arange(1000, dtype=np.float32),
           "x": torch.arange(1000, dtype=torch.float32) if torch else None}
    scale = 0.1 if quick else 1.0
    n_fast, n_slow = max(100, int(2_000 * scale)), max(50, int(400 * scale))
    live = [p for p in PAIRS if torch or not p[6]]
    todo = [(p[0], p[2], p[4], n_slow if p[7] else n_fast) for p in live]
    todo.append(("floor", "D.noop(a)", "N.noop(a)", n_fast))
    repeats = 21 if quick else REPEATS
    r = paired(todo, env, repeats)

    nb = f"nanobind {nb_version}"
    results: dict[str, dict] = {DL_NOOP: r["floor"]["a"], NB_NOOP.replace("nanobind", nb): r["floor"]["b"]}
    targets = []
    floor_a, floor_b = r["floor"]["a"]["median"], r["floor"]["b"]["median"]
    for name, dl_case, _, nb_case, _, limit, _, _ in live:
        v = r[name]
        nb_case = nb_case.replace("nanobind", nb, 1)
        results[dl_case] = v["a"]
        results[nb_case] = v["b"]
        targets.append({
            "name": name.replace("nanobind", nb),
            "pass": v["ratio"] <= limit,
            "detail": f"{v['ratio']:.3f} (median of {repeats} paired ratios; "
                      f"medians {v['a']['median']:.0f} / {v['b']['median']:.0f} ns; above each binder's "
                      f"call floor {v['a']['median'] - floor_a:.0f} / {v['b']['median'] - floor_b:.0f} ns)",
        })
    for name, v in results.items():
        print(f"  {name:<72} {v['median']:9.0f} ns  [{v['min']:.0f}..{v['max']:.0f}]", flush=True)
    return results, targets


if __name__ == "__main__":
    _, targets = run(quick="--quick" in sys.argv)
    print("\n== targets (against nanobind)")
    for tg in targets:
        print(f"  {'PASS' if tg['pass'] else 'FAIL'}  {tg['name']}: {tg['detail']}")
    sys.exit(0)
