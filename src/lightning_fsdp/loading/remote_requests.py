"""Requests to object storage, bounded: retries with backoff, timeouts, answers proven to be of the pinned object.

The :class:`~lightning_fsdp.loading.remote.RemoteFile` of :mod:`lightning_fsdp.loading.remote` fetches every range
through :func:`_with_retries`: a failed request is retried with bounded exponential backoff, except where retrying
cannot help (missing object, access denied, an answer from another object).

Every wait on the store is bounded: a request that receives nothing for :data:`REQUEST_TIMEOUT_S` (no answer, or no
byte of its body) is abandoned and retried, and a rank whose requests have received no byte for
:data:`STALL_TIMEOUT_S`, retries included, ends its load with an error naming the object and the range (both are set
per load with ``load_options(request_timeout=..., stall_timeout=...)``).

From S3 (s3fs), every read, small or large, is a ranged ``GET`` whose answer must prove that it comes from the pinned
object: its ``Content-Range`` names the range asked for and the pinned size, and its ETag (where the store sends one)
is the pinned ETag. An answer that a redirect brought from another endpoint is taken only if it proves the same. A
chunk is copied into its destination piece by piece (:data:`STREAMED_PIECE_BYTES`) as its body arrives, once its
headers have proven which bytes it holds: a request holds no more than the client's socket buffers and one piece.
fsspec's other file systems return a range's body whole, as ``bytes``, so a process holds at most
:data:`MAX_IN_FLIGHT_BYTES` of them at once (:class:`_ByteBudget`), whatever the number of chunks, readers and threads:
fetching costs a bounded amount of memory, not one that grows with the requests in flight.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from lightning_fsdp.loading.errors import CheckpointLoadError, first_line
from lightning_fsdp.loading.files import count_fetched

if TYPE_CHECKING:
    from lightning_fsdp.loading.remote import RemoteFile, RemotePath, RemoteStat


#: What a streamed body is read in: the most of a chunk that is held outside its destination at once.
STREAMED_PIECE_BYTES = 256 * 2**10
#: The chunks' response bodies a process holds at once, four chunks (fsspec returns a body whole, as ``bytes``, before
#: it is copied into its destination; the client's own copy while it assembles one comes on top).
MAX_IN_FLIGHT_BYTES = 16 * 2**20
#: Attempts per request, and the backoff before the second (doubled before each next, at most ``_MAX_BACKOFF_S``).
ATTEMPTS = 5
FIRST_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 3.0
#: A request that receives nothing for this long (no answer, or no byte of its body) is abandoned and retried.
REQUEST_TIMEOUT_S = 30.0
#: A rank whose requests to the store have received no byte for this long, retries included, ends its load.
STALL_TIMEOUT_S = 60.0
_Answer = TypeVar("_Answer")


@dataclass(frozen=True)
class RemoteTimeouts:
    """How long a load waits on the store: see :data:`REQUEST_TIMEOUT_S` and :data:`STALL_TIMEOUT_S`."""

    request: float = REQUEST_TIMEOUT_S
    stall: float = STALL_TIMEOUT_S


class _Progress:
    """When this rank last received a byte from the store, while any of its requests waits for one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = 0
        self._since = time.monotonic()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        with self._lock:
            if self._waiting == 0:  # nothing was awaited before this request: its wait starts now
                self._since = time.monotonic()
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1

    def arrived(self) -> None:
        self._since = time.monotonic()

    def idle_s(self) -> float:
        """How long the requests waiting now have received nothing."""
        return time.monotonic() - self._since


def _with_retries(
    request: Callable[[], _Answer],
    file: RemoteFile,
    byte_range: tuple[int, int],
    what: str,
    size: Callable[[_Answer], int],
) -> _Answer:
    """Run ``request`` until its answer holds the bytes of ``byte_range``, with bounded backoff, or raise a clear error.

    ``size`` counts the bytes of an answer. A missing object, a denied access or an answer from another object is not
    retried: it will not change. Retries end early once the rank's requests have received nothing for
    ``timeouts.stall`` seconds.

    """
    path = file.path
    expected = byte_range[1] - byte_range[0]
    backoff = FIRST_BACKOFF_S
    with path.progress.waiting():
        for attempt in range(ATTEMPTS):
            try:
                data = request()
            except (FileNotFoundError, PermissionError) as error:
                file.check_unchanged()  # a replaced or deleted object says so
                raise path.request_error(error, "cannot be read") from None
            except _ForeignAnswer as error:
                file.check_unchanged()  # the object was replaced: the answer was right, the load cannot go on
                raise CheckpointLoadError(
                    path.redact(
                        f"The object {str(path)!r} answered the range {byte_range[0]}-{byte_range[1] - 1} ({what})"
                        f" with bytes of another object: {error}. Nothing of it was used. A redirect to another"
                        " endpoint, a proxy or a cache in front of the store serves another object under this URL:"
                        " check the endpoint (`storage_options`) and what sits in front of it."
                    )
                ) from None
            except Exception as error:  # transient errors of any client: 5xx, throttling, resets, timeouts
                failure: BaseException = error
            else:
                if size(data) == expected:
                    return data
                failure = OSError(f"the store returned {size(data)} of {expected} bytes")
            stalled = path.progress.idle_s() + backoff >= path.timeouts.stall
            if stalled or attempt + 1 == ATTEMPTS:
                break
            time.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)
    where = f"the range {byte_range[0]}-{byte_range[1] - 1} ({what})"
    if path.progress.idle_s() + backoff >= path.timeouts.stall:
        last = (
            f"no byte within {path.timeouts.request:g} s"
            if isinstance(failure, TimeoutError)
            else f"{type(failure).__name__}: {first_line(failure)}"
        )
        raise CheckpointLoadError(
            path.redact(
                f"The object {str(path)!r} stopped answering: no byte of {where} arrived for"
                f" {path.progress.idle_s():.0f} s, after {attempt + 1} attempt(s) (the last: {last}). Check the"
                f" endpoint and the network; `load_options(stall_timeout=...)` sets how long a load waits (now"
                f" {path.timeouts.stall:g} s)."
            )
        )
    file.check_unchanged()
    raise path.request_error(failure, f"could not be read after {ATTEMPTS} attempts at {where}")


