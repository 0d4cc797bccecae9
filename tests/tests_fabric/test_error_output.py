"""What a user's terminal shows when a load fails on 2 ranks: each rank's error once, short, and as the guide says.

The script runs as a user runs it (``python failed_loads.py``, Fabric launching the second rank itself), and the test
reads what both ranks print to the terminal (stdout and stderr together).
"""

import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from torch import nn

from lightning_fsdp import CheckpointLoadError, CheckpointPathError, FSDPStrategy
from tests.tests_fabric.test_docs_examples import _DOCS, _clean_env, _kill_process_group

pytestmark = pytest.mark.package_only

_SCRIPT = Path(__file__).parent / "scripts" / "failed_loads.py"
_GUIDE = _DOCS / "guide" / "loading_large_checkpoints.rst"
#: The error's own line, as a traceback ends: ``[rank1]: lightning_fsdp.loading.errors.CheckpointLoadError: ...``.
_ERROR_LINE = re.compile(r"^\[rank(\d)\]: lightning_fsdp\.[\w.]*\.(Checkpoint\w*Error: .*)$")
#: At most this many lines per rank and failed load; before the errors were shortened, each rank printed 40 to 50.
_MAX_LINES_PER_RANK = 20


def _troubleshooting_headings() -> list[re.Pattern]:
    """The error texts that the guide's troubleshooting entries start with, ``...`` standing for any text."""
    section = _GUIDE.read_text(encoding="utf-8").split("Troubleshooting\n***************\n", 1)[1]
    headings = [line for line in section.splitlines() if line.startswith("``") and "Error: " in line]
    literals = [re.match(r"``(.+?)``(?!`)", heading).group(1) for heading in headings]
    return [re.compile(".*?".join(re.escape(part) for part in literal.split("..."))) for literal in literals]


@pytest.mark.skipif(sys.platform == "win32", reason="process groups and `os.killpg` are POSIX")
def test_a_failed_load_prints_each_ranks_error_once_and_short(tmp_path: Path):
    process = subprocess.Popen(
        [sys.executable, str(_SCRIPT), str(tmp_path)],
        cwd=tmp_path,
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=180)
    finally:
        _kill_process_group(process)
    assert process.returncode != 0, output  # the last error is uncaught, as in a user's script
    # The launch's banner comes first; the script marks the end of each case but the last.
    failures = re.split(r"^=== end of .*\n", output.split("-" * 100 + "\n\n", 1)[1], flags=re.MULTILINE)
    assert len(failures) == 4, output
    headings = _troubleshooting_headings()
    for printed, case in zip(failures, ["path typo", "shape mismatch", "rank 1 fails", "truncated file"], strict=True):
        lines = printed.splitlines()
        errors = [match.groups() for match in map(_ERROR_LINE.match, lines) if match]
        # One traceback per rank, without the chained causes that repeated the same text: the error once, short.
        assert sorted(rank for rank, _ in errors) == ["0", "1"], printed
        assert printed.count("Traceback (most recent call last)") == 2, printed
        assert "The above exception" not in printed, printed
        assert "During handling" not in printed, printed
        assert "agreement.py" not in printed, printed  # the machinery that raised it on every rank is left out
        assert len(lines) <= 2 * _MAX_LINES_PER_RANK, printed
        (text,) = {text for _, text in errors}  # every rank raised the same error
        assert "_InvalidCheckpointPathError" not in printed
        assert "must be a single file" not in printed
        if case == "path typo":
            path = tmp_path / "modle.pt"
            assert text.startswith(f"CheckpointPathError: Loading '{path}' failed on ranks 0-1: ")
            assert f"The checkpoint path '{path}' does not exist (no such file or directory)." in text
        # The guide's troubleshooting entry for it starts with the same text.
        assert any(heading.match(text) for heading in headings), f"no troubleshooting entry starts like: {text}"


def test_the_error_behind_a_path_error_stays_reachable(tmp_path: Path):
    """A traceback of the error says the cause once; the error it reports is kept, with its own traceback."""
    with pytest.raises(CheckpointPathError) as raised:
        FSDPStrategy().load_checkpoint(tmp_path / "missing.pt", nn.Linear(2, 2))
    error = raised.value
    assert isinstance(error, ValueError)  # upstream's type
    printed = "".join(traceback.format_exception(error))
    assert printed.count("does not exist") == 1, printed
    assert isinstance(error.cause, CheckpointLoadError)
    assert "does not exist (no such file or directory)" in str(error.cause)
    assert traceback.extract_tb(error.cause.__traceback__)[-1].name == "detect_checkpoint"
