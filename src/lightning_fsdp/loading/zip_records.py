"""Where each record of a zip archive (a ``torch.save`` file) really is, proven from the archive's own headers.

The central directory says where each record's local header starts and how long its data is; the local header says
where the data starts. Both are checked against each other and against the file: the data of every record lies inside
the file and before the central directory, and no two records overlap. Records whose bytes are read by range must be
stored uncompressed (``torch.save`` always stores them so).

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.files import OpenFile, file_stream, read_exactly

LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"
_ENCRYPTED_FLAG = 0x1
_UTF8_FLAG = 0x800
_DESCRIPTOR_FLAG = 0x8
#: A data descriptor (after a record's data when its sizes were not known up front): 12 to 24 bytes.
_DESCRIPTOR_SIZES = (12, 16, 20, 24)
#: Bytes hashed per read when a record's CRC is checked (the record is streamed, never held whole).
_CRC_CHUNK_BYTES = 8 * 2**20
#: The end of central directory record, the last bytes of every zip file: 22 bytes, then a comment of up to 65,535.
_END_SIGNATURE = b"PK\x05\x06"
END_RECORD_SIZE = 22
_MAX_COMMENT_SIZE = 0xFFFF
#: The zip64 end of central directory record: signature, the size of the rest, versions, disks, entry counts, the
#: central directory's size and offset (then an extensible field); a 20-byte locator follows it.
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
_ZIP64_END_SIGNATURE = b"PK\x06\x06"
_ZIP64_LOCATOR_SIZE = 20
#: A central directory entry: 46 bytes and the record's name (then its extra field and comment).
CENTRAL_HEADER_SIZE = 46


class ZipEndMissing(CheckpointLoadError):
    """A zip archive whose end record is missing: the file is truncated (an interrupted copy, download or save).

    Args:
        path: The file.
        file_size: Its size.
        needed: The size that the structures found in it say it must have at least, where that is known.

    """

    def __init__(self, path: Path, file_size: int, needed: int | None = None) -> None:
        sizes = f"It has {file_size} bytes"
        if needed is not None and needed > file_size:
            sizes += f", but its records say it had at least {needed}"
        super().__init__(
            f"The file {str(path)!r} could not be read as a `torch.save` checkpoint: it is truncated. {sizes}; its"
            " zip end record (the last bytes of every zip file) is missing. Re-copy or re-save it, and compare its"
            " size with the original's."
        )
        self.path, self.file_size, self.needed = path, file_size, needed


@dataclass(frozen=True)
class ZipRecord:
    """One record of a zip archive, located from its central-directory entry and its local header."""

    name: str
    data_offset: int
    """The absolute offset of the record's first data byte in the file."""
    size: int
    """The record's size once uncompressed (``torch.save``'s records: its size in the file)."""
    stored: bool
    """Whether the data is stored uncompressed, so that any byte range of it can be read in place."""
    crc: int


def read_zip_records(path: Path, file: OpenFile, file_size: int) -> dict[str, ZipRecord]:
    """Read and check the directory of the zip archive open as ``file`` (a file descriptor of ``path``).

    Raises:
        ZipEndMissing: If the archive's end record is missing (the file is truncated).
        CheckpointLoadError: If the archive is corrupt, encrypted, or its headers contradict each other (records
            outside the file, overlapping, or whose local header disagrees with the central directory).

    """
    try:
        with file_stream(file) as handle, zipfile.ZipFile(handle) as archive:
            infos = archive.infolist()
            directory_start = archive.start_dir
    except Exception as error:  # zipfile raises many types for a damaged directory (NotImplementedError, ...)
        check_zip_end(path, file, file_size)
        raise _corrupt(path, f"its zip directory is unreadable: {type(error).__name__}: {error}") from None

    records: dict[str, ZipRecord] = {}
    spans: list[tuple[int, int, str]] = []
    for info in infos:
        if info.filename in records:
            raise _corrupt(path, f"the record {info.filename!r} appears twice in its zip directory")
        if info.flag_bits & _ENCRYPTED_FLAG:
            raise _corrupt(path, f"the record {info.filename!r} is encrypted")
        header = bytearray(LOCAL_HEADER.size)
        if info.header_offset < 0 or info.header_offset + len(header) > file_size:
            raise _corrupt(path, f"the local header of {info.filename!r} lies outside the file")
        read_exactly(file, info.header_offset, memoryview(header), path, f"the zip header of {info.filename!r}")
        signature, _, _, method, _, _, _, _, _, name_length, extra_length = LOCAL_HEADER.unpack(header)
        if signature != LOCAL_HEADER_SIGNATURE:
            raise _corrupt(path, f"the central directory points {info.filename!r} at bytes that are no local header")
        name = bytearray(name_length)
        read_exactly(file, info.header_offset + len(header), memoryview(name), path, "a zip record name")
        if bytes(name).decode("utf-8" if info.flag_bits & _UTF8_FLAG else "cp437", "replace") != info.orig_filename:
            raise _corrupt(path, f"the local header of {info.filename!r} names another record")
        if method != info.compress_type:
            raise _corrupt(path, f"the local header of {info.filename!r} disagrees on the compression")
        data_offset = info.header_offset + len(header) + name_length + extra_length
        data_end = data_offset + info.compress_size
        if data_end > directory_start or data_end > file_size:
            raise _corrupt(path, f"the data of {info.filename!r} runs past the end of the records")
        stored = info.compress_type == zipfile.ZIP_STORED
        if stored and info.compress_size != info.file_size:
            raise _corrupt(path, f"the stored record {info.filename!r} has two different sizes")
        records[info.filename] = ZipRecord(info.filename, data_offset, info.file_size, stored, info.CRC)
        descriptor = _DESCRIPTOR_SIZES if info.flag_bits & _DESCRIPTOR_FLAG else (0,)
        spans.append((info.header_offset, data_end, descriptor, info.filename))
    _check_every_byte_accounted_for(path, sorted(spans), directory_start)
    return records


