"""Tell checkpoint layouts apart by their content, and read tensors from them without copying the whole file.

Upstream destination: ``src/lightning/fabric/utilities/load.py``.
"""

import json
import math
import mmap
import pickle
import struct
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from lightning_fsdp.loading.errors import CheckpointLoadError

#: The file that marks a sharded checkpoint written by ``fabric.save`` (the metadata of the user's state).
_FABRIC_METADATA_FILENAME = "meta.pt"
#: The file that torch's distributed checkpoint (DCP) writes into every checkpoint directory.
_DCP_METADATA_FILENAME = ".metadata"
#: Single-file Hugging Face checkpoints that a directory may hold instead of an index.
_HF_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
#: Preferred when a directory holds indexes for both formats (safetensors reads lazily and never unpickles).
_HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

#: Reads at least this large get an anonymous mapping of their own (see :meth:`ByteRangeSource.read_flat`).
_OWN_MAPPING_BYTES = 2**20

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointFormat(str, Enum):
    """The on-disk formats the loader reads."""

    FABRIC_SHARDED = "fabric-sharded"
    """A directory of distributed checkpoint shards, as ``fabric.save`` writes it with ``state_dict_type="sharded"``."""
    TORCH_ZIP = "torch-zip"
    """A ``torch.save`` file in the zip format (the default since torch 1.6): read lazily through ``mmap``."""
    TORCH_LEGACY = "torch-legacy"
    """A ``torch.save`` file in the legacy format (``_use_new_zipfile_serialization=False``). A raw state dict is
    read by byte ranges (its pickles come first and say where each tensor is); a Fabric checkpoint is read whole."""
    SAFETENSORS = "safetensors"
    """A ``.safetensors`` file: read lazily, slice by slice, and never unpickled."""
    HF_INDEX = "hf-index"
    """A Hugging Face sharded checkpoint: an ``*.index.json`` naming the file that holds each tensor."""

    @property
    def lazy(self) -> bool:
        """Whether a rank can always read just the bytes it needs, without materialising the whole source."""
        return self is not CheckpointFormat.TORCH_LEGACY


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of a tensor in a checkpoint, known without reading its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class DetectedCheckpoint:
    """What :func:`detect_checkpoint` found at a path."""

    path: Path
    """The file to read (for a directory holding a Hugging Face checkpoint, the index or weights file in it)."""
    format: CheckpointFormat
    files: tuple[Path, ...]
    """Every file the checkpoint consists of (the shards of an index; the path itself otherwise)."""

    @property
    def nbytes(self) -> int:
        return sum(file.stat().st_size for file in self.files if file.is_file())


def detect_checkpoint(path: str | Path) -> DetectedCheckpoint:
    """Find out which checkpoint format ``path`` holds, from its content rather than its name.

    Raises:
        CheckpointLoadError: If the path does not exist, is empty, or holds nothing the loader can read. The message
            says what was found.

    """
    path = Path(path)
    if not path.exists():
        raise CheckpointLoadError(
            f"The checkpoint path {str(path)!r} does not exist. Check the path (it must be reachable from every node)."
        )
    if path.is_dir():
        return _detect_directory(path)
    file_format = _sniff_file(path)
    if file_format is CheckpointFormat.HF_INDEX:
        return DetectedCheckpoint(path, file_format, _index_shard_files(path))
    return DetectedCheckpoint(path, file_format, (path,))


