"""Models created on the meta device (``empty_init=True``) under FSDP2 (``ModelParallelStrategy``), on real processes.

Upstream materialises what ``parallelize_fn`` left on the meta device with ``to_empty()`` and ``reset_parameters()``,
which leaves a Hugging Face model's norms and its rotary embedding's ``inv_freq`` (a non-persistent buffer that no
checkpoint holds) as arbitrary memory. Here the model's own initialisation runs on the sharded ``DTensor`` parameters:
a tiny random ``LlamaForCausalLM`` must hold what the same model built without meta holds where that is not random,
keep its head tied to its embedding, and after loading a checkpoint compute what ``from_pretrained`` computes.
"""

import warnings

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import ModelParallelStrategy
from lightning_fsdp.loading.materialize import MetaMaterializer, init_record
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import TableModel, tiny_llama_config

transformers = pytest.importorskip("transformers")

_VOCAB = 64
_PAD = 3  # a padding row: both nn.Embedding and Hugging Face zero it


def _parallelize(layout: str):
    def parallelize(model: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if layout == "tensor_parallel":  # the MLPs split across the two ranks, the rest replicated
            plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
            for layer in model.model.layers:
                parallelize_module(layer.mlp, device_mesh["tensor_parallel"], plan)
            return model
        for layer in model.model.layers:
            fully_shard(layer, mesh=device_mesh["data_parallel"])
        fully_shard(model, mesh=device_mesh["data_parallel"])
        return model

    return parallelize


def _fabric(layout: str) -> Fabric:
    data_parallel_size = 1 if layout == "tensor_parallel" else 2
    strategy = ModelParallelStrategy(
        _parallelize(layout), data_parallel_size=data_parallel_size, tensor_parallel_size=2 // data_parallel_size
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _set_up_and_load(directory: str, layout: str, tie: bool) -> dict:
    fabric = _fabric(layout)
    with fabric.init_module(empty_init=True):
        model = transformers.LlamaForCausalLM(tiny_llama_config(tie, _VOCAB, _PAD))
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as collectives:  # a collective here would mean gathering a parameter whole
        model = fabric.setup_module(model)
    inner = model.module
    built_without_meta = transformers.LlamaForCausalLM(tiny_llama_config(tie, _VOCAB, _PAD))

    after_setup = {
        "collectives_in_setup": {str(op): count for op, count in collectives.get_comm_counts().items()},
        "inv_freq_exact": torch.equal(inner.model.rotary_emb.inv_freq, built_without_meta.model.rotary_emb.inv_freq),
        "norms_are_ones": all(
            bool((_local(module.weight) == 1).all())
            for module in inner.modules()
            if type(module).__name__ == "LlamaRMSNorm"
        ),
        "padding_row_zero": bool((_full(inner.model.embed_tokens.weight)[_PAD] == 0).all()),
        "nan": sorted(name for name, tensor in inner.state_dict().items() if _local(tensor).isnan().any()),
        "uninitialized": sorted(record.uninitialized) if (record := init_record(inner)) is not None else None,
        "tied": inner.lm_head.weight is inner.model.embed_tokens.weight,
        # A DTensor is materialised as its shard: the ranks' local elements add up to the whole, none holds it all.
        "local_numel": {
            name: (_local(param).numel(), param.numel())
            for name, param in inner.named_parameters()
            if _local(param) is not param
        },
    }

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load_raw(directory, model)
    reference = transformers.LlamaForCausalLM.from_pretrained(directory)
    tokens = torch.randint(0, _VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, expected = model(tokens).logits, reference(tokens).logits
    return {
        **after_setup,
        "logits_max_difference": (logits - expected).abs().max().item(),
        "tied_after_load": inner.lm_head.weight is inner.model.embed_tokens.weight,
        "warnings": [str(warning.message) for warning in caught if "nothing initialised" in str(warning.message)],
    }


@pytest.mark.parametrize(
    ("layout", "tie"), [("fsdp", True), ("fsdp", False), ("tensor_parallel", True)], ids=["fsdp-tied", "fsdp", "tp"]
)
def test_empty_init_initialises_like_the_model_and_loads_exactly(tmp_path, layout, tie):
    """After setup: `inv_freq` as without meta, norms one, the padding row zero, nothing NaN, ties kept, every
    `DTensor` a shard and none gathered whole; after loading a `save_pretrained` checkpoint, `from_pretrained`'s
    logits."""
    torch.manual_seed(0)
    # safetensors; tied: the head once
    transformers.LlamaForCausalLM(tiny_llama_config(tie, _VOCAB, _PAD)).save_pretrained(tmp_path)
    results = run_distributed(_set_up_and_load, str(tmp_path), layout, tie, devices=2)
    for result in results:
        assert result["collectives_in_setup"] == {}
        assert result["inv_freq_exact"]
        assert result["norms_are_ones"]
        assert result["padding_row_zero"]
        assert result["nan"] == []
        assert result["uninitialized"] == []
        assert result["tied"] is tie
        assert result["tied_after_load"] is tie
        # FSDP2 gathers whole parameters and computes as the unsharded model does: bit for bit. Tensor parallelism
        # sums partial products across ranks, in another order: float32 rounding only.
        assert result["logits_max_difference"] <= (0.0 if layout == "fsdp" else 1e-6)
        assert result["warnings"] == []
    sharded = results[0]["local_numel"]
    assert sharded  # FSDP2 shards every parameter, tensor parallelism the MLPs'
    for name, (_, numel) in sharded.items():
        assert sum(result["local_numel"][name][0] for result in results) == numel, name
        assert all(result["local_numel"][name][0] < numel for result in results), name


def _shard_all(model: nn.Module, device_mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _materialize_in_parallelize(model: nn.Module, device_mesh) -> nn.Module:
    """The user's own materialisation: `parallelize_fn` leaves nothing on the meta device."""
    model = _shard_all(model, device_mesh)
    model.to_empty(device=torch.device("cpu"))
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.fill_(0.5)
    return model


def _load_partially(path: str, parallelize_fn) -> dict:
    strategy = ModelParallelStrategy(parallelize_fn, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TableModel()
    model = fabric.setup_module(model)
    table = model.module.table
    nan_after_setup = {
        "weight": bool(_local(table.weight).isnan().all()),
        "positions": bool(table.positions.isnan().all()),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(path, {"model": model}, strict=False)  # the checkpoint holds `linear` only
    return {
        "nan_after_setup": nan_after_setup,
        "linear": _full(model.module.linear.weight).tolist(),
        "positions": table.positions.tolist(),
        "warnings": [str(warning.message) for warning in caught if "nothing initialised" in str(warning.message)],
    }


def test_load_that_leaves_a_tensor_unwritten_warns_naming_it(tmp_path):
    """What nothing initialised is NaN after setup; a load that does not write it either warns (rank 0), naming it."""
    path = tmp_path / "linear.pt"
    torch.save({f"linear.{name}": tensor for name, tensor in nn.Linear(4, 4).state_dict().items()}, path)
    rank0, rank1 = run_distributed(_load_partially, str(path), _shard_all, devices=2)
    for result in (rank0, rank1):
        assert result["nan_after_setup"] == {"weight": True, "positions": True}
    assert rank1["warnings"] == []  # rank 0 only
    (message,) = rank0["warnings"]
    assert "still holds 2 tensor(s) that nothing initialised: 'table.positions', 'table.weight'" in message


def test_model_that_parallelize_fn_materialised_is_left_alone(tmp_path):
    """`parallelize_fn` materialised and initialised the model itself: its values stay, and no load warns."""
    path = tmp_path / "linear.pt"
    torch.save({f"linear.{name}": tensor for name, tensor in nn.Linear(4, 4).state_dict().items()}, path)
    for result in run_distributed(_load_partially, str(path), _materialize_in_parallelize, devices=2):
        assert result["nan_after_setup"] == {"weight": False, "positions": False}
        assert result["positions"] == [0.5] * 4
        assert result["warnings"] == []


def test_materializer_keeps_what_the_user_materialised():
    """Without processes: a module's tensor that is materialised already keeps its values; its meta siblings are
    initialised by the module's `reset_parameters()`."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    model[0].weight = nn.Parameter(torch.full((4, 4), 0.5))
    materializer = MetaMaterializer(model, torch.device("cpu"))
    materializer.materialize(model)
    assert torch.equal(model[0].weight, torch.full((4, 4), 0.5))
    assert not model[0].bias.is_meta
    assert not model[0].bias.isnan().any()
    assert materializer.uninitialized() == set()
