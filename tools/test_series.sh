#!/usr/bin/env bash
# Every step of the numbered series green on Lightning's master: see tools/test_series.py.
#
#   tools/test_series.sh TREE [--base REV] [--all]
#
# TREE: a git checkout of Lightning at the pinned master (docs/source-fabric/upstream.rst), clean. Without --base,
# the series is committed onto its current branch first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exec "$PY" tools/test_series.py "$@"
