"""`python -m lightning_fsdp.upstream --series`: the change as a numbered series of commits, and its manifest.

The tree is a git repository holding a copy of the installed `lightning` laid out as a checkout (as in
`test_upstream.py`); tools/test_series.sh runs Lightning's tests and ours at every step on the pinned master.
"""

import subprocess
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace
from io import StringIO
from pathlib import Path

import pytest

from lightning_fsdp.upstream import UpstreamError, plan
from lightning_fsdp.upstream.__main__ import main
from lightning_fsdp.upstream._apply import Change, Plan
from lightning_fsdp.upstream._rewrite import package_mentions
from lightning_fsdp.upstream._series import (
    STEPS,
    EarlierForm,
    _edited_tests,
    _manifest_items,
    assign,
    restriction,
    unresolved_imports,
)
from tests.tests_fabric.test_upstream import installed_lightning_tree

pytestmark = pytest.mark.package_only

_SRC = "src/lightning_fsdp"
_STRATEGY = f"{_SRC}/strategy.py"
_LOADER = f"{_SRC}/loading/loader.py"
_LOADING_CALLS = f"{_SRC}/loading_calls.py"
#: The step that reads remote checkpoints by byte ranges: before it, remote paths keep master's branch.
_REMOTE_STEP = next(number for number, step in enumerate(STEPS, 1) if "remote.py" in " ".join(step.carries))


@pytest.fixture(scope="module")
def items() -> list[tuple[str, str]]:
    return _manifest_items()


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout


