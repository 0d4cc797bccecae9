"""Load a Hugging Face ``transformers`` model that was created on the meta device (``empty_init=True``).

The model is built from its config without allocating its weights, wrapped by FSDP (each rank materialises only its
own shard of each unit), then loaded from the ``save_pretrained`` directory, shard-locally. It computes exactly what
``from_pretrained`` computes: the norms (which have no ``reset_parameters``) and RoPE's ``inv_freq`` (a buffer that no
checkpoint holds) are initialised by the model's own ``_init_weights``, and the head stays tied to the embedding.

Run it with ``python load_transformers_empty_init.py``: Fabric launches the second process itself. It needs no GPU,
and ``transformers`` (the package's ``test`` extra installs it).
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: created LlamaForCausalLM on the meta device
# expect: loaded checkpoints/llama into the sharded model; lm_head is tied to the embedding: True
# expect: logits match from_pretrained's

import gc
from pathlib import Path

import torch
from lightning.fabric import Fabric
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_fsdp import FSDPStrategy


def write_pretrained(directory: Path) -> None:
    """Stand-in for a downloaded model: a tiny random Llama, its head tied to its embedding, in safetensors."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(directory)


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}))
    fabric.launch()

    path = Path("checkpoints/llama")
    if fabric.global_rank == 0:
        write_pretrained(path)
    fabric.barrier()

    # No weights are allocated here: every tensor is on the meta device.
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    fabric.print(f"created {type(model).__name__} on the meta device")

    # FSDP materialises each unit on the rank's device and shards it; the strategy initialises every module (the
    # model's own `_init_weights`, or `reset_parameters()`) and keeps `lm_head.weight` and the embedding one tensor.
    model = fabric.setup_module(model)
    tied = model.module.lm_head.weight is model.module.model.embed_tokens.weight

    # The directory, its `model.safetensors`, or a sharded `*.index.json`: each rank reads only its own slices.
    fabric.load_raw(path, model)
    fabric.print(f"loaded {path} into the sharded model; lm_head is tied to the embedding: {tied}")

    # Check: the same logits as the unsharded model that `from_pretrained` loads.
    reference = LlamaForCausalLM.from_pretrained(path)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=1e-6, atol=1e-6)
    fabric.print("logits match from_pretrained's")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
