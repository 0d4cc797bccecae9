import os
from collections import Counter

import pytest
import torch.distributed

from tests.tests_fabric.helpers.env import LAUNCHER_VARIABLES

# Variables that launchers, cluster environments and Fabric itself set. A test that leaks one of them changes how
# every following test detects its environment, so they are restored after each test.
_ENV_VARS_TO_RESTORE = sorted(
    LAUNCHER_VARIABLES
    | {"CUDA_VISIBLE_DEVICES", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "TORCHELASTIC_RUN_ID"}
    | {"SLURM_JOB_NAME", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_PROCID"}
)


@pytest.fixture(autouse=True)
def restore_env_variables():
    """Restore the environment variables that launchers and cluster environments read or write."""
    saved = {name: os.environ.get(name) for name in _ENV_VARS_TO_RESTORE}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def teardown_process_group():
    """Destroy a process group a test left behind, so the next test can create its own."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def reset_rank_zero_only():
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", 0)
    yield
    rank_zero_only.rank = rank


def pytest_collection_modifyitems(items: list[pytest.Item], config: pytest.Config) -> None:
    """With ``PL_RUN_STANDALONE_TESTS=1``, keep only the tests marked standalone (as Lightning's suite does)."""
    if os.getenv("PL_RUN_STANDALONE_TESTS", "0") != "1":
        return
    selected, deselected = [], []
    for item in items:
        is_standalone = any(
            marker.name == "skipif" and marker.kwargs.get("standalone") for marker in item.iter_markers()
        )
        (selected if is_standalone else deselected).append(item)
    config.hook.pytest_deselected(items=deselected)
    items[:] = selected


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say how many of the guide's example scripts ran, counted by this run: the README points at this line."""
    from tests.tests_fabric.test_docs_examples import _EXAMPLES

    outcomes: dict[str, str] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            # A failed teardown after a passed call counts as failed.
            if "test_docs_examples.py::test_docs_example_runs[" in nodeid and outcomes.get(nodeid) in (None, "passed"):
                outcomes[nodeid] = outcome
    if outcomes:
        counts = Counter(outcomes.values())
        shown = ", ".join(f"{counts[name]} {name}" for name in ("passed", "failed", "error", "skipped") if counts[name])
        terminalreporter.write_line(
            f"docs examples: {len(outcomes)} of the {len(_EXAMPLES)} scripts in docs/source-fabric/examples/ ran as"
            f" scripts: {shown}"
        )
