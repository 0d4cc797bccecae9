"""Consolidate a sharded (distributed) checkpoint directory into one ``torch.save`` file, streaming, offline.

Lightning's ``consolidate_checkpoint`` (``python -m lightning.fabric.utilities.consolidate_checkpoint``) rebuilds the
whole state dict in one process (``_load_distributed_checkpoint``: torch's ``_EmptyStateDictLoadPlanner`` allocates
every tensor, DCP reads them all, the extra ``meta.pt`` is merged in) and passes it to ``torch.save``: its memory is
the whole checkpoint. This writes the same file one tensor at a time:

1. The DCP metadata is read and checked once by the package's validated reader
   (:func:`~lightning_fsdp.loading.sharded_metadata.read_checked_metadata`: allow-listed unpickling, chunks that tile
   their tensors, every shard file a regular file long enough). Nothing else parses it.
2. The non-tensor entries (DCP's byte entries: learning rates, parameter names, ...) and ``meta.pt`` are read whole
   (they are small), through the same reader.
3. The state is rebuilt as Lightning's consolidation rebuilds it, from the metadata alone: each entry placed at its path
   in the planner data (torch's ``set_element``, as its ``_EmptyStateDictLoadPlanner`` does), in the metadata's order,
   then updated with ``meta.pt``; every tensor is a stand-in that names a storage of the archive
   (:class:`~lightning_fsdp.saving.archive.TensorStandIn`: contiguous, ``requires_grad=False``, as
   ``torch.empty`` gives). It is pickled, and every record of the zip archive is placed
   (:func:`~lightning_fsdp.saving.archive.plan_records`) before any tensor is read.
4. Each tensor is read from its shards through the same reader and written at its planned offset, with its CRC-32
   computed as it goes; its local header follows. Where the saved chunks are blocks of whole rows (FSDP1's and
   FSDP2's ``Shard(0)`` shards), each chunk is read and written on its own; otherwise (a column split) the tensor is
   assembled in one buffer first.

Memory: the non-tensor objects (and their pickle) plus, at any time, one tensor in flight: two copies of its largest
saved chunk (the reader's ``torch.load`` of the chunk and the buffer it is copied into) where its chunks are blocks
of rows, else the whole tensor plus its largest chunk. Never more than twice the largest tensor. Freed buffers are
handed back to the system after each chunk (glibc's ``malloc_trim``), else its heap keeps several.

The file is written as ``.<name>.<id>.tmp`` in the output's directory, flushed, and renamed to its name; a failure
(or Ctrl-C) removes it, so the output path never holds a partial file.
"""

import math
import os
import secrets
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_fsdp.distributed.memory import return_freed_memory
from lightning_fsdp.loading.errors import CheckpointLoadError, quoted_names
from lightning_fsdp.saving import archive
from lightning_fsdp.saving.consolidated import temporary_path
from lightning_fsdp.saving.consolidated_write import _fsync_directory, _pwrite_all


@dataclass
class ConsolidationResult:
    """What :func:`consolidate_sharded_checkpoint` wrote."""

    output: str
    tensors: int
    """The tensors read from the shards (each one storage of the file)."""
    tensor_bytes: int
    objects: list[str] = field(default_factory=list)
    """The non-tensor entries of the shards (their dotted paths), pickled as they were loaded."""
    metadata_keys: list[str] = field(default_factory=list)
    """The top-level keys that ``meta.pt`` added or replaced (``"step"``, hyperparameters)."""
    largest_tensor_bytes: int = 0


