"""Load a Hugging Face checkpoint (sharded safetensors with an index, in bf16) with ``fabric.load``, then only its
backbone into a model with a new head (``strict=False``).

``fabric.load`` tells the format from the files' content: no conversion, no special case for checkpoints that Fabric
did not write. Each rank reads only the bytes of its own shard.

Run it with ``python load_hugging_face.py``: Fabric launches the second process itself. It needs no GPU.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: loaded checkpoints/hf-model (2 safetensors shards, bfloat16) into a float32 model
# expect: The checkpoint does not match the model; nothing was loaded and the model is unchanged.
# expect: strict=False loaded the backbone; the new head kept its initial values

import gc
import json
from pathlib import Path

import torch
from lightning.fabric import Fabric
from safetensors.torch import save_file
from torch import nn

from lightning_fsdp import CheckpointLoadError, FSDPStrategy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(torch.relu(self.fc_in(self.norm(x))))


class Model(nn.Module):
    """The pretrained language model: embedding, blocks, and a head over the vocabulary."""

    def __init__(self, vocab: int = 128, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(tokens))


class Classifier(nn.Module):
    """The model to fine-tune: the same backbone, and a new head (``score``) that no checkpoint holds."""

    def __init__(self, vocab: int = 128, width: int = 64, depth: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.score = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return x, self.score(x.mean(dim=1))


def write_hugging_face_checkpoint(directory: Path) -> None:
    """Stand-in for a downloaded model: two safetensors shards in bf16 and a ``model.safetensors.index.json``."""
    torch.manual_seed(0)
    state = {name: tensor.to(torch.bfloat16) for name, tensor in Model().state_dict().items()}
    names = list(state)
    shards = {"model-00001-of-00002.safetensors": names[:13], "model-00002-of-00002.safetensors": names[13:]}
    directory.mkdir(parents=True, exist_ok=True)
    for file, shard_names in shards.items():
        save_file({name: state[name] for name in shard_names}, directory / file)
    weight_map = {name: file for file, shard_names in shards.items() for name in shard_names}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()

    path = Path("checkpoints/hf-model")
    if fabric.global_rank == 0:
        write_hugging_face_checkpoint(path)
    fabric.barrier()

    # The same call as for a checkpoint that `fabric.save` wrote. The path may be the directory, the
    # `*.index.json` in it, or a single `model.safetensors`. The bf16 values are cast to the model's float32.
    with fabric.init_module(empty_init=True):
        model = Model()
    model = fabric.setup_module(model)
    fabric.load(path, {"model": model})
    fabric.print(f"loaded {path} (2 safetensors shards, bfloat16) into a float32 model")

    # Check: the sharded model computes what an unsharded model with the same (bf16-rounded) weights computes.
    torch.manual_seed(0)
    reference = Model()
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in reference.state_dict().items()})
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens))

    # Fine-tuning with a new head: the checkpoint lacks `score.*` and has a `head.weight` the model does not.
    with fabric.init_module(empty_init=True):
        classifier = Classifier()
    classifier = fabric.setup_module(classifier)
    try:
        fabric.load(path, {"model": classifier})  # strict=True: refused on every rank, before anything is written
    except CheckpointLoadError as error:
        fabric.print(f"strict=True refused: {error}")

    # strict=False loads the tensors that match and warns, on rank 0, about what it skipped.
    fabric.load(path, {"model": classifier}, strict=False)
    with torch.no_grad():
        hidden, _ = classifier(tokens)
        torch.testing.assert_close(hidden, reference.hidden(tokens))
    fabric.print("strict=False loaded the backbone; the new head kept its initial values")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
