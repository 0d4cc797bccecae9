#!/usr/bin/env bash
# Proof that this project's change works inside Lightning itself. Downloads the sdist of the `lightning` release that
# is installed in the environment (the one this package is tested with), writes the change into it with
# `python -m lightning_fsdp.upstream`, and runs this project's loading, device and round-trip tests against the patched
# upstream class (`lightning.fabric.strategies.FSDPStrategy`), with `lightning_fsdp` made impossible to import.
#
# The test files, picked to stay well under 5 minutes on 2 cores (about 2.5 minutes measured):
#   test_load_raw.py          fabric.load_raw / fabric.load of raw, safetensors and Hugging Face files, shard-locally
#   test_fsdp_roundtrip.py    save and load, full and sharded, with optimizer state, on 2 CPU ranks
#   test_devices.py           the device checks merged into strategies/parallel.py
#   test_load_errors.py       refusals raised on every rank as the same error
#   test_strategy.py          the new constructor arguments, CPU wrapping (package-only tests left out)
#   test_fsdp2.py             ModelParallelStrategy (FSDP2) merged the same way: every format into DTensor shards
#   loading/test_formats.py   the loading package on its own (formats, byte ranges), no processes
#   loading/test_remote.py    the remote reader on fsspec's memory file system, no processes
# Usage: tools/test_patched_upstream.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PY:-.venv/bin/python}}
# Absolute: the tests run from inside the patched tree (`make test` passes the venv's python as a relative path).
case "$PY" in /*) ;; */*) PY=$PWD/$PY ;; esac
PROJECT=$PWD
started=$(date +%s)
VERSION=$("$PY" -c 'from importlib.metadata import version; print(version("lightning"))')
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if ! "$PY" -m pip download --quiet --no-binary :all: --no-deps "lightning==$VERSION" -d "$WORK/sdist"; then
    echo "error: could not download the sdist of lightning==$VERSION from PyPI (is the network reachable?)." >&2
    echo "error: the patched-upstream check did not run; it needs PyPI." >&2
    exit 1
fi
tar -xzf "$WORK"/sdist/lightning-*.tar.gz -C "$WORK"
TREE=$WORK/lightning-$VERSION
# An sdist has no tests/: create the packages a git checkout has, so that the command carries the tests there.
mkdir -p "$TREE/tests/tests_fabric/utilities"
touch "$TREE/tests/tests_fabric/__init__.py" "$TREE/tests/tests_fabric/utilities/__init__.py"

PYTHONPATH="$PROJECT/src" "$PY" -m lightning_fsdp.upstream "$TREE"

# From here on, nothing may come from this project: a `lightning_fsdp` that refuses to import shadows the installed one.
mkdir -p "$WORK/block/lightning_fsdp"
echo 'raise ImportError("the patched-upstream run must not import lightning_fsdp")' >"$WORK/block/lightning_fsdp/__init__.py"
export PYTHONPATH="$TREE/src:$WORK/block"
"$PY" -c "
import lightning, torch, sys
assert lightning.__file__.startswith('$TREE/src/'), lightning.__file__
print(f'patched lightning {lightning.__version__} from {lightning.__file__}, torch {torch.__version__}')
"
cd "$TREE/tests"
TESTS=tests_fabric/utilities/checkpoint_loading
"$PY" -m pytest -p no:cacheprovider -q --color=no -o addopts="--strict-markers" \
    "$TESTS/test_load_raw.py" "$TESTS/test_fsdp_roundtrip.py" "$TESTS/test_devices.py" "$TESTS/test_load_errors.py" \
    "$TESTS/test_strategy.py" "$TESTS/test_fsdp2.py" "$TESTS/loading/test_formats.py" "$TESTS/loading/test_remote.py"
echo "patched-upstream check took $(($(date +%s) - started)) s"
