"""Load a raw module state dict, such as lit-llama's ``lit-llama.pth``, into a model sharded with FSDP.

The file holds only ``model.state_dict()``, not a checkpoint that ``fabric.save`` wrote, so it is loaded with
``fabric.load_raw``. The model is created on the meta device and sharded before anything is loaded.

Run it with ``python load_raw_state_dict.py``: Fabric launches the second process itself. It needs no GPU.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: loaded checkpoints/lit-llama.pth into a model sharded over 2 ranks
# expect: outputs match the unsharded model
# expect: saved a sharded checkpoint to checkpoints/lit-llama-sharded

import gc
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(torch.relu(self.fc_in(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int = 128, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()

    # Stand-in for a checkpoint that Fabric did not write: a plain `torch.save(model.state_dict())`.
    path = Path("checkpoints/lit-llama.pth")
    if fabric.global_rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        torch.save(Model().state_dict(), path)
    fabric.barrier()

    # Create the model on the meta device (no memory, no initialization), shard it, then fill in the weights.
    with fabric.init_module(empty_init=True):
        model = Model()
    model = fabric.setup_module(model)
    fabric.load_raw(path, model)
    fabric.print(f"loaded {path} into a model sharded over {fabric.world_size} ranks")

    # Check: the sharded model computes what the unsharded model computes with the same weights.
    reference = Model()
    reference.load_state_dict(torch.load(path, weights_only=True))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens))
    fabric.print("outputs match the unsharded model")

    # Convert once: a sharded checkpoint (the strategy's default `state_dict_type="sharded"`) is a directory in which
    # every rank later reads only its own shard, with `fabric.load(sharded_path, {"model": model})`.
    sharded_path = Path("checkpoints/lit-llama-sharded")
    fabric.save(sharded_path, {"model": model})
    fabric.print(f"saved a sharded checkpoint to {sharded_path}")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
