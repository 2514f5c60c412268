#!/usr/bin/env bash
# `make gpu-bundle`: everything a lent GPU machine needs to run dlbridge's CUDA tests, in one folder
# (target/gpu-bundle, at most 64 MiB), so the run there builds nothing and fetches nothing. The
# machine's python3 is CPython 3.12 with its own torch, jax, cupy, numba-cuda and numpy (not the
# versions pinned here): the wheels are built for cp312 and carry no dependency metadata beyond
# the `test` extra, and run.sh installs them with --no-deps.
#
#   wheels/release/   dlbridge as users get it: release, `--compatibility pypi` (the lowest
#                     manylinux tag the binary meets, which maturin's own audit checks), no test hooks
#   wheels/hooks/     the same release build with the `test-hooks` feature: the `gpu` tests need it
#                     (test_xla_cuda's CUDA handler is a hook, test_cuda_ipc's spawn-child test reads
#                     `_cuda_ipc_mappings`), and so do the fast-path probes (`_numpy_fast_path`,
#                     `_torch_bits_from_aten`, `_cuda_driver_available`, `_table_allocate`, ...)
#   wheels/examples/  every example extension whose tests have `gpu` cases (release, cp312)
#   tests/NAME/       those examples' test files (the shipped suite is inside the dlbridge wheel)
#   bench/            CUDA benchmarks: bench/gpu_*.py, copied when any exist (none yet)
#   run.sh            scripts/gpu_run.sh: `bash run.sh OUTDIR` (see there)
#   gpu_report.py     scripts/gpu_report.py: the pytest plugin, the probe and the summary run.sh uses
#   BUNDLE.txt        what was built, from which commit, with which tags and sizes
#
# The release build has its own CARGO_TARGET_DIR (target/gpu-bundle-build), so dev builds under
# target/ stay valid and a second `make gpu-bundle` rebuilds only what changed. Each step's time
# is printed.
#
#   bash scripts/gpu_bundle.sh            (PY312=/path/to/python3.12 to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out="$root/target/gpu-bundle"
limit_mib=64
maturin="$root/.venv/bin/maturin"
[[ -x "$maturin" ]] || { echo "gpu-bundle: $maturin is missing (make develop installs it)" >&2; exit 1; }

# The interpreter the wheels are built for: CPython 3.12 (the GPU machine's), as scripts/matrix.sh
# finds it (pyenv), or PY312.
py=${PY312:-}
if [[ -z "$py" ]]; then
  pyenv_root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  base=$(ls -d "$pyenv_root"/versions/3.12.* 2>/dev/null | sort -V | tail -1 || true)
  py=${base:+$base/bin/python3.12}
  [[ -n "$py" && -x "$py" ]] || py=$(command -v python3.12 || true)
fi
[[ -n "$py" && -x "$py" ]] || { echo "gpu-bundle: no CPython 3.12 found (set PY312)" >&2; exit 1; }
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 12) and sys.implementation.name == "cpython", sys.version' \
  || { echo "gpu-bundle: $py is not CPython 3.12" >&2; exit 1; }

export CARGO_TARGET_DIR="$root/target/gpu-bundle-build"
export PYO3_PYTHON="$py"
unset VIRTUAL_ENV CONDA_PREFIX

timings=()
step() { # step NAME COMMAND...: runs it, records its wall time
  local name=$1 start
  shift
  echo "== gpu-bundle: $name"
  start=$EPOCHREALTIME
  "$@"
  timings+=("$(awk -v n="$name" -v s="$start" -v e="$EPOCHREALTIME" 'BEGIN { printf "%-16s %7.1f s", n, e - s }')")
}

# Example extensions whose tests have `gpu` cases.
mapfile -t examples < <(grep -lE 'pytest\.mark\.gpu' examples/*/tests/*.py 2>/dev/null | cut -d/ -f2 | sort -u)

build() { # build DIR OUTDIR [maturin args...]
  local dir=$1 dest=$2
  shift 2
  (cd "$dir" && "$maturin" build --quiet --release --compatibility pypi -i "$py" -o "$dest" "$@")
  local whl
  whl=$(ls "$dest"/*.whl)
  # A cp312 wheel for x86-64 manylinux: what pip on the GPU machine (CPython 3.12, glibc 2.34+)
  # accepts; a plain `linux` tag or another Python's would be refused there.
  [[ "$(basename "$whl")" =~ -cp312-cp312-manylinux_2_[0-9]+_x86_64(\.[a-z0-9_]+)*\.whl$ ]] \
    || { echo "gpu-bundle: $(basename "$whl") is not a cp312 manylinux x86-64 wheel" >&2; exit 1; }
}

rm -rf "$out"
mkdir -p "$out/wheels/release" "$out/wheels/hooks" "$out/wheels/examples" "$out/tests"
step "dlbridge" build . "$out/wheels/release"
step "dlbridge+hooks" build . "$out/wheels/hooks" --features test-hooks
for ex in "${examples[@]}"; do
  step "$ex" build "examples/$ex" "$out/wheels/examples"
  mkdir -p "$out/tests/$ex"
  cp examples/"$ex"/tests/*.py "$out/tests/$ex/"
done

# The release wheel has no hooks, the other has them (the same check as `make hooks-absent`).
"$py" - "$out" <<'PY'
import glob, sys, zipfile
out = sys.argv[1]
def so(path):
    z = zipfile.ZipFile(path)
    names = [n for n in z.namelist() if n.endswith(".so")]  # one extension, built for 3.12
    assert len(names) == 1 and names[0].startswith("dlbridge/_dlbridge.cpython-312-"), (path, names)
    return z.read(names[0])
release, = glob.glob(f"{out}/wheels/release/dlbridge-*.whl")
hooks, = glob.glob(f"{out}/wheels/hooks/dlbridge-*.whl")
assert b"_view_then" not in so(release), "test hooks in the release wheel"
assert b"_view_then" in so(hooks), "no test hooks in the hooks wheel"
names = zipfile.ZipFile(release).namelist()
assert any(n.startswith("dlbridge/tests/") and n.endswith("conftest.py") for n in names), "the wheel lacks the shipped tests"
PY

# CUDA benchmarks, if any exist (bench/gpu_*.py); run.sh reports that none exist otherwise.
if compgen -G "bench/gpu_*.py" >/dev/null; then
  mkdir -p "$out/bench"
  cp bench/gpu_*.py "$out/bench/"
fi
cp scripts/gpu_run.sh "$out/run.sh"
cp scripts/gpu_report.py "$out/gpu_report.py"

{
  echo "dlbridge GPU bundle: bash run.sh OUTDIR (from any directory)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) with $("$py" -V) ($(ldd --version | head -1))"
  echo "examples with gpu tests: ${examples[*]:-none}"
  (cd "$out" && find . -type f ! -name BUNDLE.txt | sort | xargs stat -c '%s %n' | awk '{printf "  %10d  %s\n", $1, $2}')
} >"$out/BUNDLE.txt"

# At most 64 MiB: what the device tool carries (the repository's tracked files count too).
size=$(du -sb "$out" | cut -f1)
tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
echo "== gpu-bundle: timings"
printf '%s\n' "${timings[@]}"
cat "$out/BUNDLE.txt"
awk -v b="$size" -v t="$tree" 'BEGIN { printf "gpu-bundle: %.1f MiB in target/gpu-bundle (+ %.1f MiB of tracked files travel with it)\n", b / 1048576, t / 1048576 }'
if ((size + tree > limit_mib * 1048576)); then
  echo "gpu-bundle: the bundle and the tracked files exceed $limit_mib MiB" >&2
  exit 1
fi
