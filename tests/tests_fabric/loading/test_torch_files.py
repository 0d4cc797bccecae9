"""The structure of `torch.save` files, zip and legacy, read without their data: pickles walked weights-only."""

import zipfile
from pathlib import Path

import pytest
import torch

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.legacy import read_legacy_structure
from lightning_fsdp.loading.sources import ByteRangeSource, walk_tensors
from lightning_fsdp.loading.torch_pickle import read_zip_structure
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
