"""The zip archive that ``torch.save`` writes, planned from metadata so that several processes can fill it.

``torch.save`` writes a zip archive of uncompressed records under one folder (``archive/``): ``data.pkl``, a pickle
(protocol 2) of the object in which every tensor is a call of ``torch._utils._rebuild_tensor_v2`` on a storage given
by a persistent id ``("storage", <storage class>, <key>, <location>, <elements>)``; one record ``data/<key>`` per
storage with its raw bytes (in the byte order named by the ``byteorder`` record); and the records ``version``,
``.format_version``, ``.storage_alignment`` and ``.data/serialization_id``. Every record's data starts at a multiple of
64 bytes of the file (an extra field of the local header pads it), so that a reader can map storages in place.

Here the order of the records is chosen so that the big ones can be placed before anything else is known: the
storages whose bytes the ranks write come first, at offsets that depend only on their sizes; the storages that rank 0
writes alone, the pickle and the small records follow; the central directory ends the file. Readers find records
through the central directory, so the order is free (the first record's folder names the archive, as in torch).
Records larger than 4 GiB, offsets past 4 GiB and more than 65,535 records use the zip64 extensions.
"""

import pickle
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ALIGNMENT = 64
PREFIX = "archive"
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_END = struct.Struct("<4sHHHHIIH")
_ZIP64_ID = 0x0001
_PADDING_ID = 0x6C66  # a private extra field ("lf"); readers skip fields they do not know
_MAX32 = 0xFFFFFFFF
#: Sizes and offsets from this value on are written in zip64 fields (the 32-bit field holds ``_MAX32``).
_ZIP64_AT = _MAX32
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01
_VERSION_ZIP64 = 45
_VERSION_PLAIN = 20

_STORAGE_CLASSES = {
    torch.float32: "FloatStorage",
    torch.float64: "DoubleStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage",
    torch.complex128: "ComplexDoubleStorage",
}


def storage_class_supported(dtype: torch.dtype) -> bool:
    """Whether ``torch.save`` names a storage class for ``dtype`` that this writer knows."""
    return dtype in _STORAGE_CLASSES


@dataclass(frozen=True)
class RecordLayout:
    """Where one record lies: its local header at ``header_offset``, its ``size`` bytes of data at ``data_offset``."""

    name: str
    header_offset: int
    data_offset: int
    size: int


def _needs_zip64_sizes(size: int) -> bool:
    return size >= _ZIP64_AT


def _local_extra(base: int, size: int) -> bytes:
    """The local header's extra field: zip64 sizes if needed, then padding that aligns the data that follows."""
    extra = struct.pack("<HHQQ", _ZIP64_ID, 16, size, size) if _needs_zip64_sizes(size) else b""
    padding = -(base + len(extra) + 4) % ALIGNMENT
    return extra + struct.pack("<HH", _PADDING_ID, padding) + b"\0" * padding


def plan_records(records: list[tuple[str, int]], start: int) -> tuple[list[RecordLayout], int]:
    """Place ``(name, size)`` records one after the other from ``start``; return them and the offset after the last."""
    placed = []
    offset = start
    for name, size in records:
        encoded = name.encode()
        extra = _local_extra(offset + _LOCAL.size + len(encoded), size)
        data_offset = offset + _LOCAL.size + len(encoded) + len(extra)
        placed.append(RecordLayout(name, offset, data_offset, size))
        offset = data_offset + size
    return placed, offset


def local_header(record: RecordLayout, crc: int) -> bytes:
    """The local header (and its extra field) of ``record``: ``data_offset - header_offset`` bytes."""
    encoded = record.name.encode()
    zip64 = _needs_zip64_sizes(record.size)
    size32 = _MAX32 if zip64 else record.size
    extra = _local_extra(record.header_offset + _LOCAL.size + len(encoded), record.size)
    header = _LOCAL.pack(
        b"PK\x03\x04",
        _VERSION_ZIP64 if zip64 else _VERSION_PLAIN,
        0,
        0,
        0,
        _DOS_DATE,
        crc,
        size32,
        size32,
        len(encoded),
        len(extra),
    )
    result = header + encoded + extra
    assert len(result) == record.data_offset - record.header_offset
    return result


