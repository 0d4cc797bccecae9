#!/usr/bin/env bash
# Proof that the core works inside Lightning itself: Lightning's pinned master (its sources, Fabric's tests and the
# ruff configuration), the series of tools/upstream_series.py written into it without commits (`--apply`), and then,
# with the installed release's dependencies and `lightning_fsdp` made impossible to import, Lightning's own CPU tests of
# the files the series changes, which hold the carried core tests too:
#   tests_fabric/strategies/test_fsdp.py, strategies/test_model_parallel.py, utilities/test_load.py,
#   utilities/test_imports.py (`import lightning.fabric` where torch.distributed is unavailable), test_connector.py
# About 3 minutes on 2 cores. tools/test_series.sh runs the same after each PR.
#
# Lightning comes from a git repository holding the pinned commit: $LIGHTNING_GIT_DIR, else the local mirror, else a
# clone from GitHub; with none of them the check says so and is skipped (REQUIRE_LIGHTNING_SOURCE=1: fails). Lightning's
# tests come from master because the release's sdist has none; tools/test_core_on_sdist.sh, run after this one, proves
# the series on that sdist with the core's own tests.
# Usage: tools/test_patched_upstream.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PY:-.venv/bin/python}}
case "$PY" in /*) ;; */*) PY=$PWD/$PY ;; esac
PROJECT=$PWD
started=$(date +%s)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

CHECK="patched-upstream check"
ELSEWHERE="The core's own tests (tests/tests_fabric/core/) ran in the package's suite."
source tools/lightning_source.sh
TREE=$WORK/lightning
"$PY" tools/upstream_series.py "$TREE" --from-git "$GIT_DIR_@$PINNED" --apply

# From here on, nothing may come from this project: a `lightning_fsdp` that refuses to import shadows the installed one.
mkdir -p "$WORK/block/lightning_fsdp"
echo 'raise ImportError("the patched-upstream run must not import lightning_fsdp")' >"$WORK/block/lightning_fsdp/__init__.py"
export PYTHONPATH="$TREE/src:$WORK/block:$PROJECT/tools"
"$PY" -c "
import lightning, torch
assert lightning.__file__.startswith('$TREE/src/'), lightning.__file__
print(f'patched lightning {lightning.__version__} from {lightning.__file__}, torch {torch.__version__}')
"
cd "$TREE/tests"
# ranks from a fork server with torch and Lightning imported, instead of a fresh interpreter each (the plugin says why)
"$PY" -m pytest -p no:cacheprovider -p pytest_forkserver_ranks -q --color=no -o addopts="" \
    tests_fabric/strategies/test_fsdp.py tests_fabric/strategies/test_model_parallel.py \
    tests_fabric/utilities/test_load.py tests_fabric/utilities/test_imports.py tests_fabric/test_connector.py
echo "patched-upstream check took $(($(date +%s) - started)) s"
