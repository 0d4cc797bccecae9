"""The remote reader on fsspec's in-memory file system (no server): what the readers rely on beyond ranged reads."""

import os
import pickle
import threading
import time

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from lightning_fsdp import CheckpointLoadError
from lightning_fsdp.loading import remote, remote_requests
from lightning_fsdp.loading.files import fetched_bytes
from lightning_fsdp.loading.remote import RemoteFile, remote_path
from lightning_fsdp.loading.sharded_metadata import read_checked_metadata, read_dcp_metadata
from lightning_fsdp.loading.sharded_readers import CheckedFileSystemReader
from tests.tests_fabric.helpers.checkpoints import MarkerPayload

# The sharded checkpoints here are saved and read by one process, without a process group, as DCP allows.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


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


@pytest.fixture
def sharded_url(tmp_path):
    """A distributed checkpoint (one process) with two tensors and a non-tensor entry, in fsspec's memory store."""
    state = {"big": torch.randn(256, 128), "small": torch.randn(8), "extra": {"lr": 0.5}}
    dcp.save(state, checkpoint_id=tmp_path)
    fs = fsspec.filesystem("memory")
    for file in tmp_path.iterdir():
        fs.pipe(f"/remote-tests/sharded/{file.name}", file.read_bytes())
    yield "memory://remote-tests/sharded", state
    fs.rm("/remote-tests", recursive=True)


def test_sharded_entries_are_fetched_exactly(sharded_url, monkeypatch):
    """The validated reader fetches exactly the byte ranges of the entries the plan asks for, and nothing else (a large
    entry in concurrent chunks, each written into its place in the one buffer)."""
    monkeypatch.setattr(remote, "CHUNK_BYTES", 4096)  # the entry of the 128 KiB tensor comes in 33 chunks
    url, saved = sharded_url
    path = remote_path(url)
    metadata = read_checked_metadata(path, weights_only=True)
    target = {"big": torch.zeros(256, 128), "extra": {"lr": 0.0}}
    before = fetched_bytes()
    dcp.load(
        target,
        storage_reader=CheckedFileSystemReader(path, metadata),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    lengths = {index.fqn: info.length for index, info in metadata.storage_data.items()}
    assert fetched_bytes() - before == lengths["big"] + lengths["extra.lr"]
    assert torch.equal(target["big"], saved["big"])
    assert target["extra"]["lr"] == 0.5


def test_safetensors_slices_are_fetched_exactly(tmp_path):
    """Safetensors slices (torch's `HuggingFaceStorageWriter` layout) in object storage: detected from the headers, and
    each slice that the plan reads fetched by its exact byte range."""
    from lightning_fsdp.loading.formats import CheckpointFormat, detect_checkpoint
    from lightning_fsdp.loading.sharded_metadata import read_safetensors_shards_metadata
    from lightning_fsdp.loading.sharded_readers import SafetensorsSlicesReader
    from tests.tests_fabric.loading.test_safetensors_slices import _full_state, _write_slices

    _write_slices(tmp_path / "slices", [(0, 4), (4, 7)])
    fs = fsspec.filesystem("memory")
    for file in (tmp_path / "slices").iterdir():
        fs.pipe(f"/remote-tests/slices/{file.name}", file.read_bytes())
    try:
        detected = detect_checkpoint(remote_path("memory://remote-tests/slices"))
        assert detected.format is CheckpointFormat.SAFETENSORS_SHARDS
        metadata = read_safetensors_shards_metadata(detected)
        target = {"embedding.weight": torch.zeros(7, 4)}
        before = fetched_bytes()
        dcp.load(
            target,
            storage_reader=SafetensorsSlicesReader(detected.path, metadata),
            planner=DefaultLoadPlanner(allow_partial_load=True),
        )
        slices = [info.length for index, info in metadata.storage_data.items() if index.fqn == "embedding.weight"]
        assert fetched_bytes() - before == sum(slices) == 7 * 4 * 4
        assert torch.equal(target["embedding.weight"], _full_state()["embedding.weight"])
    finally:
        fs.rm("/remote-tests", recursive=True)


def test_sharded_metadata_payload_is_refused(sharded_url, tmp_path):
    url, _ = sharded_url
    metadata = read_dcp_metadata(remote_path(url))
    metadata.version = MarkerPayload(tmp_path / "marker")
    fsspec.filesystem("memory").pipe("/remote-tests/sharded/.metadata", pickle.dumps(metadata))
    with pytest.raises(CheckpointLoadError, match=r"Refused to unpickle `io\.open` .* \(the payload was not run\)"):
        read_dcp_metadata(remote_path(url))
    assert not (tmp_path / "marker").exists()


def test_large_ranges_are_fetched_concurrently_with_bounded_bytes_in_flight(monkeypatch):
    """Two readers of large ranges: their chunks are fetched concurrently, the bytes land where they belong, and the
    response bodies held at once (from the request until the body is dropped after its copy) never exceed
    `MAX_IN_FLIGHT_BYTES`, whatever the number of chunks and readers."""
    data = os.urandom(3 * remote_requests.MAX_IN_FLIGHT_BYTES + 5)
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
        assert remote.CHUNK_BYTES < peak[0] <= remote_requests.MAX_IN_FLIGHT_BYTES
        assert held[0] == 0
    finally:
        fs.rm("/remote-tests", recursive=True)
