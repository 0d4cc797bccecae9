"""Open checkpoint files safely: only regular files, and reads whose every byte is accounted for.

A path that is a FIFO or a device would block ``open`` or ``read`` forever (or read endless bytes), so every file the
loader opens is checked with :func:`require_regular_file` first. :func:`read_exactly` reads a byte range with
positioned reads into the caller's buffer: unlike a memory map, a file that shrinks while it is read gives an error,
never a ``SIGBUS``.

These functions are the one way the readers open and read a path. A path on other storage than the local file system
(an object in object storage) is a :class:`StoragePath`, which opens itself as a :class:`StorageFile`: the readers
ask it for the same byte ranges as a local file, through the same functions.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import os
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from lightning_fsdp.loading.errors import CheckpointLoadError


class StorageFile(ABC):
    """A :class:`StoragePath` opened for positioned reads: what a file descriptor is to a local file."""

    @abstractmethod
    def read_into(self, offset: int, buffer: memoryview, what: str, cached: bool = True) -> None:
        """Fill ``buffer`` with the bytes from ``offset`` on, or raise a ``CheckpointLoadError`` naming ``what``.

        ``cached=False`` asks for exactly these bytes (a tensor's slice), not for blocks around them that the file
        may keep for the small reads that follow.

        """

    @abstractmethod
    def stream(self) -> BinaryIO:
        """A seekable binary stream over the file (for ``zipfile``, the pickles and ``torch.load``)."""

    @abstractmethod
    def check_unchanged(self) -> None:
        """Raise a ``CheckpointLoadError`` if the file is no longer the one that was opened."""

    @abstractmethod
    def close(self) -> None: ...


class StoragePath(ABC):
    """A checkpoint path on other storage than the local file system, such as an object in object storage.

    It stands where a local :class:`~pathlib.Path` stands in the readers, with the part of ``Path`` they use, and
    opens itself for positioned reads (:meth:`open`). Its ``str`` is what messages show (a URL).

    """

    @property
    @abstractmethod
    def name(self) -> str: ...

    @property
    @abstractmethod
    def parent(self) -> "StoragePath": ...

    @abstractmethod
    def __truediv__(self, name: str) -> "StoragePath": ...

    @abstractmethod
    def exists(self) -> bool: ...

    @abstractmethod
    def is_file(self) -> bool: ...

    @abstractmethod
    def is_dir(self) -> bool: ...

    @abstractmethod
    def iterdir(self) -> Iterator["StoragePath"]: ...

    @abstractmethod
    def glob(self, pattern: str) -> Iterator["StoragePath"]: ...

    @abstractmethod
    def read_text(self, encoding: str = "utf-8") -> str: ...

    @abstractmethod
    def stat(self, what: str = "checkpoint file") -> Any:
        """Its ``st_size`` and ``st_mode``; raise a ``CheckpointLoadError`` if it is missing or not a file."""

    @abstractmethod
    def open(self, what: str = "checkpoint file") -> StorageFile:
        """Open it for positioned reads; raise a ``CheckpointLoadError`` naming ``what`` if it cannot be."""


#: What the loader reads: a local file, or a file on other storage.
CheckpointPath = Path | StoragePath
#: An open file: a file descriptor, or a :class:`StorageFile`.
OpenFile = int | StorageFile

_fetched = [0]
_fetched_lock = threading.Lock()


def fetched_bytes() -> int:
    """The bytes this process has fetched from other storage than the local file system so far (for progress)."""
    return _fetched[0]


def count_fetched(count: int) -> None:
    """Add ``count`` bytes that a :class:`StorageFile` fetched to :func:`fetched_bytes`."""
    with _fetched_lock:
        _fetched[0] += count


def require_regular_file(path: CheckpointPath, what: str = "checkpoint file") -> Any:
    """Return the ``stat`` of ``path`` (symbolic links followed), or raise if it is not a regular file.

    Raises:
        CheckpointLoadError: If the path does not exist, or is a FIFO, socket, device or directory.

    """
    if isinstance(path, StoragePath):
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
    if isinstance(path, StoragePath):
        return path.open()
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))


def close_file(file: OpenFile) -> None:
    """Close what :func:`open_file` opened."""
    if isinstance(file, StorageFile):
        file.close()
    else:
        os.close(file)


@contextmanager
def open_stream(path: CheckpointPath) -> Iterator[BinaryIO]:
    """A buffered binary stream over ``path`` (for ``zipfile``, the pickles and ``torch.load``)."""
    if isinstance(path, StoragePath):
        with path.open().stream() as stream:
            yield stream
    else:
        with open(path, "rb") as stream:
            yield stream


@contextmanager
def file_stream(file: OpenFile) -> Iterator[BinaryIO]:
    """A binary stream over a file already open (it stays open after the stream is closed)."""
    if isinstance(file, StorageFile):
        with file.stream() as stream:
            yield stream
    else:
        with open(file, "rb", closefd=False) as stream:
            yield stream


def lexists(path: CheckpointPath) -> bool:
    """Whether anything is at ``path``, even a dangling symbolic link."""
    return path.exists() if isinstance(path, StoragePath) else os.path.lexists(path)


def read_exactly(file: OpenFile, offset: int, buffer: memoryview, path: CheckpointPath, what: str) -> None:
    """Fill ``buffer`` with the bytes of the open file descriptor ``file`` that start at ``offset``.

    Raises:
        CheckpointLoadError: If the file ends before the buffer is full (it was truncated, possibly while it was
            being read), or cannot be read.

    """
    if isinstance(file, StorageFile):
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


def check_local_file_unchanged(path: Path, descriptor: int, opened: os.stat_result) -> None:
    """Raise if the local file open as ``descriptor`` changed since it was opened (``opened`` is its ``fstat`` then).

    A file rewritten in place has another size or modification time; one replaced (renamed over, deleted) is no longer
    the file found at ``path``.

    Raises:
        CheckpointLoadError: If the file was rewritten, truncated, replaced or deleted.

    """
    now = os.fstat(descriptor)
    try:
        at_path = os.stat(path)
    except OSError:
        at_path = None
    same_file = at_path is not None and (at_path.st_dev, at_path.st_ino) == (opened.st_dev, opened.st_ino)
    if not same_file or (now.st_size, now.st_mtime_ns) != (opened.st_size, opened.st_mtime_ns):
        raise CheckpointLoadError(
            f"The file {str(path)!r} was changed while it was being loaded (it was rewritten, replaced or truncated),"
            " so what was read may mix two versions. Do not write a checkpoint while it is being loaded; load it"
            " again once it is complete."
        )


def _file_kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO (named pipe)"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ]
    return next((name for check, name in kinds if check(mode)), "special file")
