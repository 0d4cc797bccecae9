"""Names that differ inside, not by a prefix: a base model and a LoRA adapter into a peft-wrapped sharded model.

peft wraps ``q_proj.weight`` as ``q_proj.base_layer.weight`` and keeps its adapter as ``lora_A.default.weight``, while
the base checkpoint holds ``q_proj.weight`` and ``save_pretrained`` of the adapter holds ``lora_A.weight``. Both loads
are refused with a ``rename`` that fits the file; the test pastes that rename from the error, as a user would, and the
model then computes what peft's own ``PeftModel.from_pretrained`` computes.
"""

import re
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import CheckpointLoadError, FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.layouts.targets import TargetSpec
from lightning_fsdp.loading.materialize import MetaMaterializer
from lightning_fsdp.loading.sources import TensorSpec
from lightning_fsdp.loading.validation import plan_load
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import tiny_llama_config
from tests.tests_fabric.helpers.state import gather_full_state

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# peft calls a method that transformers deprecated; Lightning's test configuration turns `FutureWarning` into errors.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

_VOCAB = 64
_ADVISED = re.compile(r"`rename=(lambda name: .*?)`, ")


def _lora_config():
    # `init_lora_weights=False`: a random adapter (peft's default adapter changes nothing until trained).
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def _write(directory) -> tuple[str, str]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(False, _VOCAB))
    model.save_pretrained(directory / "base")
    peft.get_peft_model(model, _lora_config()).save_pretrained(directory / "adapter")
    return str(directory / "base"), str(directory / "adapter" / "adapter_model.safetensors")


def _parallelize(model: nn.Module, device_mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _sharded_peft_model(layout: str, lora: Any) -> tuple[Fabric, nn.Module]:
    """A tiny Llama with the adapter ``lora``, created on the meta device and sharded over 2 CPU ranks."""
    config = tiny_llama_config(False, _VOCAB)
    if layout == "fsdp1":
        from peft.utils.other import fsdp_auto_wrap_policy

        # FSDP1 flattens each unit's parameters into one: a unit of peft's frozen base and trainable adapter needs
        # `use_orig_params=True` (Fabric's default); peft's policy wraps the adapters in units of their own.
        policy = fsdp_auto_wrap_policy(peft.get_peft_model(transformers.LlamaForCausalLM(config), lora))
        strategy = FSDPStrategy(auto_wrap_policy=policy, use_orig_params=True)
    else:
        strategy = ModelParallelStrategy(_parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)
    return fabric, fabric.setup_module(model)


def _load_base_and_adapter(base: str, adapter: str, layout: str) -> list[str]:
    fabric, model = _sharded_peft_model(layout, _lora_config())
    messages = []
    for path in (base, adapter):
        with pytest.raises(CheckpointLoadError) as error:
            fabric.load_raw(path, model)
        messages.append(str(error.value))
        rename = eval(_ADVISED.search(str(error.value)).group(1))  # pasted from the advice, as a user would
        with fabric.strategy.load_options(rename=rename):
            fabric.load_raw(path, model, strict=False)

    reference = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(base), adapter[: -len("/adapter_model.safetensors")]
    )
    tokens = torch.randint(0, _VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=1e-6, atol=1e-6)
    return messages


@pytest.mark.parametrize("layout", ["fsdp1", "fsdp2"])
def test_base_model_and_adapter_into_a_peft_model(tmp_path, layout):
    """Both refusals advise a rename that loads the file; with it the model computes what peft's loading gives."""
    base, adapter = _write(tmp_path)
    for base_message, adapter_message in run_distributed(_load_base_and_adapter, base, adapter, layout, devices=2):
        assert "differ from the model's inside, not only by a prefix" in base_message
        assert (
            "`rename=lambda name: ('base_model.model.' + name).replace('.q_proj.', '.q_proj.base_layer.')"
            ".replace('.v_proj.', '.v_proj.base_layer.')`" in base_message
        )
        assert "The other 8 ('base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight'" in base_message
        assert (
            "`rename=lambda name: name.replace('.lora_A.', '.lora_A.default.').replace('.lora_B.', '.lora_B.default.')`"
            in adapter_message
        )


def _new_adapter_on_loaded_base(base: str, layout: str) -> dict[str, Any]:
    """A peft model with a new adapter (peft's defaults), created on meta, its base loaded: it computes the base's."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])  # `init_lora_weights=True`
    fabric, model = _sharded_peft_model(layout, lora)

    def rename(name: str) -> str:  # what the refusal advises (see the test above)
        return (
            ("base_model.model." + name)
            .replace(".q_proj.", ".q_proj.base_layer.")
            .replace(".v_proj.", ".v_proj.base_layer.")
        )

    with fabric.strategy.load_options(rename=rename):
        fabric.load_raw(f"{base}/model.safetensors", model, strict=False)
    tokens = torch.randint(0, _VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
    state = gather_full_state(model)["model"]
    # NumPy arrays: a tensor would reach the test process through shared memory that this rank takes with it.
    return {
        "logits": logits.numpy(),
        "lora_A": torch.cat([value.flatten() for name, value in state.items() if ".lora_A." in name]).numpy(),
        "lora_B": torch.cat([value.flatten() for name, value in state.items() if ".lora_B." in name]).numpy(),
    }


@pytest.mark.parametrize("layout", ["fsdp1", "fsdp2"])
def test_a_new_adapter_on_a_meta_model_changes_nothing_until_trained(tmp_path, layout):
    """peft makes a new adapter's `lora_B` zero: created under `empty_init=True`, it must be zero too, not random."""
    base, _ = _write(tmp_path)
    tokens = torch.randint(0, _VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = transformers.LlamaForCausalLM.from_pretrained(base)(tokens).logits
    for rank in run_distributed(_new_adapter_on_loaded_base, base, layout, devices=2):
        torch.testing.assert_close(torch.from_numpy(rank["logits"]), expected, rtol=1e-6, atol=1e-6)
        assert not rank["lora_B"].any()
        # `lora_A` as nn.Linear initialises itself (peft's default): uniform within 1/sqrt(32), not N(0, 0.02).
        assert abs(rank["lora_A"]).max() <= 32**-0.5
        assert rank["lora_A"].std() > 0.06


def _meta_peft_model(**lora_options: Any) -> nn.Module:
    config = tiny_llama_config(False, _VOCAB)
    options = {"r": 4, "target_modules": ["q_proj", "embed_tokens"], **lora_options}
    with torch.device("meta"):
        model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(**options))
    MetaMaterializer(model, torch.device("cpu")).materialize(model)
    return model


