"""Save full checkpoints in the background: training goes on while every rank writes its own slices.

``save_in_background=True`` makes ``fabric.save`` of a full checkpoint return once every rank holds a copy of its
slices in host memory; the file appears under its name when every rank has written it. The optimizer steps right after
the call, and the file still holds the state at the call. ``fabric.strategy.wait_for_save()`` waits for the save in
flight (the next save and a load wait too) and raises its error if it failed.

Run it with ``python save_in_background.py``: Fabric launches the second process itself. It needs no GPU.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints (or the package logs) lines containing
# expect: without a gather, in the background: each of the 2 ranks writes its own slices
# expect: fabric.save returned; the file is being written
# expect: the file holds step 1, taken before the 3 steps that ran after the call
# expect: checkpoints/step-4.ckpt holds step 4

import gc
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy


def full_weight(model: nn.Module) -> torch.Tensor:
    """The first layer's whole weight, gathered from the ranks' slices."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model._forward_module):
        return model._forward_module.module[0].weight.detach().clone()


def main() -> None:
    strategy = FSDPStrategy(state_dict_type="full", auto_wrap_policy={nn.Linear}, save_in_background=True)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()

    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))

    def train_step() -> None:
        fabric.backward(model(torch.randn(4, 64)).sum())
        optimizer.step()
        optimizer.zero_grad()

    Path("checkpoints").mkdir(exist_ok=True)
    train_step()
    at_call = full_weight(model)  # for the check below
    fabric.save("checkpoints/step-1.ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    fabric.print("fabric.save returned; the file is being written")
    for _ in range(3):  # training goes on meanwhile
        train_step()
    fabric.strategy.wait_for_save()  # raises here, on every rank, if the save failed

    now = full_weight(model)
    if fabric.global_rank == 0:
        saved = torch.load("checkpoints/step-1.ckpt", weights_only=True)
        assert torch.equal(saved["model"]["0.weight"], at_call)
        assert not torch.equal(at_call, now)
        fabric.print(f"the file holds step {saved['step']}, taken before the 3 steps that ran after the call")

    fabric.save("checkpoints/step-4.ckpt", {"model": model, "optimizer": optimizer, "step": 4})
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load("checkpoints/step-4.ckpt", state)  # waits for the save in flight first
    fabric.print(f"checkpoints/step-4.ckpt holds step {state['step']}")


if __name__ == "__main__":
    main()
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
