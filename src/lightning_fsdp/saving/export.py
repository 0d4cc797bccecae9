"""The layout of a model-only export in ``.safetensors`` files: one file, or a Hugging Face sharded checkpoint.

Everything here is computed from metadata alone (names, shapes, dtypes, the module's attributes), the same on every
rank: which name each tensor is stored under, which file it goes to, each file's header and the index. The bytes are
written by :func:`lightning_fsdp.saving.consolidated.save`.

The rules follow ``transformers``' ``save_pretrained`` (5.x) and ``huggingface_hub``'s
``split_torch_state_dict_into_shards``, as their documentation and behaviour state them:

- tensors are taken in ``state_dict`` order (sorted by transformers' ``dot_natural_key`` for a model that
  ``from_pretrained`` loaded, as ``save_pretrained`` reverts its weight conversions); a tensor of more than
  ``max_shard_size`` bytes gets a shard of its own, appended when it is met; otherwise a shard is closed when the
  next tensor would take it over the limit;
- one shard is ``model.safetensors`` without an index; several are ``model-00001-of-0000N.safetensors`` with
  ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {...}}``, indented by 2, keys
  sorted; a transformers model adds ``"total_parameters"``);
- a size given as a string is a decimal number and a unit among ``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000);
- a tied tensor is stored once: among its names, in sorted order, those that match a pattern of a module's
  ``_tied_weights_keys`` are dropped (all but the last if every name matches); if several names remain, the first
  in ``state_dict`` order is kept; the names in the model's ``_keys_to_ignore_on_save`` are not stored.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import Module

from lightning_fsdp.layouts.targets import clean_name
from lightning_fsdp.loading import safetensors_header

#: ``save_pretrained``'s default ``max_shard_size`` in transformers 5.
DEFAULT_MAX_SHARD_SIZE = "50GB"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}

#: The name of each dtype in a safetensors header: the reader's table (one table for both), inverted.
DTYPES = {dtype: name for name, dtype in safetensors_header.DTYPES.items()}


class ExportUnsupported(Exception):
    """The export cannot be written for this model; the message says why."""


@dataclass(frozen=True)
class Entry:
    """A tensor of the model's state dict: its name, its target's names (tied aliases), and its record."""

    name: str
    names: tuple[str, ...]
    record: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    parameter: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class ExportFile:
    """One ``.safetensors`` file: its name in the directory and its tensors ``(name, record)`` in file order."""

    name: str
    tensors: list[tuple[str, int]]
    header: bytes = b""


@dataclass
class ExportLayout:
    """Where every exported tensor goes, and what rank 0 writes besides the tensors' bytes."""

    files: list[ExportFile]
    placement: dict[int, tuple[int, int]]
    """Record index -> (file index, offset of its data in that file)."""
    ends: list[int]
    """Each file's size."""
    index: bytes | None
    """The text of ``model.safetensors.index.json`` (sharded exports only)."""
    hf_model: Module | None
    """The transformers model whose configuration goes with a directory export."""
    dtype: torch.dtype | None
    """The model's dtype, as ``save_pretrained`` records it in the configuration."""


