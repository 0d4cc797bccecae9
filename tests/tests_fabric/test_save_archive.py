"""The pieces of the gather-free save on their own: CRC-32 arithmetic and the ``torch.save`` archive writer."""

import io
import itertools
import os
import random
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from lightning_fsdp.saving import archive
from lightning_fsdp.saving.crc import SparseCrc, combine_sparse, crc32_combine, crc32_zeros, extend_with_zeros

# The gather-free save is an extension (#28): it is not carried upstream with the core.


def test_crc32_combine_matches_zlib_on_random_splits() -> None:
    rng = random.Random(0)
    for _ in range(200):
        data = rng.randbytes(rng.randint(0, 5000))
        cut = rng.randint(0, len(data))
        assert crc32_combine(zlib.crc32(data[:cut]), zlib.crc32(data[cut:]), len(data) - cut) == zlib.crc32(data)
        assert crc32_zeros(len(data)) == zlib.crc32(bytes(len(data)))
    # long zero runs take the multiplication, not the zero feed
    assert extend_with_zeros(12345, 3 << 20) == zlib.crc32(bytes(3 << 20), 12345)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7])
def test_sparse_crcs_of_ranks_combine_to_the_record_crc(ranks: int) -> None:
    rng = random.Random(ranks)
    for _ in range(50):
        data = rng.randbytes(rng.randint(0, 4000))
        cuts = sorted(rng.sample(range(len(data) + 1), min(8, len(data) + 1)))
        bounds = [0, *cuts, len(data)]
        sparse = [SparseCrc(len(data)) for _ in range(ranks)]
        for start, stop in itertools.pairwise(bounds):
            if stop > start:
                sparse[rng.randrange(ranks)].add(start, data[start:stop])
        assert combine_sparse([crc.value() for crc in sparse], len(data)) == zlib.crc32(data)


def test_sparse_crc_refuses_runs_out_of_order() -> None:
    crc = SparseCrc(10)
    crc.add(4, b"ab")
    with pytest.raises(ValueError, match="ascend"):
        crc.add(5, b"c")


def _write_archive(path: Path, big: dict[str, torch.Tensor], extra: object) -> None:
    """A single writer of the layout the ranks share: the big storages first, then what rank 0 writes."""
    names = list(big)
    placed, end = archive.plan_records(
        [(archive.storage_record_name(str(i)), big[n].numel() * big[n].element_size()) for i, n in enumerate(names)], 0
    )
    chunks: list[tuple[int, bytes]] = []
    directory = []
    for record, name in zip(placed, names, strict=True):
        data = big[name].contiguous().view(torch.uint8).numpy().tobytes()
        crc = zlib.crc32(data)
        chunks.append((record.header_offset, archive.local_header(record, crc) + data))
        directory.append((record, crc))
    small: list[tuple[str, bytes]] = []

    def new_storage(tensor: torch.Tensor) -> archive.StorageRef:
        key = str(len(names) + len(small))
        small.append((archive.storage_record_name(key), bytes(tensor.untyped_storage())))
        return archive.StorageRef(key, tensor.dtype, tensor.untyped_storage().nbytes() // tensor.element_size())

    stand_ins = {
        n: archive.TensorStandIn(archive.StorageRef(str(i), big[n].dtype, big[n].numel()), tuple(big[n].shape))
        for i, n in enumerate(names)
    }
    pickled = archive.pickle_state({"model": stand_ins, "extra": extra}, new_storage)
    rest = [*small, (f"{archive.PREFIX}/data.pkl", pickled), *archive.small_records()]
    placed_rest, end = archive.plan_records([(n, len(d)) for n, d in rest], end)
    for record, (_, data) in zip(placed_rest, rest, strict=True):
        crc = zlib.crc32(data)
        chunks.append((record.header_offset, archive.local_header(record, crc) + data))
        directory.append((record, crc))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for offset, data in chunks:
        os.pwrite(fd, data, offset)
    os.pwrite(fd, archive.central_directory(directory, end), end)
    os.close(fd)


@pytest.mark.parametrize("zip64", [False, True])
def test_archive_reads_like_torch_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zip64: bool) -> None:
    if zip64:  # every size and offset past 100 bytes in zip64 fields, as a file over 4 GiB would have them
        monkeypatch.setattr(archive, "_ZIP64_AT", 100)
    big = {
        "w": torch.randn(7, 5),
        "b": torch.randn(3, dtype=torch.float64).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
        "i": torch.arange(11, dtype=torch.int64),
    }
    view = torch.arange(10.0)[2:5]  # a view: its whole storage is saved, with its offset
    extra = {"step": torch.tensor(3.0), "lr": 0.1, "view": view, "same": view, "name": "x", "t": (1, [2])}
    path = tmp_path / "ours.ckpt"
    _write_archive(path, big, extra)
    reference = io.BytesIO()
    torch.save({"model": big, "extra": extra}, reference)
    expected = torch.load(io.BytesIO(reference.getvalue()), weights_only=True)
    for loaded in (torch.load(path, weights_only=True), torch.load(path, weights_only=True, mmap=True)):
        assert list(loaded) == list(expected)
        for name, tensor in expected["model"].items():
            assert loaded["model"][name].dtype == tensor.dtype
            assert torch.equal(loaded["model"][name], tensor)
        assert loaded["extra"]["view"].storage_offset() == 2
        assert (
            loaded["extra"]["view"].untyped_storage().data_ptr() == loaded["extra"]["same"].untyped_storage().data_ptr()
        )
        assert torch.equal(loaded["extra"]["step"], expected["extra"]["step"])
        assert {k: v for k, v in loaded["extra"].items() if not isinstance(v, torch.Tensor)} == {
            k: v for k, v in expected["extra"].items() if not isinstance(v, torch.Tensor)
        }
    with zipfile.ZipFile(path) as opened:
        assert opened.testzip() is None
        for info in opened.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            data_offset = info.header_offset + 30 + len(info.filename) + len(_local_extra(path, info.header_offset))
            assert data_offset % archive.ALIGNMENT == 0, info.filename


def _local_extra(path: Path, header_offset: int) -> bytes:
    with open(path, "rb") as file:
        file.seek(header_offset + 26)
        name_length, extra_length = int.from_bytes(file.read(2), "little"), int.from_bytes(file.read(2), "little")
        file.seek(name_length, 1)
        return file.read(extra_length)


def test_tensor_subclasses_are_refused() -> None:
    with pytest.raises(archive.UnpicklableTensor):
        archive.pickle_state(
            {"p": torch.nn.Parameter(torch.ones(2))}, lambda tensor: archive.StorageRef("0", tensor.dtype, 2)
        )
