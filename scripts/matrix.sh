#!/usr/bin/env bash
# The Python matrix: dlbridge built for every supported CPython (besides the main .venv's 3.11,
# which `make py-test` covers with every library), each with its own virtualenv, and the shipped
# suite (`pytest --pyargs dlbridge`) run on it. Every interpreter gets numpy, ml_dtypes,
# array-api-strict and pyarrow (the newest each publishes wheels for); 3.12, 3.14 and 3.15 also get
# torch (3.12 is the GPU machine's Python), 3.12 and 3.14 jax, 3.14 Ray too, each at
# python/requirements-test.txt's pin. Ray and jaxlib publish no cp315 wheels, tensorflow none for
# cp314 or cp315: those tests skip. Right after 3.12's suite, scripts/torch_older.sh runs the torch
# tests of the same 3.12 wheels (dlbridge's and the example extensions') against the pinned torch
# and against an older one (python/requirements-torch-older.txt: 2.11, the GPU machine's).
#
# Where the interpreters come from: 3.10, 3.12 and 3.13 from pyenv on this machine; 3.14 and 3.15
# from Debian unstable, in a sid root that scripts/sid_root.sh makes once (cached outside the
# clone) and mounts for the run: this script runs again inside it for those versions
# (DLBRIDGE_IN_SID_ROOT=1), the checkout at the same path. An interpreter that cannot be had is
# reported as missing, not passed.
#
# Disk: torch's wheel from PyPI pulls about 4 GB of CUDA libraries (nvidia-*, triton). The nvidia-*
# wheels are not tied to a Python version, so torch is installed without dependencies and given
# .venv's copy of them (same torch pin, so the same libraries) by a symlink (the sid root sees that
# folder, bind-mounted read-only at its own path); triton (only torch.compile's GPU code generation
# needs it) is left out. That keeps `make test` within the disk of a CI machine. Where .venv's torch
# has no CUDA wheels or another version, torch comes with every dependency. The stamp records which.
#
#   MATRIX="3.10 3.12 3.13 3.14 3.15" bash scripts/matrix.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
versions=${MATRIX:-"3.10 3.12 3.13 3.14 3.15"}
with_torch=${MATRIX_TORCH:-"3.12 3.14 3.15"}
with_ray=${MATRIX_RAY:-"3.14"}
with_jax=${MATRIX_JAX:-"3.12 3.14"}
with_older_torch=${MATRIX_OLDER_TORCH:-"3.12"}
from_sid=${MATRIX_SID:-"3.14 3.15"}
inside=${DLBRIDGE_IN_SID_ROOT:-}
pin() { # the line of python/requirements-test.txt that pins $1
  grep -E "^$1==" python/requirements-test.txt \
    || { echo "matrix: python/requirements-test.txt has no $1== pin" >&2; exit 1; }
}
has() { [[ " $1 " == *" $2 "* ]]; }
pyenv_root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
summary=()
status=0
sid=()
mkdir -p target/matrix

