"""Write one module state dict in every format the loader reads, as users get them from elsewhere."""

import json
import zipfile
from pathlib import Path

import torch
from safetensors.torch import save_file

FORMATS = ("torch-zip", "torch-legacy", "safetensors", "hf-index-safetensors", "hf-index-bin", "hf-directory")


class MarkerPayload:
    """Unpickling this creates the file ``marker``: proof that code from the checkpoint ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return open, (self.marker, "w")


def write_checkpoint(state_dict: dict[str, torch.Tensor], directory: Path, fmt: str) -> Path:
    """Write ``state_dict`` in format ``fmt`` under ``directory``; return the path a user would pass to load it."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "torch-zip":
        path = directory / "lit-llama.pth"
        torch.save(state_dict, path)
    elif fmt == "torch-legacy":
        path = directory / "legacy.pth"
        torch.save(state_dict, path, _use_new_zipfile_serialization=False)
    elif fmt == "safetensors":
        path = directory / "model.safetensors"
        save_file(_unshared(state_dict), path)
    elif fmt in ("hf-index-safetensors", "hf-index-bin", "hf-directory"):
        path = _write_hf_sharded(state_dict, directory, binary=fmt == "hf-index-bin")
        if fmt == "hf-directory":
            path = directory
    else:
        raise ValueError(fmt)
    return path


def _write_hf_sharded(state_dict: dict[str, torch.Tensor], directory: Path, binary: bool) -> Path:
    names = list(state_dict)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    suffix = "bin" if binary else "safetensors"
    prefix = "pytorch_model" if binary else "model"
    weight_map = {}
    for index, shard_names in enumerate(halves, start=1):
        file_name = f"{prefix}-{index:05d}-of-{len(halves):05d}.{suffix}"
        shard = _unshared({name: state_dict[name] for name in shard_names})
        if binary:
            torch.save(shard, directory / file_name)
        else:
            save_file(shard, directory / file_name)
        weight_map.update(dict.fromkeys(shard_names, file_name))
    index_path = directory / f"{prefix}.{suffix}.index.json"
    index_path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index_path


def _unshared(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share memory (tied weights): store each one on its own, as exporters do.
    return {name: tensor.detach().clone().contiguous() for name, tensor in state_dict.items()}


def write_bad_inputs(tmp_path: Path, state_dict: dict) -> dict[str, tuple[Path, str]]:
    """Each bad input, and a pattern its error message must match."""
    cases: dict[str, tuple[Path, str]] = {}
    cases["missing path"] = (tmp_path / "nope.pth", "does not exist")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "notes.txt").write_text("hi")
    cases["directory without checkpoint"] = (tmp_path / "empty_dir", "holds no checkpoint.*notes.txt")
    (tmp_path / "empty.pth").write_bytes(b"")
    cases["empty file"] = (tmp_path / "empty.pth", "is empty")
    good = write_checkpoint(state_dict, tmp_path / "good", "torch-zip")
    (tmp_path / "truncated.pth").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    cases["truncated zip"] = (
        tmp_path / "truncated.pth",
        r"it is truncated\. It has \d+ bytes, but its records say it had at least \d+; its zip end record",
    )
    (tmp_path / "random.bin").write_bytes(bytes(range(7, 255)) * 40)
    cases["random bytes"] = (tmp_path / "random.bin", "not a checkpoint format")
    torch.save([torch.zeros(2), torch.ones(2)], tmp_path / "list.pth")
    cases["pickle of a list"] = (tmp_path / "list.pth", "holds a list, not a state dict")
    torch.save({"weight": torch.zeros(2), "note": "text", "count": 3}, tmp_path / "mixed.pth")
    # read as the module state itself (`load_raw`), it names the values that are not tensors; with a key for the
    # model (`fabric.load`), it says that the file is no raw state dict, for what it holds beside the tensors
    cases["non-tensor values"] = (
        tmp_path / "mixed.pth",
        "2 value.*not tensors.*'note' \\(str\\)|not a raw module state dict either: beside tensors it holds 'note'",
    )
    index_dir = tmp_path / "index"
    index = write_checkpoint(state_dict, index_dir, "hf-index-safetensors")
    next(index_dir.glob("*-00002-of-00002.safetensors")).unlink()
    cases["index with a missing shard"] = (index, "names 1 shard file.*do not exist.*00002-of-00002")
    (tmp_path / "not_index.json").write_text(json.dumps({"hello": "world"}))
    cases["json that is not an index"] = (tmp_path / "not_index.json", "not a Hugging Face checkpoint index")
    return cases


def retag_storages(path: Path, old: str, new: str) -> None:
    """Rewrite the device tags that `torch.save` recorded, e.g. to make a file look saved from `cuda:0`."""
    with zipfile.ZipFile(path) as archive:
        entries = {info.filename: archive.read(info) for info in archive.infolist()}
    pickle_name = next(name for name in entries if name.endswith("data.pkl"))
    entries[pickle_name] = _replace_pickled_string(entries[pickle_name], old, new)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)


def _replace_pickled_string(data: bytes, old: str, new: str) -> bytes:
    # torch.save pickles with protocol 2, where a string is BINUNICODE: 'X', a 4-byte length, then the text.
    def encode(text: str) -> bytes:
        return b"X" + len(text).to_bytes(4, "little") + text.encode()

    assert encode(old) in data
    return data.replace(encode(old), encode(new))
