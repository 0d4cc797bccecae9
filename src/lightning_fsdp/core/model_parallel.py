# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Shard-local loading of full checkpoints into models of ``DTensor`` parameters (FSDP2, tensor parallelism).

Destination: ``src/lightning/fabric/strategies/model_parallel.py``. The module-level functions go there as they are;
the :class:`ModelParallelStrategy` below only dispatches to them, as the edited methods of Lightning's class do.
"""

from collections.abc import Mapping
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.strategies import ModelParallelStrategy as _ModelParallelStrategy
from lightning.fabric.strategies.model_parallel import _has_dtensor_modules
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_5
from lightning.fabric.utilities.types import _PATH
from lightning_fsdp.core.fsdp import _load_full_checkpoint, _materialized, _own_device_context
from lightning_fsdp.core.load import _read_box, _shape_of


class ModelParallelStrategy(_ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with the core's loading: the methods dispatch to the functions below."""

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(_own_device_context(self.root_device))
        stack.enter_context(super().module_init_context(empty_init=empty_init))
        return stack

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Union[Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        if state:
            path = self.broadcast(path)
            metadata = _load_full_checkpoint(
                path,
                state,
                strict,
                weights_only,
                self.local_rank,
                self.num_processes,
                _has_dtensor_modules,
                _load_dtensor_module_state,
                _local_dtensor_optimizer_state,
            )
            if metadata is not None:
                return metadata
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)


def _load_dtensor_module_state(state_dict: Mapping[str, Any], module: Module, strict: bool = True) -> None:
    """Copy the rank's part of every tensor from a full (lazily read) state dict into the module's local tensors.

    Each ``DTensor`` gets the part of the full tensor that its local tensor holds, read only there; other tensors are
    copied whole. Names and shapes are checked first: missing, unexpected and mismatched names raise the error of
    :meth:`torch.nn.Module.load_state_dict` before anything is written (with ``strict=False``, missing and unexpected
    names are skipped). A tensor that several names share (tied weights) is written once.

    """
    targets = module.state_dict(keep_vars=True)
    copies: dict[int, tuple[Tensor, tuple[slice, ...], Any]] = {}
    errors = []
    for name, target in targets.items():
        if name not in state_dict:
            continue
        shape = _shape_of(state_dict[name])
        if shape != target.shape:
            errors.append(
                f"size mismatch for {name}: copying a param with shape {shape} from checkpoint, the shape in current"
                f" model is {target.shape}."
            )
        elif id(target) not in copies:
            copies[id(target)] = (*_local_tensor_and_box(target), state_dict[name])
    if strict:
        unexpected = [name for name in state_dict if name not in targets]
        missing = [name for name in targets if name not in state_dict]
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(errors))
    with torch.no_grad():
        for local, box, source in copies.values():
            local.copy_(_read_box(source, box))


def _local_tensor_and_box(tensor: Tensor) -> tuple[Tensor, tuple[slice, ...]]:
    """The tensor that this rank holds of ``tensor``, and the part of the full tensor that it holds."""
    if _TORCH_GREATER_EQUAL_2_5:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    else:
        from torch.distributed._tensor import DTensor
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, size) for size in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise NotImplementedError(
            f"A `DTensor` with placements {tensor.placements} holds a local tensor of shape {tuple(local.shape)} where"
            f" {tuple(shape)} is expected. Loading a full checkpoint into this layout is not supported: save and"
            " load a distributed checkpoint instead (`ModelParallelStrategy(save_distributed_checkpoint=True)`)."
        )
    return local, tuple(slice(start, start + size) for start, size in zip(offset, shape))


def _local_dtensor_optimizer_state(
    optimizer_state: Mapping[str, Any], module: Module, optimizer: Optimizer
) -> dict[str, Any]:
    """The rank's part of a full optimizer state, as :meth:`torch.optim.Optimizer.load_state_dict` takes it.

    The full state is keyed by parameter names, as ``get_optimizer_state_dict(..., full_state_dict=True)`` writes it,
    or by the optimizer's indices. A state tensor of its parameter's shape (Adam's ``exp_avg``) becomes a ``DTensor``
    laid out as the parameter, read only where this rank holds it; other states (``step``) and the parameter groups'
    hyperparameters are taken as they are.

    """
    saved_state, saved_groups = optimizer_state["state"], optimizer_state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} parameter groups, the optimizer has"
            f" {len(optimizer.param_groups)}. Create the optimizer with the same groups as the one that was saved."
        )
    names: dict[int, str] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), name)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    by_index = all(isinstance(key, int) for group in saved_groups for key in group["params"])
    keys = list(range(len(params))) if by_index else [names.get(id(param)) for param in params]
    unknown = set(saved_state) - set(keys)
    if unknown:
        raise ValueError(
            "The checkpoint's optimizer state holds parameters that the optimizer does not:"
            f" {sorted(map(str, unknown))}. Create the optimizer with the parameters of the one that was saved."
        )
    state = {
        index: {name: _local_optimizer_value(value, param) for name, value in saved_state[key].items()}
        for index, (key, param) in enumerate(zip(keys, params))
        if key in saved_state
    }
    groups, start = [], 0
    for saved_group, group in zip(saved_groups, optimizer.param_groups):
        indices = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        groups.append({**{k: _materialized(v) for k, v in saved_group.items() if k != "params"}, "params": indices})
    return {"state": state, "param_groups": groups}


def _local_optimizer_value(value: Any, param: Tensor) -> Any:
    """The rank's part of one optimizer state of ``param``: a ``DTensor`` like ``param`` if it has its shape."""
    if not isinstance(value, Tensor) or value.shape != param.shape or value.dim() == 0:
        return _materialized(value)
    local, box = _local_tensor_and_box(param)
    local_value = _read_box(value, box).to(device=local.device, copy=True)
    if local is param:
        return local_value
    return type(param).from_local(
        local_value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