def _detect_directory(path: Path) -> DetectedCheckpoint:
    if (path / _DCP_METADATA_FILENAME).is_file() or (path / _FABRIC_METADATA_FILENAME).is_file():
        return DetectedCheckpoint(path, CheckpointFormat.FABRIC_SHARDED, tuple(sorted(p for p in path.iterdir())))
    indexes = [path / name for name in _HF_INDEX_FILES if (path / name).is_file()]
    indexes += sorted(p for p in path.glob("*.index.json") if p not in indexes)
    if indexes:
        return DetectedCheckpoint(indexes[0], CheckpointFormat.HF_INDEX, _index_shard_files(indexes[0]))
    for name in _HF_SINGLE_FILES:
        if (path / name).is_file():
            weights = path / name
            return DetectedCheckpoint(weights, _sniff_file(weights), (weights,))
    contents = sorted(p.name for p in path.iterdir())
    shown = ", ".join(contents[:10]) + (f", ... ({len(contents)} entries)" if len(contents) > 10 else "")
    raise CheckpointLoadError(
        f"The directory {str(path)!r} holds no checkpoint. Expected a sharded Fabric checkpoint (`meta.pt` and"
        f" `.metadata`), a Hugging Face index (`*.index.json`), or one of {', '.join(_HF_SINGLE_FILES)}."
        f" It contains: {shown or 'nothing'}."
    )


def _sniff_file(path: Path) -> CheckpointFormat:
    size = path.stat().st_size
    if size == 0:
        raise CheckpointLoadError(f"The checkpoint file {str(path)!r} is empty (0 bytes). Was the save interrupted?")
    with open(path, "rb") as file:
        head = file.read(16)
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return CheckpointFormat.TORCH_ZIP
    if head.startswith(b"\x80"):  # a pickle (protocol 2+): torch's legacy format starts with its pickled magic number
        return CheckpointFormat.TORCH_LEGACY
    if len(head) > 8 and head[8:9] == b"{" and 8 + int.from_bytes(head[:8], "little") <= size:
        return CheckpointFormat.SAFETENSORS
    if head.lstrip()[:1] == b"{":
        return CheckpointFormat.HF_INDEX
    raise CheckpointLoadError(
        f"The file {str(path)!r} is not a checkpoint format lightning-fsdp reads: neither a `torch.save` file (zip or"
        f" legacy), a safetensors file, nor a Hugging Face `*.index.json`. Its first bytes are {head[:8].hex(' ')}."
    )


def _read_index(path: Path) -> dict[str, str]:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointLoadError(f"The index file {str(path)!r} is not valid JSON: {error}.") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointLoadError(
            f"The JSON file {str(path)!r} is not a Hugging Face checkpoint index: it has no `weight_map` that maps"
            " tensor names to file names."
        )
    return weight_map


def _index_shard_files(path: Path) -> tuple[Path, ...]:
    shard_names = sorted(set(_read_index(path).values()))
    missing = [name for name in shard_names if not (path.parent / name).is_file()]
    if missing:
        raise CheckpointLoadError(
            f"The index {str(path)!r} names {len(missing)} shard file(s) that do not exist next to it:"
            f" {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}. Download or copy the missing shards."
        )
    return tuple(path.parent / name for name in shard_names)


def load_torch_file(path: Path, file_format: CheckpointFormat, weights_only: bool, map_location: str = "cpu") -> Any:
    """Unpickle a ``torch.save`` file with every storage on the CPU, lazily (``mmap``) where the format allows.

    Storages always go to the CPU first, whatever device the file recorded: a file saved from ``cuda:0`` must not
    touch ``cuda:0`` from another rank, and must load on a machine without a GPU. ``map_location="meta"`` reads the
    structure only (shapes, dtypes, and for zip files each storage's offset in the file).

    """
    mmap = file_format is CheckpointFormat.TORCH_ZIP and map_location != "meta"
    with _reading_errors(path, weights_only):
        return torch.load(path, map_location=map_location, mmap=mmap, weights_only=weights_only)


