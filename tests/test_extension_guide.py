"""docs/extension-guide.md is the example extension, whole: its two TOML blocks are
examples/kernels' Cargo.toml and pyproject.toml, its Rust blocks one after the other are
examples/kernels/src/lib.rs (which `make test` builds and tests), and every Python block runs
against that built extension. (tests/test_downstream.py builds the blocks as written, outside the
workspace.)"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs/extension-guide.md").read_text()
KERNELS = ROOT / "examples/kernels"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", GUIDE, re.S)


def lines(text: str) -> list[str]:
    """The text's lines, blank ones left out (blocks are separated by prose, not blank lines)."""
    return [line for line in text.splitlines() if line.strip()]


def test_the_guide_has_code():
    assert len(blocks("rust")) >= 6 and len(blocks("python")) >= 3 and len(blocks("toml")) == 2


def test_the_rust_blocks_are_the_whole_example_in_order():
    assert lines("\n".join(blocks("rust"))) == lines((KERNELS / "src/lib.rs").read_text())


def test_the_toml_blocks_are_the_examples_build_files():
    cargo, pyproject = blocks("toml")
    assert cargo == (KERNELS / "Cargo.toml").read_text()
    assert pyproject == (KERNELS / "pyproject.toml").read_text()


def test_the_manifest_stands_alone():
    """Nothing inherited from this workspace: the example builds wherever it is copied."""
    assert ".workspace" not in blocks("toml")[0] and "workspace = true" not in blocks("toml")[0]


@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.strip().splitlines()[-1][:40])
def test_python_blocks_run(code):
    for lib in re.findall(r"^import (\w+)", code, re.M):
        pytest.importorskip(lib)
    if "jax" in code:
        pytest.importorskip("jax").config.update("jax_enable_x64", True)
    exec(compile(code, "docs/extension-guide.md", "exec"), {})
