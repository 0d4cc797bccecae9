"""The save benchmark (``benchmarks/bench_save``) runs end to end on the tiny model and reports sane numbers.

Not a timed test: it checks that every case ran (Lightning's save, the gather-free save, the contiguous and the pattern
floor, the background save with training during the write), that the files are bit-exact with Lightning's, and that
the pattern floor wrote the byte ranges that the save wrote. A background save whose ranks took different numbers of
training steps during the write used to hang here.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the benchmark reads /proc")
def test_bench_save_smoke(tmp_path):
    output = tmp_path / "table.md"
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_save",
        "--size=tiny",
        "--ranks=2",
        "--strategy=fsdp2",
        "--rounds=2",
        f"--workdir={tmp_path / 'work'}",
        f"--output={output}",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=_ROOT)
    assert completed.returncode == 0, completed.stderr[-4000:]

    table = output.read_text()
    assert "| fsdp2 | lightning-fsdp |" in table
    assert "file vs Lightning: bit-exact" in table
    background = [line for line in table.splitlines() if line.startswith("| fsdp2 | ")][-1]  # the last table's row
    assert background.endswith("| bit-exact |"), background
    assert "the second training step" in table
    assert "then the pattern floor" in table

    report = json.loads((tmp_path / "work" / "results.json").read_text())
    saved = report["runs"]["fsdp2"]["lightning-fsdp"]
    ranges = [writes for rank in saved for writes in rank["writes"]]
    # the checkpoints were deleted once measured (`--keep-files` keeps them): a run leaves no GBs behind
    assert sorted(path.name for path in (tmp_path / "work").iterdir()) == ["results.json"]
    file_size = report["file_bytes"]["fsdp2"]
    # every byte of the file was written by one of the ranks' recorded writes
    covered = sorted((offset, offset + nbytes) for offset, nbytes in ranges if nbytes)
    end = 0
    for start, stop in covered:
        assert start <= end, f"bytes {end}..{start} of the file were not written"
        end = max(end, stop)
    assert end >= file_size
    # two rounds of the save and its floors, each timed, and the ratios printed per round
    assert len(report["rounds"]["fsdp2"]) == 2
    for measured in report["rounds"]["fsdp2"]:
        assert measured["save"] > 0
        assert measured["floor"] > 0
        assert measured["pattern"] > 0
    assert "- fsdp2: the synchronous save over the write floor of its round: " in table
    # each round's save split by function (the positioned writes among them), on its slowest rank
    split = next(line for line in table.splitlines() if line.startswith("- fsdp2: where each round's save went"))
    assert "round 1 (rank " in split
    assert "round 2 (rank " in split
    assert split.count(" write ") == 2
    for rank in report["runs"]["fsdp2"]["background"]:
        assert rank["second_step"] > 0
        assert rank["reserve_seconds"] > 0
