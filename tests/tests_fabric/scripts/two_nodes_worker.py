"""One rank of a two-node run: started by ``fabric run`` or ``torchrun`` from ``tests/tests_fabric/test_two_nodes.py``.

Creates a model under ``init_module(empty_init=True)``, sets it up, loads a raw checkpoint, runs a training step, and
writes what it saw (ranks, device, where every tensor lives, memory per visible GPU) to ``<report_dir>/rank<R>.json``.
It asserts what it can check alone; the test compares the reports of all ranks.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from tests.tests_fabric.helpers.models import Block, TinyTransformer, make_batch
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state

from lightning_fsdp import FSDPStrategy

_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--report-dir", required=True)
    args = parser.parse_args()

    strategy = FSDPStrategy(auto_wrap_policy={Block})
    if os.environ.get("LT_CLI_USED") == "1":
        # `fabric run` gives Fabric its --accelerator, --devices and --num-nodes (it also takes them from behind the
        # script's name, so the script never sees them) and set up the environment in `Fabric()` already.
        fabric = Fabric(strategy=strategy)
    else:
        fabric = Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy)
        fabric.launch()

    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    init_devices = sorted({str(tensor.device) for tensor in _tensors(model)})
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))

    fabric.load_raw(args.checkpoint, model)
    expected = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    assert_same_state(gather_full_state(model)["model"], expected)

    inputs, targets = make_batch(0)
    logits = model(inputs.to(fabric.device))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.to(fabric.device).flatten())
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    trained = gather_full_state(model)["model"]

    report = {
        "pid": os.getpid(),
        "global_rank": fabric.global_rank,
        "local_rank": fabric.local_rank,
        "node_rank": fabric.node_rank,
        "world_size": fabric.world_size,
        "device": str(fabric.device),
        "init_devices": init_devices,
        "tensor_devices": sorted({str(tensor.device) for tensor in _tensors(model)}),
        "loss": loss.item(),
        "changed_by_step": sorted(name for name in expected if not torch.equal(trained[name], expected[name])),
        "env": {name: os.environ.get(name) for name in _LAUNCHER_VARIABLES},
        **_cuda_report(fabric),
    }
    fabric.barrier()  # every rank is alive while rank 0 asks the driver which process uses which GPU
    if fabric.global_rank == 0:
        report["gpu_processes"] = _gpu_processes()
    Path(args.report_dir, f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
    fabric.barrier()
    # Leave without the interpreter's teardown: when the ranks of the other node close their gloo connections first, the
    # teardown of this process's process group can abort it ("terminate called without an active exception", about one
    # run in ten here, with or without `destroy_process_group`), which would fail a run whose work is done and checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _cuda_report(fabric: Fabric) -> dict:
    if fabric.device.type != "cuda":
        return {}
    own = torch.cuda.get_device_properties(fabric.device)
    return {
        "current_device": torch.cuda.current_device(),
        "own_gpu": _uuid(own.uuid),
        # Allocator memory of this process on every GPU it can see: only its own may hold any.
        "allocated": {str(index): torch.cuda.max_memory_allocated(index) for index in range(torch.cuda.device_count())},
    }


def _gpu_processes() -> list[list[str]] | None:
    """``[pid, gpu uuid]`` for every process with a CUDA context, from the driver; ``None`` where it cannot tell."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"]
    try:
        output = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in output.splitlines() if line.strip()]
    return [[pid.strip(), _uuid(uuid)] for pid, uuid in rows]


def _uuid(uuid: object) -> str:
    return str(uuid).strip().lower().removeprefix("gpu-")


if __name__ == "__main__":
    main()
