"""The FSDP2 layout: which ranges of which checkpoint tensors this rank holds in a model of ``DTensor`` parameters.

FSDP2 (``fully_shard``) and tensor parallelism replace each parameter with a ``DTensor``: a local tensor on every rank
and, per dimension of the device mesh, a placement (``Shard(dim)`` splits a tensor dimension into chunks like
:func:`torch.chunk`, the last ones smaller or empty; ``Replicate()`` keeps it whole). The local tensor is therefore one
box of the full tensor; its rows of whole inner dimensions are contiguous ranges of the flattened checkpoint tensor:
one range for a ``Shard(0)`` parameter, one per row for ``Shard(1)``. Optimizer states are ``DTensor`` objects with
the parameter's mesh and placements. Placements this layout does not know (``Partial``, strided shards) make the loader
fall back to upstream's path.

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
    """Every tensor of ``module`` that a checkpoint fills, with the box of it that this rank's local tensor holds.

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


def local_box(
    shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[object]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The shape and offset of the box of a tensor of ``shape`` that the rank at ``coordinate`` of the mesh holds.

    ``Shard(dim)`` splits the box held so far along ``dim`` into ``torch.chunk`` pieces (mesh dimensions in order);
    ``Replicate()`` keeps it. Returns ``None`` for any other placement.

    """
    from torch.distributed.tensor import Replicate, Shard

    size = list(shape)
    offset = [0] * len(shape)
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard or not -len(shape) <= placement.dim < len(shape):
            return None  # Partial, strided shards (FSDP over a tensor-parallel dim 0), ...
        dim = placement.dim % len(shape)
        chunk = math.ceil(size[dim] / mesh_shape[mesh_dim])
        start = min(coordinate[mesh_dim] * chunk, size[dim])
        stop = min(start + chunk, size[dim])
        offset[dim] += start
        size[dim] = stop - start
    return tuple(size), tuple(offset)


def box_runs(shape: Sequence[int], box_shape: Sequence[int], box_offset: Sequence[int]) -> list[Run]:
    """The runs that copy a box of a row-major tensor of ``shape`` into a contiguous tensor of ``box_shape``.

    Trailing dimensions that the box holds whole merge into each run, so a box of whole rows is a single run.

    """
    if math.prod(box_shape) == 0:
        return []
    if not shape:
        return [Run(0, 1, 0)]
    split = len(shape) - 1  # the outermost dimension that runs do not iterate over
    while split > 0 and box_shape[split] == shape[split]:
        split -= 1
    strides = [math.prod(shape[dim + 1 :]) for dim in range(len(shape))]
    count = box_shape[split] * strides[split]
    runs = []
    outer = [range(box_offset[dim], box_offset[dim] + box_shape[dim]) for dim in range(split)]
    for position, index in enumerate(itertools.product(*outer)):
        start = (
            sum(i * stride for i, stride in zip(index, strides[:split], strict=True))
            + box_offset[split] * strides[split]
        )
        runs.append(Run(start, count, position * count))
    return runs


def _dtensor_target(name: str, dtensor: Tensor, param: Tensor | None, collected: ModuleTargets) -> Target:
    from torch.distributed.tensor import DTensor

    assert isinstance(dtensor, DTensor)
    mesh = dtensor.device_mesh
    placements = tuple(dtensor.placements)
    coordinate = mesh.get_coordinate()
    shape = tuple(dtensor.shape)
    box = local_box(shape, mesh.shape, coordinate, placements) if coordinate is not None else None
    if box is None:
        raise ShardLocalUnsupported(f"the parameter {name!r} is a DTensor with placements {placements}")
    local = dtensor.to_local()
    box_shape, box_offset = box
    if tuple(local.shape) != box_shape or not local.is_contiguous():
        raise ShardLocalUnsupported(
            f"the local tensor of {name!r} has shape {tuple(local.shape)} where its placements {placements} give"
            f" {box_shape}"
        )
    runs = box_runs(shape, box_shape, box_offset)
    target = Target([name], shape, dtensor.dtype, local=local.view(-1), runs=runs)
    if param is not None:
        global_stride = dtensor.stride()

        def to_state(flat: Tensor) -> Tensor:
            return DTensor.from_local(
                flat.view(box_shape), mesh, placements, run_check=False, shape=torch.Size(shape), stride=global_stride
            )

        collected.optimizer_params[id(param)] = OptimizerParam(local.numel(), [(target, runs)], to_state)
    return target


def _is_fsdp2_module(module: Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
