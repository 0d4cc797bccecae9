"""The load benchmark (``benchmarks/bench_load.py``) runs end to end and reports sane numbers (not a timed test)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_load.py"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sampler reads /proc")
def test_benchmark_smoke(tmp_path):
    output = tmp_path / "table.md"
    command = [
        sys.executable,
        str(_SCRIPT),
        "--size=tiny",
        "--ranks=2",
        "--formats=zip",
        "--implementations=upstream,ours",
        f"--workdir={tmp_path / 'work'}",
        f"--output={output}",
        "--cache=warm",  # dropping the page cache would slow down everything else running on the machine
        "--settle=0.2",
        "--timeout=120",
        "--retry-busy=0",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-4000:]

    table = output.read_text()
    assert table in completed.stdout
    assert "| checkpoint | implementation | load time |" in table
    rows = [line for line in table.splitlines() if line.startswith("| raw state dict, torch zip file (")]
    assert len(rows) == 2
    assert "upstream" in rows[0]
    assert "lightning-fsdp" in rows[1]
    assert "Machine:" in table
    assert "Ratios, lightning-fsdp / upstream" in table

    report = json.loads((tmp_path / "work" / "results.json").read_text())
    assert report["ranks"] == 2
    assert len(report["results"]) == 2
    for result in report["results"]:
        assert "error" not in result, result.get("error")
        assert result["correct"], result["correct_detail"]
        assert 0 < result["load_seconds"] < 60
        # Two Python processes with torch hold a few hundred MB; the tiny checkpoint adds almost nothing.
        assert 1e8 < result["base_pss"] < 4e9
        assert result["base_pss"] * 0.8 < result["peak_pss"] < result["base_pss"] + 1e9
        assert 0 < result["peak_anon"] <= result["peak_pss"]
        assert 0 < result["peak_file"] <= result["peak_pss"]
        assert result["samples_in_load"] >= 1
