"""The FSDP2 layout: which ranges of which checkpoint tensors this rank holds in a model of ``DTensor`` parameters.

FSDP2 (``fully_shard``) and tensor parallelism replace each parameter with a ``DTensor``: a local tensor on every rank
and, per dimension of the device mesh, a placement. ``Shard(dim)`` splits a tensor dimension into chunks like
:func:`torch.chunk`, the last ones smaller or empty; ``Replicate()`` keeps it whole; ``_StridedShard(dim,
split_factor)`` is what ``fully_shard`` gives a dimension that tensor parallelism already shards (FSDP x TP on a 2-D
mesh): the rank holds its chunk of each of ``split_factor`` consecutive parts of the dimension. Every layout built of
these is served shard-locally (FSDP, HSDP, tensor parallelism alone, FSDP x TP, uneven and empty shards): per
dimension the local tensor holds a few ranges of global indices, so its elements are runs of the flattened
checkpoint tensor (one per range of rows when only dimension 0 is sharded, one per row and range of columns when
dimension 1 is) that every source format reads alike. Optimizer states are ``DTensor`` objects with the parameter's
mesh and placements. Other placements (``Partial``), and a local tensor that is not contiguous or not of the shape its
placements give, make the loader fall back to upstream's path.

Upstream destination: ``src/lightning/fabric/strategies/model_parallel.py`` (module-level helpers).
"""

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import Module

from lightning_fsdp.loading.shard_local import (
    ModuleTargets,
    OptimizerParam,
    Run,
    ShardLocalUnsupported,
    Target,
    TargetCollector,
    clean_name,
    join,
    whole_target,
)


def has_dtensor_params(module: Module) -> bool:
    """Whether ``module`` holds ``DTensor`` parameters (FSDP2, tensor parallelism), sharded right now or not."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in module.parameters()) or any(
        _is_fsdp2_module(submodule) for submodule in module.modules()
    )


def collect_dtensor_targets(module: Module) -> ModuleTargets:
    """Every tensor of ``module`` that a checkpoint fills, with the part of it that this rank's local tensor holds.

    Units that hold their unsharded parameters at the moment (``reshard_after_forward=False`` after a forward) are
    resharded first: that frees the gathered copy without a collective, and the next forward gathers the loaded
    shards again.

    Raises:
        ShardLocalUnsupported: For a ``DTensor`` whose placements or local tensor this layout does not know: the
            caller falls back to upstream's state-dict loading.
        CheckpointLoadError: If a tensor is still on the meta device (the module was not set up).

    """
    from torch.distributed.tensor import DTensor

    for submodule in module.modules():
        if _is_fsdp2_module(submodule):
            submodule.reshard()
    collector = TargetCollector()
    with torch.no_grad():
        for module_name, submodule in module.named_modules():
            for name, param in submodule._parameters.items():
                full_name = clean_name(join(module_name, name))
                if param is None or collector.alias_of(param, full_name):
                    continue
                if isinstance(param, DTensor):
                    target = _dtensor_target(full_name, param, param, collector.collected)
                else:
                    target = whole_target(full_name, param, param, collector.collected)
                collector.add(target, key=param)
            for name, buffer in submodule._buffers.items():
                if buffer is None or name in submodule._non_persistent_buffers_set:
                    continue
                full_name = clean_name(join(module_name, name))
                if isinstance(buffer, DTensor):
                    target = _dtensor_target(full_name, buffer, None, collector.collected)
                else:
                    target = Target([full_name], tuple(buffer.shape), buffer.dtype, tensor=buffer)
                collector.add(target, key=buffer)
    collector.collected.check_materialized()
    return collector.collected


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
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    held = [[range(size)] if size else [] for size in shape]
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Replicate:
            continue
        if type(placement) not in (Shard, _StridedShard) or not -len(shape) <= placement.dim < len(shape):
            return None
        dim = placement.dim % len(shape)
        split_factor = int(placement.split_factor) if type(placement) is _StridedShard else 1
        pieces = mesh_shape[mesh_dim]
        length = _length(held[dim])
        kept = []
        for part in range(split_factor):
            part_start, part_stop = _chunk(length, split_factor, part)
            start, stop = _chunk(part_stop - part_start, pieces, coordinate[mesh_dim])
            kept.extend(_select(held[dim], part_start + start, part_start + stop))
        held[dim] = _merged(kept)
    return tuple(held)


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


def _dtensor_target(name: str, dtensor: Tensor, param: Tensor | None, collected: ModuleTargets) -> Target:
    from torch.distributed.tensor import DTensor

    assert isinstance(dtensor, DTensor)
    mesh = dtensor.device_mesh
    placements = tuple(dtensor.placements)
    coordinate = mesh.get_coordinate()
    shape = tuple(dtensor.shape)
    indices = local_indices(shape, mesh.shape, coordinate, placements) if coordinate is not None else None
    if indices is None:
        raise ShardLocalUnsupported(f"the parameter {name!r} is a DTensor with placements {placements}")
    local = dtensor.to_local()
    local_shape = tuple(_length(ranges) for ranges in indices)
    if tuple(local.shape) != local_shape or not local.is_contiguous():
        raise ShardLocalUnsupported(
            f"the local tensor of {name!r} has shape {tuple(local.shape)} where its placements {placements} give"
            f" {local_shape}"
        )
    runs = index_runs(shape, indices)
    target = Target([name], shape, dtensor.dtype, local=local.view(-1), runs=runs)
    if param is not None:
        global_stride = dtensor.stride()

        def to_state(flat: Tensor) -> Tensor:
            return DTensor.from_local(
                flat.view(local_shape), mesh, placements, run_check=False, shape=torch.Size(shape), stride=global_stride
            )

        collected.optimizer_params[id(param)] = OptimizerParam(local.numel(), [(target, runs)], to_state)
    return target


def _is_fsdp2_module(module: Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
