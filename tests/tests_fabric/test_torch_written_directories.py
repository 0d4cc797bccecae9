"""Sharded directories that torch writes itself, not Fabric: a raw module state dict in sharded form.

``dcp.save(model.state_dict())`` on two gloo ranks (a model sharded with ``fully_shard``), the same with torch's
``HuggingFaceStorageWriter`` without consolidation (safetensors files of slices whose headers give each slice's
offsets, and no index), and torch's converter ``torch_save_to_dcp`` write the module's own names, with no ``"model"``
entry. ``fabric.load(path, {"model": model})`` and ``fabric.load_raw(path, model)`` read them shard-locally, through
the validated sharded reader, with FSDP1 and FSDP2, every tensor exactly. The model has a submodule named ``model``
(as Hugging Face models do), so its own names start with the key that ``fabric.load`` is given: only where DCP says
each entry sat tells the two layouts apart.
"""

import os
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import CheckpointLoadError, FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.loading import loader
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state

_WORLD_SIZE = 2


class _Model(nn.Module):
    """A backbone under ``model`` and a head of 5 rows (3 and 2 over two ranks), as a Hugging Face model is laid out."""

    def __init__(self, head_rows: int = 5) -> None:
        super().__init__()
        self.model = TinyTransformer(depth=2)
        self.lm_head = nn.Linear(16, head_rows)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))


def _source_model() -> _Model:
    torch.manual_seed(0)
    model = _Model()
    with torch.no_grad():
        model.model.scale.uniform_()  # a buffer whose value differs from what `reset_parameters` gives
    return model


def _write_with_torch(directory: str) -> None:
    """On every rank, with torch alone: shard the model with ``fully_shard`` and save its state as torch does."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=_WORLD_SIZE)
    try:
        model = _source_model()
        if rank == 0:
            torch.save(model.state_dict(), f"{directory}/reference.pt")
            torch_save_to_dcp(f"{directory}/reference.pt", f"{directory}/torch_save_to_dcp")
        mesh = init_device_mesh("cpu", (_WORLD_SIZE,))
        for block in model.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dcp.save(model.state_dict(), checkpoint_id=f"{directory}/dcp_save")
        writer = HuggingFaceStorageWriter(f"{directory}/hf_storage_writer", save_distributed=True)
        dcp.save(model.state_dict(), storage_writer=writer)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[dict[str, str], str]:
    """The directories torch wrote, by how, and the consolidated file of the same state."""
    directory = tmp_path_factory.mktemp("torch_written")
    run_distributed(_write_with_torch, str(directory), devices=_WORLD_SIZE, timeout=120)
    paths = {name: str(directory / name) for name in ("dcp_save", "hf_storage_writer", "torch_save_to_dcp")}
    assert not any((Path(path) / "meta.pt").exists() for path in paths.values())  # not Fabric's
    # One file of slices per rank, and nothing else: no `.metadata`, no index.
    assert sorted(p.name for p in Path(paths["hf_storage_writer"]).iterdir()) == [
        f"shard-0000{rank + 1}-model-00001-of-00001.safetensors" for rank in range(_WORLD_SIZE)
    ]
    return paths, str(directory / "reference.pt")


def _fabric(kind: str) -> Fabric:
    if kind == "fsdp1":
        strategy = FSDPStrategy(auto_wrap_policy={Block})
    else:

        def parallelize(model: nn.Module, device_mesh) -> nn.Module:
            from torch.distributed.fsdp import fully_shard

            for block in model.model.blocks:
                fully_shard(block, mesh=device_mesh["data_parallel"])
            fully_shard(model, mesh=device_mesh["data_parallel"])
            return model

        strategy = ModelParallelStrategy(parallelize, data_parallel_size=_WORLD_SIZE, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=_WORLD_SIZE, strategy=strategy)
    fabric.launch()
    return fabric


def _fresh_model(fabric: Fabric, head_rows: int = 5) -> nn.Module:
    fabric.seed_everything(7)  # other weights than the source's
    return fabric.setup_module(_Model(head_rows))


def _load_every_way(kind: str, paths: dict[str, str], reference_path: str) -> list[str]:
    expected = torch.load(reference_path, weights_only=True)
    fabric = _fabric(kind)
    done = []
    for name, path in paths.items():
        for api in ("load", "load_raw"):
            model = _fresh_model(fabric)
            if api == "load":
                assert fabric.load(path, {"model": model}) == {}
            else:
                fabric.load_raw(path, model)
            assert not loader._warned_fallbacks, f"{name}, {api}: fell back: {loader._warned_fallbacks}"
            try:
                assert_same_state(gather_full_state(model)["model"], expected)
            except AssertionError as error:
                raise AssertionError(f"{kind}, {name}, {api}: {error}") from None
            done.append(f"{name} {api}")
    return done


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_directories_written_by_torch_load_exactly(written, kind):
    paths, reference_path = written
    results = run_distributed(_load_every_way, kind, paths, reference_path, devices=_WORLD_SIZE, timeout=240)
    assert results == [[f"{name} {api}" for name in paths for api in ("load", "load_raw")]] * _WORLD_SIZE


def _refusals(path: str) -> dict[str, str]:
    """The errors of a raw sharded directory are the validated reader's, and strict=False loads the weights alone."""
    fabric = _fabric("fsdp2")
    errors = {}
    model = _fresh_model(fabric, head_rows=6)
    before = {name: param.full_tensor() for name, param in model.named_parameters()}
    with pytest.raises(CheckpointLoadError) as error:
        fabric.load_raw(path, model)
    after = {name: param.full_tensor() for name, param in model.named_parameters()}
    assert all(torch.equal(before[name], after[name]) for name in before), "a failed load wrote the model"
    errors["shape"] = str(error.value)
    model = _fresh_model(fabric)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    with pytest.raises(CheckpointLoadError) as error:
        fabric.load(path, {"model": model, "optimizer": optimizer})
    errors["optimizer"] = str(error.value)
    assert fabric.load(path, {"model": model, "optimizer": optimizer}, strict=False) == {}
    expected = torch.load(f"{Path(path).parent}/reference.pt", weights_only=True)
    assert_same_state(gather_full_state(model)["model"], expected)
    return errors


def test_raw_sharded_directory_is_validated_like_a_fabric_one(written):
    paths, _ = written
    errors = run_distributed(_refusals, paths["dcp_save"], devices=_WORLD_SIZE, timeout=120)
    assert errors[0] == errors[1]
    assert "The sharded checkpoint does not match the model; nothing was loaded" in errors[0]["shape"]
    assert "'lm_head.weight': checkpoint shape (5, 16), model (6, 16)" in errors[0]["shape"]
    assert (
        "is a raw module state dict: it holds the model's weights only, not the requested 'optimizer'"
        in (errors[0]["optimizer"])
    )