def _git_tree(root: Path) -> Path:
    tree = installed_lightning_tree(root)
    _git(tree, "init", "--quiet")
    _git(tree, "config", "user.name", "Series Test")
    _git(tree, "config", "user.email", "series@example.com")
    _git(tree, "add", "--all")
    _git(tree, "commit", "--quiet", "-m", "base")
    return tree


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A git tree with the whole series committed onto it by the command, and the descriptions it wrote."""
    root = tmp_path_factory.mktemp("series")
    tree = _git_tree(root / "lightning")
    descriptions = root / "descriptions"
    with redirect_stdout(StringIO()):
        assert main([str(tree), "--series", "--descriptions", str(descriptions)]) == 0
    return tree, descriptions


def test_the_manifest_carries_everything_once(items):
    """Every file, definition and CHANGELOG entry that the one-shot command writes belongs to exactly one step."""
    assert assign(items).problems == []


def test_the_manifest_refuses_what_is_lost_carried_twice_or_absent(items):
    lost = (replace(STEPS[0], carries=()), *STEPS[1:])
    assert any("connector is carried by 0 steps" in problem for problem in assign(items, lost).problems)
    twice = (replace(STEPS[0], carries=(*STEPS[0].carries, f"{_STRATEGY}")), *STEPS[1:])
    assert any(f"{_STRATEGY} is carried by 2 steps" in problem for problem in assign(items, twice).problems)
    absent = (replace(STEPS[0], carries=(*STEPS[0].carries, f"{_STRATEGY}::FSDPStrategy.no_such_method")), *STEPS[1:])
    problems = assign(items, absent).problems
    assert any("no_such_method`, which the change does not carry" in problem for problem in problems)


def _step_carrying(entry: str) -> int:
    return next(number for number, step in enumerate(STEPS, 1) if entry in step.carries)


def _moved_to_the_last_step(entry: str) -> tuple:
    owner = _step_carrying(entry)
    steps = [
        replace(step, carries=tuple(carried for carried in step.carries if carried != entry))
        if number == owner
        else step
        for number, step in enumerate(STEPS, 1)
    ]
    steps[-1] = replace(steps[-1], carries=(*steps[-1].carries, entry))
    return tuple(steps)


def test_a_step_that_uses_what_a_later_step_brings_is_refused(items):
    """`setup_module` needs `_fsdp_kwargs_added`: moved to the last step, the step of `setup_module` could not run."""
    helper = f"{_STRATEGY}::_fsdp_kwargs_added"
    owner = _step_carrying(helper)
    assert owner == _step_carrying(f"{_STRATEGY}::FSDPStrategy.setup_module")
    assignment = assign(items, _moved_to_the_last_step(helper))
    assert assignment.problems == []
    restrict = restriction(assignment, owner)
    text = dict(items)[_STRATEGY]
    kept = restrict(_STRATEGY, text)
    assert "def _fsdp_kwargs_added" not in kept
    assert restrict.problems == [f"step {owner}: {_STRATEGY} uses `_fsdp_kwargs_added`, which step {len(STEPS)} brings"]
    # With the manifest as it is, step 2 keeps only the device methods, and the imports they use.
    early = restriction(assign(items), 2)
    kept = early(_STRATEGY, text)
    assert early.problems == []
    assert "def setup_environment" in kept
    assert "def module_init_context" in kept
    assert "def load_checkpoint" not in kept
    assert "loading_calls" not in kept


def test_remote_paths_keep_masters_branch_until_the_remote_step(items):
    """Before the remote step, `load_checkpoint` hands an fsspec URL to the method it replaces.

    That is master's branch, kept as `_default_load_checkpoint` by the merge, and nothing imports the remote reader;
    from the remote step on, the files are the package's own.

    """
    texts = dict(items)
    assignment = assign(items)
    before = restriction(assignment, _REMOTE_STEP - 1)
    strategy = before(_STRATEGY, texts[_STRATEGY])
    assert "from lightning.fabric.utilities.cloud_io import _is_local_file_protocol\n" in strategy
    dispatch = "        if not _is_local_file_protocol(path):\n"
    assert strategy.index(dispatch) < strategy.index("        state, module_key = _checked_state(state)\n")
    assert "return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)" in strategy
    assert "storage_options: dict" not in strategy
    assert "def load_options(self, rename: Rename | None = None) -> AbstractContextManager:" in strategy
    loading_calls = before(_LOADING_CALLS, texts[_LOADING_CALLS])
    assert "lightning_fsdp.loading.remote" not in loading_calls
    assert "def checkpoint_path" not in loading_calls
    assert "_load_storage_options" not in loading_calls
    assert "from collections.abc import Iterator\n" in loading_calls  # `Mapping` only served the remote options
    assert before.problems == []
    guide = "docs/source-fabric/guide/loading_large_checkpoints.rst"
    assert ":doc:`object_storage`" in texts[guide]
    assert ":doc:`object_storage`" not in before(guide, texts[guide])
    # Where the loader comes, the strategy holds two earlier forms of `load_checkpoint` that end at different steps:
    # the remote one (until the remote step) applies first, then the one that hands sharded checkpoints to upstream.
    loader_step = _step_carrying(_LOADING_CALLS)
    early = restriction(assignment, loader_step)
    strategy = early(_STRATEGY, texts[_STRATEGY])
    assert strategy.index(dispatch) < strategy.index("_upstream._is_sharded_checkpoint(str(path))")
    assert "A sharded directory is read as before" in strategy
    assert early.problems == []
    at_remote_step = restriction(assignment, _REMOTE_STEP)
    for path in (_STRATEGY, _LOADING_CALLS, "src/lightning_fsdp/model_parallel.py"):
        assert at_remote_step(path, texts[path]) == texts[path]


def test_an_earlier_form_holds_until_the_step_that_carries_the_definition(items):
    """The loader's `load` comes without the sharded branch, gets it with the sharded reader, and is ours after."""
    assignment = assign(items)
    sharded = _step_carrying(f"{_LOADER}::_load_sharded")
    carried = assignment.step_of(_LOADER, "load")
    assert carried > sharded
    text = dict(items)[_LOADER]
    first = min(number for number, _, _ in assignment.forms[(_LOADER, "load")])
    assert assign(items).step_of(_LOADER) == first  # the loader's own step brings `load` in its first form
    versions = {}
    for number in (first, sharded, carried):
        restrict = restriction(assignment, number)
        versions[number] = restrict(_LOADER, text)
        assert restrict.problems == []
    assert "def _load_sharded" not in versions[first]
    assert "sharded checkpoint, which the distributed checkpoint reader reads" in versions[first]
    assert "_warn_uninitialized(path, request.module, result.written)" not in versions[first]
    assert "result = _load_sharded(detected, request, stagger)" in versions[sharded]
    assert "_warn_uninitialized(path, request.module, result.written)" not in versions[sharded]
    assert "_warn_uninitialized(path, request.module, result.written)" in versions[carried]
    # Imports that only the left-out definitions used go with them.
    assert "load_sharded_checkpoint" not in versions[first]
    # Until the sharded reader, `FSDPStrategy.load_checkpoint` hands a sharded checkpoint to upstream's method (and a
    # remote path until the remote step, whose form ends later).
    strategy = dict(items)[_STRATEGY]
    to_upstream = "return super().load_checkpoint(str(path), state, strict=strict, weights_only=weights_only)"
    assert to_upstream in restriction(assignment, first)(_STRATEGY, strategy)
    at_sharded = restriction(assignment, sharded)(_STRATEGY, strategy)
    assert to_upstream not in at_sharded
    assert "return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)" in at_sharded


