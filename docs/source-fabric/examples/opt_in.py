"""An existing script, written for Lightning's own ``FSDPStrategy``, made to use lightning-fsdp with one line.

Everything below the marked line is what a downstream script (litgpt, your own) already contains: it imports the
strategy from ``lightning.fabric.strategies`` and loads a raw ``lit-llama.pth`` with ``fabric.load``, which upstream
Lightning answers with ``KeyError: 'model'``. After ``lightning_fsdp.enable()`` it gets this package's strategy.

Run it with ``python opt_in.py``: Fabric launches the second process itself. It needs no GPU.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: strategy: lightning_fsdp.strategy.FSDPStrategy
# expect: loaded checkpoints/lit-llama.pth with fabric.load
# expect: after disable(): lightning.fabric.strategies.fsdp.FSDPStrategy

import gc

import lightning_fsdp

lightning_fsdp.enable()  # the one line: before the strategy is created, anywhere in the script

# --- the unmodified script ---------------------------------------------------------------------------------------
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import FSDPStrategy  # noqa: E402
from torch import nn  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc_in = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(torch.relu(self.fc_in(x)))


def main() -> None:
    # On GPUs, `strategy="fsdp"` works too. On CPU, Fabric refuses the string before any strategy exists: pass an
    # instance, as here.
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    fabric.print(f"strategy: {type(fabric.strategy).__module__}.{type(fabric.strategy).__name__}")

    path = Path("checkpoints/lit-llama.pth")  # a raw module state dict, as published checkpoints are
    if fabric.global_rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        torch.save(nn.Sequential(Block(), Block()).state_dict(), path)
    fabric.barrier()

    with fabric.init_module(empty_init=True):
        model = nn.Sequential(Block(), Block())
    model = fabric.setup_module(model)
    fabric.load(path, {"model": model})
    fabric.print(f"loaded {path} with fabric.load")

    # `disable()` restores upstream: the class constructs Lightning's own strategy again.
    lightning_fsdp.disable()
    upstream = FSDPStrategy()
    fabric.print(f"after disable(): {type(upstream).__module__}.{type(upstream).__name__}")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
