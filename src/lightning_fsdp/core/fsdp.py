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
"""Shard-local loading of full checkpoints into FSDP1 modules.

Destination: ``src/lightning/fabric/strategies/fsdp.py``. The module-level functions go there as they are; the
:class:`FSDPStrategy` below only dispatches to them, as the edited methods of Lightning's class do.

The functions below the orchestration work on a :class:`_Layout`, which says where each tensor of a full state dict
lives on this rank. :func:`_fsdp_layout` computes it for FSDP1 modules (and ``_dtensor_layout`` in ``model_parallel.py``
for modules of ``DTensor`` parameters), so that the checks, the copy and the slicing of the optimizer state exist once.
"""

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, Optional, TypeVar, Union

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.strategies import FSDPStrategy as _FSDPStrategy
from lightning.fabric.strategies.fsdp import _has_fsdp_modules, _is_full_checkpoint
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.load import _move_state_into
from lightning.fabric.utilities.types import _PATH
from lightning_fsdp.core.load import (
    _find_hf_index,
    _is_mmappable,
    _is_raw_checkpoint_file,
    _is_raw_state_dict,
    _lazy_load_state_dict,
    _read_box,
    _read_flat,
    _shape_of,
)

_T = TypeVar("_T")


class FSDPStrategy(_FSDPStrategy):
    """Lightning's ``FSDPStrategy`` with the core's loading: the methods dispatch to the module-level functions."""

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Union[Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        if isinstance(state, Module) or (isinstance(state, dict) and state):
            from torch.distributed.fsdp import FullyShardedDataParallel

            path = self.broadcast(path)
            is_file = _is_full_checkpoint(Path(path)) or _find_hf_index(path) is not None
            if isinstance(state, FullyShardedDataParallel) and is_file:
                _load_full_checkpoint(self, path, state, _fsdp_layout(state), None, strict, weights_only)
                return {}
            module = _single_module(state, _has_fsdp_modules) if isinstance(state, dict) else None
            if module is not None and is_file:
                return _load_full_checkpoint(self, path, module, _fsdp_layout(module), state, strict, weights_only)
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)


def _single_module(state: dict[str, Any], is_sharded: Callable[[object], bool]) -> Optional[Module]:
    modules = [value for value in state.values() if is_sharded(value)]
    return modules[0] if len(modules) == 1 else None


def _load_full_checkpoint(
    strategy: ParallelStrategy,
    path: _PATH,
    module: Module,
    layout: "_Layout",
    state: Optional[dict[str, Any]],
    strict: bool,
    weights_only: Optional[bool],
) -> dict[str, Any]:
    """Load a full checkpoint or a module state dict, each rank copying only its own part of every tensor.

    A file that can be read lazily (a zip-format ``torch.save`` file, safetensors, a Hugging Face index) is opened on
    every rank at once, and every rank checks the checkpoint against its part of the model and optimizers before any
    rank writes: a checkpoint that does not fit, on any rank, leaves every rank's model and optimizers as they were. A
    file that has to be read whole (the legacy ``torch.save`` format, a file in object storage) is read by one rank of
    a node at a time, so that a node never holds more than one copy; each rank checks and writes in its own turn, so a
    rank whose check fails leaves its model and optimizers as they were while the other ranks load. An error on one
    rank is raised on every rank. The ranks wait for each other in collectives of the default process group (a
    broadcast, a barrier per turn, an ``all_gather_object`` per step), which the group's timeout bounds (the strategy's
    ``timeout``).

    Args:
        strategy: The strategy: its local rank and number of processes set the turns.
        path: The checkpoint file, or a Hugging Face index (or its folder); the same on every rank.
        module: The sharded model.
        layout: Where each tensor of the model lives on this rank (:func:`_fsdp_layout`).
        state: The objects to restore (``fabric.load``), ``module`` among them; ``None`` for a file that holds the
            module's state dict alone (``fabric.load_raw``).
        strict: Whether names must match exactly and every requested key must be in the checkpoint.
        weights_only: Passed to :func:`torch.load`. ``None`` unpickles any object of a full checkpoint (it may hold
            any object), and only tensors of a module state dict.

    Returns:
        The checkpoint's entries that ``state`` did not ask for (``{}`` for a module state dict).

    """
    raw_file = _is_raw_checkpoint_file(path)
    if state is not None and weights_only is None and not raw_file:
        weights_only = False

    def check() -> _CheckedCheckpoint:
        checkpoint = _lazy_load_state_dict(path, weights_only=weights_only)
        return _check_full_checkpoint(checkpoint, raw_file, module, layout, state, strict)

    # rank 0's file decides, so that every rank runs the same collectives whatever it finds at the path
    mmappable = strategy.broadcast(_is_mmappable(path))
    if mmappable:
        # every rank reads only the pages of its own slices of a memory-mapped file, at once
        checked = _run_in_turn(check, strategy, turn=0, turns=1)
        return _run_in_turn(partial(_write_full_checkpoint, checked, layout, state), strategy, turn=0, turns=1)

    # read whole: a rank holds the file in its turn only, so it checks and writes there
    return _run_in_turn(
        lambda: _write_full_checkpoint(check(), layout, state),
        strategy,
        turn=strategy.local_rank,
        turns=max(strategy.num_processes, 1),
    )


