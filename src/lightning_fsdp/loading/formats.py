"""Tell checkpoint layouts apart by their content, and open any of them as one kind of tensor source.

:func:`detect_checkpoint` says what a path holds; :func:`open_checkpoint` is the one way to open it, used alike by
loading, inspecting and converting a checkpoint. With ``weights_only=True`` every format is read by
proven byte ranges (:mod:`~lightning_fsdp.loading.sources`); a file the caller trusts (``weights_only=False``) may
hold any object and is read whole by ``torch.load``.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import codecs
import itertools
import json
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from lightning_fsdp.loading.errors import CheckpointKeyError, CheckpointLoadError, first_line, printable, quoted_names
from lightning_fsdp.loading.files import CheckpointPath, StoragePath, lexists, open_stream, require_regular_file
from lightning_fsdp.loading.legacy import read_legacy_structure
from lightning_fsdp.loading.safetensors_header import read_safetensors_header, read_safetensors_locations
from lightning_fsdp.loading.sources import (
    MAX_TENSORS,
    ByteRangeSource,
    DictSource,
    MergedSource,
    TensorLocation,
    TensorRef,
    TensorSource,
    TensorSpec,
    check_state_dict,
    is_extra_state_name,
    map_tensors,
    split_extra_states,
    walk_tensors,
)
from lightning_fsdp.loading.torch_pickle import (
    TorchFileStructure,
    read_zip_structure,
    unpickling_errors,
    zip_truncation,
)

#: The file that marks a sharded checkpoint written by ``fabric.save`` (the metadata of the user's state).
FABRIC_METADATA_FILENAME = "meta.pt"
#: The file that torch's distributed checkpoint (DCP) writes into every checkpoint directory.
DCP_METADATA_FILENAME = ".metadata"
#: A larger ``*.index.json`` is refused unread: the index of a trillion-parameter model (some 200,000 tensors) is a few
#: tens of MB, and parsing costs several times the file's size in memory on every rank.
MAX_INDEX_BYTES = 64 * 2**20
#: Single-file Hugging Face checkpoints that a directory may hold instead of an index.
_HF_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
#: Preferred when a directory holds indexes for both formats (safetensors never unpickles).
_HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: The ``__metadata__`` entry of a safetensors file that torch's ``HuggingFaceStorageWriter`` writes: a JSON map of
#: each tensor's name to the offsets of the slice the file holds (``{"saved_offsets": [...]}``).
_TORCH_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
#: The names of files that hold a checkpoint, for the hint of a directory that holds no checkpoint (only that hint: a
#: format is told from the content, never from the name).
_CHECKPOINT_FILE_SUFFIXES = (".ckpt", ".pth", ".pt", ".bin", ".safetensors")
#: The characters of its start that the error for a file of no checkpoint format shows, where they are text.
_SHOWN_TEXT_CHARS = 40
#: The entries that hold the module state in a checkpoint: ``fabric.save(path, {"model": model})`` and a Lightning
#: ``Trainer`` checkpoint (``.ckpt``). ``load_raw`` takes a checkpoint whose only module state is one of them.
_MODULE_ENTRIES = ("model", "state_dict")


class CheckpointFormat(str, Enum):
    """The on-disk formats the loader reads."""

    FABRIC_SHARDED = "fabric-sharded"
    """A directory of distributed checkpoint shards, as ``fabric.save`` writes it with ``state_dict_type="sharded"``."""
    TORCH_ZIP = "torch-zip"
    """A ``torch.save`` file in the zip format (the default since torch 1.6)."""
    TORCH_LEGACY = "torch-legacy"
    """A ``torch.save`` file in the legacy format (``_use_new_zipfile_serialization=False``)."""
    SAFETENSORS = "safetensors"
    """A ``.safetensors`` file (never unpickled)."""
    HF_INDEX = "hf-index"
    """A Hugging Face sharded checkpoint: an ``*.index.json`` naming the file that holds each tensor."""
    SAFETENSORS_SHARDS = "safetensors-shards"
    """A directory of safetensors files, each holding slices of tensors, as torch's ``HuggingFaceStorageWriter`` writes
    them with ``save_distributed=True`` and no consolidation: each file's header records where each slice sits in its
    tensor, and there is no index."""


@dataclass(frozen=True)
class DetectedCheckpoint:
    """What :func:`detect_checkpoint` found at a path."""

    path: Path
    """The file to read (for a directory holding a Hugging Face checkpoint, the index or weights file in it)."""
    format: CheckpointFormat
    files: tuple[Path, ...]
    """Every file the checkpoint consists of (the shards of an index; the path itself otherwise)."""
    weight_map: Mapping[str, str] | None = field(default=None, repr=False, compare=False)
    """A Hugging Face index's tensor name -> shard file name, read once, here."""

    @property
    def nbytes(self) -> int:
        return sum(file.stat().st_size for file in self.files if file.is_file())

    def reads_whole(self, weights_only: bool) -> bool:
        """Whether a rank must hold this checkpoint whole in memory to read it (only a trusted, pickled file)."""
        pickled = self.format in (CheckpointFormat.TORCH_ZIP, CheckpointFormat.TORCH_LEGACY)
        if self.format is CheckpointFormat.HF_INDEX:
            pickled = any(_sniff_file(file) is not CheckpointFormat.SAFETENSORS for file in self.files)
        return pickled and not weights_only


