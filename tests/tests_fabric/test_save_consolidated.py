"""Full checkpoints written by every rank (``lightning_fsdp.saving``), compared with Lightning's gathered save."""

import zipfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

import lightning_fsdp.saving
from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer, make_batch
from tests.tests_fabric.helpers.state import assert_identical, assert_same_state, gather_full_state
from tests.tests_fabric.test_fsdp2 import _Model, _parallelize

# The gather-free save is an extension (#28): it is not carried upstream with the core.


class _Tail(nn.Module):
    """A unit of two elements: over three ranks, the last rank's shard of it is empty."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, 0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.sum()


class _Model1(TinyTransformer):
    def __init__(self, tie_weights: bool) -> None:
        super().__init__(vocab=37, width=16, depth=2, tie_weights=tie_weights)
        self.tail = _Tail()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tail(super().forward(tokens))


def _gathered_save(fabric: Fabric, path: str, state: dict) -> None:
    """Lightning's own full save (the strategy's parent path), for reference."""
    with mock.patch.object(lightning_fsdp.saving, "save_full_checkpoint", return_value=False):
        fabric.save(path, state)


def _save_without_gather(fabric: Fabric, path: str, state: dict) -> None:
    """``fabric.save``, checking that the ranks wrote the file themselves (no fallback to the gather)."""
    outcomes = []
    real_save = lightning_fsdp.saving.save

    def save(*args: Any) -> Any:
        outcomes.append(real_save(*args))
        return outcomes[-1]

    with mock.patch.object(lightning_fsdp.saving, "save", save):
        fabric.save(path, state)
    assert outcomes == [None], outcomes  # written, not handed to the gather (which returns the reason)


def _train(fabric: Fabric, model: nn.Module, optimizer: Any, steps: int = 2) -> None:
    for step in range(steps):
        inputs, targets = make_batch(step)
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def _compare_files(ours: str, reference: str) -> None:
    with zipfile.ZipFile(ours) as archive:
        assert archive.testzip() is None  # every record's CRC-32 holds
    actual, expected = torch.load(ours, weights_only=True), torch.load(reference, weights_only=True)
    assert_identical(actual, expected)
    model_key = next(key for key, value in expected.items() if isinstance(value, dict) and "optimizer" not in key)
    if hasattr(expected[model_key], "_metadata"):
        assert actual[model_key]._metadata == expected[model_key]._metadata
    # Lightning's own lazy reader (what `fabric.load` uses for a full file) reads the same
    from lightning.fabric.utilities.load import _lazy_load, _materialize_tensors

    assert_identical(_materialize_tensors(_lazy_load(ours)), _materialize_tensors(_lazy_load(reference)))


def _fsdp1_configs(checkpoint_dir: str, configs: list[tuple[bool, bool, str]]) -> int:
    for index, (use_orig_params, tie, precision) in enumerate(configs):
        strategy = FSDPStrategy(
            auto_wrap_policy={Block, _Tail}, state_dict_type="full", use_orig_params=use_orig_params
        )
        fabric = Fabric(accelerator="cpu", devices=3, strategy=strategy, precision=precision)
        fabric.launch()
        fabric.seed_everything(1)
        with fabric.init_module():
            model = _Model1(tie)
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01)))
        _train(fabric, model, optimizer)
        expected = gather_full_state(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "step": 2, "hparams": {"lr": 0.01, "name": "x"}}
        ours, reference = f"{checkpoint_dir}/ours-{index}.ckpt", f"{checkpoint_dir}/reference-{index}.ckpt"
        _save_without_gather(fabric, ours, state)
        _gathered_save(fabric, reference, state)
        if fabric.global_rank == 0:
            _compare_files(ours, reference)
        fabric.barrier()
        # this package's loader restores the same model and optimizer
        fabric.seed_everything(2)
        with fabric.init_module():
            fresh = _Model1(tie)
        fresh = fabric.setup_module(fresh)
        fresh_optimizer = fabric.setup_optimizers(torch.optim.Adam(fresh.parameters(), lr=torch.tensor(0.5)))
        loaded = {"model": fresh, "optimizer": fresh_optimizer, "step": 0, "hparams": None}
        fabric.load(ours, loaded)
        assert loaded["step"] == 2
        assert_same_state(gather_full_state(fresh, fresh_optimizer), expected)
    return len(configs)


@pytest.mark.parametrize(
    "configs",
    [
        pytest.param([(True, False, "32-true"), (False, True, "32-true")], id="orig-untied-and-flat-tied"),
        pytest.param([(True, True, "bf16-true"), (False, False, "bf16-true")], id="bf16"),
    ],
)
def test_fsdp1_full_save_matches_lightning(tmp_path: Path, configs: list) -> None:
    assert run_distributed(_fsdp1_configs, str(tmp_path), configs, devices=3) == [len(configs)] * 3


def _fsdp2_configs(checkpoint_dir: str, layouts: list[str]) -> int:
    for index, layout in enumerate(layouts):
        data_parallel = {"tensor_parallel": 1, "fsdp_tensor_parallel": 2, "hsdp": 2}.get(layout, 4)
        strategy = ModelParallelStrategy(
            _parallelize(layout),
            data_parallel_size=data_parallel,
            tensor_parallel_size=4 // data_parallel,
            save_distributed_checkpoint=False,
        )
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
        fabric.launch()
        fabric.seed_everything(1)
        tie = layout == "fsdp"
        model = fabric.setup_module(_Model(tie_weights=tie))
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01)))
        _train(fabric, model, optimizer)
        expected = gather_full_state(model, optimizer)
        state = {"step": 2, "model": model, "optimizer": optimizer}
        ours, reference = f"{checkpoint_dir}/ours-{index}.ckpt", f"{checkpoint_dir}/reference-{index}.ckpt"
        _save_without_gather(fabric, ours, state)
        _gathered_save(fabric, reference, state)
        if fabric.global_rank == 0:
            _compare_files(ours, reference)
        fabric.barrier()
        fabric.seed_everything(2)
        fresh = fabric.setup_module(_Model(tie_weights=tie))
        fresh_optimizer = fabric.setup_optimizers(torch.optim.Adam(fresh.parameters(), lr=torch.tensor(0.5)))
        loaded = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
        fabric.load(ours, loaded)
        assert_same_state(gather_full_state(fresh, fresh_optimizer), expected)
    return len(layouts)


@pytest.mark.parametrize(
    "layouts",
    [
        pytest.param(["tensor_parallel"], id="tp"),
        pytest.param(["fsdp", "tensor_parallel", "fsdp_tensor_parallel", "hsdp"], id="all"),
    ],
)
def test_fsdp2_full_save_matches_lightning(tmp_path: Path, layouts: list[str]) -> None:
    assert run_distributed(_fsdp2_configs, str(tmp_path), layouts, devices=4) == [len(layouts)] * 4


def _save_twice(path: str) -> list[str]:
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    # the logger that `rank_zero_info` writes to (Lightning points it at its own, `lightning.pytorch` or `.fabric`)
    from lightning_utilities.core import rank_zero

    rank_zero.log.addHandler(handler)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type="full"))
    fabric.launch()
    model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)))
    fabric.save(f"{path}.1", {"model": model})
    fabric.save(f"{path}.2", {"model": model})
    return [message for message in said if "without a gather" in message]


def test_the_first_gather_free_save_says_how_it_was_written(tmp_path: Path) -> None:
    said = run_distributed(_save_twice, str(tmp_path / "model.ckpt"), devices=2)
    assert len(said[0]) == 1, said  # rank 0, once
    assert said[1] == []
    expected = f"Saved the full checkpoint '{tmp_path / 'model.ckpt'}.1' without a gather: each of the 2 ranks"
    assert expected in said[0][0]
