"""Convert a consolidated checkpoint into a sharded one once, then load it shard by shard with ``fabric.load``.

The source here is a legacy-format ``torch.save`` file; the conversion reads it by byte ranges, a chunk of rows at a
time. The sharded checkpoint that the conversion writes is read by each rank in part: only the chunks that overlap
its own shard, already cut in rows. The conversion is one call of ``convert_checkpoint``, in one process.

Run it with ``python convert_and_load.py``: Fabric launches the second process itself. It needs no GPU.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: converted checkpoints/lit-llama.pth: 26 tensors in 26 chunks
# expect: loaded checkpoints/lit-llama-sharded into a model sharded over 2 ranks
# expect: outputs match the unsharded model

import gc
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.loading.convert import convert_checkpoint


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

    # Once, before training, in one process (here rank 0 of the job; the conversion needs no GPU and no process
    # group). The source is a stand-in for a downloaded file.
    source = Path("checkpoints/lit-llama.pth")
    sharded = Path("checkpoints/lit-llama-sharded")
    if fabric.global_rank == 0:
        source.parent.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        torch.save(Model().state_dict(), source, _use_new_zipfile_serialization=False)
        result = convert_checkpoint(source, sharded)
        print(f"converted {source}: {result.tensors} tensors in {result.chunks} chunks")
    fabric.barrier()

    # Every rank reads only the chunks of the sharded checkpoint that overlap its shard.
    with fabric.init_module(empty_init=True):
        model = Model()
    model = fabric.setup_module(model)
    fabric.load(sharded, {"model": model})
    fabric.print(f"loaded {sharded} into a model sharded over {fabric.world_size} ranks")

    reference = Model()
    reference.load_state_dict(torch.load(source, weights_only=True))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens))
    fabric.print("outputs match the unsharded model")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
