"""Hugging Face models created on the meta device (``empty_init=True``), set up and loaded on real processes.

A tiny random ``LlamaForCausalLM`` is written with ``save_pretrained``; the sharded model loaded from it must compute
what ``from_pretrained`` computes. The model has what made this path fail: norms without ``reset_parameters``, a
rotary embedding whose ``inv_freq`` is a non-persistent buffer (no checkpoint holds it), and a head tied to the
embedding (``tie_word_embeddings=True``), which the checkpoint holds once.
"""

import warnings

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import CheckpointLoadError, FSDPStrategy
from lightning_fsdp.layouts.targets import TargetSpec
from lightning_fsdp.loading.materialize import MetaMaterializer
from lightning_fsdp.loading.sources import TensorSpec
from lightning_fsdp.loading.validation import plan_load
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import TableModel, UninitializableTable, tiny_llama_config

transformers = pytest.importorskip("transformers")

_VOCAB = 64


def _save_pretrained(directory, tie: bool) -> str:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(tie, _VOCAB)).save_pretrained(directory)  # safetensors
    return str(directory)


def _strategy(**kwargs) -> FSDPStrategy:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, **kwargs)


def _load_and_compare(directory: str) -> dict:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=_strategy())
    fabric.launch()
    config = transformers.LlamaConfig.from_pretrained(directory)
    with fabric.init_module(empty_init=True):
        model = transformers.LlamaForCausalLM(config)
    model = fabric.setup_module(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load_raw(directory, model)

    reference = transformers.LlamaForCausalLM.from_pretrained(directory)
    tokens = torch.randint(0, _VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=1e-6, atol=1e-6)
    inner = model.module  # the LlamaForCausalLM inside `_FabricModule` and FSDP
    torch.testing.assert_close(inner.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq, rtol=0, atol=0)
    return {
        "tied": inner.lm_head.weight is inner.model.embed_tokens.weight,
        "warnings": [str(warning.message) for warning in caught if "nothing initialised" in str(warning.message)],
    }


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_empty_init_matches_from_pretrained(tmp_path, tie):
    """Norms and rotary buffers are initialised by the model's own init, ties are kept, the logits match."""
    directory = _save_pretrained(tmp_path / "llama", tie)
    results = run_distributed(_load_and_compare, directory, devices=2)
    assert results == [{"tied": tie, "warnings": []}] * 2


def _load_untied(directory: str) -> str:
    untie = lambda module: module.to_empty(device=torch.device("cpu"), recurse=False)  # noqa: E731
    fabric = Fabric(accelerator="cpu", devices=2, strategy=_strategy(param_init_fn=untie))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(directory))
    model = fabric.setup_module(model)
    try:
        fabric.load_raw(directory, model)
    except CheckpointLoadError as error:
        return str(error)
    return "loaded"


def test_missing_tied_copy_advises_retying(tmp_path):
    """A `param_init_fn` with `to_empty` unties the head: the error says to keep them tied, not `strict=False`."""
    directory = _save_pretrained(tmp_path / "llama", tie=True)
    messages = run_distributed(_load_untied, directory, devices=2)
    for message in messages:
        assert "1 missing key(s), in the model but not the checkpoint: 'lm_head.weight'" in message
        assert "ties 'lm_head.weight' to 'model.embed_tokens.weight'" in message
        assert "`model.tie_weights()`" in message
        assert "pass `strict=False`" not in message


def _load_custom(path: str) -> dict:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy())
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TableModel()
    model = fabric.setup_module(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load_raw(path, model)
    return {
        "warnings": [str(warning.message) for warning in caught if "nothing initialised" in str(warning.message)],
        "positions_nan": bool(model.module.table.positions.isnan().all()),
    }


def test_warns_about_a_buffer_that_nothing_initialised(tmp_path):
    """The checkpoint writes `table.weight` (no init path either); only the non-persistent buffer stays unset."""
    path = tmp_path / "model.pt"
    torch.save(TableModel().state_dict(), path)
    rank0, rank1 = run_distributed(_load_custom, str(path), devices=2)
    assert rank0["positions_nan"]
    assert rank1["positions_nan"]
    assert rank1["warnings"] == []  # rank 0 only
    (message,) = rank0["warnings"]
    assert "still holds 1 tensor(s) that nothing initialised: 'table.positions'" in message
    assert "reset_parameters()" in message


class _TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(8, 4)
        self.norm = UninitializableTable()
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embedding.weight


def test_materializer_keeps_ties_and_names_what_nothing_wrote():
    """Without FSDP: the materialiser allocates a shared tensor once and tracks writes through any initialisation."""
    with torch.device("meta"):
        model = _TiedModel()
    materializer = MetaMaterializer(model, torch.device("cpu"))
    for module in (model, model.embedding, model.norm, model.head):  # FSDP's order: parents before children
        materializer(module)
    assert model.head.weight is model.embedding.weight
    assert not model.head.weight.is_meta
    assert not model.head.weight.isnan().any()  # `nn.Embedding.reset_parameters` wrote it
    assert materializer.uninitialized() == {"norm.weight", "norm.positions"}
    assert model.norm.weight.isnan().all()
    assert model.norm.positions.isnan().all()


def test_missing_tied_copy_advice_in_plan():
    """The advice needs the tie, the partner in the checkpoint, and the same shape; otherwise `strict=False`."""
    targets = [
        TargetSpec(("lm_head.weight",), (8, 4), torch.float32),
        TargetSpec(("embed.weight",), (8, 4), torch.float32),
    ]
    specs = {"embed.weight": TensorSpec((8, 4), torch.float32)}
    with pytest.raises(CheckpointLoadError, match=r"ties 'lm_head.weight' to 'embed.weight'") as error:
        plan_load(targets, specs, strict=True, rename={}, ties={"lm_head.weight": ["embed.weight"]})
    assert "pass `strict=False`" not in str(error.value)
    leaving = r"leaving the model's 1 missing tensor\(s\) \('lm_head.weight'\) as they were, pass `strict=False`"
    with pytest.raises(CheckpointLoadError, match=rf"To load only the tensors that match, {leaving}"):
        plan_load(targets, specs, strict=True, rename={}, ties={})
    plan = plan_load(targets, specs, strict=False, rename={}, ties={"lm_head.weight": ["embed.weight"]})
    assert plan.missing == ["lm_head.weight"]
