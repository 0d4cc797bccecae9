"""Mixture-of-Experts checkpoints (one tensor per expert) into transformers 5 models (fused experts), shard-locally.

``save_pretrained`` writes ``block_sparse_moe.experts.3.w1.weight`` and the like; the model holds
``mlp.experts.gate_up_proj`` (every expert's ``w1`` and ``w3``, stacked and concatenated) and ``mlp.experts.down_proj``.
The loader assembles them from the conversions the model declares, as ``from_pretrained`` does, and each rank reads
only the parts of the expert tensors that fall in its shard. Tiny random Mixtral and Qwen2-MoE models, written with
``save_pretrained``; the sharded model must hold exactly what ``from_pretrained`` gives.
"""

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_fsdp import CheckpointLoadError, FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.layouts.targets import TargetSpec
from lightning_fsdp.loading.conversions import ConvertedSource, build_composite, with_declared_conversions
from lightning_fsdp.loading.formats import detect_checkpoint, open_checkpoint
from lightning_fsdp.loading.sources import TensorSource, TensorSpec
from tests.tests_fabric.helpers.distributed import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping")

_VOCAB = 40


def _model_class(family: str) -> type:
    return {"mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM}[family]


def _config(family: str):
    common = {
        "vocab_size": _VOCAB,
        "hidden_size": 12,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_experts_per_tok": 2,
    }
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=10, num_local_experts=3, **common)
    return transformers.Qwen2MoeConfig(
        intermediate_size=14, moe_intermediate_size=6, shared_expert_intermediate_size=10, num_experts=3, **common
    )


def _save_pretrained(directory: Path, family: str) -> str:
    torch.manual_seed(0)
    _model_class(family)(_config(family)).save_pretrained(directory)
    return str(directory)


def _layer_class(family: str) -> type:
    model = _model_class(family)(_config(family))
    return type(model.model.layers[0])


