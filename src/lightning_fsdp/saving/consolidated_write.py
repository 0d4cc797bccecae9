"""The gather-free save's writes: each rank's slices at their planned offsets, then rank 0's part, then the rename.

Each rank writes the ranges it holds with positioned writes (``os.pwrite``), straight from its shard's memory (or from
its host copy, for a save in the background, :func:`_snapshot`), staged through at most :data:`STAGING_BYTES` of host
memory for tensors on an accelerator, and computes a partial CRC-32 (:mod:`lightning_fsdp.saving.crc`). Rank 0 then
writes every local header, the small storages, the pickle and the zip directory (:func:`_finish`), or a safetensors
export's headers and index (:func:`_finish_export`), and puts a directory in place of an earlier one
(:func:`_replace_directory`). The layout is :mod:`lightning_fsdp.saving.consolidated_plan`'s.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from __future__ import annotations

import errno
import os
import sys
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_fsdp.layouts.targets import Run
from lightning_fsdp.saving import archive, export
from lightning_fsdp.saving.consolidated_plan import SaveUnsupported, _Layout, _LocalWrite
from lightning_fsdp.saving.crc import SparseCrc, combine_sparse

if TYPE_CHECKING:
    from lightning_fsdp.saving.background import HostBuffers

#: Bytes of a tensor on an accelerator copied to host memory at a time before they are written.
STAGING_BYTES = 64 * 2**20
#: The most bytes one ``os.pwrite`` call is given (Linux writes at most about 2 GiB per call).
_WRITE_BYTES = 1 << 30


def _snapshot(writes: list[_LocalWrite], buffers: HostBuffers) -> list[_LocalWrite]:
    """The writes, from copies in host memory: one per distinct memory written, in ``buffers`` (reused save to save).

    Several records may be written from the same memory (the optimizer state of an FSDP flat parameter holds the
    slices of several tensors): it is copied once. The copies are laid out in the order of the writes, which is the
    same from one save to the next of the same model and optimizers.

    """
    slots: list[int] = []
    distinct: dict[tuple[int, int, torch.dtype], int] = {}
    sources: list[Tensor] = []
    for write in writes:
        key = (write.flat.data_ptr(), write.flat.numel(), write.flat.dtype)
        if key not in distinct:
            distinct[key] = len(sources)
            sources.append(write.flat)
        slots.append(distinct[key])
    # pinned where the slices are on a GPU: the copy runs as a DMA and overlaps what follows
    pin = any(source.device.type == "cuda" for source in sources)
    copies = buffers.views([(source.numel(), source.dtype) for source in sources], pin)
    for copy, source in zip(copies, sources, strict=True):
        copy.copy_(source, non_blocking=pin)
    if pin:
        torch.cuda.synchronize()
    return [_LocalWrite(write.record, copies[slot], write.runs) for write, slot in zip(writes, slots, strict=True)]


def _preallocate(fd: int, size: int) -> None:
    """Reserve the blocks of the file's first ``size`` bytes before the ranks write their slices into them.

    Every rank writes its slices at scattered offsets; with the blocks reserved first, those writes allocate nothing
    (four ranks writing 3.2 GB took 10-35% less time with it than without, on ext4). Linux's ``fallocate`` only:
    ``posix_fallocate`` emulates it, where a file system lacks it, by writing every block, which would cost more than
    it saves on a network file system. Where it is not available, nothing happens.

    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate
    except (OSError, AttributeError):
        return
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate(fd, 0, 0, size)  # a failure (EOPNOTSUPP, ENOSPC) leaves it to the writes, which report it


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwrite(fd, data[:_WRITE_BYTES], offset)
        if written <= 0:
            raise OSError(errno.EIO, "os.pwrite wrote nothing")
        data = data[written:]
        offset += written


