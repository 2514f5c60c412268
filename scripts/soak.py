"""`make soak`: 10^6 import/export round trips per path, reporting process memory growth (RSS after
the run minus RSS after a warm-up of 2e4). Fails if any path grows by 1 MiB or more. This is a
benchmark-style script, not a timed test: it prints what it measured."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
N = int(os.environ.get("SOAK_N", 10**6))
LIMIT = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def exchange_producer_path(dlbridge):
    """dlbridge's own C exchange table called from C-like code (ctypes): export, then delete."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    table = get(dlbridge.Tensor.__dlpack_c_exchange_api__, b"dlpack_exchange_api")
    from_py = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(ctypes.c_void_p))(
        ctypes.c_void_p.from_address(table + 24).value)
    deleter_of = lambda p: ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.c_void_p.from_address(p + 16).value)  # noqa: E731
    return from_py, deleter_of


def main() -> int:
    import numpy as np

    import dlbridge

    paths = {}
    a = np.arange(100, dtype=np.float32)
    paths["numpy: from_dlpack -> numpy.from_dlpack"] = lambda: np.from_dlpack(dlbridge.from_dlpack(a))
    paths["numpy: legacy capsule -> from_dlpack"] = lambda: dlbridge.from_dlpack(a.__dlpack__())
    try:
        import torch

        x = torch.arange(100, dtype=torch.float32)
        paths["torch: from_dlpack (C exchange API) -> torch.from_dlpack"] = lambda: torch.from_dlpack(dlbridge.from_dlpack(x))
    except ImportError:
        print("torch not installed: its path is skipped")
    try:
        import jax

        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp

        j = jnp.arange(100.0)
        paths["jax: from_dlpack (legacy) -> jnp.from_dlpack"] = lambda: jnp.from_dlpack(dlbridge.from_dlpack(j))
    except ImportError:
        print("jax not installed: its path is skipped")
    b, ba = b"x" * 100, bytearray(100)

    class AI:
        __array_interface__ = a.__array_interface__

    ai = AI()
    paths["asdlpack: bytes -> numpy.from_dlpack"] = lambda: np.from_dlpack(dlbridge.asdlpack(b))
    paths["asdlpack: bytearray memoryview -> capsule unconsumed"] = lambda: dlbridge.asdlpack(memoryview(ba)).__dlpack__(max_version=(1, 3))
    paths["asdlpack: __array_interface__ -> numpy.from_dlpack"] = lambda: np.from_dlpack(dlbridge.asdlpack(ai))
    from_py, deleter_of = exchange_producer_path(dlbridge)
    t = dlbridge.from_dlpack(a)
    out = ctypes.c_void_p()

    def exchange() -> None:
        assert from_py(t, ctypes.byref(out)) == 0
        deleter_of(out.value)(out.value)

    paths["C exchange API (dlbridge's table): export + deleter"] = exchange

    def failing(call):
        def once() -> None:
            try:
                call()
            except (TypeError, ValueError, BufferError):
                pass
        return once

    t_err = dlbridge.asdlpack(b"ab")
    used = a.__dlpack__()
    dlbridge.from_dlpack(used)  # consumed: every later import of it is refused
    # Error paths: each refusal must leave nothing behind (they used to park objects in PyO3's pool).
    paths["error: asdlpack(5) -> TypeError"] = failing(lambda: dlbridge.asdlpack(5))
    paths["error: from_dlpack(object()) -> TypeError"] = failing(lambda: dlbridge.from_dlpack(object()))
    paths["error: Tensor.__dlpack__(stream=0) -> ValueError"] = failing(lambda: t_err.__dlpack__(stream=0, dl_device=(2, 0)))
    paths["error: from_dlpack(consumed capsule) -> ValueError"] = failing(lambda: dlbridge.from_dlpack(used))

    failed = 0
    print(f"{'path':<62} {'calls':>9} {'seconds':>8} {'RSS growth':>12}")
    for name, f in paths.items():
        for _ in range(20_000):
            f()
        gc.collect()
        before = rss()
        t0 = time.perf_counter()
        for _ in range(N):
            f()
        gc.collect()
        growth = rss() - before
        ok = growth < LIMIT
        failed += not ok
        print(f"{name:<62} {N:>9} {time.perf_counter() - t0:8.1f} {growth / 1024:9.0f} KiB  {'OK' if ok else 'FAIL'}", flush=True)
    print(f"{len(paths) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
