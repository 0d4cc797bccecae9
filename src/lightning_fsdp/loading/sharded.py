"""Load a sharded checkpoint directory (torch distributed checkpoint) into an FSDP module and its optimizers.

Each rank reads only its own shards through torch's distributed checkpoint (DCP) reader. Unlike upstream, the
metadata file ``meta.pt`` is read with every storage mapped to the CPU, so a file written from ``cuda:0`` never
touches ``cuda:0`` of another rank, and with ``weights_only=True`` unless the caller asks otherwise.

Upstream destination: ``src/lightning/fabric/strategies/fsdp.py`` (the sharded branch of ``load_checkpoint``).
"""

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.formats import DCP_METADATA_FILENAME, FABRIC_METADATA_FILENAME
from lightning_fsdp.loading.torch_pickle import first_line


def check_sharded_request(
    path: Path,
    module_key: str,
    optimizer_keys: Sequence[str],
    metadata_keys: Iterable[str],
    strict: bool,
    weights_only: bool,
) -> tuple[dict[str, Any], set[str]]:
    """Check that the checkpoint holds what the caller asks for, before anything is read into the model.

    Returns:
        The user's metadata (``meta.pt``), and the top-level keys whose tensors the checkpoint holds.

    Raises:
        CheckpointLoadError: If the model's entry is missing, or (with ``strict=True``) a requested optimizer or key.

    """
    if not (path / DCP_METADATA_FILENAME).is_file():
        raise CheckpointLoadError(
            f"The sharded checkpoint {str(path)!r} has no `{DCP_METADATA_FILENAME}` file: the save was interrupted"
            " or the directory was copied in part."
        )
    stored = stored_entries(path)
    metadata = read_sharded_metadata(path, weights_only)
    entries = ", ".join(repr(key) for key in sorted(stored | set(map(str, metadata))))
    if module_key not in stored:
        raise CheckpointLoadError(
            f"The sharded checkpoint {str(path)!r} has no entry {module_key!r} for the model. Its entries are"
            f" {entries}: pass the model under the key it was saved with."
        )
    absent = sorted(
        [key for key in optimizer_keys if key not in stored] + [k for k in metadata_keys if k not in metadata]
    )
    if absent and strict:
        raise CheckpointLoadError(
            f"The sharded checkpoint has no entry {', '.join(repr(k) for k in absent)} that the state asks for. Its"
            f" entries are {entries}. To load what is there, pass `strict=False`."
        )
    return metadata, stored


def stored_entries(path: Path) -> set[str]:
    """The top-level keys whose tensors a sharded checkpoint holds (``model``, ``optimizer``, ...)."""
    from torch.distributed.checkpoint import FileSystemReader

    return {fqn.split(".", 1)[0] for fqn in FileSystemReader(path).read_metadata().state_dict_metadata}


def load_sharded_checkpoint(
    path: Path, module: Module, module_key: str, optimizers: Mapping[str, Optimizer], strict: bool
) -> None:
    """Restore ``module`` and ``optimizers`` from the shards in ``path`` (after :func:`check_sharded_request`)."""
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_load, _get_sharded_state_dict_context
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

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


def read_sharded_metadata(path: Path, weights_only: bool) -> dict[str, Any]:
    """Read the user's metadata of a sharded checkpoint onto the CPU (an empty dict where there is none)."""
    metadata_path = path / FABRIC_METADATA_FILENAME
    if not metadata_path.is_file():
        return {}
    try:
        metadata = torch.load(metadata_path, map_location="cpu", weights_only=weights_only)
    except Exception as error:
        fix = " If you trust the file, load it with `weights_only=False`." if weights_only else ""
        raise CheckpointLoadError(
            f"The metadata file {str(metadata_path)!r} of the sharded checkpoint could not be read:"
            f" {first_line(error)}.{fix}"
        ) from None
    if not isinstance(metadata, dict):
        raise CheckpointLoadError(f"The metadata file {str(metadata_path)!r} holds a {type(metadata).__name__}.")
    return metadata
