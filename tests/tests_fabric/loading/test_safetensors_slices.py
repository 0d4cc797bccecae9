"""Directories of safetensors slices, as torch's ``HuggingFaceStorageWriter`` writes them without consolidation.

Each file holds slices of tensors, and its header's ``__metadata__["DCP_SHARDING_INFO"]`` gives each slice's offsets
in its tensor; there is no index and no ``.metadata``. The files here are written with ``safetensors`` in the layout
torch writes (test_torch_written_directories.py loads directories that torch's own writer wrote, on two ranks);
these tests read them without a process group, and refuse slices that do not tile their tensors.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.formats import CheckpointFormat, detect_checkpoint
from lightning_fsdp.loading.sharded_metadata import module_entry, read_safetensors_shards_metadata
from lightning_fsdp.loading.sharded_readers import SafetensorsSlicesReader


def _full_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embedding.weight": torch.randn(7, 4, generator=generator),
        "head.bias": torch.randn(5, generator=generator).to(torch.bfloat16),
        "scale": torch.tensor(2.5),
    }


def _write_slices(directory: Path, rows: list[tuple[int, int]], drop: tuple[int, ...] = ()) -> None:
    """One file per row range, as each rank writes its slices; the scalar is in the first file only."""
    directory.mkdir()
    state = _full_state()
    for index, (start, stop) in enumerate(rows):
        if index in drop:
            continue
        tensors = {
            "embedding.weight": state["embedding.weight"][start:stop].contiguous(),
            "head.bias": state["head.bias"][min(start, 5) : min(stop, 5)].contiguous(),
        }
        info = {"embedding.weight": {"saved_offsets": [start, 0]}, "head.bias": {"saved_offsets": [min(start, 5)]}}
        if index == 0:
            tensors["scale"] = state["scale"]
            info["scale"] = {"saved_offsets": []}
        metadata = {"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"}
        save_file(tensors, directory / f"shard-{index + 1:05d}-model-00001-of-00001.safetensors", metadata=metadata)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_slices_are_read_into_another_layout(tmp_path):
    path = tmp_path / "slices"
    _write_slices(path, [(0, 4), (4, 7)])
    detected = detect_checkpoint(path)
    assert detected.format is CheckpointFormat.SAFETENSORS_SHARDS
    assert len(detected.files) == 2
    metadata = read_safetensors_shards_metadata(detected)
    assert module_entry(metadata, "model") is None  # a raw module state dict: names at the top level
    assert {name: tuple(entry.size) for name, entry in metadata.state_dict_metadata.items()} == {
        "embedding.weight": (7, 4),
        "head.bias": (5,),
        "scale": (),
    }
    # Read into the whole tensors (other bounds than the files' slices), with no process group.
    expected = _full_state()
    state = {name: torch.zeros_like(tensor) for name, tensor in expected.items()}
    dcp.load(state, storage_reader=SafetensorsSlicesReader(path, metadata), no_dist=True)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
        assert state[name].dtype == tensor.dtype


def test_a_missing_middle_slice_is_refused(tmp_path):
    path = tmp_path / "slices"
    _write_slices(path, [(0, 2), (2, 4), (4, 7)], drop=(1,))
    with pytest.raises(
        CheckpointLoadError, match=r"do not form whole tensors: .*'embedding.weight'.*A file is missing"
    ):
        read_safetensors_shards_metadata(detect_checkpoint(path))


def test_overlapping_slices_are_refused(tmp_path):
    path = tmp_path / "slices"
    _write_slices(path, [(0, 4), (3, 7)])
    with pytest.raises(CheckpointLoadError, match=r"do not form whole tensors: .*'embedding.weight'"):
        read_safetensors_shards_metadata(detect_checkpoint(path))


@pytest.mark.parametrize(
    ("info", "pattern"),
    [
        ("not json", r"`DCP_SHARDING_INFO` is not valid JSON"),
        ("[1, 2]", r"`DCP_SHARDING_INFO` is not a JSON object"),
        (json.dumps({"w": {"saved_offsets": [0]}}), r"'w' of shape \[2, 3\] has the offsets \[0\]"),
        (json.dumps({"w": {"saved_offsets": [0, -1]}}), r"'w' of shape \[2, 3\] has the offsets \[0, -1\]"),
        (json.dumps({"w": {"saved_offsets": [0, True]}}), r"has the offsets \[0, True\]"),
        (json.dumps({"v": {"saved_offsets": [0, 0]}}), r"'w' of shape \[2, 3\] has the offsets None"),
        (json.dumps({"w": {"saved_offsets": [0, 0]}, "v": {}}), r"names tensors it does not hold: 'v'"),
    ],
)
def test_sharding_information_is_checked(tmp_path, info, pattern):
    path = tmp_path / "slices"
    path.mkdir()
    save_file(
        {"w": torch.ones(2, 3)}, path / "shard-00001-model-00001-of-00001.safetensors", {"DCP_SHARDING_INFO": info}
    )
    with pytest.raises(
        CheckpointLoadError, match=r"is not a slice file as torch's `HuggingFaceStorageWriter`"
    ) as error:
        read_safetensors_shards_metadata(detect_checkpoint(path))
    assert error.match(pattern)


def test_slices_of_different_dtypes_are_refused(tmp_path):
    path = tmp_path / "slices"
    path.mkdir()
    for index, dtype in enumerate((torch.float32, torch.float16)):
        info = json.dumps({"w": {"saved_offsets": [index, 0]}})
        save_file({"w": torch.ones(1, 3, dtype=dtype)}, path / f"{index}.safetensors", {"DCP_SHARDING_INFO": info})
    with pytest.raises(CheckpointLoadError, match=r"slices of the tensor 'w' .* differ \(float16 .*, float32 .*\)"):
        read_safetensors_shards_metadata(detect_checkpoint(path))


def test_plain_safetensors_files_without_an_index_are_not_slices(tmp_path):
    path = tmp_path / "plain"
    path.mkdir()
    save_file({"w": torch.ones(2)}, path / "weights.safetensors")
    with pytest.raises(CheckpointLoadError, match=r"holds no checkpoint.*It contains: 'weights.safetensors'"):
        detect_checkpoint(path)
