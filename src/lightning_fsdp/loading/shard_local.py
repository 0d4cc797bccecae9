"""The shard-local copy: each rank reads from a checkpoint source only the slices of the tensors that it holds.

The slices are those of a layout's :class:`~lightning_fsdp.layouts.targets.ModuleTargets` (FSDP1:
:mod:`lightning_fsdp.layouts.fsdp1`, FSDP2: :mod:`lightning_fsdp.layouts.fsdp2`); which checkpoint tensor feeds which
target is the name plan's (:class:`~lightning_fsdp.loading.validation.NamePlan`).

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from collections.abc import Callable

import torch

from lightning_fsdp.layouts.targets import ModuleTargets
from lightning_fsdp.loading.sources import TensorSource
from lightning_fsdp.loading.validation import NamePlan


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
