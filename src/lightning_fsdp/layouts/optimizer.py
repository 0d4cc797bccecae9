"""Restore an optimizer over a sharded model from a full optimizer state, keeping only this rank's slices.

The slicing is the core's (:func:`lightning_fsdp.core.fsdp._local_optimizer_state`, the function that goes to
Lightning): this module gives it the package's layouts (:class:`~lightning_fsdp.layouts.targets.ModuleTargets`, for
FSDP1 and FSDP2 alike) and the package's lazy tensors (:class:`~lightning_fsdp.loading.sources.TensorRef`, read by
byte ranges), checks the entry's structure first, and reports a mismatch as a :class:`CheckpointValueError` (a
``ValueError``, as the core raises it).

Layer: shared infrastructure (``lightning_fsdp.layouts``), used by loading and saving; not part of the core.
"""

from collections.abc import Mapping
from typing import Any

from torch.optim import Optimizer

from lightning_fsdp.core.fsdp import _Layout, _local_optimizer_state, _Param, _Piece
from lightning_fsdp.layouts.targets import ModuleTargets, names_layout
from lightning_fsdp.loading.errors import CheckpointValueError


def local_optimizer_state(optimizer: Optimizer, collected: ModuleTargets, full_state: Mapping[str, Any]) -> dict:
    """Build the state dict that ``optimizer.load_state_dict`` takes on this rank, from a full optimizer state.

    The full state is keyed by parameter names (``FSDP.optim_state_dict``) or by integers (an optimizer of the
    unwrapped model: the order of the model's parameters, ``collected.param_names``).

    Raises:
        CheckpointValueError: If the entry is not an optimizer state dict, or the checkpoint's optimizer does not match
            this optimizer and model (param groups, parameters, shapes of the states).

    """
    state = full_state.get("state") if isinstance(full_state, Mapping) else None
    groups = full_state.get("param_groups") if isinstance(full_state, Mapping) else None
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        raise CheckpointValueError(
            "The checkpoint's optimizer entry is not an optimizer state dict (it needs `state` and `param_groups`)."
        )
    for name, saved in state.items():
        if not isinstance(saved, Mapping):
            raise CheckpointValueError(
                f"The checkpoint's optimizer state of {name!r} is a {type(saved).__name__}, not a dict of states."
            )
    try:
        return _local_optimizer_state(full_state, optimizer, core_layout(collected))
    except ValueError as error:
        raise CheckpointValueError(str(error)) from None


def core_layout(collected: ModuleTargets) -> _Layout:
    """The core's layout of what an optimizer state needs: each parameter's pieces, each tensor's full shape."""
    layout = names_layout(collected.specs())
    layout.param_names.extend(collected.param_names)
    for key, param in collected.optimizer_params.items():
        pieces = []
        for target, runs in param.parts:
            name = target.names[0]
            pieces.extend(_Piece(name, run.offset, run.count, run.start) for run in runs)
            if not runs:  # the rank holds no element of it: listed all the same, its state must be there too
                pieces.append(_Piece(name, 0, 0, 0))
        layout.params[key] = _Param(pieces, param.numel, param.to_state, param.has_state)
    return layout
