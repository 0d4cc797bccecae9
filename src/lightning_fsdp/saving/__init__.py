"""Saving without a gather: a full checkpoint that every rank writes its own slices of (an extension of the package).

:meth:`lightning_fsdp.FSDPStrategy.save_checkpoint` and :meth:`lightning_fsdp.ModelParallelStrategy.save_checkpoint`
call :func:`save_full_checkpoint` for a full checkpoint (``state_dict_type="full"``,
``save_distributed_checkpoint=False``); :func:`save_safetensors` exports a model's weights. :mod:`.consolidated`
explains how the files are written.
"""

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import _Stateful
from torch.nn import Module

from lightning_fsdp.distributed.agreement import new_namespace
from lightning_fsdp.saving.background import BackgroundSaves, wait_for_save
from lightning_fsdp.saving.consolidated import CheckpointSaveError, SaveRequest, save
from lightning_fsdp.saving.consolidated_plan import Ranks

__all__ = ["CheckpointSaveError", "save_full_checkpoint", "save_safetensors"]

_warned: set[str] = set()
_said_gather_free: list[bool] = []


def save_full_checkpoint(
    strategy: Any,
    path: Any,
    state: dict[str, Any],
    filter: dict[str, Callable[[str, Any], bool]] | None,
    module: Module,
    fsdp2: bool,
    optimizer_list: str | None = None,
    index_keys: list[str] | None = None,
    modules_first: bool | None = None,
    background: BackgroundSaves | None = None,
) -> bool:
    """Write the full checkpoint of ``state`` at ``path`` from every rank; ``False`` if it must be gathered instead.

    ``optimizer_list`` names an entry of ``state`` that holds a list of optimizers, and ``index_keys`` keys their
    states by parameter index (see :class:`~.consolidated.SaveRequest`): the Trainer's checkpoint. ``modules_first``
    puts the model and optimizers before the other entries, as Fabric's ``ModelParallelStrategy`` does (the default
    with ``fsdp2``); the Trainer keeps the checkpoint's order. With ``background``, the call returns once every rank
    holds a copy of its slices, and the file is written in the background (see :mod:`.background`); the caller
    must have waited for the previous save.

    Every rank calls it with the same arguments. When the state cannot be served (a ``filter``, a sharding layout or
    an optimizer state this writer does not know, ranks that do not share a file system), nothing is written, rank 0
    warns once saying why, and the caller saves with upstream's gather. The first save that every rank wrote says so
    once (rank 0, at the info level).

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
        modules_first=fsdp2 if modules_first is None else modules_first,
        sorted_optimizer_names=not fsdp2 and _uses_orig_params(module),
        flat_optimizer_order=not fsdp2 and not _uses_orig_params(module),
        optimizer_list=optimizer_list,
        index_keys=index_keys,
    )
    reason = save(request, _converted, _hand_off(background, request))
    if reason is not None:
        _warn_fallback(reason)
        return False
    if not _said_gather_free:
        # once per process: which save ran is never a guess (the gather at 65B is the crash this save avoids)
        _said_gather_free.append(True)
        if background is not None:
            rank_zero_info(
                f"Saving the full checkpoint {str(path)!r} without a gather, in the background: each of the"
                f" {strategy.world_size} ranks writes its own slices into the one file from a copy in host memory, and"
                " the file appears when every rank has written it. Said once."
            )
        else:
            rank_zero_info(
                f"Saved the full checkpoint {str(path)!r} without a gather: each of the {strategy.world_size} ranks"
                " wrote its own slices into the one file (Lightning's gathered save would hold it all on rank 0). Said"
                " once."
            )
    return True


def save_safetensors(fabric: Any, path: Any, model: Module, max_shard_size: int | str | None = None) -> None:
    """Export the weights of a sharded ``model`` in safetensors format, every rank writing its own slices.

    A ``path`` that ends in ``.safetensors`` (without ``max_shard_size``) gets one file. Any other ``path`` is a
    directory that gets what ``transformers``' ``save_pretrained`` writes there: the shards
    ``model-00001-of-0000N.safetensors`` of at most ``max_shard_size`` each and ``model.safetensors.index.json``, or
    ``model.safetensors`` alone when one shard holds everything, with the same names, split and index; for a
    transformers model also its ``config.json`` (and ``generation_config.json``).

    The files hold the model's state dict (parameters and persistent buffers, under the names ``Module.state_dict``
    gives them), each tied tensor once (for a transformers model under the name ``save_pretrained`` keeps, else
    under its first name). Rank 0 writes the headers, the index and the configuration; every rank writes its slices
    at their offsets; the file, or the directory, appears under ``path`` only when every rank succeeded. An earlier
    directory at ``path`` is replaced as a whole. Call it on every rank, like ``fabric.save``. With a strategy made
    with ``save_in_background=True``, it first waits for the save in flight, then returns once every rank holds a copy
    of its slices, and the files are written in the background, as a full checkpoint is (``wait_for_save()``).

    Example::

        from lightning_fsdp.saving import save_safetensors

        save_safetensors(fabric, "model.safetensors", model)  # one file
        save_safetensors(fabric, "exported", model, max_shard_size="2GB")  # a Hugging Face checkpoint

    Args:
        fabric: The ``Fabric`` (or its strategy) that set the model up.
        path: A ``.safetensors`` file, or a directory.
        model: The model as ``fabric.setup_module`` returned it.
        max_shard_size: For a directory: the largest shard, in bytes or as a string with a unit among ``KB``,
            ``MB``, ``GB``, ``TB`` (powers of 1000); ``"50GB"`` (``save_pretrained``'s default) if not given. A tensor
            larger than that gets a shard of its own.

    Raises:
        CheckpointSaveError: On every rank, if writing failed on any rank, or if the model's layout or the ranks'
            file system cannot serve this export (the message says why).

    """
    from lightning_fsdp.layouts.fsdp2 import has_dtensor_params
    from lightning_fsdp.saving import export
    from lightning_fsdp.saving.consolidated_plan import SaveUnsupported

    strategy = getattr(fabric, "strategy", fabric)
    module = getattr(model, "_forward_module", model)
    background: BackgroundSaves | None = getattr(strategy, "_background_saves", None)
    if background is not None:
        wait_for_save(strategy)  # at most one save in flight: the previous one finishes (or raises) first
    single_file = str(path).endswith(".safetensors")
    if single_file and max_shard_size is not None:
        raise ValueError(
            f"`save_safetensors(path={str(path)!r}, max_shard_size=...)`: a sharded export is a directory; pass a"
            " directory path, or leave `max_shard_size` out for one file."
        )
    shard_size = None if single_file else export.parse_shard_size(max_shard_size or export.DEFAULT_MAX_SHARD_SIZE)
    problem = None
    if strategy.global_rank == 0:
        existing = Path(path)
        if single_file and existing.is_dir():
            problem = f"the path is a directory: {str(path)!r}"
        elif not single_file and existing.exists() and not existing.is_dir():
            problem = f"the path is a file, not a directory: {str(path)!r}"
    start = strategy.broadcast((str(path), new_namespace(), problem))
    if start[2] is not None:
        raise CheckpointSaveError(f"`save_safetensors` cannot write {start[0]!r}: {start[2]}.")
    request = SaveRequest(
        path=Path(start[0]),
        state={"model": module},
        module=module,
        fsdp2=has_dtensor_params(module),
        namespace=start[1],
        ranks=Ranks(strategy.global_rank, strategy.world_size),
        safetensors=True,
        max_shard_size=shard_size,
    )
    try:
        reason = save(request, _converted, _hand_off(background, request))
    except SaveUnsupported as error:  # raised by the header on every rank alike
        reason = str(error)
    if reason is not None:
        raise CheckpointSaveError(f"`save_safetensors` cannot write {str(path)!r}: {reason}.")


def _hand_off(background: BackgroundSaves | None, request: SaveRequest) -> Callable[[Callable[[], None]], None] | None:
    """Where ``request``'s save hands the rest of its work (lent the background's host buffers), or ``None``."""
    if background is None:
        return None
    request.snapshot = background.buffers
    return partial(background.start, what=repr(str(request.path)))


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
