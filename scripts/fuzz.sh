#!/usr/bin/env bash
# `make fuzz`: every fuzz target under libFuzzer for FUZZ_SECONDS each (default 60), on stable Rust.
# libfuzzer-sys only needs sanitizer-coverage instrumentation, which stable rustc gives through
# -Cpasses=sancov-module and LLVM options (cargo-fuzz's nightly need comes from its address
# sanitizer, not used here). The corpus in fuzz/corpus is committed and grows with each run;
# crashes land in fuzz/artifacts and fail the run.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${FUZZ_SECONDS:-60}
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
# An explicit --target keeps the instrumentation off build scripts and proc macros.
triple=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --bins --quiet --target "$triple"
bin="target/$triple/release"
libdir=$(${PYO3_PYTHON:-python3} -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
export LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}"
status=0
for t in validate layout interface exchange_table; do
  mkdir -p "corpus/$t" "artifacts/$t"
  log=$(mktemp)
  if "$bin/$t" "corpus/$t" -max_total_time="$secs" -max_len=512 -artifact_prefix="artifacts/$t/" \
       -print_final_stats=1 >"$log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | awk '{print $2}')
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}')
    echo "fuzz OK   $t: ${runs:-?} executions in ${secs}s, coverage ${cov:-?} edges, corpus $(ls "corpus/$t" | wc -l) inputs, 0 crashes"
  else
    echo "fuzz FAIL $t: a crash (input saved under fuzz/artifacts/$t)"; tail -40 "$log"; status=1
  fi
  rm -f "$log"
  # Keep the committed corpus small: merge into a minimal set that keeps the coverage.
  mkdir -p "corpus/$t.min" && "$bin/$t" -merge=1 "corpus/$t.min" "corpus/$t" >/dev/null 2>&1 \
    && rm -rf "corpus/$t" && mv "corpus/$t.min" "corpus/$t"
done
exit $status
