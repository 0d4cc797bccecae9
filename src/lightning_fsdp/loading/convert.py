"""Describe a checkpoint, and convert any readable checkpoint into a sharded (distributed) checkpoint.

Conversion streams tensor by tensor, in row chunks: each chunk is read with a positioned read of exactly its bytes,
written, and dropped, so peak memory stays near the largest chunk whatever the file's size (a pickled file converted
with ``weights_only=False`` is the exception: it is read whole). Every zip record is checked against its CRC. The
output is a torch distributed checkpoint directory with a ``meta.pt``,
which ``fabric.load(path, {"model": model})`` reads shard by shard; each chunk holds a range of rows, so a rank reads
only the chunks that overlap its shard.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import dataclasses
import math
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.formats import (
    FABRIC_METADATA_FILENAME,
    CheckpointFormat,
    OpenedCheckpoint,
    detect_checkpoint,
    open_checkpoint,
    open_every_tensor,
    read_safetensors_shards,
    safetensors_shards_specs,
)
from lightning_fsdp.loading.sources import TensorSource, TensorSpec, materialize, walk_tensors

if TYPE_CHECKING:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItem

#: Rows per chunk are chosen so that a chunk holds about this many bytes.
DEFAULT_CHUNK_BYTES = 32 * 2**20
_MIN_CHUNK_BYTES = 2**20


@dataclass
class CheckpointSummary:
    """What :func:`describe_checkpoint` found."""

    path: str
    format: str
    kind: str
    """``raw state dict``, ``fabric checkpoint``, ``sharded checkpoint`` or ``hugging face checkpoint``."""
    lazy: bool
    """Whether ranks can read only their own slices (no full copy in memory)."""
    files: int
    file_bytes: int
    tensors: int
    tensor_bytes: int
    dtypes: dict[str, int]
    """Number of tensors of each dtype."""
    top_level_keys: list[str]
    largest_tensor: str | None
    largest_tensor_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def describe_checkpoint(path: str | Path, weights_only: bool = True) -> CheckpointSummary:
    """Tell what a checkpoint holds without reading its tensor data (the same reader as loading, so the same checks)."""
    detected = detect_checkpoint(path)
    if detected.format is CheckpointFormat.FABRIC_SHARDED:
        specs, top_level = _sharded_specs(detected.path, weights_only)
        kind = "sharded checkpoint"
    elif detected.format is CheckpointFormat.SAFETENSORS_SHARDS:
        specs = safetensors_shards_specs(read_safetensors_shards(detected))
        top_level = sorted(specs)
        kind = "sharded checkpoint (safetensors slices)"
    else:
        opened = open_every_tensor(detected, weights_only)
        try:
            specs = dict(opened.source.specs())
            top_level = opened.top_level_keys or sorted(specs)
        finally:
            opened.close()
        if detected.format is CheckpointFormat.HF_INDEX:
            kind = "hugging face checkpoint"
        else:
            kind = "raw state dict" if opened.raw else "fabric checkpoint"
    largest = max(specs.items(), key=lambda item: item[1].nbytes, default=(None, None))
    return CheckpointSummary(
        path=str(detected.path),
        format=detected.format.value,
        kind=kind,
        lazy=not detected.reads_whole(weights_only),
        files=len(detected.files),
        file_bytes=detected.nbytes,
        tensors=len(specs),
        tensor_bytes=sum(spec.nbytes for spec in specs.values()),
        dtypes=dict(sorted(Counter(str(spec.dtype).removeprefix("torch.") for spec in specs.values()).items())),
        top_level_keys=top_level,
        largest_tensor=largest[0],
        largest_tensor_bytes=largest[1].nbytes if largest[1] is not None else 0,
    )


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` wrote."""

    output: str
    tensors: int
    tensor_bytes: int
    chunks: int
    metadata_keys: list[str] = field(default_factory=list)
    skipped_keys: list[str] = field(default_factory=list)
    """Entries of a Fabric checkpoint that hold tensors but not the module's state (optimizer states): not converted."""


