"""Train, save and load back with ``lightning_fsdp.FSDPStrategy`` on real processes (CPU/gloo, and CUDA)."""

from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer, make_batch
from tests.tests_fabric.helpers.runif import RunIf
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state

_CONFIGS = [
    pytest.param(
        state_dict_type,
        empty_init,
        use_orig_params,
        id=f"{state_dict_type}-empty{empty_init:d}-orig{use_orig_params:d}",
    )
    for state_dict_type in ("full", "sharded")
    for empty_init in (False, True)
    for use_orig_params in (True, False)
]


def _train_save_and_reload(accelerator: str, devices: int, checkpoint_dir: str, configs: list[tuple]) -> int:
    """For each configuration: train 3 steps, save, load into a fresh model and optimizer, compare bit-exact."""
    for index, (state_dict_type, empty_init, use_orig_params) in enumerate(configs):
        strategy = FSDPStrategy(
            auto_wrap_policy={Block}, state_dict_type=state_dict_type, use_orig_params=use_orig_params
        )
        fabric = Fabric(accelerator=accelerator, devices=devices, strategy=strategy)
        fabric.launch()
        fabric.seed_everything(1234)
        model, optimizer = _make_model_and_optimizer(fabric, empty_init)
        for step in range(3):
            inputs, targets = make_batch(step)
            logits = model(inputs.to(fabric.device))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.to(fabric.device).flatten())
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        expected = gather_full_state(model, optimizer)

        path = fabric.broadcast(f"{checkpoint_dir}/checkpoint-{index}.ckpt")
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})

        fabric.seed_everything(999)  # the fresh model starts from different weights
        fresh_model, fresh_optimizer = _make_model_and_optimizer(fabric, empty_init)
        state = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
        remainder = fabric.load(path, state)
        assert state["step"] == 3
        assert remainder == {}
        assert_same_state(gather_full_state(fresh_model, fresh_optimizer), expected)
    return len(configs)


def _make_model_and_optimizer(fabric: Fabric, empty_init: bool) -> tuple:
    with fabric.init_module(empty_init=empty_init):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    optimizer = fabric.setup_optimizers(optimizer)
    return model, optimizer


# One rank (FSDP does not shard) and two; four ranks are covered by the two-node runs of
# test_full_checkpoint_configs.py and test_two_nodes.py, and took ~35 s of the suite here.
@pytest.mark.parametrize("devices", [1, 2])
def test_roundtrip_cpu(tmp_path, devices):
    configs = [param.values for param in _CONFIGS]
    results = run_distributed(_train_save_and_reload, "cpu", devices, str(tmp_path), configs, devices=devices)
    assert results == [len(configs)] * devices


@RunIf(min_cuda_gpus=2, standalone=True)
@pytest.mark.parametrize(("state_dict_type", "empty_init", "use_orig_params"), _CONFIGS)
def test_roundtrip_cuda(tmp_path, state_dict_type, empty_init, use_orig_params):
    config = [(state_dict_type, empty_init, use_orig_params)]
    results = run_distributed(_train_save_and_reload, "cuda", 2, str(tmp_path), config, devices=2, start_method="spawn")
    assert results == [1, 1]


def _load_sharded_with_cuda_tagged_metadata(checkpoint_dir: str) -> str:
    from tests.tests_fabric.helpers.checkpoints import retag_storages

    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    model, optimizer = _make_model_and_optimizer(fabric, empty_init=True)
    inputs, _ = make_batch(0)
    fabric.backward(model(inputs).sum())
    optimizer.step()
    fabric.save(checkpoint_dir, {"model": model, "optimizer": optimizer, "step": torch.tensor(3)})
    if fabric.global_rank == 0:
        # As if the checkpoint had been written on a GPU machine: `meta.pt` records its storages on `cuda:0`.
        retag_storages(Path(checkpoint_dir) / "meta.pt", "cpu", "cuda:0")
    fabric.barrier()
    state = {"model": model, "optimizer": optimizer, "step": None}
    fabric.load(checkpoint_dir, state)
    return str(state["step"].device)


def test_sharded_checkpoint_metadata_saved_on_cuda_loads_on_cpu(tmp_path):
    """Upstream reads `meta.pt` without `map_location`; here its storages go to the CPU whatever they recorded.

    This machine has no GPU: the file's device tags are rewritten to what `torch.save` records on `cuda:0`.
    """
    assert run_distributed(_load_sharded_with_cuda_tagged_metadata, str(tmp_path / "sharded"), devices=2) == [
        "cpu",
        "cpu",
    ]
