"""tools/upstream_series.py: the core placed onto Lightning's pinned master as the PRs of its manifest.

The series is written into a repository made from the local mirror of Lightning (the pinned master); without the
mirror the test that needs it is skipped. tools/test_series.sh runs Lightning's tests at every PR.
"""

import ast
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib

PROJECT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("upstream_series", PROJECT / "tools" / "upstream_series.py")
series = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(series)

MANIFEST = tomllib.loads(series.MANIFEST.read_text())
MIRROR = os.environ.get("LIGHTNING_GIT_DIR", "/work/.mirror/Lightning-AI+pytorch-lightning/repo")
PINNED = "7f0c3436cd3f6ad3753125672024fc415cbcb414"


def _mirror_has_pinned_master() -> bool:
    if shutil.which("git") is None or not Path(MIRROR).is_dir():
        return False
    return subprocess.run(["git", "--git-dir", MIRROR, "cat-file", "-e", PINNED], capture_output=True).returncode == 0


def test_series_applies_to_pinned_master(tmp_path, capsys):
    if not _mirror_has_pinned_master():
        pytest.skip(f"no git repository of Lightning holding master {PINNED[:8]} at {MIRROR} (set LIGHTNING_GIT_DIR)")
    cores = {entry["core"] for pr in MANIFEST["pr"] for entry in pr.get("definitions", []) + pr.get("tests", [])}
    if missing := sorted(core for core in cores if not (PROJECT / core).is_file()):
        pytest.skip(f"the core named in the manifest is not in this checkout yet: {missing}")
    tree = tmp_path / "lightning"
    assert series.main([str(tree), "--from-git", f"{MIRROR}@{PINNED}", "--series", "series"]) == 0
    table = capsys.readouterr().out
    assert "warning" not in table, table

    commits = series.git(tree, "rev-list", "--reverse", "master..series").split()
    assert len(commits) == len(MANIFEST["pr"])
    log = ""
    for commit, pr in zip(commits, MANIFEST["pr"], strict=True):
        changed = set(series.git(tree, "show", "--name-only", "--format=", commit).split())
        # every file the PR names is touched (a test file only where the tree has Lightning's tests), and no other
        assert changed == series.files_of(pr, MANIFEST), pr["key"]
        assert series.git(tree, "log", "-1", "--format=%s", commit).strip() == pr["title"]
        for path in changed:
            text = series.git(tree, "show", f"{commit}:{path}")
            assert "lightning_fsdp" not in text, path
            if path.endswith(".py"):
                ast.parse(text, filename=path)
                assert max(map(len, text.splitlines())) <= 120, path
        log = series.git(tree, "show", f"{commit}:{MANIFEST['changelog']}")
    # the CHANGELOG lines in PR order under their headings, each with its link placeholder
    positions = [log.index(pr["changelog"][1]) for pr in MANIFEST["pr"] if pr["changelog"][0] == "Added"]
    assert positions == sorted(positions)
    assert all("/pull/XXXXX)" in pr["changelog"][1] for pr in MANIFEST["pr"])


def test_apply_to_a_tree_without_tests_skips_the_test_edits_with_one_note(tmp_path, capsys):
    """An unpacked sdist has no ``tests/``: the source changes are written, the test edits skipped and said so once."""
    if not _mirror_has_pinned_master():
        pytest.skip(f"no git repository of Lightning holding master {PINNED[:8]} at {MIRROR} (set LIGHTNING_GIT_DIR)")
    tree = tmp_path / "lightning"
    series.checkout(f"{MIRROR}@{PINNED}", tree)
    shutil.rmtree(tree / "tests")
    assert series.main([str(tree), "--apply"]) == 0
    out = capsys.readouterr().out
    assert out.count("has no tests/") == 1, out
    edits = sum(edit["file"].startswith("tests/") for pr in MANIFEST["pr"] for edit in pr.get("edits", []))
    carried = sum(len(entry["names"]) for pr in MANIFEST["pr"] for entry in pr.get("tests", []))
    assert f"{edits} test edit(s) and {carried} carried test(s) of the series skipped" in out
    assert not (tree / "tests").exists()
    changed = set(series.git(tree, "diff", "--name-only", "--diff-filter=d").split())  # tests/ itself deleted above
    assert "src/lightning/fabric/utilities/load.py" in changed
    assert MANIFEST["changelog"] in changed


def test_edit_with_a_missing_anchor_fails_loudly(tmp_path):
    path = tmp_path / "module.py"
    path.write_text("class A:\n    def f(self):\n        x = 1\n        return x\n")
    target = series.Target(path)
    target.edit("A.f", "x = 1", "after", "y = 2")
    assert "        x = 1\n        y = 2\n" in target.text
    with pytest.raises(series.SeriesError, match=r"0 statements in `A\.f` start with 'z = 1'"):
        target.edit("A.f", "z = 1", "replace", "")
    with pytest.raises(series.SeriesError, match=r"`A\.g` not found"):
        target.edit("A.g", "x = 1", "replace", "")


def test_changelog_line_replaces_the_empty_entry_and_follows_the_others():
    text = "# Changelog\n\n## [unreleased] - YYYY-MM-DD\n\n### Added\n\n- one\n\n### Changed\n\n-\n\n---\n\n## [2.6]\n"
    text = series.changelog(text, "Changed", "- two")
    text = series.changelog(text, "Added", "- three")
    assert "### Added\n\n- one\n\n- three\n\n### Changed\n\n- two\n\n---\n\n## [2.6]\n" in text
