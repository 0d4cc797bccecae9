"""Load checkpoints into a model sharded with FSDP2 (``fully_shard``) through ``lightning_fsdp.ModelParallelStrategy``.

First a raw module state dict with ``fabric.load_raw``, then a full checkpoint with Adam's state with ``fabric.load``.
The model is created on the meta device and sharded by ``parallelize_fn`` before anything is loaded; each rank copies
only its own slice of every tensor into its ``DTensor`` shards.

Run it with ``python fsdp2_load.py``: Fabric launches the second process itself. It needs no GPU.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: loaded checkpoints/fsdp2-raw.pth into a model sharded with fully_shard over 2 ranks
# expect: outputs match the unsharded model
# expect: resumed from checkpoints/fsdp2-full.ckpt at step 1 with Adam's state

import gc
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from lightning_fsdp import ModelParallelStrategy


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


def parallelize(model: Model, device_mesh: DeviceMesh) -> Model:
    # FSDP2: shard every block, then the root (embedding and head), over the data-parallel dimension of the mesh.
    mesh = device_mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sharded_model(fabric: Fabric) -> tuple[nn.Module, torch.optim.Optimizer]:
    # The meta device: no memory, no initialization; `setup_module` calls `parallelize`, then allocates the shards.
    with fabric.init_module(empty_init=True):
        model = Model()
    model = fabric.setup_module(model)
    # Create the optimizer before the first forward: FSDP2 keeps the root's parameters gathered after it.
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    return model, optimizer


def train_step(fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    strategy = ModelParallelStrategy(
        parallelize,
        data_parallel_size=2,  # FSDP over both ranks
        tensor_parallel_size=1,
        save_distributed_checkpoint=False,  # `fabric.save` writes one full checkpoint file
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)  # `accelerator="cpu"`: the gloo backend
    fabric.launch()

    # Stand-in for a checkpoint that Fabric did not write: a plain `torch.save(model.state_dict())`.
    raw_path = Path("checkpoints/fsdp2-raw.pth")
    if fabric.global_rank == 0:
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        torch.save(Model().state_dict(), raw_path)
    fabric.barrier()

    model, optimizer = sharded_model(fabric)
    fabric.load_raw(raw_path, model)
    fabric.print(f"loaded {raw_path} into a model sharded with fully_shard over {fabric.world_size} ranks")

    # Check: the sharded model computes what the unsharded model computes with the same weights.
    reference = Model()
    reference.load_state_dict(torch.load(raw_path, weights_only=True))
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens))
    fabric.print("outputs match the unsharded model")

    # A full checkpoint with Adam's state, then a fresh sharded model and optimizer that resume from it.
    train_step(fabric, model, optimizer, tokens)
    full_path = Path("checkpoints/fsdp2-full.ckpt")
    fabric.save(full_path, {"model": model, "optimizer": optimizer, "step": 1})

    resumed, resumed_optimizer = sharded_model(fabric)
    state = {"model": resumed, "optimizer": resumed_optimizer, "step": 0}
    fabric.load(full_path, state)

    # Check: one more step from the loaded weights and Adam moments gives what the original model gets.
    train_step(fabric, model, optimizer, tokens)
    train_step(fabric, resumed, resumed_optimizer, tokens)
    with torch.no_grad():
        torch.testing.assert_close(resumed(tokens), model(tokens))
    fabric.print(f"resumed from {full_path} at step {state['step']} with Adam's state")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
