"""A sharded checkpoint directory's metadata, read without running code and checked before any tensor is read.

The DCP ``.metadata`` file is unpickled with an allow-list of torch's checkpoint metadata types (torch unpickles it
with plain :mod:`pickle`) and checked (chunks that tile each tensor exactly, storage records inside the directory),
``meta.pt`` is read with ``weights_only``, and every storage file must be a regular file that holds every byte the
metadata places in it, so a FIFO or a truncated shard gives an error instead of a hang or a half-read model. The
safetensors slices of torch's ``HuggingFaceStorageWriter`` (no ``.metadata``) are described as DCP chunks from their
headers and checked the same way. What the caller asks for (the model's entry, the optimizers', the metadata keys) is
checked against these before anything is read. The reading is :mod:`lightning_fsdp.loading.sharded_readers`'s, the
load into the model :mod:`lightning_fsdp.loading.sharded`'s.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import math
import os
import pathlib
import pickle
import stat
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
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

from lightning_fsdp.loading.errors import (
    CheckpointKeyError,
    CheckpointLoadError,
    printable,
    shown_items,
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
from lightning_fsdp.loading.torch_pickle import first_line

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
        raise CheckpointKeyError(
            f"The sharded checkpoint {str(path)!r} has no entry {module_key!r} for the model. Its entries are"
            f" {entries}: pass the model under the key it was saved with."
        )
    absent = sorted(
        [key for key in optimizer_keys if key not in stored] + [k for k in metadata_keys if k not in metadata]
    )
    if absent and strict:
        raise CheckpointKeyError(
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
    state dict, its names at the top level; :class:`~.SafetensorsSlicesReader` reads it.

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


@dataclass
class _SafetensorsSliceInfo(_StorageInfo):
    """Where a slice of a tensor is in a safetensors file: its raw bytes, in the shape of the slice."""

    shape: tuple[int, ...] = ()


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
