# dlbridge. Two set-up commands work on a fresh machine:
#   make demo   a real exchange between Rust and numpy / torch / jax / tensorflow / pyarrow
#   make test   every test (Rust and Python), lints, docs, stubs, valgrind
# Everything is installed into one virtualenv, .venv, reused across make runs. `make help` lists
# every target (the `## ` comment on each target's line).
SHELL := /bin/bash
CARGO ?= cargo
PYTHON ?= python3
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MATURIN := VIRTUAL_ENV=$(VENV) $(VENV)/bin/maturin
# No pip cache: torch and tensorflow's wheels would keep ~5 GB of a CI machine's disk for nothing.
export PIP_NO_CACHE_DIR := 1
# One interpreter for every build (cargo and maturin), so pyo3 is configured once.
export PYO3_PYTHON := $(PY)

# maturin installs the package's requirements each time and pip reports every `test` extra it
# skips ("Ignoring pytest: markers 'extra == \"test\"' ..."): noise, filtered out.
QUIET_MATURIN = set -o pipefail; $(MATURIN) develop --quiet $(1) 2>&1 | { grep -v -e "^Ignoring .*markers 'extra ==" -e "^Looking in links" || true; }
# What the demo imports (the extension and two examples): built when a file they are built from
# changed since the last build, so a warm `make demo` builds nothing.
DEMO_SOURCES := $(wildcard $(shell git ls-files -co --exclude-standard crates/dlbridge crates/dlbridge-python examples/scale examples/kernels python/dlbridge 2>/dev/null | grep -E '\.(rs|toml|py|pyi)$$')) Cargo.toml Cargo.lock pyproject.toml
DEMO_STAMP := $(VENV)/.demo-built

.PHONY: help demo demo-abi test lint rust-test miri hooks-absent matrix docs valgrind valgrind-python develop py-test stubs package gpu-bundle bench fuzz soak clean

help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  make \1\t\2/' | expand -t 22

demo: $(DEMO_STAMP) ## Rust reads numpy/torch arrays and hands Rust buffers to numpy/torch/jax/tf/pyarrow
	@echo "== 3/3 running examples/demo.py =="
	@cd /tmp && $(PY) $(CURDIR)/examples/demo.py
	@echo "== a Rust-made tensor read by a child process through torch, no copy: examples/demo_processes.py =="
	@cd /tmp && $(PY) $(CURDIR)/examples/demo_processes.py

demo-abi: ## the Rust-only demo: a Rust buffer through the raw C ABI and back
	$(CARGO) run --quiet --example demo

test: lint rust-test miri docs valgrind py-test stubs hooks-absent matrix package ## every test: Rust, Miri, docs, valgrind, Python, stubs, other Pythons, package (long)

$(STAMP): python/requirements-test.txt
	@echo "== 1/3 installing numpy, torch, jax, tensorflow-cpu, pyarrow, ... into .venv (first time: ~3.5 GB of downloads, a 7.6 GB .venv) =="
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	set -o pipefail; $(PY) -m pip install --progress-bar off -r python/requirements-test.txt | { grep --line-buffered -E '^(Collecting|Successfully)' || true; }
	touch $(STAMP)

$(DEMO_STAMP): $(STAMP) $(DEMO_SOURCES)
	@echo "== 2/3 building dlbridge, examples/scale and examples/kernels into .venv (first time: a few minutes) =="
	@$(call QUIET_MATURIN,--features test-hooks)
	@cd examples/scale && $(call QUIET_MATURIN)
	@cd examples/kernels && $(call QUIET_MATURIN)
	@touch $@

# Everything the tests import: the demo's build, examples/bridges and examples/torch_native.
develop: $(DEMO_STAMP) ## build dlbridge and every example extension into .venv (editable)
	@cd examples/bridges && $(call QUIET_MATURIN)
	@cd examples/torch_native && $(call QUIET_MATURIN)

