# dlbridge: `make demo` shows an exchange, `make test` runs every test. Both work on a fresh machine.
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: demo test rust-test lint docs valgrind clean

demo:
	$(CARGO) run --quiet --example demo

test: lint rust-test docs valgrind

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --all-features -- -D warnings

rust-test:
	$(CARGO) test --workspace --all-features

docs:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --all-features

# Every Rust test binary under valgrind memcheck: any error, or a definite leak, fails the run.
valgrind:
	@command -v valgrind >/dev/null || (apt-get update -qq && apt-get install -y -qq valgrind)
	bash scripts/valgrind.sh

clean:
	$(CARGO) clean
