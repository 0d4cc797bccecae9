"""Model-only export (``save_safetensors``), every rank writing its own slices: one ``.safetensors`` file, or a
Hugging Face directory (shards, index, configuration) as ``save_pretrained`` writes it."""

import errno
import json
import os
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric
from safetensors.torch import load_file

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.saving import CheckpointSaveError, save_safetensors
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer, tiny_llama_config
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state
from tests.tests_fabric.test_fsdp2 import _Model, _parallelize

# The gather-free save is an extension (#28): it is not carried upstream with the core.


def _fabric(layout: str) -> Fabric:
    if layout == "fsdp1":
        strategy = FSDPStrategy(auto_wrap_policy={Block})
        fabric = Fabric(accelerator="cpu", devices=3, strategy=strategy)
    else:
        strategy = ModelParallelStrategy(_parallelize(layout), data_parallel_size=2, tensor_parallel_size=2)
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    return fabric


def _model(layout: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyTransformer(tie_weights=True) if layout == "fsdp1" else _Model(tie_weights=True)


def _export_and_reload(path: str, layout: str) -> bool:
    fabric = _fabric(layout)
    model = fabric.setup_module(_model(layout, 1))
    expected = gather_full_state(model)["model"]
    save_safetensors(fabric, path, model)
    if fabric.global_rank == 0:
        exported = load_file(path)
        # every tensor once: the tied head is stored as the embedding, the name that comes first
        assert sorted(exported) == sorted(name for name in expected if name != "head.weight")
        for name, tensor in exported.items():
            assert tensor.dtype == expected[name].dtype
            assert torch.equal(tensor, expected[name]), name
    fabric.barrier()
    fresh = fabric.setup_module(_model(layout, 2))
    fabric.load_raw(path, fresh)
    assert_same_state(gather_full_state(fresh)["model"], expected)
    return True


@pytest.mark.parametrize(("layout", "devices"), [("fsdp1", 3), ("fsdp_tensor_parallel", 4)])
def test_safetensors_export_reads_back(tmp_path: Path, layout: str, devices: int) -> None:
    path = str(tmp_path / "model.safetensors")
    assert run_distributed(_export_and_reload, path, layout, devices=devices) == [True] * devices
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


# --------------------------------------------------------------------------------------------------------------------
# A directory as transformers' `save_pretrained` writes it: shards, `model.safetensors.index.json`, the configuration


def _llama_config(tie: bool):
    # 64 wide: the embedding and the MLP weights take 32 KiB each, which the shard sizes below are chosen around
    return tiny_llama_config(tie, vocab=128, hidden=64)


def _llama(tie: bool, source: str | None, seed: int) -> torch.nn.Module:
    """A tiny random Llama: loaded by ``from_pretrained`` from ``source``, or built from its configuration."""
    import transformers

    if source is not None:
        return transformers.LlamaForCausalLM.from_pretrained(source)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_llama_config(tie))


