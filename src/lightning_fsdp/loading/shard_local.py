"""Copy each rank's own slice of every parameter from a checkpoint into FSDP's flat parameters.

FSDP (``FullyShardedDataParallel``, FSDP1) flattens the parameters of each wrapped unit into one ``FlatParameter``
and keeps a contiguous shard of it per rank. Its ``_shard_param_infos`` say, for every original parameter, whether
this rank holds part of it, where in the local shard, and which range of the flattened parameter. Copying exactly
that range from the checkpoint needs no all-gather and no unsharded unit, and with a source read by byte ranges
source a rank reads only the bytes of its own shard.

Upstream destination: ``src/lightning/fabric/strategies/fsdp.py`` (module-level helpers).
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import Module

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.sources import TensorSource
from lightning_fsdp.loading.validation import LoadPlan, TargetSpec

_FLAT_PARAM_ATTRIBUTES = ("_fqns", "_shapes", "_shard_param_infos", "_shared_param_infos")


class ShardLocalUnsupported(Exception):
    """The model uses an FSDP configuration that the shard-local path does not know; the message says which."""


@dataclass(frozen=True)
class FlatSlot:
    """Where this rank's part of one original parameter lives in its unit's local flat shard."""

    local_shard: Tensor
    """The rank's shard of the flat parameter (1-D, possibly padded at the end)."""
    offset: int
    """Where the part starts in ``local_shard``."""
    numel: int
    """How many elements of the parameter this rank holds (0 when it holds none)."""
    start: int
    """Index of the first held element in the flattened original parameter."""


@dataclass
class Target:
    """One tensor of the model to fill: a slot of a flat parameter, or a whole tensor (buffer, unmanaged param)."""

    names: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    slot: FlatSlot | None = None
    tensor: Tensor | None = None
    param: Tensor | None = None
    """The parameter object an optimizer sees for this tensor (with ``use_orig_params=True``, or unmanaged)."""

    @property
    def spec(self) -> TargetSpec:
        return TargetSpec(tuple(self.names), self.shape, self.dtype)


@dataclass
class ModuleTargets:
    """Every tensor of a (sharded) module that a checkpoint can fill, and how the optimizer sees them."""

    targets: list[Target] = field(default_factory=list)
    flat_params: dict[int, tuple[Tensor, list[Target]]] = field(default_factory=dict)
    """``id(flat_param)`` -> (its local shard, the targets it holds), for optimizers over flat parameters."""

    def specs(self) -> list[TargetSpec]:
        return [target.spec for target in self.targets]

    def by_param(self) -> dict[int, Target]:
        return {id(target.param): target for target in self.targets if target.param is not None}