lint: $(STAMP) ## cargo fmt --check, clippy -D warnings, no circles between the crate's modules
	$(PYTHON) scripts/module_cycles.py --self-test
	$(PYTHON) scripts/module_cycles.py
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --all-features -- -D warnings

# The torch_stable tests load the venv's libtorch (DLBRIDGE_TORCH_DIR, torch's package folder);
# DLBRIDGE_REQUIRE_TORCH=1 makes its absence a failure, never a silent skip.
rust-test: $(STAMP) ## every Rust test, all features
	DLBRIDGE_REQUIRE_XLA_HEADERS=1 DLBRIDGE_REQUIRE_TORCH=1 \
	  DLBRIDGE_TORCH_DIR="$$($(PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))')" \
	  $(CARGO) test --workspace --all-features

# Miri (default Stacked Borrows) over the crate's core: every unit, integration and doc test of
# everything that does not call into libpython (managed, export, view, layout, ndarray, dtype,
# interface, borrow, process_wide, fork, the live-segment registry with fake owners: shm; the
# shm tests that need memfd and mmap are left out under Miri) and of the bridges (faer, nalgebra,
# arrow, image, candle, cudarc: the cudarc
# tests that need a GPU are ignored everywhere without one; nalgebra's iterating tests are ignored
# under Miri, see tests/nalgebra_bridge.rs), and the native torch op's decoding of optional, list
# and plain-list arguments (torch_stable::kernel's unbox tests: every free counted). Isolation is
# off only so proptest can read its files; case counts lowered.
miri: ## the core's tests under Miri (nightly)
	@rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^miri' \
	  || rustup component add --toolchain nightly miri rust-src
	PROPTEST_CASES=8 MIRIFLAGS="-Zmiri-disable-isolation" $(CARGO) +nightly miri test -p dlbridge --features ndarray,faer,nalgebra,arrow,image,candle,cudarc,shm
	MIRIFLAGS="-Zmiri-disable-isolation" $(CARGO) +nightly miri test -p dlbridge --features torch-stable --lib -- torch_stable::kernel::unbox_tests torch_stable::kernel::slots_tests

# What users install carries no test hooks: the extension built without the test-hooks feature
# (as every wheel is) must not contain them.
hooks-absent: $(STAMP) ## checks a build without test-hooks has none
	$(CARGO) build --quiet -p dlbridge-python
	@if grep -q -a -e _HostileBuffer -e _view_then -e _drop_on_native_thread -e _typed_mut_fill -e _slice_across_call -e _slice_across_detach target/debug/lib_dlbridge.so; then \
	  echo "test hooks found in a build without the test-hooks feature"; exit 1; fi
	@echo "no test hooks in a build without the test-hooks feature"

docs: $(STAMP) ## cargo doc, warnings denied
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --all-features

# Every Rust test binary under valgrind memcheck (any error or definite leak fails), then the
# interop smoke run in embedded CPython (errors or definite leaks through dlbridge fail).
valgrind: develop ## Rust tests and embedded Python under valgrind memcheck
	@command -v valgrind >/dev/null || (apt-get update -qq && apt-get install -y -qq valgrind)
	bash scripts/valgrind.sh
	PY=$(PY) bash scripts/valgrind_python.sh

# The Python tests ship inside the package: run them the way a user would, from outside the tree.
py-test: develop ## the Python tests (shipped suite, examples, README and guide, downstream crates)
	cd /tmp && $(PY) -m pytest -q -p no:cacheprovider --pyargs dlbridge $(CURDIR)/examples/scale/tests $(CURDIR)/examples/kernels/tests $(CURDIR)/examples/bridges/tests $(CURDIR)/examples/torch_native/tests $(CURDIR)/tests
	@echo "The shipped suite again, as if no array library were installed (it must skip, not fail):"
	cd /tmp && DLBRIDGE_TEST_WITHOUT=numpy,torch,jax,tensorflow,pyarrow,array_api_strict,ml_dtypes,tvm_ffi \
	  $(PY) -m pytest -q -p no:cacheprovider --pyargs dlbridge

