"""Open checkpoint files safely: only regular files, and reads whose every byte is accounted for.

A path that is a FIFO or a device would block ``open`` or ``read`` forever (or read endless bytes), so every file the
loader opens is checked with :func:`require_regular_file` first. :func:`read_exactly` reads a byte range with
positioned reads into the caller's buffer: unlike a memory map, a file that shrinks while it is read gives an error,
never a ``SIGBUS``.

Upstream destination: ``src/lightning/fabric/utilities/load.py``.
"""

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.remote import RemoteFile, RemotePath

#: What the loader reads: a local file, or an object in object storage (:mod:`~lightning_fsdp.loading.remote`).
CheckpointPath = Path | RemotePath
#: An open file: a file descriptor, or an object opened for ranged reads.
OpenFile = int | RemoteFile


def require_regular_file(path: CheckpointPath, what: str = "checkpoint file") -> Any:
    """Return the ``stat`` of ``path`` (symbolic links followed), or raise if it is not a regular file.

    Raises:
        CheckpointLoadError: If the path does not exist, or is a FIFO, socket, device or directory.

    """
    if isinstance(path, RemotePath):
        return path.stat(what)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CheckpointLoadError(
            f"The {what} {str(path)!r} does not exist. Check the path (it must be reachable from every node)."
        ) from None
    except OSError as error:
        raise CheckpointLoadError(f"The {what} {str(path)!r} cannot be read: {error.strerror or error}.") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointLoadError(
            f"The {what} {str(path)!r} is not a regular file but a {_file_kind(info.st_mode)}: the loader reads"
            " checkpoints from regular files only (a pipe or a device could block every rank). Copy it to a file."
        )
    return info


def open_file(path: CheckpointPath) -> OpenFile:
    """Open ``path`` for positioned reads (a local file: without following it into a FIFO's blocking open)."""
    if isinstance(path, RemotePath):
        return RemoteFile(path)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))


def close_file(file: OpenFile) -> None:
    """Close what :func:`open_file` opened."""
    if isinstance(file, RemoteFile):
        file.close()
    else:
        os.close(file)


@contextmanager
def open_stream(path: CheckpointPath) -> Iterator[BinaryIO]:
    """A buffered binary stream over ``path`` (for ``zipfile``, the pickles and ``torch.load``)."""
    if isinstance(path, RemotePath):
        with RemoteFile(path).stream() as stream:
            yield stream
    else:
        with open(path, "rb") as stream:
            yield stream


@contextmanager
def file_stream(file: OpenFile) -> Iterator[BinaryIO]:
    """A binary stream over a file already open (it stays open after the stream is closed)."""
    if isinstance(file, RemoteFile):
        with file.stream() as stream:
            yield stream
    else:
        with open(file, "rb", closefd=False) as stream:
            yield stream


def lexists(path: CheckpointPath) -> bool:
    """Whether anything is at ``path``, even a dangling symbolic link."""
    return path.exists() if isinstance(path, RemotePath) else os.path.lexists(path)


def read_exactly(file: OpenFile, offset: int, buffer: memoryview, path: CheckpointPath, what: str) -> None:
    """Fill ``buffer`` with the bytes of the open file descriptor ``file`` that start at ``offset``.

    Raises:
        CheckpointLoadError: If the file ends before the buffer is full (it was truncated, possibly while it was
            being read), or cannot be read.

    """
    if isinstance(file, RemoteFile):
        file.read_into(offset, buffer, what)
        return
    done = 0
    total = len(buffer)
    while done < total:
        try:
            count = os.preadv(file, [buffer[done:]], offset + done)
        except OSError as error:
            raise CheckpointLoadError(
                f"Reading {what} from {str(path)!r} failed: {error.strerror or error}. Check the file and the storage."
            ) from None
        if count == 0:
            raise CheckpointLoadError(
                f"The file {str(path)!r} ended before {what} did ({done} of {total} bytes at offset {offset}): it is"
                " truncated, or it was changed while it was being loaded. Re-copy or re-save it, and do not write it"
                " during a load."
            )
        done += count


def _file_kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO (named pipe)"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ]
    return next((name for check, name in kinds if check(mode)), "special file")