def detect_checkpoint(path: str | CheckpointPath) -> DetectedCheckpoint:
    """Find out which checkpoint format ``path`` holds, from its content rather than its name.

    Raises:
        CheckpointLoadError: If the path does not exist, is empty, is not a regular file or directory, or holds
            nothing the loader can read. The message says what was found.

    """
    path = path if isinstance(path, StoragePath) else Path(path)
    if not path.exists():
        raise CheckpointLoadError(
            f"The checkpoint path {str(path)!r} does not exist (no such file or directory). Pass the path of a"
            " checkpoint file or directory that every node can reach."
        )
    if path.is_dir():
        return _detect_directory(path)
    file_format = _sniff_file(path)
    if file_format is CheckpointFormat.HF_INDEX:
        weight_map = read_index(path)
        shards = tuple(sorted(path.parent / name for name in set(weight_map.values())))
        return DetectedCheckpoint(path, file_format, shards, weight_map)
    return DetectedCheckpoint(path, file_format, (path,))


def _detect_directory(path: Path) -> DetectedCheckpoint:
    # lexists: a `.metadata` that is a FIFO or a dangling link still marks a sharded checkpoint (and is refused there).
    if lexists(path / DCP_METADATA_FILENAME) or lexists(path / FABRIC_METADATA_FILENAME):
        return DetectedCheckpoint(path, CheckpointFormat.FABRIC_SHARDED, tuple(sorted(p for p in path.iterdir())))
    indexes = [path / name for name in _HF_INDEX_FILES if (path / name).exists()]
    indexes += sorted(p for p in path.glob("*.index.json") if p not in indexes)
    if indexes:
        return detect_checkpoint(indexes[0])
    for name in _HF_SINGLE_FILES:
        if (path / name).exists():
            return detect_checkpoint(path / name)
    shards = tuple(sorted(path.glob("*.safetensors")))
    if shards and _TORCH_SHARDING_INFO_KEY in read_safetensors_header(shards[0])[1]:
        return DetectedCheckpoint(path, CheckpointFormat.SAFETENSORS_SHARDS, shards)
    contents = sorted(p.name for p in path.iterdir())
    shown = quoted_names(contents)
    # one checkpoint file in the folder (a `full.ckpt` that `fabric.save` wrote there, beside a `hparams.yaml`): the
    # path was probably meant to name it
    candidates = [
        name
        for name in contents
        if name.lower().endswith(_CHECKPOINT_FILE_SUFFIXES) and not name.startswith(".") and (path / name).is_file()
    ]
    hint = f" Did you mean {str(path / candidates[0])!r}?" if len(candidates) == 1 else ""
    raise CheckpointLoadError(
        f"The directory {str(path)!r} holds no checkpoint. Expected a sharded Fabric checkpoint (`meta.pt` and"
        f" `.metadata`), a Hugging Face index (`*.index.json`), or one of {', '.join(_HF_SINGLE_FILES)}."
        f" It contains: {shown or 'nothing'}.{hint}"
    )


