#!/usr/bin/env bash
# One build, two torch releases: the wheels of dlbridge and of the example extensions built once
# for CPython 3.12 (the GPU machine's Python) run their torch tests against the pinned torch
# (python/requirements-test.txt, in the matrix's .venv-3.12) and against the older release of
# python/requirements-torch-older.txt (2.11, the GPU machine's torch), in .venv-torch<X.Y>.
# dlbridge finds libtorch's stable C functions at run time (no link-time torch), so nothing is
# rebuilt for the older torch. Run by scripts/matrix.sh right after its 3.12 step (which built
# dlbridge's wheel into target/matrix/wheels-3.12 and made .venv-3.12, both used here):
#
#   bash scripts/torch_older.sh    (on its own: after `make matrix`)
#
# The shipped suite runs whole there (every torch test in it, and the rest); the examples' tests
# too (examples/kernels, examples/torch_native). A test that needs what only a newer torch has
# skips, naming the release.
#
# Disk: PyPI's torch wheel is the CUDA one, and its ~3 GB of nvidia-* libraries are not needed to
# run on a CPU. As in scripts/matrix.sh, torch is installed without dependencies and its CUDA
# libraries come from .venv's (same CUDA major, same sonames: a library only has to load): the
# venv's nvidia/ folder is linked to .venv's, entry by entry, and a CUDA toolkit library the older
# torch links but .venv's torch does not bring (2.11: libcurand) is installed from its cuda-toolkit
# pin. Where .venv's torch has no CUDA wheels, torch comes with every dependency. The stamp
# records which. No pip cache (the Makefile's PIP_NO_CACHE_DIR).
#
# Writes its summary lines to $TORCH_OLDER_SUMMARY (default: stdout); exit 1 on any failure.
set -euo pipefail
export PIP_NO_CACHE_DIR=${PIP_NO_CACHE_DIR:-1} # run on its own too: no pip cache (see the Makefile)
cd "$(dirname "$0")/.."
root=$(pwd)
v=${TORCH_OLDER_PYTHON:-3.12}
req="$root/python/requirements-torch-older.txt"
pinned="$root/.venv-$v"
target="$root/target/matrix"
out="$target/wheels-$v"
maturin="$root/.venv/bin/maturin"
summary_file=${TORCH_OLDER_SUMMARY:-/dev/stdout}
summary=()
status=0
finish() { printf '%s\n' "${summary[@]}" >"$summary_file"; exit $status; }

