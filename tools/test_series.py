# Copyright The lightning-fsdp developers.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Every step of the series green: ``python tools/test_series.py TREE`` (see tools/test_series.sh).

TREE is a git checkout of Lightning (the pinned master) with a clean working tree. Unless ``--base REV`` names the
commit below a series already committed there, the series is committed first (``--series``). Then, at each step's
commit, it runs Lightning's tests of the strategies (the four files of ``test_lightning_suite.py``) on the tree's own
``src/``, and the carried tests of this project that the step adds, with ``lightning_fsdp`` impossible to import. It
prints, per step: Lightning's tests passed, failed and edited on purpose (the step's ``lightning_edits`` and those of
the steps before, each edited in the step that needs it), ours passed, and the lines the step changes. It fails
unless, at every step, Lightning's tests and ours pass.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.etree import ElementTree

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT / "src"))

from lightning_fsdp.upstream._series import STEPS  # noqa: E402

LIGHTNING_TESTS = (
    "tests_fabric/strategies/test_fsdp.py",
    "tests_fabric/strategies/test_model_parallel.py",
    "tests_fabric/test_connector.py",
    "tests_fabric/utilities/test_load.py",
)
CARRIED = "tests/tests_fabric/utilities/checkpoint_loading/"
#: The carried files that CI runs on the patched release (tools/test_patched_upstream.sh), and the agreement's tests so
#: that every step that brings code runs some of ours; ``--all`` runs every one.
CI_FILES = (
    "test_load_raw.py",
    "test_fsdp_roundtrip.py",
    "test_devices.py",
    "test_load_errors.py",
    "test_strategy.py",
    "test_fsdp2.py",
    "loading/test_formats.py",
    "loading/test_agreement.py",
    "loading/test_remote.py",
)


def git(tree: Path, *args: str) -> str:
    """Run git in ``tree``; return its output."""
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout


def pytest(tree: Path, files: list[str], block: Path, report: Path) -> dict[str, list[str]]:
    """Run ``files`` from the tree's ``tests/`` on its ``src/``; return the test ids by outcome."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{block}"}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts=", f"--junitxml={report}"]
    completed = subprocess.run([*command, *files], cwd=tree / "tests", env=env, capture_output=True, text=True)
    outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    if not report.is_file():
        raise SystemExit(f"pytest did not run:\n{completed.stdout[-3000:]}{completed.stderr[-3000:]}")
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        name = f"{case.get('classname')}::{case.get('name')}"
        outcomes["failed" if kind in ("failure", "error") else kind].append(name)
    report.unlink()
    return outcomes


def lines_changed(tree: Path, commit: str) -> dict[str, list[int]]:
    """Lines added and removed by ``commit``: source, tests, docs (the CHANGELOG counts as docs)."""
    counts = {"src": [0, 0], "tests": [0, 0], "docs": [0, 0]}
    for line in git(tree, "show", "--numstat", "--format=", commit).splitlines():
        added, removed, path = line.split("\t")
        kind = "docs" if path.startswith("docs/") or path.endswith("CHANGELOG.md") else path.split("/")[0]
        if kind in counts:
            counts[kind][0] += int(added)
            counts[kind][1] += int(removed)
    return counts


def main() -> int:
    """Check every step; print the table; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path)
    parser.add_argument("--base", help="the commit below a series already committed in TREE")
    parser.add_argument("--all", action="store_true", help="run every carried test file a step adds, not CI's list")
    args = parser.parse_args()
    tree = args.tree.resolve()
    if args.base is None:
        args.base = git(tree, "rev-parse", "HEAD").strip()
        env = {**os.environ, "PYTHONPATH": str(PROJECT / "src")}
        subprocess.run([sys.executable, "-m", "lightning_fsdp.upstream", "--series", str(tree)], check=True, env=env)
    commits = git(tree, "rev-list", "--reverse", f"{args.base}..HEAD").split()
    if len(commits) != len(STEPS):
        raise SystemExit(f"{tree} has {len(commits)} commits above {args.base}; the series has {len(STEPS)}")
    head = git(tree, "rev-parse", "--abbrev-ref", "HEAD").strip()
    rows, failures = [], []
    edited: set[str] = set()
    with tempfile.TemporaryDirectory() as work:
        block = Path(work) / "block"
        (block / "lightning_fsdp").mkdir(parents=True)
        (block / "lightning_fsdp" / "__init__.py").write_text('raise ImportError("the series must not import it")\n')
        try:
            for number, (commit, step) in enumerate(zip(commits, STEPS, strict=True), 1):
                started = time.monotonic()
                git(tree, "checkout", "--quiet", "--detach", commit)
                edited |= {edit.node_id for edit in step.lightning_edits}
                theirs = pytest(tree, list(LIGHTNING_TESTS), block, Path(work) / "report.xml")
                if theirs["failed"]:
                    failures.append(f"step {number}: Lightning's tests failed: {theirs['failed']}")
                added = git(tree, "show", "--name-only", "--format=", commit).split()
                ours_files = [
                    path.removeprefix("tests/")
                    for path in added
                    if path.startswith(CARRIED)
                    and Path(path).name.startswith("test_")
                    and (args.all or path.removeprefix(CARRIED) in CI_FILES)
                ]
                ours = pytest(tree, ours_files, block, Path(work) / "report.xml") if ours_files else None
                if ours is not None and ours["failed"]:
                    failures.append(f"step {number}: ours failed {ours['failed']}")
                counts = lines_changed(tree, commit)
                rows.append(
                    (
                        number,
                        commit[:10],
                        len(theirs["passed"]),
                        len(theirs["failed"]),
                        len(edited),
                        "-" if ours is None else f"{len(ours['passed'])} ({len(ours['skipped'])} skipped)",
                        ", ".join(Path(path).name for path in ours_files) or "-",
                        " ".join(f"{kind} +{a}/-{r}" for kind, (a, r) in counts.items()),
                        f"{time.monotonic() - started:.0f} s",
                    )
                )
                print(" | ".join(str(cell) for cell in rows[-1]), flush=True)
        finally:
            git(tree, "checkout", "--quiet", head if head != "HEAD" else commits[-1])
    print("\n| step | commit | Lightning passed | failed | edited | ours passed | our files | lines | time |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
