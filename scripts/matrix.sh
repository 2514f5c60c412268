#!/usr/bin/env bash
# The Python matrix: dlbridge built for every supported CPython this machine has (besides the main
# .venv's 3.11, which `make py-test` covers with every library), each with its own virtualenv, and
# the shipped suite (`pytest --pyargs dlbridge`) run on it. Every interpreter gets numpy, ml_dtypes,
# array-api-strict and pyarrow (the newest each publishes wheels for); 3.12 also gets torch (the
# GPU machine's Python). An interpreter the machine lacks is reported as missing, not passed.
#
# Disk: torch's wheel from PyPI pulls about 4 GB of CUDA libraries (nvidia-*, triton). The nvidia-*
# wheels are not tied to a Python version, so 3.12's torch is installed without dependencies and
# given .venv's copy of them (same torch pin, so the same libraries) by a symlink; triton (only
# torch.compile's GPU code generation needs it) is left out. That keeps `make test` within the
# disk of a CI machine. Where .venv's torch has no CUDA wheels or another version, 3.12 gets torch
# with every dependency. The stamp records which.
#
#   MATRIX="3.10 3.12 3.13" bash scripts/matrix.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
versions=${MATRIX:-"3.10 3.12 3.13"}
maturin="$root/.venv/bin/maturin"
pyenv_root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
summary=()
status=0
for v in $versions; do
  base=$(ls -d "$pyenv_root"/versions/"$v".* 2>/dev/null | sort -V | tail -1 || true)
  py="$base/bin/python$v"
  if [[ -z "$base" || ! -x "$py" ]]; then
    summary+=("$v: not installed on this machine (not tested)")
    continue
  fi
  venv="$root/.venv-$v"
  stamp="$venv/.installed"
  libs="pytest numpy ml_dtypes array-api-strict pyarrow"
  torch="" deps=() shared="" mode=""
  if [[ "$v" == "3.12" ]]; then
    torch=$(grep -E '^torch==' python/requirements-test.txt) \
      || { echo "matrix: python/requirements-test.txt has no torch== pin" >&2; exit 1; }
    # torch's own requirements as .venv's torch (the same pin) states them, but for the CUDA
    # wheels (shared below) and triton; plain torch with every dependency where that is not
    # possible (no .venv torch with CUDA wheels, or another version).
    shared=$(ls -d "$root"/.venv/lib/python3.*/site-packages/nvidia 2>/dev/null | head -1 || true)
    if [[ -n "$shared" ]] && mapfile -t deps < <("$root/.venv/bin/python" - "${torch#torch==}" <<'PY'
import importlib.metadata as m, sys
if m.version("torch").split("+")[0] != sys.argv[1]:
    sys.exit(1)
for r in m.requires("torch") or []:
    name = r.split(";")[0].strip().lower()
    if "extra ==" not in r and not name.startswith(("nvidia-", "cuda-toolkit", "triton")):
        print(r)
PY
    ) && ((${#deps[@]})); then
      mode="shared-nvidia(${deps[*]})"
    else
      shared="" deps=() mode="plain"
    fi
  fi
  want="$libs${torch:+ $torch $mode}"
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install --quiet $libs
    if [[ -n "$shared" ]]; then
      "$venv/bin/python" -m pip install --quiet --no-deps "$torch"
      "$venv/bin/python" -m pip install --quiet --no-warn-conflicts "${deps[@]}"
    elif [[ -n "$torch" ]]; then
      "$venv/bin/python" -m pip install --quiet "$torch"
    fi
    echo "$want" >"$stamp"
  fi
  if [[ -n "$shared" ]]; then
    site=$(ls -d "$venv"/lib/python3.*/site-packages)
    ln -sfn "$shared" "$site/nvidia"
  fi
  # Every library asked for must import: a broken one would only make its tests skip.
  mods="numpy ml_dtypes array_api_strict pyarrow${torch:+ torch}"
  (cd /tmp && "$venv/bin/python" -c "import sys, importlib; [importlib.import_module(m) for m in sys.argv[1:]]" $mods)
  echo "== CPython $v: building dlbridge"
  out="$root/target/matrix/wheels-$v"
  rm -rf "$out"
  CARGO_TARGET_DIR="$root/target/matrix" PYO3_PYTHON="$venv/bin/python" \
    "$maturin" build --quiet --features test-hooks -i "$venv/bin/python" -o "$out"
  "$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$out"/dlbridge-*.whl
  echo "== CPython $v: the shipped suite"
  log=$(mktemp)
  set +e
  (cd /tmp && "$venv/bin/python" -m pytest -q -p no:cacheprovider --pyargs dlbridge) | tee "$log" | tail -3
  rc=${PIPESTATUS[0]}
  set -e
  line=$(grep -E "^[0-9]+ (passed|failed)" "$log" | tail -1 || true)
  found=$("$venv/bin/python" -c "import numpy, importlib.util as u; print('numpy', numpy.__version__, *[m for m in ('torch', 'pyarrow', 'ml_dtypes', 'array_api_strict') if u.find_spec(m)])")
  summary+=("$v: ${line:-no result} ($found)")
  rm -f "$log"
  [[ $rc -ne 0 ]] && status=1
done
echo "== Python matrix"
printf '  %s\n' "${summary[@]}"
exit $status
