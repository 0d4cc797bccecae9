"""Copy each rank's own slices of every tensor from a checkpoint into a sharded model: the shard-layout seam.

A layout answers one question for a module: "which flat ranges of which checkpoint tensors go where on this rank".
The answer is a :class:`ModuleTargets`: for every tensor of the model a :class:`Target` (its checkpoint names, full
shape, dtype, and the runs (:class:`Run`) that copy ranges of the flattened checkpoint tensor into a flat local
view), and for every parameter an optimizer sees an :class:`OptimizerParam` (how to build its state from the same
runs). The copy (:func:`copy_into_module`) and the optimizer slicing (:mod:`.optimizer`) know only this model.

This module holds the model and the FSDP1 layout: FSDP (``FullyShardedDataParallel``) flattens the parameters of each
wrapped unit into one ``FlatParameter`` and keeps a contiguous shard of it per rank. Which elements of which tensor a
rank holds is the core's answer (:func:`lightning_fsdp.core.fsdp._fsdp_layout`, from FSDP's ``_shard_param_infos``),
which :func:`collect_targets` turns into targets. The FSDP2 (``fully_shard``, ``DTensor``) layout is in
:mod:`.fsdp2_layout`.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import Module

from lightning_fsdp.core.fsdp import _fsdp_layout
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.sources import TensorSource
from lightning_fsdp.loading.validation import NamePlan, TargetSpec

_FLAT_PARAM_ATTRIBUTES = ("_fqns", "_shapes", "_shard_param_infos", "_shared_param_infos")


class ShardLocalUnsupported(Exception):
    """The model uses a sharding configuration that the shard-local path does not know; the message says which."""


@dataclass(frozen=True)
class Run:
    """``count`` elements of the flattened checkpoint tensor from ``start`` go to ``offset`` of a flat destination."""

    start: int
    count: int
    offset: int


@dataclass
class Target:
    """One tensor of the model to fill: runs into a flat view of this rank's part, or a whole tensor (a buffer)."""

    names: list[str]
    """The checkpoint names: the first is the primary, the rest are tied aliases."""
    shape: tuple[int, ...]
    """The full (unsharded) shape."""
    dtype: torch.dtype
    local: Tensor | None = None
    """A 1-D view of the memory that ``runs`` write into (a flat parameter's shard, a ``DTensor``'s local tensor)."""
    runs: list[Run] = field(default_factory=list)
    tensor: Tensor | None = None
    """A tensor that is copied whole instead (buffers, parameters that are not sharded)."""

    @property
    def spec(self) -> TargetSpec:
        return TargetSpec(tuple(self.names), self.shape, self.dtype)

    @property
    def local_numel(self) -> int:
        """How many elements of this tensor the rank writes."""
        if self.tensor is not None:
            return math.prod(self.shape)
        return sum(run.count for run in self.runs)


@dataclass
class OptimizerParam:
    """A parameter that an optimizer holds, and how to build its per-element state from a full optimizer state."""

    numel: int
    """Elements of the flat buffer that the state is assembled in (the parameter's local elements)."""
    parts: list[tuple[Target, list[Run]]]
    """The targets the parameter holds, each with runs from its checkpoint tensor into the flat buffer."""
    to_state: Callable[[Tensor], Tensor]
    """Turns the filled flat buffer into the state tensor (a view of the parameter's shape, or a ``DTensor``)."""
    has_state: bool = True
    """``False`` for an original FSDP1 parameter with no element on this rank: it never gets a gradient there, so the
    optimizer keeps no state for it on this rank (as after ``FSDP.optim_state_dict_to_load``)."""


@dataclass
class ModuleTargets:
    """Every tensor of a (sharded) module that a checkpoint can fill, and how the optimizer sees them."""

    targets: list[Target] = field(default_factory=list)
    optimizer_params: dict[int, OptimizerParam] = field(default_factory=dict)
    """``id(parameter)`` -> how to build its optimizer state, for every parameter an optimizer may hold."""
    param_names: list[str] = field(default_factory=list)
    """The parameters' names in the order of the unwrapped model's ``parameters()`` (an optimizer state keyed by
    integers counts them so)."""

    def specs(self) -> list[TargetSpec]:
        return [target.spec for target in self.targets]

    def check_materialized(self) -> None:
        """Raise if a tensor is still on the meta device (the module was not set up)."""
        on_meta = [
            t.names[0]
            for t in self.targets
            if (t.tensor is not None and t.tensor.is_meta) or (t.local is not None and t.local.is_meta)
        ]
        if on_meta:
            raise CheckpointLoadError(
                f"{len(on_meta)} tensor(s) of the model are on the meta device (e.g. {on_meta[0]!r}), so nothing can"
                " be loaded into them. Call `fabric.setup_module(model)` (or `fabric.setup(model)`) before loading."
            )


def whole_target(name: str, tensor: Tensor, param: Tensor | None, collected: ModuleTargets) -> Target:
    """A tensor that every rank holds whole; a parameter among them gets its optimizer state whole too."""
    target = Target([name], tuple(tensor.shape), tensor.dtype, tensor=tensor)
    if param is not None:
        numel = param.numel()
        shape = param.shape
        collected.optimizer_params[id(param)] = OptimizerParam(
            numel, [(target, [Run(0, numel, 0)])], lambda flat: flat.view(shape)
        )
    return target


