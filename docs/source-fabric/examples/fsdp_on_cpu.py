"""Train a model sharded with FSDP over 2 CPU processes, save a sharded checkpoint and resume from it.

Run it with ``python fsdp_on_cpu.py``: Fabric launches the second process itself. It needs no GPU.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: rank 0 of 2 holds
# expect: resumed from checkpoints/fsdp-on-cpu at step 3

import gc

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy


class Block(nn.Module):
    """The unit that FSDP wraps and shards: here, a transformer-style MLP block."""

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
    # Same arguments as Lightning's FSDPStrategy; `accelerator="cpu"` selects the gloo backend.
    strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(42)

    # `empty_init=True` creates the parameters on the meta device: no rank ever holds the whole model.
    with fabric.init_module(empty_init=True):
        model = Model()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))

    local = sum(p.numel() for p in model.parameters())
    with torch.device("meta"):  # count the full model's parameters without allocating them
        total = sum(p.numel() for p in Model().parameters())
    fabric.print(f"rank {fabric.global_rank} of {fabric.world_size} holds {local:,} of {total:,} parameters")

    for step in range(3):
        tokens = torch.randint(0, 128, (4, 17))
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(f"step {step}: loss {loss.item():.4f}")

    # A sharded checkpoint is a directory: every rank writes and later reads only its own shard.
    path = "checkpoints/fsdp-on-cpu"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})

    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    fabric.print(f"resumed from {path} at step {state['step']}")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