def _host_bytes(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous 1-D host tensor, without a copy."""
    return memoryview(tensor.view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")


def _write_runs(fds: list[int], writes: list[_LocalWrite], layout: _Layout, crc: bool = True) -> dict[int, int]:
    """Write this rank's runs; return the sparse CRC of every record (this rank's bytes, zeros elsewhere)."""
    by_record: dict[int, list[tuple[Run, Tensor]]] = {}
    for write in writes:
        by_record.setdefault(write.record, []).extend((run, write.flat) for run in write.runs if run.count)
    crcs = {}
    for index, record in enumerate(layout.records):
        placed = layout.placed[index]
        if placed is None:
            continue
        fd = fds[layout.files[index]]
        sparse = SparseCrc(record.nbytes) if crc else None
        itemsize = record.dtype.itemsize
        for run, flat in sorted(by_record.get(index, []), key=lambda item: item[0].start):
            piece = flat[run.offset : run.offset + run.count]
            if piece.dtype != record.dtype:
                raise SaveUnsupported(f"{record.label!r} is {piece.dtype} on this rank, {record.dtype} in the plan")
            step = max(STAGING_BYTES // itemsize, 1)
            for chunk_start in range(0, run.count, step):
                chunk = piece[chunk_start : chunk_start + step]
                if chunk.device.type != "cpu":
                    chunk = chunk.to("cpu")  # one staging buffer of at most STAGING_BYTES at a time
                data = _host_bytes(chunk)
                position = (run.start + chunk_start) * itemsize
                _pwrite_all(fd, data, placed.data_offset + position)
                if sparse is not None:
                    sparse.add(position, data)
        if sparse is not None:
            crcs[index] = sparse.value()
    return crcs


def _open_shared(paths: list[Path], token: str) -> tuple[list[int], bool]:
    """Open the files that rank 0 created; whether each holds its mark (else the ranks do not share them)."""
    fds: list[int] = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            break
        fds.append(fd)
        if os.pread(fd, len(token.encode()), 0) != token.encode():
            break
    else:
        return fds, True
    for fd in fds:
        os.close(fd)
    return [], False


def _finish_export(fds: list[int], exported: export.ExportLayout, directory: Path | None) -> None:
    """Rank 0: every file's header; for a directory, the index and a transformers model's configuration."""
    for fd, file, end in zip(fds, exported.files, exported.ends, strict=True):
        _pwrite_all(fd, memoryview(file.header), 0)
        os.ftruncate(fd, end)
        os.fsync(fd)
    if directory is None:
        return
    if exported.index is not None:
        (directory / export.INDEX_NAME).write_bytes(exported.index)
    export.write_configuration(exported, str(directory))
    shards = {file.name for file in exported.files}
    for entry in os.scandir(directory):
        if entry.name not in shards and entry.is_file():
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_directory(directory)


def _replace_directory(new: Path, path: Path) -> None:
    """Rank 0: put the directory ``new`` at ``path``; an earlier directory there is replaced, or kept on failure.

    Where the system can (Linux ``renameat2(RENAME_EXCHANGE)``), the two directories are swapped in one step, so
    that ``path`` is always a complete directory; elsewhere the earlier one is first renamed aside (and back if the
    second rename fails). The earlier directory is then removed.
    """
    import shutil

    if not os.path.lexists(path):
        os.rename(new, path)
        return
    if _swap(new, path):
        shutil.rmtree(new, ignore_errors=True)  # now the earlier directory
        return
    aside = new.with_suffix(".old")
    os.rename(path, aside)
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(aside, path)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _swap(first: Path, second: Path) -> bool:
    """Exchange two paths atomically with Linux's ``renameat2``; ``False`` where it is not available."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0


def _finish(fd: int, layout: _Layout, all_crcs: list[list[int]], full_state: Any) -> None:
    """Rank 0: the local headers of the storages, the small storages, the pickle, the small records, the directory."""
    directory: list[tuple[archive.RecordLayout, int]] = []
    for index, placed in enumerate(layout.placed):
        assert placed is not None  # every record of a torch.save archive is stored
        crc = combine_sparse([crcs[index] for crcs in all_crcs], placed.size)
        _pwrite_all(fd, memoryview(archive.local_header(placed, crc)), placed.header_offset)
        directory.append((placed, crc))

    small: list[tuple[str, bytes]] = []

    def new_storage(tensor: Tensor) -> archive.StorageRef:
        from torch.serialization import location_tag

        storage = tensor.untyped_storage()
        key = str(len(layout.records) + len(small))
        data = bytes(storage.cpu()) if storage.nbytes() else b""
        small.append((archive.storage_record_name(key), data))
        return archive.StorageRef(key, tensor.dtype, storage.nbytes() // tensor.dtype.itemsize, location_tag(storage))

    pickled = archive.pickle_state(full_state, new_storage)
    records = [*small, (f"{archive.PREFIX}/data.pkl", pickled), *archive.small_records()]
    placed_small, end = archive.plan_records([(name, len(data)) for name, data in records], layout.end)
    for placed, (_, data) in zip(placed_small, records, strict=True):
        crc = zlib.crc32(data)
        _pwrite_all(fd, memoryview(archive.local_header(placed, crc) + data), placed.header_offset)
        directory.append((placed, crc))
    central = archive.central_directory(directory, end)
    _pwrite_all(fd, memoryview(central), end)
    os.ftruncate(fd, end + len(central))
    os.fsync(fd)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
