"""The README's examples work as written: the Python block runs, and the Rust #[pyfunction] is
compiled into the example extension verbatim and behaves as described."""

import pathlib
import re

import numpy as np

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


def test_rust_example_is_the_one_compiled_into_the_example_extension():
    fn = block("rust").split("use pyo3::prelude::*;\n", 1)[1].strip()
    assert fn in (ROOT / "examples/scale/src/lib.rs").read_text()
    import dlbridge_scale

    a = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::-1]
    dlbridge_scale.scale_f32(a, 2.0)
    assert a.tolist() == [[4.0, 2.0, 0.0], [10.0, 8.0, 6.0]]


def test_kernel_examples_are_compiled_into_the_kernels_extension():
    src = (ROOT / "examples/kernels/src/lib.rs").read_text()
    for code in blocks("rust")[1:]:
        assert code in src