def _streams_ranges(fs: Any) -> bool:
    """Whether ranges of ``fs`` are streamed into their destination (s3fs: its client's bodies are streams)."""
    return bool(getattr(fs, "async_impl", False)) and callable(getattr(fs, "_call_s3", None))


class _ForeignAnswer(OSError):
    """An answer whose headers show that it holds bytes of another object (another size or ETag)."""


async def _within(seconds: float, coroutine: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``await coroutine(*args, **kwargs)``, cancelled after ``seconds`` (then ``TimeoutError``)."""
    return await asyncio.wait_for(coroutine(*args, **kwargs), seconds)


async def _stream_s3_range(path: RemotePath, pinned: RemoteStat, start: int, destination: memoryview) -> int:
    """Copy the S3 object's bytes from ``start`` on into ``destination`` as they arrive; return the count copied.

    Each wait (for the answer, for a piece of its body) ends after ``timeouts.request`` seconds, or sooner if the
    rank's requests have then received nothing for ``timeouts.stall``. The count is short if the answer ended early
    (a reset connection): the caller retries.

    Raises:
        OSError: If the answer does not hold exactly the range asked for (a store that ignores ``Range`` answers with
            the whole object, which must not land at ``start``).
        _ForeignAnswer: If the answer is from another object: its ``Content-Range`` gives another size, or its ETag is
            not the pinned one.
        TimeoutError: If the store sent nothing for too long.

    """
    fs, timeouts, progress = path.fs, path.timeouts, path.progress

    def timeout() -> float:
        return max(0.0, min(timeouts.request, timeouts.stall - progress.idle_s()))

    bucket, key, version = fs.split_path(path.fs_path)
    stop = start + len(destination)
    answer = await asyncio.wait_for(
        fs._call_s3(
            "get_object",
            Bucket=bucket,
            Key=key,
            Range=f"bytes={start}-{stop - 1}",
            **({"VersionId": version} if version else {}),
        ),
        timeout(),
    )
    body = answer["Body"]
    try:
        served = answer.get("ContentRange") or ""
        if not served.startswith(f"bytes {start}-{stop - 1}/") or answer.get("ContentLength") != len(destination):
            raise OSError(
                f"the store answered the range {start}-{stop - 1} with {served or 'no Content-Range'} and"
                f" {answer.get('ContentLength')} bytes"
            )
        total = served.rpartition("/")[2]
        if total != str(pinned.st_size):
            raise _ForeignAnswer(
                f"its Content-Range {served!r} gives a size of {total}, the object holds {pinned.st_size}"
            )
        etag = _bare_etag(answer.get("ETag"))
        if etag is not None and pinned.etag is not None and etag != pinned.etag:
            raise _ForeignAnswer(f"its ETag is {etag!r}, the object's is {pinned.etag!r}")
        progress.arrived()
        copied = 0
        while copied < len(destination):
            piece = await asyncio.wait_for(body.read(min(STREAMED_PIECE_BYTES, len(destination) - copied)), timeout())
            if not piece:
                break
            destination[copied : copied + len(piece)] = piece
            copied += len(piece)
            progress.arrived()
            count_fetched(len(piece))
        return copied
    finally:
        body.close()


class _ByteBudget:
    """A count of bytes that threads take before fetching and give back after: at most ``limit`` taken at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._taken = 0
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, count: int) -> Iterator[None]:
        count = min(count, self.limit)  # a larger piece waits until it is alone
        with self._changed:
            self._changed.wait_for(lambda: self._taken + count <= self.limit)
            self._taken += count
        try:
            yield
        finally:
            with self._changed:
                self._taken -= count
                self._changed.notify_all()


_in_flight = _ByteBudget(MAX_IN_FLIGHT_BYTES)


def _bare_etag(tag: Any) -> str | None:
    """An ETag without its quotes (and weak prefix): stores quote them in some answers and not in others."""
    if not isinstance(tag, str) or not tag:
        return None
    return tag.removeprefix("W/").strip('"')
