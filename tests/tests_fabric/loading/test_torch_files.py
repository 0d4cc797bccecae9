"""The structure of `torch.save` files, zip and legacy, read without their data: pickles walked weights-only."""

import re
import zipfile
from pathlib import Path

import pytest
import torch

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.files import close_file, open_file
from lightning_fsdp.loading.formats import load_torch_file
from lightning_fsdp.loading.legacy import read_legacy_structure
from lightning_fsdp.loading.sources import ByteRangeSource, walk_tensors
from lightning_fsdp.loading.torch_pickle import read_zip_structure
from lightning_fsdp.loading.zip_records import ZipRecord, read_zip_records
from tests.tests_fabric.helpers.checkpoints import MarkerPayload


def _read_structure(path: Path, legacy: bool, weights_only: bool = True):
    return read_legacy_structure(path, weights_only) if legacy else read_zip_structure(path, weights_only)


def _checkpoint() -> dict:
    storage = torch.arange(24, dtype=torch.float32)
    return {
        "model": {
            "weight": storage.view(4, 6),
            "transposed": storage.view(4, 6).t(),  # a view sharing the storage
            "tail": storage[18:],  # a view at an offset
            "half": torch.arange(5, dtype=torch.bfloat16),
        },
        "step": 7,
    }


@pytest.mark.parametrize("legacy", [False, True])
def test_the_structure_locates_every_tensor_and_reads_it_by_byte_ranges(tmp_path, legacy):
    path = tmp_path / "checkpoint.pt"
    saved = _checkpoint()
    torch.save(saved, path, _use_new_zipfile_serialization=not legacy)
    structure = _read_structure(path, legacy)
    assert structure.content["step"] == 7
    model = structure.content["model"]
    assert all(tensor.device.type == "meta" for tensor in model.values())  # no data was read
    assert model["weight"].untyped_storage()._cdata == model["transposed"].untyped_storage()._cdata
    source = ByteRangeSource(structure.locate(model))
    try:
        for name, tensor in saved["model"].items():
            assert source.specs()[name].shape == tuple(tensor.shape)
            assert torch.equal(source.read(name), tensor), name
    finally:
        source.close()
    assert [name for name, _ in walk_tensors(structure.content)] == [f"model.{name}" for name in saved["model"]]


@pytest.mark.parametrize("legacy", [False, True])
def test_objects_other_than_tensors_are_refused_unrun(tmp_path, legacy):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.pt"
    payload = {"weight": torch.zeros(2), "payload": MarkerPayload(marker)}
    torch.save(payload, path, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(CheckpointLoadError, match=r"Refused to unpickle .*the payload was not run.*weights_only=False"):
        _read_structure(path, legacy)
    assert not marker.exists()


def test_a_storage_that_does_not_match_its_checksum_is_refused_when_checked(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"w": torch.zeros(64)}, path)
    (storage,) = read_zip_structure(path, weights_only=True).storages.values()
    data = bytearray(path.read_bytes())
    data[storage.offset + 5] ^= 0xFF  # one byte of the storage's record
    path.write_bytes(bytes(data))
    read_zip_structure(path, weights_only=True)  # the storages are not read to locate them
    with pytest.raises(CheckpointLoadError, match=r"does not match its checksum \(CRC\)"):
        read_zip_structure(path, weights_only=True, verify_crc=True)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_truncated_file_is_refused(tmp_path, legacy):
    path = tmp_path / "checkpoint.pt"
    torch.save({"w": torch.zeros(64)}, path, _use_new_zipfile_serialization=not legacy)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CheckpointLoadError, match="truncated"):
        _read_structure(path, legacy)


def _truncated_error(path: Path, size: int) -> str:
    path.with_name("cut.pt").write_bytes(path.read_bytes()[:size])
    with pytest.raises(CheckpointLoadError, match="it is truncated") as error:
        read_zip_structure(path.with_name("cut.pt"), weights_only=True)
    return str(error.value)


def test_a_truncated_zip_file_says_its_size_and_the_size_its_records_need(tmp_path):
    """An interrupted copy: the error gives the size found and the size that the file's structures say it had."""
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {"w": torch.zeros(1000), "b": torch.zeros(24, dtype=torch.float16)}, "step": 7}, path)
    size = path.stat().st_size
    pickle = _records(path)["checkpoint/data.pkl"]
    pickle_end, storages = pickle.data_offset + pickle.size, 1000 * 4 + 24 * 2
    with zipfile.ZipFile(path) as archive:
        directory_start = archive.start_dir
    sizes = r"It has (\d+) bytes, but its records say it had at least (\d+); its zip end record"
    # cut in the tensors' data: the pickle's storages say how large the file was at least
    for cut in (pickle_end + 1, size // 2):
        found = re.search(sizes, _truncated_error(path, cut))
        assert found, cut
        assert int(found.group(1)) == cut
        assert pickle_end + storages < int(found.group(2)) <= size
    # cut in the end record: the zip64 end record before it says how large the file was
    for cut in (size - 1, size - 22):
        found = re.search(sizes, _truncated_error(path, cut))
        assert found, cut
        assert (int(found.group(1)), int(found.group(2))) == (cut, size)
    # cut in the pickle, or in the central directory, past what the pickle accounts for: only the size found
    for cut in (pickle_end - 10, directory_start + 10):
        assert _truncated_error(path, cut).endswith(
            f"it is truncated. It has {cut} bytes; its zip end record (the last bytes of every zip file) is"
            " missing. Re-copy or re-save it, and compare its size with the original's."
        )


def test_a_truncated_zip_file_read_whole_says_the_same(tmp_path):
    """A trusted file is read by `torch.load`, whose error for a truncated file is `OSError: Invalid argument`."""
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {"w": torch.zeros(1000)}, "step": 7}, path)
    expected = _truncated_error(path, path.stat().st_size // 2)
    with pytest.raises(CheckpointLoadError) as error:
        load_torch_file(path.with_name("cut.pt"), weights_only=False)
    assert str(error.value) == expected
    assert error.value.__cause__ is None
    assert error.value.__suppress_context__  # torch's error is not printed under it


def _records(path: Path) -> dict[str, ZipRecord]:
    file = open_file(path)
    try:
        return read_zip_records(path, file, path.stat().st_size)
    finally:
        close_file(file)


def test_a_zip_archive_that_torch_did_not_write_is_refused(tmp_path):
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "hello")
    with pytest.raises(CheckpointLoadError, match=r"not a `torch.save` checkpoint: it has 0 `data.pkl` records"):
        read_zip_structure(path, weights_only=True)


def test_a_compressed_storage_is_refused(tmp_path):
    source = tmp_path / "checkpoint.pt"
    torch.save({"w": torch.zeros(64)}, source)
    path = tmp_path / "compressed.pt"
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for info in original.infolist():
            archive.writestr(info.filename, original.read(info.filename))
    with pytest.raises(CheckpointLoadError, match="the archive has a compressed record for it"):
        read_zip_structure(path, weights_only=True)
