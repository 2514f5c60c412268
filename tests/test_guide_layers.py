"""The extension guide's chapter on a layer with a weight gradient is
examples/kernels/src/rms_norm.rs, whole: its ```rust title="src/rms_norm.rs"``` blocks one after the
other are that file (examples/kernels/tests/test_layers.py and test_results.py test it); its Python
blocks run in test_extension_guide.py."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs/extension-guide.md").read_text()


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_the_rms_norm_blocks_are_the_whole_file_in_order():
    blocks = re.findall(r'```rust title="src/rms_norm.rs"\n(.*?)```', GUIDE, re.S)
    assert len(blocks) >= 4
    assert lines("\n".join(blocks)) == lines((ROOT / "examples/kernels/src/rms_norm.rs").read_text())


def test_the_chapter_shows_the_layer_in_both_frameworks():
    chapter = GUIDE[GUIDE.index("## 10. A layer with a weight gradient"):]
    for needle in ("results:", ".residual()", "nn.Parameter", "fullgraph=True", ".backward()", "jax.jit", "jax.grad",
                   "torch.nn.RMSNorm", "setup_context", "custom_vjp"):
        assert needle in chapter, needle


def test_the_context_blocks_are_the_whole_file_in_order():
    blocks = re.findall(r'```rust title="src/context.rs"\n(.*?)```', GUIDE, re.S)
    assert len(blocks) == 3
    assert lines("\n".join(blocks)) == lines((ROOT / "examples/kernels/src/context.rs").read_text())


def test_the_reduce_block_is_the_whole_file():
    """The guide's lib.rs declares `mod reduce;`: the file is shown whole (a folded block), so the
    crate the guide describes builds from the guide alone (test_downstream builds it)."""
    blocks = re.findall(r'```rust title="src/reduce.rs"\n(.*?)```', GUIDE, re.S)
    assert len(blocks) == 1
    assert lines(blocks[0]) == lines((ROOT / "examples/kernels/src/reduce.rs").read_text())
