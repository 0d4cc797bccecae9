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
skipped=0
failed=0
failed_tests=()
for test in $tests; do
  echo "=== $test"
  output=$($PYTHON -m pytest "$test" -q -rs -p no:cacheprovider 2>&1)
  status=$?
  echo "$output"
  summary=$(echo "$output" | tail -n 1)
  if [ "$status" -ne 0 ]; then
    failed=$((failed + 1))
    failed_tests+=("$test")
  elif echo "$summary" | grep -q "passed"; then
    passed=$((passed + 1))
  else
    skipped=$((skipped + 1))  # the hardware it asks for is not here
  fi
done
for test in "${failed_tests[@]}"; do echo "FAILED $test"; done
echo "standalone: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