def _sniff_file(path: Path) -> CheckpointFormat:
    size = require_regular_file(path).st_size
    if size == 0:
        raise CheckpointLoadError(f"The checkpoint file {str(path)!r} is empty (0 bytes). Was the save interrupted?")
    with open_stream(path) as file:
        start = file.read(4 * _SHOWN_TEXT_CHARS)  # up to 4 bytes a character: the text the error may show
    head = start[:16]
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return CheckpointFormat.TORCH_ZIP
    # Before the pickle check: a safetensors header size can start with the byte 0x80 (a header of 128 bytes).
    if len(head) > 8 and head[8:9] == b"{" and 8 + int.from_bytes(head[:8], "little") <= size:
        return CheckpointFormat.SAFETENSORS
    if head.startswith(b"\x80"):  # a pickle (protocol 2+): torch's legacy format starts with its pickled magic number
        return CheckpointFormat.TORCH_LEGACY
    if head.lstrip()[:1] == b"{":
        return CheckpointFormat.HF_INDEX
    # a text file (a Git LFS pointer, an HTML error page saved as the checkpoint) is shown as text as well
    text = _as_text(start)
    raise CheckpointLoadError(
        f"The file {str(path)!r} is not a checkpoint format that the loader reads: neither a `torch.save` file (zip or"
        f" legacy), a safetensors file, nor a Hugging Face `*.index.json`. Its first bytes are {start[:8].hex(' ')}"
        + (f" (as text: {text!r}).{_text_hint(text)}" if text else ".")
    )


def _as_text(data: bytes) -> str:
    """The first :data:`_SHOWN_TEXT_CHARS` characters of ``data`` as UTF-8, or ``""`` if it is not printable text.

    Line breaks and tabs count as text (``repr`` shows them escaped); a character cut at the end of ``data`` is left
    out. Any other control or format character means that the bytes are not text.

    """
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(data)  # not final: a cut last character is held back
    except UnicodeDecodeError:
        return ""
    text = text[:_SHOWN_TEXT_CHARS]
    return text if text.strip() and all(char.isprintable() or char in "\t\n\r" for char in text) else ""


def _text_hint(text: str) -> str:
    """What a text file found in place of a checkpoint is, and the fix, for the two that users meet."""
    if text.startswith("version https://git-lfs.github.com/spec/"):
        return (
            " It is a Git LFS pointer, not the file it stands for: fetch the file with `git lfs pull` in its"
            " repository."
        )
    if text.lstrip().lower().startswith(("<!doctype html", "<html")):
        return " It is a web page (a download that returned an error page?): download the checkpoint again."
    return ""


def read_index(path: CheckpointPath) -> dict[str, str]:
    """The ``weight_map`` of a Hugging Face index: tensor name -> the name of the shard file (next to the index).

    The index is read once, and refused before it is parsed when it is larger than :data:`MAX_INDEX_BYTES` or could
    name more than :data:`~lightning_fsdp.loading.sources.MAX_TENSORS` tensors; the checks of shard names run once
    per shard, not once per tensor.

    Raises:
        CheckpointLoadError: If the index is too large, not valid JSON, has no ``weight_map``, names a file outside
            its directory (an absolute path, ``..``), or a shard that does not exist.

    """
    size = require_regular_file(path, "index file").st_size
    if size <= MAX_INDEX_BYTES:
        with open_stream(path) as file:
            data = file.read(MAX_INDEX_BYTES + 1)  # never more than the limit, even if the file grew meanwhile
        size = len(data)
    if size > MAX_INDEX_BYTES:
        raise CheckpointLoadError(
            f"The index file {str(path)!r} holds {size} bytes, more than the limit of {MAX_INDEX_BYTES} bytes (64 MiB)"
            " for a Hugging Face index (the index of a trillion-parameter model is a few tens of MB): it is not an"
            " index, or it is corrupt. Re-download the checkpoint."
        )
    # Each entry takes two JSON strings, four quotes: a bound on the entries before parsing builds any of them (a
    # quote escaped in a name only raises it).
    entries_at_most = data.count(b'"') // 4
    if entries_at_most > MAX_TENSORS:
        raise CheckpointLoadError(
            f"The index {str(path)!r} names up to {entries_at_most} tensors, more than the limit of"
            f" {MAX_TENSORS} (the largest models have a few hundred thousand): it is corrupt or crafted. Re-download"
            " the checkpoint."
        )
    try:
        index = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointLoadError(f"The index file {str(path)!r} is not valid JSON: {first_line(error)}.") from None
    del data
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointLoadError(
            f"The JSON file {str(path)!r} is not a Hugging Face checkpoint index: it has no `weight_map` that maps"
            " tensor names to file names."
        )
    shards = sorted(set(weight_map.values()))
    outside = [name for name in shards if not _is_plain_relative(name)]
    if outside:
        raise CheckpointLoadError(
            f"The index {str(path)!r} names shard file(s) outside its directory: {quoted_names(outside)}."
            " A Hugging Face index names its shards by file names relative to it; refusing to read other files."
        )
    missing = [name for name in shards if not (path.parent / name).exists()]
    if missing:
        raise CheckpointLoadError(
            f"The index {str(path)!r} names {len(missing)} shard file(s) that do not exist next to it:"
            f" {quoted_names(missing)}. Download or copy the missing shards."
        )
    return weight_map