def _parallelize(model: nn.Module, device_mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _full(model: nn.Module, layout: str) -> dict[str, torch.Tensor]:
    """The model's full state, gathered (FSDP1) or assembled from ``DTensor``\\ s (FSDP2)."""
    if layout == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            return {name: tensor.clone() for name, tensor in model.module.state_dict().items()}
    from torch.distributed.tensor import DTensor

    state = model.state_dict()
    return {
        k.removeprefix("_forward_module."): v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()
    }


def _load_and_compare(directory: str, family: str, layout: str) -> list[str]:
    """Load into an `empty_init` model and an ordinary one; the names of the tensors that differ from the reference."""
    if layout == "fsdp1":
        strategy = FSDPStrategy(auto_wrap_policy={_layer_class(family)})
    else:
        strategy = ModelParallelStrategy(_parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    reference = _model_class(family).from_pretrained(directory).state_dict()
    config = transformers.AutoConfig.from_pretrained(directory)
    differing = []
    for empty_init in (True, False):
        torch.manual_seed(1)
        with fabric.init_module(empty_init=empty_init):
            model = _model_class(family)(config)
        model = fabric.setup_module(model)
        fabric.load_raw(directory, model)
        loaded = _full(model, layout)
        assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight"} <= set(loaded)
        assert set(loaded) == set(reference), set(loaded) ^ set(reference)
        differing += [f"{empty_init}:{name}" for name in reference if not torch.equal(loaded[name], reference[name])]
    return differing


@pytest.mark.parametrize("layout", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_experts_load_like_from_pretrained(tmp_path, family, layout):
    """One tensor per expert into fused experts: bit-exact against `from_pretrained`, meta and ordinary init."""
    directory = _save_pretrained(tmp_path / family, family)
    assert "model.layers.0.mlp.experts.2.down_proj.weight" in load_file(f"{directory}/model.safetensors") or (
        "model.layers.0.block_sparse_moe.experts.2.w2.weight" in load_file(f"{directory}/model.safetensors")
    )
    assert run_distributed(_load_and_compare, directory, family, layout, devices=2) == [[], []]


class _Recording(TensorSource):
    """A real source that notes which elements of which checkpoint tensor are read."""

    def __init__(self, base: TensorSource) -> None:
        self.base = base
        self.reads: list[tuple[str, int, int]] = []

    def specs(self) -> Mapping[str, TensorSpec]:
        return self.base.specs()

    def read(self, name: str) -> torch.Tensor:
        self.reads.append((name, 0, self.base.specs()[name].numel))
        return self.base.read(name)

    def read_flat_into(self, name: str, start: int, out: torch.Tensor) -> None:
        self.reads.append((name, start, out.numel()))
        self.base.read_flat_into(name, start, out)

    def check_unchanged(self) -> None:
        self.base.check_unchanged()

    def close(self) -> None:
        self.base.close()


def _targets(model: nn.Module) -> list[TargetSpec]:
    return [TargetSpec((name,), tuple(t.shape), t.dtype) for name, t in model.state_dict().items()]


def test_a_slice_reads_only_the_experts_in_it(tmp_path):
    """A range of `gate_up_proj` reads only the ranges of the `w1` and `w3` tensors of the experts it covers."""
    directory = _save_pretrained(tmp_path / "mixtral", "mixtral")
    model = _model_class("mixtral")(_config("mixtral"))
    opened = open_checkpoint(detect_checkpoint(Path(directory)), None, True)
    recording = _Recording(opened.source)
    try:
        source = with_declared_conversions(model, recording, _targets(model))
        assert isinstance(source, ConvertedSource)
        name = "model.layers.1.mlp.experts.gate_up_proj"
        assert source.specs()[name] == TensorSpec((3, 20, 12), torch.float32)
        assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" not in source.specs()
        # Expert 1's `w3` rows 4 to 9, then expert 2's `w1` rows 0 to 2: (1, 14, 0) to (2, 3, 0) of the fused tensor.
        start, stop = (20 + 14) * 12, (2 * 20 + 3) * 12
        out = torch.empty(stop - start)
        source.read_flat_into(name, start, out)
        prefix = "model.layers.1.block_sparse_moe.experts"
        assert recording.reads == [(f"{prefix}.1.w3.weight", 4 * 12, 6 * 12), (f"{prefix}.2.w1.weight", 0, 3 * 12)]
        state = load_file(f"{directory}/model.safetensors")
        fused = torch.stack(
            [torch.cat([state[f"{prefix}.{e}.w1.weight"], state[f"{prefix}.{e}.w3.weight"]]) for e in range(3)]
        )
        assert torch.equal(out, fused.reshape(-1)[start:stop])
        assert torch.equal(source.read(name), fused)
    finally:
        opened.close()


def _refused(directory: str) -> str:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={_layer_class("mixtral")}))
    fabric.launch()
    config = _config("mixtral")
    config.num_local_experts = 4
    with fabric.init_module(empty_init=True):
        model = _model_class("mixtral")(config)
    model = fabric.setup_module(model)
    with pytest.raises(CheckpointLoadError) as error:
        fabric.load_raw(directory, model)
    return str(error.value)


def test_experts_of_another_configuration_are_refused_without_strict_false_advice(tmp_path):
    """3 experts in the file, 4 in the model: the missing expert is named, and `strict=False` is not offered."""
    directory = _save_pretrained(tmp_path / "mixtral", "mixtral")
    for message in run_distributed(_refused, directory, devices=2):
        assert (
            "'model.layers.0.mlp.experts.gate_up_proj': the model has 4 experts, the checkpoint 3 (checkpoint"
            " (3, 20, 12), model (4, 20, 12)); the checkpoint lacks"
            " 'model.layers.0.block_sparse_moe.experts.3.w1.weight',"
            " 'model.layers.0.block_sparse_moe.experts.3.w3.weight'" in message
        ), message
        assert "lacks 'model.layers.0.block_sparse_moe.experts.3.w2.weight'" in message
        assert "strict=False" not in message


def test_a_missing_expert_in_the_middle_is_named(tmp_path):
    """The file lacks expert 1 of 3 (a lost shard): the message names it, not only the counts."""
    directory = _save_pretrained(tmp_path / "mixtral", "mixtral")
    state = load_file(f"{directory}/model.safetensors")
    save_file({k: v for k, v in state.items() if ".experts.1." not in k}, f"{directory}/model.safetensors")
    model = _model_class("mixtral")(_config("mixtral"))
    opened = open_checkpoint(detect_checkpoint(Path(directory)), None, True)
    try:
        with pytest.raises(CheckpointLoadError, match=r"the model has 3 experts, the checkpoint 2") as error:
            with_declared_conversions(model, opened.source, _targets(model))
    finally:
        opened.close()
    assert "lacks 'model.layers.0.block_sparse_moe.experts.1.w1.weight'" in str(error.value)
    assert "experts.0.w1" not in str(error.value)


def _with_mixed_dtypes(directory: str) -> None:
    """Rewrite the file with the experts 1 of every layer in bf16 and the rest in float32."""
    path = f"{directory}/model.safetensors"
    state = load_file(path)
    save_file(
        {k: v.to(torch.bfloat16) if ".experts.1." in k else v for k, v in state.items()},
        path,
        metadata={"format": "pt"},
    )


def test_experts_in_mixed_dtypes_are_cast_to_the_models_dtype(tmp_path):
    """bf16 and float32 experts into a float32 model: each is cast, as `from_pretrained` casts them, bit-exact."""
    directory = _save_pretrained(tmp_path / "mixtral", "mixtral")
    _with_mixed_dtypes(directory)
    dtypes = {v.dtype for k, v in load_file(f"{directory}/model.safetensors").items() if ".experts." in k}
    assert dtypes == {torch.bfloat16, torch.float32}
    reference = _model_class("mixtral").from_pretrained(directory, dtype=torch.float32).state_dict()
    model = _model_class("mixtral")(_config("mixtral"))
    opened = open_checkpoint(detect_checkpoint(Path(directory)), None, True)
    try:
        source = with_declared_conversions(model, opened.source, _targets(model))
        name = "model.layers.0.mlp.experts.gate_up_proj"
        assert source.specs()[name] == TensorSpec((3, 20, 12), torch.float32)
        assert torch.equal(source.read(name), reference[name])
        assert torch.equal(source.read_flat(name, 250, 500), reference[name].reshape(-1)[250:500])
    finally:
        opened.close()
    # Sharded over two processes, every tensor as `from_pretrained` gives it.
    assert run_distributed(_load_and_compare, directory, "mixtral", "fsdp1", devices=2) == [[], []]


def test_a_transposed_piece_is_read_whole_and_transposed(tmp_path):
    """A declared `Transpose` (used by some families) places each checkpoint tensor transposed in the target."""
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    path = tmp_path / "experts.safetensors"
    experts = {f"experts.{e}.weight": torch.randn(3, 5) for e in range(2)}
    save_file(experts, path)

    opened = open_checkpoint(detect_checkpoint(path), None, True)
    try:
        converter = WeightConverter("experts.*.weight", "experts.fused", [MergeModulelist(dim=0), Transpose(1, 2)])

        source = ConvertedSource(
            opened.source,
            {
                "experts.fused": build_composite(
                    "experts.fused", converter, {"experts.*.weight": list(experts)}, opened.source.specs(), None
                )
            },
        )
        expected = torch.stack(list(experts.values())).transpose(1, 2)
        assert source.specs()["experts.fused"].shape == (2, 5, 3)
        assert torch.equal(source.read("experts.fused"), expected)
        assert torch.equal(source.read_flat("experts.fused", 7, 22), expected.reshape(-1)[7:22])
    finally:
        opened.close()


def test_an_operation_that_cannot_be_read_shard_locally_is_refused(tmp_path):
    """A declared `Interleave` is refused with the conversion named and a fix, never `strict=False`."""
    from transformers.core_model_loading import Interleave, WeightConverter

    specs = {"experts.w13_weight": TensorSpec((2, 8, 4), torch.float32)}
    converter = WeightConverter("experts.w13_weight", "experts.gate_up_proj", [Interleave(dim=1)])
    with pytest.raises(CheckpointLoadError, match=r"cannot read `Interleave\(dim=1\)` shard-locally") as error:
        build_composite("experts.gate_up_proj", converter, {"experts.w13_weight": list(specs)}, specs, None)
    assert "from_pretrained(path)" in str(error.value)
    assert "strict=False" not in str(error.value)


def test_a_transformers_model_inside_another_module_aligns_after_converting(tmp_path):
    """The conversions name the file's tensors as `from_pretrained` would; the usual prefix alignment then applies."""
    from lightning_fsdp.loading.validation import plan_load

    directory = _save_pretrained(tmp_path / "qwen2_moe", "qwen2_moe")
    wrapper = nn.Module()
    wrapper.model = _model_class("qwen2_moe")(_config("qwen2_moe"))  # as in a LightningModule
    targets = _targets(wrapper)
    opened = open_checkpoint(detect_checkpoint(Path(directory)), None, True)
    try:
        source = with_declared_conversions(wrapper, opened.source, targets)
        plan = plan_load(targets, source.specs(), strict=True)
    finally:
        opened.close()
    assert plan.aligned == {"": "model."}
    assert plan.sources["model.model.layers.1.mlp.experts.down_proj"] == "model.layers.1.mlp.experts.down_proj"
    assert len(plan.sources) == len(targets)


def _shard_experts_by_columns(model: nn.Module, device_mesh) -> nn.Module:
    """Tensor parallelism over the experts' last dimension: each rank's part is a strided box of every fused tensor."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    def partition(name: str, module: nn.Module, mesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(param.dim() - 1)]))
            module.register_parameter(param_name, sharded)

    for layer in model.model.layers:
        distribute_module(layer.mlp.experts, device_mesh["tensor_parallel"], partition)
    return model


def _load_tensor_parallel(directory: str) -> list[str]:
    from torch.distributed.tensor import DTensor

    strategy = ModelParallelStrategy(_shard_experts_by_columns, data_parallel_size=1, tensor_parallel_size=2)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    reference = _model_class("mixtral").from_pretrained(directory).state_dict()
    torch.manual_seed(1)
    model = fabric.setup_module(_model_class("mixtral")(transformers.AutoConfig.from_pretrained(directory)))
    experts = model.module.model.layers[0].mlp.experts.gate_up_proj
    assert isinstance(experts, DTensor)
    assert experts.to_local().shape == (3, 20, 6)
    fabric.load_raw(directory, model)
    loaded = _full(model, "fsdp2")
    return [name for name in reference if not torch.equal(loaded[name], reference[name])]


def test_experts_load_into_a_column_sharded_layout(tmp_path):
    """Each rank holds half of every expert row: strided runs over the fused tensor, one per row, from the pieces."""
    directory = _save_pretrained(tmp_path / "mixtral", "mixtral")
    assert run_distributed(_load_tensor_parallel, directory, devices=2) == [[], []]


def test_conversions_that_transformers_cannot_read_leave_the_names_as_they_are(tmp_path):
    """Declarations that raise inside transformers: one warning, and the file's names are matched as they are."""

    class _Config(transformers.PretrainedConfig):
        model_type = "checkpoint_loading_test_custom"

    class _Custom(transformers.PreTrainedModel):
        config_class = _Config

        def __init__(self) -> None:
            super().__init__(_Config())
            self.linear = nn.Linear(2, 2)

        def is_custom_code(self) -> bool:
            raise RuntimeError("the custom code cannot be found")

    path = tmp_path / "model.safetensors"
    model = _Custom()
    save_file(model.state_dict(), path)
    opened = open_checkpoint(detect_checkpoint(path), None, True)
    try:
        with pytest.warns(UserWarning, match=r"conversions that _Custom declares could not be read \(Runtime"):
            assert with_declared_conversions(model, opened.source, _targets(model)) is opened.source
    finally:
        opened.close()
