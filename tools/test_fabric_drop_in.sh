#!/usr/bin/env bash
# Lightning's own CPU tests of Fabric's strategies, run against this package's: master's
# tests_fabric/strategies/test_fsdp.py and test_model_parallel.py, on master's sources, with `lightning_fsdp.enable()`
# in effect (tools/pytest_enable_lightning_fsdp.py), so that every strategy the tests build is `lightning_fsdp`'s.
# The tests deselected below are the intended differences, each with its reason; every other test must pass, with
# upstream's exception types and messages where it checks them. About 20 seconds.
# Usage: tools/test_fabric_drop_in.sh [PYTHON]   (default: .venv/bin/python)
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
        echo "Fabric drop-in check SKIPPED: no git repository of Lightning holding $PINNED (set LIGHTNING_GIT_DIR)" \
            "and GitHub not reachable. The package's own tests of its Fabric strategies ran in its suite." >&2
        [ "${REQUIRE_LIGHTNING_SOURCE:-0}" = 1 ] && exit 1
        exit 0
    fi
fi
# (a partial mirror lacks blobs outside these paths, which git names on stderr: a missing file here fails the run)
git --git-dir="$GIT_DIR_" archive "$PINNED" src tests/tests_fabric 2>/dev/null | tar -x -C "$WORK"
test -f "$WORK/tests/tests_fabric/strategies/test_fsdp.py"

# Intended differences. The package's classes override what these tests replace with mocks (upstream's `setup_module`,
# its loading internals `_load` and `_load_raw_module_state`, a `Mock` model saved or loaded from an empty file), so
# the mocks do not reach the code they stand in for: the package's own tests load and save real checkpoints there
# (tests/tests_fabric/). And FSDP2's `setup_module` of a meta-device model does not warn about modules without
# `reset_parameters()`: the package runs the model's own initialisation first and warns after a load about the
# tensors that are still uninitialised (docs: "Hugging Face models with empty_init=True").
DESELECT=(
    tests_fabric/strategies/test_fsdp.py::test_setup_use_orig_params
    tests_fabric/strategies/test_fsdp.py::test_load_checkpoint_one_fsdp_module_required
    tests_fabric/strategies/test_fsdp.py::test_load_full_checkpoint_remote_allows_non_tensor_objects
    tests_fabric/strategies/test_fsdp.py::test_load_full_checkpoint_remote_honors_explicit_weights_only
    tests_fabric/strategies/test_fsdp.py::test_load_sharded_checkpoint_metadata_weights_only
    tests_fabric/strategies/test_model_parallel.py::test_save_checkpoint_path_exists
    tests_fabric/strategies/test_model_parallel.py::test_load_checkpoint_one_dist_module_required
    tests_fabric/strategies/test_model_parallel.py::test_meta_device_materialization
)
cd "$WORK/tests"
PYTHONPATH="$WORK/src:$PROJECT/src:$PROJECT/tools" "$PY" -m pytest -p no:cacheprovider -p pytest_enable_lightning_fsdp \
    -q --color=no -o addopts="" tests_fabric/strategies/test_fsdp.py tests_fabric/strategies/test_model_parallel.py \
    "${DESELECT[@]/#/--deselect=}"
