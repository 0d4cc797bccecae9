"""One rank of a two-node run: started by ``fabric run`` or ``torchrun`` from ``tests/tests_fabric/test_two_nodes.py``.

For each strategy, ``FSDPStrategy`` (FSDP1) and then ``ModelParallelStrategy`` (FSDP2 over all ranks of both nodes),
in the same processes: creates a model under ``init_module(empty_init=True)``, sets it up, loads a raw checkpoint
shard-locally, and runs a training step. Writes what it saw per strategy (ranks, device, where every tensor lives,
memory per visible GPU) to ``<report_dir>/rank<R>.json``. It asserts what it can check alone; the test compares the
reports of all ranks.
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

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.loading import loader

_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--report-dir", required=True)
    parser.add_argument("--strategies", default="fsdp,model_parallel", help="run one after the other, in one launch")
    args = parser.parse_args()

    reports = {}
    for name in args.strategies.split(","):
        fabric, reports[name] = _set_up_load_and_train(args, name)
    fabric.barrier()  # every rank is alive while rank 0 asks the driver which process uses which GPU
    if fabric.global_rank == 0:
        gpu_processes = _gpu_processes()
        for report in reports.values():
            report["gpu_processes"] = gpu_processes
    Path(args.report_dir, f"rank{fabric.global_rank}.json").write_text(json.dumps(reports))
    fabric.barrier()
    # Leave without the interpreter's teardown: when the ranks of the other node close their gloo connections first, the
    # teardown of this process's process group can abort it ("terminate called without an active exception", about one
    # run in ten here, with or without `destroy_process_group`), which would fail a run whose work is done and checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _set_up_load_and_train(args: argparse.Namespace, name: str) -> tuple[Fabric, dict]:
    """One strategy's run; a later strategy's ``Fabric`` reuses the process group that the first one joined."""
    if name == "fsdp":
        strategy = FSDPStrategy(auto_wrap_policy={Block})
    else:
        world_size = args.devices * args.num_nodes
        strategy = ModelParallelStrategy(_fully_shard, data_parallel_size=world_size, tensor_parallel_size=1)
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
    assert not loader._warned_fallbacks, f"{name}: the load fell back to upstream's path: {loader._warned_fallbacks}"
    expected = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    assert_same_state(_full_model_state(model), expected)

    inputs, targets = make_batch(0)
    logits = model(inputs.to(fabric.device))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.to(fabric.device).flatten())
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    trained = _full_model_state(model)

    return fabric, {
        "pid": os.getpid(),
        "global_rank": fabric.global_rank,
        "local_rank": fabric.local_rank,
        "node_rank": fabric.node_rank,
        "world_size": fabric.world_size,
        "device": str(fabric.device),
        "init_devices": init_devices,
        "tensor_devices": sorted({str(tensor.device) for tensor in _tensors(model)}),
        "local_numel": sum(_local(parameter).numel() for parameter in model.parameters()),
        "loss": loss.item(),
        "changed_by_step": sorted(name for name in expected if not torch.equal(trained[name], expected[name])),
        "env": {name: os.environ.get(name) for name in _LAUNCHER_VARIABLES},
        **_cuda_report(fabric),
    }


def _fully_shard(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=device_mesh["data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on every rank, on CPU."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(parameter, DTensor) for parameter in model.parameters()):
        return gather_full_state(model)["model"]
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = getattr(model, "_forward_module", model)
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {name: tensor.detach().cpu().clone() for name, tensor in state.items()}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