def _is_plain_relative(name: str) -> bool:
    # Symbolic links in the directory are followed (the Hugging Face cache links snapshot files to its blobs).
    parts = PurePosixPath(name).parts
    return bool(name) and "\\" not in name and not PurePosixPath(name).is_absolute() and ".." not in parts


def load_torch_file(path: Path, weights_only: bool) -> Any:
    """Read a whole ``torch.save`` file with every storage on the CPU (for trusted files that may hold any object).

    Storages always go to the CPU first, whatever device the file recorded: a file saved from ``cuda:0`` must not
    touch ``cuda:0`` from another rank, and must load on a machine without a GPU. The file is read into memory, not
    mapped, so a file changed during the load cannot crash the process.

    """
    require_regular_file(path)
    try:
        with unpickling_errors(path, weights_only), ExitStack() as stack:
            source = stack.enter_context(open_stream(path)) if isinstance(path, StoragePath) else path
            return torch.load(source, map_location="cpu", mmap=False, weights_only=weights_only)
    except CheckpointLoadError:
        # torch's reader says only `OSError: [Errno 22] Invalid argument` for a truncated file
        truncated = zip_truncation(path) if _sniff_file(path) is CheckpointFormat.TORCH_ZIP else None
        if truncated is not None:
            raise truncated from None
        raise


@dataclass
class OpenedCheckpoint:
    """A checkpoint file, opened: the module's tensors as a source, and the other entries of a Fabric checkpoint."""

    source: TensorSource
    """The module's state."""
    entries: dict[str, Any] = field(default_factory=dict)
    """The other top-level entries of a Fabric checkpoint (optimizer states, metadata), with tensors as
    :class:`~lightning_fsdp.loading.sources.TensorRef` (read on demand) where the file was read by byte ranges;
    empty for a raw state dict."""
    raw: bool = True
    """Whether the file is a raw module state dict rather than a Fabric checkpoint."""
    top_level_keys: list[str] = field(default_factory=list)
    extra_sources: list[TensorSource] = field(default_factory=list)
    module_extras: dict[str, Any] = field(default_factory=dict)
    """The module state's extra states (``<module>._extra_state``) that are not tensors, by name, with tensors inside
    them as in ``entries``: they are set whole (see :func:`~lightning_fsdp.loading.sources.split_extra_states`)."""

    def check_unchanged(self) -> None:
        """Raise if a file changed since it was opened."""
        for source in [self.source, *self.extra_sources]:
            source.check_unchanged()

    def close(self) -> None:
        for source in [self.source, *self.extra_sources]:
            source.close()
        self.entries.clear()
        self.module_extras.clear()