def convert_checkpoint(
    source: str | Path,
    output: str | Path,
    module_key: str = "model",
    weights_only: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_chunk: Callable[[int], None] | None = None,
) -> ConversionResult:
    """Write the module state of ``source`` (any format the loader reads) as a sharded checkpoint in ``output``.

    Args:
        source: A raw state dict, a Fabric full checkpoint, a safetensors file or a Hugging Face checkpoint.
        output: A directory to create; it must not exist yet, or be empty.
        module_key: The key the module is stored under in the output (and found under in a Fabric checkpoint);
            load the result with ``fabric.load(output, {module_key: model})``.
        weights_only: Unpickle only tensors and plain containers.
        chunk_bytes: About how many bytes each written chunk holds at most (never more than half the largest tensor).
        on_chunk: Called with the byte count of every chunk written (for progress).

    """
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise CheckpointLoadError(f"The output {str(output)!r} exists and is not an empty directory: choose another.")
    detected = detect_checkpoint(source)
    if detected.format is CheckpointFormat.FABRIC_SHARDED:
        raise CheckpointLoadError(
            f"{str(detected.path)!r} is a sharded checkpoint already: there is nothing to do. To consolidate it into"
            " one file, call `lightning_fsdp.saving.offline.consolidate_sharded_checkpoint` (what"
            " `lightning-fsdp convert DIRECTORY FILE` runs)."
        )
    if detected.format is CheckpointFormat.SAFETENSORS_SHARDS:
        raise CheckpointLoadError(f"{str(detected.path)!r} is a sharded checkpoint already: there is nothing to do.")
    opened = open_checkpoint(detected, module_key, weights_only, verify_crc=True)
    try:
        metadata, skipped = _metadata_and_skipped(opened)
        # a module's extra states that are not tensors (`get_extra_state`) are written whole, as DCP writes objects
        extras = materialize(opened.module_extras)
        return _write_sharded(opened.source, output, module_key, metadata, skipped, chunk_bytes, on_chunk, extras)
    finally:
        opened.close()


