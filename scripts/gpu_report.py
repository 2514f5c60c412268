"""The GPU bundle's reporting (scripts/gpu_bundle.sh copies this file next to run.sh).

Three uses:
  pytest -p gpu_report ...          a pytest plugin: each test's outcome, whether it is marked `gpu`,
                                    and why it was skipped or failed, one JSON line per test in the
                                    file DLBRIDGE_GPU_REPORT names, written as each test ends (a step
                                    killed by its timeout keeps what ran)
  python gpu_report.py probe        which libraries import, what the CUDA device is, and which of
                                    dlbridge's fast paths are active, through dlbridge's public
                                    behaviour and, where the wheel has them, its test hooks: JSON
  python gpu_report.py summarize OUT WORK
                                    OUT/summary.md, OUT/summary.json and OUT/failures.txt from the
                                    steps run.sh recorded in WORK (steps.tsv, logs/*.jsonl, probes)
Only the standard library is needed for `summarize`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any

# --- pytest plugin -------------------------------------------------------------------------------

try:  # pytest-xdist's hooks are optional: the plugin runs without xdist too
    import pytest

    _optional_hook = pytest.hookimpl(optionalhook=True)
except ImportError:  # `summarize` needs only the standard library
    def _optional_hook(f):  # noqa: ANN001, ANN202
        return f

_results: dict[str, dict] = {}
_state = {"worker": False}


def _write(record: dict) -> None:
    path = os.environ.get("DLBRIDGE_GPU_REPORT")
    if not path or _state["worker"]:  # under pytest-xdist the controller writes, once
        return
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest hook
    _state["worker"] = hasattr(config, "workerinput")


def pytest_collection_finish(session) -> None:  # noqa: ANN001 - pytest hook (not under xdist's controller)
    gpu = sum(item.get_closest_marker("gpu") is not None for item in session.items)
    _write({"event": "collected", "n": len(session.items), "gpu": gpu})


@_optional_hook
def pytest_xdist_node_collection_finished(node, ids) -> None:  # noqa: ANN001 - pytest-xdist hook
    if not _state.get("collected"):  # every worker collects the same tests
        _state["collected"] = True
        _write({"event": "collected", "n": len(ids), "gpu": None})


def _reason(report) -> str:  # noqa: ANN001
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    text = getattr(report, "longreprtext", "") or ""
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")]
    return (lines[0][1:].strip() if lines else text.strip().splitlines()[-1] if text.strip() else "")[:300]


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 - pytest hook
    r = _results.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": None, "reason": "",
                                            "duration": 0.0, "longrepr": ""})
    r["duration"] += report.duration
    xfail = hasattr(report, "wasxfail")
    if report.when == "setup":
        if report.failed:
            r.update(outcome="error", reason=_reason(report), longrepr=report.longreprtext[-6000:])
        elif report.skipped:
            r.update(outcome="xfailed" if xfail else "skipped", reason=_reason(report) if not xfail else report.wasxfail)
    elif report.when == "call":
        if xfail:
            r.update(outcome="xfailed" if report.skipped else "xpassed", reason=report.wasxfail)
        elif report.failed:
            r.update(outcome="failed", reason=_reason(report), longrepr=report.longreprtext[-6000:])
        elif report.skipped:
            r.update(outcome="skipped", reason=_reason(report))
        else:
            r["outcome"] = "passed"
    else:  # teardown: the test's result is complete
        if report.failed:
            r.update(outcome="error", reason="teardown: " + _reason(report),
                     longrepr=(r["longrepr"] + "\n--- teardown ---\n" + report.longreprtext)[-6000:])
        r["gpu"] = "gpu" in report.keywords  # the marker's name (also in a report sent by an xdist worker)
        r["duration"] = round(r["duration"], 3)
        if r["outcome"] is None:
            r["outcome"] = "error"
        _write(r)
        del _results[report.nodeid]


# --- probe ---------------------------------------------------------------------------------------

# Every library the shipped suite and the example tests import (their tests skip without it).
LIBRARIES = ["numpy", "torch", "jax", "jaxlib", "cupy", "numba", "numba.cuda", "ml_dtypes", "pyarrow",
             "tensorflow", "array_api_strict", "tvm_ffi", "ray"]
# What runs the tests (not missing libraries when absent: run.sh does without the last two).
TOOLS = ["pytest", "pytest_timeout", "xdist"]


def probe() -> dict:
    import importlib

    out: dict = {"python": sys.version.split()[0], "executable": sys.executable, "libraries": {}, "missing": [],
                 "checks": []}

    def check(name: str, f) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        try:
            ok, detail = f()
            ok = None if ok is None else bool(ok)
        except Exception as e:  # noqa: BLE001 - reported, the probe goes on
            ok, detail = False, f"{type(e).__name__}: {e}"[:400]
        out["checks"].append({"name": name, "ok": ok, "detail": str(detail)[:400],
                              "seconds": round(time.perf_counter() - t0, 3)})

    mods = {}
    for name in LIBRARIES + TOOLS:
        try:
            m = importlib.import_module(name)
            mods[name] = m
            out["libraries"][name] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            if name in LIBRARIES:
                out["missing"].append(name)
            out["libraries"][name] = None
            out.setdefault("import_errors", {})[name] = f"{type(e).__name__}: {e}"[:200]

    import dlbridge

    D: Any = dlbridge._dlbridge  # the hooks are not in its stubs
    hooks = hasattr(D, "_view")
    out["dlbridge"] = {"version": dlbridge.__version__, "file": dlbridge.__file__, "test_hooks": hooks}
    np, torch, cupy, jax = (mods.get(k) for k in ("numpy", "torch", "cupy", "jax"))
    cuda = bool(torch is not None and torch.cuda.is_available())
    out["cuda"] = {"torch.cuda.is_available": cuda}
    if torch is not None:
        out["cuda"]["torch.version.cuda"] = torch.version.cuda
        if cuda:
            out["cuda"]["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if jax is not None:
        try:
            out["cuda"]["jax devices"] = [str(d) for d in jax.devices()]
        except Exception as e:  # noqa: BLE001
            out["cuda"]["jax devices"] = f"{type(e).__name__}: {e}"[:200]
    if cupy is not None:
        try:
            out["cuda"]["cupy devices"] = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001
            out["cuda"]["cupy devices"] = f"{type(e).__name__}: {e}"[:200]
    if "numba.cuda" in mods:
        try:
            out["cuda"]["numba.cuda.is_available"] = bool(mods["numba.cuda"].is_available())
        except Exception as e:  # noqa: BLE001
            out["cuda"]["numba.cuda.is_available"] = f"{type(e).__name__}: {e}"[:200]

    # Public behaviour (any wheel): zero-copy both ways, proven by data pointers.
    if np is not None:
        def numpy_round_trip():
            a = np.arange(12, dtype=np.float32).reshape(3, 4)
            t = dlbridge.from_dlpack(a)
            b = np.from_dlpack(t)
            b[0, 0] = 42
            return t.data_ptr == a.ctypes.data == b.ctypes.data and a[0, 0] == 42, "numpy -> dlbridge -> numpy, same memory"
        check("numpy zero-copy round trip", numpy_round_trip)
    if torch is not None:
        def torch_cpu():
            x = torch.arange(6, dtype=torch.float32)
            t = dlbridge.from_dlpack(x)
            return t.data_ptr == x.data_ptr() and torch.from_dlpack(t).data_ptr() == x.data_ptr(), "same memory"
        check("torch (cpu) zero-copy round trip", torch_cpu)
    if cuda:
        def torch_cuda():
            x = torch.arange(8, dtype=torch.float32, device="cuda")
            t = dlbridge.from_dlpack(x)
            y = torch.from_dlpack(t)
            y[0] = 42
            torch.cuda.synchronize()
            ok = t.data_ptr == x.data_ptr() == y.data_ptr() and x[0].item() == 42 and str(t.device) == f"cuda:{x.device.index}"
            return ok, f"{t.device}, pointer {t.data_ptr:#x} == {x.data_ptr():#x}, write seen: {x[0].item() == 42}"
        check("torch.cuda zero-copy round trip (from_dlpack)", torch_cuda)

        def torch_cuda_asdlpack():
            x = torch.arange(8, dtype=torch.float32, device="cuda")
            t = dlbridge.asdlpack(x)
            return t.data_ptr == x.data_ptr() and torch.from_dlpack(t).data_ptr() == x.data_ptr(), str(t.device)
        check("torch.cuda asdlpack", torch_cuda_asdlpack)

        def cai():
            x = torch.arange(8, dtype=torch.float32, device="cuda")
            holder = type("C", (), {"__cuda_array_interface__": x.__cuda_array_interface__, "x": x})()
            t = dlbridge.asdlpack(holder)
            return t.data_ptr == x.data_ptr(), f"{t.device} (the device ordinal comes from the driver)"
        check("__cuda_array_interface__ import (driver pointer lookup)", cai)

        def driver_by_share():
            import pickle
            x = torch.ones(4, device="cuda")
            data = pickle.dumps(dlbridge.share(x))
            return True, f"share() made a CUDA IPC handle ({len(data)} bytes of pickle)"
        check("CUDA driver loaded (share of a torch.cuda tensor)", driver_by_share)
    if cupy is not None and cuda:
        def cupy_cuda():
            a = cupy.arange(8, dtype=cupy.float32)
            t = dlbridge.from_dlpack(a)
            c = cupy.from_dlpack(t)
            return t.data_ptr == a.data.ptr == c.data.ptr, str(t.device)
        check("cupy zero-copy round trip", cupy_cuda)
    if jax is not None:
        def jax_gpu():
            gpus = [d for d in jax.devices() if d.platform == "gpu"]
            if not gpus:
                return None, "jax has no GPU"
            x = jax.device_put(jax.numpy.arange(8.0), gpus[0])
            t = dlbridge.from_dlpack(x)
            return t.data_ptr == x.unsafe_buffer_pointer(), str(t.device)
        check("jax (cuda) zero-copy import", jax_gpu)

    # Exchange tables: which types publish one (DLPack 1.3's capsule) and its version.
    import ctypes

    def table_version(ty) -> str | None:  # noqa: ANN001
        cap = getattr(ty, "__dlpack_c_exchange_api__", None)
        if cap is None:
            return None
        valid = ctypes.pythonapi.PyCapsule_IsValid
        valid.restype, valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
        if not valid(cap, b"dlpack_exchange_api"):
            return f"not a 'dlpack_exchange_api' capsule: {type(cap).__name__}"
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        major, minor = (ctypes.c_uint32 * 2).from_address(get(cap, b"dlpack_exchange_api"))
        return f"{major}.{minor}"

    types = {"dlbridge.Tensor": dlbridge.Tensor}
    if np is not None:
        types["numpy.ndarray"] = np.ndarray
    if torch is not None:
        types["torch.Tensor"] = torch.Tensor
    if cupy is not None:
        types["cupy.ndarray"] = cupy.ndarray
    if jax is not None:
        types["jax.Array"] = type(jax.numpy.zeros(1))
    out["exchange_tables"] = {}
    for name, ty in types.items():
        try:
            out["exchange_tables"][name] = table_version(ty)
        except Exception as e:  # noqa: BLE001
            out["exchange_tables"][name] = f"{type(e).__name__}: {e}"[:200]

    # Fast paths, as the test hooks report them (absent from a release wheel: not known there).
    fast: dict = {}
    if hooks:
        fast["cuda driver (libcuda.so.1 loaded)"] = D._cuda_driver_available()
        if np is not None:
            dlbridge.from_dlpack(np.zeros(2))  # the numpy fast path is verified at first use
            fast["numpy struct fast path"] = D._numpy_fast_path()
        if torch is not None:
            for label, f in (("torch ATen neg/conj bits", D._torch_bits_from_aten),
                             ("torch ATen write checks + version bump", D._torch_writes_from_aten)):
                try:
                    fast[label] = f()
                except Exception as e:  # noqa: BLE001
                    fast[label] = f"{type(e).__name__}: {e}"[:200]
        likes = {}
        if torch is not None:
            likes["torch.Tensor (cpu)"] = (torch.zeros(1), dlbridge.Device("cpu"))
            if cuda:
                x = torch.zeros(1, device="cuda")
                likes["torch.Tensor (cuda)"] = (x, dlbridge.Device("cuda", x.device.index))
        if cupy is not None and cuda:
            likes["cupy.ndarray (cuda)"] = (cupy.zeros(1), dlbridge.Device("cuda", cupy.cuda.Device().id))
        for label, (like, dev) in likes.items():
            try:
                t = D._table_allocate(like, [4], dev)
                fast[f"exchange table used: {label}"] = f"allocated on {t.device}" if str(t.device) == str(dev) else \
                    f"allocated on {t.device}, asked {dev}"
            except TypeError as e:
                fast[f"exchange table used: {label}"] = False if "no exchange table" in str(e) else f"TypeError: {e}"[:200]
            except Exception as e:  # noqa: BLE001
                fast[f"exchange table used: {label}"] = f"{type(e).__name__}: {e}"[:200]
        if torch is not None and cuda:
            try:
                x = torch.zeros(1, device="cuda")
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    got = D._current_work_stream(x, dlbridge.Device("cuda", x.device.index))
                fast["current_work_stream (torch, side stream)"] = (
                    True if got == s.cuda_stream else f"{got:#x} != torch's {s.cuda_stream:#x}")
            except Exception as e:  # noqa: BLE001
                fast["current_work_stream (torch, side stream)"] = f"{type(e).__name__}: {e}"[:200]
    out["fast_paths"] = fast
    return out


# --- summary -------------------------------------------------------------------------------------

OUTCOMES = ["passed", "failed", "error", "skipped", "xfailed", "xpassed"]


def _read_jsonl(path: str) -> tuple[dict | None, list[dict]]:
    collected, tests = None, []
    if not os.path.exists(path):
        return None, []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if r.get("event") == "collected":
                collected = r
            else:
                tests.append(r)
    return collected, tests


def _short(nodeid: str) -> str:
    """A test's id without the virtualenv's path (site-packages/dlbridge/tests/... -> dlbridge/tests/...)."""
    return nodeid.split("site-packages/", 1)[-1]


def _missing_from_reason(reason: str) -> str | None:
    for pat in (r"^(\S+) is not installed", r"could not import '([^']+)'", r"No module named '([^']+)'"):
        m = re.search(pat, reason)
        if m:
            return m.group(1)
    return None


def summarize(out: str, work: str) -> int:
    steps: list[dict[str, Any]] = []
    with open(os.path.join(work, "steps.tsv")) as f:
        for line in f:
            name, kind, rc, secs, limit, note = (line.rstrip("\n").split("\t") + [""] * 6)[:6]
            steps.append({"step": name, "kind": kind, "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                          "seconds": float(secs or 0), "limit_s": int(limit or 0), "note": note})
    gpu_tests: dict[str, list[dict]] = {}
    skip_reasons: dict[str, int] = {}
    missing_by_skip: dict[str, int] = {}
    failures: list[tuple[str, dict]] = []
    for s in steps:
        if s["kind"] != "pytest":
            continue
        collected, tests = _read_jsonl(os.path.join(work, "logs", s["step"] + ".jsonl"))
        counts = {k: 0 for k in OUTCOMES}
        gcounts = {k: 0 for k in OUTCOMES}
        for t in tests:
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
            if t.get("gpu"):
                gcounts[t["outcome"]] = gcounts.get(t["outcome"], 0) + 1
                gpu_tests.setdefault(s["step"], []).append(t)
            if t["outcome"] == "skipped":
                skip_reasons[t["reason"]] = skip_reasons.get(t["reason"], 0) + 1
                lib = _missing_from_reason(t["reason"])
                if lib:
                    missing_by_skip[lib] = missing_by_skip.get(lib, 0) + 1
            if t["outcome"] in ("failed", "error", "xpassed"):
                failures.append((s["step"], t))
        s["collected"] = collected["n"] if collected else None
        s["counts"] = counts
        s["gpu_counts"] = gcounts
        s["gpu_collected"] = collected["gpu"] if collected else None
        s["not_run"] = (collected["n"] - len(tests)) if collected else None
    probes: dict[str, Any] = {}
    for s in steps:
        if s["kind"] == "probe":
            try:
                with open(os.path.join(work, "logs", s["step"] + ".json")) as f:
                    probes[s["step"]] = json.load(f)
            except (OSError, ValueError) as e:
                probes[s["step"]] = {"error": f"no probe result: {e}"}
    env = ""
    if os.path.exists(os.path.join(work, "env.txt")):
        with open(os.path.join(work, "env.txt")) as f:
            env = f.read().strip()
    bench_note = ""
    if os.path.exists(os.path.join(work, "bench_note.txt")):
        with open(os.path.join(work, "bench_note.txt")) as f:
            bench_note = f.read().strip()

    gpu_all = [t for ts in gpu_tests.values() for t in ts]
    gpu_passed = sum(t["outcome"] == "passed" for t in gpu_all)
    gpu_failed = sum(t["outcome"] in ("failed", "error") for t in gpu_all)
    gpu_skipped = sum(t["outcome"] == "skipped" for t in gpu_all)
    missing = sorted(set().union(*(p.get("missing", []) for p in probes.values())) if probes else set())
    ok = all(s["rc"] == 0 for s in steps if s["kind"] != "info") and not failures

    L = ["# dlbridge GPU run", ""]
    if env:
        L += ["```", env, "```", ""]
    L += ["| step | rc | time (s) | limit (s) | collected | passed | failed | error | skipped | xfail | not run | "
          "gpu-marked: passed / failed / skipped |", "|" + " --- |" * 12]
    for s in steps:
        rc = "timeout" if s["rc"] in (124, 137) else "not run (time budget)" if s["rc"] == -1 else s["rc"]
        if s["kind"] == "pytest":
            c, g = s["counts"], s["gpu_counts"]
            L.append(f"| {s['step']} | {rc} | {s['seconds']:.1f} | {s['limit_s']} | {s['collected']} | {c['passed']} | "
                     f"{c['failed']} | {c['error']} | {c['skipped']} | {c['xfailed'] + c['xpassed']} | {s['not_run']} | "
                     f"{g['passed']} / {g['failed'] + g['error']} / {g['skipped']} |")
        else:
            L.append(f"| {s['step']} | {rc} | {s['seconds']:.1f} | {s['limit_s']} | {s['note']} |" + " |" * 7)
    L.append("")
    if gpu_passed == 0:
        L.append(f"**GPU tests: {len(gpu_all)} `gpu`-marked test runs, {gpu_passed} passed, {gpu_failed} failed, "
                 f"{gpu_skipped} skipped: no CUDA code of dlbridge ran on a GPU in this run.**")
    else:
        L.append(f"**GPU tests: {len(gpu_all)} `gpu`-marked test runs, {gpu_passed} passed, {gpu_failed} failed, "
                 f"{gpu_skipped} skipped.**")
    L.append("")
    # One row per gpu test, one column per step that ran it.
    gsteps = list(gpu_tests)
    rows: dict[str, dict[str, str]] = {}
    for step, ts in gpu_tests.items():
        for t in ts:
            cell = t["outcome"] + (f" ({t['reason']})" if t["reason"] else "")
            rows.setdefault(_short(t["nodeid"]), {})[step] = cell.replace("|", "/")
    if rows:
        L += ["| gpu test | " + " | ".join(gsteps) + " |", "|" + " --- |" * (len(gsteps) + 1)]
        L += [f"| {name} | " + " | ".join(cells.get(st, "") for st in gsteps) + " |" for name, cells in rows.items()]
    L += ["", "## Libraries", ""]
    for name, p in probes.items():
        libs = p.get("libraries", {})
        have = ", ".join(f"{k} {v}" for k, v in libs.items() if v is not None)
        L.append(f"- {name}: python {p.get('python')}; {have}")
    if probes:
        L.append(f"- missing (their tests skipped, not bundled): {', '.join(missing) or 'none'}")
    else:
        L.append("- missing: not known (no probe ran)")
    if missing_by_skip:
        L.append("- skips naming a missing library: " + ", ".join(f"{k} ({v})" for k, v in sorted(missing_by_skip.items())))
    L += ["", "## CUDA and fast paths", ""]
    for name, p in probes.items():
        if "error" in p:
            L.append(f"- {name}: {p['error']}")
            continue
        d = p.get("dlbridge", {})
        L.append(f"- {name}: dlbridge {d.get('version')} ({'with' if d.get('test_hooks') else 'without'} test hooks) "
                 f"from {d.get('file')}")
        L.append(f"  - cuda: {json.dumps(p.get('cuda'))}")
        for c in p.get("checks", []):
            mark = {True: "ok", False: "FAILED", None: "n/a"}.get(c["ok"], str(c["ok"]))
            L.append(f"  - {mark}: {c['name']}: {c['detail']}")
        L.append(f"  - exchange tables published (DLPack version): {json.dumps(p.get('exchange_tables'))}")
        if p.get("fast_paths"):
            for k, v in p["fast_paths"].items():
                L.append(f"  - fast path: {k}: {v}")
        elif not d.get("test_hooks"):
            L.append("  - fast paths: not observable without the test hooks (see the hooks wheel's probe)")
    L += ["", "## Benchmarks", "", bench_note or "none run", ""]
    if skip_reasons:
        L += ["## Skip reasons (all steps)", ""]
        for reason, n in sorted(skip_reasons.items(), key=lambda kv: -kv[1])[:40]:
            L.append(f"- {n}x {reason}")
        L.append("")
    L += ["## Failures", ""]
    L += [f"- {step}: {t['outcome']}: {_short(t['nodeid'])}: {t['reason']}" for step, t in failures] or ["none"]
    skipped_note = f"; {gpu_skipped} of {len(gpu_all)} gpu-marked test runs skipped, not passed" if gpu_skipped else ""
    if ok:
        L += ["", f"Result: PASS (every step exited 0, no test failed{skipped_note})"]
    else:
        bad = [f"{s['step']} rc={s['rc']}" for s in steps if s["kind"] != "info" and s["rc"] != 0]
        L += ["", "Result: FAIL: " + "; ".join(bad + ([f"{len(failures)} failing tests"] if failures else [])) + skipped_note]
    text = "\n".join(L).rstrip() + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"ok": ok, "steps": steps, "gpu": {"runs": len(gpu_all), "passed": gpu_passed, "failed": gpu_failed,
                                                     "skipped": gpu_skipped, "tests": gpu_tests},
                   "missing_libraries": missing, "skips_naming_a_library": missing_by_skip, "probes": probes,
                   "skip_reasons": skip_reasons, "benchmarks": bench_note}, f, indent=1)
    with open(os.path.join(out, "failures.txt"), "w") as f:
        for step, t in failures:
            f.write(f"===== {step}: {t['outcome']}: {t['nodeid']}\n{t.get('longrepr', '')}\n\n")
        if not failures:
            f.write("no failing tests\n")
    sys.stdout.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        json.dump(probe(), sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    elif sys.argv[1:2] == ["summarize"] and len(sys.argv) == 4:
        sys.exit(summarize(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(f"usage: {sys.argv[0]} probe | summarize OUT WORK")
