"""Two "nodes" of real processes on one machine, launched the way users launch real nodes.

Each node is its own launcher process (``fabric run --num-nodes=2 --node-rank=R ...`` or the ``torchrun`` equivalent)
on 127.0.0.1, and every rank runs ``scripts/two_nodes_worker.py``, once with ``FSDPStrategy`` (FSDP1) and then with
``ModelParallelStrategy`` (FSDP2 across both nodes) in the same processes: ``init_module(empty_init=True)``,
``setup_module``, ``load_raw`` of a raw checkpoint (shard-local, compared bit-exact), a training step, and a report of
its ranks, device and tensors.
On CPU the nodes have two ranks each; the standalone GPU tests give each node its own ``CUDA_VISIBLE_DEVICES`` and
check, per physical GPU, which processes put memory there.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from tests.tests_fabric.helpers.models import TinyTransformer
from tests.tests_fabric.helpers.runif import RunIf

#: Where this package of tests is imported from: the repository's root here, ``tests/`` once carried into Lightning.
_IMPORT_ROOT = Path(__file__).resolve().parents[len(__name__.split(".")) - 1]
_WORKER = Path(__file__).resolve().parent / "scripts" / "two_nodes_worker.py"
_NUM_NODES = 2
_TIMEOUT = 150.0
_STRATEGIES = ("fsdp", "model_parallel")
# What a launcher, a scheduler or Fabric's CLI may have left in this process's environment: the nodes get none of it.
_INHERITED_PREFIXES = ("SLURM_", "TORCHELASTIC_", "LT_", "PL_", "OMPI_", "PMI_")
_INHERITED_NAMES = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}
_INHERITED_NAMES |= {"MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"}


def _launch_command(launcher: str, node_rank: int, port: int, accelerator: str, devices: int) -> list[str]:
    if launcher == "fabric":
        fabric = shutil.which("fabric", path=str(Path(sys.executable).parent)) or shutil.which("fabric")
        if fabric is None:
            pytest.skip("the `fabric` command is not installed")
        return [
            fabric,
            "run",
            f"--accelerator={accelerator}",
            f"--devices={devices}",
            f"--num-nodes={_NUM_NODES}",
            f"--node-rank={node_rank}",
            "--main-address=127.0.0.1",
            f"--main-port={port}",
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={_NUM_NODES}",
        f"--nproc-per-node={devices}",
        f"--node-rank={node_rank}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
    ]


def _run_two_nodes(
    launcher: str,
    tmp_path: Path,
    checkpoint: Path,
    accelerator: str = "cpu",
    devices: int = 2,
    node_env: list[dict[str, str]] | None = None,
) -> dict[str, list[dict]]:
    """Start both nodes at once, wait for them (killing both on timeout); return each strategy's reports by rank."""
    if launcher == "fabric":
        pytest.importorskip("click", reason="`fabric run` needs `click` (in the test extra)")
    port = find_free_network_port()
    report_dir = tmp_path / "reports"
    report_dir.mkdir()
    base_env = {
        name: value
        for name, value in os.environ.items()
        if name not in _INHERITED_NAMES and not name.startswith(_INHERITED_PREFIXES)
    }
    base_env["PYTHONPATH"] = os.pathsep.join([str(_IMPORT_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    base_env["OMP_NUM_THREADS"] = "1"
    worker_args = [str(_WORKER), f"--accelerator={accelerator}", f"--devices={devices}", f"--num-nodes={_NUM_NODES}"]
    worker_args += [f"--checkpoint={checkpoint}", f"--report-dir={report_dir}"]

    processes, logs = [], []
    for node_rank in range(_NUM_NODES):
        env = {**base_env, **(node_env[node_rank] if node_env else {})}
        log = tmp_path / f"node{node_rank}.log"
        logs.append(log)
        command = _launch_command(launcher, node_rank, port, accelerator, devices) + worker_args
        with open(log, "w") as out:
            process = subprocess.Popen(  # each node in its own session, so that a hang is killed with its workers
                command, env=env, cwd=_IMPORT_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        processes.append(process)

    deadline = time.monotonic() + _TIMEOUT
    while time.monotonic() < deadline and any(process.poll() is None for process in processes):
        time.sleep(0.1)
    timed_out = [process for process in processes if process.poll() is None]
    for process in timed_out:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    codes = [process.returncode for process in processes]
    if timed_out or any(codes):
        tails = "\n".join(f"--- node {rank} (exit code {codes[rank]}):\n{_tail(log)}" for rank, log in enumerate(logs))
        reason = f"timed out after {_TIMEOUT}s" if timed_out else "failed"
        pytest.fail(f"The two-node run with {launcher} {reason}:\n{tails}")

    world_size = _NUM_NODES * devices
    by_rank = [json.loads((report_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    reports = {strategy: [ranks[strategy] for ranks in by_rank] for strategy in _STRATEGIES}
    for strategy_reports in reports.values():
        assert [report["global_rank"] for report in strategy_reports] == list(range(world_size))
    return reports


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _save_raw_checkpoint(path: Path, device: str = "cpu") -> Path:
    torch.manual_seed(7)
    model = TinyTransformer().to(device)
    torch.save(model.state_dict(), path)
    return path


def _assert_ranks_and_training(reports: list[dict], devices: int, strategy: str) -> None:
    for report in reports:
        rank = report["global_rank"]
        node_rank, local_rank = divmod(rank, devices)
        assert (report["node_rank"], report["local_rank"], report["world_size"]) == (
            node_rank,
            local_rank,
            _NUM_NODES * devices,
        ), report
        # Fabric's ranks are the launcher's: torchrun (under `fabric run` too) set these for this very process.
        assert report["env"]["RANK"] == str(rank)
        assert report["env"]["LOCAL_RANK"] == str(local_rank)
        assert report["env"]["GROUP_RANK"] == str(node_rank)
        assert report["init_devices"] == ["meta"], "`init_module(empty_init=True)` must create parameters on meta"
        assert report["tensor_devices"] == [report["device"]], (
            f"{strategy}, rank {rank}: tensors on {report['tensor_devices']}"
        )
        assert report["changed_by_step"], f"{strategy}, rank {rank}: the training step changed nothing"
    # All ranks hold the same model and saw the same batch: the same loss and the same parameters changed.
    assert len({report["loss"] for report in reports}) == 1
    assert len({tuple(report["changed_by_step"]) for report in reports}) == 1
    if strategy == "model_parallel":  # FSDP2 over all ranks of both nodes: each holds its own rows of every parameter
        full = sum(tensor.numel() for tensor in TinyTransformer().parameters())
        assert sum(report["local_numel"] for report in reports) == full
        assert all(0 < report["local_numel"] < full for report in reports)


@pytest.mark.parametrize("launcher", ["fabric", "torchrun"])
def test_two_nodes_cpu(tmp_path, launcher):
    checkpoint = _save_raw_checkpoint(tmp_path / "raw.pth")
    for strategy, reports in _run_two_nodes(launcher, tmp_path, checkpoint).items():
        _assert_ranks_and_training(reports, devices=2, strategy=strategy)
        assert {report["device"] for report in reports} == {"cpu"}


@RunIf(min_cuda_gpus=2, standalone=True)
@pytest.mark.parametrize("saved_on", ["cpu", "cuda:0"])
@pytest.mark.parametrize("launcher", ["fabric", "torchrun"])
def test_two_nodes_cuda_every_rank_on_its_own_gpu(tmp_path, launcher, saved_on):
    """Each "node" sees its own GPUs; every rank's memory must be on its own GPU, none on another's (or on GPU 0).

    ``saved_on="cuda:0"`` saves the checkpoint from the first GPU, which is what put node 1's tensors on ``cuda:0``.

    """
    gpus = torch.cuda.device_count()
    devices = gpus // _NUM_NODES
    # GPU indices as this process sees them; each node's CUDA_VISIBLE_DEVICES names them as the driver does.
    physical = [list(range(node * devices, (node + 1) * devices)) for node in range(_NUM_NODES)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    driver_ids = visible.split(",") if visible else [str(index) for index in range(gpus)]
    node_env = [{"CUDA_VISIBLE_DEVICES": ",".join(driver_ids[index] for index in ids)} for ids in physical]
    uuids = [str(torch.cuda.get_device_properties(index).uuid).lower().removeprefix("gpu-") for index in range(gpus)]
    checkpoint = _save_raw_checkpoint(tmp_path / "raw.pth", device=saved_on)

    runs = _run_two_nodes(launcher, tmp_path, checkpoint, accelerator="cuda", devices=devices, node_env=node_env)
    for strategy, reports in runs.items():
        _assert_every_rank_on_its_own_gpu(reports, devices, strategy, physical, uuids)


def _assert_every_rank_on_its_own_gpu(
    reports: list[dict], devices: int, strategy: str, physical: list[list[int]], uuids: list[str]
) -> None:
    _assert_ranks_and_training(reports, devices=devices, strategy=strategy)
    for report in reports:
        rank, local_rank, node_rank = report["global_rank"], report["local_rank"], report["node_rank"]
        assert report["device"] == f"cuda:{local_rank}"
        assert report["current_device"] == local_rank
        assert report["own_gpu"] == uuids[physical[node_rank][local_rank]], (
            f"{strategy}, rank {rank} is on the wrong GPU"
        )
        others = {index: used for index, used in report["allocated"].items() if int(index) != local_rank}
        assert report["allocated"][str(local_rank)] > 0
        assert all(used == 0 for used in others.values()), (
            f"{strategy}, rank {rank} allocated memory on other GPUs: {others}"
        )
    # From the driver's side: every worker process has a CUDA context on its own GPU and on no other.
    gpu_processes = reports[0].get("gpu_processes") or []
    for report in reports:
        used = {uuid for pid, uuid in gpu_processes if pid == str(report["pid"])}
        if used:  # the driver may not see the processes (a container's PID namespace): then this part says nothing
            assert used == {report["own_gpu"]}, f"rank {report['global_rank']} has CUDA contexts on {used}"
