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