def open_checkpoint(
    detected: DetectedCheckpoint, module_key: str | None, weights_only: bool, verify_crc: bool = False
) -> OpenedCheckpoint:
    """Open a checkpoint file, and tell a raw module state dict from a Fabric checkpoint by its content.

    Args:
        detected: What :func:`detect_checkpoint` found.
        module_key: The entry of a Fabric checkpoint that holds the module's state; ``None`` when the file must be the
            module's state itself (``load_raw``).
        weights_only: Unpickle only tensors and plain containers. With ``False``, pickled files are read whole.
        verify_crc: Check every zip record against its CRC (``convert``, which reads every byte anyway).

    Raises:
        CheckpointLoadError: If the file is unreadable, unsafe, corrupt, or holds no module state.

    """
    if detected.format in (CheckpointFormat.FABRIC_SHARDED, CheckpointFormat.SAFETENSORS_SHARDS):
        raise ValueError("A sharded checkpoint is read by `lightning_fsdp.loading.sharded`, not opened as a file.")
    if detected.format is CheckpointFormat.SAFETENSORS:
        return OpenedCheckpoint(ByteRangeSource(read_safetensors_locations(detected.path)))
    if detected.format is CheckpointFormat.HF_INDEX:
        return OpenedCheckpoint(_open_index(detected, weights_only, verify_crc))
    if detected.reads_whole(weights_only):
        content = _as_mapping(load_torch_file(detected.path, weights_only), detected.path)
        return _split_entries(content, module_key, detected.path, DictSource, lambda entries: ([], entries))
    structure = _read_structure(detected.path, detected.format, weights_only, verify_crc)
    content = _as_mapping(structure.content, detected.path)

    def locate_source(state_dict: Mapping[str, Any]) -> ByteRangeSource:
        check_state_dict(state_dict)
        return ByteRangeSource(structure.locate(state_dict))

    def lazy_entries(entries: dict[str, Any]) -> tuple[list[TensorSource], dict[str, Any]]:
        names = _tensor_names(entries)
        if not names:
            return [], entries
        source = ByteRangeSource(structure.locate({name: tensor for tensor, name in names.values()}))
        return [source], map_tensors(entries, lambda _, tensor: TensorRef(source, names[id(tensor)][1]))

    return _split_entries(content, module_key, detected.path, locate_source, lazy_entries)


def open_every_tensor(detected: DetectedCheckpoint, weights_only: bool) -> OpenedCheckpoint:
    """Open every tensor of a checkpoint file, each named by its dotted path (``optimizer.state.w.exp_avg``).

    For inspecting a file: the same reading and checks as :func:`open_checkpoint`, whatever the file holds.
    ``raw`` says whether the file is a module state dict (every value a tensor or a module's extra state).

    """
    if detected.format in (CheckpointFormat.SAFETENSORS, CheckpointFormat.HF_INDEX):
        return open_checkpoint(detected, None, weights_only)
    if detected.reads_whole(weights_only):
        content = _as_mapping(load_torch_file(detected.path, weights_only), detected.path)
        source: TensorSource = DictSource(dict(walk_tensors(content)))
    else:
        structure = _read_structure(detected.path, detected.format, weights_only, verify_crc=False)
        content = _as_mapping(structure.content, detected.path)
        source = ByteRangeSource(structure.locate(dict(walk_tensors(content))))
    return OpenedCheckpoint(source, raw=_is_module_state_dict(content), top_level_keys=[str(key) for key in content])


def _split_entries(
    content: Mapping[Any, Any], module_key: str | None, path: Path, make_source: Any, make_entries: Any
) -> OpenedCheckpoint:
    keys = [str(key) for key in content]

    def opened(module_state: Mapping[Any, Any], entries: dict[str, Any], raw: bool) -> OpenedCheckpoint:
        tensors, module_extras = split_extra_states(module_state)
        extra_sources, entries = make_entries(entries) if entries else ([], {})
        extras_sources, module_extras = make_entries(module_extras) if module_extras else ([], {})
        return OpenedCheckpoint(
            make_source(tensors),
            entries,
            raw=raw,
            top_level_keys=keys,
            extra_sources=[*extra_sources, *extras_sources],
            module_extras=module_extras,
        )

    if not content and module_key is None:
        # upstream's `load_raw` would report every name of the model as missing (and `fabric.load` the model's key)
        raise CheckpointLoadError(f"The checkpoint {str(path)!r} is empty: it holds no model weights. Check the path.")
    raw = _is_module_state_dict(content)
    top_level_tensors = any(isinstance(value, torch.Tensor) for value in content.values())
    if module_key is None and not raw and (_module_state_entries(content) or not top_level_tensors):
        # `load_raw` of a checkpoint: its one module state, as from a sharded checkpoint; nothing else is read.
        return opened(content[_module_entry(content, path)], {}, raw=False)
    module_entry = content.get(module_key) if module_key is not None else None
    if isinstance(module_entry, Mapping):
        return opened(module_entry, {key: value for key, value in content.items() if key != module_key}, raw=False)
    if module_key is not None and not raw:
        raise CheckpointKeyError(_no_module_entry_message(content, module_key, path))
    # a module state dict (`load_raw` of tensors beside other objects is refused, naming what is not a tensor)
    return opened(content, {}, raw=True)