class _CheckedCheckpoint(NamedTuple):
    """A checkpoint checked against the model and optimizers, of which nothing was written yet."""

    module_state: Mapping[str, Any]
    sources: dict[str, str]
    optimizer_states: dict[str, dict[str, Any]]
    rest: dict[str, Any]


def _check_full_checkpoint(
    checkpoint: Mapping[str, Any],
    raw_file: bool,
    module: Module,
    layout: "_Layout",
    state: Optional[dict[str, Any]],
    strict: bool,
) -> _CheckedCheckpoint:
    """Check a (lazily read) checkpoint against the model and the optimizers in ``state``, writing nothing.

    ``raw_file`` says that the file can only hold a module state dict (safetensors, a Hugging Face index).

    """
    if state is None:
        # `fabric.load_raw`: the file is the module's state dict
        return _CheckedCheckpoint(checkpoint, _check_module_state(checkpoint, module, layout, strict), {}, {})
    module_key = next(key for key, value in state.items() if value is module)
    if raw_file or (module_key not in checkpoint and _is_raw_state_dict(checkpoint)):
        # a module state dict (`torch.save(model.state_dict())`, safetensors): nothing else was saved with it
        checkpoint = {module_key: checkpoint}
    checkpoint = dict(checkpoint)
    optimizers = {key: optim for key, optim in state.items() if isinstance(optim, Optimizer)}
    _validate_keys_for_strict_loading(state.keys() - {module_key}, checkpoint.keys(), strict=strict)
    module_state = checkpoint.pop(module_key)
    sources = _check_module_state(module_state, module, layout, strict)
    # the optimizers' states are sliced (and checked) before anything is written
    optimizer_states = {
        key: _local_optimizer_state(checkpoint.pop(key), optim, layout)
        for key, optim in optimizers.items()
        if key in checkpoint
    }
    return _CheckedCheckpoint(module_state, sources, optimizer_states, checkpoint)


def _write_full_checkpoint(
    checked: _CheckedCheckpoint, layout: "_Layout", state: Optional[dict[str, Any]]
) -> dict[str, Any]:
    """Write a checked checkpoint into the model, the optimizers and ``state``; return the entries left over."""
    _copy_module_state(checked.module_state, checked.sources, layout)
    if state is None:
        return {}
    for key, optimizer_state in checked.optimizer_states.items():
        state[key].load_state_dict(optimizer_state)
    # the module's and the optimizers' entries were taken out by the checks
    _move_state_into(source=checked.rest, destination=state, keys=set(state))
    return checked.rest


