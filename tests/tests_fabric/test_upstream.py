"""`python -m lightning_fsdp.upstream`: the change written into a Lightning source tree.

The tree here is a copy of the installed `lightning` package laid out as a checkout (`src/lightning/...`, with empty
`tests/tests_fabric/` and `docs/source-fabric/`), so no download is needed; tools/test_patched_upstream.sh does the
same with the sdist from PyPI and runs the carried tests against it.
"""

import ast
import io
import re
import subprocess
import sys
import tokenize
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from lightning_fsdp.upstream import UpstreamError, _apply, destinations, plan
from lightning_fsdp.upstream.__main__ import main
from lightning_fsdp.upstream._apply import _changelog, pinned_fingerprints
from lightning_fsdp.upstream._merge import merge_module
from lightning_fsdp.upstream._rewrite import UPSTREAM_NAMES, drop_package_only_blocks, package_mentions
from lightning_fsdp.upstream._series import reference_tree
from lightning_fsdp.upstream._source import Source

_DOCS = Path(__file__).resolve().parents[2] / "docs" / "source-fabric" / "upstream.rst"
pytestmark = pytest.mark.package_only


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return installed_lightning_tree(tmp_path / "lightning")


def installed_lightning_tree(root: Path) -> Path:
    """A copy of the installed `lightning` package laid out as a checkout, with empty tests and docs folders."""
    return reference_tree(root)


def _code_names(text: str) -> set[str]:
    return {token.string for token in tokenize.generate_tokens(io.StringIO(text).readline) if token.type == 1}


def test_writes_the_change_in_lightnings_layout(tree: Path) -> None:
    original_fsdp = (tree / "src/lightning/fabric/strategies/fsdp.py").read_text()
    result = plan(tree)
    result.write()
    written = {change.path for change in result.changes}
    assert {
        "src/lightning/fabric/strategies/fsdp.py",
        "src/lightning/fabric/strategies/parallel.py",
        "src/lightning/fabric/connector.py",
        "src/lightning/fabric/CHANGELOG.md",
        "src/lightning/fabric/utilities/checkpoint_loading/loader.py",
        "tests/tests_fabric/utilities/checkpoint_loading/test_load_raw.py",
        "tests/tests_fabric/utilities/checkpoint_loading/conftest.py",
        "docs/source-fabric/guide/checkpoint/loading_large_checkpoints.rst",
    } <= written
    assert not any("test_opt_in" in path or "test_cli" in path for path in written)
    fsdp = (tree / "src/lightning/fabric/strategies/fsdp.py").read_text()
    upstream_class = next(
        node for node in ast.parse(fsdp).body if isinstance(node, ast.ClassDef) and node.name == "FSDPStrategy"
    )
    assert [ast.unparse(base) for base in upstream_class.bases] == ["ParallelStrategy", "_Sharded"]  # not a subclass
    methods = [node.name for node in upstream_class.body if isinstance(node, ast.FunctionDef)]
    assert methods.count("load_checkpoint") == 1
    assert "_default_setup_environment" in methods  # upstream's body, called from ours
    assert "_default_load_checkpoint" not in methods  # remote paths too are read by the new loader
    assert "load_concurrency: How many ranks" in fsdp  # the argument joins the class docstring
    assert len(fsdp) > len(original_fsdp)
    for change in result.changes:
        if change.path.endswith(".py"):
            assert "lightning_fsdp" not in _code_names(change.new), change.path
    connector = (tree / "src/lightning/fabric/connector.py").read_text()
    assert "FSDP is only available on GPU" not in connector
    changelog = (tree / "src/lightning/fabric/CHANGELOG.md").read_text()
    unreleased = changelog.split("## [unreleased]", 1)[1].split("\n## ", 1)[0]
    assert "`load_concurrency`" in unreleased


def test_nothing_it_writes_names_the_package(tree: Path) -> None:
    """The package's name stays with the package: upstream's spellings replace the names it keeps (upstream.rst)."""
    result = plan(tree)
    written = {change.path: change.new for change in result.changes}
    assert [f"{path}:{line}" for path, text in written.items() for line in package_mentions(text)] == []
    assert not [note for note in result.notes if "names the package" in note]
    everything = "\n".join(written.values())
    unused = [ours for ours, upstream in UPSTREAM_NAMES.items() if upstream not in everything]
    assert unused == [], "these names are no longer carried: remove their rules"
    # A file that carries a header carries Lightning's, as Lightning's own files have it.
    lightning_header = _header((tree / "src/lightning/fabric/strategies/fsdp.py").read_text())
    headers = {path: _header(text) for path, text in written.items() if path.endswith(".py") and _header(text)}
    new_files = [change.path for change in result.changes if change.old is None and change.path in headers]
    assert new_files
    assert {path: headers[path] for path in new_files} == {path: lightning_header for path in new_files}