torch_pin=$(grep -E '^torch==' "$req") || { echo "torch_older: $req has no torch== pin" >&2; exit 1; }
older=${torch_pin#torch==}
xy=$(cut -d. -f1,2 <<<"$older")
venv="$root/.venv-torch$xy"
others=$(grep -vE '^(#|torch==|\s*$)' "$req" | tr '\n' ' ')
if [[ ! -x "$pinned/bin/python" ]] || ! ls "$out"/dlbridge-*.whl >/dev/null 2>&1; then
  summary+=("torch $older: not tested ($pinned or $out/dlbridge-*.whl missing: make matrix makes them)")
  status=1
  finish
fi
py=$(readlink -f "$pinned/bin/python")

# The example extensions, built once for this interpreter, into the folder of dlbridge's wheel.
echo "== torch $older: building the example extensions for CPython $v"
t0=$SECONDS
rm -f "$out"/dlbridge_kernels-*.whl "$out"/dlbridge_torch_native-*.whl "$out"/dlbridge_scale-*.whl
for ex in kernels torch_native scale; do
  (cd "examples/$ex" && CARGO_TARGET_DIR="$target" PYO3_PYTHON="$pinned/bin/python" \
    "$maturin" build --quiet -i "$pinned/bin/python" -o "$out")
done
examples=("$out"/dlbridge_kernels-*.whl "$out"/dlbridge_torch_native-*.whl)
# examples/scale: what two of the shipped suite's torch tests call (test_torch_bits, test_soundness).
wheels=("$out"/dlbridge-*.whl "${examples[@]}" "$out"/dlbridge_scale-*.whl)
t_build=$((SECONDS - t0))

tests=(--pyargs dlbridge "$root/examples/kernels/tests" "$root/examples/torch_native/tests")
# run_tests NAME VENV PYTEST-ARGS...: the tests, the whole output in target/matrix/NAME.log.
run_tests() {
  local name=$1 env=$2 log="$target/$1.log" rc line found
  shift 2
  set +e
  (cd /tmp && "$env/bin/python" -m pytest -q -p no:cacheprovider -rfEs "$@") >"$log" 2>&1
  rc=$?
  set -e
  grep -E "^(FAILED|ERROR) |^[0-9]+ (passed|failed)|^(no tests ran|[0-9]+ error)" "$log" || tail -20 "$log"
  echo "   (the whole output: $log)"
  line=$(grep -E "^[0-9]+ (passed|failed)" "$log" | tail -1 || true)
  found=$("$env/bin/python" -c "import torch; print('torch', torch.__version__)" 2>&1 | tail -1)
  last="${line:-no result} ($found)"
  [[ $rc -ne 0 ]] && status=1
  return 0
}

# The pinned torch, the same wheels: the examples' tests (the matrix ran the shipped suite).
echo "== torch $older: the examples' tests on CPython $v with the pinned torch"
"$pinned/bin/python" -m pip install --quiet --force-reinstall --no-deps "${examples[@]}"
t0=$SECONDS
run_tests "examples-$v" "$pinned" "$root/examples/kernels/tests" "$root/examples/torch_native/tests"
summary+=("$v examples: $last; build ${t_build} s, tests $((SECONDS - t0)) s")

# The older torch's virtualenv.
shared=$(cat "$target/torch-shared-nvidia" 2>/dev/null || true)
mode=plain
[[ -n "$shared" && -d "$shared" ]] && mode="shared-nvidia($shared)"
want="$torch_pin $others $mode"
stamp="$venv/.installed"
t0=$SECONDS
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "== torch $older: installing $torch_pin $others into $venv"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  set -f # jax[cpu] is not a glob
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet $others
  set +f
  if [[ "$mode" == shared-nvidia* ]]; then
    "$venv/bin/python" -m pip install --quiet --no-deps "$torch_pin"
    # torch's requirements but its CUDA libraries and triton; the cuda-toolkit extras .venv's
    # torch does not ask for, at this torch's cuda-toolkit pin.
    "$venv/bin/python" - "$root/.venv/bin/python" >"$venv/torch-deps.txt" <<'PY'
import importlib.metadata as m, re, subprocess, sys
def split(reqs):
    plain, toolkit = [], {}
    for r in reqs or []:
        if "extra ==" in r:
            continue
        name = r.split(";")[0].strip()
        low = name.lower()
        t = re.match(r"cuda-toolkit\[([^\]]*)\](.*)", low)
        if t:
            toolkit = {"extras": set(t.group(1).split(",")), "spec": t.group(2).strip()}
        elif not low.startswith(("nvidia-", "triton")):
            plain.append(r)
    return plain, toolkit
plain, toolkit = split(m.requires("torch"))
ref = subprocess.run([sys.argv[1], "-c", "import importlib.metadata as m; print('\\n'.join(m.requires('torch') or []))"],
                     capture_output=True, text=True, check=True).stdout.splitlines()
_, ref_toolkit = split(ref)
print("\n".join(plain))
missing = sorted(toolkit.get("extras", set()) - ref_toolkit.get("extras", set()))
if missing:
    print(f"cuda-toolkit[{','.join(missing)}]{toolkit['spec']}")
PY
    "$venv/bin/python" -m pip install --quiet --no-warn-conflicts -r "$venv/torch-deps.txt"
  else
    "$venv/bin/python" -m pip install --quiet "$torch_pin"
  fi
  echo "$want" >"$stamp"
fi
if [[ "$mode" == shared-nvidia* ]]; then
  # .venv's CUDA libraries, linked entry by entry into this venv's nvidia/ (what pip put there
  # itself stays: a real folder is entered, a missing entry linked).
  site=$(ls -d "$venv"/lib/python3.*/site-packages)
  "$venv/bin/python" - "$shared" "$site/nvidia" <<'PY'
import os, sys
def overlay(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if os.path.islink(d) and not os.path.exists(d):
            os.remove(d)  # a link into an older .venv
        if not os.path.lexists(d):
            os.symlink(s, d)
        elif os.path.isdir(s) and os.path.isdir(d) and not os.path.islink(d):
            overlay(s, d)
overlay(sys.argv[1], sys.argv[2])
PY
fi
t_install=$((SECONDS - t0))
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "${wheels[@]}"
# The torch asked for, importable (a broken one would only make its tests skip).
(cd /tmp && "$venv/bin/python" -c "
import sys, torch, jax
v = torch.__version__.split('+')[0]
sys.exit(0 if v == sys.argv[1] else f'torch {v} in $venv, not {sys.argv[1]}')" "$older")

echo "== torch $older: the shipped suite and the examples' tests on CPython $v, the same wheels"
t0=$SECONDS
run_tests "suite-torch$xy" "$venv" "${tests[@]}"
summary+=("torch $older: $last; install ${t_install} s, tests $((SECONDS - t0)) s")
finish
