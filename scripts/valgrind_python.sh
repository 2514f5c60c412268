#!/usr/bin/env bash
# The interop smoke run (embedded CPython + numpy + dlbridge) under valgrind memcheck. CPython and
# numpy have their own known reports, so this counts only errors and definite leaks whose stacks
# pass through dlbridge's code, and fails if there is any.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
log=$(mktemp)
PYTHONMALLOC=malloc valgrind --tool=memcheck --leak-check=full --show-leak-kinds=definite --num-callers=50 \
  "$PY" scripts/smoke.py >"$log" 2>&1 || true
grep -q "smoke done" "$log" || { echo "valgrind python: the smoke run did not finish"; tail -40 "$log"; exit 1; }
python3 - "$log" <<'PYEOF'
import re, sys
text = open(sys.argv[1]).read()
blocks = re.split(r"\n==\d+== \n", text)
ours = lambda b: "dlbridge" in b or "_dlbridge" in b
errors = [b for b in blocks if re.search(r"Invalid (read|write|free)|uninitialised|Mismatched free", b)]
leaks = [b for b in blocks if "definitely lost" in b and "loss record" in b]
our_errors, our_leaks = [b for b in errors if ours(b)], [b for b in leaks if ours(b)]
summary = re.findall(r"ERROR SUMMARY: (\d+) errors", text)
print(f"valgrind python: {len(our_errors)} memory errors and {len(our_leaks)} definite leaks through dlbridge "
      f"({len(errors)} errors, {len(leaks)} definite-leak records in the whole process; ERROR SUMMARY {summary[-1] if summary else '?'})")
for b in (our_errors + our_leaks)[:5]:
    print(b[:3000])
sys.exit(1 if our_errors or our_leaks else 0)
PYEOF