def test_an_earlier_form_that_no_longer_fits_ours_is_refused(items):
    """A form whose lines are not in our definition, or that comes from the step that carries it, stops the series."""
    number = _step_carrying(f"{_SRC}/loading/optimizer.py")
    form = EarlierForm(f"{_LOADER}::_prepare", old="no such line\n", new="", reason="a test")
    steps = tuple(
        replace(step, earlier_forms=(*step.earlier_forms, form)) if index == number else step
        for index, step in enumerate(STEPS, 1)
    )
    assignment = assign(items, steps)
    assert assignment.problems == []
    restrict = restriction(assignment, number)
    restrict(_LOADER, dict(items)[_LOADER])
    assert restrict.problems == [
        f"step {number}: {_LOADER}::_prepare: the lines of its earlier form were found 0 times in ours (ours changed):"
        " update the form in `lightning_fsdp/upstream/_series.py`"
    ]
    carried = assignment.step_of(_LOADER, "_prepare")
    late = tuple(
        replace(step, earlier_forms=(*step.earlier_forms, form)) if index == carried else step
        for index, step in enumerate(STEPS, 1)
    )
    assert assign(items, late).problems == [
        f"step {carried} gives an earlier form of `{_LOADER}::_prepare`, which step {carried} completes: only a step"
        " before it can"
    ]
    absent = replace(form, where=f"{_LOADER}::no_such_function")
    unknown = (replace(STEPS[0], earlier_forms=(absent,)), *STEPS[1:])
    assert assign(items, unknown).problems == [
        f"step 1: an earlier form names `{_LOADER}::no_such_function`, which the change does not carry"
    ]
    until_absent = replace(form, until=f"{_SRC}/loading/no_such_module.py")
    unknown = (replace(STEPS[0], earlier_forms=(until_absent,)), *STEPS[1:])
    assert assign(items, unknown).problems == [
        f"step 1: an earlier form names `{_SRC}/loading/no_such_module.py`, which the change does not carry"
    ]


def test_an_import_of_a_later_module_is_refused(tmp_path):
    tree = installed_lightning_tree(tmp_path / "lightning")
    module = "src/lightning/fabric/utilities/checkpoint_loading/loader.py"
    importer = "from lightning.fabric.utilities.checkpoint_loading.turns import StaggeredLoad\n"
    importer += "from lightning.fabric.strategies.fsdp import _no_such_helper\n"
    step = Plan(tree, "x", [Change(module, None, importer, "loader")])
    assert unresolved_imports(tree, step) == [
        f"{module}:1 imports `lightning.fabric.utilities.checkpoint_loading.turns`, which the tree does not have",
        f"{module}:2 imports `_no_such_helper` from `lightning.fabric.strategies.fsdp`, which does not define it",
    ]


