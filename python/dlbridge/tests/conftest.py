"""Markers for the shipped test suite."""

import pytest

import dlbridge


def _dynamo_before_tensorflow():
    """torch.compile imports triton, whose LLVM aborts the process ("Option ... registered more
    than once") when tensorflow's LLVM was loaded first; the other order works. The kernel tests
    compile with torch in the same session as tests that import tensorflow, so torch's compiler
    is loaded first, wherever both are installed."""
    import importlib.util
    import sys

    from .libs import have

    if "tensorflow" in sys.modules or importlib.util.find_spec("tensorflow") is None:
        return
    if have("torch"):
        import torch._dynamo  # noqa: F401


def pytest_configure(config):
    _dynamo_before_tensorflow()
    # Every warning attributed to dlbridge's own modules (the package and this suite: a library's
    # deprecation reached through dlbridge's calls, or one dlbridge raises from Rust on behalf of
    # its caller here) fails the test that caused it, on every interpreter of the matrix. The
    # suite runs from outside the tree (`--pyargs dlbridge`), so no ini file would apply: the
    # filter is added here. Tests that expect a warning catch it with pytest.warns.
    config.addinivalue_line("filterwarnings", r"error:::dlbridge(\.|$)")
    # fork() in a process that has other threads (CPython 3.12 on warns, from multiprocessing's
    # module): only test_processes' fork cases do it, and they expect it (see `starting` there).
    config.addinivalue_line("filterwarnings", r"error:This process .* is multi-threaded, use of fork\(\):DeprecationWarning")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped where none is present")
    config.addinivalue_line(
        "markers", "processes: starts child processes (each waited for with a bound, then reaped)"
    )
    config.addinivalue_line(
        "markers",
        "hooks: needs dlbridge's test-only hooks (cargo feature test-hooks, which `make test` builds "
        "with and no wheel has); skipped where they are absent",
    )


def pytest_collection_modifyitems(config, items):
    if hasattr(dlbridge._dlbridge, "_view"):
        return
    skip = pytest.mark.skip(reason="dlbridge was built without the test-hooks feature (make test builds with it)")
    for item in items:
        if "hooks" in item.keywords:
            item.add_marker(skip)
