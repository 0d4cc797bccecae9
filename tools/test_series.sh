#!/usr/bin/env bash
# Every PR of the series green on Lightning's pinned master: see tools/test_series.py.
#
#   tools/test_series.sh [TREE] [--git GIT_DIR@REV] [--base REV] [--core CHECKOUT] [-k EXPR]
#
# Without TREE, a fresh repository is made from the local mirror of Lightning at the pinned master.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exec "$PY" tools/test_series.py "$@"
