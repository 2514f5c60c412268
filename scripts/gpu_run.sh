#!/usr/bin/env bash
# run.sh of the GPU bundle (`make gpu-bundle` copies this file to target/gpu-bundle/run.sh): runs
# dlbridge's CUDA tests on a machine with a GPU that builds nothing and fetches nothing.
#
#   bash run.sh [OUTDIR]          (default ./results; PYTHON=... to use another python3.12)
#
# The machine's python3 (CPython 3.12 with its own torch, jax, cupy, numba-cuda, numpy, pytest) is
# used as it is: each wheel goes into a virtualenv that sees the system packages
# (`--system-site-packages`, plus the packages of the virtualenv python3 itself lives in, if it is
# one), installed with `pip install --no-index --no-deps`. Steps, each under `timeout`, all within
# BUDGET seconds (default 330: under 6 minutes with the summary), the most telling first:
#   env            the machine: nvidia-smi, python, the wheels
#   install-hooks  the test-hooks wheel and the example extensions with `gpu` tests, into venv-hooks
#   probe-hooks    the libraries found, the CUDA device, zero-copy on CUDA through the public API,
#                  which types publish exchange tables, and which fast paths are active (numpy
#                  struct fast path, torch ATen bits, exchange tables on CPU and CUDA,
#                  current_work_stream, the CUDA driver), read through the test hooks
#   gpu            `pytest --pyargs dlbridge -m gpu` (every gpu test: some need the hooks)
#   examples-X     each bundled example's tests (its gpu cases and the rest)
#   install-release, probe-release, gpu-release
#                  the same with the release wheel (no test hooks, as users get it)
#   bench-X        each bench/gpu_*.py, if the bundle has any (none exist yet: the summary says so)
#   suite          `pytest --pyargs dlbridge`, the whole shipped suite, with the hooks wheel and what
#                  is left of the budget; in pytest-xdist workers where the machine has xdist and 8+
#                  cores (SUITE_WORKERS=N to choose, 0 for serial)
# OUTDIR gets at most 8 files (what a device tool brings back): summary.md (the counts per step,
# the gpu tests one by one, missing libraries, fast paths, timings), summary.json, failures.txt
# (each failing test's traceback), run.log (this script's output) and logs.tar.gz (each step's
# log, pytest's junit XML and the per-test JSON lines). Exit status 0 when every step exited 0
# and no test failed; skipped tests are counted as skipped, never as passed.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:-./results}
mkdir -p "$out" && out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
budget=${BUDGET:-330}
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/dlbridge-gpu.XXXXXX")
mkdir -p "$work/logs" "$work/plugin"
cp "$here/gpu_report.py" "$work/plugin/gpu_report.py"
: >"$work/steps.tsv"
exec > >(tee "$out/run.log") 2>&1
teepid=$!

finish() {
  # The summary is written whatever happened before (a step killed, a failed install).
  "$py" "$work/plugin/gpu_report.py" summarize "$out" "$work"
  local rc=$?
  (cd "$work" && tar czf "$out/logs.tar.gz" logs steps.tsv env.txt 2>/dev/null)
  echo "== results in $out ($(ls "$out" | tr '\n' ' ')); $((SECONDS - start)) s in all"
  rm -rf "$work"
  exec >&- 2>&-
  wait "$teepid" 2>/dev/null  # run.log is complete before the caller collects OUTDIR
  return $rc
}

# record NAME KIND RC SECONDS LIMIT NOTE
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$work/steps.tsv"; }

# step NAME KIND CAP COMMAND...: runs COMMAND under `timeout` (CAP seconds, less when the budget is
# nearly spent; 25 s are kept for the summary), its output to logs/NAME.log.
step() {
  local name=$1 kind=$2 cap=$3 left limit t0 rc secs
  shift 3
  left=$((budget - (SECONDS - start) - 25))
  limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    echo "== $name: not run, the time budget ($budget s) is spent"
    record "$name" "$kind" -1 0 0 "not run: time budget spent"
    return 1
  fi
  echo "== $name (at most $limit s)"
  t0=$EPOCHREALTIME
  DLBRIDGE_GPU_REPORT="$work/logs/$name.jsonl" timeout -k 10 "$limit" "$@" >"$work/logs/$name.log" 2>&1
  rc=$?
  secs=$(awk -v s="$t0" -v e="$EPOCHREALTIME" 'BEGIN { printf "%.1f", e - s }')
  local note=""
  ((rc == 124 || rc == 137)) && note="killed at its $limit s limit"
  record "$name" "$kind" "$rc" "$secs" "$limit" "$note"
  echo "   rc=$rc in $secs s${note:+ ($note)}: $(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|deselected)|^(=+ )?no tests ran' "$work/logs/$name.log" | tail -1 | tr -d '=')"
  if ((rc != 0)); then tail -n 15 "$work/logs/$name.log" | sed 's/^/   | /'; fi
  return $rc
}

{
  echo "date:    $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(uname -n)"
  echo "gpu:     $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | paste -sd ';' || echo 'nvidia-smi: none')"
  echo "python:  $("$py" -c 'import sys; print(sys.version.split()[0], sys.executable)' 2>&1)"
  echo "bundle:  $(sed -n 2,3p "$here/BUNDLE.txt" 2>/dev/null | paste -sd ';')"
  echo "wheels:  $(cd "$here" && ls wheels/*/*.whl | paste -sd ' ')"
} | tee "$work/env.txt"
record env info 0 0 0 "see the header"

