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
"""Shard-local loading of full checkpoints into FSDP1 modules, and the rank's own GPU in ``module_init_context``.

Destination: ``src/lightning/fabric/strategies/fsdp.py``. The module-level functions go there as they are; the
:class:`FSDPStrategy` below only dispatches to them, as the edited methods of Lightning's class do.
"""

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, Optional, TypeVar, Union

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.strategies import FSDPStrategy as _FSDPStrategy
from lightning.fabric.strategies.fsdp import _has_fsdp_modules
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, get_filesystem
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.load import _move_state_into
from lightning.fabric.utilities.types import _PATH
from lightning_fsdp.core.load import (
    _find_hf_index,
    _is_mmappable,
    _is_raw_checkpoint_file,
    _lazy_load_state_dict,
    _read_flat,
    _shape_of,
)

_T = TypeVar("_T")


class FSDPStrategy(_FSDPStrategy):
    """Lightning's ``FSDPStrategy`` with the core's loading: the methods dispatch to the module-level functions."""

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
        if not state or isinstance(state, Optimizer):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        path = self.broadcast(path)
        if not _is_checkpoint_file(path):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if isinstance(state, Module):
            state, module_key = {"model": state}, "model"
            _load_full_checkpoint(path, state, module_key, strict, weights_only, self.local_rank, self.num_processes)
            return {}
        modules = [key for key, value in state.items() if _has_fsdp_modules(value)]
        if len(modules) != 1:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        # a full checkpoint may hold any object; safetensors files and indexes hold tensors only
        if weights_only is None and not _is_raw_checkpoint_file(path):
            weights_only = False
        return _load_full_checkpoint(path, state, modules[0], strict, weights_only, self.local_rank, self.num_processes)


def _is_checkpoint_file(path: _PATH) -> bool:
    """Whether ``path`` is a checkpoint file (local or remote) or the index of a sharded Hugging Face checkpoint."""
    if not _is_local_file_protocol(path):
        return get_filesystem(path).isfile(str(path))
    return Path(path).is_file() or _find_hf_index(path) is not None


def _own_device_context(device: torch.device) -> AbstractContextManager:
    """Make the rank's own GPU the current device, so that tensors created on ``"cuda"`` land there."""
    return torch.cuda.device(device) if device.type == "cuda" else ExitStack()


def _load_full_checkpoint(
    path: _PATH,
    state: dict[str, Any],
    module_key: str,
    strict: bool,
    weights_only: Optional[bool],
    local_rank: int,
    local_world_size: int,
    load_module_state: Optional[Callable[[Mapping[str, Any], Module, bool], None]] = None,
    local_optimizer_state: Optional[Callable[[Mapping[str, Any], Module, Optimizer], dict[str, Any]]] = None,
) -> dict[str, Any]:
    """Load a full checkpoint or a raw module state dict into ``state``, each rank copying only its own shards.

    A file that can be read lazily (a zip-format ``torch.save`` file, safetensors, a Hugging Face index) is opened on
    every rank at once; one that has to be read whole (the legacy ``torch.save`` format, a file in object storage) is
    read by one rank of a node at a time, so that a node never holds more than one copy.

    Args:
        path: The checkpoint file, or a Hugging Face index (or its folder).
        state: The objects to restore; ``state[module_key]`` is the model.
        module_key: The key of the model in ``state`` and in the checkpoint; a checkpoint without it (or not a
            mapping there) is the model's raw state dict.
        strict: Whether names must match exactly and every requested key must be in the checkpoint.
        weights_only: Passed to :func:`torch.load`.
        local_rank: The rank's index on its node.
        local_world_size: The number of ranks on the node.
        load_module_state: Copies the rank's part of a full state dict into the model; FSDP's flat parameters by
            default (:func:`_load_fsdp_module_state`).
        local_optimizer_state: The rank's part of a full optimizer state, as ``optimizer.load_state_dict`` takes it;
            for FSDP's flat parameters by default (:func:`_local_optimizer_state`).

    """
    load = partial(
        _load_full_checkpoint_into,
        path,
        state,
        module_key,
        strict,
        weights_only,
        load_module_state or _load_fsdp_module_state,
        local_optimizer_state or _local_optimizer_state,
    )
    # every rank runs the same collectives, whatever it found at the path
    return _run_in_turn(load, turn=0 if _is_mmappable(path) else local_rank, turns=local_world_size)


