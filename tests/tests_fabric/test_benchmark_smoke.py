"""The load benchmark (``benchmarks/bench_load``) runs end to end and reports sane numbers (not a timed test)."""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from benchmarks.bench_load import capacity, checkpoints, cli
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy
from tests.tests_fabric.helpers.distributed import run_distributed

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
        "--implementations=upstream,core,ours",
        "--strategy=fsdp",
        f"--workdir={tmp_path / 'work'}",
        f"--output={output}",
        "--cache=warm",  # dropping the page cache would slow down everything else running on the machine
        "--settle=0.2",
        "--timeout=120",
        "--retry-busy=0",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=360)
    assert completed.returncode == 0, completed.stderr[-4000:]

    table = output.read_text()
    assert table in completed.stdout
    assert "| strategy | checkpoint | implementation | load time |" in table
    assert "| storage read per node | read-call bytes per node | correct |" in table
    rows = [line for line in table.splitlines() if line.startswith("| FSDP1 | raw state dict, torch zip file (")]
    assert [row.split(" | ")[2] for row in rows] == [f"upstream {lightning.__version__}", "core", "lightning-fsdp"]
    assert all(" ‡ |" in row for row in rows)  # a warm cache: storage reads marked as not meaningful
    assert "Machine:" in table
    assert "Ratios to upstream, core / upstream and lightning-fsdp / upstream" in table
    ratios = table[table.index("Ratios to upstream") :].split("\n\n")[1].splitlines()
    assert [row.split(" | ")[2] for row in ratios if row.startswith("| FSDP1 |")] == ["core", "lightning-fsdp"]

    report = json.loads((tmp_path / "work" / "results.json").read_text())
    assert report["ranks"] == 2
    assert [r["case"]["implementation"] for r in report["results"]] == ["upstream", "core", "ours"]
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
    ours = report["results"][2]
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


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="the refusal on a machine without a GPU")
def test_device_cuda_without_a_gpu_says_so(tmp_path, capsys):
    """``--device cuda`` where no GPU exists: one line that says so, before anything is written."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--device", "cuda", "--size=tiny", f"--workdir={tmp_path / 'work'}"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--device cuda: no GPU exists here" in error
    assert "CPU build, without CUDA" in error or "sees no CUDA device" in error
    assert not (tmp_path / "work").exists()


def test_legacy_fabric_checkpoint_is_also_loaded_as_a_trusted_file():
    """The same file with ``weights_only=False``: read whole, in turns of k=1 and k=all ranks, upstream alongside."""
    args = argparse.Namespace(
        formats=["legacy-fabric"],
        implementations=["upstream", "core", "ours"],
        load_concurrency=None,
        ranks=4,
        nodes=1,
        strategies=["fsdp"],
    )
    cases = cli._cases(args)
    title = "Fabric checkpoint {'model': ...}, legacy pickle file"
    trusted = f"{title}, `weights_only=False`"
    upstream = [(c.title, c.weights_only) for c in cases if c.implementation == "upstream"]
    assert upstream == [(title, True), (trusted, False)]
    # the core has no `load_concurrency`: one row each, a file read whole always by one rank of a node at a time
    core = [(c.title, c.label, c.weights_only, c.load_concurrency) for c in cases if c.implementation == "core"]
    assert core == [(title, "core", True, None), (trusted, "core", False, None)]
    ours = [(c.title, c.label, c.weights_only) for c in cases if c.implementation == "ours"]
    assert ours == [
        (title, "lightning-fsdp, k=1", True),
        (title, "lightning-fsdp, k=all (4)", True),
        (trusted, "lightning-fsdp, k=1", False),
        (trusted, "lightning-fsdp, k=all (4)", False),
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sampler reads /proc")
def test_benchmark_smoke_fsdp2(tmp_path):
    """FSDP2: upstream's, the core's and this project's `ModelParallelStrategy` (the default implementations), a full
    checkpoint with Adam and an HF index."""
    output = tmp_path / "table.md"
    command = [
        sys.executable,
        str(_PACKAGE),
        "--size=tiny",
        "--ranks=2",
        "--strategy=fsdp2",
        "--formats=full,legacy,hf-index",  # legacy: not an FSDP2 format, so no row
        f"--workdir={tmp_path / 'work'}",
        f"--output={output}",
        "--cache=file",
        "--settle=0.2",
        "--timeout=120",
        "--retry-busy=0",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=480)
    assert completed.returncode == 0, completed.stderr[-4000:]
    table = output.read_text()
    header = "| strategy | checkpoint | implementation | load time |"
    main_table = table[table.index(header) :].split("\n\n")[0]
    rows = [line.split(" | ") for line in main_table.splitlines() if line.startswith("| FSDP2 | ")]
    assert [(row[1].split(" (")[0], row[2]) for row in rows] == [
        (checkpoints.FORMAT_TITLES[fmt], impl)
        for fmt in ("full", "hf-index")
        for impl in (f"upstream {lightning.__version__}", "core", "lightning-fsdp")
    ]
    assert "n/a (upstream has no Hugging Face index support)" in rows[3][3]
    assert "Targets of issue FSDP2, item 5" in table
    assert "full checkpoint with Adam state, lightning-fsdp: load time at most 0.25x upstream" in table

    report = json.loads((tmp_path / "work" / "results.json").read_text())
    measured = [r for r in report["results"] if "load_seconds" in r]
    assert [(r["case"]["format"], r["case"]["implementation"]) for r in measured] == [
        ("full", "upstream"),
        ("full", "core"),
        ("full", "ours"),
        ("hf-index", "core"),
        ("hf-index", "ours"),
    ]
    for result in measured:
        assert result["case"]["strategy"] == "fsdp2"
        assert result["correct"], result["correct_detail"]
        assert result["page_cache_dropped"] is True  # `--cache file`: the checkpoint's pages were evicted
        assert result["anon_above_base"] == result["peak_anon"] - result["base_anon"]
        if result["case"]["format"] == "full":
            # Adam's exp_avg and exp_avg_sq of every local shard and a step per parameter, over both ranks
            shapes, names = checkpoints._state_dict_layout(*checkpoints.PRESETS["tiny"])
            expected = sum(2 * 4 * math.prod(shapes[name]) + 4 * 2 for name in names)
            assert result["optimizer_state_bytes"] == result["optimizer_state_allocated"] == expected
        else:
            assert result["optimizer_state_bytes"] == 0
        assert result["anon_above_base_less_optimizer"] == result["anon_above_base"] - result["optimizer_state_bytes"]
    index = json.loads(Path(report["files"]["hf-index"]["path"]).read_text())
    assert len(set(index["weight_map"].values())) == 4
    assert list(index["weight_map"]) == list(checkpoints._make_state_dict(*checkpoints.PRESETS["tiny"]))


@pytest.mark.parametrize(
    ("capacity_depth", "start", "limit", "bisections", "largest", "smallest", "tried"),
    [
        (5, 1, 64, 1, 4, 6, [1, 2, 4, 8, 6]),  # doubling to 8, one bisection between 4 and 8
        (5, 1, 64, 2, 5, 6, [1, 2, 4, 8, 6, 5]),
        (3, 1, 64, 0, 2, 4, [1, 2, 4]),
        (40, 1, 24, 1, 24, None, [1, 2, 4, 8, 16, 24]),  # every size fits: up to the limit, then stop
        (0, 1, 64, 1, None, 1, [1]),  # nothing fits
        (7, 2, 64, 3, 7, 8, [2, 4, 8, 6, 7]),  # adjacent sizes: no further bisection
    ],
)
def test_capacity_ladder(capacity_depth, start, limit, bisections, largest, smallest, tried):
    """The ladder of sizes against a fake load that fits up to `capacity_depth`: no real loads."""
    calls = []

    def fits(depth: int) -> bool:
        calls.append(depth)
        return depth <= capacity_depth

    ladder = capacity.search(fits, start, limit, bisections)
    assert calls == tried
    assert (ladder.largest_fit, ladder.smallest_fail) == (largest, smallest)
    if largest is not None and smallest is not None:
        assert largest < smallest


def test_capacity_ratio_and_sizes():
    sizes = {d: {"model_bytes": d * 1e8} for d in (1, 2, 3, 4, 6, 8, 16)}
    ours = capacity.Ladder(1, 64, largest_fit=6, smallest_fail=8)
    upstream = capacity.Ladder(1, 64, largest_fit=2, smallest_fail=3)
    assert capacity.capacity_ratio(ours, upstream, sizes) == "3.0x (between 2.0x and 4.0x)"
    assert capacity.capacity_ratio(capacity.Ladder(1, 16, largest_fit=16), upstream, sizes).startswith("at least 5.3x")
    assert capacity.capacity_ratio(ours, capacity.Ladder(1, 4, largest_fit=4), sizes).startswith("n/a")
    # What fits: a checked load; a load that returned on every rank and was OOM-killed only in the check after it
    assert capacity._fits({"correct": True})
    assert not capacity._fits({"correct": False})
    killed = {"error": "failed during verify: ...", "loaded": True, "oom_kills": 1}
    assert capacity._fits(killed)
    assert capacity._outcome(True, killed) == "yes*"
    assert not capacity._fits({**killed, "loaded": False})  # killed in the load
    assert not capacity._fits({**killed, "oom_kills": 0})  # another failure after the load
    assert capacity._why_not({**killed, "loaded": False}) == "OOM-killed"
    assert capacity.parse_bytes("3GiB") == capacity.parse_bytes("3g") == 3 * 2**30
    assert capacity.parse_bytes("512MiB") == 2**29
    with pytest.raises(argparse.ArgumentTypeError):
        capacity.parse_bytes("3 potatoes")


@pytest.mark.skipif(not capacity.cgroups_writable(), reason="needs a writable memory cgroup (v1, root)")
def test_capacity_probe_under_a_cgroup(tmp_path):
    """One real probe: a cap far below what two ranks need to start, so the cgroup's OOM killer ends the job."""
    command = [
        sys.executable,
        str(_PACKAGE),
        "--capacity",
        "--cap=200MiB",
        "--capacity-width=64",
        "--capacity-max-depth=1",
        "--ranks=2",
        "--strategy=fsdp2",
        "--implementations=ours",
        f"--workdir={tmp_path / 'work'}",
        "--cache=file",
        "--settle=0.1",
        "--timeout=60",
        "--retry-busy=0",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert (
        "| FSDP2 | lightning-fsdp | none | 0.1 MB (64x1, checkpoint 0.4 MB) | OOM-killed | 1: no |" in completed.stdout
    )
    report = json.loads((tmp_path / "work" / "capacity.json").read_text())
    outcome = report["ladders"][0]["outcomes"]["1"]
    assert outcome["limit"] == "cgroup"
    assert outcome["oom_kills"] >= 1
    assert outcome["cgroup_peak_usage"] <= 200 * 2**20
    assert not list((tmp_path / "work" / "capacity").iterdir())  # each size's files deleted after its runs


def test_remote_cases_and_their_labels():
    """The remote rows: lightning-fsdp from s3:// (client created during the load or before the base) and Lightning
    master's `load_checkpoint`, which reads a remote file with `torch.load` only (no safetensors)."""
    args = argparse.Namespace(
        formats=["zip", "safetensors"],
        implementations=["ours", "s3", "s3-client-in-base", "master-s3"],
        load_concurrency=None,
        ranks=2,
        nodes=1,
        strategies=["fsdp"],
        s3_server="ranged",
        master_problem=None,
    )
    cases = [(c.format, c.implementation, c.label, c.unavailable) for c in cli._cases(args)]
    server = "moto, ranges served by seek"
    labels = {
        "ours": "lightning-fsdp",
        "s3": f"lightning-fsdp, from s3:// ({server})",
        "s3-client-in-base": f"lightning-fsdp, from s3://, S3 client created before the base ({server})",
        "master-s3": f"Lightning master, from s3:// ({server})",
    }
    assert cases == [
        *((("zip", impl, label, None)) for impl, label in labels.items()),
        *((("safetensors", impl, label, None)) for impl, label in list(labels.items())[:3]),
        ("safetensors", "master-s3", labels["master-s3"], cases[-1][3]),
    ]
    assert "no safetensors" in cases[-1][3]
    assert "--lightning-master" in cli._master_problem(None)
    assert "does not import cleanly" in cli._master_problem(Path(__file__).parent)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the server's peak memory is read from /proc")
def test_object_store_shim_serves_what_moto_serves(tmp_path):
    """The benchmark's range shim (`--s3-server ranged`) answers every range as stock moto does, and the server counts
    the bytes it sent per node, by the User-Agent."""
    pytest.importorskip("moto.server")
    import boto3
    from benchmarks.bench_load.object_store import NODE_APP_ID, start_object_store
    from botocore.config import Config
    from botocore.exceptions import ClientError

    data = torch.randint(0, 256, (3 * 2**20 + 17,), dtype=torch.uint8).numpy().tobytes()
    (tmp_path / "object.bin").write_bytes(data)
    meta = {"files": {"zip": {"path": str(tmp_path / "object.bin")}}}
    ranges = ["bytes=0-9", "bytes=5-99999", "bytes=3000000-", "bytes=-100", "bytes=1000000-2999999", "bytes=0-"]
    answers = {}
    for server in ("stock", "ranged"):
        store = start_object_store(meta, tmp_path, server)
        try:
            options = store.storage_options
            client = boto3.client(
                "s3",
                endpoint_url=store.endpoint,
                aws_access_key_id=options["key"],
                aws_secret_access_key=options["secret"],
                region_name=options["client_kwargs"]["region_name"],
                config=Config(user_agent_appid=NODE_APP_ID.format(1)),
            )
            store.reset()
            got = []
            for spec in ranges:
                answer = client.get_object(Bucket="bench", Key="zip/object.bin", Range=spec)
                got.append((answer["ContentRange"], answer["ETag"], answer["ContentLength"], answer["Body"].read()))
            with pytest.raises(ClientError, match="InvalidRange"):
                client.get_object(Bucket="bench", Key="zip/object.bin", Range=f"bytes={len(data)}-")
            counters = store.counters()
        finally:
            store.stop()
        assert [body for *_, body in got] == [data[0:10], data[5:100000], data[3000000:], data[-100:],
                                              data[1000000:3000000], data]  # fmt: skip
        node = counters["nodes"]["1"]
        assert node["requests"] == len(ranges) + 1
        assert sum(len(body) for *_, body in got) < node["get_bytes"] < sum(len(body) for *_, body in got) + 1000
        assert counters["peak_rss"] > 0
        assert counters["cpu_seconds"] > 0
        answers[server] = got
    assert answers["ranged"] == answers["stock"]
