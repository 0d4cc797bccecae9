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
    # Leave together and tear the process group down before the interpreter does: gloo's threads, torn down during
    # interpreter finalisation, can abort the process ("terminate called without an active exception"), which failed
    # this test once in a CI run whose work was done and checked. The FSDP modules hold the group and sit in reference
    # cycles, so only a collection lets `destroy_process_group` drop the last reference and join those threads.
    fabric.barrier()
    del model, output
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
