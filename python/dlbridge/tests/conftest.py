"""Markers for the shipped test suite."""

import pytest

import dlbridge


def pytest_configure(config):
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