def _load_full_checkpoint_into(
    path: _PATH,
    state: dict[str, Any],
    module_key: str,
    strict: bool,
    weights_only: Optional[bool],
    load_module_state: Callable[[Mapping[str, Any], Module, bool], None],
    local_optimizer_state: Callable[[Mapping[str, Any], Module, Optimizer], dict[str, Any]],
) -> dict[str, Any]:
    checkpoint = _lazy_load_state_dict(path, weights_only=weights_only)
    if _is_raw_checkpoint_file(path) or not isinstance(checkpoint.get(module_key), Mapping):
        # a raw module state dict (`torch.save(model.state_dict())`, safetensors, a Hugging Face checkpoint)
        checkpoint = {module_key: checkpoint}
    _validate_keys_for_strict_loading(state.keys() - {module_key}, checkpoint.keys(), strict=strict)
    module = state[module_key]
    optimizers = {key: optim for key, optim in state.items() if isinstance(optim, Optimizer)}
    # the optimizers' states are sliced (and checked) first, so that an error leaves the model untouched
    optimizer_states = {
        key: local_optimizer_state(checkpoint.pop(key), module, optim)
        for key, optim in optimizers.items()
        if key in checkpoint
    }
    load_module_state(checkpoint.pop(module_key), module, strict)
    for key, optimizer_state in optimizer_states.items():
        optimizers[key].load_state_dict(optimizer_state)
    requested_metadata_keys = state.keys() - {module_key} - optimizers.keys()
    _move_state_into(source=checkpoint, destination=state, keys=requested_metadata_keys)
    return checkpoint


def _run_in_turn(fn: Callable[[], _T], turn: int, turns: int) -> _T:
    """Call ``fn`` in this rank's turn, one of ``turns`` that the ranks of a node take one after the other.

    Ranks that share a turn run at the same time. ``fn`` must not run collectives: the ranks whose turn it is not wait
    in a barrier meanwhile. If ``fn`` raises on any rank, every rank raises.

    """
    result: Optional[_T] = None
    error: Optional[Exception] = None
    for current in range(turns):
        if current == turn:
            try:
                result = fn()
            except Exception as ex:
                error = ex
        if turns > 1 and _distributed_is_initialized():
            torch.distributed.barrier()
    _raise_on_all_ranks(error)
    return result  # type: ignore[return-value]


def _raise_on_all_ranks(error: Optional[BaseException]) -> None:
    """Share each rank's error with one collective, and raise on every rank if any rank failed.

    A rank that failed raises its own error; the others raise a ``RuntimeError`` that names the failed ranks and the
    first error, so that no rank continues with a partially loaded model while another stopped.

    """
    if not _distributed_is_initialized():
        if error is not None:
            raise error
        return
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages: list[Optional[str]] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, message)
    failed = [rank for rank, message in enumerate(messages) if message is not None]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"Loading the checkpoint failed on rank(s) {', '.join(map(str, failed))}: {messages[failed[0]]}"
        )


