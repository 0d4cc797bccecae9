"""Load a sharded checkpoint directory (torch distributed checkpoint) into an FSDP module and its optimizers.

Each rank reads only its own shards through torch's distributed checkpoint (DCP) reader. Unlike upstream, the
metadata file ``meta.pt`` is read with every storage mapped to the CPU, so a file written from ``cuda:0`` never
touches ``cuda:0`` of another rank, and with ``weights_only=True`` unless the caller asks otherwise.

Upstream destination: ``src/lightning/fabric/strategies/fsdp.py`` (the sharded branch of ``load_checkpoint``).
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.formats import _FABRIC_METADATA_FILENAME, _first_line


def load_sharded_checkpoint(
    path: Path,
    module: Module,
    module_key: str,
    optimizers: Mapping[str, Optimizer],
    strict: bool,
    weights_only: bool,
) -> dict[str, Any]:
    """Restore ``module`` and ``optimizers`` from the shards in ``path``; return the user's metadata (``meta.pt``)."""
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_load, _get_sharded_state_dict_context
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    metadata = read_sharded_metadata(path, weights_only)
    with _get_sharded_state_dict_context(module):
        module_state = {module_key: module.state_dict()}
        _distributed_checkpoint_load(module_state, path)
        module.load_state_dict(module_state[module_key], strict=strict)
        if optimizers:
            reader = FileSystemReader(path=path)
            for optimizer_key, optimizer in optimizers.items():
                optimizer_state = load_sharded_optimizer_state_dict(
                    model_state_dict=module_state[module_key], optimizer_key=optimizer_key, storage_reader=reader
                )
                flattened = FSDP.optim_state_dict_to_load(
                    optim_state_dict=optimizer_state[optimizer_key], model=module, optim=optimizer
                )
                optimizer.load_state_dict(flattened)
    return metadata


def read_sharded_metadata(path: Path, weights_only: bool) -> dict[str, Any]:
    """Read the user's metadata of a sharded checkpoint onto the CPU (an empty dict where there is none)."""
    metadata_path = path / _FABRIC_METADATA_FILENAME
    if not metadata_path.is_file():
        return {}
    try:
        metadata = torch.load(metadata_path, map_location="cpu", weights_only=weights_only)
    except Exception as error:
        fix = " If you trust the file, load it with `weights_only=False`." if weights_only else ""
        raise CheckpointLoadError(
            f"The metadata file {str(metadata_path)!r} of the sharded checkpoint could not be read:"
            f" {_first_line(error)}.{fix}"
        ) from None
    if not isinstance(metadata, dict):
        raise CheckpointLoadError(f"The metadata file {str(metadata_path)!r} holds a {type(metadata).__name__}.")
    return metadata
