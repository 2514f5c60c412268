#!/usr/bin/env bash
# The interop smoke run (embedded CPython + numpy + dlbridge) under valgrind memcheck. CPython and
# numpy have their own known reports, so this counts only errors and definite leaks whose stacks
# pass through dlbridge's code (scripts/valgrind_classify.py: by frame, never by path, so a
# checkout named dlbridge works), and fails if there is any.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
log=$(mktemp)
PYTHONMALLOC=malloc valgrind --tool=memcheck --leak-check=full --show-leak-kinds=definite --num-callers=50 \
  "$PY" scripts/smoke.py >"$log" 2>&1 || true
grep -q "smoke done" "$log" || { echo "valgrind python: the smoke run did not finish"; tail -40 "$log"; exit 1; }
python3 scripts/valgrind_classify.py --self-test
python3 scripts/valgrind_classify.py "$log"
