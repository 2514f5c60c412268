"""Builds bench/shim-nanobind (the nanobind twin of bench/shim-dlbridge's argument and result
functions) with the system C++ compiler against the nanobind package installed in this Python,
the way nanobind's own CMake does a release build (-O3, nanobind's core in the same module, hidden
symbols, compact assertions). The module goes to OUT_DIR (default: target/bench-nanobind in the
repository), never into the source tree; it is rebuilt only when this script, the C++ source or
the nanobind version changed.

    python bench/shim-nanobind/build.py [OUT_DIR]
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SOURCE = HERE / "shim_nanobind.cpp"
MODULE = "shim_nanobind"
DEFAULT_OUT = ROOT / "target" / "bench-nanobind"


def flags() -> list[str]:
    import nanobind

    nb = Path(nanobind.__file__).resolve().parent
    return [
        "-O3", "-DNDEBUG", "-DNB_COMPACT_ASSERTIONS", "-std=c++17", "-fPIC", "-fvisibility=hidden",
        "-fno-strict-aliasing", "-fno-stack-protector", "-ffunction-sections", "-fdata-sections",
        "-I", sysconfig.get_paths()["include"], "-I", nanobind.include_dir(),
        "-I", str(nb / "ext" / "robin_map" / "include"),
        # nanobind's CMake uses the faster TLS model where the compiler has it (x86-64 Linux).
        *(["-mtls-dialect=gnu2"] if platform.machine() == "x86_64" and sys.platform == "linux" else []),
    ]


def build(out_dir: Path = DEFAULT_OUT) -> Path:
    """The built module's directory (put it on sys.path and import shim_nanobind)."""
    import nanobind

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "g++")
    key = hashlib.sha256(
        "\0".join([nanobind.__version__, cxx, *flags(), SOURCE.read_text(), Path(__file__).read_text()]).encode()
    ).hexdigest()
    lib = out_dir / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    stamp = out_dir / "build-key"
    if lib.exists() and stamp.exists() and stamp.read_text() == key:
        return out_dir
    core = out_dir / f"nb_combined-{nanobind.__version__}.o"
    steps = [
        [cxx, *flags(), "-c", str(Path(nanobind.source_dir()) / "nb_combined.cpp"), "-o", str(core)],
        [cxx, *flags(), "-c", str(SOURCE), "-o", str(out_dir / f"{MODULE}.o")],
        [cxx, "-shared", "-Wl,-s", "-Wl,--gc-sections", str(out_dir / f"{MODULE}.o"), str(core), "-o", str(lib)],
    ]
    print(f"building {lib.name} (nanobind {nanobind.__version__}, {cxx} -O3)", flush=True)
    for cmd in steps:
        print("  " + shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    stamp.write_text(key)
    return out_dir


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)