def _run_in_turn(fn: Callable[[], _T], strategy: ParallelStrategy, turn: int, turns: int) -> _T:
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
        if current < turns - 1:
            strategy.barrier()
    _raise_on_all_ranks(strategy, error)
    return result  # type: ignore[return-value]


def _raise_on_all_ranks(strategy: ParallelStrategy, error: Optional[BaseException]) -> None:
    """Share each rank's error with one collective, and raise on every rank if any rank failed.

    A rank that failed raises its own error; the others raise a ``RuntimeError`` that names the failed ranks and the
    first error, so that no rank continues with a partially loaded model while another stopped.

    """
    if strategy.world_size == 1 or not torch.distributed.is_initialized():
        if error is not None:
            raise error
        return
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages: list[Optional[str]] = [None] * strategy.world_size
    torch.distributed.all_gather_object(messages, message)
    failed = [rank for rank, message in enumerate(messages) if message is not None]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"Loading the checkpoint failed on rank(s) {', '.join(map(str, failed))}: {messages[failed[0]]}"
        )


_Index = Union[int, tuple[slice, ...]]
"""Which part of a full tensor a rank holds: the flat elements from an ``int`` start on, or a box of slices."""


class _Shard(NamedTuple):
    """Where one tensor of the model lives on this rank: ``local`` holds the part ``index`` of the full tensor."""

    shape: torch.Size
    local: Tensor
    index: _Index


class _Piece(NamedTuple):
    """The part ``index`` (``numel`` elements) of the tensor ``name``, at ``offset`` of a parameter's local elements."""

    name: str
    offset: int
    numel: int
    index: _Index


class _Param(NamedTuple):
    """A parameter that an optimizer holds: the pieces of its ``numel`` local elements, and the state they make.

    ``stateful`` is ``False`` for an original FSDP parameter with no element on this rank: it gets no gradient here, so
    the optimizer keeps no state for it here (as after ``FSDP.optim_state_dict_to_load``).

    """

    pieces: list[_Piece]
    numel: int
    to_state: Callable[[Tensor], Tensor]
    stateful: bool = True