def _write_sharded(
    tensor_source: TensorSource,
    output: Path,
    module_key: str,
    metadata: dict[str, Any],
    skipped: list[str],
    chunk_bytes: int,
    on_chunk: Callable[[int], None] | None,
    extras: dict[str, Any] | None = None,
) -> "ConversionResult":
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    specs = tensor_source.specs()
    module_state: dict[str, Any] = {
        name: torch.empty(spec.shape, dtype=spec.dtype, device="meta") for name, spec in specs.items()
    }
    state_dict = {module_key: {**module_state, **(extras or {})}}
    # Writing a chunk holds it twice (the read and torch's serialization), so chunks of at most half the largest
    # tensor keep the peak near one largest tensor.
    largest = max((spec.nbytes for spec in specs.values()), default=0)
    chunk_bytes = max(min(chunk_bytes, largest // 2), _MIN_CHUNK_BYTES)
    planner = _streaming_save_planner()(tensor_source, module_key, chunk_bytes, on_chunk)
    output.mkdir(parents=True, exist_ok=True)
    # One file per chunk: torch's writer keeps every tensor of a file alive until the file is closed.
    # No copy-ahead: chunks are read one at a time, when the writer asks for them.
    writer = FileSystemWriter(output, single_file_per_rank=False, thread_count=1, per_thread_copy_ahead=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state_dict, storage_writer=writer, planner=planner, no_dist=True)
    torch.save(metadata, output / FABRIC_METADATA_FILENAME)
    return ConversionResult(
        output=str(output),
        tensors=len(specs),
        tensor_bytes=sum(spec.nbytes for spec in specs.values()),
        chunks=planner.chunks,
        metadata_keys=sorted(metadata),
        skipped_keys=skipped,
    )


def _metadata_and_skipped(opened: OpenedCheckpoint) -> tuple[dict[str, Any], list[str]]:
    """The entries of a Fabric checkpoint besides the module's: metadata to keep, and optimizer states to skip."""
    metadata: dict[str, Any] = {}
    skipped: list[str] = []
    for key, value in opened.entries.items():
        tensors = list(walk_tensors(value))
        if tensors and not (len(tensors) == 1 and tensors[0][0] == "" and value.dim() == 0):
            skipped.append(str(key))  # optimizer states: their sharded layout is FSDP's, not convertible offline
        else:
            metadata[key] = materialize(value)  # plain values, or a step counter saved as a scalar tensor
    return metadata, skipped


def _sharded_specs(path: Path, weights_only: bool) -> tuple[dict[str, TensorSpec], list[str]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_fsdp.loading.sharded_metadata import read_dcp_metadata, read_sharded_metadata

    metadata = read_dcp_metadata(path, weights_only)
    specs = {
        fqn: TensorSpec(tuple(entry.size), entry.properties.dtype)
        for fqn, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    top_level = sorted({fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata})
    top_level += sorted(set(map(str, read_sharded_metadata(path, weights_only))) - set(top_level))
    return specs, top_level


@cache
def _streaming_save_planner() -> type["DefaultSavePlanner"]:
    """The planner class of :func:`_write_sharded`, defined on first use: torch's DCP planners are imported only then.

    ``inspect`` (:func:`describe_checkpoint`) imports this module but writes nothing, and importing DCP costs seconds.

    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem

    class _StreamingSavePlanner(DefaultSavePlanner):
        """A DCP save planner that reads each tensor from the source only when the writer asks for it, in row chunks."""

        def __init__(
            self, source: TensorSource, module_key: str, chunk_bytes: int, on_chunk: Callable[[int], None] | None
        ) -> None:
            super().__init__()
            self.source = source
            self.prefix = f"{module_key}."
            self.chunk_bytes = chunk_bytes
            self.on_chunk = on_chunk
            self.chunks = 0

        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            items = [
                piece
                for item in plan.items
                for piece in (_split_rows(item, self.chunk_bytes) if self._from_source(item) else [item])
            ]
            self.plan = dataclasses.replace(plan, items=items)
            self.chunks = sum(1 for item in items if self._from_source(item))  # the tensors' chunks, read from the file
            return self.plan

        def _from_source(self, write_item: WriteItem) -> bool:
            return write_item.index.fqn.removeprefix(self.prefix) in self.source.specs()

        def resolve_data(self, write_item: WriteItem) -> Any:
            if not self._from_source(write_item):
                # a module's extra state (an object, or a tensor inside one), in memory: torch's planner writes it
                return super().resolve_data(write_item)
            assert write_item.tensor_data is not None
            name = write_item.index.fqn.removeprefix(self.prefix)
            chunk = write_item.tensor_data.chunk
            shape = tuple(write_item.tensor_data.size)
            row = math.prod(shape[1:]) if shape else 1
            start = (chunk.offsets[0] if shape else 0) * row
            values = self.source.read_flat(name, start, start + math.prod(chunk.sizes)).reshape(tuple(chunk.sizes))
            if self.on_chunk is not None:
                self.on_chunk(values.numel() * values.element_size())
            return values

    return _StreamingSavePlanner


def _split_rows(item: "WriteItem", chunk_bytes: int) -> list["WriteItem"]:
    """Split a whole-tensor write item into items of whole rows, each about ``chunk_bytes`` large."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItemType

    data = item.tensor_data
    if data is None or len(data.size) == 0 or data.size[0] <= 1:
        return [item]
    row_bytes = math.prod(data.size[1:]) * data.properties.dtype.itemsize
    rows_per_chunk = max(1, chunk_bytes // max(row_bytes, 1))
    if rows_per_chunk >= data.size[0]:
        return [item]
    pieces = []
    for first in range(0, data.size[0], rows_per_chunk):
        rows = min(rows_per_chunk, data.size[0] - first)
        offsets = torch.Size([first, *([0] * (len(data.size) - 1))])
        sizes = torch.Size([rows, *data.size[1:]])
        pieces.append(
            dataclasses.replace(
                item,
                index=MetadataIndex(item.index.fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), data.properties, data.size),
            )
        )
    return pieces
