"""Lightning's own tests of the two strategies: on the tree the upstream command patches, and against this package.

Lightning's tests are not on PyPI (its sdist has none) and this project never copies them, so these tests need a
checkout of Lightning: ``LIGHTNING_TESTS=/path/to/pytorch-lightning`` (a git checkout, or any tree with its
``tests/tests_fabric/``); they are skipped without one. The patched tree is the checkout's own ``src/`` (a release
tag, or master at the pinned commit); the run against this package's classes needs tests of the installed release
(tag 2.6.5 or 2.6.6: master's tests import what the release does not have). docs/source-fabric/upstream.rst names the
commits they were run at, the counts and the time.

Every test of those files must pass except the intended behaviour changes below, each with its reason; a new failure,
or an intended change that passes again, fails these tests.
"""

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from lightning_fsdp.upstream import plan
from tests.tests_fabric.test_upstream import installed_lightning_tree

pytestmark = pytest.mark.package_only

_CHECKOUT = os.environ.get("LIGHTNING_TESTS")
_PLUGIN_DIR = Path(__file__).parent / "helpers" / "lightning_suite"
_SRC = Path(__file__).resolve().parents[2] / "src"

#: Lightning's test modules of the two strategies and of what the command changes around them.
STRATEGY_TESTS = ("tests_fabric/strategies/test_fsdp.py", "tests_fabric/strategies/test_model_parallel.py")
PATCHED_TREE_TESTS = (*STRATEGY_TESTS, "tests_fabric/test_connector.py", "tests_fabric/utilities/test_load.py")

#: Upstream's tests that fail on purpose, with the reason (the list in docs/source-fabric/upstream.rst).
INTENDED_CHANGES = {
    # The last call loads an empty file into a `Mock(spec=nn.Module)` through a mocked `torch.load`. The new loader
    # reads the file itself and refuses an empty one (`CheckpointLoadError`: "is empty (0 bytes)").
    "test_load_checkpoint_one_fsdp_module_required": "an empty file is not loaded through a mocked `torch.load`",
    "test_load_checkpoint_one_dist_module_required": "an empty file is not loaded through a mocked `torch.load`",
    # Materialised tensors that nothing initialised are NaN; the warning names them when a load leaves them unwritten.
    "test_meta_device_materialization": "the warning about uninitialised tensors comes with the load, by name",
}
#: On the patched tree only: the connector's GPU-only check for FSDP is removed. Master's tests of its remote branch
#: (fsspec URLs, read whole through `cloud_io._load`, which they mock) meet the shard-local remote reader instead: a
#: remote file is read by byte ranges, with `weights_only=True` unless `weights_only=False` is passed, and a remote
#: sharded directory by the validated reader. The release's tests have none of these; only the tests a run collects
#: are expected.
INTENDED_CHANGES_PATCHED = {
    **INTENDED_CHANGES,
    "test_fsdp_unsupported_on_cpu": "FSDP runs on CPU (gloo)",
    "test_load_full_checkpoint_remote_allows_non_tensor_objects": "a remote file is read by byte ranges, weights-only",
    "test_load_full_checkpoint_remote_honors_explicit_weights_only": "a remote file is read by byte ranges",
    "test_load_sharded_checkpoint_metadata_weights_only": "a remote sharded directory is read by the validated reader",
}


def _expected_failures(intended: dict[str, str], outcomes: dict[str, list[str]]) -> list[str]:
    collected = {name for names in outcomes.values() for name in names}
    return sorted(name for name in intended if name in collected)


def _run_lightning_tests(files: tuple[str, ...], pythonpath: list[Path], plugin: str | None, out: Path) -> dict:
    tests_dir = Path(_CHECKOUT or "") / "tests"
    report = out / "report.xml"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts=", f"--junitxml={report}"]
    command += ["-p", plugin] if plugin else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(path) for path in pythonpath)}
    completed = subprocess.run(
        [*command, *files], cwd=tests_dir, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    cases = ElementTree.parse(report).getroot().iter("testcase")
    outcomes = {"passed": [], "failed": [], "skipped": []}
    for case in cases:
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        outcomes["failed" if kind in ("failure", "error") else kind].append(case.get("name"))
    assert outcomes["passed"], completed.stdout[-3000:] + completed.stderr[-3000:]
    return outcomes


@pytest.mark.skipif(_CHECKOUT is None, reason="set LIGHTNING_TESTS to a checkout of Lightning to run its tests")
def test_lightnings_strategy_tests_against_this_package(tmp_path):
    """Upstream's tests of both strategies, with `FSDPStrategy` and `ModelParallelStrategy` being this package's."""
    outcomes = _run_lightning_tests(STRATEGY_TESTS, [_SRC, _PLUGIN_DIR], "redirect_strategies", tmp_path)
    assert sorted(outcomes["failed"]) == _expected_failures(INTENDED_CHANGES, outcomes)


@pytest.mark.skipif(_CHECKOUT is None, reason="set LIGHTNING_TESTS to a checkout of Lightning to run its tests")
def test_lightnings_tests_on_the_patched_tree(tmp_path):
    """Upstream's tests of the strategies, the connector and `utilities/load.py`, on the tree the command patched.

    The tree is the checkout's own sources when it has them (tests and sources of one commit: a release tag or the
    pinned master), else a copy of the installed release.

    """
    checkout_src = Path(_CHECKOUT or "") / "src"
    if (checkout_src / "lightning").is_dir():
        tree = tmp_path / "lightning"
        shutil.copytree(checkout_src, tree / "src", ignore=shutil.ignore_patterns("__pycache__"))
    else:
        tree = installed_lightning_tree(tmp_path / "lightning")
    plan(tree).write()
    outcomes = _run_lightning_tests(PATCHED_TREE_TESTS, [tree / "src"], None, tmp_path)
    assert sorted(outcomes["failed"]) == _expected_failures(INTENDED_CHANGES_PATCHED, outcomes)