class _Layout(NamedTuple):
    """Which parts of which tensors of a full state dict this rank holds (see :func:`_fsdp_layout`)."""

    shards: dict[str, _Shard]
    tied: dict[str, str]
    params: dict[int, _Param]
    param_names: list[str]
    extra_states: dict[str, Module]
    """The modules with an extra state (``get_extra_state``), by the name of its entry: it is set whole."""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _fsdp_layout(module: Module) -> _Layout:
    """Where each tensor of an FSDP1 model lives on this rank, and what each parameter that an optimizer sees holds.

    ``shards`` maps each name of the model's state dict to its place on this rank: a parameter that FSDP flattened is
    written into its part of the unit's local shard (``local``, empty when the rank holds no element of it), which
    holds the elements from ``index`` on of the flattened full parameter; a tensor that FSDP does not shard (a buffer,
    a parameter outside every unit) is written whole (``index=()``). ``tied`` maps the other names of tied parameters
    to the name in ``shards``. ``params`` maps each parameter (``id``: a ``FlatParameter``, an original parameter with
    ``use_orig_params=True``, a parameter that FSDP does not shard) to the pieces of the named tensors it holds.
    ``param_names`` lists the parameters' names in the order of the unwrapped model's ``parameters()``, the order of
    an optimizer state keyed by integers.

    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    layout = _Layout({}, {}, {}, [], _extra_states(module))
    # the unwrapped model's order of its modules, which FSDP's wrappers keep: parameters sort by their module
    positions: dict[str, int] = {}
    for module_name, _ in module.named_modules():
        positions.setdefault(clean_tensor_name(module_name), len(positions))
    order: dict[str, tuple[int, int]] = {}
    whole: dict[int, str] = {}
    for module_name, submodule in module.named_modules():
        prefix = clean_tensor_name(module_name)
        if isinstance(submodule, FullyShardedDataParallel) and submodule._handle is not None:
            flat_param = submodule._handle.flat_param
            local_shard = getattr(flat_param, "_local_shard", flat_param.data)
            pieces = []
            orig_params = getattr(flat_param, "_params", None) or [None] * len(flat_param._fqns)
            infos = zip(flat_param._fqns, flat_param._shapes, flat_param._shard_param_infos, orig_params)
            for i, (fqn, shape, info, param) in enumerate(infos):
                name = _join(prefix, fqn)
                piece = _Piece(name, 0, 0, 0)
                if info.in_shard:
                    piece = _Piece(name, info.offset_in_shard, info.numel_in_shard, info.intra_param_start_idx)
                pieces.append(piece)
                layout.shards[name] = _Shard(shape, local_shard[piece.offset : piece.offset + piece.numel], piece.index)
                order[name] = (positions[name.rpartition(".")[0]], i)
                if param is not None:
                    to_state = partial(_viewed_as, param.shape)
                    own = _Param([piece._replace(offset=0)], param.numel(), to_state, stateful=piece.numel > 0)
                    layout.params[id(param)] = own
            layout.params[id(flat_param)] = _Param(pieces, flat_param.numel(), partial(_viewed_as, flat_param.shape))
            for shared in flat_param._shared_param_infos:
                primary = _join(prefix, _join(shared.prim_module_name, shared.prim_param_name))
                layout.tied[_join(prefix, _join(shared.module_name, shared.param_name))] = primary
        tensors = list(submodule._parameters.items()) + [
            (name, buffer)
            for name, buffer in submodule._buffers.items()
            if name not in submodule._non_persistent_buffers_set
        ]
        for i, (name, tensor) in enumerate(tensors):
            if tensor is None or getattr(tensor, "_fsdp_flattened", False):
                continue
            full_name = clean_tensor_name(_join(module_name, name))
            if id(tensor) in whole:
                layout.tied[full_name] = whole[id(tensor)]
                continue
            whole[id(tensor)] = full_name
            layout.shards[full_name] = _Shard(tensor.shape, tensor, ())
            if name in submodule._parameters:
                piece = _Piece(full_name, 0, tensor.numel(), 0)
                layout.params[id(tensor)] = _Param([piece], tensor.numel(), partial(_viewed_as, tensor.shape))
                order[full_name] = (positions[prefix], i)
    layout.param_names.extend(sorted(order, key=order.__getitem__))
    return layout


def _extra_states(module: Module) -> dict[str, Module]:
    """The submodules that save an extra state (they override ``get_extra_state``), by the name of its entry."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    # a module held under several names saves its extra state under each, as `Module.state_dict` visits it
    return {
        clean_tensor_name(_join(name, _EXTRA_STATE_KEY_SUFFIX)): submodule
        for name, submodule in module.named_modules(remove_duplicate=False)
        if type(submodule).get_extra_state is not Module.get_extra_state
    }


def _viewed_as(shape: torch.Size, flat: Tensor) -> Tensor:
    return flat.view(shape)


def _match_module_state(state_dict: Mapping[str, Any], layout: _Layout) -> tuple[dict[str, str], list[str], list[str]]:
    """Which entry of ``state_dict`` feeds each tensor in ``layout.shards``, and the missing and unexpected names.

    A tensor is fed by the entry of its own name, else by the entry of a name tied to it. Missing and unexpected names
    are counted as :meth:`torch.nn.Module.load_state_dict` counts them: every name of the model's state dict, tied ones
    included, is expected. Shapes are not compared, and nothing is read.

    """
    shards, tied = layout.shards, layout.tied
    sources = {}
    for name in shards:
        aliases = (alias for alias, primary in tied.items() if primary == name and alias in state_dict)
        source = name if name in state_dict else next(aliases, None)
        if source is not None:
            sources[name] = source
    extra = layout.extra_states
    unexpected = [name for name in state_dict if name not in shards and name not in tied and name not in extra]
    missing = [name for name in [*shards, *tied, *extra] if name not in state_dict]
    return sources, missing, unexpected


