"""The README's examples work as written: the Python blocks run here; the Rust blocks are built as
written in a crate outside the workspace and called from numpy, torch and jax by
tests/test_downstream.py."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def block(lang: str) -> str:
    return blocks(lang)[0]


def test_python_examples_run():
    first, *rest = blocks("python")
    assert len(first.strip().splitlines()) == 5
    for code in [first, *rest]:
        exec(compile(code, "README.md", "exec"), {})
