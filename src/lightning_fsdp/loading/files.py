"""Open checkpoint files safely: only regular files, and reads whose every byte is accounted for.

A path that is a FIFO or a device would block ``open`` or ``read`` forever (or read endless bytes), so every file the
loader opens is checked with :func:`require_regular_file` first. :func:`read_exactly` reads a byte range with
positioned reads into the caller's buffer: unlike a memory map, a file that shrinks while it is read gives an error,
never a ``SIGBUS``.

Upstream destination: ``src/lightning/fabric/utilities/load.py``.
"""

import os
import stat
from pathlib import Path

from lightning_fsdp.loading.errors import CheckpointLoadError


def require_regular_file(path: Path, what: str = "checkpoint file") -> os.stat_result:
    """Return the ``stat`` of ``path`` (symbolic links followed), or raise if it is not a regular file.

    Raises:
        CheckpointLoadError: If the path does not exist, or is a FIFO, socket, device or directory.

    """
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
            f"The {what} {str(path)!r} is not a regular file but a {_file_kind(info.st_mode)}: lightning-fsdp reads"
            " checkpoints from regular files only (a pipe or a device could block every rank). Copy it to a file."
        )
    return info


def read_exactly(file: int, offset: int, buffer: memoryview, path: Path, what: str) -> None:
    """Fill ``buffer`` with the bytes of the open file descriptor ``file`` that start at ``offset``.

    Raises:
        CheckpointLoadError: If the file ends before the buffer is full (it was truncated, possibly while it was
            being read), or cannot be read.

    """
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
