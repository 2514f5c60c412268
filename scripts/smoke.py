"""Interop smoke run for valgrind (embedded Python): numpy and buffer exporters through dlbridge
both ways, legacy and versioned capsules, unconsumed capsules, refusals, the exchange table."""

import gc

import numpy as np

import dlbridge

for _ in range(200):
    a = np.arange(24, dtype=np.float64).reshape(2, 3, 4)[:, ::-1, 1::2]
    t = dlbridge.from_dlpack(a)
    assert np.from_dlpack(t).tolist() == a.tolist()
    t.__dlpack__()
    t.__dlpack__(max_version=(1, 3))
    assert np.from_dlpack(t, copy=True).tolist() == a.tolist()
    dlbridge.from_dlpack(a.__dlpack__())
    dlbridge.from_dlpack(a.__dlpack__(max_version=(1, 0)))
    dlbridge.asdlpack(b"abcdef")
    m = dlbridge.asdlpack(memoryview(bytearray(16)).cast("i"))
    np.from_dlpack(m)[0] = 3
    ro = np.arange(3.0)
    ro.flags.writeable = False
    try:
        dlbridge.from_dlpack(ro).__dlpack__()
    except BufferError:
        pass
    try:
        dlbridge.from_dlpack(np.arange(3, dtype=">i4"))
    except BufferError:
        pass
    dlbridge.from_dlpack(dlbridge.from_dlpack(np.zeros((0, 3))))
    dlbridge._dlbridge._drop_on_native_thread(np.arange(5.0))
    memoryview(t)
gc.collect()
print("smoke done")