def consolidate_sharded_checkpoint(
    source: str | Path,
    output: str | Path,
    weights_only: bool = True,
    on_bytes: Callable[[int], None] | None = None,
) -> ConsolidationResult:
    """Write the sharded checkpoint ``source`` as the one ``torch.save`` file that Lightning's consolidation writes.

    The result has the keys, nesting, dtypes, shapes and values that
    ``torch.save(_load_distributed_checkpoint(source), output)`` gives: the model's state, the optimizer state as DCP
    holds it (keyed by parameter name), and the entries of ``meta.pt``. ``torch.load``, Fabric's ``fabric.load`` and
    this package's loader read it.

    Args:
        source: A directory written by ``fabric.save`` with ``state_dict_type="sharded"`` (FSDP1) or by
            ``ModelParallelStrategy`` (FSDP2), or any torch distributed checkpoint (it must have a ``.metadata``).
        output: The file to write; it must not exist.
        weights_only: Unpickle only torch's metadata types, tensors and plain containers. ``False`` only for a
            checkpoint you trust.
        on_bytes: Called with the byte count of every piece of tensor data written (for progress).

    Raises:
        CheckpointLoadError: If the checkpoint is invalid or unreadable, holds a tensor this writer cannot store (a
            dtype without a ``torch.save`` storage class here, such as float8), or the output exists. The output path
            is left as it was.

    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_fsdp.loading.sharded_metadata import read_checked_metadata, read_sharded_metadata
    from lightning_fsdp.loading.sharded_readers import CheckedFileSystemReader

    source, output = Path(source), Path(output)
    if output.exists() or output.is_symlink():
        raise CheckpointLoadError(f"The output {str(output)!r} exists: choose another path, or remove it first.")
    if not output.parent.is_dir():
        raise CheckpointLoadError(f"The output's directory {str(output.parent)!r} does not exist: create it first.")
    metadata = read_checked_metadata(source, weights_only)
    entries = metadata.state_dict_metadata
    unsupported = [
        f"{fqn} ({entry.properties.dtype})"
        for fqn, entry in entries.items()
        if isinstance(entry, TensorStorageMetadata) and not archive.storage_class_supported(entry.properties.dtype)
    ]
    if unsupported:
        raise CheckpointLoadError(
            f"The sharded checkpoint {str(source)!r} holds tensors that this conversion cannot stream into a"
            f" `torch.save` file: {quoted_names(unsupported)}. Nothing was written. Consolidate it in one process"
            " with `python -m lightning.fabric.utilities.consolidate_checkpoint` instead (it needs the whole"
            " checkpoint in memory)."
        )
    extra = read_sharded_metadata(source, weights_only)
    reader = CheckedFileSystemReader(source, metadata, weights_only=weights_only)
    reader.set_up_storage_reader(metadata, True)
    objects = _read_objects(reader, source, metadata, weights_only)

    tensors: list[tuple[str, TensorStorageMetadata, archive.StorageRef]] = []
    state: dict[str, Any] = {}
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            ref = archive.StorageRef(str(len(tensors)), entry.properties.dtype, math.prod(entry.size))
            tensors.append((fqn, entry, ref))
            value: Any = archive.TensorStandIn(ref, tuple(entry.size))
        else:
            value = objects[fqn]
        _place(state, metadata.planner_data, fqn, value)
    state.update(extra)

    small: list[tuple[str, bytes]] = []
    pickled = _pickle(state, source, len(tensors), small)
    records = [
        (f"{archive.PREFIX}/data.pkl", pickled),
        *[(archive.storage_record_name(ref.key), ref.numel * ref.dtype.itemsize) for _, _, ref in tensors],
        *small,
        *archive.small_records(),
    ]
    placed, end = archive.plan_records([(name, d if isinstance(d, int) else len(d)) for name, d in records], 0)
    tmp = temporary_path(output, secrets.token_hex(8))
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        directory = []
        for layout, (_, data) in zip(placed, records, strict=True):
            if isinstance(data, int):
                continue  # a tensor of the shards: written below
            crc = zlib.crc32(data)
            _pwrite_all(fd, memoryview(archive.local_header(layout, crc) + data), layout.header_offset)
            directory.append((layout, crc))
        for (fqn, entry, _), layout in zip(tensors, placed[1 : 1 + len(tensors)], strict=True):
            crc = _write_tensor(reader, source, fd, fqn, entry, layout.data_offset, on_bytes)
            _pwrite_all(fd, memoryview(archive.local_header(layout, crc)), layout.header_offset)
            directory.append((layout, crc))
        directory.sort(key=lambda item: item[0].header_offset)
        central = archive.central_directory(directory, end)
        _pwrite_all(fd, memoryview(central), end)
        os.ftruncate(fd, end + len(central))
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, output)
        _fsync_directory(output.parent)
    except BaseException:  # Ctrl-C too: the output path never holds a partial file
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return ConsolidationResult(
        output=str(output),
        tensors=len(tensors),
        tensor_bytes=sum(ref.numel * ref.dtype.itemsize for _, _, ref in tensors),
        objects=list(objects),
        metadata_keys=[str(key) for key in extra],
        largest_tensor_bytes=max((ref.numel * ref.dtype.itemsize for _, _, ref in tensors), default=0),
    )


def _place(state: dict[str, Any], planner_data: Any, fqn: str, value: Any) -> None:
    """Put ``value`` where Lightning's consolidation puts it: at its saved path, else under its name."""
    from torch.distributed.checkpoint._traverse import set_element

    if isinstance(planner_data, dict) and fqn in planner_data:
        set_element(state, planner_data[fqn], value)
    else:
        state[fqn] = value


