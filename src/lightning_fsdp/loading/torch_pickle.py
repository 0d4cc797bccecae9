"""Read the structure of a ``torch.save`` file (zip format) and prove where each tensor's bytes are.

The object is unpickled with every storage on the meta device, through torch's weights-only unpickler unless the
caller trusts the file, so nothing but tensors and plain containers is built and no tensor data is read. Each storage
the pickle names is then matched with its zip record (:mod:`~lightning_fsdp.loading.zip_records`), whose size must be
exactly what the pickle says the storage holds.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import io
import pickle
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_fsdp.loading.errors import CheckpointLoadError, first_line, quoted_names
from lightning_fsdp.loading.files import (
    CheckpointPath,
    OpenFile,
    close_file,
    file_stream,
    open_file,
    read_exactly,
    require_regular_file,
)
from lightning_fsdp.loading.sources import TensorLocation, TensorSpec
from lightning_fsdp.loading.zip_records import (
    CENTRAL_HEADER_SIZE,
    END_RECORD_SIZE,
    LOCAL_HEADER,
    LOCAL_HEADER_SIGNATURE,
    ZipEndMissing,
    check_zip_end,
    read_record,
    read_zip_records,
    verify_record_crc,
)


@dataclass(frozen=True)
class StorageBytes:
    """Where the bytes of one storage of a ``torch.save`` file are."""

    offset: int
    """Absolute byte offset in the file."""
    nbytes: int


@dataclass
class TorchFileStructure:
    """A ``torch.save`` file's object, with tensors on the meta device, and where each storage's bytes are."""

    path: Path
    content: Any
    storages: dict[int, StorageBytes]
    """Storage (by its ``_cdata``) -> its bytes in the file."""

    def locate(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorLocation]:
        """Where the bytes of each of ``tensors`` (taken from :attr:`content`) are.

        Raises:
            CheckpointLoadError: If a tensor is not backed by a storage of the file (a sparse or otherwise rebuilt
                tensor).

        """
        locations = {}
        for name, tensor in tensors.items():
            storage = self.storages.get(tensor.untyped_storage()._cdata)
            if storage is None or tensor.layout is not torch.strided:
                raise CheckpointLoadError(
                    f"The tensor {name!r} in {str(self.path)!r} is not a plain dense tensor backed by the file's"
                    " storages (sparse, quantized or rebuilt from other objects), which the loader does not load."
                    " Save a state dict of dense tensors."
                )
            spec = TensorSpec(tuple(tensor.shape), tensor.dtype)
            stride = None if tensor.is_contiguous() else tuple(tensor.stride())
            # Checked against the file's size by the source that reads them.
            locations[name] = TensorLocation(
                self.path, storage.offset, storage.nbytes, spec, element_offset=tensor.storage_offset(), stride=stride
            )
        return locations


def read_zip_structure(path: Path, weights_only: bool, verify_crc: bool = False) -> TorchFileStructure:
    """Unpickle a zip-format ``torch.save`` file's object with tensors on the meta device, and locate its storages.

    Args:
        path: The file.
        weights_only: Unpickle only tensors and plain containers.
        verify_crc: Check every storage record against its CRC too (reads the whole file once, a few MiB at a time).

    Raises:
        CheckpointLoadError: If the file is unsafe (with ``weights_only``), corrupt, truncated, or its pickle and its
            records disagree.

    """
    info = require_regular_file(path)
    file = open_file(path)
    try:
        try:
            records = read_zip_records(path, file, info.st_size)
        except ZipEndMissing as missing:
            raise _with_the_size_needed(missing, file) from None
        pickles = [name for name in records if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise CheckpointLoadError(
                f"The file {str(path)!r} is a zip archive but not a `torch.save` checkpoint: it has"
                f" {len(pickles)} `data.pkl` records where torch writes one. Its records: {quoted_names(records)}."
            )
        prefix = pickles[0].removesuffix("data.pkl")
        byteorder = records.get(f"{prefix}byteorder")
        if byteorder is not None and read_record(path, file, byteorder) != b"little":
            raise CheckpointLoadError(
                f"The file {str(path)!r} was saved on a big-endian machine, which the loader does not read. Load it"
                " with `torch.load` and save it again on this machine."
            )
        data = read_record(path, file, records[pickles[0]])
        storages: dict[int, StorageBytes] = {}
        by_key: dict[str, torch.TypedStorage] = {}

        def persistent_load(saved_id: Any) -> torch.TypedStorage:
            if not isinstance(saved_id, tuple) or len(saved_id) != 5 or _ascii(saved_id[0]) != "storage":
                raise CheckpointLoadError(f"The file {str(path)!r} names an unknown kind of persistent object.")
            _, storage_type, key, _location, numel = saved_id
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else getattr(storage_type, "dtype", None)
            key = _ascii(key)
            if not isinstance(dtype, torch.dtype) or not isinstance(numel, int) or numel < 0:
                raise CheckpointLoadError(f"The file {str(path)!r} describes the storage {key!r} inconsistently.")
            if key in by_key:
                return by_key[key]
            record = records.get(f"{prefix}data/{key}")
            nbytes = numel * dtype.itemsize
            if record is None or not record.stored or record.size != nbytes:
                found = "no record" if record is None else f"a record of {record.size} bytes"
                if record is not None and not record.stored:
                    found = "a compressed record"
                raise CheckpointLoadError(
                    f"The file {str(path)!r} is corrupt: its pickle says the storage {key!r} holds {nbytes} bytes, but"
                    f" the archive has {found} for it. Re-copy or re-save the checkpoint."
                )
            if verify_crc:
                verify_record_crc(path, file, record)
            untyped = torch.UntypedStorage(nbytes, device="meta")
            storage = torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
            storages[untyped._cdata] = StorageBytes(record.data_offset, nbytes)
            by_key[key] = storage
            return storage

        with unpickling_errors(path, weights_only):
            unpickler = unpickler_class(weights_only)(io.BytesIO(data), encoding="utf-8")
            unpickler.persistent_load = persistent_load
            content = unpickler.load()
        return TorchFileStructure(path, content, storages)
    finally:
        close_file(file)


def zip_truncation(path: CheckpointPath) -> ZipEndMissing | None:
    """The error for the zip-format ``torch.save`` file ``path`` if it lost its end, else ``None``.

    For the errors of readers other than :func:`read_zip_structure` (``torch.load``): it gives the file's size and the
    size that its pickle or zip64 end record says it had.

    """
    info = require_regular_file(path)
    file = open_file(path)
    try:
        check_zip_end(path, file, info.st_size)
        return None
    except ZipEndMissing as missing:
        return _with_the_size_needed(missing, file)
    finally:
        close_file(file)


def _with_the_size_needed(missing: ZipEndMissing, file: OpenFile) -> ZipEndMissing:
    """``missing``, with the larger of the size it gives and the size that the file's pickle needs."""
    known = [size for size in (missing.needed, _size_needed(missing.path, file, missing.file_size)) if size is not None]
    return ZipEndMissing(missing.path, missing.file_size, max(known, default=None))


