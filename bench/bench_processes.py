"""Tensors across processes (issue 23): the targets of `make bench`'s "processes" group, also
runnable alone (`python bench/bench_processes.py`). Every target is a ratio of two cases measured
in this run, interleaved (each repeat times every case of its group in turn); PASS/FAIL printed.

- a 1 GiB float32 shared Tensor sent to a running child through a multiprocessing queue and an
  acknowledgement back (the data not read) <= 0.01 x the same with a numpy array (pickled, copied);
- the same <= 1.0 x torch.multiprocessing sending an already share_memory_()'d tensor through its
  queue (torch's default file_descriptor strategy);
- a shared tensor's round trip flat from 1e3 to 1e8 elements (<= 1.2 x);
- Ray: ray.get of a 1e8-element Tensor in a task <= 1.2 x the same for a numpy array.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import statistics
import sys
import time

GIB = 1 << 30


def echo(q_in, q_out) -> None:
    """A running child: acknowledges each object it receives, without reading its data."""
    while True:
        x = q_in.get()
        if x is None:
            return
        q_out.put(1)
        del x


def round_trips(cases: dict, repeats: dict[str, int]) -> dict[str, float]:
    """Median seconds per put+ack for each case, interleaved: `cases` maps a name to
    (q_in, q_out, obj)."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for name, (q_in, q_out, obj) in cases.items():  # warm-up: the child's first unpickle
        q_in.put(obj)
        q_out.get(timeout=600)
    for i in range(max(repeats.values())):
        for name, (q_in, q_out, obj) in cases.items():
            if i >= repeats[name]:
                continue
            t0 = time.perf_counter()
            q_in.put(obj)
            q_out.get(timeout=600)
            times[name].append(time.perf_counter() - t0)
            gc.collect()
    return {k: statistics.median(v) for k, v in times.items()}


def start_echo(ctx):
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=echo, args=(q_in, q_out), daemon=True)
    p.start()
    return p, q_in, q_out


def stop(*running) -> None:
    for p, q_in, _ in running:
        q_in.put(None)
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join(60)


def queue_targets(quick: bool) -> tuple[dict[str, float], list[dict]]:
    import numpy as np

    import dlbridge

    n = GIB // 4 // (16 if quick else 1)
    ctx = mp.get_context("spawn")
    results: dict[str, float] = {}
    running = [start_echo(ctx) for _ in range(2)]
    shared = dlbridge.shared_empty(n, "float32")
    plain = np.ones(n, dtype=np.float32)
    try:
        (_, qa, ra), (_, qb, rb) = running
        r = round_trips({"shared": (qa, ra, shared), "numpy": (qb, rb, plain)}, {"shared": 21, "numpy": 3})
        results["1 GiB shared Tensor through a multiprocessing queue, ack back"] = r["shared"]
        results["1 GiB numpy array through a multiprocessing queue, ack back"] = r["numpy"]
        del plain
        gc.collect()
        # The round trip against the size (the same child, interleaved).
        sizes = {k: dlbridge.shared_empty(10**k, "float32") for k in (3, 5, 7, 8)}
        r = round_trips({f"1e{k}": (qa, ra, t) for k, t in sizes.items()}, {f"1e{k}": 21 for k in sizes})
        for k, v in r.items():
            results[f"shared Tensor round trip, {k} f32"] = v
    finally:
        stop(*running)
    try:
        import torch
        import torch.multiprocessing as tmp
    except ImportError:
        torch = None
    if torch is not None:
        tctx = tmp.get_context("spawn")
        running = [start_echo(tctx), start_echo(ctx)]
        x = torch.ones(n, dtype=torch.float32).share_memory_()
        try:
            (_, qa, ra), (_, qb, rb) = running
            r = round_trips({"torch": (qa, ra, x), "shared": (qb, rb, shared)}, {"torch": 21, "shared": 21})
            results["1 GiB share_memory_() torch tensor through torch.multiprocessing's queue, ack back"] = r["torch"]
            results["1 GiB shared Tensor through a multiprocessing queue, ack back (beside torch)"] = r["shared"]
        finally:
            stop(*running)
    label = "" if not quick else " (quick: 64 MiB)"
    checks = [
        (f"1 GiB shared Tensor to a child and back <= 0.01 x numpy array{label}",
         "1 GiB shared Tensor through a multiprocessing queue, ack back",
         "1 GiB numpy array through a multiprocessing queue, ack back", 0.01),
        (f"1 GiB shared Tensor to a child and back <= 1.0 x torch.multiprocessing share_memory_(){label}",
         "1 GiB shared Tensor through a multiprocessing queue, ack back (beside torch)",
         "1 GiB share_memory_() torch tensor through torch.multiprocessing's queue, ack back", 1.0),
        ("shared Tensor round trip 1e8 <= 1.2 x 1e3", "shared Tensor round trip, 1e8 f32",
         "shared Tensor round trip, 1e3 f32", 1.2),
    ]
    return results, [target(results, *c) for c in checks if c[1] in results and c[2] in results]


def target(results: dict[str, float], name: str, num: str, den: str, limit: float) -> dict:
    r = results[num] / results[den]
    return {"name": name, "pass": r <= limit,
            "detail": f"{r:.3g} ({results[num] * 1e6:.0f} / {results[den] * 1e6:.0f} us)"}


def timed_gets(refs, repeats: int) -> dict[str, float]:
    """In a Ray task: median seconds of ray.get for each ref (interleaved), objects dropped each time."""
    import ray

    times: dict[str, list[float]] = {k: [] for k in refs}
    for _ in range(repeats):
        for k, ref in refs.items():
            t0 = time.perf_counter()
            obj = ray.get(ref)
            times[k].append(time.perf_counter() - t0)
            del obj
    return {k: statistics.median(v) for k, v in times.items()}


def ray_targets(quick: bool) -> tuple[dict[str, float], list[dict]]:
    try:
        import ray
    except ImportError:
        return {}, []
    import numpy as np

    import dlbridge

    n = 10**8 // (100 if quick else 1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        a = np.ones(n, dtype=np.float32)
        refs = {"tensor": ray.put(dlbridge.asdlpack(a)), "numpy": ray.put(a)}
        del a
        r = ray.get(ray.remote(timed_gets).remote(refs, 31), timeout=600)
    finally:
        ray.shutdown()
    results = {"ray.get of a 1e8 f32 Tensor in a task": r["tensor"], "ray.get of a 1e8 f32 numpy array in a task": r["numpy"]}
    label = "" if not quick else " (quick: 1e6)"
    return results, [target(results, f"Ray: ray.get of a 1e8 Tensor in a task <= 1.2 x numpy array{label}",
                            "ray.get of a 1e8 f32 Tensor in a task", "ray.get of a 1e8 f32 numpy array in a task", 1.2)]


def run(quick: bool = False) -> tuple[dict[str, float], list[dict]]:
    """Every case (median seconds) and every target of this group."""
    print("\n== processes: tensors to other processes (median of interleaved repeats)", flush=True)
    results, targets = queue_targets(quick)
    r, t = ray_targets(quick)
    results.update(r)
    targets += t
    for name, v in results.items():
        print(f"  {name:<88} {v * 1e6:12.1f} us", flush=True)
    return results, targets


if __name__ == "__main__":
    _, targets = run(quick="--quick" in sys.argv)
    print("\n== targets (processes)")
    for tg in targets:
        print(f"  {'PASS' if tg['pass'] else 'FAIL'}  {tg['name']}: {tg['detail']}")
    sys.exit(0)