# The shipped suite on CPython 3.10, 3.12, 3.13, 3.14 and 3.15 too (one virtualenv each, .venv-3.X;
# 3.11 is .venv above). 3.14 and 3.15 come from Debian unstable, in a root scripts/sid_root.sh
# makes once outside the clone (DLBRIDGE_SID_ROOT, default /var/cache/dlbridge-sid; needs root)
# and mounts only while the matrix runs in it. After 3.12, scripts/torch_older.sh runs the same 3.12
# wheels (dlbridge's and the examples') against the pinned torch and torch 2.11 (.venv-torch2.11).
matrix: $(STAMP) ## the shipped suite on CPython 3.10, 3.12, 3.13, 3.14, 3.15; torch 2.11 too
	bash scripts/matrix.sh

# The .pyi stubs must match the compiled module, and the package's Python type-checks.
stubs: develop ## stubtest: the .pyi stubs match the module; mypy over the package's Python
	cd /tmp && $(PY) -m mypy.stubtest dlbridge._dlbridge --mypy-config-file $(CURDIR)/pyproject.toml
	$(PY) -m mypy --config-file $(CURDIR)/pyproject.toml python/dlbridge/__init__.py python/dlbridge/kernels.py

# What the registries would get: the crate built from its packaged files (cargo publish --dry-run),
# the sdist built once into a release wheel that auditwheel calls manylinux, that wheel smoke-tested
# in a clean virtualenv (scripts/package_check.sh; its own target dir, target/package-check).
package: $(STAMP) ## build the crate and the wheel/sdist and check them
	PY=$(PY) bash scripts/package_check.sh

# What a lent GPU machine runs (it builds and fetches nothing): cp312 release wheels of dlbridge
# (without and with test hooks) and of each example with `gpu` tests, those tests and run.sh, in
# target/gpu-bundle (64 MiB at most). There: `bash target/gpu-bundle/run.sh OUTDIR`.
gpu-bundle: $(STAMP) ## wheels + tests + run.sh for a GPU machine, in target/gpu-bundle
	bash scripts/gpu_bundle.sh

# Side-by-side benchmarks (release builds of dlbridge and of the peer shims; the nanobind shim with the
# system C++ compiler into target/bench-nanobind), criterion benchmarks of
# the Rust core, callgrind instruction counts; writes docs/BENCHMARKS.md and docs/bench_sizes.png.
bench: $(STAMP) ## side-by-side benchmarks; writes docs/BENCHMARKS.md
	$(PY) -m pip install --quiet -r bench/requirements-bench.txt
	$(MATURIN) develop --release --quiet --features test-hooks
	cd bench/shim-dlbridge && $(MATURIN) develop --release --quiet
	cd examples/kernels && $(MATURIN) develop --release --quiet
	cd bench/shim-pyo3-dlpack && $(MATURIN) develop --release --quiet
	cd bench/shim-dlpark && $(MATURIN) develop --release --quiet
	$(PY) bench/shim-nanobind/build.py $(CURDIR)/target/bench-nanobind
	@command -v valgrind >/dev/null || (apt-get update -qq && apt-get install -y -qq valgrind)
	mkdir -p bench/rust-core/target && cd bench/rust-core && $(CARGO) bench --bench core -- --warm-up-time 1 --measurement-time 3 2>&1 | tee target/criterion.txt
	cd /tmp && $(PY) $(CURDIR)/bench/bench.py

# Every fuzz target for FUZZ_SECONDS (default 60) each; the corpus is committed.
fuzz: $(STAMP) ## each fuzz target for FUZZ_SECONDS (default 60)
	bash scripts/fuzz.sh

# 10^6 round trips per path; fails if any path grows the process by 1 MiB or more.
soak: develop ## 10^6 round trips per path, memory growth
	cd /tmp && $(PY) $(CURDIR)/scripts/soak.py

clean: ## remove target/ and the virtualenvs
	$(CARGO) clean
	rm -rf $(VENV) $(CURDIR)/.venv-3.* $(CURDIR)/.venv-torch*