def collect_targets(module: Module) -> ModuleTargets:
    """Find every tensor of ``module`` that a checkpoint fills, with the slice of it this rank holds.

    Raises:
        ShardLocalUnsupported: If a unit is unsharded right now or FSDP's flat parameters lack the metadata this
            path relies on (another torch release, FSDP2): the caller falls back to FSDP's own state-dict loading.
        CheckpointLoadError: If a tensor is still on the meta device (the module was not set up).

    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    collected = ModuleTargets()
    by_name: dict[str, Target] = {}
    seen_tensors: dict[int, Target] = {}

    def add(target: Target, key: Tensor | None = None) -> None:
        if key is not None and id(key) in seen_tensors:  # a tied tensor outside FSDP's flat parameters
            seen_tensors[id(key)].names.extend(target.names)
            return
        if key is not None:
            seen_tensors[id(key)] = target
        collected.targets.append(target)
        for name in target.names:
            by_name[name] = target

    for module_name, submodule in module.named_modules():
        prefix = _clean_name(module_name)  # without FSDP's and activation checkpointing's wrapper names
        if isinstance(submodule, FullyShardedDataParallel) and submodule._handle is not None:
            for target in _flat_param_targets(submodule, prefix, collected, by_name):
                add(target)
        for name, param in submodule._parameters.items():
            if param is None or getattr(param, "_fsdp_flattened", False):
                continue  # FSDP manages it through a flat parameter, handled above
            full_name = _clean_name(_join(module_name, name))
            add(Target([full_name], tuple(param.shape), param.dtype, tensor=param, param=param), key=param)
        for name, buffer in submodule._buffers.items():
            if buffer is None or name in submodule._non_persistent_buffers_set:
                continue
            full_name = _clean_name(_join(module_name, name))
            add(Target([full_name], tuple(buffer.shape), buffer.dtype, tensor=buffer), key=buffer)

    on_meta = [t.names[0] for t in collected.targets if t.tensor is not None and t.tensor.is_meta]
    on_meta += [t.names[0] for t in collected.targets if t.slot is not None and t.slot.local_shard.is_meta]
    if on_meta:
        raise CheckpointLoadError(
            f"{len(on_meta)} tensor(s) of the model are on the meta device (e.g. {on_meta[0]!r}), so nothing can be"
            " loaded into them. Call `fabric.setup_module(model)` (or `fabric.setup(model)`) before loading."
        )
    return collected


def _flat_param_targets(
    fsdp_module: Module, prefix: str, collected: ModuleTargets, by_name: dict[str, Target]
) -> Iterator[Target]:
    handle = fsdp_module._handle
    flat_param = handle.flat_param
    missing = [attr for attr in _FLAT_PARAM_ATTRIBUTES if not hasattr(flat_param, attr)]
    if missing:
        raise ShardLocalUnsupported(f"FSDP's flat parameters in this torch release lack {', '.join(missing)}")
    local_shard = getattr(flat_param, "_local_shard", None)
    if local_shard is None:  # FSDP creates `_local_shard` lazily, at the first forward; until then `data` is the shard
        local_shard = flat_param.data
    elif flat_param.data.data_ptr() != local_shard.data_ptr() or (
        handle.uses_sharded_strategy and not handle.needs_unshard()
    ):
        # FSDP would reuse its unsharded copy (SHARD_GRAD_OP keeps it after a forward without backward) instead of
        # gathering the shards again, and never see what is written into them.
        raise ShardLocalUnsupported(
            f"the FSDP unit {prefix or '<root>'!r} holds an unsharded copy of its parameters at the moment (after a"
            " forward without backward, or inside forward and backward)"
        )
    orig_params = getattr(flat_param, "_params", None)  # set with `use_orig_params=True`
    unit_targets: list[Target] = []
    for index, (fqn, shape, info) in enumerate(
        zip(flat_param._fqns, flat_param._shapes, flat_param._shard_param_infos, strict=True)
    ):
        if info.in_shard:
            slot = FlatSlot(local_shard, info.offset_in_shard, info.numel_in_shard, info.intra_param_start_idx)
        else:
            slot = FlatSlot(local_shard, 0, 0, 0)
        param = orig_params[index] if orig_params is not None else None
        target = Target([_join(prefix, fqn)], tuple(shape), flat_param.dtype, slot=slot, param=param)
        unit_targets.append(target)
        yield target
    for shared in flat_param._shared_param_infos:
        primary = _join(prefix, _join(shared.prim_module_name, shared.prim_param_name))
        by_name_target = next((t for t in unit_targets if t.names[0] == primary), None) or by_name.get(primary)
        if by_name_target is None:
            raise ShardLocalUnsupported(f"the tied parameter {primary!r} was not found in its FSDP unit")
        by_name_target.names.append(_join(prefix, _join(shared.module_name, shared.param_name)))
    collected.flat_params[id(flat_param)] = (local_shard, unit_targets)


def copy_into_module(
    collected: ModuleTargets,
    plan: LoadPlan,
    source: TensorSource,
    on_tensor: Callable[[int], None] | None = None,
) -> None:
    """Copy the planned tensors from ``source``: each rank reads and writes only the slices it holds.

    Values are cast to the model's dtype and moved to the tensor's device (the rank's own) by the copy.

    """
    with torch.no_grad():
        for target in collected.targets:
            source_name = plan.sources.get(target.names[0])
            if source_name is None:
                continue
            if target.slot is not None:
                slot = target.slot
                if slot.numel:
                    values = source.read_flat(source_name, slot.start, slot.start + slot.numel)
                    slot.local_shard[slot.offset : slot.offset + slot.numel].copy_(values)
                nbytes = slot.numel * target.dtype.itemsize
            else:
                assert target.tensor is not None
                target.tensor.copy_(source.read(source_name))
                nbytes = target.tensor.numel() * target.tensor.element_size()
            if on_tensor is not None:
                on_tensor(nbytes)


def _clean_name(name: str) -> str:
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)


def _join(prefix: str, name: str) -> str:
    if not prefix:
        return name
    return f"{prefix}.{name}" if name else prefix
