"""scripts/module_cycles.py (run by `make lint`) passes on the crate as it is and fails, naming the
circle, when one is planted in a copy of the crate's real source."""

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "module_cycles.py"
SRC = ROOT / "crates" / "dlbridge" / "src"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_self_test_finds_every_planted_kind_of_circle():
    r = run("--self-test")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "planted file, re-export, parent, inline-module and folder circles found" in r.stdout


def test_the_crate_has_no_circle():
    r = run(str(SRC))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no circles" in r.stdout


def test_a_circle_planted_in_the_real_source_fails(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SRC, src)
    # The core's old circle: the requirement types naming the tensor that is checked against them.
    with open(src / "spec.rs", "a") as f:
        f.write("\nfn _planted(_: &crate::managed::ManagedTensor) {}\n")
    r = run(str(src))
    assert r.returncode == 1, r.stdout
    first = r.stdout.splitlines()[0]
    assert first.startswith("circle of ") and "managed" in first and "spec" in first, r.stdout
    assert "spec -> managed: crate::managed::ManagedTensor" in r.stdout


def test_a_room_reaching_back_into_the_python_layers_entry_points_fails(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SRC, src)
    # A room below calling the layer's top (python/mod.rs), which uses every room.
    with open(src / "python" / "runtime" / "release.rs", "a") as f:
        f.write("\nfn _planted(m: &pyo3::Bound<'_, pyo3::types::PyModule>) { let _ = crate::python::init_module(m); }\n")
    r = run(str(src))
    assert r.returncode == 1, r.stdout
    assert "python/runtime/release -> python: crate::python::init_module" in r.stdout
