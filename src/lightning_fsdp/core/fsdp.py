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
        if state:
            path = self.broadcast(path)
            metadata = _load_full_checkpoint(path, state, strict, weights_only, self.local_rank, self.num_processes)
            if metadata is not None:
                return metadata
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)


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
    state: Union[Module, Optimizer, dict[str, Any]],
    strict: bool,
    weights_only: Optional[bool],
    local_rank: int,
    local_world_size: int,
    has_sharded_modules: Callable[[object], bool] = _has_fsdp_modules,
    load_module_state: Optional[Callable[[Mapping[str, Any], Module, bool], None]] = None,
    local_optimizer_state: Optional[Callable[[Mapping[str, Any], Module, Optimizer], dict[str, Any]]] = None,
) -> Optional[dict[str, Any]]:
    """Load a full checkpoint or a raw module state dict into ``state``, each rank copying only its own shards.

    A file that can be read lazily (a zip-format ``torch.save`` file, safetensors, a Hugging Face index) is opened on
    every rank at once; one that has to be read whole (the legacy ``torch.save`` format, a file in object storage) is
    read by one rank of a node at a time, so that a node never holds more than one copy. The ranks wait for each other
    in collectives of the default process group, so a rank that dies or hangs meanwhile makes the others wait until
    the group's timeout (the strategy's ``timeout``, 30 minutes by default).

    Args:
        path: The checkpoint file, or a Hugging Face index (or its folder); the same on every rank.
        state: The model (``fabric.load_raw``), or the objects to restore (``fabric.load``).
        strict: Whether names must match exactly and every requested key must be in the checkpoint.
        weights_only: Passed to :func:`torch.load`. ``None`` unpickles any object of a full checkpoint, as
            ``_lazy_load`` does; safetensors files and indexes hold tensors only.
        local_rank: The rank's index on its node.
        local_world_size: The number of ranks on the node.
        has_sharded_modules: Whether an object of ``state`` is the sharded model.
        load_module_state: Copies the rank's part of a full state dict into the model; FSDP's flat parameters by
            default (:func:`_load_fsdp_module_state`).
        local_optimizer_state: The rank's part of a full optimizer state, as ``optimizer.load_state_dict`` takes it;
            for FSDP's flat parameters by default (:func:`_local_optimizer_state`).

    Returns:
        The checkpoint's entries that ``state`` did not ask for (``{}`` for a model alone), or ``None`` if ``path``
        is not a checkpoint file or ``state`` does not hold exactly one sharded model: the caller loads it otherwise.

    """
    if isinstance(state, Optimizer) or not _is_checkpoint_file(path):
        return None
    # a safetensors file or a Hugging Face index holds a module state dict and nothing else
    raw_file = _is_raw_checkpoint_file(path)
    load_raw = isinstance(state, Module)
    if load_raw:
        state, module_key = {"model": state}, "model"
    else:
        modules = [key for key, value in state.items() if has_sharded_modules(value)]
        if len(modules) != 1:
            return None
        module_key = modules[0]
        # a full checkpoint may hold any object; safetensors files and indexes hold tensors only
        if weights_only is None and not raw_file:
            weights_only = False
    load = partial(
        _load_full_checkpoint_into,
        path,
        raw_file,
        state,
        module_key,
        strict,
        weights_only,
        load_module_state or _load_fsdp_module_state,
        local_optimizer_state or _local_optimizer_state,
    )
    # every rank runs the same collectives, whatever it found at the path
    metadata = _run_in_turn(load, turn=0 if _is_mmappable(path) else local_rank, turns=local_world_size)
    return {} if load_raw else metadata


def _load_full_checkpoint_into(
    path: _PATH,
    raw_file: bool,
    state: dict[str, Any],
    module_key: str,
    strict: bool,
    weights_only: Optional[bool],
    load_module_state: Callable[[Mapping[str, Any], Module, bool], None],
    local_optimizer_state: Callable[[Mapping[str, Any], Module, Optimizer], dict[str, Any]],
) -> dict[str, Any]:
    checkpoint = _lazy_load_state_dict(path, weights_only=weights_only)
    if raw_file or not isinstance(checkpoint.get(module_key), Mapping):
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
    """Where one tensor of the model lives on this rank (see :func:`_fsdp_layout`)."""

    shape: torch.Size
    local: Tensor
    start: int


class _Piece(NamedTuple):
    """Elements ``start:start + numel`` of the flattened tensor ``name``, at ``offset`` of a flat parameter."""

    name: str
    offset: int
    numel: int
    start: int


