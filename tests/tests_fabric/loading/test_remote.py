"""The remote reader on fsspec's in-memory file system (no server): what the readers rely on beyond ranged reads."""

import os
import threading
import time

import fsspec
import pytest

from lightning_fsdp import CheckpointLoadError
from lightning_fsdp.loading import remote
from lightning_fsdp.loading.remote import RemoteFile, remote_path


@pytest.fixture
def object_url():
    fs = fsspec.filesystem("memory")
    fs.pipe("/remote-tests/object.bin", bytes(range(10)))
    yield "memory://remote-tests/object.bin"
    fs.rm("/remote-tests", recursive=True)


def test_stream_reads_like_a_file_at_and_past_the_end(object_url):
    """zipfile and the pickles read a stream to its end, and seek past it; a range past the end is an error."""
    file = RemoteFile(remote_path(object_url))
    stream = file.stream()
    stream.seek(20)
    assert stream.read() == b""
    stream.seek(6)
    assert stream.read() == bytes(range(6, 10))
    assert stream.read(4) == b""
    with pytest.raises(CheckpointLoadError, match="ended before"):
        file.read_into(8, memoryview(bytearray(4)), "the tensor 'w'")


def test_object_changed_after_it_was_opened(object_url):
    path = remote_path(object_url)
    RemoteFile(path)  # pins the size and fingerprint
    fsspec.filesystem("memory").pipe("/remote-tests/object.bin", bytes(range(9)))
    with pytest.raises(CheckpointLoadError, match="was changed while it was being loaded"):
        path.check_unchanged()


def test_large_ranges_are_fetched_concurrently_with_bounded_bytes_in_flight(monkeypatch):
    """Two readers of large ranges: their chunks are fetched concurrently, the bytes land where they belong, and the
    response bodies held at once (from the request until the body is dropped after its copy) never exceed
    `MAX_IN_FLIGHT_BYTES`, whatever the number of chunks and readers."""
    data = os.urandom(3 * remote.MAX_IN_FLIGHT_BYTES + 5)
    fs = fsspec.filesystem("memory")
    fs.pipe("/remote-tests/large.bin", data)
    path = remote_path("memory://remote-tests/large.bin")
    held, peak, lock = [0], [0], threading.Lock()

    class Body(bytes):  # counts as held until the reader drops it
        def __del__(self) -> None:
            with lock:
                held[0] -= len(self)

    cat_file = path.fs.cat_file

    def counting_cat_file(name: str, start: int, end: int) -> bytes:
        with lock:
            held[0] += end - start
            peak[0] = max(peak[0], held[0])
        time.sleep(0.01)  # the other requests start meanwhile
        return Body(cat_file(name, start=start, end=end))

    monkeypatch.setattr(path.fs, "cat_file", counting_cat_file)
    try:
        file = RemoteFile(path)
        half = len(data) // 2
        destinations = [bytearray(half), bytearray(len(data) - half)]
        readers = [
            threading.Thread(target=file.read_into, args=(start, memoryview(out), "the tensor 'w'", False))
            for start, out in zip((0, half), destinations, strict=True)
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        assert bytes(destinations[0]) + bytes(destinations[1]) == data
        assert remote.CHUNK_BYTES < peak[0] <= remote.MAX_IN_FLIGHT_BYTES
        assert held[0] == 0
    finally:
        fs.rm("/remote-tests", recursive=True)