def _is_module_state_dict(content: Mapping[Any, Any]) -> bool:
    """Whether a file holds a module state dict alone: every value a tensor, or a module's extra state (any object).

    The core's ``_is_raw_state_dict`` requires every value to be a tensor; this package also loads the extra states
    (see :func:`~lightning_fsdp.loading.sources.split_extra_states`), so it takes a file that holds them for one too.
    (The core is not imported here: ``lightning-fsdp inspect`` reads files without importing Lightning.)

    """
    return bool(content) and all(
        isinstance(value, torch.Tensor) or is_extra_state_name(key) for key, value in content.items()
    )


def _no_module_entry_message(content: Mapping[Any, Any], module_key: str | None, path: Path) -> str:
    """The refusal of a checkpoint without ``module_key``, naming the calls that load this file's module state."""
    shown = _shown_entries(content)
    states = _module_state_entries(content)
    refusal = (
        f"The checkpoint {str(path)!r} has no entry {module_key!r} for the model, and it is not a raw module state"
        f" dict either. Its entries are {shown}"
    )
    if not content:
        return f"The checkpoint {str(path)!r} is empty: it has no entry {module_key!r} for the model. Check the path."
    if not states and any(isinstance(value, torch.Tensor) for value in content.values()):
        others = [
            str(key)
            for key, value in content.items()
            if not isinstance(value, torch.Tensor) and not is_extra_state_name(key)
        ]
        return (
            f"The checkpoint {str(path)!r} has no entry {module_key!r} for the model, and it is not a raw module state"
            f" dict either: beside tensors it holds {quoted_names(others)}, which a module state dict does"
            " not hold. Save the model's state dict alone (`torch.save(model.state_dict(), path)`), or under a key"
            " (`{'model': model.state_dict(), ...}`) and load it under that key."
        )
    if not states:
        return (
            f"{refusal}, and none of them holds a module state (a dict of tensors): it holds no model weights to load."
            " Check the path."
        )
    calls = [f"`fabric.load(path, {{{key!r}: model}})`" for key in states[:5]]
    if len(states) == 1:
        if states[0] in _MODULE_ENTRIES:  # what `load_raw` picks by itself
            calls.insert(0, "`fabric.load_raw(path, model)`")
        return f"{refusal}; the model's weights are under {states[0]!r}. Load them with {' or '.join(calls)}."
    return (
        f"{refusal}, and {len(states)} of them hold a module state ({', '.join(map(repr, states[:5]))}). Name the one"
        f" to load as the key of the model: {' or '.join(calls)}."
    )


def _module_entry(content: Mapping[Any, Any], path: Path) -> str:
    """The one entry of a checkpoint that holds a module state (``model`` of Fabric, ``state_dict`` of Lightning)."""
    states = _module_state_entries(content)
    known = [key for key in _MODULE_ENTRIES if key in states]
    shown = _shown_entries(content)
    if len(known) == 1 and len(states) == 1:
        return known[0]
    if not states:
        raise CheckpointLoadError(
            f"The file {str(path)!r} is not a raw module state dict but a checkpoint with the entries {shown}, and none"
            " of them holds a module state (a dict of tensors): it holds no model weights to load. Check the path."
        )
    choices = " or ".join(f"`fabric.load(path, {{{key!r}: model}})`" for key in states[:5])
    raise CheckpointLoadError(
        f"The file {str(path)!r} is a checkpoint with the entries {shown}, and {len(states)} of them hold a module"
        f" state ({', '.join(map(repr, states[:5]))}), so `load_raw` cannot tell which one to load"
        f"{'' if known else f' (it takes one entry named {_MODULE_ENTRIES[0]!r} or {_MODULE_ENTRIES[1]!r})'}."
        f" Name the entry to load as the key of the model: {choices}."
    )


