"""The model of a sharded module that the layouts build: what each rank holds of every tensor, and where it goes.

A layout answers one question for a module: "which flat ranges of which checkpoint tensors go where on this rank".
The answer is a :class:`ModuleTargets`: for every tensor of the model a :class:`Target` (its checkpoint names, full
shape, dtype, and the runs (:class:`Run`) that copy ranges of the flattened checkpoint tensor into a flat local
view), and for every parameter an optimizer sees an :class:`OptimizerParam` (how to build its state from the same
runs). The loading's copy (:func:`lightning_fsdp.loading.shard_local.copy_into_module`), the optimizer slicing
(:mod:`lightning_fsdp.layouts.optimizer`) and the gather-free save know only this model.

The layouts that build it: FSDP1 (``FullyShardedDataParallel``) in :mod:`lightning_fsdp.layouts.fsdp1`, FSDP2
(``fully_shard``, ``DTensor``) in :mod:`lightning_fsdp.layouts.fsdp2`.

Layer: shared infrastructure (``lightning_fsdp.layouts``), used by loading and saving; not part of the core.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_fsdp.core.fsdp import _Layout, _Shard
from lightning_fsdp.loading.errors import CheckpointLoadError

#: The tensor of a layout entry that stands for names and shapes only (nothing is read into or out of it).
_NOTHING = torch.empty(0)


@dataclass(frozen=True)
class TargetSpec:
    """A tensor the model expects: its names (the first is the one it is stored under; the rest are tied aliases)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


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


def names_layout(specs: Sequence[TargetSpec]) -> _Layout:
    """The core's layout of the model's names and full shapes alone, for the core's matching of a checkpoint's names.

    ``shards`` holds each tensor under its primary name, ``tied`` its other names (see
    :func:`lightning_fsdp.core.fsdp._match_module_state`); no entry holds memory of the model.

    """
    shards = {spec.names[0]: _Shard(torch.Size(spec.shape), _NOTHING, ()) for spec in specs}
    tied = {alias: spec.names[0] for spec in specs for alias in spec.names[1:]}
    return _Layout(shards, tied, {}, [], {})


def clean_name(name: str) -> str:
    """``name`` without the names that FSDP's and activation checkpointing's wrappers insert."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)
