"""Checkpoints in object storage (``s3://``, ``gs://``, ... through fsspec), read by byte ranges like local files.

A :class:`RemotePath` stands where a local :class:`~pathlib.Path` stands in the loader, and a :class:`RemoteFile`
where an open file descriptor stands (they are the :class:`~lightning_fsdp.loading.files.StoragePath` and
:class:`~lightning_fsdp.loading.files.StorageFile` of object storage): the readers of every format ask it for the same
proven byte ranges they read from a local file, so each rank fetches only the structures that locate its slices and
the slices themselves, never the whole object, and keeps no local copy. What it fetches is counted in
:func:`~lightning_fsdp.loading.files.fetched_bytes`.

A large range is fetched as chunks on a bounded pool of threads, each written into its place in the destination;
small reads (zip headers, the pickles) are served from blocks of :data:`BLOCK_BYTES`, so adjacent small reads cost one
request. The first size and ETag (or version) seen for an object are pinned: a later request finding another object, or
a different size, is an error, as a replaced local file is. The chunks are :data:`STREAMED_CHUNK_BYTES` where the
bodies are streamed (S3), :data:`CHUNK_BYTES` elsewhere.

Each request is bounded (retries with backoff, timeouts, the proof that an S3 answer is of the pinned object, the bytes
held in flight): :mod:`lightning_fsdp.loading.remote_requests`.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import asyncio
import fnmatch
import io
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from lightning_fsdp.loading.errors import CheckpointLoadError, first_line
from lightning_fsdp.loading.files import StorageFile, StoragePath, count_fetched
from lightning_fsdp.loading.remote_requests import (
    RemoteTimeouts,
    _bare_etag,
    _in_flight,
    _Progress,
    _stream_s3_range,
    _streams_ranges,
    _with_retries,
    _within,
)

#: The size of the chunks a large range is fetched in, concurrently, from a store whose bodies arrive whole: large
#: enough that a request's latency is small against its transfer, small enough that a rank's chunks spread over the
#: pool and that few of them fit in
#: :data:`~lightning_fsdp.loading.remote_requests.MAX_IN_FLIGHT_BYTES`.
CHUNK_BYTES = 4 * 2**20
#: The chunks of a store whose bodies are streamed (S3): their size costs no memory, and each request has a cost of its
#: own, so they are larger (the size S3's guidance gives for ranged GETs).
STREAMED_CHUNK_BYTES = 16 * 2**20
#: Reads up to this size (and the buffer of a stream) are served from aligned blocks of it, a few cached per object.
BLOCK_BYTES = 64 * 2**10
#: Concurrent requests of one rank.
MAX_CONCURRENT_REQUESTS = 8
_CACHED_BLOCKS = 16
#: Environment variables whose values must never appear in a message.
_SECRET_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_KEY")
#: Option names (parts of them) whose values are credentials, masked in every message.
_SECRET_OPTION_WORDS = ("key", "secret", "token", "password", "credential", "sas", "signature")


def is_remote(path: Any) -> bool:
    """Whether ``path`` is a URL of a file system other than the local one (``s3://``, ``gs://``, ``memory://``)."""
    if isinstance(path, RemotePath):
        return True
    if not isinstance(path, str) or "://" not in path:
        return False
    from fsspec.utils import get_protocol

    return get_protocol(path) not in ("file", "local")


@dataclass(frozen=True)
class RemoteStat:
    """What the loader asks of a file's ``stat``, for an object in object storage."""

    st_size: int
    fingerprint: tuple[Any, ...]
    """Size, ETag (or checksum), version and modification time, as far as the store reports them."""
    etag: str | None = None
    """The ETag without its quotes, if the store reports one: every ranged answer must carry the same."""
    st_mode: int = stat.S_IFREG
    st_ino: int = 0
    st_dev: int = 0


class RemotePath(StoragePath):
    """An object (or a prefix) in object storage, with the part of :class:`~pathlib.Path` that the loader uses.

    Paths made from one another (``path / name``, ``path.parent``) share the store's connection and the sizes and
    ETags pinned so far.

    """

    def __init__(
        self, fs: Any, fs_path: str, protocol: str, secrets: tuple[str, ...], shared: "_Shared | None" = None
    ) -> None:
        self.fs = fs
        self.fs_path = fs_path.rstrip("/")
        self.protocol = protocol
        self._secrets = secrets
        self._shared = _Shared() if shared is None else shared
        self._pins = self._shared.pins

    def _derived(self, fs_path: str) -> "RemotePath":
        return RemotePath(self.fs, fs_path, self.protocol, self._secrets, self._shared)

    @property
    def blocks(self) -> "OrderedDict[int, bytes]":
        """The blocks of this object read so far (small reads are served from them), shared by its open files."""
        return self._shared.blocks.setdefault(self.fs_path, OrderedDict())

    def __str__(self) -> str:
        return f"{self.protocol}://{self.fs_path}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and str(self) == str(other)

    def __lt__(self, other: "RemotePath") -> bool:
        return str(self) < str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, name: str) -> "RemotePath":
        return self._derived(f"{self.fs_path}/{name}")

    @property
    def name(self) -> str:
        return self.fs_path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "RemotePath":
        return self._derived(self.fs_path.rsplit("/", 1)[0]) if "/" in self.fs_path else self

    def _info(self) -> dict[str, Any] | None:
        """The store's description of this path, fresh (not from a listing cached earlier); ``None`` if absent.

        Once the store has not answered such a request, the paths of the load do not ask it again: they raise that
        error at once (a store that stops answering ends a load after one request timeout, not one per question).

        """
        if self._shared.unanswered is not None:
            raise self._shared.unanswered
        self.fs.invalidate_cache(self.fs_path)
        try:
            return self.call("info", self.fs_path)
        except FileNotFoundError:
            return None
        except Exception as error:
            failure = self.request_error(error, "cannot be read")
            if isinstance(error, TimeoutError):
                self._shared.unanswered = failure
            raise failure from None

    def exists(self) -> bool:
        return self._info() is not None

    def is_dir(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "directory"

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") != "directory"

    def iterdir(self) -> Iterator["RemotePath"]:
        try:
            names = self.call("ls", self.fs_path, detail=False)
        except Exception as error:
            raise self.request_error(error, "cannot be listed") from None
        for name in names:
            name = self.fs._strip_protocol(name).rstrip("/")
            if name != self.fs_path:
                yield self._derived(name)

    def glob(self, pattern: str) -> Iterator["RemotePath"]:
        return (child for child in self.iterdir() if fnmatch.fnmatchcase(child.name, pattern))

    def read_text(self, encoding: str = "utf-8") -> str:
        file = RemoteFile(self)
        try:
            data = bytearray(file.size)
            file.read_into(0, memoryview(data), "the file")
            file.check_unchanged()
        finally:
            file.close()
        return data.decode(encoding)

    def open(self, what: str = "checkpoint file") -> "RemoteFile":
        return RemoteFile(self, what)

    def stat(self, what: str = "checkpoint file") -> RemoteStat:
        """The object's size and fingerprint, pinned on the first call: later files opened on it must match.

        Raises:
            CheckpointLoadError: If the object (or its bucket) does not exist, is a prefix (a "directory"), or cannot
                be read.

        """
        pinned = self._pins.get(self.fs_path)
        if pinned is not None:
            return pinned
        info = self._info()
        if info is None:
            raise CheckpointLoadError(
                f"The {what} {str(self)!r} does not exist (no such object, or no such bucket). Check the URL, and"
                " that every node can reach it."
            )
        if info.get("type") == "directory":
            raise CheckpointLoadError(f"The {what} {str(self)!r} is a prefix (a directory), not an object.")
        self._pins[self.fs_path] = _stat_of(info)
        return self._pins[self.fs_path]

    def check_unchanged(self) -> None:
        """Raise if the object is no longer the one pinned by :meth:`stat` (replaced, rewritten, truncated, deleted)."""
        pinned = self.stat()
        info = self._info()
        if info is None or _stat_of(info) != pinned:
            raise CheckpointLoadError(
                f"The object {str(self)!r} was changed while it was being loaded (it was rewritten, replaced, truncated"
                " or deleted: its size or ETag differs), so what was read may mix two versions. Do not write a"
                " checkpoint while it is being loaded; load it again once it is complete."
            )

    @property
    def timeouts(self) -> RemoteTimeouts:
        return self._shared.timeouts

    @property
    def progress(self) -> _Progress:
        return self._shared.progress

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.method(*args, **kwargs)``, abandoned after ``timeouts.request`` where the file system is asynchronous.

        s3fs makes its client on first use (its imports, its session: seconds of CPU on a busy node), which is not a
        request to the store: it is made first, within ``timeouts.stall``.

        Raises:
            TimeoutError: If the store did not answer in time.
            OSError: If the client could not be made in time.

        """
        coroutine = getattr(self.fs, f"_{method}", None)
        if not getattr(self.fs, "async_impl", False) or coroutine is None:
            return getattr(self.fs, method)(*args, **kwargs)
        from fsspec.asyn import sync

        set_session = getattr(self.fs, "set_session", None)
        if asyncio.iscoroutinefunction(set_session):
            try:
                sync(self.fs.loop, _within, self.timeouts.stall, set_session)
            except TimeoutError:
                raise OSError(f"its client could not be made within {self.timeouts.stall:g} s") from None
        return sync(self.fs.loop, _within, self.timeouts.request, coroutine, *args, **kwargs)

    def request_error(self, error: BaseException, happened: str) -> CheckpointLoadError:
        """The error for a request on this path that failed for good; credentials never appear in it."""
        if isinstance(error, TimeoutError):
            reason = (
                f"the store did not answer within {self.timeouts.request:g} s (`load_options(request_timeout=...)`)."
                " Check the endpoint and the network"
            )
        elif isinstance(error, PermissionError):
            reason = (
                "access was denied. Check the credentials (fsspec's usual configuration: environment variables, the"
                " provider's config files, or `storage_options`) and the object's permissions"
            )
        else:
            reason = f"{type(error).__name__}: {first_line(error)}. Check the URL, the endpoint and the network"
        return CheckpointLoadError(self.redact(f"The object {str(self)!r} {happened}: {reason}."))

    def redact(self, message: str) -> str:
        """``message`` with every credential this path was opened with (or the environment holds) masked."""
        secrets = [*self._secrets, *(os.environ.get(name, "") for name in _SECRET_VARIABLES)]
        for secret in sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True):
            message = message.replace(secret, "***")
        return message


def remote_path(
    url: str, storage_options: Mapping[str, Any] | None = None, timeouts: RemoteTimeouts | None = None
) -> RemotePath:
    """Open the file system of ``url`` through fsspec, with ``storage_options`` (credentials, endpoint, ...).

    Args:
        url: The object's (or prefix's) URL.
        storage_options: Options of the fsspec file system.
        timeouts: How long requests and the load wait on the store (by default :class:`RemoteTimeouts`' defaults).

    Raises:
        CheckpointLoadError: If fsspec does not know the URL's protocol or its package is not installed.

    """
    from fsspec.core import url_to_fs
    from fsspec.utils import get_protocol

    protocol = get_protocol(url)
    try:
        fs, fs_path = url_to_fs(url, **dict(storage_options or {}))
    except ImportError as error:
        raise CheckpointLoadError(
            f"Reading {protocol}:// checkpoints needs a package that is not installed: {first_line(error)}"
        ) from None
    except ValueError as error:
        raise CheckpointLoadError(f"fsspec cannot open the URL {url!r}: {first_line(error)}") from None
    shared = _Shared(timeouts=timeouts or RemoteTimeouts())
    return RemotePath(fs, fs_path, protocol, tuple(_secrets(storage_options or {})), shared)


@dataclass
class _Shared:
    """What the paths made from one URL share.

    The pinned size and ETag of each object, its cached blocks, the load's timeouts, when its requests last received
    a byte, and the error of a request for a description that the store did not answer.

    """

    pins: dict[str, RemoteStat] = field(default_factory=dict)
    blocks: dict[str, "OrderedDict[int, bytes]"] = field(default_factory=dict)
    timeouts: RemoteTimeouts = field(default_factory=RemoteTimeouts)
    progress: _Progress = field(default_factory=_Progress)
    unanswered: CheckpointLoadError | None = None


class RemoteFile(StorageFile):
    """An object opened for positioned reads: what a file descriptor is to a local file.

    Its size and fingerprint are those pinned by the path's first :meth:`RemotePath.stat`.

    """

    def __init__(self, path: RemotePath, what: str = "checkpoint file") -> None:
        self.path = path
        self.size = path.stat(what).st_size
        self._blocks = path.blocks
        self._lock = threading.Lock()

    def read_into(self, offset: int, buffer: memoryview, what: str, cached: bool = True) -> None:
        """Fill ``buffer`` with the object's bytes from ``offset`` on (concurrent chunks for a large buffer).

        A small read is served from a cached block unless ``cached`` is ``False`` (a tensor's slice: exactly its
        bytes are fetched, so a rank fetches no more than its own slices and the structures that locate them).

        Raises:
            CheckpointLoadError: If the range runs past the object's end (it is truncated), the object changed, or a
                request failed for good.

        """
        total = len(buffer)
        if offset < 0 or offset + total > self.size:
            raise CheckpointLoadError(
                f"The object {str(self.path)!r} ended before {what} did ({total} bytes at offset {offset}, the object"
                f" holds {self.size}): it is truncated, or it was changed while it was being loaded. Re-upload it, and"
                " do not write it during a load."
            )
        if total == 0:
            return
        if cached and total <= BLOCK_BYTES:
            self._read_small(offset, buffer)
            return
        streamed = _streams_ranges(self.path.fs)
        size = STREAMED_CHUNK_BYTES if streamed else CHUNK_BYTES
        chunks = [(start, min(start + size, total)) for start in range(0, total, size)]

        def fetch_chunk(chunk: tuple[int, int]) -> None:
            start, stop = chunk
            if streamed:
                self._stream_into(offset + start, buffer[start:stop], what)
                return
            with _in_flight.hold(stop - start):  # the body is dropped once copied, before the budget is released
                buffer[start:stop] = self._fetch(offset + start, offset + stop, what)

        if len(chunks) == 1:
            fetch_chunk(chunks[0])
            return
        # A pool of this read's own: its threads end with it (none outlive the load), and after a failed chunk the
        # others are cancelled or waited for, so that no thread writes into the buffer once this call has returned.
        pool = ThreadPoolExecutor(min(MAX_CONCURRENT_REQUESTS, len(chunks)), thread_name_prefix="lightning-fsdp-fetch")
        try:
            for future in [pool.submit(fetch_chunk, chunk) for chunk in chunks]:
                future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _read_small(self, offset: int, buffer: memoryview) -> None:
        position, end = offset, offset + len(buffer)
        while position < end:
            index = position // BLOCK_BYTES
            block = self._block(index)
            start = position - index * BLOCK_BYTES
            count = min(len(block) - start, end - position)
            buffer[position - offset : position - offset + count] = block[start : start + count]
            position += count

    def _block(self, index: int) -> bytes:
        with self._lock:
            block = self._blocks.get(index)
            if block is not None:
                self._blocks.move_to_end(index)
                return block
        block = self._fetch(index * BLOCK_BYTES, min((index + 1) * BLOCK_BYTES, self.size), "the structures")
        with self._lock:
            self._blocks[index] = block
            while len(self._blocks) > _CACHED_BLOCKS:
                self._blocks.popitem(last=False)
        return block

    def _fetch(self, start: int, stop: int, what: str) -> bytes:
        """Bytes ``[start, stop)`` of the object, retried with backoff; exactly that many or an error."""
        if _streams_ranges(self.path.fs):  # S3: through the answer's checks, as every read from S3
            data = bytearray(stop - start)
            self._stream_into(start, memoryview(data), what)
            return bytes(data)
        path = self.path

        def request() -> bytes:
            answer = path.call("cat_file", path.fs_path, start=start, end=stop)
            path.progress.arrived()
            return answer

        data = _with_retries(request, self, (start, stop), what, len)
        count_fetched(len(data))
        return data

    def _stream_into(self, start: int, destination: memoryview, what: str) -> None:
        """Fill ``destination`` with the object's bytes from ``start`` on, as they arrive; retried with backoff."""
        from fsspec.asyn import sync

        path, pinned = self.path, self.path.stat()
        _with_retries(
            lambda: sync(path.fs.loop, _stream_s3_range, path, pinned, start, destination),
            self,
            (start, start + len(destination)),
            what,
            int,
        )

    def stream(self) -> io.BufferedReader:
        """A seekable binary stream over the object (for ``zipfile`` and the pickles), reading by ranges."""
        return io.BufferedReader(_RemoteStream(self), buffer_size=BLOCK_BYTES)

    def check_unchanged(self) -> None:
        self.path.check_unchanged()

    def close(self) -> None:
        pass  # nothing is held open: the blocks stay for the other files of the same object until the path goes


class _RemoteStream(io.RawIOBase):
    def __init__(self, file: RemoteFile) -> None:
        self._file = file
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._file.size}[whence]
        if base + offset < 0:
            raise OSError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self._file.size - self._position))
        if count == 0:  # at or past the end, as a file reads
            return 0
        self._file.read_into(self._position, view[:count], "the data read")
        self._position += count
        return count


def _stat_of(info: Mapping[str, Any]) -> RemoteStat:
    size = int(info.get("size") or 0)
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("crc32c")
    version = info.get("VersionId") or info.get("version_id") or info.get("generation")
    modified = info.get("LastModified") or info.get("mtime") or info.get("updated") or info.get("created")
    return RemoteStat(size, (size, tag, version, str(modified)), etag=_bare_etag(tag))


def _secrets(options: Mapping[str, Any]) -> Iterator[str]:
    """The values of ``storage_options`` that are credentials (``key``, ``secret``, ``token``, ``password``, ...)."""
    for name, value in options.items():
        if isinstance(value, str) and any(word in str(name).lower() for word in _SECRET_OPTION_WORDS):
            yield value
        elif isinstance(value, Mapping):
            yield from _secrets(value)