def _check_module_state(state_dict: Mapping[str, Any], module: Module, layout: _Layout, strict: bool) -> dict[str, str]:
    """Which entry of ``state_dict`` feeds each tensor in ``layout.shards``; no tensor data is read, nothing written.

    Names and shapes are checked, and reported as :meth:`torch.nn.Module.load_state_dict` reports them; with
    ``strict=False`` missing and unexpected names are skipped.

    """
    sources, missing, unexpected = _match_module_state(state_dict, layout)
    errors = []
    for name, source in sources.items():
        shape = _shape_of(state_dict[source])
        if shape != layout.shards[name].shape:
            errors.append(
                f"size mismatch for {name}: copying a param with shape {shape} from checkpoint, the shape in current"
                f" model is {layout.shards[name].shape}."
            )
    if strict:
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(errors))
    return sources


def _copy_module_state(state_dict: Mapping[str, Any], sources: Mapping[str, str], layout: _Layout) -> None:
    """Copy this rank's part of each tensor named in ``sources`` (see :func:`_check_module_state`) into the model.

    The extra states that ``state_dict`` holds are set whole, as :meth:`torch.nn.Module.load_state_dict` sets them.

    """
    with torch.no_grad():
        for name, source in sources.items():
            shard = layout.shards[name]
            if shard.local.numel():
                shard.local.copy_(_read_part(state_dict[source], shard.index, shard.local.numel()).view_as(shard.local))
    _set_extra_states(state_dict, layout.extra_states)


def _set_extra_states(state_dict: Mapping[str, Any], extra_states: Mapping[str, Module]) -> None:
    """Set the extra state of each module in ``extra_states`` (see :func:`_extra_states`) that ``state_dict`` holds."""
    for name, submodule in extra_states.items():
        if name in state_dict:
            submodule.set_extra_state(_materialized(state_dict[name]))


def _read_part(value: Any, index: _Index, numel: int) -> Tensor:
    """The part ``index`` of a tensor or a lazy slice: ``numel`` flat elements, or a box."""
    if isinstance(index, int):
        return _read_flat(value, index, index + numel)
    return _read_box(value, index)


def _local_optimizer_state(optimizer_state: Mapping[str, Any], optimizer: Optimizer, layout: _Layout) -> dict[str, Any]:
    """The rank's part of a full optimizer state, as :meth:`torch.optim.Optimizer.load_state_dict` takes it.

    The full state is keyed by parameter names, as ``FSDP.optim_state_dict`` writes it, or by integers, as an
    optimizer of the unwrapped model saves it (``optimizer.state_dict()``). Per-parameter state tensors (Adam's
    ``exp_avg``) are sliced like their parameter, from the lazily read checkpoint; scalar states (``step``) and the
    parameter groups' hyperparameters are read as they are. Everything is checked before it is returned.

    """
    saved_state, saved_groups = optimizer_state["state"], optimizer_state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} parameter group(s), the optimizer has"
            f" {len(optimizer.param_groups)}. Create the optimizer with the same groups as the one that was saved."
        )
    if any(isinstance(key, int) for key in saved_state):
        saved_state = _state_by_name(saved_state, layout.param_names)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for saved_group, group in zip(saved_groups, optimizer.param_groups):
        indices = []
        for param in group["params"]:
            if id(param) not in layout.params:
                raise ValueError(
                    "The optimizer holds a parameter that is not part of the model. Create the optimizer with the"
                    " parameters of the model (after `setup_module`)."
                )
            param_state = _local_param_state(saved_state, layout.params[id(param)], layout)
            if param_state:
                state[index] = param_state
            indices.append(index)
            index += 1
        hyperparameters = {
            key: _materialized(value, group.get(key)) for key, value in saved_group.items() if key != "params"
        }
        groups.append({**hyperparameters, "params": indices})
    return {"state": state, "param_groups": groups}


