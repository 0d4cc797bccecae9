import json

import pytest
import torch

from lightning_fsdp.core.load import (
    _find_hf_index,
    _is_mmappable,
    _is_safetensors_file,
    _lazy_load_state_dict,
    _read_box,
    _read_flat,
)


def test_is_safetensors_file_from_content(tmp_path):
    _save_safetensors({"a": torch.zeros(2)}, tmp_path / "weights.bin")
    torch.save({"a": torch.zeros(2)}, tmp_path / "model.safetensors")
    (tmp_path / "empty").write_bytes(b"")
    assert _is_safetensors_file(tmp_path / "weights.bin")
    assert not _is_safetensors_file(tmp_path / "model.safetensors")
    assert not _is_safetensors_file(tmp_path / "empty")
    assert not _is_safetensors_file(tmp_path)


def test_find_hf_index(tmp_path):
    assert _find_hf_index(tmp_path) is None
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {}}))
    assert _find_hf_index(tmp_path) == index
    assert _find_hf_index(index) == index
    (tmp_path / "pytorch_model.bin.index.json").write_text("{}")
    with pytest.raises(ValueError, match="several checkpoint indexes"):
        _find_hf_index(tmp_path)


def test_lazy_load_state_dict_formats(tmp_path):
    state_dict = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}
    torch.save(state_dict, tmp_path / "zip.pt")
    torch.save(state_dict, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    _save_safetensors(state_dict, tmp_path / "model.safetensors")
    _save_safetensors({"a": state_dict["a"]}, tmp_path / "shard-1.safetensors")
    torch.save({"b": state_dict["b"]}, tmp_path / "shard-2.bin")
    weight_map = {"a": "shard-1.safetensors", "b": "shard-2.bin"}
    (tmp_path / "model.index.json").write_text(json.dumps({"weight_map": weight_map}))

    for name, mmappable in [("zip.pt", True), ("legacy.pt", False), ("model.safetensors", True), ("", True)]:
        path = tmp_path / name
        assert _is_mmappable(path) is mmappable
        loaded = _lazy_load_state_dict(path, weights_only=True)
        assert sorted(loaded) == ["a", "b"]
        for key, expected in state_dict.items():
            assert torch.equal(_read_flat(loaded[key], 0, expected.numel()).view(expected.shape), expected)


def test_read_flat_and_box_from_safetensors_slices(tmp_path):
    tensor = torch.arange(30.0).reshape(5, 6)
    _save_safetensors({"t": tensor, "s": torch.tensor(7.0)}, tmp_path / "model.safetensors")
    loaded = _lazy_load_state_dict(tmp_path / "model.safetensors")
    for start, stop in [(0, 30), (7, 8), (5, 19), (29, 30), (12, 12)]:
        assert torch.equal(_read_flat(loaded["t"], start, stop), tensor.reshape(-1)[start:stop])
    assert torch.equal(_read_flat(loaded["s"], 0, 1), torch.tensor([7.0]))
    box = (slice(1, 3), slice(2, 6))
    assert torch.equal(_read_box(loaded["t"], box), tensor[box])


def test_hf_index_refuses_shards_outside_its_folder(tmp_path):
    (tmp_path / "model.index.json").write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(ValueError, match="outside its folder"):
        _lazy_load_state_dict(tmp_path)
    (tmp_path / "model.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="no `weight_map`"):
        _lazy_load_state_dict(tmp_path)


def test_lazy_load_state_dict_refuses_damaged_files(tmp_path):
    """A file cut short is refused when it is opened, before any tensor of it is read."""
    state_dict = {"a": torch.arange(100.0), "b": torch.ones(3, 4)}
    torch.save(state_dict, tmp_path / "model.pt")
    data = (tmp_path / "model.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match="failed finding central directory"):
        _lazy_load_state_dict(tmp_path / "truncated.pt", weights_only=True)

    _save_safetensors(state_dict, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[:-8])
    assert _is_safetensors_file(tmp_path / "truncated.safetensors")
    with pytest.raises(Exception, match="not fully covered"):
        _lazy_load_state_dict(tmp_path / "truncated.safetensors")
    # a header that claims more bytes than the file holds is not taken for a safetensors file
    (tmp_path / "header.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    assert not _is_safetensors_file(tmp_path / "header.safetensors")


def _save_safetensors(tensors, path):
    # `safetensors` is optional: the tests that write such files are skipped without it
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file(tensors, path)