# Torch's requirements as .venv's torch (the same pin) states them, but for the CUDA wheels (shared)
# and triton; written to a file the sid root sees too. Nothing is shared (every dependency
# installed) where .venv has no CUDA wheels or another torch.
deps_file="$root/target/matrix/torch-deps.txt"
shared_file="$root/target/matrix/torch-shared-nvidia"
if [[ -z "$inside" ]]; then
  rm -f "$deps_file" "$shared_file"
  shared=$("$root/.venv/bin/python" -c '
import importlib.util as u
s = u.find_spec("nvidia")
print(next(iter(s.submodule_search_locations)) if s and s.submodule_search_locations else "")
' 2>/dev/null || true)
  torch_pin=$(pin torch)
  if [[ -n "$shared" ]] && "$root/.venv/bin/python" - "${torch_pin#torch==}" >"$deps_file.tmp" <<'PY' && [[ -s "$deps_file.tmp" ]]; then
import importlib.metadata as m, sys
if m.version("torch").split("+")[0] != sys.argv[1]:
    sys.exit(1)
for r in m.requires("torch") or []:
    name = r.split(";")[0].strip().lower()
    if "extra ==" not in r and not name.startswith(("nvidia-", "cuda-toolkit", "triton")):
        print(r)
PY
    mv "$deps_file.tmp" "$deps_file"
    realpath "$shared" >"$shared_file"
  fi
  rm -f "$deps_file.tmp"
fi
shared=$(cat "$shared_file" 2>/dev/null || true)

for v in $versions; do
  if [[ -n "$inside" ]]; then
    py=/usr/bin/python$v
    [[ -x "$py" ]] || { summary+=("$v: not in the sid root (not tested)"); status=1; continue; }
  else
    base=$(ls -d "$pyenv_root"/versions/"$v".* 2>/dev/null | sort -V | tail -1 || true)
    py="$base/bin/python$v"
    if [[ -z "$base" || ! -x "$py" ]]; then
      if has "$from_sid" "$v"; then sid+=("$v"); else summary+=("$v: not installed on this machine (not tested)"); fi
      continue
    fi
  fi
  venv="$root/.venv-$v"
  stamp="$venv/.installed"
  libs="pytest numpy ml_dtypes array-api-strict pyarrow"
  # Inside the sid root .venv's maturin (a host interpreter's script) cannot run: each venv has its own.
  [[ -n "$inside" ]] && libs+=" $(pin maturin)"
  torch="" mode="" ray=""
  if has "$with_torch" "$v"; then
    torch=$(pin torch)
    if [[ -n "$shared" && -s "$deps_file" ]]; then mode="shared-nvidia($(tr '\n' ' ' <"$deps_file"))"; else mode="plain"; fi
  fi
  has "$with_ray" "$v" && ray=$(pin ray)
  # flatbuffers: jax.export's serialization (examples/kernels' tests, run on 3.12 by torch_older.sh).
  has "$with_jax" "$v" && libs+=" $(pin 'jax\[cpu\]') flatbuffers"
  want="$libs${torch:+ $torch $mode}${ray:+ $ray}"
  t0=$SECONDS
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "== CPython $v: installing $libs${torch:+ $torch}${ray:+ $ray}"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    set -f # jax[cpu] is not a glob
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install --quiet $libs
    set +f
    if [[ "$mode" == shared-nvidia* ]]; then
      "$venv/bin/python" -m pip install --quiet --no-deps "$torch"
      "$venv/bin/python" -m pip install --quiet --no-warn-conflicts -r "$deps_file"
    elif [[ -n "$torch" ]]; then
      "$venv/bin/python" -m pip install --quiet "$torch"
    fi
    [[ -n "$ray" ]] && "$venv/bin/python" -m pip install --quiet "$ray"
    echo "$want" >"$stamp"
  fi
  if [[ "$mode" == shared-nvidia* ]]; then
    site=$(ls -d "$venv"/lib/python3.*/site-packages)
    ln -sfn "$shared" "$site/nvidia"
  fi
  t_install=$((SECONDS - t0))
  # Every library asked for must import: a broken one would only make its tests skip.
  mods="numpy ml_dtypes array_api_strict pyarrow${torch:+ torch}${ray:+ ray}"
  has "$with_jax" "$v" && mods+=" jax"
  # shellcheck disable=SC2086
  (cd /tmp && "$venv/bin/python" -c "import sys, importlib; [importlib.import_module(m) for m in sys.argv[1:]]" $mods)
  echo "== CPython $v: building dlbridge"
  t0=$SECONDS
  if [[ -n "$inside" ]]; then
    # Its own target directory: build scripts linked against sid's C library do not run on the host.
    target="$root/target/matrix-sid" maturin="$venv/bin/maturin"
  else
    target="$root/target/matrix" maturin="$root/.venv/bin/maturin"
  fi
  out="$target/wheels-$v"
  rm -rf "$out"
  CARGO_TARGET_DIR="$target" PYO3_PYTHON="$venv/bin/python" \
    "$maturin" build --quiet --features test-hooks -i "$venv/bin/python" -o "$out"
  "$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$out"/dlbridge-*.whl
  t_build=$((SECONDS - t0))
  echo "== CPython $v: the shipped suite"
  t0=$SECONDS
  # The whole output (failures, warnings, every skip's reason) is kept; failures and counts shown.
  log="$root/target/matrix/suite-$v.log"
  set +e
  (cd /tmp && "$venv/bin/python" -m pytest -q -p no:cacheprovider -rfEs --pyargs dlbridge) >"$log" 2>&1
  rc=$?
  set -e
  grep -E "^(FAILED|ERROR) |^[0-9]+ (passed|failed)|^(no tests ran|[0-9]+ error)" "$log" || tail -20 "$log"
  echo "   (the whole output: $log)"
  t_suite=$((SECONDS - t0))
  line=$(grep -E "^[0-9]+ (passed|failed)" "$log" | tail -1 || true)
  found=$("$venv/bin/python" -c "import sys, numpy, importlib.util as u; print('%d.%d.%d' % sys.version_info[:3], 'numpy', numpy.__version__, *[m for m in ('torch', 'ray', 'jax', 'pyarrow', 'ml_dtypes', 'array_api_strict') if u.find_spec(m)])")
  summary+=("$v: ${line:-no result} ($found; install ${t_install} s, build ${t_build} s, suite ${t_suite} s)")
  [[ $rc -ne 0 ]] && status=1
  if [[ -z "$inside" ]] && has "$with_older_torch" "$v"; then
    # Now, while target/matrix's pyo3 is configured for this interpreter.
    t0=$SECONDS
    older_sum="$root/target/matrix/torch-older-summary.txt"
    rm -f "$older_sum"
    TORCH_OLDER_PYTHON=$v TORCH_OLDER_SUMMARY="$older_sum" bash scripts/torch_older.sh || status=1
    if [[ -s "$older_sum" ]]; then mapfile -t -O "${#summary[@]}" summary <"$older_sum"; else summary+=("$v older torch: no result"); status=1; fi
    summary+=("$v older torch: whole step $((SECONDS - t0)) s")
  fi
done

if [[ -n "$inside" ]]; then
  # The caller outside the root prints these.
  printf '%s\n' "${summary[@]}" >"${MATRIX_SUMMARY:-/dev/stdout}"
  exit $status
fi

if ((${#sid[@]})) && [[ $(id -u) != 0 ]]; then
  summary+=("${sid[*]}: not tested (the sid root they come from needs root)")
elif ((${#sid[@]})); then
  # 3.14 and 3.15 from the sid root: this script again, inside it.
  t0=$SECONDS
  if bash scripts/sid_root.sh setup; then
    t_setup=$((SECONDS - t0))
    sum="$root/target/matrix/sid-summary.txt"
    rm -f "$sum"
    set +e
    SID_BINDS="$shared" MATRIX="${sid[*]}" MATRIX_SUMMARY="$sum" bash scripts/sid_root.sh run bash "$root/scripts/matrix.sh"
    rc=$?
    set -e
    [[ $rc -ne 0 ]] && status=1
    if [[ -s "$sum" ]]; then mapfile -t -O "${#summary[@]}" summary <"$sum"; else summary+=("${sid[*]}: no result from the sid root (exit $rc)"); fi
    summary+=("sid root (3.14, 3.15): set-up ${t_setup} s, whole run $((SECONDS - t0)) s")
  else
    summary+=("${sid[*]}: the sid root could not be set up (not tested)")
    status=1
  fi
fi
echo "== Python matrix"
printf '  %s\n' "${summary[@]}"
exit $status
