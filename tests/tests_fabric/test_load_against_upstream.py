"""The same full checkpoint loaded by this package and by upstream's own `load_checkpoint`: the same result.

Each rank trains a model with Adam two steps (with a float `lr`, and with a tensor `lr` as compiled optimizers use),
saves a full Fabric checkpoint with metadata, then loads it into fresh objects twice through `fabric.load`: once with
this package's strategy, once with upstream's `load_checkpoint` body run on the same strategy object (upstream's
`FSDPStrategy` refuses the CPU, its method does not). Parameters, optimizer state and `param_groups` (as each rank holds
them), the metadata moved into `state` and the returned remainder must be identical, types, dtypes and devices
included (a tensor `lr` stays a tensor, a float a float); then one `optimizer.step()` must give the same parameters.
"""

from typing import Any
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy as UpstreamFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as UpstreamModelParallelStrategy
from torch import nn

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer, make_batch

_UPSTREAM = {FSDPStrategy: UpstreamFSDPStrategy, ModelParallelStrategy: UpstreamModelParallelStrategy}


def _parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _fabric(fsdp: int) -> Fabric:
    if fsdp == 1:
        strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
    else:
        strategy = ModelParallelStrategy(_parallelize, save_distributed_checkpoint=False)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def _make(fabric: Fabric, seed: int, tensor_lr: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    fabric.seed_everything(seed)
    model = fabric.setup_module(TinyTransformer())
    lr = torch.tensor(0.01) if tensor_lr else 0.01
    return model, fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=lr))


def _step(fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    inputs, targets = make_batch(step)
    loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def _local(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What this rank holds: its shards of the parameters, its optimizer state and param groups, as they are."""
    params = dict(model.named_parameters())
    names = {id(param): name for name, param in params.items()}
    return {
        "params": {name: param.detach().clone() for name, param in params.items()},
        "buffers": {name: buffer.clone() for name, buffer in model.named_buffers()},
        "state": {
            names[id(param)]: {
                key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in s.items()
            }
            for param, s in optimizer.state.items()
        },
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
    }


def _assert_identical(actual: Any, expected: Any, path: str = "") -> None:
    """Equal values of the same types; a tensor (or `DTensor`) of the same dtype, device, shape and placement.

    A tuple and a list compare equal: upstream's FSDP2 path returns Adam's `betas` tuple as a list (torch's
    distributed state-dict helpers rebuild the groups), where this package keeps the tuple that was saved.

    """
    if isinstance(expected, torch.Tensor):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__}, upstream {type(expected).__name__}"
        described, expected_described = (
            (tensor.dtype, tensor.device, tuple(tensor.shape)) for tensor in (actual, expected)
        )
        assert described == expected_described, f"{path}: {described}, upstream {expected_described}"
        if hasattr(expected, "placements"):
            assert actual.placements == expected.placements, f"{path}: {actual.placements}, upstream"
            actual, expected = actual.to_local(), expected.to_local()
        assert torch.equal(actual, expected), f"{path}: values differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {actual!r}, upstream {expected!r}"
        assert set(actual) == set(expected), f"{path}: keys {sorted(actual)}, upstream {sorted(expected)}"
        for key in expected:
            _assert_identical(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), f"{path}: {actual!r}, upstream {expected!r}"
        assert len(actual) == len(expected), f"{path}: {actual!r}, upstream {expected!r}"
        for index, (item, expected_item) in enumerate(zip(actual, expected, strict=True)):
            _assert_identical(item, expected_item, f"{path}[{index}]")
    else:
        assert type(actual) is type(expected), f"{path}: {actual!r}, upstream {expected!r}"
        assert actual == expected, f"{path}: {actual!r}, upstream {expected!r}"


def _load_and_step(fabric: Fabric, path: str, tensor_lr: bool, upstream: bool) -> dict[str, Any]:
    model, optimizer = _make(fabric, seed=2, tensor_lr=tensor_lr)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    strategy_class = type(fabric.strategy)
    # Through `fabric.load` either way: it unwraps the objects and copies the metadata back, for both.
    method = _UPSTREAM[strategy_class].load_checkpoint if upstream else strategy_class.load_checkpoint
    with mock.patch.object(strategy_class, "load_checkpoint", method):
        remainder = fabric.load(path, state)
    loaded = {**_local(model, optimizer), "metadata": {"step": state["step"]}, "remainder": remainder}
    _step(fabric, model, optimizer, 3)  # the optimizer works after the load
    return {"loaded": loaded, "stepped": _local(model, optimizer)}


def _compare_with_upstream(fsdp: int, directory: str) -> list[str]:
    fabric = _fabric(fsdp)
    compared = []
    for tensor_lr in (True, False):
        model, optimizer = _make(fabric, seed=1, tensor_lr=tensor_lr)
        for step in range(2):
            _step(fabric, model, optimizer, step)
        path = f"{directory}/fsdp{fsdp}-{'tensor' if tensor_lr else 'float'}-lr.ckpt"
        extra = {"schedule": torch.arange(3.0), "note": "warmup", "scale": torch.tensor(0.5, dtype=torch.bfloat16)}
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": torch.tensor(2), "extra": extra})

        ours = _load_and_step(fabric, path, tensor_lr, upstream=False)
        theirs = _load_and_step(fabric, path, tensor_lr, upstream=True)
        assert isinstance(ours["loaded"]["param_groups"][0]["lr"], torch.Tensor if tensor_lr else float)
        _assert_identical(ours, theirs, f"fsdp{fsdp}, {'tensor' if tensor_lr else 'float'} lr")
        compared.append("tensor lr" if tensor_lr else "float lr")
    return compared


@pytest.mark.parametrize("fsdp", [1, 2], ids=["fsdp1", "fsdp2"])
def test_full_checkpoint_with_adam_loads_as_upstream_loads_it(tmp_path, fsdp):
    results = run_distributed(_compare_with_upstream, fsdp, str(tmp_path), devices=2)
    assert results == [["tensor lr", "float lr"]] * 2