def _state_by_name(saved_state: Mapping[int, Any], names: Sequence[str]) -> dict[str, Any]:
    """An optimizer state keyed by the parameters' indices (as the unwrapped model ordered them) keyed by name."""
    unknown = [key for key in saved_state if not isinstance(key, int) or not 0 <= key < len(names)]
    if unknown:
        raise ValueError(
            f"The checkpoint's optimizer state holds parameters that the model does not: {sorted(map(str, unknown))}."
            f" The model has {len(names)} parameters. Create the optimizer with the parameters of the one that was"
            " saved."
        )
    return {names[key]: value for key, value in saved_state.items()}


def _local_param_state(saved_state: Mapping[str, Any], param: _Param, layout: _Layout) -> dict[str, Any]:
    """The state of one parameter of the optimizer, assembled from the slices of the names it holds."""
    present = [piece for piece in param.pieces if piece.name in saved_state]
    if not param.stateful or not present:
        return {}
    if len(present) != len(param.pieces):
        absent = next(piece.name for piece in param.pieces if piece.name not in saved_state)
        raise ValueError(
            f"The checkpoint's optimizer state has no entry for {absent!r} but has one for {present[0].name!r}, which"
            " the same parameter holds: the optimizer state is incomplete."
        )
    keys = saved_state[present[0].name].keys()
    scalars: dict[str, Any] = {}
    flats: dict[str, Tensor] = {}
    for piece in present:
        shape = layout.shards[piece.name].shape
        if saved_state[piece.name].keys() != keys:
            raise ValueError(
                f"The checkpoint's optimizer state of {piece.name!r} has the entries {sorted(saved_state[piece.name])},"
                f" that of {present[0].name!r}, which the same parameter holds, has {sorted(keys)}: the optimizer"
                " state is inconsistent."
            )
        for key, value in saved_state[piece.name].items():
            if not _is_tensor(value) or len(_shape_of(value)) == 0:
                if key in flats:
                    raise ValueError(
                        f"The checkpoint's optimizer state {key!r} of {piece.name!r} is a scalar, that of another"
                        " tensor that the same parameter holds is not: the optimizer state is inconsistent."
                    )
                scalars.setdefault(key, _materialized(value))
                continue
            if _shape_of(value) != shape:
                raise ValueError(
                    f"The checkpoint's optimizer state {key!r} of {piece.name!r} has shape {tuple(_shape_of(value))},"
                    f" but the parameter has shape {tuple(shape)}. The optimizer state belongs to another model."
                )
            part = _read_part(value, piece.index, piece.numel).reshape(-1)
            # elements that no piece writes (the padding of an FSDP shard) stay zero
            flat = flats.setdefault(key, torch.zeros(param.numel, dtype=part.dtype))
            flat[piece.offset : piece.offset + piece.numel] = part
    return {**scalars, **{key: param.to_state(flat) for key, flat in flats.items()}}


def _is_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor or a lazily read one (a slice with ``get_shape()``, as safetensors gives)."""
    return isinstance(value, Tensor) or hasattr(value, "get_shape")


def _materialized(value: Any, like: Any = None) -> Any:
    """A value read from the checkpoint into memory of its own (a memory-mapped tensor would keep the file open).

    A tensor lands on the device of the optimizer's current value ``like`` where that is a tensor: the optimizer takes
    its groups' hyperparameters (``lr=torch.tensor(0.01)``) as they are.

    """
    if isinstance(value, (list, tuple)) and isinstance(like, (list, tuple)) and len(value) == len(like):
        return type(value)(_materialized(item, current) for item, current in zip(value, like))
    if not _is_tensor(value):
        return value
    tensor = _read_box(value, ()).clone()
    return tensor.to(like.device) if isinstance(like, Tensor) else tensor
