#!/usr/bin/env bash
# Runs every test marked `RunIf(standalone=True)` in a process of its own, as Lightning's suite does for its
# multi-GPU tests: a standalone test may create a process group or touch CUDA state that must not leak into another.
# Usage: bash tests/run_standalone_tests.sh [pytest path or node id, default: tests]
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
TARGET=${1:-tests}
export PL_RUN_STANDALONE_TESTS=1

tests=$($PYTHON -m pytest "$TARGET" -q --collect-only 2>/dev/null | grep "::" || true)
if [ -z "$tests" ]; then
  echo "No standalone tests selected (they need the hardware they ask for, e.g. 2 CUDA GPUs)."
  exit 0
fi
passed=0
failed=0
failed_tests=()
for test in $tests; do
  echo "=== $test"
  if $PYTHON -m pytest "$test" -q -rs -p no:cacheprovider; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    failed_tests+=("$test")
  fi
done
for test in "${failed_tests[@]}"; do echo "FAILED $test"; done
echo "standalone: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
