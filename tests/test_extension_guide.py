"""docs/extension-guide.md is true: every Rust and TOML block is an excerpt of the example
extension (examples/kernels, which `make test` builds and tests) appearing there verbatim, and every
Python block runs against that built extension."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs/extension-guide.md").read_text()
KERNELS = ROOT / "examples/kernels"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", GUIDE, re.S)


def test_the_guide_has_code():
    assert len(blocks("rust")) >= 6 and len(blocks("python")) >= 3 and len(blocks("toml")) >= 2


@pytest.mark.parametrize("code", blocks("rust"), ids=lambda c: c.strip().splitlines()[0][:40])
def test_rust_blocks_are_compiled_in_the_example(code):
    assert code in (KERNELS / "src/lib.rs").read_text()


@pytest.mark.parametrize("code", blocks("toml"), ids=lambda c: c.strip().splitlines()[0][:40])
def test_toml_blocks_are_the_examples_build_files(code):
    assert code in (KERNELS / "Cargo.toml").read_text() + (KERNELS / "pyproject.toml").read_text()


@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.strip().splitlines()[-1][:40])
def test_python_blocks_run(code):
    for lib in re.findall(r"^import (\w+)", code, re.M):
        pytest.importorskip(lib)
    if "jax" in code:
        pytest.importorskip("jax").config.update("jax_enable_x64", True)
    exec(compile(code, "docs/extension-guide.md", "exec"), {})