class TargetCollector:
    """Adds targets once per tensor: a tensor met again under another name (tied weights) becomes an alias."""

    def __init__(self) -> None:
        self.collected = ModuleTargets()
        self.by_name: dict[str, Target] = {}
        self._by_tensor: dict[int, Target] = {}

    def add(self, target: Target, key: Tensor | None = None) -> None:
        if key is not None and self.alias_of(key, *target.names):
            return
        if key is not None:
            self._by_tensor[id(key)] = target
        self.collected.targets.append(target)
        for name in target.names:
            self.by_name[name] = target

    def alias(self, target: Target, names: list[str]) -> None:
        target.names.extend(names)
        for name in names:
            self.by_name[name] = target

    def alias_of(self, key: Tensor, *names: str) -> bool:
        """Add ``names`` to the target of ``key`` if it was added before (a tied tensor); say whether it was."""
        target = self._by_tensor.get(id(key))
        if target is not None:
            self.alias(target, list(names))
        return target is not None


def collect_targets(module: Module) -> ModuleTargets:
    """The FSDP1 layout: every tensor of ``module`` that a checkpoint fills, with the slice of it this rank holds.

    The layout is the core's (:func:`lightning_fsdp.core.fsdp._fsdp_layout`), read from FSDP's ``_shard_param_infos``;
    this adds the checks that let the loader fall back instead, and the targets and optimizer parameters of the copy.

    Raises:
        ShardLocalUnsupported: If a unit is unsharded right now or FSDP's flat parameters lack the metadata this
            path relies on (another torch release): the caller falls back to FSDP's own state-dict loading.
        CheckpointLoadError: If a tensor is still on the meta device (the module was not set up).

    """
    _check_flat_params(module)
    layout = _fsdp_layout(module)
    collected = ModuleTargets(param_names=layout.param_names)
    targets: dict[str, Target] = {}
    for name, shard in layout.shards.items():
        if not isinstance(shard.index, int):  # a tensor that FSDP does not shard: copied whole
            target = Target([name], tuple(shard.shape), shard.local.dtype, tensor=shard.local)
        else:
            runs = [Run(shard.index, shard.local.numel(), 0)] if shard.local.numel() else []
            target = Target([name], tuple(shard.shape), shard.local.dtype, local=shard.local, runs=runs)
        targets[name] = target
        collected.targets.append(target)
    for alias, primary in layout.tied.items():
        if primary not in targets:
            raise ShardLocalUnsupported(f"the tied parameter {primary!r} was not found in its FSDP unit")
        targets[primary].names.append(alias)
    for param in module.parameters():
        core_param = layout.params.get(id(param))
        if core_param is None:
            continue
        parts = [
            (targets[piece.name], [Run(piece.index, piece.numel, piece.offset)] if piece.numel else [])
            for piece in core_param.pieces
        ]
        # the core's answer: an original parameter with no element on this rank keeps no optimizer state here
        collected.optimizer_params[id(param)] = OptimizerParam(
            param.numel(), parts, _viewed_as(param), core_param.stateful
        )
    collected.check_materialized()
    return collected


def _check_flat_params(module: Module) -> None:
    """Raise :class:`ShardLocalUnsupported` where writing into the units' local shards would not reach the model."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for module_name, submodule in module.named_modules():
        if not isinstance(submodule, FullyShardedDataParallel) or submodule._handle is None:
            continue
        handle = submodule._handle
        flat_param = handle.flat_param
        missing = [attr for attr in _FLAT_PARAM_ATTRIBUTES if not hasattr(flat_param, attr)]
        if missing:
            raise ShardLocalUnsupported(f"FSDP's flat parameters in this torch release lack {', '.join(missing)}")
        # FSDP creates `_local_shard` lazily, at the first forward; until then `data` is the shard
        local_shard = getattr(flat_param, "_local_shard", None)
        if local_shard is not None and (
            flat_param.data.data_ptr() != local_shard.data_ptr()
            or (handle.uses_sharded_strategy and not handle.needs_unshard())
        ):
            # FSDP would reuse its unsharded copy (SHARD_GRAD_OP keeps it after a forward without backward) instead
            # of gathering the shards again, and never see what is written into them.
            raise ShardLocalUnsupported(
                f"the FSDP unit {clean_name(module_name) or '<root>'!r} holds an unsharded copy of its parameters at"
                " the moment (after a forward without backward, or inside forward and backward)"
            )


def _viewed_as(param: Tensor) -> Callable[[Tensor], Tensor]:
    """How the optimizer state of ``param`` is made from its flat buffer: it takes the shape of its parameter.

    A sharded original parameter is a 1-D view of its slice; one that FSDP does not shard (NO_SHARD, a single rank)
    keeps its shape.

    """
    shape = param.shape

    def to_state(flat: Tensor) -> Tensor:
        return flat.view(shape) if flat.numel() == math.prod(shape) else flat

    return to_state


def copy_into_module(
    collected: ModuleTargets,
    plan: NamePlan,
    source: TensorSource,
    on_tensor: Callable[[int], None] | None = None,
) -> None:
    """Copy the planned tensors from ``source``: each rank reads and writes only the slices it holds.

    Values are cast to the model's dtype and moved to the tensor's device (the rank's own) by the copy. A slice of the
    same dtype in host memory is read straight into the parameter's memory, without a buffer in between.

    """
    with torch.no_grad():
        for target in collected.targets:
            source_name = plan.sources.get(target.names[0])
            if source_name is None:
                continue
            if target.tensor is not None:
                target.tensor.copy_(source.read(source_name))
            else:
                assert target.local is not None
                for run in target.runs:
                    if run.count:
                        source.read_flat_into(source_name, run.start, target.local[run.offset : run.offset + run.count])
                # A read into the memory bypasses autograd's record of in-place writes: record it, as `copy_` would.
                torch.autograd.graph.increment_version(target.local)
            if on_tensor is not None:
                on_tensor(target.local_numel * target.dtype.itemsize)


def clean_name(name: str) -> str:
    """``name`` without the names that FSDP's and activation checkpointing's wrappers insert."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)