def test_series_commits_each_step_and_ends_at_the_one_shot_change(committed, tmp_path):
    tree, descriptions = committed
    total = len(STEPS)
    subjects = _git(tree, "log", "--reverse", "--format=%s", f"HEAD~{total}..HEAD").splitlines()
    assert subjects == [f"({number}/{total}) {step.title}" for number, step in enumerate(STEPS, 1)]
    assert _git(tree, "status", "--porcelain") == ""
    one_shot = plan(installed_lightning_tree(tmp_path / "fresh"))
    for change in one_shot.changes:
        assert (tree / change.path).read_text() == change.new, change.path
    written = sorted(path.name for path in descriptions.iterdir())
    assert written == [f"{number:02d}-{step.slug}.md" for number, step in enumerate(STEPS, 1)]
    # The pull requests say which definitions come in an earlier form, and which step completes them.
    loader_step = _step_carrying(f"{_SRC}/loading_calls.py")  # brings `FSDPStrategy.load_checkpoint`
    sharded = _step_carrying(f"{_STRATEGY}::FSDPStrategy.load_checkpoint")
    texts = {number: (descriptions / name).read_text() for number, name in enumerate(written, 1)}
    assert (
        f"- `FSDPStrategy.load_checkpoint` comes in an earlier form, completed in ({sharded}/{total}):"
        in texts[loader_step]
    )
    assert "- `FSDPStrategy.load_checkpoint` replaces its earlier form of (" in texts[sharded]
    for path in descriptions.iterdir():
        text = path.read_text()
        for heading in ("## Motivation", "## What changes", "## Measured effect", "## Tests", "## Behaviour changes"):
            assert heading in text, path
    messages = _git(tree, "log", "--format=%B", f"HEAD~{total}..HEAD")
    assert "lightning_fsdp" not in messages.lower()
    assert "lightning-fsdp" not in messages.lower()
    # The first step only removes the connector's check; the step's own files change, nothing else.
    first = _git(tree, "show", "--name-only", "--format=", f"HEAD~{total - 1}").split()
    assert first == ["src/lightning/fabric/CHANGELOG.md", "src/lightning/fabric/connector.py"]
    # Before the remote step, the release's own `load_checkpoint` is kept for remote paths; the remote step drops it.
    fsdp = "src/lightning/fabric/strategies/fsdp.py"
    before_remote = _git(tree, "show", f"HEAD~{total - _REMOTE_STEP + 1}:{fsdp}")
    assert "    def _default_load_checkpoint(\n" in before_remote
    assert (
        "return self._default_load_checkpoint(path, state, strict=strict, weights_only=weights_only)" in before_remote
    )
    assert "_default_load_checkpoint" not in _git(tree, "show", f"HEAD~{total - _REMOTE_STEP}:{fsdp}")


def test_no_step_names_the_package(committed):
    """No file that a step writes or edits, and no description, names the package (upstream.rst)."""
    tree, descriptions = committed
    total = len(STEPS)
    found = []
    for number in range(1, total + 1):
        commit = f"HEAD~{total - number}"
        paths = _git(tree, "show", "--name-only", "--format=", commit).split()
        assert paths, f"step {number} changes nothing"
        for path in paths:
            found += [
                f"step {number}: {path}:{line}" for line in package_mentions(_git(tree, "show", f"{commit}:{path}"))
            ]
    written = sorted(descriptions.iterdir())
    assert len(written) == total
    found += [f"{path.name}:{line}" for path in written for line in package_mentions(path.read_text())]
    assert found == []


def test_series_refuses_a_checkout_with_uncommitted_changes(tmp_path):
    tree = _git_tree(tmp_path / "lightning")
    (tree / "src/lightning/fabric/connector.py").write_text("# edited\n")
    err = StringIO()
    with redirect_stderr(err):
        assert main([str(tree), "--series"]) == 1
    assert "has uncommitted changes: commit or discard them before `--series`" in err.getvalue()
    assert _git(tree, "log", "--format=%s") == "base\n"


def test_lightnings_tests_are_edited_where_a_step_changes_their_behaviour(tmp_path):
    """Each edit replaces its lines inside its test; lines that moved or changed stop the series."""
    edit = STEPS[0].lightning_edits[0]
    test_file = tmp_path / "tests" / edit.file
    test_file.parent.mkdir(parents=True)
    other = "def test_other():\n    pass\n"
    test_file.write_text(f"{other}\n\n@mock.patch('x')\n{edit.old}    assert True\n")
    notes: list[str] = []
    (change,) = _edited_tests(tmp_path, [edit], notes)
    assert change.new == f"{other}\n\n@mock.patch('x')\n{edit.new}    assert True\n"
    assert notes == []
    test_file.write_text(f"{other}\n\n{edit.old.replace('raise', 'raises')}")
    with pytest.raises(UpstreamError, match=f"the lines of `{edit.test}` that the series edits were found 0 times"):
        _edited_tests(tmp_path, [edit], notes)
    test_file.unlink()
    assert _edited_tests(tmp_path, [edit], notes) == []
    assert notes == [f"not edited: tests/{edit.file} ({edit.test}), which the tree lacks"]