def check_zip_end(path: Path, file: OpenFile, file_size: int) -> None:
    """Raise unless the end of the file open as ``file`` holds a zip end record, where ``zipfile`` looks for it.

    Raises:
        ZipEndMissing: If it does not (the file is truncated), with the size that a zip64 end record before it gives.

    """
    tail_offset = max(0, file_size - END_RECORD_SIZE - _MAX_COMMENT_SIZE)
    tail = bytearray(file_size - tail_offset)
    read_exactly(file, tail_offset, memoryview(tail), path, "the end of the zip archive")
    if not _holds_end_record(tail):
        raise ZipEndMissing(path, file_size, _size_from_zip64_end(tail, tail_offset))


def _holds_end_record(tail: bytearray) -> bool:
    """Whether the end of a file holds a whole end record (its signature and 22 bytes), as ``zipfile`` looks for it."""
    position = tail.rfind(_END_SIGNATURE)
    while position >= 0 and position + END_RECORD_SIZE > len(tail):  # cut short: a signature is not the record
        position = tail.rfind(_END_SIGNATURE, 0, position)
    return position >= 0


def _size_from_zip64_end(tail: bytearray, tail_offset: int) -> int | None:
    """The size of a zip64 archive whose end record is missing, from its zip64 end record where ``tail`` holds it.

    The zip64 end record (written by ``torch.save`` too) is followed by a 20-byte locator and the end record; it is
    taken as one only where the central directory it describes ends where it starts.

    """
    position = tail.rfind(_ZIP64_END_SIGNATURE)
    while position >= 0:
        if position + _ZIP64_END.size <= len(tail):
            _, rest, *_, directory_size, directory_offset = _ZIP64_END.unpack_from(tail, position)
            if directory_offset + directory_size == tail_offset + position:
                return tail_offset + position + 12 + rest + _ZIP64_LOCATOR_SIZE + END_RECORD_SIZE
        position = tail.rfind(_ZIP64_END_SIGNATURE, 0, position)
    return None


def _check_every_byte_accounted_for(path: Path, spans: list[tuple[int, int, tuple[int, ...], str]], end: int) -> None:
    """Raise unless the records tile the file from its start to the central directory.

    A length field that was changed, or a record whose data is not where its headers say, leaves a gap or an
    overlap.

    """
    position, previous = 0, "the start of the file"
    allowed: tuple[int, ...] = (0,)
    for start, data_end, descriptor, name in [*spans, (end, end, (0,), "the central directory")]:
        if start - position not in allowed:
            relation = "overlap" if start < position else f"leave {start - position} unaccounted bytes between them"
            raise _corrupt(path, f"{previous} and the record {name!r} {relation}")
        position, previous, allowed = data_end, f"the record {name!r}", descriptor


def read_record(path: Path, file: OpenFile, record: ZipRecord) -> bytes:
    """Read a whole record (decompressing it if needed) and check its CRC."""
    if record.stored:
        data = bytearray(record.size)
        read_exactly(file, record.data_offset, memoryview(data), path, f"the zip record {record.name!r}")
        _check_crc(path, record, zlib.crc32(data))
        return bytes(data)
    try:
        with file_stream(file) as handle, zipfile.ZipFile(handle) as archive:
            return archive.read(record.name)  # zipfile checks the CRC of what it decompresses
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, zlib.error) as error:
        raise _corrupt(path, f"the record {record.name!r} cannot be decompressed: {error}") from None


def verify_record_crc(path: Path, file: OpenFile, record: ZipRecord) -> None:
    """Stream a record and check it against the CRC in its header, holding at most a few MiB at a time."""
    if not record.stored:
        read_record(path, file, record)
        return
    crc = 0
    buffer = bytearray(min(record.size, _CRC_CHUNK_BYTES))
    position = 0
    while position < record.size:
        view = memoryview(buffer)[: min(len(buffer), record.size - position)]
        read_exactly(file, record.data_offset + position, view, path, f"the zip record {record.name!r}")
        crc = zlib.crc32(view, crc)
        position += len(view)
    _check_crc(path, record, crc)


def _check_crc(path: Path, record: ZipRecord, crc: int) -> None:
    if crc != record.crc:
        raise _corrupt(path, f"the record {record.name!r} does not match its checksum (CRC)")


def _corrupt(path: Path, reason: str) -> CheckpointLoadError:
    return CheckpointLoadError(
        f"The file {str(path)!r} could not be read as a `torch.save` checkpoint: {reason}. It looks truncated or"
        " corrupt; re-copy or re-save it."
    )