def _header(text: str) -> str:
    lines = text.splitlines()
    end = next((index for index, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return "\n".join(lines[:end]) if end and lines[0].startswith("# Copyright") else ""


def test_the_package_only_parts_of_the_guide_are_left_out() -> None:
    page = "Intro, see `Usage`_.\n\n.. package-only\n\n.. _usage:\n\nUsage\n=====\n\nInstall it.\n\n"
    page += ".. end package-only\n\nEnd.\n"
    kept, dropped = drop_package_only_blocks(page, "page.rst")
    assert kept == "Intro, see `Usage`_.\n\nEnd.\n"
    assert dropped == {"usage"}
    with pytest.raises(UpstreamError, match=r"to sections inside them.*\n  - page.rst: `usage`\nMove the reference"):
        _apply._check_package_only_references({Path("page.rst"): (kept, dropped)})
    _apply._check_package_only_references(
        {Path("page.rst"): drop_package_only_blocks(page.replace("`Usage`_", ""), "")}
    )
    with pytest.raises(UpstreamError, match=r"page.rst:3: `.. package-only` is not closed by `.. end package-only`"):
        drop_package_only_blocks(page.replace(".. end package-only", ""), "page.rst")


def test_patched_tree_runs_on_cpu_without_this_package(tree: Path, tmp_path: Path) -> None:
    plan(tree).write()
    block = tmp_path / "block" / "lightning_fsdp"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text("raise ImportError('blocked')")
    script = """
import sys
import lightning
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy
from lightning.fabric.utilities.checkpoint_loading.errors import CheckpointLoadError

assert lightning.__file__.startswith(sys.argv[1]), lightning.__file__
strategy = FSDPStrategy(load_concurrency=2)
assert strategy.load_concurrency == 2
fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp")
assert type(fabric.strategy) is FSDPStrategy
print("ok", "lightning_fsdp" in sys.modules)
"""
    env = {"PYTHONPATH": f"{tree / 'src'}:{tmp_path / 'block'}", "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-c", script, str(tree / "src")], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-2:] == ["ok", "False"]


def test_refuses_a_tree_of_another_version(tree: Path) -> None:
    fsdp = tree / "src/lightning/fabric/strategies/fsdp.py"
    changed = fsdp.read_text().replace("device_id=self.root_device.index", "device_id=self.root_device")
    fsdp.write_text(changed)
    (tree / "src" / "version.info").write_text("2.7.0.dev0")
    with pytest.raises(UpstreamError, match=r"holds lightning 2\.7\.0\.dev0") as error:
        plan(tree)
    assert "`FSDPStrategy.setup_module`" in str(error.value)
    assert "`FSDPStrategy.module_sharded_context`" in str(error.value)
    stderr = io.StringIO()
    with redirect_stderr(stderr), redirect_stdout(io.StringIO()):
        assert main([str(tree)]) == 1
    assert stderr.getvalue().startswith("error: ")
    assert fsdp.read_text() == changed  # nothing was written
    assert not (tree / "src/lightning/fabric/utilities/checkpoint_loading").exists()


def test_accepts_a_tree_that_differs_only_where_the_change_does_not_reach(tree: Path) -> None:
    """Only the definitions that the change replaces or calls are compared: upstream may move elsewhere."""
    fsdp = tree / "src/lightning/fabric/strategies/fsdp.py"
    text = fsdp.read_text() + "\n\ndef _a_helper_added_on_master() -> None:\n    pass\n"
    fsdp.write_text(text.replace("def barrier(self, *args: Any, **kwargs: Any)", "def barrier(self, *args: Any)", 1))
    (tree / "src" / "version.info").write_text("2.7.0.dev0")
    result = plan(tree)
    assert not any("master" in note for note in result.notes)


def test_accepts_the_definitions_of_the_pinned_master(tree: Path, monkeypatch) -> None:
    """A definition that the change calls may be master's at the pinned commit (its fingerprint), and is named."""
    fsdp = tree / "src/lightning/fabric/strategies/fsdp.py"
    text = fsdp.read_text()
    fsdp.write_text(text.replace("def _is_sharded_checkpoint(path: Path)", "def _is_sharded_checkpoint(path)"))
    with pytest.raises(UpstreamError, match=r"nor like Lightning's master.*\n.*`_is_sharded_checkpoint`"):
        plan(tree)
    pinned = pinned_fingerprints(tree)
    assert list(pinned) == ["lightning.fabric.strategies.fsdp"]
    assert list(pinned["lightning.fabric.strategies.fsdp"]) == ["_is_sharded_checkpoint"]
    monkeypatch.setattr(_apply, "PINNED_MASTER_DEFINITIONS", pinned)
    result = plan(tree)
    (note,) = [note for note in result.notes if "master" in note]
    assert f"master at {_apply.PINNED_MASTER_COMMIT}" in note
    assert "strategies/fsdp.py: `_is_sharded_checkpoint`" in note


def test_refuses_a_directory_that_is_not_lightning(tmp_path: Path) -> None:
    with pytest.raises(UpstreamError, match=r"src/lightning/fabric/strategies/fsdp.py` is missing"):
        plan(tmp_path)


def test_prints_a_diff_stat(tree: Path) -> None:
    stdout = io.StringIO()
    with redirect_stdout(stdout):
        assert main([str(tree / "src"), "--dry-run"]) == 0
    lines = stdout.getvalue().splitlines()
    assert all(re.fullmatch(r" \S+ +\| +\d+ \+*-*", line) for line in lines[:-2])
    assert " src/lightning/fabric/strategies/fsdp.py " in stdout.getvalue()
    assert re.fullmatch(
        r" \d+ files changed, \d+ insertions\(\+\), \d+ deletions\(-\) \(into lightning .*\)", lines[-2]
    )
    assert not (tree / "src/lightning/fabric/utilities/checkpoint_loading").exists()  # dry run


def test_merges_any_subclass_into_its_base() -> None:
    """The mechanism is generic: the same merge serves ``ModelParallelStrategy`` once this package has one."""
    upstream = r'''
from typing import Any


class Parent:
    def setup(self) -> list:
        return ["parent"]


class Strategy(Parent):
    r"""Upstream.

    Args:
        size: A size.
        \**kwargs: Passed on.

    """

    def __init__(
        self,
        size: int = 1,
        **kwargs: Any,
    ) -> None:
        self.size = size

    def setup(self) -> list:
        return [*super().setup(), "upstream"]

    def other(self) -> str:
        return "other"
'''
    ours = '''
from typing import Any

from upstream_module import Strategy as _UpstreamStrategy


class Strategy(_UpstreamStrategy):
    """Ours.

    Args:
        limit: A new limit.
            On two lines.

    """

    def __init__(self, *args: Any, limit: int = 3, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit = _check(limit)

    def setup(self) -> list:
        return [*super().setup(), "ours", self.other()]

    def extra(self) -> int:
        return self.limit


def _check(limit: int) -> int:
    return limit
'''
    merged = merge_module(Source(upstream, "upstream_module.py"), "upstream_module", Source(ours, "ours.py"))
    namespace: dict = {}
    exec(compile(merged, "merged", "exec"), namespace)
    strategy = namespace["Strategy"](size=2, limit=5)
    assert (strategy.size, strategy.limit, strategy.extra()) == (2, 5, 5)
    assert strategy.setup() == ["parent", "upstream", "ours", "other"]
    assert namespace["Strategy"].__mro__[1] is namespace["Parent"]
    assert "        limit: A new limit.\n            On two lines.\n" in merged
    with pytest.raises(TypeError):
        namespace["Strategy"](2, 5)  # the new argument is keyword-only


def test_changelog_entries_go_under_unreleased() -> None:
    released = "# Changelog\n\n## [2.6.6] - 2025-01-01\n\n### Fixed\n\n- Something\n"
    text = _changelog(released)
    assert text.index("## [unreleased]") < text.index("## [2.6.6]")
    assert text.index("`load_concurrency`") < text.index("## [2.6.6]")
    placeholder = "# Changelog\n\n## [unreleased] - YYYY-MM-DD\n\n### Added\n\n-\n\n### Fixed\n\n-\n\n## [2.6.6]\n"
    text = _changelog(placeholder)
    assert "\n-\n" not in text.split("## [2.6.6]")[0]
    assert "\n\n\n" not in text


def test_upstream_rst_lists_what_the_command_writes() -> None:
    """The table in docs/source-fabric/upstream.rst is the command's own map (paste the expected one if it fails)."""
    text = _DOCS.read_text()
    table = text.split(".. _upstream-command-table:", 1)[1].split("\n\n\n", 1)[0]
    rows = re.findall(r"\* - ``([^`]+)``\n\s+- (?:``([^`]+)``|(not carried))", table)
    documented = {source: destination or missing for source, destination, missing in rows}
    expected = destinations()
    rendered = "\n".join(
        f"   * - ``{source}``\n     - " + (f"``{dest}``" if dest != "not carried" else "not carried")
        for source, dest in expected.items()
    )
    assert documented == expected, f"update the table in {_DOCS}:\n{rendered}"


def test_upstream_rst_lists_the_names_the_command_rewrites() -> None:
    """The table of upstream's spellings in docs/source-fabric/upstream.rst is the command's own."""
    table = _DOCS.read_text().split(".. _upstream-names-table:", 1)[1].split("\n\n\n", 1)[0]
    documented = dict(re.findall(r"\* - ``([^`]+)``\n\s+- ``([^`]+)``", table))
    assert documented == UPSTREAM_NAMES
