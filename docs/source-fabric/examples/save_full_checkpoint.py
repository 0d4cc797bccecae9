"""Save a full checkpoint of a sharded model without gathering it: every rank writes its own slices into one file.

``state_dict_type="full"`` makes ``fabric.save`` write one ``torch.save`` file, the one Lightning's full save writes.
Here no rank gathers the model or the optimizer state: each writes its slices at their place in the file. The same
model's weights are then exported as one ``.safetensors`` file, and as a Hugging Face checkpoint (shards and
``model.safetensors.index.json``, as ``save_pretrained`` writes them), written the same way.

Run it with ``python save_full_checkpoint.py``: Fabric launches the second process itself. It needs no GPU.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: saved checkpoints/full.ckpt from 2 ranks, no gather
# expect: torch.load reads model, optimizer and step
# expect: safetensors holds the model's 10 tensors
# expect: the index maps 10 tensors to 3 shards

import gc
import json
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.saving import save_safetensors


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


def main() -> None:
    strategy = FSDPStrategy(state_dict_type="full", auto_wrap_policy={Block})
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()

    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(*(Block(48) for _ in range(2)), nn.Linear(48, 5)))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    fabric.backward(model(torch.randn(4, 48)).sum())
    optimizer.step()

    path = Path("checkpoints/full.ckpt")
    path.parent.mkdir(exist_ok=True)  # as with Lightning's full save, the folder must exist
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    fabric.print(f"saved {path} from {fabric.world_size} ranks, no gather")

    if fabric.global_rank == 0:
        checkpoint = torch.load(path, weights_only=True)
        assert sorted(checkpoint) == ["model", "optimizer", "step"]
        fabric.print("torch.load reads model, optimizer and step")

    save_safetensors(fabric, "checkpoints/model.safetensors", model)
    if fabric.global_rank == 0:
        from safetensors.torch import load_file

        fabric.print(f"safetensors holds the model's {len(load_file('checkpoints/model.safetensors'))} tensors")

    save_safetensors(fabric, "checkpoints/exported", model, max_shard_size="10KB")  # a directory
    if fabric.global_rank == 0:
        weight_map = json.loads(Path("checkpoints/exported/model.safetensors.index.json").read_text())["weight_map"]
        fabric.print(f"the index maps {len(weight_map)} tensors to {len(set(weight_map.values()))} shards")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive (see load_raw_state_dict.py).
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
