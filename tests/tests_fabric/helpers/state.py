"""Gather the full state of an FSDP1 or FSDP2 model and optimizer on every rank, to compare it bit-exact."""

from typing import Any

import torch
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.layouts.fsdp2 import has_dtensor_params


def gather_full_state(model: Module, optimizer: Optimizer | None = None) -> dict[str, Any]:
    """Return ``{"model": ..., "optimizer": ...}`` with unsharded CPU tensors, the same on every rank."""
    module = getattr(model, "_forward_module", model)
    if has_dtensor_params(module):
        return _gather_dtensor_state(module, optimizer)
    with FSDP.state_dict_type(
        module,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
    ):
        state: dict[str, Any] = {"model": _to_cpu(module.state_dict())}
        if optimizer is not None:
            optimizer = getattr(optimizer, "optimizer", optimizer)
            state["optimizer"] = _to_cpu(FSDP.optim_state_dict(module, optimizer))
    return state


def _gather_dtensor_state(module: Module, optimizer: Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    state: dict[str, Any] = {"model": _to_cpu(get_model_state_dict(module, options=options))}
    if optimizer is not None:
        optimizer = getattr(optimizer, "optimizer", optimizer)
        # A copy: the step counters are the optimizer's own tensors, which the next step increments.
        state["optimizer"] = _to_cpu(get_optimizer_state_dict(module, optimizer, options=options))
    return state


def assert_same_state(actual: Any, expected: Any, path: str = "") -> None:
    """Assert that two nested states hold bit-identical tensors and equal values, naming the first difference."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert torch.equal(actual.cpu(), expected.cpu()), f"{path}: values differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a dict, got {type(actual).__name__}"
        assert set(actual) == set(expected), f"{path}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{path}.{key}" if path else str(key))
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for index, (a, e) in enumerate(zip(actual, expected, strict=False)):
            assert_same_state(a, e, f"{path}[{index}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {key: _to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(value) for value in obj)
    return obj


def assert_identical(actual: Any, expected: Any, path: str = "") -> None:
    """Same types, same keys in the same order, same dtypes, shapes and bytes (NaN and -0.0 included)."""
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert actual.device == expected.device, path
        left, right = actual.contiguous().reshape(-1), expected.contiguous().reshape(-1)
        assert torch.equal(left.view(torch.uint8), right.view(torch.uint8)), f"{path}: bytes differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_identical(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_identical(a, e, f"{path}[{index}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
