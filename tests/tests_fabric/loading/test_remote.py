"""The remote reader on fsspec's in-memory file system (no server): what the readers rely on beyond ranged reads."""

import fsspec
import pytest

from lightning_fsdp import CheckpointLoadError
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
