"""A new user's crate, outside this workspace: the README's and the extension guide's Rust blocks
build as written, and examples/kernels builds when copied out of the repository with only its
`dlbridge` dependency line changed. Each built module is then imported and called from numpy (and
torch and jax where installed), in a subprocess so its module names cannot clash with the
installed example.

The crates are written into a temporary folder (no workspace above them) and built with one
shared target folder, target/downstream, so a second run rebuilds only what changed. Cost on a
2-core machine (measured): 55 s the first time (pyo3, ndarray, rayon and dlbridge built once for
all three crates), 17 s after that (the three small crates themselves, which live in a new
temporary folder each run)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DLBRIDGE = ROOT / "crates/dlbridge"
TARGET = ROOT / "target/downstream"
DEP_LINE = re.compile(r'^dlbridge = \{ path = "[^"]*"', re.M)

pytestmark = pytest.mark.skipif(shutil.which("cargo") is None, reason="needs cargo")


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def point_at_this_clone(manifest: str) -> str:
    """The one edit the docs ask for: the dlbridge dependency's path."""
    new, n = DEP_LINE.subn(f'dlbridge = {{ path = "{DLBRIDGE}"', manifest)
    assert n == 1, "exactly one dlbridge dependency line"
    return new


def build(crate: pathlib.Path) -> pathlib.Path:
    """`cargo build` of a crate outside the workspace; the path of its cdylib."""
    # The workspace's lock, so the user's versions are the tested ones and nothing is fetched.
    shutil.copy(ROOT / "Cargo.lock", crate / "Cargo.lock")
    env = dict(os.environ, CARGO_TARGET_DIR=str(TARGET), PYO3_PYTHON=sys.executable)
    env.pop("RUSTFLAGS", None)
    r = subprocess.run(
        ["cargo", "build", "--quiet", "--message-format=short"],
        cwd=crate, env=env, capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    # The user's crate builds without warnings (dlbridge's own are its tests' business).
    own = [w for w in r.stderr.splitlines() if "warning" in w and not w.startswith(str(DLBRIDGE)) and "`dlbridge`" not in w]
    assert not own, r.stderr
    name = re.search(r'^\[lib\]\n(?:#.*\n)*name = "(\w+)"', (crate / "Cargo.toml").read_text(), re.M)[1]
    return TARGET / "debug" / f"lib{name}.so"


def call(so: pathlib.Path, modules: list[str], code: str, tmp: pathlib.Path) -> None:
    """Runs `code` in a fresh interpreter that imports `so` under each of `modules`' names."""
    mods = tmp / "modules"
    mods.mkdir(exist_ok=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for m in modules:
        shutil.copy(so, mods / f"{m}{suffix}")
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp, env=dict(os.environ, PYTHONPATH=str(mods)), capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_copied_example_and_the_guide_build_outside_the_workspace(tmp_path):
    # examples/kernels, copied out, with only its dlbridge line changed.
    kernels = tmp_path / "kernels"
    shutil.copytree(ROOT / "examples/kernels", kernels, ignore=shutil.ignore_patterns("target", "__pycache__"))
    manifest = kernels / "Cargo.toml"
    manifest.write_text(point_at_this_clone(manifest.read_text()))
    build(kernels)

    # The guide's blocks as written: its Cargo.toml (dlbridge line changed) and its Rust blocks,
    # one after the other, as src/lib.rs.
    guide = (ROOT / "docs/extension-guide.md").read_text()
    crate = tmp_path / "guide"
    (crate / "src").mkdir(parents=True)
    (crate / "Cargo.toml").write_text(point_at_this_clone(blocks(guide, "toml")[0]))
    (crate / "src/lib.rs").write_text("\n".join(blocks(guide, "rust")))
    # The last chapter's file (blocks fenced ```rust title="src/modes.rs"```).
    (crate / "src/modes.rs").write_text("\n".join(re.findall(r'```rust title="src/modes.rs"\n(.*?)```', guide, re.S)))
    (crate / "src/rms_norm.rs").write_text(
        "\n".join(re.findall(r'```rust title="src/rms_norm.rs"\n(.*?)```', guide, re.S))
    )
    (crate / "src/reduce.rs").write_text(
        "\n".join(re.findall(r'```rust title="src/reduce.rs"\n(.*?)```', guide, re.S))
    )
    (crate / "src/context.rs").write_text(
        "\n".join(re.findall(r'```rust title="src/context.rs"\n(.*?)```', guide, re.S))
    )
    (crate / "src/params.rs").write_text(
        "\n".join(re.findall(r'```rust title="src/params.rs"\n(.*?)```', guide, re.S))
    )
    so = build(crate)
    call(so, ["dlbridge_kernels"], """
        import numpy as np
        import dlbridge_kernels as K
        assert K.__file__.startswith(%r)
        y = np.ones(3, dtype=np.float32)
        assert K.saxpy_(2.0, np.arange(3, dtype=np.float32), y) is y and y.tolist() == [1.0, 3.0, 5.0]
        assert K.softmax(np.zeros((2, 2))).tolist() == [[0.5, 0.5], [0.5, 0.5]]
        try:
            import torch
        except ImportError:
            pass
        else:
            assert type(K.saxpy(2.0, torch.ones(3), torch.ones(3))) is torch.Tensor
        try:
            import jax.numpy as jnp
        except ImportError:
            pass
        else:
            out = K.saxpy(2.0, jnp.ones(3, dtype="float32"), jnp.ones(3, dtype="float32"))
            assert out.tolist() == [3.0, 3.0, 3.0]
    """ % str(tmp_path), tmp_path)


def test_the_readmes_rust_blocks_build_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    toml, rust = blocks(readme, "toml"), blocks(readme, "rust")
    assert len(toml) == 1 and len(rust) == 2
    crate = tmp_path / "readme"
    (crate / "src").mkdir(parents=True)
    (crate / "Cargo.toml").write_text(
        '[package]\nname = "my_ext"\nversion = "0.1.0"\nedition = "2024"\n\n' + point_at_this_clone(toml[0])
    )
    # Each block is a whole src/lib.rs; here each is a module of one crate (one build for both).
    for i, code in enumerate(rust):
        (crate / f"src/block{i}.rs").write_text(code)
    (crate / "src/lib.rs").write_text(
        "//! The README's Rust blocks.\n" + "".join(f"mod block{i};\n" for i in range(len(rust)))
    )
    so = build(crate)
    # Both #[pymodule]s are in the one library: imported under each name.
    call(so, ["my_ext", "my_kernels"], """
        import sys
        import numpy as np
        import pytest
        import my_ext, my_kernels

        a = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::-1]
        my_ext.scale_f32(a, 2.0)
        assert a.tolist() == [[4.0, 2.0, 0.0], [10.0, 8.0, 6.0]]
        ro = np.ones(3, np.float32)
        ro.flags.writeable = False
        with pytest.raises(TypeError) as e:
            my_ext.scale_f32(ro, 2.0)
        assert str(e.value) == "expected writable float32 cpu tensor, got read-only float32 (3,) on cpu"
        if sys.version_info >= (3, 11):
            assert e.value.__notes__ == ["while processing 't'"]
        try:
            import dlbridge_scale  # examples/scale: the same kernel over an untyped ManagedTensor
        except ImportError:
            pass
        else:
            with pytest.raises(TypeError) as untyped:
                dlbridge_scale.scale_f32(ro, 2.0)
            assert str(untyped.value) == str(e.value)  # one wording on both paths
        with pytest.raises(TypeError) as e:
            my_ext.scale_f32([1.0, 2.0], 2.0)
        assert str(e.value).startswith("expected an array (an object with __dlpack__ or the buffer protocol), got list")

        x, y = np.arange(3, dtype=np.float32), np.ones(3, np.float32)
        assert my_kernels.saxpy_(2.0, x, y) is y and y.tolist() == [1.0, 3.0, 5.0]
        assert type(my_kernels.double(x)) is np.ndarray and my_kernels.double(x).tolist() == [0.0, 2.0, 4.0]
        assert my_kernels.arange_like(x, 2).tolist() == [0.0, 1.0]
        with pytest.raises(TypeError) as e:
            my_kernels.saxpy_(1.0, x, np.ones(3))
        assert str(e.value) == "expected writable float32 1-d C-contiguous cpu tensor, got float64 (3,) on cpu"
        try:
            import torch
        except ImportError:
            pass
        else:
            t = torch.arange(3, dtype=torch.float32)
            assert type(my_kernels.double(t)) is torch.Tensor
            assert type(my_kernels.arange_like(t, 2)) is torch.Tensor
        try:
            import jax.numpy as jnp
        except ImportError:
            pass
        else:
            assert my_kernels.double(jnp.ones(2, dtype="float32")).tolist() == [2.0, 2.0]
    """, tmp_path)