class _Shard(NamedTuple):
    """Where one tensor of the model lives on this rank (see :func:`_fsdp_shards`)."""

    shape: torch.Size
    local: Optional[Tensor]
    start: int


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _fsdp_shards(module: Module) -> tuple[dict[str, _Shard], dict[str, str]]:
    """Where each tensor of the model lives on this rank, and the names of tied parameters' other occurrences.

    A parameter that FSDP flattened is written into the part of its unit's local shard that this rank holds (none when
    it holds no element of it), from the element ``start`` of the flattened full parameter on; a tensor that FSDP does
    not shard (a buffer, a parameter outside every unit) is written whole (``start=-1``).

    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    shards: dict[str, _Shard] = {}
    tied: dict[str, str] = {}
    whole: dict[int, str] = {}
    for module_name, submodule in module.named_modules():
        prefix = clean_tensor_name(module_name)
        if isinstance(submodule, FullyShardedDataParallel) and submodule._handle is not None:
            flat_param = submodule._handle.flat_param
            local_shard = getattr(flat_param, "_local_shard", flat_param.data)
            for fqn, shape, info in zip(flat_param._fqns, flat_param._shapes, flat_param._shard_param_infos):
                local = None
                if info.in_shard:
                    local = local_shard[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
                shards[_join(prefix, fqn)] = _Shard(shape, local, info.intra_param_start_idx if info.in_shard else 0)
            for shared in flat_param._shared_param_infos:
                primary = _join(prefix, _join(shared.prim_module_name, shared.prim_param_name))
                tied[_join(prefix, _join(shared.module_name, shared.param_name))] = primary
        tensors = list(submodule._parameters.items()) + [
            (name, buffer)
            for name, buffer in submodule._buffers.items()
            if name not in submodule._non_persistent_buffers_set
        ]
        for name, tensor in tensors:
            if tensor is None or getattr(tensor, "_fsdp_flattened", False):
                continue
            full_name = clean_tensor_name(_join(module_name, name))
            if id(tensor) in whole:
                tied[full_name] = whole[id(tensor)]
            else:
                whole[id(tensor)] = full_name
                shards[full_name] = _Shard(tensor.shape, tensor, -1)
    return shards, tied


def _load_fsdp_module_state(state_dict: Mapping[str, Any], module: Module, strict: bool = True) -> None:
    """Copy this rank's part of every tensor from a full (lazily read) state dict into the FSDP module's shards.

    Names and shapes are checked, and reported as :meth:`torch.nn.Module.load_state_dict` reports them, before
    anything is written; with ``strict=False`` missing and unexpected names are skipped.

    """
    shards, tied = _fsdp_shards(module)
    missing = [name for name in [*shards, *tied] if name not in state_dict]
    unexpected = [name for name in state_dict if name not in shards and name not in tied]
    sources = {}
    errors = []
    for name, shard in shards.items():
        aliases = (alias for alias, primary in tied.items() if primary == name and alias in state_dict)
        source = name if name in state_dict else next(aliases, None)
        if source is None:
            continue
        shape = _shape_of(state_dict[source])
        if shape != shard.shape:
            errors.append(
                f"size mismatch for {name}: copying a param with shape {shape} from checkpoint, the shape in current"
                f" model is {shard.shape}."
            )
        sources[name] = source
    if strict:
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(errors))
    with torch.no_grad():
        for name, source in sources.items():
            shard = shards[name]
            if shard.start < 0:
                shard.local.copy_(_read_flat(state_dict[source], 0, shard.local.numel()).view(shard.shape))
            elif shard.local is not None:
                shard.local.copy_(_read_flat(state_dict[source], shard.start, shard.start + shard.local.numel()))


def _local_optimizer_state(optimizer_state: Mapping[str, Any], module: Module, optimizer: Optimizer) -> dict[str, Any]:
    """The rank's part of a full optimizer state (keyed by parameter names), as ``optimizer.load_state_dict`` takes it.

    Per-parameter state tensors (Adam's ``exp_avg``) are sliced like their parameter, from the lazily read checkpoint;
    scalar states (``step``) and the parameter groups' hyperparameters are taken as they are.

    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    shards, _ = _fsdp_shards(module)
    saved_state, saved_groups = optimizer_state["state"], optimizer_state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} parameter groups, the optimizer has"
            f" {len(optimizer.param_groups)}. Create the optimizer with the same groups as the one that was saved."
        )
    # each parameter's pieces: (name, offset in its flat local state, number of elements, start in the full tensor)
    pieces: dict[int, list[tuple[str, int, int, int]]] = {}
    for module_name, submodule in module.named_modules():
        if not isinstance(submodule, FullyShardedDataParallel) or submodule._handle is None:
            continue
        flat_param = submodule._handle.flat_param
        prefix = clean_tensor_name(module_name)
        held = [(_join(prefix, fqn), info) for fqn, info in zip(flat_param._fqns, flat_param._shard_param_infos)]
        pieces[id(flat_param)] = [
            (name, info.offset_in_shard, info.numel_in_shard, info.intra_param_start_idx)
            for name, info in held
            if info.in_shard
        ]
        for (name, info), param in zip(held, getattr(flat_param, "_params", None) or []):
            pieces[id(param)] = [(name, 0, info.numel_in_shard, info.intra_param_start_idx)] if info.in_shard else []
    whole = {id(shard.local): name for name, shard in shards.items() if shard.start < 0}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for saved_group, group in zip(saved_groups, optimizer.param_groups):
        indices = []
        for param in group["params"]:
            param_pieces = pieces.get(id(param))
            if param_pieces is None:  # a parameter that FSDP does not shard
                param_pieces = [(whole[id(param)], 0, param.numel(), 0)]
            param_state = _local_param_state(saved_state, param, param_pieces)
            if param_state:
                state[index] = param_state
            indices.append(index)
            index += 1
        groups.append({**{k: _materialized(v) for k, v in saved_group.items() if k != "params"}, "params": indices})
    return {"state": state, "param_groups": groups}


def _local_param_state(
    saved_state: Mapping[str, Any], param: Tensor, pieces: list[tuple[str, int, int, int]]
) -> dict[str, Any]:
    """The state of one parameter of the optimizer, assembled from the slices of the names it holds."""
    local: dict[str, Any] = {}
    for name, offset, numel, start in pieces:
        for key, value in saved_state.get(name, {}).items():
            if not isinstance(value, Tensor) or value.dim() == 0:
                local.setdefault(key, _materialized(value))
                continue
            flat = local.setdefault(key, torch.zeros(param.numel(), dtype=value.dtype))
            flat[offset : offset + numel] = _read_flat(value, start, start + numel)
    for key, value in local.items():
        if isinstance(value, Tensor) and value.dim() and value.numel() == param.numel():
            local[key] = value.view(param.shape)
    return local


def _materialized(value: Any) -> Any:
    """A tensor read from the checkpoint into memory of its own (a memory-mapped one would keep the file open)."""
    return value.clone() if isinstance(value, Tensor) else value
