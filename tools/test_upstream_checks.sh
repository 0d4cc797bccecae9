#!/usr/bin/env bash
# The four checks against Lightning's own code, at once (each is one pytest process; on 2 cores the four together
# take about as long as the longest alone): tools/test_patched_upstream.sh (the series in Lightning's master, Lightning's
# tests), tools/test_core_on_sdist.sh (the series in the installed release's sdist, the core's tests),
# tools/test_trainer_drop_in.sh (Lightning's Trainer strategy tests against lightning_fsdp.pytorch) and
# tools/test_fabric_drop_in.sh (Lightning's Fabric strategy tests against lightning_fsdp). Each one's output
# is printed whole, in that order, once all have finished; the exit status is the first failure's, or 0.
# Usage: tools/test_upstream_checks.sh [PYTHON]   (default: .venv/bin/python)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PY:-.venv/bin/python}}
started=$(date +%s)
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
CHECKS=(test_patched_upstream test_core_on_sdist test_trainer_drop_in test_fabric_drop_in)
pids=()
for check in "${CHECKS[@]}"; do
    bash "tools/$check.sh" "$PY" >"$LOGS/$check.log" 2>&1 &
    pids+=($!)
done
status=0
for index in "${!CHECKS[@]}"; do
    wait "${pids[$index]}"
    code=$?
    echo "=== tools/${CHECKS[$index]}.sh (exit code $code) ==="
    cat "$LOGS/${CHECKS[$index]}.log"
    if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then
        status=$code
    fi
done
echo "upstream checks took $(($(date +%s) - started)) s"
exit "$status"
