"""The public Python functions have docstrings a user can work from: `help(dlbridge.f)` states the
signature, says what every argument is, what comes back, and what is raised."""

import inspect
import re

import pytest

import dlbridge

FUNCTIONS = [dlbridge.from_dlpack, dlbridge.asdlpack]


@pytest.mark.parametrize("f", FUNCTIONS, ids=lambda f: f.__name__)
def test_every_argument_the_result_and_the_exceptions_are_documented(f):
    doc = inspect.getdoc(f)
    assert doc and {"Arguments:", "Returns:", "Raises:"} <= set(doc.splitlines())
    arguments = doc.split("Arguments:")[1].split("Returns:")[0]
    for name in inspect.signature(f).parameters:
        assert re.search(rf"^  {name}: \S", arguments, re.M), f"{f.__name__}: {name} is not documented"
    raises = doc.split("Raises:")[1]
    for exc in ("TypeError", "BufferError", "ValueError"):
        assert re.search(rf"^  {exc}: \S", raises, re.M), f"{f.__name__}: {exc} is not documented"


@pytest.mark.parametrize("f", FUNCTIONS, ids=lambda f: f.__name__)
def test_the_signature_is_introspectable(f):
    assert str(inspect.signature(f)).startswith("(")