if ! "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  echo "run.sh: $py is not Python 3.12: the bundle's wheels are cp312 (set PYTHON)"
  record python cmd 1 0 0 "$py is not Python 3.12"
  finish
  exit 1
fi

# make_venv DIR WHEEL...: a virtualenv that sees what $py sees, with the wheels installed.
make_venv() {
  local venv=$1 site
  shift
  "$py" -m venv --system-site-packages --without-pip "$venv" || return 1
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || return 1
  # If $py is itself a virtualenv, --system-site-packages gives only its base interpreter's
  # packages: add $py's own site directories (their .pth files processed), after the new venv's.
  "$py" - "$site/_outer_site.pth" <<'PY' || return 1
import site, sys
dirs = [d for d in site.getsitepackages() + [site.getusersitepackages()] if d]
with open(sys.argv[1], "w") as f:
    f.write("import site; [site.addsitedir(d) for d in %r]\n" % dirs)
PY
  if "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install --no-index --no-deps --ignore-installed --disable-pip-version-check \
      --no-warn-script-location "$@" || return 1
  elif "$venv/bin/python" -m ensurepip --default-pip >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install --no-index --no-deps --ignore-installed --disable-pip-version-check "$@" || return 1
  else
    echo "no pip for $py: unpacking the wheels into $site (they hold only the package and its dist-info)"
    "$venv/bin/python" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
      "$site" "$@" || return 1
  fi
  # The installed wheel is what imports (not a copy elsewhere on the path).
  (cd "$work" && "$venv/bin/python" -c '
import sys, dlbridge
assert dlbridge.__file__.startswith(sys.prefix), dlbridge.__file__
print("dlbridge", dlbridge.__version__, "from", dlbridge.__file__, "test hooks:", hasattr(dlbridge._dlbridge, "_view"))
')
}

export -f make_venv
export py work
# jax takes 75% of the GPU's memory at its first use by default: several processes (spawn
# children, xdist workers) and torch/cupy share the GPU here.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$work/plugin${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# pytest-timeout, where the machine has it: one hanging test fails alone instead of the step.
pytest_args=(-q -p no:cacheprovider -p gpu_report -rfEs)
if "$py" -c 'import pytest_timeout' 2>/dev/null; then pytest_args+=(--timeout=90); fi

# pytest_step NAME CAP VENV ARGS...: pytest from outside any source tree, with its junit XML.
pytest_step() {
  local name=$1 cap=$2 venv=$3
  shift 3
  step "$name" pytest "$cap" bash -c 'cd "$1" && shift && exec "$@"' _ "$work" \
    "$venv/bin/python" -m pytest "${pytest_args[@]}" --junitxml="$work/logs/$name.xml" "$@"
}

probe_step() { # probe_step NAME VENV
  step "$1" probe 90 bash -c 'cd "$1" && "$2" "$3" probe >"$4"' _ "$work" "$2/bin/python" \
    "$work/plugin/gpu_report.py" "$work/logs/$1.json"
}

# Most telling first: the suite, the longest, runs last with what is left of the budget (a step
# killed at its limit keeps the results of the tests it ran).
hk="$work/venv-hooks"
if step install-hooks cmd 60 bash -c 'make_venv "$@"' _ "$hk" "$here"/wheels/hooks/*.whl "$here"/wheels/examples/*.whl; then
  probe_step probe-hooks "$hk"
  pytest_step gpu 90 "$hk" --pyargs dlbridge -m gpu
  for dir in "$here"/tests/*/; do
    [[ -d "$dir" ]] || continue
    pytest_step "examples-$(basename "$dir")" 60 "$hk" "$dir"
  done
fi
rel="$work/venv-release"
if step install-release cmd 60 bash -c 'make_venv "$@"' _ "$rel" "$here"/wheels/release/*.whl; then
  probe_step probe-release "$rel"
  pytest_step gpu-release 60 "$rel" --pyargs dlbridge -m gpu
fi
if [[ -x "$hk/bin/python" ]]; then
  if compgen -G "$here/bench/gpu_*.py" >/dev/null; then
    for b in "$here"/bench/gpu_*.py; do
      step "bench-$(basename "$b" .py)" cmd 60 bash -c 'cd "$1" && "$2" "$3"' _ "$work" "$hk/bin/python" "$b"
    done
    echo "CUDA benchmarks: see the bench-* steps and their logs in logs.tar.gz" >"$work/bench_note.txt"
  else
    echo "No CUDA benchmarks exist yet (bench/ has no gpu_*.py): none run." >"$work/bench_note.txt"
  fi
  # The whole shipped suite, gpu tests included, in SUITE_WORKERS processes (pytest-xdist, each
  # test file in one process) where the machine has pytest-xdist and 8 cores or more; else serially.
  workers=${SUITE_WORKERS:-}
  if [[ -z "$workers" ]]; then
    workers=0
    if "$py" -c 'import xdist' 2>/dev/null && (($(nproc) >= 8)); then workers=6; fi
  fi
  parallel=()
  ((workers > 0)) && parallel=(-n "$workers" --dist loadfile)
  echo "suite:   ${workers} pytest-xdist workers (0: serial)" >>"$work/env.txt"
  pytest_step suite 300 "$hk" --durations=10 "${parallel[@]}" --pyargs dlbridge
fi

finish
exit $?
