#!/usr/bin/env bash
# What the registries would get, checked the way a user meets it (`make package`, part of
# `make test`):
#   1. crate:   `cargo publish --dry-run -p dlbridge` packages the crate and builds it from the
#               packaged files alone; the package must carry both license texts and its README, and
#               the README's example must be the crate's tested doc example.
#   2. sdist:   `maturin sdist`; it must carry pyproject.toml, both crates, the Python sources, the
#               license texts and the README.
#   3. wheel:   the sdist built once, in release mode, by pip from a clean virtualenv (PEP 517, the
#               maturin that pyproject.toml's build-system names), with `--compatibility pypi`
#               (only tags PyPI accepts: the lowest manylinux tag the binary meets, as `maturin
#               build --release` picks; pip's default, `off`, would tag it plain `linux`).
#               `auditwheel show` must then find the wheel consistent with a manylinux policy, the
#               same one as its tag; the wheel carries the license texts. The policy is the build
#               machine's glibc (manylinux_2_34 on glibc 2.34+: the linker binds dlopen, dlsym and
#               pthread_key_* to their 2.34 symbol versions); a manylinux2014 wheel needs a
#               manylinux2014 build image (or maturin --zig), which is the release pipeline's job.
#   4. install: that wheel and numpy (the pin in python/requirements-test.txt) into another clean
#               virtualenv, and a smoke test run from outside the tree: import, zero-copy both ways,
#               no test hooks.
# Each step prints its time. The release build goes to target/package-check (its own
# CARGO_TARGET_DIR, so the dev builds under target/ stay valid, and dependencies are reused by the
# next run); everything else lives in a temporary directory removed on exit.
#
#   PY=.venv/bin/python bash scripts/package_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
py=${PY:-"$root/.venv/bin/python"}
maturin="$root/.venv/bin/maturin"
# The auditwheel that judges the wheel (installed into a temporary virtualenv of its own).
auditwheel_pin="auditwheel==6.8.2"
numpy_pin=$(grep -E '^numpy==' python/requirements-test.txt) \
  || { echo "package: python/requirements-test.txt has no numpy== pin" >&2; exit 1; }

export CARGO_TARGET_DIR="$root/target/package-check"
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dlbridge-package.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

timings=()
step() { # step NAME FUNCTION: runs it, records its wall time
  local name=$1 start end
  shift
  echo "== package: $name"
  start=$EPOCHREALTIME
  "$@"
  end=$EPOCHREALTIME
  timings+=("$(awk -v n="$name" -v s="$start" -v e="$end" 'BEGIN { printf "%-8s %6.1f s", n, e - s }')")
}
fail() { echo "package: $*" >&2; exit 1; }

crate() {
  # --allow-dirty: on a clean clone (CI) it changes nothing; in a working tree being edited it lets
  # `make test` check the files as they are. The real `cargo publish` keeps the clean-tree guard.
  local list
  list=$(cargo package -p dlbridge --list --allow-dirty 2>/dev/null) || fail "cargo package --list failed"
  for f in LICENSE-MIT LICENSE-APACHE README.md Cargo.toml src/lib.rs; do
    grep -qx "$f" <<<"$list" || fail "the crate package lacks $f"
  done
  # The README's example is the crate-level doc example (which `cargo test` runs), word for word.
  local readme_example doc_example
  readme_example=$(awk '/^```rust$/ {f = 1; next} /^```$/ {f = 0} f' crates/dlbridge/README.md)
  doc_example=$(sed -n 's|^//! \{0,1\}||p' crates/dlbridge/src/lib.rs | awk '/^```/ {if (f) exit; f = 1; next} f')
  [[ -n "$readme_example" && "$readme_example" == "$doc_example" ]] \
    || fail "crates/dlbridge/README.md's example differs from the first example in src/lib.rs"
  cargo publish --dry-run --allow-dirty -p dlbridge
}

