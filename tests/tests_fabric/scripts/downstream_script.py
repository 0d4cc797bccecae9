"""A script written the downstream way (as litgpt does): upstream's `FSDPStrategy`, and `fabric.load` on a raw file.

Usage: python downstream_script.py CHECKPOINT [--opt-in] [--opt-in-first]
"""

# lightning-fsdp: package-only (it tests `lightning_fsdp.enable()`)
import gc
import sys

if "--opt-in-first" in sys.argv:
    import lightning_fsdp

    lightning_fsdp.enable()

import lightning as L
import torch
from lightning.fabric.strategies import FSDPStrategy
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def main() -> None:
    checkpoint = sys.argv[1]
    if "--opt-in" in sys.argv:  # the one line, after the imports, as a user would add it to an existing script
        import lightning_fsdp

        lightning_fsdp.enable()

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = nn.Sequential(Block(), Block())
    model = fabric.setup(model)
    fabric.load(checkpoint, {"model": model})

    expected = torch.load(checkpoint, weights_only=True)
    output = model(torch.ones(1, 8))
    reference = nn.Sequential(Block(), Block())
    reference.load_state_dict(expected)
    assert torch.allclose(output, reference(torch.ones(1, 8)))
    fabric.print(f"strategy: {type(fabric.strategy).__module__}.{type(fabric.strategy).__name__}")
    fabric.print("loaded the raw checkpoint")
    fabric.barrier()  # leave together


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
