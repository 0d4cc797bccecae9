"""Restore an optimizer over an FSDP model from a full (unsharded) optimizer state, keeping only this rank's slices.

A full optimizer state, as ``FSDP.optim_state_dict`` writes it into a Fabric full checkpoint, keys each state by the
parameter's name and holds per-parameter tensors (Adam's ``exp_avg``, SGD's ``momentum_buffer``) at the parameter's
full shape. Each rank slices them exactly like the parameter, so the full optimizer state is never held on a rank.

Upstream destination: ``src/lightning/fabric/strategies/fsdp.py`` (module-level helpers).
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.shard_local import ModuleTargets, ShardLocalUnsupported, Target
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

    by_param = collected.by_param()
    local_state: dict[int, dict[str, Any]] = {}
    local_groups = []
    index = 0
    for saved_group, group in zip(groups, optimizer.param_groups, strict=True):
        indices = []
        for param in group["params"]:
            if id(param) in collected.flat_params:
                local_shard, unit_targets = collected.flat_params[id(param)]
                param_state = _flat_param_state(state, unit_targets, local_shard)
            elif id(param) in by_param:
                param_state = _param_state(state, by_param[id(param)])
            else:
                raise ShardLocalUnsupported("the optimizer holds a parameter that is not part of the model")
            if param_state:
                local_state[index] = param_state
            indices.append(index)
            index += 1
        local_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": indices})
    return {"state": local_state, "param_groups": local_groups}


def _param_state(state: Mapping[str, Any], target: Target) -> dict[str, Any]:
    saved = _saved_state(state, target)
    if saved is None:
        return {}
    return {key: _local_value(key, value, target) for key, value in saved.items()}


def _flat_param_state(state: Mapping[str, Any], targets: list[Target], local_shard: Tensor) -> dict[str, Any]:
    saved_states = [(target, _saved_state(state, target)) for target in targets]
    present = [(target, saved) for target, saved in saved_states if saved is not None]
    if not present:
        return {}
    if len(present) != len(saved_states):
        absent = [target.names[0] for target, saved in saved_states if saved is None]
        raise CheckpointLoadError(
            f"The checkpoint's optimizer state has no entry for {absent[0]!r} but has one for"
            f" {present[0][0].names[0]!r} of the same FSDP unit; the optimizer state is incomplete."
        )
    keys = set(present[0][1])
    for target, saved in present:
        if set(saved) != keys:
            raise CheckpointLoadError(
                f"The checkpoint's optimizer state of {target.names[0]!r} has the entries {sorted(saved)}, that of"
                f" {present[0][0].names[0]!r} has {sorted(keys)}; the optimizer state is inconsistent."
            )
        for key, value in saved.items():
            _check_state_shape(key, value, target)
    local: dict[str, Any] = {}
    for key, first in present[0][1].items():
        if not _is_per_element(first, present[0][0]):
            local[key] = materialize(first)
            continue
        flat = torch.zeros(local_shard.numel(), dtype=first.dtype)
        for target, saved in present:
            value = saved[key]
            if not _is_per_element(value, target):
                raise CheckpointLoadError(
                    f"The checkpoint's optimizer state {key!r} is per element for {present[0][0].names[0]!r} but not"
                    f" for {target.names[0]!r} of the same FSDP unit; the optimizer state is inconsistent."
                )
            slot = target.slot
            assert slot is not None
            flat[slot.offset : slot.offset + slot.numel] = _flat_range(value, slot.start, slot.start + slot.numel)
        local[key] = flat
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


def _local_value(key: str, value: Any, target: Target) -> Any:
    _check_state_shape(key, value, target)
    if target.slot is None or not _is_per_element(value, target):
        return materialize(value)
    slot = target.slot
    local = _flat_range(value, slot.start, slot.start + slot.numel).clone()
    # A sharded original parameter is a 1-D view of its slice; without sharding (NO_SHARD, or a single rank, where
    # FSDP does not shard) it keeps its shape. The state takes the shape of the parameter it belongs to.
    if target.param is not None and target.param.numel() == local.numel():
        local = local.view(target.param.shape)
    return local


def _check_state_shape(key: str, value: Any, target: Target) -> None:
    """A tensor state is a scalar (Adam's ``step``) or has its parameter's shape (``exp_avg``); nothing else loads."""
    if isinstance(value, (Tensor, TensorRef)) and value.dim() > 0 and tuple(value.shape) != target.shape:
        raise CheckpointLoadError(
            f"The checkpoint's optimizer state {key!r} of {target.names[0]!r} has shape {tuple(value.shape)}, but the"
            f" parameter has shape {target.shape}. The optimizer state belongs to another model; nothing was loaded."
        )


def _is_per_element(value: Any, target: Target) -> bool:
    return isinstance(value, (Tensor, TensorRef)) and value.dim() > 0 and tuple(value.shape) == target.shape


def _flat_range(value: Tensor | TensorRef, start: int, stop: int) -> Tensor:
    if isinstance(value, TensorRef):
        return value.read_flat(start, stop)
    return value.reshape(-1)[start:stop]
