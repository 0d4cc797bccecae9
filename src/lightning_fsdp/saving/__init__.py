"""Saving without a gather: a full checkpoint that every rank writes its own slices of (an extension of the package).

Importing this module registers :func:`save_full_checkpoint` as a full-checkpoint writer of both strategies
(``lightning_fsdp.strategy._FULL_CHECKPOINT_WRITERS``, the core's seam), so that
:meth:`lightning_fsdp.FSDPStrategy.save_checkpoint` and :meth:`lightning_fsdp.ModelParallelStrategy.save_checkpoint`
call it for a full checkpoint (``state_dict_type="full"``, ``save_distributed_checkpoint=False``); ``lightning_fsdp``
imports it with either strategy. :mod:`.consolidated` explains how the file is written.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _Stateful
from torch.nn import Module

from lightning_fsdp.loading.agreement import new_namespace
from lightning_fsdp.saving.consolidated import CheckpointSaveError, Ranks, SaveRequest, save

__all__ = ["CheckpointSaveError", "save_full_checkpoint", "save_safetensors"]

_warned: set[str] = set()


def save_full_checkpoint(
    strategy: Any,
    path: Any,
    state: dict[str, Any],
    filter: dict[str, Callable[[str, Any], bool]] | None,
    module: Module,
    fsdp2: bool,
) -> bool:
    """Write the full checkpoint of ``state`` at ``path`` from every rank; ``False`` if it must be gathered instead.

    Every rank calls it with the same arguments. When the state cannot be served (a ``filter``, a sharding layout or
    an optimizer state this writer does not know, ranks that do not share a file system), nothing is written, rank 0
    warns once saying why, and the caller saves with upstream's gather.

    Raises:
        CheckpointSaveError: On every rank, if writing failed on any rank (the path is left as it was).

    """
    start = strategy.broadcast((str(path), new_namespace()))
    path, namespace = Path(start[0]), start[1]
    if filter:
        _warn_fallback("a `filter` is given")
        return False
    if path.is_dir():
        from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint

        if not _is_sharded_checkpoint(path):
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
    request = SaveRequest(
        path=path,
        state=state,
        module=module,
        fsdp2=fsdp2,
        namespace=namespace,
        ranks=Ranks(strategy.global_rank, strategy.world_size),
        modules_first=fsdp2,
        sorted_optimizer_names=not fsdp2 and _uses_orig_params(module),
        flat_optimizer_order=not fsdp2 and not _uses_orig_params(module),
    )
    reason = save(request, _converted)
    if reason is not None:
        _warn_fallback(reason)
        return False
    return True


def save_safetensors(fabric: Any, path: Any, model: Module) -> None:
    """Export the weights of a sharded ``model`` as one ``.safetensors`` file, every rank writing its own slices.

    The file holds the model's state dict (parameters and persistent buffers, under the names ``Module.state_dict``
    gives them), each tied tensor once under its first name, as ``safetensors.torch.save_model`` and
    ``save_pretrained`` store tied weights. Rank 0 writes the header; every rank writes its slices at their offsets;
    the file appears under ``path`` only when every rank succeeded. Call it on every rank, like ``fabric.save``.

    Example::

        from lightning_fsdp.saving import save_safetensors

        save_safetensors(fabric, "model.safetensors", model)

    Raises:
        CheckpointSaveError: On every rank, if writing failed on any rank, or if the model's layout or the ranks'
            file system cannot serve this export (the message says why).

    """
    from lightning_fsdp.loading.fsdp2_layout import has_dtensor_params
    from lightning_fsdp.saving.consolidated import SaveUnsupported

    strategy = getattr(fabric, "strategy", fabric)
    module = getattr(model, "_forward_module", model)
    start = strategy.broadcast((str(path), new_namespace()))
    request = SaveRequest(
        path=Path(start[0]),
        state={"model": module},
        module=module,
        fsdp2=has_dtensor_params(module),
        namespace=start[1],
        ranks=Ranks(strategy.global_rank, strategy.world_size),
        safetensors=True,
    )
    try:
        reason = save(request, _converted)
    except SaveUnsupported as error:  # raised by the header on every rank alike
        reason = str(error)
    if reason is not None:
        raise CheckpointSaveError(f"`save_safetensors` cannot write {str(path)!r}: {reason}.")


def _converted(obj: Any) -> Any:
    if isinstance(obj, Module):
        return obj.state_dict()
    return obj.state_dict() if isinstance(obj, _Stateful) else obj


def _uses_orig_params(module: Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(
        getattr(getattr(submodule, "_handle", None), "_use_orig_params", False)
        for submodule in module.modules()
        if isinstance(submodule, FullyShardedDataParallel)
    )


def _warn_fallback(reason: str) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    rank_zero_warn(
        f"The full checkpoint is saved by gathering it on rank 0 (Lightning's way), not by every rank writing its own"
        f" slices, because {reason}."
    )


def _write(strategy: Any, path: Any, state: dict, filter: Any, module: Module, fsdp2: bool) -> bool:
    # Looked up at call time, so that patching `lightning_fsdp.saving.save_full_checkpoint` reaches the strategies.
    return save_full_checkpoint(strategy, path, state, filter, module, fsdp2)


def _register() -> None:
    from lightning_fsdp.strategy import _FULL_CHECKPOINT_WRITERS

    if _write not in _FULL_CHECKPOINT_WRITERS:
        _FULL_CHECKPOINT_WRITERS.append(_write)


_register()
