"""Restore an optimizer over an FSDP model from a full (unsharded) optimizer state, keeping only this rank's slices.

A full optimizer state, as ``FSDP.optim_state_dict`` writes it into a Fabric full checkpoint, keys each state by the
parameter's name and holds per-parameter tensors (Adam's ``exp_avg``, SGD's ``momentum_buffer``) at the parameter's
full shape. Each rank slices them exactly like the parameter, so the full optimizer state is never held on a rank.
Everything else is restored as the optimizer holds it: scalar states (Adam's ``step``) and tensor hyperparameters of
the parameter groups (``lr=torch.tensor(0.01)``) as tensors, never as the loader's lazy references.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.shard_local import ModuleTargets, OptimizerParam, ShardLocalUnsupported, Target
from lightning_fsdp.loading.sources import TensorRef, materialize


def local_optimizer_state(optimizer: Optimizer, collected: ModuleTargets, full_state: Mapping[str, Any]) -> dict:
    """Build the state dict that ``optimizer.load_state_dict`` takes on this rank, from a full optimizer state.

    Raises:
        ShardLocalUnsupported: For state this path cannot slice (integer-keyed states): the caller falls back to
            FSDP's own optimizer-state loading.
        CheckpointLoadError: If the checkpoint's optimizer does not match this optimizer (param groups, names), or a
            state tensor is neither a scalar nor of its parameter's shape.

    """
    state = full_state.get("state")
    groups = full_state.get("param_groups")
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        raise CheckpointLoadError(
            "The checkpoint's optimizer entry is not an optimizer state dict (it needs `state` and `param_groups`)."
        )
    if any(not isinstance(key, str) for key in state):
        raise ShardLocalUnsupported("the optimizer state is keyed by parameter index, not by parameter name")
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointLoadError(
            f"The checkpoint's optimizer has {len(groups)} parameter group(s), this optimizer has"
            f" {len(optimizer.param_groups)}. Create the optimizer with the same groups as the one that was saved."
        )

    local_state: dict[int, dict[str, Any]] = {}
    local_groups = []
    index = 0
    for saved_group, group in zip(groups, optimizer.param_groups, strict=True):
        indices = []
        for param in group["params"]:
            optimizer_param = collected.optimizer_params.get(id(param))
            if optimizer_param is None:
                raise ShardLocalUnsupported("the optimizer holds a parameter that is not part of the model")
            param_state = _param_state(state, optimizer_param) if optimizer_param.has_state else {}
            if param_state:
                local_state[index] = param_state
            indices.append(index)
            index += 1
        local_groups.append({**_hyperparameters(saved_group, group), "params": indices})
    return {"state": local_state, "param_groups": local_groups}


def _hyperparameters(saved_group: Mapping[str, Any], group: Mapping[str, Any]) -> dict[str, Any]:
    """A saved parameter group's settings, read: a tensor (``lr``) on the device of the optimizer's own, else the CPU.

    ``Optimizer.load_state_dict`` moves the per-parameter state to its parameter's device but takes the groups' values
    as they are, so a tensor setting must arrive read and placed: the lazy reference would fail the first ``step()``.

    """
    return {
        key: _placed_like(materialize(value), group.get(key)) for key, value in saved_group.items() if key != "params"
    }


def _placed_like(value: Any, current: Any) -> Any:
    """``value`` with each tensor on the device of the tensor at the same place in ``current`` (betas, a tuple)."""
    if isinstance(value, Tensor) and isinstance(current, Tensor):
        return value.to(current.device)
    if isinstance(value, (list, tuple)) and isinstance(current, (list, tuple)) and len(value) == len(current):
        return type(value)(_placed_like(item, now) for item, now in zip(value, current, strict=True))
    return value


def _param_state(state: Mapping[str, Any], param: OptimizerParam) -> dict[str, Any]:
    """The state of one optimizer parameter: scalars as saved, per-element tensors assembled from its runs."""
    saved_states = [(target, runs, _saved_state(state, target)) for target, runs in param.parts]
    present = [(target, runs, saved) for target, runs, saved in saved_states if saved is not None]
    if not present:
        return {}
    if len(present) != len(saved_states):
        absent = [target.names[0] for target, _, saved in saved_states if saved is None]
        raise CheckpointLoadError(
            f"The checkpoint's optimizer state has no entry for {absent[0]!r} but has one for"
            f" {present[0][0].names[0]!r} of the same FSDP unit; the optimizer state is incomplete."
        )
    first_target, _, first_saved = present[0]
    keys = set(first_saved)
    for target, _, saved in present:
        if set(saved) != keys:
            raise CheckpointLoadError(
                f"The checkpoint's optimizer state of {target.names[0]!r} has the entries {sorted(saved)}, that of"
                f" {first_target.names[0]!r} has {sorted(keys)}; the optimizer state is inconsistent."
            )
        for key, value in saved.items():
            _check_state_shape(key, value, target)
    # Elements no run writes (the padding of an FSDP1 flat shard) must be zero; filling the rest first would only
    # write every element twice.
    covered = sum(run.count for _, runs in param.parts for run in runs) == param.numel
    allocate = torch.empty if covered else torch.zeros
    local: dict[str, Any] = {}
    for key, first in first_saved.items():
        if not _is_per_element(first, first_target):
            local[key] = materialize(first)
            continue
        flat = allocate(param.numel, dtype=first.dtype)
        for target, runs, saved in present:
            value = saved[key]
            if not _is_per_element(value, target):
                raise CheckpointLoadError(
                    f"The checkpoint's optimizer state {key!r} is per element for {first_target.names[0]!r} but not"
                    f" for {target.names[0]!r} of the same FSDP unit; the optimizer state is inconsistent."
                )
            for run in runs:
                _copy_flat_range(value, run.start, flat[run.offset : run.offset + run.count])
        local[key] = param.to_state(flat)
    return local


def _saved_state(state: Mapping[str, Any], target: Target) -> Mapping[str, Any] | None:
    for name in target.names:
        if name in state:
            saved = state[name]
            if not isinstance(saved, Mapping):
                raise CheckpointLoadError(
                    f"The checkpoint's optimizer state of {name!r} is a {type(saved).__name__}, not a dict of states."
                )
            return saved
    return None


def _check_state_shape(key: str, value: Any, target: Target) -> None:
    """A tensor state is a scalar (Adam's ``step``) or has its parameter's shape (``exp_avg``); nothing else loads."""
    if isinstance(value, (Tensor, TensorRef)) and value.dim() > 0 and tuple(value.shape) != target.shape:
        raise CheckpointLoadError(
            f"The checkpoint's optimizer state {key!r} of {target.names[0]!r} has shape {tuple(value.shape)}, but the"
            f" parameter has shape {target.shape}. The optimizer state belongs to another model; nothing was loaded."
        )


def _is_per_element(value: Any, target: Target) -> bool:
    return isinstance(value, (Tensor, TensorRef)) and value.dim() > 0 and tuple(value.shape) == target.shape


def _copy_flat_range(value: Tensor | TensorRef, start: int, out: Tensor) -> None:
    """Write ``out.numel()`` elements of the flattened ``value`` from ``start`` into ``out``."""
    if isinstance(value, TensorRef):
        value.read_flat_into(start, out)
    else:
        out.copy_(value.reshape(-1)[start : start + out.numel()])
