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
"""Every PR of the series green on Lightning's master: ``python tools/test_series.py [TREE]`` (see test_series.sh).

Writes the series (tools/upstream_series.py) into TREE, a fresh repository made from the pinned master of the local
mirror (``--git GIT_DIR@REV``), unless ``--base REV`` names the commit below a series already committed in TREE. Then,
on master and after each PR, with the tree's ``src/`` first on the path and ``lightning_fsdp`` impossible to import:
Lightning's CPU tests of the strategies and loading (the carried tests are in the same files), ``ruff check`` and
``ruff format --check`` with Lightning's configuration on the files the PR changes, ``import lightning.fabric``
with safetensors and s3fs unimportable (and, in utilities/test_imports.py, with ``torch.distributed`` unavailable),
and no module-level import of safetensors, s3fs or tqdm in the Fabric modules the PR changes. Prints a table; fails
unless every PR passes everything that passed on master.
"""

import argparse
import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

PROJECT = Path(__file__).resolve().parents[1]
MIRROR = "/work/.mirror/Lightning-AI+pytorch-lightning/repo@7f0c3436cd3f6ad3753125672024fc415cbcb414"
LIGHTNING_TESTS = (
    "tests_fabric/strategies/test_fsdp.py",
    "tests_fabric/strategies/test_model_parallel.py",
    "tests_fabric/utilities/test_load.py",
    "tests_fabric/utilities/test_imports.py",
    "tests_fabric/test_connector.py",
)
RESULT = re.compile(r"^(tests_fabric/\S+::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", re.MULTILINE)
COLLECTION_ERROR = re.compile(r"^ERROR (tests_fabric/[^\s:]+)\s*$", re.MULTILINE)
SUMMARY = re.compile(r"^=+ .* in [\d.]+s", re.MULTILINE)
STARTED = re.compile(r"^(tests_fabric/\S+::\S+)", re.MULTILINE)
#: ``import lightning.fabric`` where safetensors and s3fs are missing (probes with ``find_spec`` see them: torch does).
WITHOUT_OPTIONAL = """
import importlib.machinery, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("safetensors", "s3fs"):
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        raise ImportError(f"No module named {spec.name!r}")
sys.meta_path.insert(0, Refuse())
import lightning.fabric
"""
#: Optional packages that Fabric's modules may import only inside functions (``lightning`` imports tqdm anyway, through
#: ``lightning.pytorch``, so for tqdm the check reads the modules).
OPTIONAL = ("safetensors", "s3fs", "tqdm")


#: Top-level packages of the tests that need no requirement of their own.
KNOWN = {"lightning", "tests_fabric", "torch", "pytest"}


def module_level_imports(text: str) -> list[str]:
    """The top-level packages that a module imports at module level."""
    nodes = [
        n for n in ast.parse(text).body if isinstance(n, (ast.Import, ast.ImportFrom)) and not getattr(n, "level", 0)
    ]
    return [(alias.name if isinstance(n, ast.Import) else n.module).split(".")[0] for n in nodes for alias in n.names]


def top_level_optional_imports(path: Path) -> list[str]:
    """The optional packages that a module imports at module level (outside ``if TYPE_CHECKING:``)."""
    found, body = [], list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            body += node.body + node.orelse
        elif isinstance(node, ast.Try):
            body += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [getattr(node, "module", "") or ""]
        found += [
            name for name in names if isinstance(node, (ast.Import, ast.ImportFrom)) and name.split(".")[0] in OPTIONAL
        ]
    return found


def git(tree: Path, *args: str) -> str:
    """Run git in ``tree``; return its output."""
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout


