"""The memory probe of ``bench_save`` (``benchmarks/bench_save/first_touch.py``) runs and prints every figure.

Not a timed test: the figures depend on the machine; the test checks that each one is measured and printed.
"""

import re
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_RATE = r"\d+\.\d\d GB/s"


def test_first_touch_prints_every_figure(tmp_path):
    command = [sys.executable, "-m", "benchmarks.bench_save.first_touch", "--gib=1", "--file-mib=8"]
    completed = subprocess.run(
        [*command, f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=120, cwd=_ROOT
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = completed.stdout.splitlines()
    assert re.fullmatch(f"anonymous memory, GiB 1, first touch: {_RATE}", lines[0]), lines
    assert re.fullmatch(f"anonymous memory, just freed, again: {_RATE[:-5]} GB/s", lines[1]), lines
    written = [line for line in lines if line.startswith("page cache, ")]
    assert len(written) == 5, lines
    assert all(re.search(f"writes {_RATE}, fsync \\d+\\.\\d\\d s$", line) for line in written), written
    assert lines[-1].startswith("free memory reported to the hypervisor"), lines
    assert list(tmp_path.iterdir()) == []  # the files are removed
