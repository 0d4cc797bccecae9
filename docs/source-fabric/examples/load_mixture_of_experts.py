"""Load a Mixture-of-Experts checkpoint (one tensor per expert) into a transformers 5 model (fused experts).

``save_pretrained`` and the Hub write every expert's weights as tensors of their own
(``model.layers.0.block_sparse_moe.experts.3.w1.weight``); the model holds them fused
(``model.layers.0.mlp.experts.gate_up_proj``, all experts' ``w1`` and ``w3`` in one tensor). The loader assembles the
fused tensors from the conversions that the model declares, as ``from_pretrained`` does, and each rank reads only the
parts of the expert tensors that fall in its shard.

Run it with ``python load_mixture_of_experts.py``: Fabric launches the second process itself. It needs no GPU, and
``transformers`` 5 (the package's ``test`` extra installs it).
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: the checkpoint holds 12 expert tensors per layer; the model holds 2
# expect: every tensor equals from_pretrained's

import gc
from pathlib import Path

import torch
from lightning.fabric import Fabric
from safetensors import safe_open
from torch.distributed.fsdp import FullyShardedDataParallel
from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

from lightning_fsdp import FSDPStrategy


def write_pretrained(directory: Path) -> None:
    """Stand-in for a downloaded model: a tiny random Mixtral with 4 experts, in safetensors."""
    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
    )
    MixtralForCausalLM(config).save_pretrained(directory)


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={MixtralDecoderLayer}))
    fabric.launch()

    path = Path("checkpoints/mixtral")
    if fabric.global_rank == 0:
        write_pretrained(path)
    fabric.barrier()

    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model = fabric.setup_module(model)

    # The same call as for any other model: the model's declared conversions (MergeModulelist, Concatenate) are
    # applied to the checkpoint's names, and each fused tensor is read piece by piece, only this rank's part of it.
    fabric.load_raw(path, model)

    # Check: every tensor, gathered, equals what `from_pretrained` loads in one process.
    reference = MixtralForCausalLM.from_pretrained(path).state_dict()
    with FullyShardedDataParallel.summon_full_params(model, writeback=False):
        loaded = {name: tensor.clone() for name, tensor in model.module.state_dict().items()}
    with safe_open(path / "model.safetensors", "pt") as file:
        names_in_file = file.keys()
    in_file = [name for name in names_in_file if name.startswith("model.layers.0.block_sparse_moe.experts.")]
    in_model = [name for name in loaded if name.startswith("model.layers.0.mlp.experts.")]
    fabric.print(f"the checkpoint holds {len(in_file)} expert tensors per layer; the model holds {len(in_model)}")
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reference[name]), name
    fabric.print("every tensor equals from_pretrained's")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