def _module_state_entries(content: Mapping[Any, Any]) -> list[str]:
    return [str(key) for key, value in content.items() if _looks_like_module_state(value)]


def _shown_entries(content: Mapping[Any, Any]) -> str:
    return ", ".join(repr(str(key)) for key in list(content)[:10]) + (", ..." if len(content) > 10 else "")


def _looks_like_module_state(value: Any) -> bool:
    return isinstance(value, Mapping) and any(isinstance(item, torch.Tensor) for item in value.values())


def _read_structure(
    path: Path, file_format: CheckpointFormat, weights_only: bool, verify_crc: bool
) -> TorchFileStructure:
    if file_format is CheckpointFormat.TORCH_ZIP:
        return read_zip_structure(path, weights_only, verify_crc=verify_crc)
    return read_legacy_structure(path, weights_only)


def _tensor_names(obj: Any) -> dict[int, tuple[torch.Tensor, str]]:
    """A name for each distinct tensor in ``obj`` (by identity): its dotted path, made unique where paths collide."""
    names: dict[int, tuple[torch.Tensor, str]] = {}
    taken: set[str] = set()
    suffixes = itertools.count(1)

    def name(path: str, tensor: torch.Tensor) -> torch.Tensor:
        # `{"a.b": x, "a": {"b": y}}` gives both the path "a.b": each must still be read as itself.
        unique = path
        while unique in taken:
            unique = f"{path}#{next(suffixes)}"
        taken.add(unique)
        names[id(tensor)] = (tensor, unique)
        return tensor

    map_tensors(obj, name)
    return names


def _open_index(detected: DetectedCheckpoint, weights_only: bool, verify_crc: bool) -> TensorSource:
    path = detected.path
    weight_map = detected.weight_map if detected.weight_map is not None else read_index(path)
    locations: dict[str, TensorLocation] = {}
    whole: dict[str, torch.Tensor] = {}
    shard_of: dict[str, str] = {}
    for shard in sorted(set(weight_map.values())):
        file = path.parent / shard
        file_format = _sniff_file(file)
        if file_format is CheckpointFormat.SAFETENSORS:
            found: Mapping[str, Any] = read_safetensors_locations(file)
            locations.update(found)
        elif file_format in (CheckpointFormat.TORCH_ZIP, CheckpointFormat.TORCH_LEGACY) and weights_only:
            structure = _read_structure(file, file_format, weights_only, verify_crc)
            found = _as_mapping(structure.content, file)
            check_state_dict(found)
            locations.update(structure.locate(found))
        elif file_format in (CheckpointFormat.TORCH_ZIP, CheckpointFormat.TORCH_LEGACY):
            found = _as_mapping(load_torch_file(file, weights_only), file)
            check_state_dict(found)
            whole.update(found)
        else:
            raise CheckpointLoadError(f"The shard {str(file)!r} of index {str(path)!r} is not a weights file.")
        for name in found:
            if name in shard_of:
                raise CheckpointLoadError(f"The tensor {name!r} is in two shards of the index {str(path)!r}.")
            shard_of[name] = shard
    absent = [name for name, shard in weight_map.items() if shard_of.get(name) != shard]
    if absent:
        raise CheckpointLoadError(
            f"The checkpoint index names {len(absent)} tensor(s) that are not in the shard it points to:"
            f" {quoted_names(absent)}. The index and its shards do not belong together; re-download the checkpoint."
        )
    if not whole:
        return ByteRangeSource(locations)
    return MergedSource([DictSource(whole), ByteRangeSource(locations)])


@dataclass(frozen=True)
class SafetensorsSlice:
    """One slice of a tensor in a file of :attr:`CheckpointFormat.SAFETENSORS_SHARDS`."""

    offsets: tuple[int, ...]
    """Where the slice's first element sits in the tensor, per dimension."""
    location: TensorLocation
    """Where the slice's bytes are (its shape and dtype are the slice's)."""


