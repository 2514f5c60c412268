"""`make demo`: a real exchange between Rust and real Python libraries, shown to a person.

Rust code (the example extension `dlbridge_scale`, built on the dlbridge crate) reads numpy and
torch arrays without copying, hands a Rust-made buffer to numpy, torch and jax, and scales tensors
in place; a table shows what each library's arrays look like when they pass through dlbridge.
"""

from __future__ import annotations

import os
import warnings

# Library start-up chatter (tensorflow's C++ and absl logs, gRPC, glog) is not part of the demo:
# silenced before any of them is imported.
for var, level in [("TF_CPP_MIN_LOG_LEVEL", "3"), ("GRPC_VERBOSITY", "ERROR"), ("GLOG_minloglevel", "3")]:
    os.environ.setdefault(var, level)
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402

import dlbridge  # noqa: E402
import dlbridge_scale  # noqa: E402


def hexp(p: int) -> str:
    return f"{p:#014x}"


def route(obj) -> str:
    """How dlbridge takes this object in (decided the way dlbridge decides it)."""
    import ctypes

    if isinstance(obj, np.ndarray):
        return "numpy struct, no capsule"
    if hasattr(type(obj), "__dlpack_c_exchange_api__"):
        return "C exchange API"
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    name = get_name(obj.__dlpack__(max_version=(1, 3))).decode()
    return "legacy capsule" if name == "dltensor" else "versioned capsule"


def section(title: str) -> None:
    print(f"\n{title}\n{'-' * len(title)}")


def main() -> None:
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import torch

    print("dlbridge demo: Rust <-> numpy / torch / jax through DLPack 1.3, without copies")

    section("1. Python arrays read in Rust (dlbridge.ManagedTensor in a #[pyfunction])")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()
    rows = [("numpy", a, a.ctypes.data), ("numpy a[:, ::-2]", a[:, ::-2], a[:, ::-2].ctypes.data),
            ("torch x.t()", x, x.data_ptr())]
    print(f"  {'source':<18} {'dtype':<8} {'shape':<8} {'strides':<9} {'Python pointer':<16} {'Rust pointer':<16} zero-copy")
    for name, obj, py_ptr in rows:
        d = dlbridge_scale.describe(obj)
        print(f"  {name:<18} {d['dtype']:<8} {str(tuple(d['shape'])):<8} {str(tuple(d['strides'])):<9} "
              f"{hexp(py_ptr):<16} {hexp(d['data_ptr']):<16} {'yes' if py_ptr == d['data_ptr'] else 'NO'}")

    section("2. A Rust-made buffer (256-byte aligned) handed to numpy, torch and jax")
    t = dlbridge_scale.arange(8)
    n, tt, j = np.from_dlpack(t), torch.from_dlpack(t), jnp.from_dlpack(t)
    print(f"  Rust buffer  {hexp(t.data_ptr)}  {t!r}")
    print(f"  numpy        {hexp(n.ctypes.data)}  same memory: {n.ctypes.data == t.data_ptr}")
    print(f"  torch        {hexp(tt.data_ptr())}  same memory: {tt.data_ptr() == t.data_ptr}")
    print(f"  jax          {hexp(j.unsafe_buffer_pointer())}  same memory: {j.unsafe_buffer_pointer() == t.data_ptr}")
    n[3] = 100.0
    print("  numpy writes n[3] = 100.0")
    print(f"    torch sees {tt[3].item():.1f}, jax sees {float(j[3]):.1f}; Rust's sum over its buffer: {dlbridge_scale.total(t):.1f}")
    dlbridge_scale.scale(tt, 2.0)
    print("  Rust scale(torch_tensor, 2.0) in place")
    print(f"    numpy now {n.tolist()}")

    # Imported before the section starts, so nothing they print at start-up can split it.
    import pyarrow as pa
    import tensorflow as tf

    section("3. What each library's arrays look like passing through dlbridge")

    sources = [
        ("numpy", np.zeros((2, 3), np.float64)),
        ("numpy (read-only)", np.broadcast_to(np.arange(3, dtype=np.int16), (2, 3))),
        ("numpy (transposed)", np.zeros((2, 3), np.complex64).T),
        ("torch", torch.zeros(2, 3, dtype=torch.bfloat16)),
        ("torch (expanded)", torch.zeros(3).expand(2, 3)),
        ("torch", torch.zeros(4, dtype=torch.float8_e4m3fn)),
        ("jax", jnp.zeros((2, 3), jnp.float32)),
        ("tensorflow", tf.zeros((2, 3), tf.int32)),
        ("pyarrow", pa.array([1, 2, 3], pa.uint16())),
    ]
    print(f"  {'producer':<20} {'route into dlbridge':<26} {'dtype':<14} {'shape':<8} {'strides':<9} {'readonly':<8} zero-copy")
    for name, obj in sources:
        tensor = dlbridge.from_dlpack(obj)
        kind = route(obj)
        src_ptr = dlbridge_scale.describe(obj)["data_ptr"]
        print(f"  {name:<20} {kind:<26} {str(tensor.dtype):<14} {str(tensor.shape):<8} {str(tensor.strides):<9} "
              f"{str(tensor.readonly):<8} {'yes' if tensor.data_ptr == src_ptr else 'NO'}")
    print("\n  (legacy capsules cannot say read-only, so dlbridge treats them as read-only, as numpy does;")
    print("   numpy arrays are read through their own struct after a one-time check against numpy's")
    print("   buffer export; torch tensors through torch's DLPack 1.3 C exchange table)")

    kernels()


def kernels() -> None:
    """Rust kernels (examples/kernels) called from numpy, torch and jax, each returning the caller's type."""
    import jax.numpy as jnp
    import torch

    import dlbridge_kernels as K

    section("4. Rust kernels (examples/kernels) return the caller's own kind of array")
    rows = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    print(f"  {'caller':<8} {'softmax(x) returned':<28} first row")
    for name, x in [("numpy", rows), ("torch", torch.from_numpy(rows.copy())), ("jax", jnp.asarray(rows))]:
        out = K.softmax(x)
        kind = f"{type(out).__module__}.{type(out).__name__}"
        print(f"  {name:<8} {kind:<28} {', '.join(f'{v:.4f}' for v in np.asarray(dlbridge.from_dlpack(out))[0])}")
    y = torch.ones(4)
    same = K.saxpy_(2.0, torch.arange(4.0), y) is y
    print(f"  saxpy_(2, arange(4), y) in place on a torch tensor: y = {y.tolist()} (returned y itself: {same})")
    try:
        K.saxpy_(2.0, torch.arange(4.0), torch.ones(4, dtype=torch.float64))
    except TypeError as e:
        print(f"  a float64 y is refused at conversion: TypeError: {e}")


if __name__ == "__main__":
    main()
