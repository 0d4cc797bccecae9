"""The load benchmark (``benchmarks/bench_load``) runs end to end and reports sane numbers (not a timed test)."""

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks.bench_load import checkpoints, cli
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy
from tests.tests_fabric.helpers.distributed import run_distributed

# Tests of the package itself (its opt-in, CLI, docs, benchmark): `python -m lightning_fsdp.upstream` leaves them out.
pytestmark = pytest.mark.package_only

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGE = _ROOT / "benchmarks" / "bench_load"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sampler reads /proc")
def test_benchmark_smoke(tmp_path):
    output = tmp_path / "table.md"
    command = [
        sys.executable,
        str(_PACKAGE),
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
    assert "| storage read per node | read-call bytes per node | correct |" in table
    rows = [line for line in table.splitlines() if line.startswith("| raw state dict, torch zip file (")]
    assert len(rows) == 2
    assert "upstream" in rows[0]
    assert "lightning-fsdp" in rows[1]
    assert all(" ‡ |" in row for row in rows)  # a warm cache: storage reads marked as not meaningful
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
        # The kernel's per-rank peaks bound every sample from above.
        assert result["peak_rss_sum_of_rank_peaks"] >= 0.98 * result["peak_rss_sampled"] > 0
        assert result["page_cache_dropped"] is False
        assert len(result["read_bytes_per_rank"]) == len(result["rchar_per_rank"]) == 2
        assert result["read_bytes_per_node"] == [sum(result["read_bytes_per_rank"])]
        assert result["rchar_per_node"] == [sum(result["rchar_per_rank"])]
        assert min(result["read_bytes_per_rank"]) >= 0
    # lightning-fsdp reads every byte of the model with positioned reads, each rank its own shard: the node reads the
    # file about once. (Upstream memory-maps it: its tensors never pass through a read call.)
    ours = report["results"][1]
    assert ours["case"]["implementation"] == "ours"
    assert report["files"]["zip"]["bytes"] * 0.9 < ours["rchar_per_node"][0] < report["files"]["zip"]["bytes"] * 3


def _save_full_checkpoint(path: str) -> None:
    strategy = FSDPStrategy(auto_wrap_policy={checkpoints.Block}, state_dict_type="full")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = checkpoints.Model(8, 2)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=checkpoints.ADAM_LR))
    fabric.backward(model(torch.randn(2, 8)).sum())
    optimizer.step()
    fabric.save(path, {"model": model, "optimizer": optimizer})


def _structure(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _structure(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_structure(item) for item in value]
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype
    return value


def test_full_checkpoint_is_built_like_fabric_save(tmp_path):
    """The benchmark writes its full checkpoint directly; it must have the layout that `fabric.save` gives."""
    path = tmp_path / "fabric.ckpt"
    run_distributed(_save_full_checkpoint, str(path), devices=2)
    saved = torch.load(path, weights_only=True)
    _, param_names = checkpoints._state_dict_layout(8, 2)
    built = checkpoints._full_checkpoint(checkpoints._make_state_dict(8, 2), param_names)
    assert _structure(built) == _structure(saved)


def test_benchmark_runs_as_module():
    """The README's other way to run it: ``python -m benchmarks.bench_load`` from the repository root."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_load", "--help"], cwd=_ROOT, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "usage: bench_load" in completed.stdout
    assert "--load-concurrency" in completed.stdout


def test_legacy_fabric_checkpoint_is_also_loaded_as_a_trusted_file():
    """The same file with ``weights_only=False``: read whole, in turns of k=1 and k=all ranks, upstream alongside."""
    args = argparse.Namespace(
        formats=["legacy-fabric"], implementations=["upstream", "ours"], load_concurrency=None, ranks=4, nodes=1
    )
    cases = cli._cases(args)
    title = "Fabric checkpoint {'model': ...}, legacy pickle file"
    trusted = f"{title}, `weights_only=False`"
    upstream = [(c.title, c.weights_only) for c in cases if c.implementation == "upstream"]
    assert upstream == [(title, True), (trusted, False)]
    ours = [(c.title, c.label, c.weights_only) for c in cases if c.implementation == "ours"]
    assert ours == [
        (title, "lightning-fsdp, k=1", True),
        (title, "lightning-fsdp, k=all (4)", True),
        (trusted, "lightning-fsdp, k=1", False),
        (trusted, "lightning-fsdp, k=all (4)", False),
    ]