def read_safetensors_shards(detected: DetectedCheckpoint) -> dict[str, list[SafetensorsSlice]]:
    """Every slice of every tensor in a directory of :attr:`CheckpointFormat.SAFETENSORS_SHARDS`, by tensor name.

    Each file's header is checked as any safetensors file's is, and its ``DCP_SHARDING_INFO`` must give the offsets of
    every tensor the file holds, one per dimension. Whether the slices tile their tensors is checked by the sharded
    reader (:mod:`~lightning_fsdp.loading.sharded`), as for any sharded checkpoint.

    Raises:
        CheckpointLoadError: If a file is not valid safetensors, lacks the sharding information, or its offsets do not
            describe its tensors; the message names the file.

    """
    slices: dict[str, list[SafetensorsSlice]] = {}
    for file in detected.files:
        locations, metadata = read_safetensors_header(file)
        offsets = _sharding_offsets(file, metadata, locations)
        for name, location in locations.items():
            slices.setdefault(name, []).append(SafetensorsSlice(offsets[name], location))
    for name, parts in slices.items():
        kinds = {(str(part.location.spec.dtype).removeprefix("torch."), len(part.offsets)) for part in parts}
        if len(kinds) > 1:
            shown = ", ".join(f"{dtype} with {dims} dimension(s)" for dtype, dims in sorted(kinds))
            raise CheckpointLoadError(
                f"The slices of the tensor {name!r} in {str(detected.path)!r} differ ({shown}): the files were not"
                " written by one save. Re-save the checkpoint."
            )
    return slices


def safetensors_shards_specs(slices: Mapping[str, list[SafetensorsSlice]]) -> dict[str, TensorSpec]:
    """The shape and dtype of each tensor that :func:`read_safetensors_shards` found: the extent of its slices.

    The files record no tensor's shape, only where each slice starts, so the shape is where the last slice ends (as
    torch's ``HuggingFaceStorageWriter``'s own reader takes it).

    """
    return {
        name: TensorSpec(
            tuple(
                max(part.offsets[dim] + part.location.spec.shape[dim] for part in parts)
                for dim in range(len(parts[0].offsets))
            ),
            parts[0].location.spec.dtype,
        )
        for name, parts in slices.items()
    }


def _sharding_offsets(
    path: CheckpointPath, metadata: Mapping[str, str], locations: Mapping[str, TensorLocation]
) -> dict[str, tuple[int, ...]]:
    """The offsets of each slice of a file, from its ``DCP_SHARDING_INFO``: one count per dimension of each tensor."""

    def invalid(reason: str) -> CheckpointLoadError:
        return CheckpointLoadError(
            f"The safetensors file {str(path)!r} is not a slice file as torch's `HuggingFaceStorageWriter` writes it:"
            f" {reason}. Re-save the checkpoint."
        )

    text = metadata.get(_TORCH_SHARDING_INFO_KEY)
    if text is None:
        raise invalid(f"its header has no `{_TORCH_SHARDING_INFO_KEY}` (the offsets of its slices)")
    try:
        info = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise invalid(f"its `{_TORCH_SHARDING_INFO_KEY}` is not valid JSON ({first_line(error)})") from None
    if not isinstance(info, dict):
        raise invalid(f"its `{_TORCH_SHARDING_INFO_KEY}` is not a JSON object")
    offsets = {}
    for name, location in locations.items():
        entry = info.get(name)
        values = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(values, list)
            or len(values) != len(location.spec.shape)
            or not all(type(value) is int and value >= 0 for value in values)
        ):
            raise invalid(
                f"the tensor {name!r} of shape {list(location.spec.shape)} has the offsets {printable(repr(values))}"
                " (one non-negative integer per dimension expected)"
            )
        offsets[name] = tuple(values)
    unknown = sorted(set(info) - set(locations))
    if unknown:
        raise invalid(f"its `{_TORCH_SHARDING_INFO_KEY}` names tensors it does not hold: {quoted_names(unknown)}")
    return offsets


def _as_mapping(obj: Any, path: Path) -> Mapping[Any, Any]:
    if not isinstance(obj, Mapping):
        raise CheckpointLoadError(
            f"The file {str(path)!r} holds a {type(obj).__name__}, not a state dict or a Fabric checkpoint (both are"
            " dicts)."
        )
    return obj