sdist() {
  VIRTUAL_ENV="$root/.venv" "$maturin" sdist --out "$tmp/sdist"
  local archive
  archive=$(ls "$tmp"/sdist/dlbridge-*.tar.gz)
  local list
  list=$(tar tzf "$archive" | sed 's|^[^/]*/||')
  for f in pyproject.toml Cargo.toml Cargo.lock LICENSE-MIT LICENSE-APACHE README.md \
    crates/dlbridge/Cargo.toml crates/dlbridge/src/lib.rs crates/dlbridge/LICENSE-MIT \
    crates/dlbridge-python/Cargo.toml crates/dlbridge-python/src/lib.rs \
    python/dlbridge/__init__.py python/dlbridge/_dlbridge.pyi python/dlbridge/py.typed; do
    grep -qx "$f" <<<"$list" || fail "the sdist lacks $f"
  done
  if grep -E '\.so$' <<<"$list"; then fail "the sdist carries a built extension"; fi
}

wheel() {
  "$py" -m venv "$tmp/build"
  # The sdist builds from its own files: pip unpacks it and builds it in isolation (maturin from
  # PyPI as pyproject.toml's build-system says), with the workspace's release profile.
  "$tmp/build/bin/python" -m pip wheel --no-deps --wheel-dir "$tmp/wheel" \
    --config-settings=maturin.build-args="--compatibility pypi" "$tmp"/sdist/dlbridge-*.tar.gz
  "$tmp/build/bin/python" -m pip install --quiet "$auditwheel_pin"
  local whl report tag policy
  whl=$(ls "$tmp"/wheel/dlbridge-*.whl)
  report=$("$tmp/build/bin/auditwheel" show "$whl" 2>&1) || { echo "$report"; fail "auditwheel show failed"; }
  echo "$report"
  # auditwheel wraps its lines: one line to match on.
  policy=$(tr -s ' \n' ' ' <<<"$report" | sed -n 's/.*consistent with the following platform tag: "\([^"]*\)".*/\1/p')
  [[ "$policy" == manylinux_* ]] || fail "auditwheel finds no manylinux policy for $(basename "$whl") (${policy:-none})"
  tag=${whl##*/}
  tag=${tag%.whl}
  tag=${tag##*-}
  [[ ".$tag." == *".$policy."* ]] || fail "the wheel is tagged $tag, auditwheel says $policy"
  "$tmp/build/bin/python" - "$whl" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
for f in ("LICENSE-MIT", "LICENSE-APACHE"):
    assert any(n.endswith(".dist-info/licenses/" + f) for n in names), f"the wheel lacks {f}"
PY
  echo "package: $(basename "$whl") is a valid $policy wheel"
}

install() {
  "$py" -m venv "$tmp/clean"
  "$tmp/clean/bin/python" -m pip install --quiet "$tmp"/wheel/dlbridge-*.whl "$numpy_pin"
  (cd "$tmp" && "$tmp/clean/bin/python" - "$tmp/clean" <<'PY'
import sys
import numpy as np
import dlbridge

assert dlbridge.__file__.startswith(sys.argv[1]), dlbridge.__file__  # the installed wheel
assert not hasattr(dlbridge._dlbridge, "_HostileBuffer"), "test hooks in a release wheel"
a = np.arange(12, dtype=np.float32).reshape(3, 4)
t = dlbridge.from_dlpack(a)
assert t.data_ptr == a.ctypes.data and tuple(t.shape) == (3, 4), (t.data_ptr, t.shape)
b = np.from_dlpack(t)
assert b.ctypes.data == a.ctypes.data and (b == a).all()
b[0, 0] = 42.0
assert a[0, 0] == 42.0  # the same memory
u = np.from_dlpack(dlbridge.asdlpack(b"\x01\x02\x03"))
assert u.tolist() == [1, 2, 3] and not u.flags.writeable
print(f"smoke test passed: dlbridge {dlbridge.__version__} from {dlbridge.__file__}")
PY
  )
}

step crate crate
step sdist sdist
step wheel wheel
step install install
echo "== package: timings"
printf '%s\n' "${timings[@]}"
