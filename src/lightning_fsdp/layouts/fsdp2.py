"""The FSDP2 layout: which ranges of which checkpoint tensors this rank holds in a model of ``DTensor`` parameters.

FSDP2 (``fully_shard``) and tensor parallelism replace each parameter with a ``DTensor``: a local tensor on every rank
and, per dimension of the device mesh, a placement. ``Shard(dim)`` splits a tensor dimension into chunks like
:func:`torch.chunk`, the last ones smaller or empty; ``Replicate()`` keeps it whole; ``_StridedShard(dim,
split_factor)`` is what ``fully_shard`` gives a dimension that tensor parallelism already shards (FSDP x TP on a 2-D
mesh): the rank holds its chunk of each of ``split_factor`` consecutive parts of the dimension. The layout is the
core's (:func:`lightning_fsdp.core.model_parallel._dtensor_layout`): each local tensor holds a box of the full tensor,
computed with torch's own offsets. Layouts built of these are served shard-locally (FSDP, HSDP, tensor parallelism
alone, FSDP x TP, uneven and empty shards): the elements of a box are runs of the flattened checkpoint tensor (one per
range of rows when only dimension 0 is sharded, one per row and range of columns when dimension 1 is) that every
source format reads alike. :func:`local_indices` reads ``_StridedShard`` placements left to right, as
``distribute_tensor`` does, to find the layouts that ``fully_shard`` places otherwise. Optimizer states
are ``DTensor`` objects with the parameter's mesh and placements. Other placements (``Partial``), a ``_StridedShard``
layout that torch itself reads in two ways (uneven sizes when FSDP shards over three or more ranks:
:func:`ambiguous_strided_dim`), and a local tensor that is not contiguous or not of the shape its placements give make
the loader fall back to upstream's path.

Layer: shared infrastructure (``lightning_fsdp.layouts``), used by loading and saving; not part of the core.
"""

import functools
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

from torch import Tensor
from torch.nn import Module

from lightning_fsdp.core.model_parallel import _dtensor_layout
from lightning_fsdp.layouts.targets import (
    ModuleTargets,
    OptimizerParam,
    Run,
    ShardLocalUnsupported,
    Target,
)