def _size_needed(path: Path, file: OpenFile, file_size: int) -> int | None:
    """The size that a truncated ``torch.save`` file had at least, from the pickle it starts with, or ``None``.

    ``torch.save`` writes the pickle as the archive's first record, then one record for each storage it lists: the
    file held at least the pickle, each storage's local header, name and bytes, a central directory entry for each of
    these records, and the zip's end record. The pickle is read with torch's weights-only unpickler whatever the load
    asked for (the file is damaged, and only the storages' sizes are wanted); ``None`` if it cannot be read.

    """
    header = bytearray(LOCAL_HEADER.size)
    if file_size < len(header):
        return None
    read_exactly(file, 0, memoryview(header), path, "the first zip header")
    signature, *_, name_length, extra_length = LOCAL_HEADER.unpack(header)
    name = bytearray(name_length)
    if signature != LOCAL_HEADER_SIGNATURE or len(header) + name_length > file_size:
        return None
    read_exactly(file, len(header), memoryview(name), path, "the first zip record's name")
    pickle_name = bytes(name).decode("utf-8", "replace")
    if not pickle_name.endswith("/data.pkl"):
        return None
    prefix = pickle_name.removesuffix("data.pkl")
    storages: dict[str, int] = {}

    def persistent_load(saved_id: Any) -> torch.TypedStorage:
        _, storage_type, key, _, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        storages[str(_ascii(key))] = numel * dtype.itemsize
        return torch.TypedStorage(
            wrap_storage=torch.UntypedStorage(storages[str(_ascii(key))], device="meta"), dtype=dtype, _internal=True
        )

    try:
        with file_stream(file) as stream:
            stream.seek(len(header) + name_length + extra_length)
            unpickler = unpickler_class(weights_only=True)(stream, encoding="utf-8")
            unpickler.persistent_load = persistent_load
            unpickler.load()
            pickle_end = stream.tell()
    except Exception:  # a damaged pickle can raise nearly anything: the error then gives the size only
        return None
    lengths = [len(f"{prefix}data/{key}".encode()) for key in storages]  # the storages' record names
    records = sum(LOCAL_HEADER.size + length for length in lengths) + sum(storages.values())
    directory = sum(CENTRAL_HEADER_SIZE + length for length in [name_length, *lengths])
    return pickle_end + records + directory + END_RECORD_SIZE


def unpickler_class(weights_only: bool) -> type:
    """Torch's weights-only unpickler (tensors and plain containers only), or the plain one for trusted files."""
    if weights_only:
        from torch._weights_only_unpickler import Unpickler

        return Unpickler
    return pickle.Unpickler


@contextmanager
def unpickling_errors(path: Path, weights_only: bool) -> Iterator[None]:
    """Turn whatever unpickling a bad or unsafe file raises into one :class:`CheckpointLoadError` that says why."""
    try:
        yield
    except CheckpointLoadError:
        raise
    except pickle.UnpicklingError as error:
        if weights_only:
            raise CheckpointLoadError(
                f"Refused to unpickle {str(path)!r}: it holds objects other than tensors and plain containers, which"
                " could run code when loaded (the payload was not run), or it is corrupt. If you trust the file and"
                f" its author, load it with `weights_only=False`. Details: {first_line(error)}"
            ) from None
        raise CheckpointLoadError(
            f"The file {str(path)!r} is not a readable `torch.save` file: {first_line(error)}"
        ) from None
    except Exception as error:  # a damaged pickle can raise nearly anything
        raise CheckpointLoadError(
            f"The file {str(path)!r} could not be read as a `torch.save` checkpoint: it looks truncated or corrupt"
            f" ({type(error).__name__}: {first_line(error)}). Re-copy or re-save it."
        ) from None


def _ascii(value: Any) -> Any:
    return value.decode("ascii") if isinstance(value, bytes) else value
