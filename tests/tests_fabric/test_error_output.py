"""What a user's terminal shows when a load fails on 2 ranks: the error once, short, and as the guide says.

The script runs as a user runs it (``python failed_loads.py``, Fabric launching the second rank itself), and the test
reads what both ranks print to the terminal (stdout and stderr together). Measured with a script of one
``fabric.load`` on 2 CPU ranks, output lines in all (Fabric's 7-line launch banner included), before and after the
error was printed once per node: a wrong path 29 and 19, a wrong key (``{"net": model}`` for a checkpoint saved under
``"model"``) 31 and 20; under ``torchrun --nproc-per-node=2``, 73 and 63, 75 and 64 (the rest is torchrun's summary).
"""

import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from torch import nn

from lightning_fsdp import CheckpointLoadError, CheckpointPathError, FSDPStrategy
from lightning_fsdp.loading.errors import ERRORS_ON_EVERY_RANK_ENV
from tests.tests_fabric.test_docs_examples import _DOCS, _clean_env, _kill_process_group

_SCRIPT = Path(__file__).parent / "scripts" / "failed_loads.py"
_GUIDE = _DOCS / "guide" / "loading_large_checkpoints.rst"
#: The error's own line, as a traceback ends: ``[rank1]: lightning_fsdp.loading.errors.CheckpointLoadError: ...``.
_ERROR_LINE = re.compile(r"^\[rank(\d)\]: lightning_fsdp\.[\w.]*\.(Checkpoint\w*Error: .*)$")
#: The one line that a rank other than local rank 0 prints instead of the same error's traceback.
_SAME_ERROR_LINE = re.compile(r"^\[rank(\d)\]: (Checkpoint\w*Error): the same error as local rank 0 prints \(set .*\)$")
#: At most this many lines per rank and failed load; before the errors were shortened, each rank printed 40 to 50.
_MAX_LINES_PER_RANK = 20


def _troubleshooting_headings() -> list[re.Pattern]:
    """The error texts that the guide's troubleshooting entries start with, ``...`` standing for any text."""
    section = _GUIDE.read_text(encoding="utf-8").split("Troubleshooting\n***************\n", 1)[1]
    headings = [line for line in section.splitlines() if line.startswith("``") and "Error: " in line]
    literals = [re.match(r"``(.+?)``(?!`)", heading).group(1) for heading in headings]
    return [re.compile(".*?".join(re.escape(part) for part in literal.split("..."))) for literal in literals]


def _run_failed_loads(tmp_path: Path, every_rank: bool = False) -> list[str]:
    """Run the script; return what the terminal shows for each of its four failed loads."""
    env = _clean_env()
    if every_rank:
        env[ERRORS_ON_EVERY_RANK_ENV] = "1"
    process = subprocess.Popen(
        [sys.executable, str(_SCRIPT), str(tmp_path)],
        cwd=tmp_path,
        env=env,
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
    # Every rank still raised a `CheckpointLoadError` that code can catch, with the cause on it.
    for rank in (0, 1):
        caught = (tmp_path / f"caught-rank{rank}.txt").read_text().splitlines()
        assert caught == [
            "path typo|CheckpointPathError|CheckpointLoadError",
            "shape mismatch|CheckpointLoadError|CheckpointLoadError",
            f"rank 1 fails|CheckpointLoadError|{'CheckpointLoadError' if rank == 1 else 'NoneType'}",
        ], rank
    return failures


@pytest.mark.skipif(sys.platform == "win32", reason="process groups and `os.killpg` are POSIX")
def test_a_failed_load_prints_its_error_once_and_short(tmp_path: Path):
    failures = _run_failed_loads(tmp_path)
    headings = _troubleshooting_headings()
    for printed, case in zip(failures, ["path typo", "shape mismatch", "rank 1 fails", "truncated file"], strict=True):
        lines = printed.splitlines()
        errors = [match.groups() for match in map(_ERROR_LINE.match, lines) if match]
        # Local rank 0 prints the traceback, without the chained causes that repeated the same text; rank 1 one line.
        assert [rank for rank, _ in errors] == ["0"], printed
        (text,) = [text for _, text in errors]
        assert printed.count(text.split(": ", 1)[1]) == 1, printed  # the message, exactly once in both ranks' output
        same = [match.groups() for match in map(_SAME_ERROR_LINE.match, lines) if match]
        assert same == [("1", text.split(":", 1)[0])], printed
        assert printed.count("Traceback (most recent call last)") == 1, printed
        assert "The above exception" not in printed, printed
        assert "During handling" not in printed, printed
        assert "agreement.py" not in printed, printed  # the machinery that raised it on every rank is left out
        assert len(lines) <= _MAX_LINES_PER_RANK + 1, printed
        assert "_InvalidCheckpointPathError" not in printed
        assert "must be a single file" not in printed
        if case == "path typo":
            path = tmp_path / "modle.pt"
            assert text.startswith(f"CheckpointPathError: Loading '{path}' failed on ranks 0-1: ")
            assert f"The checkpoint path '{path}' does not exist (no such file or directory)." in text
        # The guide's troubleshooting entry for it starts with the same text.
        assert any(heading.match(text) for heading in headings), f"no troubleshooting entry starts like: {text}"


@pytest.mark.skipif(sys.platform == "win32", reason="process groups and `os.killpg` are POSIX")
def test_every_rank_prints_its_error_when_asked(tmp_path: Path):
    """For debugging, `LIGHTNING_FSDP_ERRORS_ON_EVERY_RANK=1` prints each rank's traceback, as before."""
    for printed in _run_failed_loads(tmp_path, every_rank=True):
        errors = [match.groups() for match in map(_ERROR_LINE.match, printed.splitlines()) if match]
        assert sorted(rank for rank, _ in errors) == ["0", "1"], printed
        assert len({text for _, text in errors}) == 1, printed  # the same error on every rank
        assert not [line for line in printed.splitlines() if _SAME_ERROR_LINE.match(line)], printed


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