def _adapter_tensors(model: nn.Module, part: str) -> torch.Tensor:
    return torch.cat([value.detach().flatten() for name, value in model.named_parameters() if f".{part}." in name])


@pytest.mark.parametrize("scheme", [True, "gaussian", False])
def test_adapters_materialise_as_peft_initialises_them(scheme):
    """Each `init_lora_weights` as peft draws it: `lora_A` (std 1/sqrt(3 * 32) as nn.Linear, or 1/r), `lora_B` zero
    unless `False`; an embedding's adapter: `lora_embedding_A` zero and `lora_embedding_B` N(0, 1)."""
    model = _meta_peft_model(init_lora_weights=scheme)
    lora_a, lora_b = _adapter_tensors(model, "lora_A"), _adapter_tensors(model, "lora_B")
    expected_a_std = 0.25 if scheme == "gaussian" else (3 * 32) ** -0.5
    assert 0.75 * expected_a_std < lora_a.std() < 1.25 * expected_a_std
    assert lora_b.any() == (scheme is False)
    embedding_a, embedding_b = _adapter_tensors(model, "lora_embedding_A"), _adapter_tensors(model, "lora_embedding_B")
    assert embedding_a.any() == (scheme is False)
    assert 0.75 < embedding_b.std() < 1.25


def test_a_scheme_computed_from_base_weights_starts_as_peft_default_with_a_warning():
    with pytest.warns(UserWarning, match=r"`init_lora_weights='pissa'`, which peft computes from the base weights"):
        model = _meta_peft_model(init_lora_weights="pissa", target_modules=["q_proj"])
    assert not _adapter_tensors(model, "lora_B").any()


def _specs(names, shape=(4, 4)):
    return {name: TensorSpec(shape, torch.float32) for name in names}


def _targets(names, shape=(4, 4)):
    return [TargetSpec((name,), shape, torch.float32) for name in names]


def test_a_substituted_component_is_advised():
    """A component renamed throughout (`block_sparse_moe` for `mlp`): the advice replaces it, and loads everything."""
    names = [f"layers.{i}.{part}.weight" for i in range(3) for part in ("attn", "block_sparse_moe")]
    targets = _targets([name.replace("block_sparse_moe", "mlp") for name in names])
    with pytest.raises(CheckpointLoadError) as error:
        plan_load(targets, _specs(names), strict=True)
    message = str(error.value)
    assert (
        "`rename=lambda name: name.replace('.block_sparse_moe.', '.mlp.')`, 6 of the model's 6 tensors load." in message
    )
    assert "strict=False" not in message
    plan = plan_load(targets, _specs(names), strict=True, rename=eval(_ADVISED.search(message).group(1)))
    assert len(plan.sources) == 6


def test_the_insertion_advised_keeps_shapes():
    """`q_proj.weight` (4, 4) could be `q_proj.lora_A.default.weight` (2, 4) or `q_proj.base_layer.weight` (4, 4)."""
    names = [f"layers.{i}.q_proj.weight" for i in range(2)]
    adapters = _targets([f"layers.{i}.q_proj.lora_A.default.weight" for i in range(2)], shape=(2, 4))
    targets = adapters + _targets([f"layers.{i}.q_proj.base_layer.weight" for i in range(2)])
    with pytest.raises(CheckpointLoadError) as error:
        plan_load(targets, _specs(names), strict=True)
    message = str(error.value)
    assert (
        "`rename=lambda name: name.replace('.q_proj.', '.q_proj.base_layer.')`, 2 of the model's 4 tensors" in message
    )
    assert "The other 2 ('layers.0.q_proj.lora_A.default.weight', 'layers.1.q_proj.lora_A.default.weight')" in message


def test_what_the_advised_rename_does_not_load_is_named():
    """Tensors of the file that the model lacks, even after the rename, are named with the `strict=False` they need."""
    names = [f"layers.{i}.{part}.weight" for i in range(3) for part in ("attn", "block_sparse_moe")] + ["extra.weight"]
    targets = _targets([name.replace("block_sparse_moe", "mlp") for name in names if name != "extra.weight"])
    with pytest.raises(CheckpointLoadError) as error:
        plan_load(targets, _specs(names), strict=True)
    message = str(error.value)
    assert (
        "6 of the model's 6 tensors load. The file's 1 other tensor(s) ('extra.weight') are not in the model" in message
    )
    assert "add `strict=False` to ignore them" in message