def central_directory(records: list[tuple[RecordLayout, int]], start: int) -> bytes:
    """The central directory of ``(record, crc)`` pairs written at ``start``, and the end records after it."""
    entries = []
    for record, crc in records:
        encoded = record.name.encode()
        fields = []
        size32 = offset32 = None
        if _needs_zip64_sizes(record.size):
            fields += [record.size, record.size]
            size32 = _MAX32
        if record.header_offset >= _ZIP64_AT:
            fields.append(record.header_offset)
            offset32 = _MAX32
        extra = struct.pack(f"<HH{len(fields)}Q", _ZIP64_ID, 8 * len(fields), *fields) if fields else b""
        version = _VERSION_ZIP64 if fields else _VERSION_PLAIN
        entries.append(
            _CENTRAL.pack(
                b"PK\x01\x02",
                version,
                version,
                0,
                0,
                0,
                _DOS_DATE,
                crc,
                size32 if size32 is not None else record.size,
                size32 if size32 is not None else record.size,
                len(encoded),
                len(extra),
                0,
                0,
                0,
                0,
                offset32 if offset32 is not None else record.header_offset,
            )
            + encoded
            + extra
        )
    directory = b"".join(entries)
    end_offset = start + len(directory)
    count = len(records)
    zip64_end = _ZIP64_END.pack(
        b"PK\x06\x06", _ZIP64_END.size - 12, _VERSION_ZIP64, _VERSION_ZIP64, 0, 0, count, count, len(directory), start
    )
    locator = _ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, end_offset, 1)
    end = _END.pack(
        b"PK\x05\x06",
        0,
        0,
        min(count, 0xFFFF),
        min(count, 0xFFFF),
        len(directory) if len(directory) < _ZIP64_AT else _MAX32,
        start if start < _ZIP64_AT else _MAX32,
        0,
    )
    return directory + zip64_end + locator + end


@dataclass(frozen=True)
class StorageRef:
    """A storage of the archive: record ``data/<key>`` holds ``numel`` elements of ``dtype``."""

    key: str
    dtype: torch.dtype
    numel: int
    location: str = "cpu"


@dataclass(frozen=True)
class TensorStandIn:
    """A contiguous tensor of ``shape`` over a whole storage, in the object that rank 0 pickles."""

    storage: StorageRef
    shape: tuple[int, ...]

    def stride(self) -> tuple[int, ...]:
        strides = []
        step = 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= max(size, 1)
        return tuple(reversed(strides))


class UnpicklableTensor(Exception):
    """A tensor that this writer does not pickle as ``torch.save`` would (a subclass, sparse, quantized)."""


def pickle_state(obj: Any, new_storage: Callable[[Tensor], StorageRef]) -> bytes:
    """``obj`` pickled as ``torch.save`` pickles it; real tensors get storages from ``new_storage`` (once each)."""
    import io

    buffer = io.BytesIO()
    _Pickler(buffer, new_storage).dump(obj)
    return buffer.getvalue()


class _Pickler(pickle.Pickler):
    def __init__(self, file: Any, new_storage: Callable[[Tensor], StorageRef]) -> None:
        super().__init__(file, protocol=2)
        self._new_storage = new_storage
        self._storages: dict[tuple[int, int], StorageRef] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            storage_class = getattr(torch, _STORAGE_CLASSES[obj.dtype])
            return ("storage", storage_class, obj.key, obj.location, obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        from torch._utils import _rebuild_tensor_v2

        if isinstance(obj, TensorStandIn):
            return _rebuild_tensor_v2, (obj.storage, 0, obj.shape, obj.stride(), False, OrderedDict())
        if isinstance(obj, Tensor):
            if type(obj) is not Tensor or obj.layout is not torch.strided or obj.is_quantized:
                raise UnpicklableTensor(f"a tensor of type {type(obj).__name__} with layout {obj.layout}")
            if obj.dtype not in _STORAGE_CLASSES:
                raise UnpicklableTensor(f"a tensor of dtype {obj.dtype}")
            storage = obj.untyped_storage()
            identity = (storage.data_ptr(), storage.nbytes())
            ref = self._storages.get(identity)
            if ref is None:
                ref = self._storages[identity] = self._new_storage(obj)
            args = (ref, obj.storage_offset(), tuple(obj.shape), obj.stride(), obj.requires_grad, OrderedDict())
            return _rebuild_tensor_v2, args
        return NotImplemented


def small_records(serialization_id: str | None = None) -> list[tuple[str, bytes]]:
    """The records besides the pickle and the storages, with the values ``torch.save`` writes."""
    import sys

    return [
        (f"{PREFIX}/.format_version", b"1"),
        (f"{PREFIX}/.storage_alignment", str(ALIGNMENT).encode()),
        (f"{PREFIX}/byteorder", sys.byteorder.encode()),
        (f"{PREFIX}/version", b"3\n"),
        (f"{PREFIX}/.data/serialization_id", (serialization_id or _serialization_id()).encode()),
    ]


def _serialization_id() -> str:
    return "".join(str(secrets.randbelow(10)) for _ in range(40))


def storage_record_name(key: str) -> str:
    """The record that holds the storage ``key``."""
    return f"{PREFIX}/data/{key}"
