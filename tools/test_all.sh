#!/usr/bin/env bash
# `make test`: the package's pytest suite and, at the same time at a lower CPU priority (nice 10), the three checks
# against Lightning's own code (tools/test_upstream_checks.sh). Many tests of the suite wait (on ranks that time out,
# on a stalled object store, on turns), so on a small machine the checks run in the time the suite leaves idle
# instead of after it; under load the suite keeps its priority. The checks' output is printed after the suite's.
# The exit status is the suite's failure, else the checks'.
# Usage: tools/test_all.sh [PYTHON] [PYTEST_WORKERS]   (defaults: .venv/bin/python, 2)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
WORKERS=${2:-2}
started=$(date +%s)
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
nice -n 10 bash tools/test_upstream_checks.sh "$PY" >"$LOG" 2>&1 &
checks=$!
# The core's own tests (tests/tests_fabric/core) run in tools/test_core_on_sdist.sh, written into the installed
# release's sdist with Lightning's names (the same tests against the same release; in the package itself when the
# sdist cannot be had), and in tools/test_patched_upstream.sh on Lightning's master: the suite leaves them out here,
# not to run them a third time. `pytest tests` runs everything.
"$PY" -m pytest tests -q -n "$WORKERS" --dist worksteal --ignore=tests/tests_fabric/core
suite=$?
echo "pytest finished after $(($(date +%s) - started)) s; waiting for the checks against Lightning's code"
wait "$checks"
upstream=$?
cat "$LOG"
echo "make test took $(($(date +%s) - started)) s (suite exit code $suite, checks exit code $upstream)"
[ "$suite" -ne 0 ] && exit "$suite"
exit "$upstream"