class _FSDPLayout(NamedTuple):
    """Which elements of which tensors of a full state dict this rank holds in an FSDP module."""

    shards: dict[str, _Shard]
    tied: dict[str, str]
    pieces: dict[int, list[_Piece]]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _fsdp_layout(module: Module) -> _FSDPLayout:
    """Where each tensor of the model lives on this rank, and what each parameter that an optimizer sees holds.

    ``shards`` maps each name of the model's state dict to its place on this rank: a parameter that FSDP flattened is
    written into its part of the unit's local shard (``local``, empty when the rank holds no element of it), which
    holds the elements from ``start`` on of the flattened full parameter; a tensor that FSDP does not shard (a buffer,
    a parameter outside every unit) is written whole (``start=-1``). ``tied`` maps the other names of tied parameters
    to the name in ``shards``. ``pieces`` maps each parameter (``id``: a ``FlatParameter``, an original parameter with
    ``use_orig_params=True``, a parameter that FSDP does not shard) to the pieces of the named tensors it holds (every
    tensor of a unit is listed, with ``numel=0`` where the rank holds no element of it).

    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    layout = _FSDPLayout({}, {}, {})
    whole: dict[int, str] = {}
    for module_name, submodule in module.named_modules():
        prefix = clean_tensor_name(module_name)
        if isinstance(submodule, FullyShardedDataParallel) and submodule._handle is not None:
            flat_param = submodule._handle.flat_param
            local_shard = getattr(flat_param, "_local_shard", flat_param.data)
            pieces = []
            orig_params = getattr(flat_param, "_params", None) or [None] * len(flat_param._fqns)
            infos = zip(flat_param._fqns, flat_param._shapes, flat_param._shard_param_infos, orig_params)
            for fqn, shape, info, param in infos:
                name = _join(prefix, fqn)
                piece = _Piece(name, 0, 0, 0)
                if info.in_shard:
                    piece = _Piece(name, info.offset_in_shard, info.numel_in_shard, info.intra_param_start_idx)
                pieces.append(piece)
                layout.shards[name] = _Shard(shape, local_shard[piece.offset : piece.offset + piece.numel], piece.start)
                if param is not None:
                    layout.pieces[id(param)] = [piece._replace(offset=0)]
            layout.pieces[id(flat_param)] = pieces
            for shared in flat_param._shared_param_infos:
                primary = _join(prefix, _join(shared.prim_module_name, shared.prim_param_name))
                layout.tied[_join(prefix, _join(shared.module_name, shared.param_name))] = primary
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
                layout.tied[full_name] = whole[id(tensor)]
                continue
            whole[id(tensor)] = full_name
            layout.shards[full_name] = _Shard(tensor.shape, tensor, -1)
            layout.pieces[id(tensor)] = [_Piece(full_name, 0, tensor.numel(), 0)]
    return layout


def _load_fsdp_module_state(state_dict: Mapping[str, Any], module: Module, strict: bool = True) -> None:
    """Copy this rank's part of every tensor from a full (lazily read) state dict into the FSDP module's shards.

    Names and shapes are checked, and reported as :meth:`torch.nn.Module.load_state_dict` reports them, before
    anything is written; with ``strict=False`` missing and unexpected names are skipped.

    """
    shards, tied, _ = _fsdp_layout(module)
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
            elif shard.local.numel():
                shard.local.copy_(_read_flat(state_dict[source], shard.start, shard.start + shard.local.numel()))


def _local_optimizer_state(optimizer_state: Mapping[str, Any], module: Module, optimizer: Optimizer) -> dict[str, Any]:
    """The rank's part of a full optimizer state (keyed by parameter names), as ``optimizer.load_state_dict`` takes it.

    Per-parameter state tensors (Adam's ``exp_avg``) are sliced like their parameter, from the lazily read checkpoint;
    scalar states (``step``) and the parameter groups' hyperparameters are taken as they are.

    """
    pieces = _fsdp_layout(module).pieces
    saved_state, saved_groups = optimizer_state["state"], optimizer_state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} parameter groups, the optimizer has"
            f" {len(optimizer.param_groups)}. Create the optimizer with the same groups as the one that was saved."
        )
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for saved_group, group in zip(saved_groups, optimizer.param_groups):
        indices = []
        for param in group["params"]:
            param_state = _local_param_state(saved_state, param, pieces[id(param)])
            if param_state:
                state[index] = param_state
            indices.append(index)
            index += 1
        groups.append({**{k: _materialized(v) for k, v in saved_group.items() if k != "params"}, "params": indices})
    return {"state": state, "param_groups": groups}


def _local_param_state(saved_state: Mapping[str, Any], param: Tensor, pieces: list[_Piece]) -> dict[str, Any]:
    """The state of one parameter of the optimizer, assembled from the slices of the names it holds."""
    local: dict[str, Any] = {}
    for name, offset, numel, start in pieces:
        if not numel:
            continue
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