def parse_shard_size(value: int | str) -> int:
    """``max_shard_size`` in bytes: an ``int``, or a string such as ``"5GB"`` or ``"500MB"`` (powers of 1000)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"`save_safetensors(max_shard_size={value!r})`: give an int (bytes) or a string like '5GB'.")
    if isinstance(value, int):
        size = value
    else:
        text = value.strip()
        unit = text[-2:].upper()
        try:
            size = int(float(text[:-2].strip()) * _UNITS[unit])
        except (KeyError, ValueError):
            raise ValueError(
                f"`save_safetensors(max_shard_size={value!r})`: give a number and a unit among KB, MB, GB, TB"
                " (e.g. '5GB'), or an int in bytes."
            ) from None
    if size <= 0:
        raise ValueError(f"`save_safetensors(max_shard_size={value!r})` must be positive.")
    return size


def unwrapped(module: Module) -> Module:
    """The user's model inside FSDP1's root wrapper (FSDP2 and tensor parallelism keep the model's own class)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return module.module if isinstance(module, FullyShardedDataParallel) else module


def transformers_model(module: Module) -> Module | None:
    """``module`` if it is a transformers ``PreTrainedModel`` (without importing transformers otherwise)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    return module if isinstance(module, transformers.PreTrainedModel) else None


def plan(entries: list[Entry], module: Module, max_shard_size: int | None) -> ExportLayout:
    """The files of the export: one file (``max_shard_size=None``), or a directory as ``save_pretrained`` writes it.

    Args:
        entries: Every tensor of the model's state dict, in ``state_dict`` order (tied aliases each once per name).
        module: The model (its FSDP1 wrapper included), for the tied-weight and ignore rules.
        max_shard_size: The largest shard in bytes, for a directory export.

    Raises:
        ExportUnsupported: If a dtype has no safetensors name, or (a directory) transformers would store the
            model's weights under converted names.

    """
    model = unwrapped(module)
    hf_model = transformers_model(model)
    kept = _kept(entries, model)
    if hf_model is not None and max_shard_size is not None:  # one file keeps the state_dict names, in any order
        order = _save_order(hf_model)
        if order is not None:
            kept = sorted(kept, key=lambda entry: order(entry.name))
    for entry in kept:
        if entry.dtype not in DTYPES:
            raise ExportUnsupported(f"safetensors has no dtype for {entry.dtype} ({entry.name!r})")
    if max_shard_size is None:
        files = [ExportFile("", [(entry.name, entry.record) for entry in kept])]
        index = None
    else:
        shards = _split(kept, max_shard_size)
        if len(shards) <= 1:
            files = [ExportFile(WEIGHTS_NAME, [(entry.name, entry.record) for entry in kept])]
            index = None
        else:
            count = len(shards)
            files = [
                ExportFile(f"model-{number:05d}-of-{count:05d}.safetensors", [(e.name, e.record) for e in shard])
                for number, shard in enumerate(shards, start=1)
            ]
            index = _index(files, kept, entries, hf_model is not None)
    by_record = {entry.record: entry for entry in kept}
    placement: dict[int, tuple[int, int]] = {}
    ends = []
    for position, file in enumerate(files):
        file.header = header([(name, by_record[record]) for name, record in file.tensors])
        offset = len(file.header)
        for _, record in file.tensors:
            placement[record] = (position, offset)
            offset += by_record[record].nbytes
        ends.append(offset)
    dtype = next((e.dtype for e in entries if e.parameter and e.dtype.is_floating_point), None)
    return ExportLayout(files, placement, ends, index, hf_model, dtype)


def header(tensors: list[tuple[str, Entry]]) -> bytes:
    """A safetensors header (its length prefix included, padded to 8 bytes): the tensors back to back, in order."""
    content: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, entry in tensors:
        content[name] = {
            "dtype": DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    encoded = json.dumps(content, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def write_configuration(layout: ExportLayout, directory: str) -> None:
    """Rank 0: ``config.json`` (and ``generation_config.json``) of a transformers model, as ``save_pretrained``."""
    import copy

    model = layout.hf_model
    if model is None:
        return
    config = copy.deepcopy(model.config)  # save_pretrained sets these on the model's own config; this leaves it be
    if layout.dtype is not None:
        config.dtype = str(layout.dtype).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(directory)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and model.can_generate():
        generation_config.save_pretrained(directory)


def _kept(entries: list[Entry], model: Module) -> list[Entry]:
    """The entries stored: one name per tied tensor, none of the names the model ignores on save."""
    patterns = _tied_patterns(model)
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    position = {entry.name: index for index, entry in enumerate(entries)}
    chosen: dict[int, str] = {}
    for entry in entries:
        if entry.record in chosen:
            continue
        names = [name for name in entry.names if name not in ignored]
        if len(names) > 1:
            matching = [name for name in sorted(names) if any(re.search(pattern, name) for pattern in patterns)]
            dropped = set(matching) if len(matching) < len(names) else set(matching[:-1])
            names = [name for name in names if name not in dropped]
        if names:  # the first remaining name in state_dict order
            chosen[entry.record] = min(names, key=lambda name: position.get(name, len(position)))
    return [entry for entry in entries if chosen.get(entry.record) == entry.name]


def _tied_patterns(model: Module) -> list[str]:
    patterns = []
    for name, submodule in model.named_modules():
        keys = getattr(submodule, "_tied_weights_keys", None) or ()
        prefix = clean_name(name)
        patterns.extend(f"{prefix}.{key}" if prefix else key for key in keys)
    return patterns


def _split(entries: list[Entry], max_shard_size: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for entry in entries:
        if entry.nbytes > max_shard_size:
            shards.append([entry])
            continue
        if current and size + entry.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current:
        shards.append(current)
    return shards


def _index(files: list[ExportFile], kept: list[Entry], entries: list[Entry], transformers: bool) -> bytes:
    metadata: dict[str, int] = {"total_size": sum(entry.nbytes for entry in kept)}
    if transformers:  # save_pretrained adds `num_parameters()`: every parameter once, buffers not counted
        counted: dict[int, int] = {e.record: math.prod(e.shape) for e in entries if e.parameter}
        metadata["total_parameters"] = sum(counted.values())
    weight_map = {name: file.name for file in files for name, _ in file.tensors}
    return (json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n").encode()


def _save_order(model: Module) -> Callable[[str], Any] | None:
    """The sort key ``save_pretrained`` puts the names in before sharding, ``None`` for ``state_dict`` order.

    ``save_pretrained`` reverts the weight conversions transformers applied when loading (``_weight_conversions``,
    set by ``from_pretrained``; else the model type's default ``conversion_mapping``). With none to revert on a model
    not loaded by ``from_pretrained``, the ``state_dict`` order stays; a model loaded by ``from_pretrained`` has its
    (empty) list, and the names are sorted by ``dot_natural_key``. Conversions that rename or reshape are refused.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, dot_natural_key
    except ImportError:  # a transformers without weight conversions
        return None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [
            c for c in get_model_conversion_mapping(model, add_legacy=False) or [] if not isinstance(c, PrefixChange)
        ]
        if not conversions:
            return None
    if conversions:
        raise ExportUnsupported(
            f"`save_pretrained` stores the weights of `{type(model).__name__}` under converted names (transformers'"
            " weight conversions), which this export does not reproduce"
        )
    return dot_natural_key
