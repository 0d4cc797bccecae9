"""Load a base model and a LoRA adapter on top into a peft-wrapped model sharded with FSDP.

peft renames what it wraps: the base checkpoint's ``model.layers.0.self_attn.q_proj.weight`` is
``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` in the wrapped model, and the adapter file's
``...q_proj.lora_A.weight`` is ``...q_proj.lora_A.default.weight``. Each file is loaded with a ``rename`` (the one that
the loader advises when it is called without) and ``strict=False``: the base file does not hold the adapter's tensors,
nor the adapter file the base model's.

Run it with ``python load_peft_adapter.py``: Fabric launches the second process itself. It needs no GPU, and
``transformers`` and ``peft`` (the package's ``test`` extra installs them).
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: loaded the base model and the adapter
# expect: logits match PeftModel.from_pretrained's

import gc
from pathlib import Path

import torch
from lightning.fabric import Fabric
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils.other import fsdp_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_fsdp import FSDPStrategy

CONFIG = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)


def lora_config() -> LoraConfig:
    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def write_base_and_adapter(directory: Path) -> None:
    """Stand-in for a downloaded base model and a trained adapter (random, so that it changes the logits)."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(CONFIG)
    base.save_pretrained(directory / "base")
    get_peft_model(base, lora_config()).save_pretrained(directory / "adapter")


def base_names(name: str) -> str:
    """A base checkpoint's name -> the peft-wrapped model's (the rename that the loader's error advises)."""
    return (
        ("base_model.model." + name)
        .replace(".q_proj.", ".q_proj.base_layer.")
        .replace(".v_proj.", ".v_proj.base_layer.")
    )


def adapter_names(name: str) -> str:
    """An adapter file's name -> the model's: peft saves without the adapter's name, ``default``."""
    return name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")


def main() -> None:
    # FSDP1 flattens the parameters of each unit into one: a unit that holds peft's frozen base weights and its
    # trainable adapter needs `use_orig_params=True` (Fabric's default). peft's policy puts each adapter in a unit.
    policy = fsdp_auto_wrap_policy(get_peft_model(LlamaForCausalLM(CONFIG), lora_config()))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy=policy, use_orig_params=True))
    fabric.launch()

    checkpoints = Path("checkpoints")
    if fabric.global_rank == 0:
        write_base_and_adapter(checkpoints)
    fabric.barrier()

    with fabric.init_module(empty_init=True):
        model = get_peft_model(LlamaForCausalLM(CONFIG), lora_config())
    model = fabric.setup_module(model)

    # The base model: every tensor but the adapter's.
    with fabric.strategy.load_options(rename=base_names):
        fabric.load_raw(checkpoints / "base", model, strict=False)
    # The adapter on top: only the adapter's tensors.
    with fabric.strategy.load_options(rename=adapter_names):
        fabric.load_raw(checkpoints / "adapter" / "adapter_model.safetensors", model, strict=False)
    fabric.print("loaded the base model and the adapter")

    # Check: the same logits as peft's own loading, in one process.
    reference = PeftModel.from_pretrained(
        LlamaForCausalLM.from_pretrained(checkpoints / "base"), checkpoints / "adapter"
    )
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=1e-6, atol=1e-6)
    fabric.print("logits match PeftModel.from_pretrained's")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
