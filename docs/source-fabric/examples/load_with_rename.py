"""Load a checkpoint whose names differ from the model's, without a copy of the file.

A ``LlamaForCausalLM``-style file holds the base model under ``model.`` and a head, ``lm_head.weight``, that the
base model does not have. ``fabric.strategy.load_options(rename=...)`` maps the names for the loads inside the block:
``"model."`` is removed, and ``lm_head.`` is left out. A file saved from a compiled model (``_orig_mod.``) needs no
option: exactly one prefix makes every name match, so the loader removes it and says so.

Run it with ``python load_with_rename.py``: Fabric launches the second process itself. It needs no GPU.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: loaded the causal-LM file into the base model with rename
# expect: loaded the compiled model's file, its prefix removed automatically

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
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class BaseModel(nn.Module):
    def __init__(self, vocab: int = 128, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return x


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()

    causal_lm, compiled = Path("checkpoints/causal_lm.pth"), Path("checkpoints/compiled.pth")
    if fabric.global_rank == 0:
        causal_lm.parent.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        weights = BaseModel().state_dict()
        # As a causal-LM class saves it: the base model under "model.", and a head the base model lacks.
        torch.save({**{f"model.{k}": v for k, v in weights.items()}, "lm_head.weight": torch.zeros(128, 32)}, causal_lm)
        torch.save({f"_orig_mod.{k}": v for k, v in weights.items()}, compiled)  # saved after torch.compile
    fabric.barrier()

    with fabric.init_module(empty_init=True):
        model = BaseModel()
    model = fabric.setup_module(model)
    with fabric.strategy.load_options(rename={"model.": "", "lm_head.": None}):
        fabric.load_raw(causal_lm, model)
    fabric.print("loaded the causal-LM file into the base model with rename")

    fabric.load_raw(compiled, model)
    fabric.print("loaded the compiled model's file, its prefix removed automatically")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
