"""The extension guide's chapter on optional tensors and lists of tensors is
examples/kernels/src/params.rs, whole: its ```rust title="src/params.rs"``` blocks one after the
other are that file (examples/kernels/tests/test_params.py tests it); its Python blocks run in
test_extension_guide.py."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs/extension-guide.md").read_text()


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_the_params_blocks_are_the_whole_file_in_order():
    blocks = re.findall(r'```rust title="src/params.rs"\n(.*?)```', GUIDE, re.S)
    assert len(blocks) >= 4
    assert lines("\n".join(blocks)) == lines((ROOT / "examples/kernels/src/params.rs").read_text())


def test_the_chapter_shows_both_kinds_in_every_mode():
    chapter = GUIDE[GUIDE.index("## 12. Optional tensors and lists of tensors"):]
    for needle in ("optional:", "lists:", "TensorList", "optional_input", "input_list", ".count", "jax.jit",
                   "jax.vmap", "jax.grad", "fullgraph=True", "Tensor?", "Tensor[]"):
        assert needle in chapter, needle
