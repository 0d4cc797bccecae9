"""Model-only export to one ``.safetensors`` file, every rank writing its own slices (``save_safetensors``)."""

from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from safetensors.torch import load_file

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.saving import save_safetensors
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer
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
