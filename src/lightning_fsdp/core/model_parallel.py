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
the :class:`ModelParallelStrategy` below only dispatches to them, as the edited methods of Lightning's class do. The
load itself is ``FSDPStrategy``'s (``fsdp.py``), given the layout of ``DTensor`` shards that :func:`_dtensor_layout`
computes.
"""

from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.strategies import ModelParallelStrategy as _ModelParallelStrategy
from lightning.fabric.strategies.fsdp import _is_full_checkpoint
from lightning.fabric.strategies.model_parallel import _has_dtensor_modules
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_5
from lightning.fabric.utilities.types import _PATH
from lightning_fsdp.core.fsdp import (
    _extra_states,
    _Layout,
    _load_full_checkpoint,
    _Param,
    _Piece,
    _Shard,
    _single_module,
)
from lightning_fsdp.core.load import _find_hf_index


class ModelParallelStrategy(_ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with the core's loading: the methods dispatch to the functions below."""

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Union[Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        if isinstance(state, Module) or (isinstance(state, dict) and state):
            path = self.broadcast(path)
            is_file = _is_full_checkpoint(Path(path)) or _find_hf_index(path) is not None
            if is_file and isinstance(state, Module) and _has_dtensor_modules(state):
                _load_full_checkpoint(self, path, state, _dtensor_layout(state), None, strict, weights_only)
                return {}
            module = _single_module(state, _has_dtensor_modules) if isinstance(state, dict) else None
            if module is not None and is_file:
                return _load_full_checkpoint(self, path, module, _dtensor_layout(module), state, strict, weights_only)
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)


def _dtensor_layout(module: Module) -> _Layout:
    """Where each tensor of a model of ``DTensor`` parameters lives on this rank (see ``fsdp._Layout``).

    A ``DTensor`` holds a box of the full tensor in its local tensor; other tensors are held whole. The optimizer's
    state of a ``DTensor`` parameter is a ``DTensor`` laid out as the parameter.

    """
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    # the state dict's names: without the prefix of a wrapper that leaves it out there (activation checkpointing)
    param_names = [clean_tensor_name(name) for name, _ in module.named_parameters()]
    layout = _Layout({}, {}, {}, param_names, _extra_states(module))
    names: dict[int, str] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name in layout.extra_states:  # a module's extra state is set whole, not read into a tensor
            continue
        if id(tensor) in names:
            layout.tied[name] = names[id(tensor)]
            continue
        names[id(tensor)] = name
        local, box = _local_tensor_and_box(tensor)
        layout.shards[name] = _Shard(tensor.shape, local, box)
    for name, param in module.named_parameters():
        local, box = _local_tensor_and_box(param)
        piece = _Piece(clean_tensor_name(name), 0, local.numel(), box)
        layout.params[id(param)] = _Param([piece], local.numel(), partial(_like_param, param, local))
    return layout


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


def _like_param(param: Tensor, local: Tensor, flat: Tensor) -> Tensor:
    """An optimizer state from this rank's ``flat`` elements, laid out as ``param`` (a ``DTensor`` or not)."""
    if _TORCH_GREATER_EQUAL_2_5:
        from torch.distributed.tensor import DTensor
    else:
        from torch.distributed._tensor import DTensor

    value = flat.view(local.shape).to(local.device)
    if not isinstance(param, DTensor):
        return value
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