@contextmanager
def _reading_errors(path: Path, weights_only: bool) -> Iterator[None]:
    """Turn what unpickling a bad or unsafe file raises into one :class:`CheckpointLoadError` that says why."""
    try:
        yield
    except pickle.UnpicklingError as error:
        if weights_only:
            raise CheckpointLoadError(
                f"Refused to unpickle {str(path)!r}: it holds objects other than tensors and plain containers, which"
                " could run code when loaded (the payload was not run). If you trust the file and its author, load"
                f" it with `weights_only=False`. Details: {_first_line(error)}"
            ) from None
        raise CheckpointLoadError(f"The file {str(path)!r} is not a readable `torch.save` file: {error}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, struct.error) as error:
        raise CheckpointLoadError(
            f"The file {str(path)!r} could not be read as a `torch.save` checkpoint: it looks truncated or corrupt"
            f" ({_first_line(error)}). Re-copy or re-save it."
        ) from None


class _NotLocatable(Exception):
    """A legacy-format file whose tensors cannot be located by byte offset (the caller reads it whole instead)."""


def read_legacy_layout(path: Path, weights_only: bool) -> tuple[Any, dict[int, int]]:
    """Read the structure of a legacy-format ``torch.save`` file and where each storage's bytes are, not its data.

    The legacy format is a sequence of pickles (magic number, protocol, system info, the object, the storage keys)
    followed by each storage's element count and bytes, in the order of the keys. The pickles come first, so the
    structure and every storage's offset are known after reading a few kilobytes.

    Returns:
        The unpickled object with tensors on the meta device, and for each storage (by its ``_cdata``) the offset of
        its first byte in the file.

    Raises:
        _NotLocatable: For files this reader does not know (storage views, other legacy variants).
        CheckpointLoadError: For unsafe (with ``weights_only``), truncated or corrupt files.

    """
    from torch._weights_only_unpickler import Unpickler as WeightsOnlyUnpickler

    unpickler_class = WeightsOnlyUnpickler if weights_only else pickle.Unpickler
    storages: dict[str, torch.TypedStorage] = {}

    def persistent_load(saved_id: tuple) -> Any:
        kind = saved_id[0].decode("ascii") if isinstance(saved_id[0], bytes) else saved_id[0]
        if kind == "module" and not weights_only:
            return saved_id[1]
        if kind != "storage":
            raise _NotLocatable(f"persistent id {kind!r}")
        storage_type, key, _location, numel, view_metadata = saved_id[1:]
        if view_metadata is not None:
            raise _NotLocatable("a storage view")
        if key not in storages:
            dtype = storage_type.dtype
            untyped = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
            storages[key] = torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        return storages[key]

    with _reading_errors(path, weights_only), open(path, "rb") as file:
        for _ in range(3):  # magic number, protocol version, system info
            unpickler_class(file).load()
        unpickler = unpickler_class(file)
        unpickler.persistent_load = persistent_load
        content = unpickler.load()
        keys = unpickler_class(file).load()
        offsets: dict[int, int] = {}
        position = file.tell()
        for key in keys:
            storage = storages.get(key)
            if storage is None:
                raise _NotLocatable(f"storage {key!r} is not referenced")
            file.seek(position)
            (numel,) = struct.unpack("<q", file.read(8))
            if numel * storage.dtype.itemsize != storage._untyped_storage.nbytes():
                raise _NotLocatable(f"storage {key!r} has {numel} elements, not {storage.size()}")
            offsets[storage._untyped_storage._cdata] = position + 8
            position += 8 + storage._untyped_storage.nbytes()
        if position > path.stat().st_size:
            raise CheckpointLoadError(
                f"The file {str(path)!r} could not be read as a `torch.save` checkpoint: it is truncated. Re-copy it."
            )
    return content, offsets


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class TensorSource:
    """Named tensors that can be read whole or as a range of their flattened elements.

    A range read returns only the elements asked for, so with a lazy source a rank touches only the bytes of its own
    shard.

    """

    lazy: bool = True

    def specs(self) -> Mapping[str, TensorSpec]:
        """Shape and dtype of every tensor, read from the file's metadata without reading tensor data."""
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        """Return the whole tensor (a view of the mapped file where the format allows)."""
        raise NotImplementedError

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Return elements ``[start, stop)`` of the flattened tensor."""
        return self.read(name).reshape(-1)[start:stop]

    def close(self) -> None:
        """Release open files and mappings."""


def check_all_tensors(state_dict: Mapping[str, Any]) -> None:
    """Raise if a module state dict holds values other than tensors, naming the first few."""
    not_tensors = {k: type(v).__name__ for k, v in state_dict.items() if not isinstance(v, torch.Tensor)}
    if not_tensors:
        shown = ", ".join(f"{k!r} ({t})" for k, t in list(not_tensors.items())[:5])
        raise CheckpointLoadError(
            f"The state dict holds {len(not_tensors)} value(s) that are not tensors where tensors are expected:"
            f" {shown}{', ...' if len(not_tensors) > 5 else ''}. A module state dict maps parameter and buffer"
            " names to tensors."
        )


class DictSource(TensorSource):
    """Tensors from an in-memory or memory-mapped state dict (what ``torch.load`` returned)."""

    def __init__(self, state_dict: Mapping[str, Any], lazy: bool) -> None:
        self._state_dict = state_dict
        self.lazy = lazy
        check_all_tensors(state_dict)
        self._specs = {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in state_dict.items()}

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def read(self, name: str) -> torch.Tensor:
        return self._state_dict[name]

    def close(self) -> None:
        self._state_dict = {}


class SafetensorsSource(TensorSource):
    """Tensors from one or more safetensors files, read slice by slice."""

    def __init__(self, files: Mapping[str, Path] | Path) -> None:
        from safetensors import safe_open

        paths = sorted(set(files.values())) if isinstance(files, Mapping) else [files]
        self._handles: dict[Path, Any] = {}
        self._file_of: dict[str, Path] = {}
        self._specs: dict[str, TensorSpec] = {}
        for path in paths:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as error:  # safetensors raises its own error types (SafetensorError, OSError, ...)
                raise CheckpointLoadError(
                    f"The safetensors file {str(path)!r} could not be read: {_first_line(error)}. It looks truncated"
                    " or corrupt; re-copy it."
                ) from None
            self._handles[path] = handle
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle is not a mapping
                tensor_slice = handle.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(tensor_slice.get_dtype())
                if dtype is None:
                    raise CheckpointLoadError(
                        f"The tensor {name!r} in {str(path)!r} has dtype {tensor_slice.get_dtype()}, which"
                        " lightning-fsdp does not read."
                    )
                self._specs[name] = TensorSpec(tuple(tensor_slice.get_shape()), dtype)
                self._file_of[name] = path
        if isinstance(files, Mapping):
            _check_index_matches(files, self._file_of)

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def read(self, name: str) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        shape = self._specs[name].shape
        if len(shape) == 0 or start >= stop:
            return self.read(name).reshape(-1)[start:stop]
        # safetensors slices along dimensions: read the rows that cover the range, then trim to the exact elements.
        row = math.prod(shape[1:])
        if row == 0:
            return self.read(name).reshape(-1)[start:stop]
        first_row, end_row = start // row, -(-stop // row)
        rows = self._handles[self._file_of[name]].get_slice(name)[first_row:end_row]
        offset = first_row * row
        return rows.reshape(-1)[start - offset : stop - offset]

    def close(self) -> None:
        self._handles.clear()


class MergedSource(TensorSource):
    """Several sources seen as one (the shards of a Hugging Face ``pytorch_model.bin`` index)."""

    def __init__(self, sources: list[TensorSource]) -> None:
        self._sources = sources
        self.lazy = all(source.lazy for source in sources)
        self._owner: dict[str, TensorSource] = {}
        self._specs: dict[str, TensorSpec] = {}
        for source in sources:
            for name, spec in source.specs().items():
                self._owner[name] = source
                self._specs[name] = spec

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def read(self, name: str) -> torch.Tensor:
        return self._owner[name].read(name)

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._owner[name].read_flat(name, start, stop)

    def close(self) -> None:
        for source in self._sources:
            source.close()


def _check_index_matches(weight_map: Mapping[str, Path], file_of: Mapping[str, Path]) -> None:
    absent = [name for name, file in weight_map.items() if file_of.get(name) != file]
    if absent:
        raise CheckpointLoadError(
            f"The checkpoint index names {len(absent)} tensor(s) that are not in the shard it points to:"
            f" {', '.join(repr(n) for n in absent[:5])}{', ...' if len(absent) > 5 else ''}. The index and its shards"
            " do not belong together; re-download the checkpoint."
        )


def open_index(path: Path, weights_only: bool, materialize: bool = True) -> TensorSource:
    """Open a Hugging Face sharded checkpoint from its ``*.index.json``.

    Args:
        path: The index file.
        weights_only: Unpickle only tensors and plain containers.
        materialize: Whether a shard whose tensors cannot be located by byte offset may be read whole; when
            ``False`` such a shard raises ``_NotLocatable`` instead (the caller reads it in turns).

    """
    weight_map = {name: path.parent / file for name, file in _read_index(path).items()}
    shard_formats = {file: _sniff_file(file) for file in sorted(set(weight_map.values()))}
    if all(fmt is CheckpointFormat.SAFETENSORS for fmt in shard_formats.values()):
        return SafetensorsSource(weight_map)
    sources: list[TensorSource] = []
    for file, fmt in shard_formats.items():
        if fmt is CheckpointFormat.SAFETENSORS:
            sources.append(SafetensorsSource(file))
        elif fmt is CheckpointFormat.TORCH_ZIP:
            sources.append(DictSource(as_mapping(load_torch_file(file, fmt, weights_only), file), lazy=True))
        elif fmt is CheckpointFormat.TORCH_LEGACY:
            sources.append(open_legacy_file(file, weights_only, materialize))
        else:
            raise CheckpointLoadError(f"The shard {str(file)!r} of index {str(path)!r} is not a weights file.")
    merged = MergedSource(sources)
    _check_index_matches(weight_map, {name: file for name, file in _files_by_name(sources, shard_formats)})
    return merged


def is_lazy(detected: DetectedCheckpoint, weights_only: bool = True) -> bool:
    """Whether ranks can read only their own bytes of this checkpoint (reads the pickles of legacy files only)."""
    files = detected.files if detected.format is CheckpointFormat.HF_INDEX else (detected.path,)
    for file in files:
        if not file.is_file() or _sniff_file(file) is not CheckpointFormat.TORCH_LEGACY:
            continue
        try:
            content, offsets = read_legacy_layout(file, weights_only)
            if not isinstance(content, Mapping) or not any(isinstance(v, torch.Tensor) for v in content.values()):
                return False
            ByteRangeSource.from_legacy_layout(
                file, {k: v for k, v in content.items() if isinstance(v, torch.Tensor)}, offsets
            )
        except _NotLocatable:
            return False
    return True


def open_legacy_file(path: Path, weights_only: bool, materialize: bool = True) -> TensorSource:
    """A legacy-format state dict file, by byte ranges where its tensors can be located, else read whole."""
    try:
        content, offsets = read_legacy_layout(path, weights_only)
        return ByteRangeSource.from_legacy_layout(path, as_mapping(content, path), offsets)
    except _NotLocatable:
        if not materialize:
            raise
    return DictSource(as_mapping(load_torch_file(path, CheckpointFormat.TORCH_LEGACY, weights_only), path), False)


def _files_by_name(sources: list[TensorSource], shard_formats: Mapping[Path, CheckpointFormat]) -> Iterator:
    for source, file in zip(sources, shard_formats, strict=True):
        for name in source.specs():
            yield name, file


def as_mapping(obj: Any, path: Path) -> Mapping[str, Any]:
    """Return what a checkpoint file holds, or raise if it is not a dict (neither a state dict nor a checkpoint)."""
    if not isinstance(obj, Mapping):
        raise CheckpointLoadError(
            f"The file {str(path)!r} holds a {type(obj).__name__}, not a state dict or a Fabric checkpoint (both are"
            " dicts)."
        )
    return obj


@dataclass(frozen=True)
class _TensorLocation:
    file: Path
    offset: int
    """Byte offset of the tensor's first element in ``file``."""
    spec: TensorSpec


class ByteRangeSource(TensorSource):
    """Tensors read with plain positioned reads of exactly the bytes asked for: nothing is mapped or cached.

    Each read returns fresh memory holding only the requested elements, so the process's memory never grows with the
    file (unlike a memory map, whose touched pages stay resident). Used where peak memory must stay near the largest
    read, e.g. converting a checkpoint tensor by tensor.

    """

    def __init__(self, locations: Mapping[str, _TensorLocation]) -> None:
        self._locations = dict(locations)
        self._specs = {name: location.spec for name, location in self._locations.items()}

    @classmethod
    def from_zip_entries(cls, path: Path, tensors: Mapping[str, torch.Tensor]) -> "ByteRangeSource":
        """Locate tensors that ``torch.load(path, map_location="meta")`` returned (they carry their storage offset)."""
        return cls._locate(path, tensors, lambda storage: getattr(storage, "_checkpoint_offset", None))

    @classmethod
    def from_legacy_layout(
        cls, path: Path, tensors: Mapping[str, torch.Tensor], offsets: Mapping[int, int]
    ) -> "ByteRangeSource":
        """Locate tensors that :func:`read_legacy_layout` returned, with the storage offsets it found."""
        return cls._locate(path, tensors, lambda storage: offsets.get(storage._cdata))

    @classmethod
    def _locate(
        cls, path: Path, tensors: Mapping[str, torch.Tensor], storage_offset_of: Callable[[Any], int | None]
    ) -> "ByteRangeSource":
        locations = {}
        for name, tensor in tensors.items():
            storage_offset = storage_offset_of(tensor.untyped_storage())
            if storage_offset is None or not tensor.is_contiguous():
                raise _NotLocatable(f"the tensor {name!r} is a non-contiguous view or has no recorded offset")
            offset = storage_offset + tensor.storage_offset() * tensor.element_size()
            locations[name] = _TensorLocation(path, offset, TensorSpec(tuple(tensor.shape), tensor.dtype))
        return cls(locations)

    @classmethod
    def from_safetensors(cls, paths: list[Path]) -> "ByteRangeSource":
        """Locate every tensor of safetensors files from their JSON headers."""
        locations = {}
        for path in paths:
            with open(path, "rb") as file:
                header_size = int.from_bytes(file.read(8), "little")
                header = json.loads(file.read(header_size))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise CheckpointLoadError(f"The tensor {name!r} in {str(path)!r} has unsupported dtype {entry}.")
                begin = 8 + header_size + entry["data_offsets"][0]
                locations[name] = _TensorLocation(path, begin, TensorSpec(tuple(entry["shape"]), dtype))
        return cls(locations)

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def read(self, name: str) -> torch.Tensor:
        spec = self._specs[name]
        return self.read_flat(name, 0, spec.numel).view(spec.shape)

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        location = self._locations[name]
        itemsize = location.spec.dtype.itemsize
        nbytes = max(stop - start, 0) * itemsize
        if nbytes == 0:
            return torch.empty(0, dtype=location.spec.dtype)
        # Large reads get memory of their own, returned to the system as soon as the tensor is dropped: from the heap,
        # freed blocks of this size tend to stay resident and the process would grow with every read.
        buffer = mmap.mmap(-1, nbytes) if nbytes >= _OWN_MAPPING_BYTES else bytearray(nbytes)
        with open(location.file, "rb", buffering=0) as file:
            file.seek(location.offset + start * itemsize)
            read = file.readinto(buffer)
        if read != nbytes:
            raise CheckpointLoadError(
                f"The file {str(location.file)!r} ended before the tensor {name!r} did: it is truncated."
            )
        return torch.frombuffer(buffer, dtype=location.spec.dtype)