def run_in_session(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """Run ``command`` in a session of its own; then end what it left running (the other ranks of a failed launch)."""
    with subprocess.Popen(command, start_new_session=True, stdout=PIPE, stderr=PIPE, text=True, **kwargs) as process:
        stdout, stderr = process.communicate()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def pytest(tree: Path, env: dict, extra: list[str]) -> dict[str, list[str]]:
    """Run Lightning's test files on the tree's ``src/``; return the test ids by outcome.

    A multi-process test that fails can take pytest down with it (the launcher's observer kills the main process when
    a child dies): that test counts as failed, and pytest runs again without the tests done so far.
    """
    files = [f for f in LIGHTNING_TESTS if (tree / "tests" / f).is_file()]
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-o", "addopts=", "--color=no", *extra]
    # ranks from a fork server with torch and Lightning imported (tools/pytest_forkserver_ranks.py says why)
    command += ["-p", "pytest_forkserver_ranks"]
    # the ids that `--deselect` takes are relative to the rootdir; a test that hangs (ranks waiting for each other)
    # ends its pytest after 5 minutes and counts as crashed
    command += ["--rootdir", str(tree), "--timeout", "300", "--timeout-method", "thread"]
    outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    done: list[str] = []
    while True:
        deselect = [arg for test in done for arg in ("--deselect", f"tests/{test}")]
        run = run_in_session([*command, *deselect, *files], cwd=tree / "tests", env=env)
        outcomes["failed"] += [f"{path} (collection error)" for path in COLLECTION_ERROR.findall(run.stdout)]
        for test, outcome in RESULT.findall(run.stdout):
            kind = {"PASSED": "passed", "XFAIL": "passed", "SKIPPED": "skipped"}.get(outcome, "failed")
            outcomes[kind].append(test)
            done.append(test)
        if run.returncode >= 0 and SUMMARY.search(run.stdout):
            return outcomes
        started = STARTED.findall(run.stdout)
        if not started:
            raise SystemExit(f"pytest did not run ({run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
        if started[-1] in done:  # killed after its last test had reported
            return outcomes
        outcomes["failed"].append(started[-1] + " (crashed)")
        done.append(started[-1])


def checks(tree: Path, env: dict, changed: list[str]) -> list[str]:
    """Ruff on the changed Python files and the two import checks; return what failed."""
    failed = []
    python = [f for f in changed if f.endswith(".py") and (tree / f).is_file()]
    ruff = [str(Path(sys.executable).with_name("ruff")), "--config", str(tree / "pyproject.toml")]
    for command in (["check"], ["format", "--check"]):
        if python and subprocess.run([ruff[0], *command, *ruff[1:], *python], cwd=tree, capture_output=True).returncode:
            failed.append(f"ruff {' '.join(command)}")
    if subprocess.run([sys.executable, "-c", WITHOUT_OPTIONAL], env=env, capture_output=True).returncode:
        failed.append("import without safetensors/s3fs")
    for path in (f for f in python if f.startswith("src/lightning/fabric/")):
        if imported := top_level_optional_imports(tree / path):
            failed.append(f"{path} imports {imported} at module level")
    required = {re.split(r"[^\w.-]", line.strip())[0].lower().replace("-", "_") for req in
                (tree / "requirements" / "fabric").glob("*.txt") for line in req.read_text().splitlines()}  # fmt: skip
    for path in (f for f in python if f.startswith("tests/")):
        before = git(tree, "show", f"HEAD~1:{path}") if git(tree, "ls-tree", "HEAD~1", path) else ""
        new = set(module_level_imports((tree / path).read_text())) - set(module_level_imports(before))
        if unknown := sorted(n for n in new if n not in required | set(sys.stdlib_module_names) | KNOWN):
            failed.append(f"{path} imports {unknown} at module level, not in requirements/fabric")
    return failed


def main() -> int:
    """Check every PR; print the table; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, nargs="?", help="default: a temporary directory")
    parser.add_argument("--git", default=MIRROR, help="GIT_DIR@REV of Lightning to make TREE from")
    parser.add_argument("--base", help="the commit below a series already committed in TREE")
    parser.add_argument("--core", type=Path, action="append", default=[], help="read the core from this checkout")
    parser.add_argument("-k", default="", help="pytest -k expression (default: all)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="series-"))
    tree = (args.tree or work / "lightning").resolve()
    if args.base is None:
        existed = tree.exists()
        args.base = git(tree, "rev-parse", "HEAD").strip() if existed else "master"
        command = [sys.executable, str(PROJECT / "tools/upstream_series.py"), str(tree), "--series", "series"]
        command += [] if existed else ["--from-git", args.git]
        command += [arg for path in args.core for arg in ("--core", str(path))]
        subprocess.run(command, check=True)
    commits = [args.base, *git(tree, "rev-list", "--reverse", f"{args.base}..HEAD").split()]
    block = work / "block" / "lightning_fsdp"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text('raise ImportError("the series must not import lightning_fsdp")\n')
    tools = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(block.parent), str(tools)])}
    extra = ["-k", args.k] if args.k else []
    rows, baseline, failures = [], set(), []
    try:
        for step, commit in enumerate(commits):
            started = time.monotonic()
            git(tree, "checkout", "-q", "--detach", commit)
            outcome = pytest(tree, env, extra)
            changed = git(tree, "show", "--name-only", "--format=", commit).split() if step else []
            problems = checks(tree, env, changed)
            if step == 0:
                baseline = set(outcome["failed"])
            new = sorted(set(outcome["failed"]) - baseline)
            if new or problems:
                failures.append(f"PR {step}: failed {new} {problems}")
            title = git(tree, "log", "-1", "--format=%s", commit).strip()[:60]
            counts = [len(outcome["passed"]), len(outcome["failed"]), len(new), len(outcome["skipped"])]
            seconds = f"{time.monotonic() - started:.0f} s"
            cells = (step or "master", commit[:8], *counts, ", ".join(problems) or "ok", seconds, title)
            rows.append(cells)
            print(" | ".join(map(str, cells)), flush=True)
    finally:
        git(tree, "checkout", "-q", commits[-1])
    print("\n| PR | commit | passed | failed | new failures | skipped | ruff, imports | time | title |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for cells in rows:
        print("| " + " | ".join(map(str, cells)) + " |")
    if baseline:
        print(f"failing on master already: {sorted(baseline)}")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    print(f"tree: {tree}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
