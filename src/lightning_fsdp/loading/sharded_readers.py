"""The readers of a sharded checkpoint's tensors and entries: torch's distributed checkpoint (DCP) reader, guarded.

:class:`CheckedFileSystemReader` serves the metadata that :mod:`lightning_fsdp.loading.sharded_metadata` read and
checked, opens nothing but regular files (a FIFO swapped in after the check is refused), unpickles the non-tensor
entries of the ``.distcp`` files with ``torch.load(weights_only=True)`` (torch uses ``weights_only=False``), and from
object storage fetches exactly the byte range of each entry the plan asks for, by range requests, never a whole shard
file and with no local copy; an object replaced during the load is an error. :class:`SafetensorsSlicesReader` reads
the safetensors slices of torch's ``HuggingFaceStorageWriter`` as raw bytes, unpickling nothing.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import io
import os
import pickle
import re
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from typing_extensions import override

from lightning_fsdp.loading.errors import (
    CheckpointLoadError,
    printable,
)
from lightning_fsdp.loading.files import (
    CheckpointPath,
    StorageFile,
    StoragePath,
)
from lightning_fsdp.loading.sharded_metadata import _open_regular_file, _storage_file
from lightning_fsdp.loading.torch_pickle import first_line

_WEIGHTS_ONLY_REASON = "WeightsUnpickler error:"


class CheckedFileSystemReader(FileSystemReader):
    """A DCP reader for a checkpoint whose metadata was read by :func:`~.read_dcp_metadata`.

    It serves that metadata instead of unpickling ``.metadata`` again, opens only regular files, and with
    ``weights_only=True`` unpickles the non-tensor entries with ``torch.load(weights_only=True)``. From object storage,
    it fetches exactly the byte range of each entry that the plan asks for, and checks at the end of each file that
    the object is still the one it pinned (its size and ETag).

    Args:
        path: The checkpoint directory (a local directory, or a prefix in object storage).
        metadata: What :func:`~.read_dcp_metadata` returned for it (check the files with :func:`~.check_storage_files`).
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


class SafetensorsSlicesReader(CheckedFileSystemReader):
    """A DCP reader for the safetensors slices that :func:`~.read_safetensors_shards_metadata` described.

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


def _unpickling_reason(error: BaseException) -> str:
    """The one sentence of ``torch.load``'s weights-only error that says what was refused (it spans a page)."""
    text = str(error)
    if _WEIGHTS_ONLY_REASON not in text:
        return first_line(error)
    reason = " ".join(text.split(_WEIGHTS_ONLY_REASON, 1)[1].split())
    return printable(reason.split(". ", 1)[0].split(" Check the documentation", 1)[0].rstrip("."))
