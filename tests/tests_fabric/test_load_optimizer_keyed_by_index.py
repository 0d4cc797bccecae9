"""An optimizer state saved without a strategy (keyed by parameter index) loads shard-locally into FSDP1 and FSDP2.

A run on one device saves ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}``: the optimizer's
state is keyed by the index of each parameter in ``model.parameters()``. Loaded into a sharded model, every parameter
gets its own state (sliced like the parameter), with ``use_orig_params`` either way, and the shard-local path serves
it (no fallback to FSDP's own loading, which failed after writing the model with ``use_orig_params=False``).
"""

import pytest
import torch
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.loading import loader
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer, make_batch
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state


def _fully_shard_blocks(model, device_mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _load(path: str, layout: str) -> bool:
    if layout == "fsdp2":
        strategy = ModelParallelStrategy(_fully_shard_blocks, data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = FSDPStrategy(auto_wrap_policy={Block}, use_orig_params=layout == "fsdp1")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=layout != "fsdp2"):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.5))
    loader._warned_fallbacks.clear()
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(path, state) == {}
    assert state["step"] == 2
    assert not loader._warned_fallbacks, loader._warned_fallbacks

    saved = torch.load(path, weights_only=True)
    names = [name for name, _ in TinyTransformer().named_parameters()]
    full = gather_full_state(model, optimizer)
    assert_same_state(full["model"], saved["model"])
    assert_same_state(full["optimizer"]["state"], {names[i]: value for i, value in saved["optimizer"]["state"].items()})
    assert optimizer.param_groups[0]["lr"] == 1e-2
    return True


@pytest.mark.parametrize("layout", ["fsdp1", "fsdp1-flat_params", "fsdp2"])
def test_optimizer_state_keyed_by_index_loads_shard_locally(tmp_path, layout):
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        inputs, targets = make_batch(step)
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path / "single_device.ckpt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 2}, path)
    assert run_distributed(_load, str(path), layout, devices=2) == [True, True]