def _fully_shard_layers(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _llama_fabric(layout: str) -> Fabric:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if layout == "fsdp1":
        strategy = FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer})
        fabric = Fabric(accelerator="cpu", devices=3, strategy=strategy)
    else:
        strategy = ModelParallelStrategy(_fully_shard_layers, data_parallel_size=2, tensor_parallel_size=1)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def _export_directory(root: str, layout: str, tie: bool, source: str | None, max_shard_size: int | str) -> bool:
    import transformers
    from safetensors import safe_open

    fabric = _llama_fabric(layout)
    model = fabric.setup_module(_llama(tie, source, seed=1))
    expected = gather_full_state(model)["model"]
    exported = Path(root) / "exported"
    save_safetensors(fabric, exported, model, max_shard_size=max_shard_size)
    if fabric.global_rank == 0:
        # What save_pretrained writes for the same model, unsharded, in one process
        reference = Path(root) / "reference"
        _llama(tie, source, seed=1).save_pretrained(reference, max_shard_size=max_shard_size)
        files = sorted(p.name for p in exported.iterdir())
        assert files == sorted(p.name for p in reference.iterdir())
        shards = [name for name in files if name.startswith("model-")]
        assert len(shards) >= 3, files
        index = json.loads((exported / "model.safetensors.index.json").read_text())
        assert index == json.loads((reference / "model.safetensors.index.json").read_text())
        assert (exported / "model.safetensors.index.json").read_text() == (
            reference / "model.safetensors.index.json"
        ).read_text()
        assert json.loads((exported / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
        stored = {}
        for shard in shards:
            with safe_open(exported / shard, framework="pt") as file:
                for name in file.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    assert index["weight_map"][name] == shard
                    stored[name] = file.get_tensor(name)
        assert sorted(stored) == sorted(index["weight_map"])
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
        for name, tensor in stored.items():
            assert tensor.dtype == expected[name].dtype
            assert torch.equal(tensor, expected[name]), name
        loaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
        assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
        assert_same_state(loaded.state_dict(), expected)
    fabric.barrier()
    fresh = fabric.setup_module(_llama(tie, None, seed=2))
    fabric.load_raw(exported, fresh)
    assert_same_state(gather_full_state(fresh)["model"], expected)
    return True


@pytest.mark.parametrize(
    ("layout", "tie", "from_pretrained", "max_shard_size"),
    [
        ("fsdp1", True, False, "30KB"),  # the embedding and the MLP weights (32 KiB each) get shards of their own
        ("fsdp1", False, True, 100_000),  # loaded by from_pretrained: save_pretrained sorts the names first
        ("fsdp2", True, True, "30KB"),
        ("fsdp2", False, False, 100_000),
    ],
)
def test_hugging_face_directory_export(
    tmp_path: Path, layout: str, tie: bool, from_pretrained: bool, max_shard_size: int | str
) -> None:
    pytest.importorskip("transformers")
    source = None
    if from_pretrained:
        source = str(tmp_path / "source")
        _llama(tie, None, seed=1).save_pretrained(source)
    devices = 3 if layout == "fsdp1" else 2
    result = run_distributed(_export_directory, str(tmp_path), layout, tie, source, max_shard_size, devices=devices)
    assert result == [True] * devices
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def _export_with_failing_rank(path: str) -> str:
    fabric = _fabric("fsdp1")
    model = fabric.setup_module(_model("fsdp1", 1))
    failing = mock.patch("os.pwrite", side_effect=OSError(errno.EIO, os.strerror(errno.EIO)))
    with failing if fabric.global_rank == 1 else nullcontext():
        try:
            save_safetensors(fabric, path, model, max_shard_size=1000)
        except CheckpointSaveError as error:
            failure = str(error)
        else:
            failure = ""
    fabric.barrier()
    if fabric.global_rank == 0:
        assert sorted(p.name for p in Path(path).iterdir()) == ["earlier.txt"]
        assert (Path(path) / "earlier.txt").read_text() == "an earlier export"
        assert not [p.name for p in Path(path).parent.iterdir() if p.name.startswith(".")]
    fabric.barrier()
    save_safetensors(fabric, path, model, max_shard_size=1000)  # replaces the directory as a whole
    return failure


def test_failed_directory_export_leaves_the_earlier_directory(tmp_path: Path) -> None:
    path = tmp_path / "exported"
    path.mkdir()
    (path / "earlier.txt").write_text("an earlier export")
    failures = run_distributed(_export_with_failing_rank, str(path), devices=3)
    for failure in failures:
        assert "rank 1" in failure
        assert "Input/output error" in failure
    files = sorted(p.name for p in path.iterdir())
    assert "earlier.txt" not in files
    assert "model.safetensors.index.json" in files
    assert [p.name for p in tmp_path.iterdir()] == ["exported"]


@pytest.mark.parametrize("exchange", [True, False])
def test_directory_replaced_in_one_step_or_by_two_renames(tmp_path: Path, exchange: bool) -> None:
    from lightning_fsdp.saving import consolidated_write

    path, new = tmp_path / "exported", tmp_path / ".exported.1234.tmp"
    path.mkdir()
    (path / "earlier.txt").write_text("earlier")
    new.mkdir()
    (new / "model.safetensors").write_bytes(b"new")
    with mock.patch.object(consolidated_write, "_swap", return_value=False) if not exchange else nullcontext():
        consolidated_write._replace_directory(new, path)
    assert [p.name for p in path.iterdir()] == ["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["exported"]
    # A failing second rename puts the earlier directory back
    new.mkdir()
    renames = [None, OSError(errno.EIO, "injected"), None]
    swap_unavailable = mock.patch.object(consolidated_write, "_swap", return_value=False)
    with swap_unavailable, mock.patch("os.rename", side_effect=renames):
        with pytest.raises(OSError, match="injected"):
            consolidated_write._replace_directory(new, path)
        assert [call.args for call in os.rename.call_args_list] == [
            (path, path.with_name(".exported.1234.old")),
            (new, path),
            (path.with_name(".exported.1234.old"), path),
        ]


def _entries(model: torch.nn.Module) -> list:
    from lightning_fsdp.saving import export

    records: dict[int, int] = {}
    aliases: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        aliases.setdefault(id(tensor), []).append(name)
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [
        export.Entry(
            name,
            tuple(aliases[id(tensor)]),
            records.setdefault(id(tensor), len(records)),
            tensor.dtype,
            tuple(tensor.shape),
            name in parameters,
        )
        for name, tensor in state.items()
    ]


def test_export_plan_splits_as_huggingface_hub_and_refuses_converted_weights() -> None:
    """The plan alone, in one process: the split of `split_torch_state_dict_into_shards`, the size strings it parses,
    and a model whose weights transformers converts (Mixtral's experts) refused for a directory, not for one file."""
    transformers = pytest.importorskip("transformers")
    from huggingface_hub import split_torch_state_dict_into_shards

    from lightning_fsdp.saving import export

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config(tie=False))
    for size in ("30KB", "0.05MB", 16384, 10**9):
        layout = export.plan(_entries(model), model, export.parse_shard_size(size))
        split = split_torch_state_dict_into_shards(model.state_dict(), max_shard_size=size)
        assert {f.name: [name for name, _ in f.tensors] for f in layout.files} == split.filename_to_tensors
    with pytest.raises(ValueError, match="a number and a unit"):
        export.parse_shard_size("5GiB")
    config = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        num_local_experts=2,
    )
    mixtral = transformers.MixtralForCausalLM(config)
    with pytest.raises(export.ExportUnsupported, match="converted names"):
        export.plan(_entries(mixtral), mixtral, 10**9)
    assert export.plan(_entries(mixtral), mixtral, None).files[0].name == ""


def test_export_writes_every_dtype_under_the_name_safetensors_gives_it(tmp_path: Path) -> None:
    """One dtype table for the reader and the export; each name is the one `safetensors.torch.save_file` writes, and
    the export's plan takes float8 and uint16 tensors (the export's own table refused them; the gather-free writer's
    plan still refuses a dtype that `torch.save` names no storage class for, in either format)."""
    import json
    import struct

    from safetensors.torch import save_file

    from lightning_fsdp.loading import safetensors_header
    from lightning_fsdp.saving import export

    assert {name: dtype for dtype, name in export.DTYPES.items()} == safetensors_header.DTYPES
    tensors = {str(dtype): torch.zeros(2, dtype=dtype) for dtype in export.DTYPES}
    save_file(tensors, tmp_path / "all.safetensors")
    data = (tmp_path / "all.safetensors").read_bytes()
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    assert {key: header[key]["dtype"] for key in tensors} == {str(dtype): name for dtype, name in export.DTYPES.items()}

    model = torch.nn.Module()
    model.register_buffer("scale", torch.zeros(4, dtype=torch.float8_e4m3fn))
    model.register_buffer("ids", torch.zeros(3, dtype=torch.uint16))
    assert [tensors for file in export.plan(_entries(model), model, None).files for tensors in file.tensors] == [
        ("scale", 0),
        ("ids", 1),
    ]
