"""Read and check the header of a ``.safetensors`` file: where each tensor's bytes are, proven before any is read.

A safetensors file is an 8-byte little-endian header size, a JSON header that maps each name to its dtype, shape and
byte range, and the tensors' bytes. The header is checked as the safetensors library checks it, and once for every
reader (loading, ``inspect`` and ``convert``): every name once, a known dtype, non-negative integer dimensions,
``dtype size x elements = bytes``, and byte ranges that cover the data exactly, in order, without gaps or overlaps.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import json
import math
from pathlib import Path
from typing import Any

import torch

from lightning_fsdp.loading.errors import CheckpointLoadError, first_line
from lightning_fsdp.loading.files import close_file, open_file, read_exactly, require_regular_file
from lightning_fsdp.loading.sources import MAX_TENSORS, TensorLocation, TensorSpec

#: The safetensors library refuses larger headers (its ``MAX_HEADER_SIZE``); so does this reader.
MAX_HEADER_BYTES = 100_000_000
_HEADER_SIZE_BYTES = 8
_METADATA_KEY = "__metadata__"
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}

#: The dtypes of the safetensors format by their names in a header (the export writes the same names).
DTYPES = {
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
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors_locations(path: Path) -> dict[str, TensorLocation]:
    """Where each tensor of a safetensors file is, after checking the whole header against the file.

    Raises:
        CheckpointLoadError: If the file is not a valid safetensors file; the message says what is wrong.

    """
    return read_safetensors_header(path)[0]


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorLocation], dict[str, str]]:
    """:func:`read_safetensors_locations`, and the header's ``__metadata__`` (a map of strings, empty where absent).

    Raises:
        CheckpointLoadError: If the file is not a valid safetensors file; the message says what is wrong.

    """
    file_size = require_regular_file(path).st_size
    file = open_file(path)
    try:
        if file_size < _HEADER_SIZE_BYTES:
            raise _invalid(path, "it is shorter than the 8-byte header size")
        size_bytes = bytearray(_HEADER_SIZE_BYTES)
        read_exactly(file, 0, memoryview(size_bytes), path, "the header size")
        header_size = int.from_bytes(size_bytes, "little")
        if header_size > MAX_HEADER_BYTES:
            raise _invalid(
                path,
                f"its header is {header_size} bytes, more than the limit of {MAX_HEADER_BYTES} (the safetensors"
                " library's)",
            )
        if _HEADER_SIZE_BYTES + header_size > file_size:
            raise _invalid(path, f"its header size ({header_size} bytes) exceeds the file ({file_size} bytes)")
        header_bytes = bytearray(header_size)
        read_exactly(file, _HEADER_SIZE_BYTES, memoryview(header_bytes), path, "the header")
    finally:
        close_file(file)
    # Every entry has one "data_offsets" key: counting them costs a scan of the bytes, checking them one by one far
    # more. A name that spells the key can only make the count larger, never hide an entry.
    tensors = header_bytes.count(b'"data_offsets"')
    if tensors > MAX_TENSORS:
        raise _invalid(
            path,
            f"its header describes {tensors} tensors, more than the limit of {MAX_TENSORS} (the largest"
            " models have a few hundred thousand in all)",
        )
    try:
        header = json.loads(header_bytes)
        if isinstance(header, dict) and len(header) - (_METADATA_KEY in header) != tensors:
            # JSON keeps the last of a repeated name; only then (or for a name that spells the key) look for one.
            json.loads(header_bytes, object_pairs_hook=_refuse_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise _invalid(path, f"its header is not valid JSON ({first_line(error)})") from None
    del header_bytes
    if not isinstance(header, dict):
        raise _invalid(path, "its header is not a JSON object")
    metadata = header.pop(_METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _invalid(path, "its `__metadata__` is not a map of strings")

    data_start = _HEADER_SIZE_BYTES + header_size
    entries = sorted((_entry(path, name, value) for name, value in header.items()), key=lambda entry: entry[1])
    locations = {}
    expected_begin = 0
    for name, begin, end, spec in entries:
        if begin != expected_begin:
            raise _invalid(path, f"the bytes of {name!r} do not follow the previous tensor's (gap or overlap)")
        expected_begin = end
        locations[name] = TensorLocation(path, data_start + begin, end - begin, spec)
    if data_start + expected_begin != file_size:
        raise _invalid(path, f"its tensors cover {expected_begin} bytes but the file holds {file_size - data_start}")
    return locations, metadata


def _entry(path: Path, name: str, value: Any) -> tuple[str, int, int, TensorSpec]:
    # Run for every tensor of every file: checks by `type` and C-level scans, the same rules as the library's.
    if type(value) is not dict or value.keys() != _ENTRY_KEYS:
        raise _invalid(path, f"the entry of {name!r} is not {{dtype, shape, data_offsets}}")
    dtype = DTYPES.get(value["dtype"]) if type(value["dtype"]) is str else None
    if dtype is None:
        raise _invalid(path, f"the tensor {name!r} has dtype {value['dtype']!r}, which the loader does not read")
    shape, offsets = value["shape"], value["data_offsets"]
    if type(shape) is not list or not _all_counts(shape):
        raise _invalid(path, f"the tensor {name!r} has an invalid shape {shape!r}")
    if type(offsets) is not list or len(offsets) != 2 or not _all_counts(offsets):
        raise _invalid(path, f"the tensor {name!r} has invalid data offsets {offsets!r}")
    begin, end = offsets
    spec = TensorSpec(tuple(shape), dtype)
    if end < begin or end - begin != math.prod(shape) * dtype.itemsize:
        raise _invalid(
            path,
            f"the tensor {name!r} of shape {tuple(shape)} and dtype {value['dtype']} spans {end - begin}"
            " bytes, not its size",
        )
    return name, begin, end, spec


def _all_counts(values: list[Any]) -> bool:
    """Whether every value is a non-negative integer (not a bool, not a float)."""
    return set(map(type, values)) <= {int} and min(values, default=0) >= 0


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the name {key!r} appears twice")
            seen.add(key)
    return result


def _invalid(path: Path, reason: str) -> CheckpointLoadError:
    return CheckpointLoadError(
        f"The safetensors file {str(path)!r} is invalid: {reason}. It looks truncated or corrupt; re-copy or re-save"
        " it."
    )