def has_dtensor_params(module: Module) -> bool:
    """Whether ``module`` holds ``DTensor`` parameters (FSDP2, tensor parallelism), sharded right now or not."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in module.parameters()) or any(
        _is_fsdp2_module(submodule) for submodule in module.modules()
    )


def collect_dtensor_targets(module: Module) -> ModuleTargets:
    """Every tensor of ``module`` that a checkpoint fills, with the part of it that this rank's local tensor holds.

    The layout is the core's (:func:`lightning_fsdp.core.model_parallel._dtensor_layout`: the names as in the state
    dict, tied tensors, the box of the full tensor that each local tensor holds, from torch's own offsets, and how each
    parameter's optimizer state is laid out); this adds the checks that let the loader fall back instead, and the runs
    of the copy. Units that hold their unsharded parameters at the moment (``reshard_after_forward=False`` after a
    forward) are resharded first: that frees the gathered copy without a collective, and the next forward gathers the
    loaded shards again.

    Raises:
        ShardLocalUnsupported: For a ``DTensor`` whose placements or local tensor this layout does not know: the
            caller falls back to upstream's state-dict loading.
        CheckpointLoadError: If a tensor is still on the meta device (the module was not set up).

    """
    from torch.distributed.tensor import DTensor

    for submodule in module.modules():
        if _is_fsdp2_module(submodule):
            submodule.reshard()
    tensors = module.state_dict(keep_vars=True)
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            _check_placements(name, tensor)
    try:
        layout = _dtensor_layout(module)
    except NotImplementedError as error:
        raise ShardLocalUnsupported(str(error)) from None
    collected = ModuleTargets(param_names=layout.param_names)
    targets: dict[str, Target] = {}
    for name, shard in layout.shards.items():
        tensor = tensors[name]
        if not isinstance(tensor, DTensor):  # held whole by every rank: copied whole
            target = Target([name], tuple(shard.shape), tensor.dtype, tensor=tensor)
        else:
            if not shard.local.is_contiguous():
                raise ShardLocalUnsupported(f"the local tensor of {name!r} is not contiguous")
            indices = tuple([range(part.start, part.stop)] if part.stop > part.start else [] for part in shard.index)
            runs = index_runs(tuple(shard.shape), indices)
            target = Target([name], tuple(shard.shape), tensor.dtype, local=shard.local.view(-1), runs=runs)
        targets[name] = target
        collected.targets.append(target)
    for alias, primary in layout.tied.items():
        targets[primary].names.append(alias)
    for param in module.parameters():
        core_param = layout.params[id(param)]
        parts = []
        for piece in core_param.pieces:
            target = targets[piece.name]
            parts.append((target, target.runs if target.tensor is None else [Run(0, piece.numel, 0)]))
        collected.optimizer_params[id(param)] = OptimizerParam(core_param.numel, parts, core_param.to_state)
    collected.check_materialized()
    return collected


def _check_placements(name: str, dtensor: Tensor) -> None:
    """Raise :class:`ShardLocalUnsupported` for a ``DTensor`` whose local part is not a box this path can read.

    ``Shard`` and ``Replicate`` placements hold a box; ``_StridedShard`` ones do where torch reads them one way only
    (:func:`ambiguous_strided_dim`); other placements (``Partial``) and a rank outside the mesh are left to upstream.

    """
    from torch.distributed.tensor import Replicate, Shard

    mesh = dtensor.device_mesh
    placements = tuple(dtensor.placements)
    shape = tuple(dtensor.shape)
    if mesh.get_coordinate() is None:
        raise ShardLocalUnsupported(f"the parameter {name!r} is a DTensor of a mesh that this rank is not part of")
    if all(type(placement) in (Replicate, Shard) for placement in placements):
        return
    if _splits(shape, mesh.shape, mesh.get_coordinate(), placements) is None:
        raise ShardLocalUnsupported(f"the parameter {name!r} is a DTensor with placements {placements}")
    ambiguous = ambiguous_strided_dim(shape, tuple(mesh.shape), placements)
    if ambiguous is not None:
        raise ShardLocalUnsupported(
            f"the parameter {name!r} is a DTensor with placements {placements}, which torch reads in two ways"
            f" for {shape[ambiguous]} indices of dimension {ambiguous} over the mesh {tuple(mesh.shape)}"
        )


def local_indices(
    shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[object]
) -> tuple[list[range], ...] | None:
    """Per dimension of a tensor of ``shape``, the global indices that the rank at ``coordinate`` of the mesh holds.

    The placements apply left to right, one per mesh dimension, each to the indices held so far: ``Replicate()``
    keeps them, ``Shard(dim)`` keeps the rank's ``torch.chunk`` piece of them along ``dim`` (the last pieces smaller or
    empty), and ``_StridedShard(dim, split_factor)`` chunks them into ``split_factor`` pieces, chunks each of those
    like ``Shard`` and keeps the rank's part of every one, in order. The indices of a dimension come back as maximal
    ascending ranges, in the order of the local tensor. Returns ``None`` for any other placement (``Partial``).

    """
    splits = _splits(shape, mesh_shape, coordinate, placements)
    return None if splits is None else _held(shape, splits)


@functools.lru_cache(maxsize=1024)
def ambiguous_strided_dim(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[object, ...]
) -> int | None:
    """The first dimension whose indices :func:`local_indices` and ``fully_shard`` place differently on some rank.

    ``fully_shard`` over a tensor-parallel parameter chunks each rank's tensor-parallel shard (right to left: the
    plain shards first, then its own), and describes that with a ``_StridedShard`` placement, which
    ``distribute_tensor`` and :func:`local_indices` read left to right. The two readings agree for sizes that divide
    evenly and whenever FSDP shards over two ranks, but not always (7 rows over a 3 x 2 mesh: ``fully_shard`` leaves
    rank (2, 0) no row and gives (2, 1) row 6, the placements the reverse), so the loader serves a ``_StridedShard``
    only where they agree on every rank: the answer depends on the shape, mesh and placements alone, so every rank
    takes the same path. Returns ``None`` where they agree (or the placements have no ``_StridedShard``, or one that
    :func:`local_indices` does not know).

    """
    sharding = [mesh_dim for mesh_dim, placement in enumerate(placements) if hasattr(placement, "dim")]
    coordinates = itertools.product(*(range(size) if dim in sharding else (0,) for dim, size in enumerate(mesh_shape)))
    for coordinate in coordinates:
        splits = _splits(shape, mesh_shape, coordinate, placements)
        if splits is None or all(split.split_factor == 1 for split in splits):
            return None
        plain = [split for split in splits if split.split_factor == 1]
        strided = [split._replace(split_factor=1) for split in reversed(splits) if split.split_factor > 1]
        left_to_right, right_to_left = _held(shape, splits), _held(shape, plain + strided)
        for dim, (left, right) in enumerate(zip(left_to_right, right_to_left, strict=True)):
            if left != right:
                return dim
    return None


def index_runs(shape: Sequence[int], indices: Sequence[list[range]]) -> list[Run]:
    """The runs that copy the indices of a row-major tensor of ``shape`` into a contiguous local tensor.

    ``indices`` gives, per dimension, the ranges of global indices that the local tensor holds (as
    :func:`local_indices` returns them). Trailing dimensions held whole merge into each run, so a ``Shard(0)`` part is
    one run per range of rows; the local offsets follow each other in the local tensor's row-major order.

    """
    if any(not ranges for ranges in indices):
        return []
    if not shape:
        return [Run(0, 1, 0)]
    split = len(shape) - 1  # the outermost dimension that runs do not iterate over
    while split > 0 and indices[split] == [range(shape[split])]:
        split -= 1
    strides = [math.prod(shape[dim + 1 :]) for dim in range(len(shape))]
    outer = [itertools.chain.from_iterable(indices[dim]) for dim in range(split)]
    runs = []
    offset = 0
    for index in itertools.product(*outer):
        base = sum(i * stride for i, stride in zip(index, strides[:split], strict=True))
        for block in indices[split]:
            count = len(block) * strides[split]
            runs.append(Run(base + block.start * strides[split], count, offset))
            offset += count
    return runs


class _Split(NamedTuple):
    """What one placement keeps along ``dim``: piece ``index`` of ``pieces`` of each of ``split_factor`` parts."""

    dim: int
    pieces: int
    index: int
    split_factor: int


def _splits(
    shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[object]
) -> list[_Split] | None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    splits = []
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Replicate:
            continue
        if type(placement) not in (Shard, _StridedShard) or not -len(shape) <= placement.dim < len(shape):
            return None
        split_factor = int(placement.split_factor) if type(placement) is _StridedShard else 1
        splits.append(_Split(placement.dim % len(shape), mesh_shape[mesh_dim], coordinate[mesh_dim], split_factor))
    return splits


def _held(shape: Sequence[int], splits: Sequence[_Split]) -> tuple[list[range], ...]:
    """The index ranges per dimension that remain after ``splits``, applied in order to the whole tensor."""
    held = [[range(size)] if size else [] for size in shape]
    for split in splits:
        length = _length(held[split.dim])
        kept = []
        for part in range(split.split_factor):
            part_start, part_stop = _chunk(length, split.split_factor, part)
            start, stop = _chunk(part_stop - part_start, split.pieces, split.index)
            kept.extend(_select(held[split.dim], part_start + start, part_start + stop))
        held[split.dim] = _merged(kept)
    return tuple(held)


def _chunk(length: int, pieces: int, index: int) -> tuple[int, int]:
    """Start and stop of piece ``index`` of ``length`` items cut like ``torch.chunk`` (empty pieces at the end)."""
    size = -(-length // pieces)
    start = min(index * size, length)
    return start, min(start + size, length)


def _length(ranges: list[range]) -> int:
    return sum(len(block) for block in ranges)


def _select(ranges: list[range], start: int, stop: int) -> list[range]:
    """The ranges of the items at positions ``start`` to ``stop`` of the sequence that ``ranges`` concatenate."""
    selected = []
    position = 0
    for block in ranges:
        low, high = max(start - position, 0), min(stop - position, len(block))
        if low < high:
            selected.append(block[low:high])
        position += len(block)
    return selected


def _merged(ranges: list[range]) -> list[range]:
    merged: list[range] = []
    for block in ranges:
        if merged and merged[-1].stop == block.start:
            merged[-1] = range(merged[-1].start, block.stop)
        else:
            merged.append(block)
    return merged


def _is_fsdp2_module(module: Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
