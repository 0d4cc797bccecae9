"""Tensor sources on their own: exact byte ranges of a file, in-memory state dicts, and walks over unpickled objects."""

import os
from pathlib import Path

import pytest
import torch

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.sources import (
    MAX_NESTING,
    ByteRangeSource,
    DictSource,
    MergedSource,
    TensorLocation,
    TensorRef,
    TensorSpec,
    map_tensors,
    materialize,
    walk_tensors,
)

_HEADER = b"not a tensor: header bytes that no location covers"


def _file_of(path: Path, *tensors: torch.Tensor) -> list[int]:
    """Write ``tensors``' bytes one after the other behind a header; return the offset of each."""
    offsets, data = [], bytearray(_HEADER)
    for tensor in tensors:
        offsets.append(len(data))
        data += tensor.contiguous().view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(data))
    return offsets


def _location(path: Path, offset: int, storage: torch.Tensor, shape, **kwargs) -> TensorLocation:
    spec = TensorSpec(tuple(shape), storage.dtype)
    return TensorLocation(path, offset, storage.numel() * storage.element_size(), spec, **kwargs)


def test_byte_ranges_read_exactly_the_located_elements(tmp_path):
    path = tmp_path / "tensors.bin"
    storage = torch.arange(24, dtype=torch.float32)
    halves = torch.arange(6, dtype=torch.bfloat16)
    offsets = _file_of(path, storage, halves)
    source = ByteRangeSource(
        {
            "whole": _location(path, offsets[0], storage, (4, 6)),
            # A view in the middle of its storage, and a transposed one: both as the file's structure describes them.
            "slice": _location(path, offsets[0], storage, (2, 3), element_offset=6),
            "transposed": _location(path, offsets[0], storage, (6, 4), stride=(1, 6)),
            "bf16": _location(path, offsets[1], halves, (6,)),
        }
    )
    try:
        assert source.specs()["whole"] == TensorSpec((4, 6), torch.float32)
        assert torch.equal(source.read("whole"), storage.view(4, 6))
        assert torch.equal(source.read("slice"), storage[6:12].view(2, 3))
        assert torch.equal(source.read("transposed"), storage.view(4, 6).t())
        assert torch.equal(source.read_flat("whole", 5, 9), storage[5:9])
        assert torch.equal(source.read_flat("transposed", 1, 3), storage.view(4, 6).t().reshape(-1)[1:3])
        out = torch.full((3,), -1.0)
        source.read_flat_into("whole", 20, out)  # same dtype, on the CPU: read straight into `out`
        assert torch.equal(out, storage[20:23])
        source.read_flat_into("bf16", 2, out)  # another dtype: read, then cast
        assert torch.equal(out, halves[2:5].float())
        source.check_unchanged()
    finally:
        source.close()


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"shape": (7,)}, "it needs more bytes than its storage holds"),
        ({"shape": (2, 2), "stride": (3, -1)}, "it has a negative stride"),
        ({"shape": (2,), "element_offset": -1}, "it has a negative size or offset"),
        ({"shape": (1,), "offset_delta": 1}, "its bytes lie outside the file"),
    ],
)
def test_a_location_outside_its_storage_or_its_file_is_refused(tmp_path, kwargs, reason):
    path = tmp_path / "tensors.bin"
    storage = torch.arange(6, dtype=torch.float32)
    (offset,) = _file_of(path, storage)
    offset += kwargs.pop("offset_delta", 0)
    with pytest.raises(CheckpointLoadError, match=rf"is corrupt: the tensor 'w' cannot be read because {reason}"):
        ByteRangeSource({"w": _location(path, offset, storage, **kwargs)})


def test_a_file_changed_while_it_is_read_is_noticed(tmp_path):
    path = tmp_path / "tensors.bin"
    storage = torch.arange(6, dtype=torch.float32)
    (offset,) = _file_of(path, storage)
    source = ByteRangeSource({"w": _location(path, offset, storage, (6,))})
    try:
        replacement = tmp_path / "new.bin"
        _file_of(replacement, storage + 1)
        os.replace(replacement, path)
        with pytest.raises(CheckpointLoadError, match="was changed while it was being loaded"):
            source.check_unchanged()
    finally:
        source.close()


def test_dict_and_merged_sources():
    first = DictSource({"a": torch.ones(2, 2)})
    second = DictSource({"b": torch.arange(3.0)})
    merged = MergedSource([first, second])
    assert merged.specs() == {"a": TensorSpec((2, 2), torch.float32), "b": TensorSpec((3,), torch.float32)}
    assert torch.equal(merged.read_flat("b", 1, 3), torch.tensor([1.0, 2.0]))
    out = torch.empty(2, dtype=torch.float64)
    merged.read_flat_into("a", 2, out)
    assert torch.equal(out, torch.ones(2, dtype=torch.float64))
    with pytest.raises(CheckpointLoadError, match=r"1 value\(s\) that are not tensors.*'step' \(int\)"):
        DictSource({"a": torch.ones(1), "step": 3})
    with pytest.raises(CheckpointLoadError, match=r"1 key\(s\) that are not names: 0 \(int\)"):
        DictSource({0: torch.ones(1)})


def test_walks_visit_each_object_once_and_keep_what_is_shared():
    source = DictSource({"exp_avg": torch.arange(4.0)})
    reference = TensorRef(source, "exp_avg")
    tied = torch.ones(2)
    shared = [tied, 3]
    checkpoint = {"model": {"embedding": tied, "head": tied}, "optimizer": {"w": reference}, "a": shared, "b": shared}
    assert [path for path, _ in walk_tensors(checkpoint)] == ["model.embedding", "model.head", "optimizer.w", "a.0"]
    copy = materialize(checkpoint)
    assert torch.equal(copy["optimizer"]["w"], torch.arange(4.0))  # a reference is read
    assert copy["model"]["embedding"] is copy["model"]["head"]  # one tensor, copied once
    assert copy["model"]["embedding"] is not tied
    assert copy["a"] is copy["b"]
    calls = []
    map_tensors(checkpoint, lambda path, tensor: calls.append(path))
    assert calls == ["model.embedding", "optimizer.w"]  # once per tensor, at the first place it is found
    cycle: list = []
    cycle.append(cycle)
    rebuilt = map_tensors(cycle, lambda path, tensor: tensor)
    assert rebuilt is not cycle
    assert rebuilt[0] is rebuilt  # a cycle ends, and stays one


def test_containers_nested_beyond_any_checkpoint_are_refused():
    deep: list = [torch.ones(1)]
    for _ in range(MAX_NESTING + 1):
        deep = [deep]
    with pytest.raises(CheckpointLoadError, match=rf"nested more than {MAX_NESTING} levels deep"):
        walk_tensors(deep)
