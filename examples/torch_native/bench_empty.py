"""The cost of one eager call of an empty op: native (registered through torch's stable C ABI
from Rust, examples/torch_native) against the same empty op as a Python torch.library.custom_op.

Run after a release build: cd examples/torch_native && maturin develop --release; then
python bench_empty.py [N] [--compiled]. Prints ns per call (best of 7 runs of N calls) and the
ratios. With --compiled, also saxpy inside a torch.compile(fullgraph=True) function: the native op
against a Python custom_op whose body calls that same native op (so the bodies cost the same).
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