def _pickle(state: dict[str, Any], source: Path, first_key: int, small: list[tuple[str, bytes]]) -> bytes:
    """``state`` pickled as ``torch.save`` pickles it; tensors held in non-tensor entries go to ``small``."""

    def new_storage(tensor: Tensor) -> archive.StorageRef:
        from torch.serialization import location_tag

        storage = tensor.untyped_storage()
        key = str(first_key + len(small))
        small.append((archive.storage_record_name(key), bytes(storage.cpu()) if storage.nbytes() else b""))
        return archive.StorageRef(key, tensor.dtype, storage.nbytes() // tensor.dtype.itemsize, location_tag(storage))

    try:
        return archive.pickle_state(state, new_storage)
    except archive.UnpicklableTensor as error:
        raise CheckpointLoadError(
            f"A non-tensor entry of the sharded checkpoint {str(source)!r} holds {error}, which this conversion cannot"
            " write as `torch.save` does. Nothing was written. Consolidate it with"
            " `python -m lightning.fabric.utilities.consolidate_checkpoint` instead."
        ) from None


class _Targets:
    """The part of a DCP load planner that the reader calls: where each read lands, and the byte entries read."""

    def __init__(self, target: Tensor | None = None) -> None:
        self.target = target
        self.objects: dict[str, bytes] = {}

    def resolve_tensor(self, item: Any) -> Tensor:
        assert self.target is not None
        view = self.target
        for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths, strict=True)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, item: Any, tensor: Tensor) -> None:
        pass

    def load_bytes(self, item: Any, value: Any) -> None:
        self.objects[item.storage_index.fqn] = value.getvalue()


def _read(reader: Any, source: Path, what: str, items: list, targets: _Targets) -> None:
    from torch.distributed.checkpoint.planner import LoadPlan

    from lightning_fsdp.loading.sharded import _dcp_call

    _dcp_call(f"Reading {what} from {str(source)!r}", lambda: reader.read_data(LoadPlan(items), targets).wait())


def _read_objects(reader: Any, source: Path, metadata: Any, weights_only: bool) -> dict[str, Any]:
    """Every non-tensor entry of the checkpoint, unpickled as Lightning's consolidation does (onto the CPU)."""
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio

    names = [fqn for fqn, entry in metadata.state_dict_metadata.items() if isinstance(entry, BytesStorageMetadata)]
    targets = _Targets()
    items = [_create_read_item_for_byteio(MetadataIndex(fqn), 0, MetadataIndex(fqn), 0, 0) for fqn in names]
    if items:
        _read(reader, source, "the non-tensor entries", items, targets)
    # With `weights_only`, the reader checked each entry with `torch.load(weights_only=True)` before handing it on.
    return {
        fqn: torch.load(io.BytesIO(targets.objects[fqn]), map_location="cpu", weights_only=weights_only)
        for fqn in names
    }


def _write_tensor(
    reader: Any,
    source: Path,
    fd: int,
    fqn: str,
    entry: Any,
    data_offset: int,
    on_bytes: Callable[[int], None] | None,
) -> int:
    """Read the tensor ``fqn`` from its shards, write it at ``data_offset``; return its CRC-32."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    size = tuple(entry.size)
    dtype = entry.properties.dtype
    row_bytes = math.prod(size[1:]) * dtype.itemsize if size else dtype.itemsize
    chunks = sorted(entry.chunks, key=lambda chunk: tuple(chunk.offsets))
    row_blocks = all(
        all(offset == 0 for offset in chunk.offsets[1:]) and tuple(chunk.sizes[1:]) == size[1:] for chunk in chunks
    )
    if not row_blocks or not size:
        # One buffer for the whole tensor, filled chunk by chunk (each chunk's read is in flight alone).
        chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=torch.Size(size))]
    crc = 0
    for chunk in chunks:
        # The metadata's chunks of a tensor tile it exactly (checked when it was read): blocks of rows sorted by
        # their first row are consecutive byte ranges, so the record's CRC-32 runs through them in order.
        buffer = torch.empty(tuple(chunk.sizes), dtype=dtype)
        items = create_read_items_for_chunk_list(fqn, entry, [chunk])
        _read(reader, source, f"the tensor {fqn!r}", items, _Targets(buffer))
        data = memoryview(buffer.reshape(-1).view(torch.uint8).numpy()) if buffer.numel() else memoryview(b"")
        _pwrite_all(fd, data, data_offset + (chunk.offsets[0] * row_bytes if size else 0))
        crc = zlib.crc32(data, crc)
        if on_bytes is not None:
            on_bytes(data.nbytes)
        del data, buffer
        # glibc keeps freed chunks of this size in its heap, fragmented: without this the peak grows to several chunks.
        return_freed_memory()
    return crc
