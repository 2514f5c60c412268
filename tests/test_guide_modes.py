"""The extension guide's last chapter (every mode) is examples/kernels/src/modes.rs, whole: its
```rust title="src/modes.rs"``` blocks one after the other are that file (which `make test` builds
and examples/kernels/tests/test_modes.py tests); its Python blocks run in test_extension_guide.py."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs/extension-guide.md").read_text()


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_the_modes_blocks_are_the_whole_file_in_order():
    blocks = re.findall(r'```rust title="src/modes.rs"\n(.*?)```', GUIDE, re.S)
    assert len(blocks) >= 4
    assert lines("\n".join(blocks)) == lines((ROOT / "examples/kernels/src/modes.rs").read_text())


def test_the_chapter_is_there_and_shows_every_mode():
    chapter = GUIDE[GUIDE.index("## 9. Every mode"):]
    for needle in ("jax.jit", "jax.vmap", "jax.grad", "torch.compile", "fullgraph=True", "gradcheck", "mutates_args"):
        assert needle in chapter, needle
