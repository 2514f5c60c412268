"""The cost of one eager call of an empty op: native (registered through torch's stable C ABI
from Rust, examples/torch_native) against the same empty op as a Python torch.library.custom_op.

Run after a release build: cd examples/torch_native && maturin develop --release; then
python bench_empty.py [N] [--compiled]. Prints ns per call (best of 7 runs of N calls) and the
ratios. With --compiled, also saxpy inside a torch.compile(fullgraph=True) function: the native op
against a Python custom_op whose body calls that same native op (so the bodies cost the same).
With --kernels, a dlbridge.kernels kernel with an empty body (empty_like, made by add_kernel: a
native op) against the same function made a kernel from Python (a Python custom op): eager as
torch.ops under inference mode and in grad mode, and inside a compiled function called in grad
mode and under inference mode (interleaved, medians).
"""

import sys
import timeit

import torch

import dlbridge_torch_native as native

N = next((int(a) for a in sys.argv[1:] if a.isdigit()), 20000)
native.register()


@torch.library.custom_op("bench_py::empty", mutates_args=())
def py_empty(x: torch.Tensor) -> None:
    pass


x = torch.empty(4)
cases = {
    "native empty (run_boxed)": torch.ops.dlbridge_native.empty.default,
    "native empty_xla (XLA handler via adapter)": torch.ops.dlbridge_native.empty_xla.default,
    "python custom_op empty (torch.ops)": torch.ops.bench_py.empty.default,
    "python custom_op empty (the function)": py_empty,
    "aten::alias (a C++ op, for scale)": torch.ops.aten.alias.default,
}


def ns_per_call(f):
    return min(timeit.repeat(lambda: f(x), number=N, repeat=7)) / N * 1e9


print(f"torch {torch.__version__}, {N} calls x 7, best run")
for mode in ("grad mode", "inference_mode"):
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.enable_grad()
    with ctx:
        r = {name: ns_per_call(f) for name, f in cases.items()}
    print(f"-- eager, {mode}")
    for name, t in r.items():
        print(f"  {name:45s} {t:8.0f} ns")
    nat = r["native empty (run_boxed)"]
    print(f"  python custom_op (torch.ops) / native: {r['python custom_op empty (torch.ops)'] / nat:.2f} x")
    print(f"  adapter / native: {r['native empty_xla (XLA handler via adapter)'] / nat:.2f} x")


if "--compiled" in sys.argv:
    ops = torch.ops.dlbridge_native

    @torch.library.custom_op("bench_py::saxpy", mutates_args=())
    def py_saxpy(x: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
        return ops.saxpy.default(x, y, a)

    @py_saxpy.register_fake
    def _(x, y, a):
        return torch.empty_like(x)

    y = torch.ones(4)
    native_fn = torch.compile(lambda x, y: ops.saxpy(x, y, 2.0), fullgraph=True)
    python_fn = torch.compile(lambda x, y: py_saxpy(x, y, 2.0), fullgraph=True)
    native_fn(x, y), python_fn(x, y)
    with torch.no_grad():
        r = {
            "eager native saxpy": ns_per_call(lambda x: ops.saxpy.default(x, y, 2.0)),
            "eager python custom_op around it": ns_per_call(lambda x: torch.ops.bench_py.saxpy.default(x, y, 2.0)),
            "compiled native saxpy": ns_per_call(lambda x: native_fn(x, y)),
            "compiled python custom_op around it": ns_per_call(lambda x: python_fn(x, y)),
        }
    print("-- saxpy of 4 floats, no_grad")
    for name, t in r.items():
        print(f"  {name:45s} {t:8.0f} ns")
    print(f"  compiled native / compiled python op: {r['compiled native saxpy'] / r['compiled python custom_op around it']:.2f} x")


if "--kernels" in sys.argv:
    import statistics

    import dlbridge.kernels

    nat = native.empty_like
    assert nat._native_fallback is None, nat._native_fallback
    py = dlbridge.kernels.kernel(nat.__wrapped__, name="empty_like_py", out="x")
    assert isinstance(py.torch_op, torch._library.custom_ops.CustomOpDef)

    def medians(cases, n, repeats=15):
        """Interleaved (the order rotated every repeat): ns per call, median of the repeats."""
        times = {k: [] for k in cases}
        names = list(cases)
        for r in range(repeats):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                times[k].append(timeit.timeit(cases[k], number=n) / n * 1e9)
        return {k: statistics.median(v) for k, v in times.items()}

    def show(title, r):
        print(f"-- {title}")
        for name, t in r.items():
            print(f"  {name:45s} {t:8.0f} ns")
        a, b = list(r.values())[:2]
        print(f"  native / python op: {a / b:.2f} x")

    no, po = nat._overload, py._overload
    x = torch.empty(4)
    with torch.inference_mode():
        xi = torch.empty(4)
        r = medians({"native kernel op": lambda: no(xi), "python op kernel": lambda: po(xi),
                     "aten::empty_like (scale)": lambda: torch.ops.aten.empty_like.default(xi)}, N)
    show("empty kernel, eager as torch.ops, inference_mode", r)
    r = medians({"native kernel op": lambda: no(x), "python op kernel": lambda: po(x)}, N)
    show("empty kernel, eager as torch.ops, grad mode", r)
    fn = torch.compile(lambda x: nat(x), fullgraph=True)
    fp = torch.compile(lambda x: py(x), fullgraph=True)
    fn(x), fp(x)
    r = medians({"native kernel op": lambda: fn(x), "python op kernel": lambda: fp(x)}, max(N // 10, 1))
    show("empty kernel in torch.compile(fullgraph=True), called in grad mode", r)
    with torch.inference_mode():
        gn = torch.compile(lambda x: nat(x), fullgraph=True)
        gp = torch.compile(lambda x: py(x), fullgraph=True)
        gn(xi), gp(xi)
        r = medians({"native kernel op": lambda: gn(xi), "python op kernel": lambda: gp(xi)}, max(N // 10, 1))
    show("empty kernel in torch.compile(fullgraph=True), called under inference_mode", r)
