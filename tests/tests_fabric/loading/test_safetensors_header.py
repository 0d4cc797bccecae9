"""The safetensors header on its own: every tensor located from it, and a header that contradicts the file refused."""

import struct

import pytest
import torch
from safetensors.torch import save_file

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.safetensors_header import read_safetensors_locations
from lightning_fsdp.loading.sources import ByteRangeSource, TensorSpec


def test_the_header_locates_every_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = {
        "embedding": torch.randn(5, 3),
        "norm": torch.randn(3, dtype=torch.bfloat16),
        "positions": torch.arange(4),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 2, dtype=torch.float16),
    }
    save_file(tensors, path, metadata={"format": "pt"})
    locations = read_safetensors_locations(path)
    assert {name: location.spec for name, location in locations.items()} == {
        name: TensorSpec(tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()
    }
    source = ByteRangeSource(locations)
    try:
        for name, tensor in tensors.items():
            assert torch.equal(source.read(name), tensor), name
    finally:
        source.close()


def _file_with_header(path, header: str, data: bytes = b"\0" * 8):
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + data)
    return path


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ('{"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}', "spans 8 bytes, not its size"),
        ('{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}', "its header is not valid JSON"),
        ('{"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}', "has dtype 'Q7'"),
        ('{"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}', "its tensors cover 4 bytes but the file"),
        ('{"w": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}', "gap or overlap"),
    ],
)
def test_a_header_that_contradicts_the_file_is_refused(tmp_path, header, reason):
    path = _file_with_header(tmp_path / "crafted.safetensors", header)
    with pytest.raises(CheckpointLoadError, match=rf"The safetensors file .* is invalid: .*{reason}"):
        read_safetensors_locations(path)


def test_a_header_size_beyond_the_file_is_refused(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CheckpointLoadError, match=r"its header size \(1000 bytes\) exceeds the file \(10 bytes\)"):
        read_safetensors_locations(path)
