#!/usr/bin/env bash
# Lightning's own CPU tests of the Trainer's strategies, run against this package's: master's
# tests_pytorch/strategies/test_fsdp.py and test_model_parallel.py, on master's sources, with `lightning_fsdp.enable()`
# in effect (tools/pytest_enable_lightning_fsdp.py), so that every strategy the tests build is
# `lightning_fsdp.pytorch`'s. The tests deselected below are the intended differences, each with its reason; every
# other test must pass. About 20 seconds.
# Usage: tools/test_trainer_drop_in.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PY:-.venv/bin/python}}
case "$PY" in /*) ;; */*) PY=$PWD/$PY ;; esac
PROJECT=$PWD
PINNED=7f0c3436cd3f6ad3753125672024fc415cbcb414
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

GIT_DIR_=${LIGHTNING_GIT_DIR:-/work/.mirror/Lightning-AI+pytorch-lightning/repo}
if ! git --git-dir="$GIT_DIR_" cat-file -e "$PINNED" 2>/dev/null; then
    GIT_DIR_=$WORK/lightning.git
    if ! timeout 300 git clone --quiet --bare --filter=blob:none https://github.com/Lightning-AI/pytorch-lightning.git \
        "$GIT_DIR_" 2>/dev/null; then
        echo "Trainer drop-in check SKIPPED: no git repository of Lightning holding $PINNED (set LIGHTNING_GIT_DIR)" \
            "and GitHub not reachable. The package's own Trainer tests (tests/tests_pytorch/) ran in its suite." >&2
        [ "${REQUIRE_LIGHTNING_SOURCE:-0}" = 1 ] && exit 1
        exit 0
    fi
fi
git --git-dir="$GIT_DIR_" archive "$PINNED" src tests/tests_pytorch | tar -x -C "$WORK"

# Intended differences: with `enable()` the Trainer accepts FSDP on CPU; the other tests replace upstream's loading
# internals with mocks (`_lazy_load`, `_load`, `_load_raw_module_state`, a `Mock` model), which this package's loader
# does not call: the package's own tests load real checkpoints in their place (tests/tests_pytorch/).
DESELECT=(
    tests_pytorch/strategies/test_fsdp.py::test_invalid_on_cpu
    tests_pytorch/strategies/test_fsdp.py::test_strategy_load_optimizer_states_multiple
    tests_pytorch/strategies/test_fsdp.py::test_lazy_load_full_state_dict
    tests_pytorch/strategies/test_fsdp.py::test_load_full_checkpoint_remote_honors_explicit_weights_only
    tests_pytorch/strategies/test_fsdp.py::test_load_full_checkpoint_remote_allows_non_tensor_objects
    tests_pytorch/strategies/test_fsdp.py::test_load_sharded_checkpoint_metadata_weights_only
)
cd "$WORK/tests"
PYTHONPATH="$WORK/src:$PROJECT/src:$PROJECT/tools" "$PY" -m pytest -p no:cacheprovider -p pytest_enable_lightning_fsdp \
    -q --color=no -o addopts="" tests_pytorch/strategies/test_fsdp.py tests_pytorch/strategies/test_model_parallel.py \
    "${DESELECT[@]/#/--deselect=}"
