#!/usr/bin/env bash
# `make test`: the package's pytest suite, then the three checks against Lightning's own code
# (tools/test_upstream_checks.sh), and how long each took. The exit status is the suite's failure, else the checks'.
#
# The core's own tests (tests/tests_fabric/core) are left out of the suite here: tools/test_core_on_sdist.sh runs them,
# written into the installed release's sdist with Lightning's names (the same tests against the same release; in the
# package itself when the sdist cannot be had), and tools/test_patched_upstream.sh runs them on Lightning's master;
# the suite would run them a third time. `pytest tests` runs everything.
# (Running the checks beside the suite at a lower CPU priority was tried on 2026-12-04: on 2 cores the suite leaves
# too little idle time, and the checks took 1189 s instead of about 250.)
# Usage: tools/test_all.sh [PYTHON] [PYTEST_WORKERS]   (defaults: .venv/bin/python, 3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
WORKERS=${2:-3}
started=$(date +%s)
# the 25 slowest tests at the end: where the next cut of the suite's time is
"$PY" -m pytest tests -q -n "$WORKERS" --dist worksteal --ignore=tests/tests_fabric/core --durations=25
suite=$?
suite_seconds=$(($(date +%s) - started))
bash tools/test_upstream_checks.sh "$PY"
upstream=$?
echo "make test took $(($(date +%s) - started)) s: the suite $suite_seconds s (exit code $suite), the checks against" \
    "Lightning's code $(($(date +%s) - started - suite_seconds)) s (exit code $upstream)"
[ "$suite" -ne 0 ] && exit "$suite"
exit "$upstream"
