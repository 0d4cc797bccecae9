"""Load a sharded checkpoint directory (torch distributed checkpoint) into an FSDP1 or FSDP2 module and its optimizers.

Each rank reads only its own shards through torch's distributed checkpoint (DCP) reader, with four guards that
upstream lacks:

- ``weights_only`` means no code runs: the DCP ``.metadata`` file is unpickled with an allow-list of torch's checkpoint
  metadata types (torch unpickles it with plain :mod:`pickle`), the non-tensor entries of the ``.distcp`` files with
  ``torch.load(weights_only=True)`` (torch uses ``weights_only=False``), and ``meta.pt`` with ``weights_only=True``,
  every storage mapped to the CPU.
- Every file is a regular file that holds every byte the metadata places in it, checked before anything is opened, so
  a FIFO or a truncated shard gives an error instead of a hang or a half-read model.
- A checkpoint in object storage (a :class:`~lightning_fsdp.loading.files.StoragePath`) is read the same way, through
  the same checks: each rank fetches exactly the byte ranges of its own entries (as DCP's planner gives them) by range
  requests, never a whole shard file and with no local copy, and an object replaced during the load is an error.
- The checkpoint's entries (tensor or not, global shape, dtype) are compared with the model's sharded state dict and
  the optimizers' before anything is read, and everything is read before anything is written: a failed load leaves
  the model and the optimizers as they were.
- A failure inside DCP (a ``CheckpointException``, which is a ``BaseException`` with every rank's traceback in its
  message) is raised as one short :class:`CheckpointLoadError`, with the ranks that failed.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import functools
import io
import math
import os
import pathlib
import pickle
import re
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.layouts.fsdp2 import has_dtensor_params
from lightning_fsdp.loading.errors import (
    CheckpointLoadError,
    printable,
    quoted_names,
    shown_items,
    unexpected_cause,
)
from lightning_fsdp.loading.files import (
    CheckpointPath,
    StorageFile,
    StoragePath,
    check_local_file_unchanged,
    lexists,
    require_regular_file,
)
from lightning_fsdp.loading.formats import (
    DCP_METADATA_FILENAME,
    FABRIC_METADATA_FILENAME,
    DetectedCheckpoint,
    read_safetensors_shards,
    safetensors_shards_specs,
)
from lightning_fsdp.loading.quiet import torch_internal_warnings_silenced
from lightning_fsdp.loading.sources import materialize
from lightning_fsdp.loading.torch_pickle import first_line

_T = TypeVar("_T")
_WEIGHTS_ONLY_REASON = "WeightsUnpickler error:"
#: The classes that torch pickles into a DCP ``.metadata`` file (``torch.distributed.checkpoint.metadata`` and the
#: file system reader's storage records), and the plain types they hold. Nothing else may be unpickled from it.
_METADATA_CLASSES: tuple[Any, ...] = (
    Metadata,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    StorageMeta,
    _MEM_FORMAT_ENCODING,
    _StorageInfo,
    torch.Size,
    OrderedDict,
    set,
    frozenset,
)


def check_sharded_request(
    path: CheckpointPath,
    module_key: str | None,
    optimizer_keys: Sequence[str],
    metadata_keys: Iterable[str],
    strict: bool,
    weights_only: bool,
    dcp_metadata: Metadata | None = None,
) -> tuple[dict[str, Any], set[str]]:
    """Check that the checkpoint holds what the caller asks for, before anything is read into the model.

    No collective runs here, so it may run before the ranks agree. The checkpoint's files are checked like
    :func:`check_storage_files` does, unless ``dcp_metadata`` is given: then it was read and checked already.
    ``module_key`` is what :func:`module_entry` returned: ``None`` where the checkpoint is the module's state itself.

    Returns:
        The user's metadata (``meta.pt``), and the top-level keys whose tensors the checkpoint holds.

    Raises:
        CheckpointLoadError: If a file is missing, unsafe or unreadable, or the model's entry is missing, or (with
            ``strict=True``) a requested optimizer or key.

    """
    if dcp_metadata is None:
        dcp_metadata = read_checked_metadata(path, weights_only)
    stored = _top_level_keys(dcp_metadata)
    metadata = read_sharded_metadata(path, weights_only)
    if module_key is None:
        return metadata, stored
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


def module_entry(metadata: Metadata, module_key: str | None) -> str | None:
    """The entry of a sharded checkpoint that holds the module's state, or ``None``: the checkpoint is that state.

    A sharded checkpoint is told apart as a checkpoint file is, by where its tensors sit in the state dict that was
    saved (DCP records each entry's path in its planner data). ``fabric.save`` and ``dcp.save({"model": ...})`` put
    the module's tensors under its key; ``dcp.save(model.state_dict())`` and ``torch_save_to_dcp`` put them at the
    top level, as in a raw state dict file: such a checkpoint is the module's state. ``fabric.load`` reads the entry
    ``module_key`` where the checkpoint has one, and the checkpoint itself where it holds tensors at its top level;
    ``load_raw`` (``module_key=None``) reads the checkpoint itself where it holds tensors at its top level, and the
    entry ``"model"`` otherwise.

    """
    paths = _entry_paths(metadata)
    if module_key is not None and any(len(keys) > 1 and keys[0] == module_key for keys in paths.values()):
        return module_key
    tensors_at_top = any(
        len(paths[fqn]) == 1 and isinstance(entry, TensorStorageMetadata)
        for fqn, entry in metadata.state_dict_metadata.items()
    )
    return None if tensors_at_top else (module_key or "model")


def read_checked_metadata(path: CheckpointPath, weights_only: bool) -> Metadata:
    """:func:`read_dcp_metadata`, then :func:`check_storage_files`: what a load reads once and uses throughout."""
    metadata = read_dcp_metadata(path, weights_only)
    check_storage_files(path, metadata)
    return metadata


def read_safetensors_shards_metadata(detected: DetectedCheckpoint) -> Metadata:
    """The distributed checkpoint metadata of a directory of safetensors slices (torch's ``HuggingFaceStorageWriter``).

    Such a directory has no ``.metadata``: each file's header says which slices of which tensors it holds
    (:func:`~lightning_fsdp.loading.formats.read_safetensors_shards`). They are described here as DCP describes the
    chunks of its own files, and checked the same way (the slices of each tensor must tile it exactly), so the rest of
    the sharded load, and its resharding to the model's layout, serve them unchanged. The directory holds a module's
    state dict, its names at the top level; :class:`SafetensorsSlicesReader` reads it.

    Raises:
        CheckpointLoadError: If a file is invalid, or the slices of a tensor overlap or leave part of it out.

    """
    slices = read_safetensors_shards(detected)
    specs = safetensors_shards_specs(slices)
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for name, parts in slices.items():
        chunks = []
        for part in parts:
            offsets = torch.Size(part.offsets)
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(part.location.spec.shape)))
            location = part.location
            storage[MetadataIndex(name, offsets)] = _SafetensorsSliceInfo(
                location.file.name, location.storage_offset, location.storage_nbytes, shape=location.spec.shape
            )
        spec = specs[name]
        entries[name] = TensorStorageMetadata(TensorProperties(dtype=spec.dtype), torch.Size(spec.shape), chunks)
    metadata = Metadata(entries, planner_data={name: (name,) for name in entries}, storage_data=storage)
    problems = _metadata_problems(metadata)
    if problems:
        raise CheckpointLoadError(
            f"The safetensors slices in {str(detected.path)!r} do not form whole tensors: {shown_items(problems)}."
            " A file is missing or comes from another save: re-copy or re-save the checkpoint."
        )
    return metadata


def stored_entries(path: CheckpointPath, weights_only: bool = True) -> set[str]:
    """The top-level keys whose tensors a sharded checkpoint holds (``model``, ``optimizer``, ...)."""
    return _top_level_keys(read_dcp_metadata(path, weights_only))


def read_dcp_metadata(path: CheckpointPath, weights_only: bool = True) -> Metadata:
    """Read and check the ``.metadata`` file of a sharded checkpoint, without running code from it.

    Use this instead of ``FileSystemReader(path).read_metadata()``, which unpickles the file with plain :mod:`pickle`.

    Args:
        path: The checkpoint directory.
        weights_only: Unpickle only the classes of torch's checkpoint metadata (the default). ``False`` unpickles
            anything: only for a checkpoint you trust.

    Raises:
        CheckpointLoadError: If the file is missing, not a regular file, holds another type (its payload is not
            run), or is not consistent (a storage record outside the directory, a chunk outside its tensor, ...).

    """
    file = path / DCP_METADATA_FILENAME
    if not lexists(file):
        raise CheckpointLoadError(
            f"The sharded checkpoint {str(path)!r} has no `{DCP_METADATA_FILENAME}` file: the save was interrupted"
            " or the directory was copied in part."
        )
    with _open_regular_file(file, "metadata file of the sharded checkpoint") as stream:
        try:
            metadata = (_MetadataUnpickler(stream) if weights_only else pickle.Unpickler(stream)).load()
        except _RefusedGlobal as refused:
            raise CheckpointLoadError(
                f"Refused to unpickle `{refused}` from the sharded checkpoint's metadata file {str(file)!r} (the"
                " payload was not run): this file holds only torch's checkpoint metadata types, so it was crafted or"
                " is not a checkpoint. Load it with `weights_only=False` only if you trust its source."
            ) from None
        except Exception as error:
            raise CheckpointLoadError(
                f"The metadata file {str(file)!r} of the sharded checkpoint could not be read: {first_line(error)}."
                " It is truncated or corrupt: re-copy or re-save the checkpoint."
            ) from None
    try:
        problems = _metadata_problems(metadata)
    except (AttributeError, TypeError) as error:  # a record unpickled without its fields
        problems = [f"a record is incomplete ({first_line(error)})"]
    if problems:
        raise CheckpointLoadError(
            f"The metadata file {str(file)!r} of the sharded checkpoint is not valid: {shown_items(problems)}. It is"
            " corrupt or was crafted: re-copy or re-save the checkpoint."
        )
    return metadata


def check_storage_files(path: CheckpointPath, metadata: Metadata) -> None:
    """Check that every file the metadata refers to is a regular file that holds every byte placed in it.

    Raises:
        CheckpointLoadError: If a shard file is missing, is a FIFO, device or directory, or is shorter than the
            offset plus length of an entry stored in it.

    """
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        size = require_regular_file(file, "shard file of the sharded checkpoint").st_size
        if size < end:
            raise CheckpointLoadError(
                f"The shard file {str(file)!r} of the sharded checkpoint is truncated: the metadata places data up to"
                f" byte {end}, but the file has {size} bytes. Re-copy or re-save the checkpoint."
            )


def load_sharded_checkpoint(
    path: CheckpointPath,
    module: Module,
    module_key: str | None,
    optimizers: Mapping[str, Optimizer],
    strict: bool,
    weights_only: bool = True,
    dcp_metadata: Metadata | None = None,
) -> str:
    """Restore ``module`` and ``optimizers`` from the shards in ``path`` (after :func:`check_sharded_request`).

    ``module`` is an FSDP1 module (its sharded state dict holds ``ShardedTensor`` objects) or a module of ``DTensor``
    parameters (FSDP2, tensor parallelism); only how the model's and the optimizers' state dicts are taken and given
    back differs. ``module_key`` is what :func:`module_entry` returned: ``None`` where the checkpoint is the module's
    state itself (it holds no optimizer state then). ``dcp_metadata``, when given, is what
    :func:`read_checked_metadata` returned for ``path``: it is not read again.

    Every rank must call it (it runs collectives). The entries are checked against the model and the optimizers,
    then everything is read, then written: when it raises, the model and the optimizers are unchanged.

    Returns:
        What ``strict=False`` left out (missing and unexpected model keys), or an empty string.

    Raises:
        CheckpointLoadError: If the checkpoint does not match the model, or a file is unsafe or unreadable, or the
            distributed checkpoint reader failed on any rank (the same error on every rank).

    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    metadata = dcp_metadata if dcp_metadata is not None else read_checked_metadata(path, weights_only)
    slices = any(isinstance(info, _SafetensorsSliceInfo) for info in metadata.storage_data.values())
    reader = (SafetensorsSlicesReader if slices else CheckedFileSystemReader)(path, metadata, weights_only=weights_only)
    dtensors = has_dtensor_params(module)
    with torch_internal_warnings_silenced(), _sharded_state_dict_context(module, dtensors):
        model_state = _model_state_to_read_into(module, dtensors)
        # DCP names an entry by its path in the state dict it reads into, as in the one that was saved.
        module_state = model_state if module_key is None else {module_key: model_state}
        prefix = "" if module_key is None else f"{module_key}."
        skipped = _check_against_model(metadata, prefix, model_state, list(optimizers), strict)
        read_optimizer_state = _read_dtensor_optimizer_state if dtensors else _read_flat_optimizer_state
        write_optimizers = [
            read_optimizer_state(path, module, model_state, key, optimizer, reader, strict)
            for key, optimizer in optimizers.items()
        ]
        planner = DefaultLoadPlanner(allow_partial_load=not strict)
        _dcp_call(
            f"Reading the model from {str(path)!r}",
            lambda: dcp.load(module_state, storage_reader=reader, planner=planner),
        )
        module.load_state_dict(model_state, strict=strict)
        for write_optimizer in write_optimizers:
            write_optimizer()
    return skipped


def _sharded_state_dict_context(module: Module, dtensors: bool) -> AbstractContextManager:
    """FSDP1 gives its sharded state dict inside this context; a module of ``DTensor`` parameters always does."""
    if dtensors:
        return nullcontext()
    from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context

    return _get_sharded_state_dict_context(module)


def _model_state_to_read_into(module: Module, dtensors: bool) -> dict[str, Any]:
    """The model's sharded state dict, holding tensors that the reader may fill before anything is written.

    FSDP1's sharded state dict holds copies of the local shards already; a module's own state dict holds its
    ``DTensor`` parameters themselves, which the reader would write one by one: those are replaced by copies.

    """
    state = module.state_dict()
    if dtensors:
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                state[name] = value.clone()
    return state


def _read_flat_optimizer_state(
    path: CheckpointPath,
    module: Module,
    model_state: Mapping[str, Any],
    key: str,
    optimizer: Optimizer,
    reader: "CheckedFileSystemReader",
    strict: bool,
) -> Callable[[], None]:
    """Read an FSDP1 optimizer's state (keyed by parameter names) and flatten it; return the call that loads it."""
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    optimizer_state = _dcp_call(
        f"Reading the optimizer state {key!r} from {str(path)!r}",
        lambda: load_sharded_optimizer_state_dict(
            model_state_dict=model_state, optimizer_key=key, storage_reader=reader
        ),
    )
    flattened = _dcp_call(
        f"Matching the optimizer state {key!r} of {str(path)!r} to the optimizer",
        lambda: FSDP.optim_state_dict_to_load(model=module, optim=optimizer, optim_state_dict=optimizer_state[key]),
    )
    # What `optimizer.load_state_dict` would refuse only after the model was written.
    sizes = [len(group["params"]) for group in flattened["param_groups"]]
    expected_sizes = [len(group["params"]) for group in optimizer.param_groups]
    if sizes != expected_sizes:
        raise _other_parameters(path, key, _group_sizes(sizes, expected_sizes))
    return functools.partial(optimizer.load_state_dict, flattened)


def _read_dtensor_optimizer_state(
    path: CheckpointPath,
    module: Module,
    model_state: Mapping[str, Any],
    key: str,
    optimizer: Optimizer,
    reader: "CheckedFileSystemReader",
    strict: bool,
) -> Callable[[], None]:
    """Read the state of an optimizer of ``DTensor`` parameters; return the call that loads it.

    The state is read into a copy of what ``get_optimizer_state_dict`` gives (keyed by parameter names, with the
    parameters' placements), which holds the optimizer's own tensors. Like upstream, that call first gives an
    optimizer without state its initial state (a step with zero gradients and learning rate).

    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    template = _dcp_call(
        f"Taking the state of the optimizer {key!r}", lambda: get_optimizer_state_dict(module, optimizer)
    )
    expected_groups = [group["params"] for group in template["param_groups"]]
    optimizer_state = {key: materialize(template)}
    planner = DefaultLoadPlanner(allow_partial_load=not strict)
    _dcp_call(
        f"Reading the optimizer state {key!r} from {str(path)!r}",
        lambda: dcp.load(optimizer_state, storage_reader=reader, planner=planner),
    )
    groups = [group.get("params") for group in optimizer_state[key]["param_groups"]]
    if groups != expected_groups:
        raise _other_parameters(path, key, _group_differences(groups, expected_groups))
    return functools.partial(set_optimizer_state_dict, module, optimizer, optim_state_dict=optimizer_state[key])


def _group_differences(saved: list[Any], expected: list[list[str]]) -> str:
    """How the parameter names of an optimizer's saved groups differ from the optimizer's."""
    saved_names = [name for group in saved if isinstance(group, list) for name in group]
    sizes = [len(group) if isinstance(group, list) else 0 for group in saved]
    differences = [_group_sizes(sizes, [len(group) for group in expected])]
    known = {name for group in expected for name in group}
    stored = {name for name in saved_names if isinstance(name, str)}
    unknown = [name for name in saved_names if not isinstance(name, str) or name not in known]
    if unknown:
        differences.append(f"not in the optimizer: {quoted_names(unknown)}")
    absent = [name for group in expected for name in group if name not in stored]
    if absent:
        differences.append(f"not in the checkpoint: {quoted_names(absent)}")
    if not unknown and not absent:
        differences.append("the same names, grouped or ordered differently")
    return "; ".join(differences)


def _group_sizes(saved: list[int], expected: list[int]) -> str:
    return (
        f"its parameter groups hold {sum(saved)} parameter(s) in {len(saved)} group(s), the optimizer's"
        f" {sum(expected)} in {len(expected)}"
    )


def _other_parameters(path: CheckpointPath, key: str, differences: str) -> CheckpointLoadError:
    return CheckpointLoadError(
        f"The optimizer state {key!r} of the sharded checkpoint {str(path)!r} belongs to other parameters:"
        f" {differences}. Nothing was loaded. Pass the optimizer that was saved with this model, with the same"
        " parameter groups."
    )


def read_sharded_metadata(path: CheckpointPath, weights_only: bool) -> dict[str, Any]:
    """Read the user's metadata of a sharded checkpoint onto the CPU (an empty dict where there is none)."""
    metadata_path = path / FABRIC_METADATA_FILENAME
    if not lexists(metadata_path):
        return {}
    with _open_regular_file(metadata_path, "metadata file of the sharded checkpoint") as stream:
        try:
            metadata = torch.load(stream, map_location="cpu", weights_only=weights_only)
        except Exception as error:
            fix = " If you trust the file, load it with `weights_only=False`." if weights_only else ""
            raise CheckpointLoadError(
                f"The metadata file {str(metadata_path)!r} of the sharded checkpoint could not be read:"
                f" {first_line(error)}.{fix}"
            ) from None
    if not isinstance(metadata, dict):
        raise CheckpointLoadError(f"The metadata file {str(metadata_path)!r} holds a {type(metadata).__name__}.")
    return metadata


class CheckedFileSystemReader(FileSystemReader):
    """A DCP reader for a checkpoint whose metadata was read by :func:`read_dcp_metadata`.

    It serves that metadata instead of unpickling ``.metadata`` again, opens only regular files, and with
    ``weights_only=True`` unpickles the non-tensor entries with ``torch.load(weights_only=True)``. From object storage,
    it fetches exactly the byte range of each entry that the plan asks for, and checks at the end of each file that
    the object is still the one it pinned (its size and ETag).

    Args:
        path: The checkpoint directory (a local directory, or a prefix in object storage).
        metadata: What :func:`read_dcp_metadata` returned for it (check the files with :func:`check_storage_files`).
        weights_only: Whether the non-tensor entries may hold only tensors and plain containers.

    """

    def __init__(self, path: CheckpointPath, metadata: Metadata, weights_only: bool = True) -> None:
        super().__init__(str(path))
        self.fs = _RegularFileSystem()
        self.path = self.fs.init_path(path)  # DCP's own file system made a local `Path` of it, even of a URL
        self._metadata = metadata
        self._weights_only = weights_only

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._weights_only:
            planner = _WeightsOnlyBytes(planner, self.path)  # type: ignore[assignment]
        return super().read_data(plan, planner)

    @override
    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> IO[bytes]:
        if isinstance(file, StorageFile):
            return _fetch_entry(file, sinfo)
        return super()._slice_file(file, sinfo)


@dataclass
class _SafetensorsSliceInfo(_StorageInfo):
    """Where a slice of a tensor is in a safetensors file: its raw bytes, in the shape of the slice."""

    shape: tuple[int, ...] = ()


class SafetensorsSlicesReader(CheckedFileSystemReader):
    """A DCP reader for the safetensors slices that :func:`read_safetensors_shards_metadata` described.

    A slice is stored as raw little-endian bytes in a safetensors file, not as a ``torch.save`` payload as in DCP's
    own files: each request reads the bytes of its slice (exactly their range, from object storage too) and copies the
    part the plan asks for. Nothing is unpickled.

    """

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    dtype = self._metadata.state_dict_metadata[item.storage_index.fqn].properties.dtype
                    data = bytearray(self._slice_file(stream, info).read(info.length))
                    if len(data) != info.length:
                        raise CheckpointLoadError(
                            f"The file {name!r} of {str(self.path)!r} ended within the slice of"
                            f" {item.storage_index.fqn!r}: it was truncated during the load. Re-copy or re-save it."
                        )
                    stored = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
                    part = stored.reshape(info.shape)
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                        part = part.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != part.size():  # `copy_` would broadcast
                        raise CheckpointLoadError(
                            f"The slice of {item.storage_index.fqn!r} read from {name!r} has the shape"
                            f" {list(part.size())}, the plan's target {list(target.size())}."
                        )
                    target.copy_(part)
                    planner.commit_tensor(item, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


def _fetch_entry(file: StorageFile, info: _StorageInfo) -> IO[bytes]:
    """The bytes of one entry of a remote shard file, exactly its range, as the stream DCP reads the entry from.

    They are fetched straight into the stream's own buffer: one copy of the entry in memory, not two.

    """
    stream = io.BytesIO()
    if info.length:
        stream.seek(info.length - 1)
        stream.write(b"\0")  # sizes the buffer once
        stream.seek(0)
        with stream.getbuffer() as buffer:
            file.read_into(info.offset, buffer, f"the entry at offset {info.offset}", cached=False)
    return stream


class _WeightsOnlyBytes:
    """A load planner's stand-in that hands it a non-tensor entry only once it unpickled with ``weights_only=True``.

    The planner unpickles what it gets with ``weights_only=False``: it gets the checked object pickled anew.
    """

    def __init__(self, planner: LoadPlanner, path: CheckpointPath) -> None:
        self._planner = planner
        self._path = path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.storage_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            reason = _unpickling_reason(error)
            refused = re.search(r"GLOBAL (\S+)", reason)
            if refused is None:
                raise CheckpointLoadError(
                    f"The entry {fqn!r} of the sharded checkpoint {str(self._path)!r} could not be read: {reason}."
                    " It is corrupt: re-copy or re-save the checkpoint."
                ) from None
            raise CheckpointLoadError(
                f"Refused to unpickle `{refused[1]}` from the entry {fqn!r} of the sharded checkpoint"
                f" {str(self._path)!r} (the payload was not run): a non-tensor entry may hold only tensors and plain"
                " containers. Load it with `weights_only=False` only if you trust its source."
            ) from None
        except Exception as error:
            raise CheckpointLoadError(
                f"The entry {fqn!r} of the sharded checkpoint {str(self._path)!r} could not be read:"
                f" {first_line(error)}. Re-copy or re-save the checkpoint."
            ) from None
        checked = io.BytesIO()
        torch.save(obj, checked)
        checked.seek(0)
        self._planner.load_bytes(read_item, checked)


class _RegularFileSystem(FileSystem):
    """DCP's file system, except that it opens nothing but regular files (a FIFO swapped in after the check).

    A path in object storage is opened as a :class:`~lightning_fsdp.loading.files.StorageFile`, which
    :meth:`CheckedFileSystemReader._slice_file` reads the entries' ranges from; once they are read, the object must
    still be the one pinned when the files were checked.

    """

    @override
    def init_path(self, path: str | os.PathLike | StoragePath) -> Any:
        return path if isinstance(path, StoragePath) else super().init_path(path)

    @override
    def concat_path(self, path: str | os.PathLike | StoragePath, suffix: str) -> Any:
        return path / suffix if isinstance(path, StoragePath) else super().concat_path(path, suffix)

    @override
    @contextmanager
    def create_stream(self, path: str | os.PathLike | StoragePath, mode: str) -> Iterator[Any]:
        if mode != "rb":
            raise ValueError(f"A sharded checkpoint is opened for reading only, got mode {mode!r}.")
        what = "shard file of the sharded checkpoint"
        if isinstance(path, StoragePath):
            with _storage_file(path, what) as file:
                yield file
            return
        with _open_regular_file(Path(path), what) as stream:
            yield stream


class _RefusedGlobal(Exception):
    """A global that the metadata unpickler does not allow (its name is the message)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file: its classes and the torch dtypes and layouts they hold, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed_globals().get((module, name))
        if allowed is None:
            raise _RefusedGlobal(printable(f"{module}.{name}"))
        return allowed


def _allowed_globals() -> dict[tuple[str, str], Any]:
    if not _ALLOWED:
        from torch.serialization import _get_layout  # turns a layout's name into the layout (a dictionary lookup)

        _ALLOWED.update({(obj.__module__, obj.__qualname__): obj for obj in (*_METADATA_CLASSES, _get_layout)})
        for name, value in vars(torch).items():
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                _ALLOWED["torch", name] = value
        # ``StorageMeta.checkpoint_id`` is the path the checkpoint was saved to; pathlib moved to a package in 3.13.
        for cls in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath):
            _ALLOWED["pathlib", cls.__name__] = cls
            _ALLOWED[cls.__module__, cls.__name__] = cls
    return _ALLOWED


_ALLOWED: dict[tuple[str, str], Any] = {}


@contextmanager
def _open_regular_file(path: CheckpointPath, what: str) -> Iterator[IO[bytes]]:
    """Open ``path`` for reading without blocking on a FIFO, and only if it is a regular file.

    Once it was read (or its reading failed), it must be the file opened, unchanged, as an object in object storage,
    read by range requests, must be the object pinned (see :func:`_storage_file`).

    """
    if isinstance(path, StoragePath):
        with _storage_file(path, what) as file, file.stream() as stream:
            yield cast(IO[bytes], stream)
        return
    require_regular_file(path, what)
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise CheckpointLoadError(f"The {what} {str(path)!r} cannot be opened: {error.strerror or error}.") from None
    with os.fdopen(descriptor, "rb") as stream:
        opened = os.fstat(descriptor)
        if not stat.S_ISREG(opened.st_mode):
            require_regular_file(path, what)  # it was replaced after the first check: raises, naming what it is now
            raise CheckpointLoadError(f"The {what} {str(path)!r} was replaced while it was being opened.")
        if hasattr(os, "set_blocking"):
            os.set_blocking(descriptor, True)
        try:
            yield stream
        except Exception:
            check_local_file_unchanged(Path(path), descriptor, opened)  # a rewritten file says so, not what it broke
            raise
        check_local_file_unchanged(Path(path), descriptor, opened)


@contextmanager
def _storage_file(path: StoragePath, what: str) -> Iterator[StorageFile]:
    """Open an object for range requests; once it was read (or its reading failed), it must be the object pinned."""
    file = path.open(what)
    try:
        yield file
    except Exception:
        file.check_unchanged()  # an object replaced during the load says so, not what its new bytes broke
        raise
    file.check_unchanged()


def _metadata_problems(metadata: Any) -> list[str]:
    """What makes unpickled DCP metadata unusable: wrong types, chunks outside their tensor, records outside the dir."""
    if not isinstance(metadata, Metadata):
        return [f"it holds a {type(metadata).__name__}, not torch's checkpoint `Metadata`"]
    entries = metadata.state_dict_metadata
    storage = metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return ["its entries or storage records are not dictionaries"]
    problems = []
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            problems.append(f"an entry is named {fqn!r}, not a string")
        elif isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                problems.append(f"the entry {fqn!r} has no storage record")
        elif isinstance(entry, TensorStorageMetadata):
            problems += [f"the tensor {fqn!r}: {problem}" for problem in _tensor_entry_problems(fqn, entry, storage)]
        else:
            problems.append(f"the entry {fqn!r} is a {type(entry).__name__}")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            problems.append(f"a storage record is a {type(info).__name__} keyed by a {type(index).__name__}")
        elif not _is_file_name(info.relative_path):
            problems.append(f"the entry {index.fqn!r} is stored in {info.relative_path!r}, outside the checkpoint")
        elif not (_is_count(info.offset) and _is_count(info.length)):
            problems.append(f"the entry {index.fqn!r} has offset {info.offset!r} and length {info.length!r}")
        elif info.transform_descriptors is not None and not all(isinstance(d, str) for d in info.transform_descriptors):
            problems.append(f"the entry {index.fqn!r} has transforms {info.transform_descriptors!r}")
    planner_data = metadata.planner_data
    if planner_data is not None:
        if not isinstance(planner_data, dict):
            problems.append(f"its planner data is a {type(planner_data).__name__}")
        else:
            problems += [
                f"the entry {fqn!r} has the path {keys!r} in the planner data"
                for fqn, keys in planner_data.items()
                if not _is_state_dict_path(fqn, keys, len(entries))
            ]
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        problems.append(f"its storage meta is a {type(metadata.storage_meta).__name__}")
    return problems


def _tensor_entry_problems(fqn: str, entry: TensorStorageMetadata, storage: dict) -> list[str]:
    size = entry.size
    if not isinstance(entry.properties, TensorProperties) or not isinstance(entry.properties.dtype, torch.dtype):
        return ["its properties are not tensor properties with a dtype"]
    if not isinstance(size, torch.Size) or not all(_is_count(n) for n in size):
        return [f"its size is {size!r}"]
    if not isinstance(entry.chunks, list):
        return [f"its chunks are a {type(entry.chunks).__name__}"]
    problems = []
    for chunk in entry.chunks:
        if not isinstance(chunk, ChunkStorageMetadata) or not (
            isinstance(chunk.offsets, torch.Size) and isinstance(chunk.sizes, torch.Size)
        ):
            problems.append(f"a chunk is a {type(chunk).__name__}")
        elif not (len(chunk.offsets) == len(chunk.sizes) == len(size)) or not all(
            _is_count(o) and _is_count(n) and o + n <= total
            for o, n, total in zip(chunk.offsets, chunk.sizes, size, strict=False)
        ):
            problems.append(f"the chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} is outside {list(size)}")
        elif MetadataIndex(fqn, chunk.offsets) not in storage:
            problems.append(f"the chunk at {list(chunk.offsets)} has no storage record")
    if not problems:
        problems += _coverage_problems(entry.chunks, size)
    return problems


def _coverage_problems(chunks: list[ChunkStorageMetadata], size: torch.Size) -> list[str]:
    """The chunks of a tensor must cover it exactly: no element twice, none left out."""
    if sum(math.prod(chunk.sizes) for chunk in chunks) != math.prod(size):
        return [f"its chunks hold {sum(math.prod(c.sizes) for c in chunks)} elements, not {math.prod(size)}"]
    ordered = sorted(chunks, key=lambda chunk: tuple(chunk.offsets))
    for index, first in enumerate(ordered):
        for second in ordered[index + 1 :]:
            if all(
                max(a, b) < min(a + n, b + m)
                for a, n, b, m in zip(first.offsets, first.sizes, second.offsets, second.sizes, strict=True)
            ):
                return [f"its chunks at {list(first.offsets)} and {list(second.offsets)} overlap"]
    return []


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_file_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _is_state_dict_path(fqn: Any, keys: Any, entry_count: int) -> bool:
    # DCP names a nested entry by its path, joined with dots; a list index can be no larger than the entry count.
    return (
        isinstance(keys, tuple)
        and all(isinstance(k, str) or (_is_count(k) and k <= entry_count) for k in keys)
        and fqn == ".".join(map(str, keys))
    )


def _top_level_keys(metadata: Metadata) -> set[str]:
    return {keys[0] for keys in _entry_paths(metadata).values()}


def _entry_paths(metadata: Metadata) -> dict[str, tuple[Any, ...]]:
    """Each entry's path in the state dict that was saved: from the planner data, else its name split at the first dot.

    DCP joins the path with dots into the entry's name (``("model", "0.weight")`` is ``model.0.weight``), so only the
    planner data tells ``("model.0.weight",)``, a tensor at the top level, from it.

    """
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {fqn: tuple(map(str, planner_data.get(fqn) or fqn.split(".", 1))) for fqn in metadata.state_dict_metadata}


def _check_against_model(
    metadata: Metadata, prefix: str, model_state: Mapping[str, Any], optimizer_keys: Sequence[str], strict: bool
) -> str:
    """Compare the checkpoint's entries with the model's state and raise one error listing the problems.

    ``prefix`` is that of the model's entries (``"model."``), or empty where the checkpoint is the module's state.

    Returns:
        What ``strict=False`` leaves out (missing and unexpected keys), or an empty string.

    """
    entries = metadata.state_dict_metadata
    mismatches: list[str] = []
    missing = []
    for name, value in model_state.items():
        entry = entries.get(prefix + name)
        if entry is None:
            missing.append(name)
        elif isinstance(value, torch.Tensor):
            problem = _tensor_mismatch(entry, tuple(value.size()), value.dtype)
            if problem:
                mismatches.append(f"{prefix + name!r}: {problem}")
        elif not isinstance(entry, BytesStorageMetadata):
            mismatches.append(f"{prefix + name!r}: checkpoint tensor, model {type(value).__name__}")
    unexpected = [
        fqn[len(prefix) :] for fqn in entries if fqn.startswith(prefix) and fqn[len(prefix) :] not in model_state
    ]
    for key in optimizer_keys:
        mismatches += _optimizer_mismatches(entries, key, model_state)

    problems = []
    if strict and missing:
        problems.append(f"{len(missing)} missing key(s), in the model but not the checkpoint: {quoted_names(missing)}")
    if strict and unexpected:
        problems.append(
            f"{len(unexpected)} unexpected key(s), in the checkpoint but not the model: {quoted_names(unexpected)}"
        )
    if mismatches:
        problems.append(f"{len(mismatches)} entr(y/ies) that cannot be loaded: {shown_items(mismatches)}")
    if problems:
        leaving = f"leaving the model's {len(missing)} missing tensor(s) ({quoted_names(missing)}) as they were, "
        fix = (
            f" To load only the tensors that match, {leaving if missing else ''}pass `strict=False`."
            if strict and not mismatches
            else ""
        )
        raise CheckpointLoadError(
            "The sharded checkpoint does not match the model; nothing was loaded and the model is unchanged.\n- "
            + "\n- ".join(problems)
            + fix
        )
    skipped = []
    if missing:
        skipped.append(f"{len(missing)} missing key(s) left as they were ({quoted_names(missing)})")
    if unexpected:
        skipped.append(f"{len(unexpected)} unexpected key(s) ignored ({quoted_names(unexpected)})")
    return "; ".join(skipped)


def _optimizer_mismatches(entries: Mapping[str, Any], key: str, model_state: Mapping[str, Any]) -> list[str]:
    # FSDP names the state of a parameter `<optimizer>.state.<parameter name>.<state name>`; state that is not a
    # scalar (Adam's `exp_avg`, SGD's `momentum_buffer`) has the parameter's shape.
    prefix = f"{key}.state."
    mismatches = []
    for fqn, entry in entries.items():
        if not fqn.startswith(prefix):
            continue
        rest = fqn[len(prefix) :]
        owner = _owning_tensor(rest, model_state)
        if owner is None:
            mismatches.append(f"{fqn!r}: state of a parameter the model does not have")
        elif isinstance(entry, TensorStorageMetadata) and entry.size.numel() != 1:
            shape = tuple(model_state[owner].size())
            if tuple(entry.size) != shape:
                mismatches.append(f"{fqn!r}: checkpoint {_shape(tuple(entry.size))}, parameter {_shape(shape)}")
    return mismatches


def _owning_tensor(name: str, model_state: Mapping[str, Any]) -> str | None:
    """The longest tensor name of the model that ``name`` extends by at least one dotted part."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:end])
        if isinstance(model_state.get(candidate), torch.Tensor):
            return candidate
    return None


def _tensor_mismatch(entry: Any, shape: tuple[int, ...], dtype: torch.dtype) -> str:
    if not isinstance(entry, TensorStorageMetadata):
        return f"checkpoint holds a non-tensor object, model a tensor of shape {_shape(shape)}"
    if tuple(entry.size) != shape:
        return f"checkpoint shape {_shape(tuple(entry.size))}, model {_shape(shape)}"
    stored = entry.properties.dtype
    if stored != dtype and not (stored.is_floating_point and dtype.is_floating_point):
        return f"checkpoint dtype {stored}, model {dtype} (cannot be cast)"
    return ""


def _dcp_call(what: str, call: Callable[[], _T]) -> _T:
    """Run a call into DCP, and turn its failure (on any rank) into one short error."""
    try:
        return call()
    except CheckpointLoadError:
        raise
    except CheckpointException as error:
        ranks = tuple(sorted(error.failures))
        causes = [failure[0] for failure in error.failures.values()]
        own = next((cause for cause in causes if isinstance(cause, CheckpointLoadError)), None)
        if own is not None:
            detail = str(own)
        elif causes and isinstance(causes[0], pickle.UnpicklingError):
            detail = (
                f"{_unpickling_reason(causes[0])}. An entry is corrupt, or is not a tensor as torch writes it: re-copy"
                " or re-save the checkpoint."
            )
        else:
            detail = first_line(causes[0]) if causes else "no details"
        cause = own if own is not None else error
        message = f"{what} failed on rank(s) {', '.join(map(str, ranks))}: {detail}"
        raise CheckpointLoadError(message, ranks, cause) from unexpected_cause(cause)
    except Exception as error:
        raise CheckpointLoadError(f"{what} failed: {first_line(error)}", cause=error) from unexpected_cause(error)


def _unpickling_reason(error: BaseException) -> str:
    """The one sentence of ``torch.load``'s weights-only error that says what was refused (it spans a page)."""
    text = str(error)
    if _WEIGHTS_ONLY_REASON not in text:
        return first_line(error)
    reason = " ".join(text.split(_WEIGHTS_ONLY_REASON, 1)[1].split())
    return printable(reason.split(". ", 1)[0].split(" Check the documentation", 1)[0].rstrip("."))


def _shape(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))})" if len(shape) != 1 else f"({shape[0]},)"
