"""`make demo`, part 2: a tensor made in Rust, read by a child process through torch without a copy.

The parent allocates a shared tensor (`dlbridge.shared_empty`: memory the Rust crate maps) and has
Rust code (the example extension `dlbridge_scale`) fill it; a child started with `spawn` receives
it through a multiprocessing queue (the pickle is a handle of a few dozen bytes), wraps it with
`torch.from_dlpack` over the same memory, and doubles it in place; the parent sees the result.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import warnings

warnings.filterwarnings("ignore")


def child(q_in, q_out) -> None:
    import torch

    t = q_in.get(timeout=120)  # unpickling maps the parent's memory
    x = torch.from_dlpack(t)
    q_out.put((os.getpid(), x.data_ptr() == t.data_ptr, float(x.sum()), str(x.dtype)))
    x.mul_(2)  # in place, in the parent's memory
    q_out.put("doubled")


def main() -> None:
    import numpy as np

    import dlbridge
    import dlbridge_scale

    t = dlbridge.shared_empty((1000, 1000), "float64")
    dlbridge_scale.fill(t, 1.5)  # Rust writes the shared memory
    print(f"parent {os.getpid()}: {t!r}")
    print(f"  filled by Rust: {np.from_dlpack(t)[0, :4].tolist()} ...")
    p = pickle.dumps(t)
    assert pickle.loads(p).data_ptr == t.data_ptr  # loading it here maps nothing new (and claims its pin)
    print(f"  its pickle is {len(p)} bytes (a handle, not the {t.nbytes} bytes of data)")
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q_in, q_out))
    p.start()
    try:
        q_in.put(t)
        pid, same, total, dtype = q_out.get(timeout=120)
        print(f"child {pid}: torch.from_dlpack(t) is a {dtype} tensor over the same memory "
              f"(torch's data_ptr == the Tensor's: {same}), sum {total}; torch doubles it in place")
        assert q_out.get(timeout=120) == "doubled"
    finally:
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
    print(f"parent {os.getpid()}: sees the child's write without any copy: {np.from_dlpack(t)[0, :4].tolist()} ...")
    assert same and (np.from_dlpack(t) == 3.0).all()


if __name__ == "__main__":
    main()
