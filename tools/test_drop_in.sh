#!/usr/bin/env bash
# Lightning's own CPU tests of its FSDP strategies, run against this package's: master's
# tests_<suite>/strategies/test_fsdp.py and test_model_parallel.py, on master's sources, with `lightning_fsdp.enable()`
# in effect (tools/pytest_enable_lightning_fsdp.py), so that every strategy the tests build is this package's:
# `lightning_fsdp`'s for Fabric, `lightning_fsdp.pytorch`'s for the Trainer. The tests deselected below are the
# intended differences, each with its reason; every other test must pass, with upstream's exception types and messages
# where it checks them. About 20 seconds each.
# Usage: tools/test_drop_in.sh fabric|trainer [PYTHON]   (default: .venv/bin/python); tools/test_fabric_drop_in.sh and
# tools/test_trainer_drop_in.sh run it for one suite.
set -euo pipefail
cd "$(dirname "$0")/.."
SUITE=$1
PY=${2:-${PY:-.venv/bin/python}}
case "$PY" in /*) ;; */*) PY=$PWD/$PY ;; esac
PROJECT=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

case "$SUITE" in
fabric)
    TESTS=tests_fabric
    CHECK="Fabric drop-in check"
    ELSEWHERE="The package's own tests of its Fabric strategies ran in its suite."
    # The package's classes override what these tests replace with mocks (upstream's `setup_module`, its loading
    # internals `_load` and `_load_raw_module_state`, a `Mock` model saved, or loaded from an empty file), so the mocks
    # do not reach the code they stand in for: the package's own tests load and save real checkpoints there
    # (tests/tests_fabric/). And FSDP2's `setup_module` of a meta-device model does not warn about modules without
    # `reset_parameters()`: the package runs the model's own initialisation first and warns after a load about the
    # tensors that are still uninitialised (docs: "Hugging Face models with empty_init=True").
    DESELECT=(
        strategies/test_fsdp.py::test_setup_use_orig_params
        strategies/test_fsdp.py::test_load_checkpoint_one_fsdp_module_required
        strategies/test_fsdp.py::test_load_full_checkpoint_remote_allows_non_tensor_objects
        strategies/test_fsdp.py::test_load_full_checkpoint_remote_honors_explicit_weights_only
        strategies/test_fsdp.py::test_load_sharded_checkpoint_metadata_weights_only
        strategies/test_model_parallel.py::test_save_checkpoint_path_exists
        strategies/test_model_parallel.py::test_load_checkpoint_one_dist_module_required
        strategies/test_model_parallel.py::test_meta_device_materialization
    )
    ;;
trainer)
    TESTS=tests_pytorch
    CHECK="Trainer drop-in check"
    ELSEWHERE="The package's own Trainer tests (tests/tests_pytorch/) ran in its suite."
    # With `enable()` the Trainer accepts FSDP on CPU; the other tests replace upstream's loading internals with mocks
    # (`_lazy_load`, `_load`, `_load_raw_module_state`, a `Mock` model), which this package's loader does not call:
    # the package's own tests load real checkpoints in their place (tests/tests_pytorch/).
    DESELECT=(
        strategies/test_fsdp.py::test_invalid_on_cpu
        strategies/test_fsdp.py::test_strategy_load_optimizer_states_multiple
        strategies/test_fsdp.py::test_lazy_load_full_state_dict
        strategies/test_fsdp.py::test_load_full_checkpoint_remote_honors_explicit_weights_only
        strategies/test_fsdp.py::test_load_full_checkpoint_remote_allows_non_tensor_objects
        strategies/test_fsdp.py::test_load_sharded_checkpoint_metadata_weights_only
    )
    ;;
*)
    echo "usage: tools/test_drop_in.sh fabric|trainer [PYTHON]" >&2
    exit 2
    ;;
esac

source tools/lightning_source.sh
# (a partial mirror lacks blobs outside these paths, which git names on stderr: a missing file here fails the run)
git --git-dir="$GIT_DIR_" archive "$PINNED" src "tests/$TESTS" 2>/dev/null | tar -x -C "$WORK"
test -f "$WORK/tests/$TESTS/strategies/test_fsdp.py"
cd "$WORK/tests"
PYTHONPATH="$WORK/src:$PROJECT/src:$PROJECT/tools" "$PY" -m pytest -p no:cacheprovider -p pytest_enable_lightning_fsdp \
    -q --color=no -o addopts="" "$TESTS/strategies/test_fsdp.py" "$TESTS/strategies/test_model_parallel.py" \
    "${DESELECT[@]/#/--deselect=$TESTS/}"
