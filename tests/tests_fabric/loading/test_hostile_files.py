"""Crafted and damaged files, in one process: each is read exactly, or refused with one clear error, never guessed.

Every case goes through the reader that loading, `inspect` and `convert` share, and through `inspect` and `convert`
themselves, so none of them can accept what another refuses.
"""

import json
import os
import struct
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_fsdp.loading.convert import convert_checkpoint, describe_checkpoint
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.formats import detect_checkpoint, open_checkpoint
from tests.tests_fabric.helpers.checkpoints import write_checkpoint
from tests.tests_fabric.helpers.models import TinyTransformer
from tests.tests_fabric.helpers.runif import RunIf


@pytest.fixture
def state_dict():
    torch.manual_seed(0)
    return TinyTransformer().state_dict()


def _open(path: Path, module_key: str | None = None):
    return open_checkpoint(detect_checkpoint(path), module_key=module_key, weights_only=True)


def _assert_refused_everywhere(path: Path, pattern: str, tmp_path: Path) -> None:
    """Loading's reader, `inspect` and `convert` all refuse the file with the same kind of error."""
    with pytest.raises(CheckpointLoadError, match=pattern):
        _open(path)
    with pytest.raises(CheckpointLoadError, match=pattern):
        describe_checkpoint(path)
    with pytest.raises(CheckpointLoadError, match=pattern):
        convert_checkpoint(path, tmp_path / f"converted-{path.name}")


def _rewrite_zip(source: Path, target: Path, change=None, **zip_kwargs) -> None:
    """Re-pack a `torch.save` zip with Python's zipfile: its records land at other offsets than torch's writer's."""
    with zipfile.ZipFile(source) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(target, "w", **zip_kwargs) as archive:
        for name, data in entries:
            if change is not None:
                data = change(name, data)
            archive.writestr(name, data)


def test_zip_record_shorter_than_its_storage_is_refused(tmp_path, state_dict):
    good = write_checkpoint(state_dict, tmp_path / "good", "torch-zip")
    crafted = tmp_path / "crafted.pth"
    # The pickle still says each storage's size; one record now holds fewer bytes than that.
    _rewrite_zip(good, crafted, change=lambda name, data: data[: len(data) // 2] if name.endswith("/data/0") else data)
    _assert_refused_everywhere(
        crafted, r"its pickle says the storage '0' holds \d+ bytes, but the archive has a record of", tmp_path
    )


@pytest.mark.parametrize("fmt", ["torch-zip", "hf-index-bin"])
def test_repacked_zip_files_load_exactly_and_convert_exactly(tmp_path, state_dict, fmt):
    path = write_checkpoint(state_dict, tmp_path / "original", fmt)
    for file in [path] if fmt == "torch-zip" else sorted(path.parent.glob("*.bin")):
        _rewrite_zip(file, file.with_suffix(".tmp"))
        file.with_suffix(".tmp").replace(file)
    opened = _open(path)
    for name, tensor in state_dict.items():
        assert torch.equal(opened.source.read(name), tensor), name
    output = tmp_path / "converted"
    convert_checkpoint(path, output)
    converted = _open_converted(output)
    assert set(converted) == set(state_dict)
    for name, tensor in state_dict.items():
        assert torch.equal(converted[name], tensor), name


def _open_converted(output: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(output).read_metadata()
    state = {
        fqn: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for fqn, meta in metadata.state_dict_metadata.items()
    }
    dcp.load(state, storage_reader=dcp.FileSystemReader(output), no_dist=True)
    return {fqn.removeprefix("model."): tensor for fqn, tensor in state.items()}


def test_convert_checks_each_zip_records_crc(tmp_path, state_dict):
    good = write_checkpoint(state_dict, tmp_path / "good", "torch-zip")
    damaged = tmp_path / "damaged.pth"
    data = bytearray(good.read_bytes())
    with zipfile.ZipFile(good) as archive:
        info = archive.getinfo(next(n for n in archive.namelist() if n.endswith("/data/1")))
    # A flipped bit inside a tensor's bytes: offsets and sizes all hold, only the checksum can tell.
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    data[info.header_offset + 30 + name_length + extra_length + 3] ^= 0x10
    damaged.write_bytes(bytes(data))
    with pytest.raises(CheckpointLoadError, match=r"does not match its checksum \(CRC\)"):
        convert_checkpoint(damaged, tmp_path / "out")


def _safetensors_with_header(tmp_path: Path, name: str, change) -> Path:
    path = tmp_path / "good.safetensors"
    save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.float16)}, path)
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    text = change(header)
    text = text if isinstance(text, str) else json.dumps(text)
    crafted = tmp_path / f"{name}.safetensors"
    crafted.write_bytes(len(text).to_bytes(8, "little") + text.encode() + raw[8 + size :])
    return crafted


def _set(header: dict, name: str, key: str, value) -> dict:
    header[name][key] = value
    return header


_SAFETENSORS_CASES = {
    "shape needs more bytes": (lambda h: _set(h, "a", "shape", [3, 3]), r"spans 24 bytes, not its size"),
    "dtype needs more bytes": (lambda h: _set(h, "b", "dtype", "F32"), r"spans 8 bytes, not its size"),
    "overlapping ranges": (
        lambda h: _set(_set(h, "b", "data_offsets", [0, 8]), "b", "dtype", "F16"),
        r"gap or overlap|not its size",
    ),
    "negative offset": (lambda h: _set(h, "a", "data_offsets", [-8, 16]), r"invalid data offsets"),
    "duplicate names": (
        lambda h: json.dumps(h)[:-1] + ', "a": ' + json.dumps(h["a"]) + "}",
        r"appears twice",
    ),
    "unknown dtype": (lambda h: _set(h, "a", "dtype", "Q7"), r"dtype 'Q7'"),
    "bool as a dimension": (lambda h: _set(h, "a", "shape", [True, 6]), r"invalid shape"),
    "bytes past the file": (lambda h: _set(h, "b", "data_offsets", [24, 40]), r"not its size|cover"),
}


@pytest.mark.parametrize("case", list(_SAFETENSORS_CASES))
def test_invalid_safetensors_header_is_refused_everywhere(tmp_path, case):
    change, pattern = _SAFETENSORS_CASES[case]
    path = _safetensors_with_header(tmp_path, case.replace(" ", "_"), change)
    for call in (
        lambda: _open(path),
        lambda: describe_checkpoint(path),
        lambda: convert_checkpoint(path, tmp_path / "o"),
    ):
        with pytest.raises(CheckpointLoadError, match=pattern):
            call()


def test_valid_crafted_safetensors_header_still_loads(tmp_path):
    path = _safetensors_with_header(tmp_path, "same", lambda header: header)
    assert torch.equal(_open(path).source.read("a"), torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/hostname", "shards/../../outside.safetensors"])
def test_index_names_stay_inside_the_checkpoint(tmp_path, state_dict, name):
    (tmp_path / "outside.safetensors").write_bytes(b"SECRET-BYTES-" * 10)
    index = write_checkpoint(state_dict, tmp_path / "checkpoint", "hf-index-safetensors")
    content = json.loads(index.read_text())
    first = next(iter(content["weight_map"]))
    content["weight_map"][first] = name
    index.write_text(json.dumps(content))
    for call in (lambda: _open(index), lambda: describe_checkpoint(index)):
        with pytest.raises(CheckpointLoadError, match=r"outside its directory") as error:
            call()
        assert "SECRET" not in str(error.value)


def test_index_may_name_symlinked_shards(tmp_path, state_dict):
    """The Hugging Face cache links each snapshot file to `../../blobs/<hash>`: links are followed."""
    index = write_checkpoint(state_dict, tmp_path / "snapshot", "hf-index-safetensors")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in index.parent.glob("*.safetensors"):
        shard.replace(blobs / shard.name)
        shard.symlink_to(Path("..") / "blobs" / shard.name)
    opened = _open(index)
    assert all(torch.equal(opened.source.read(name), tensor) for name, tensor in state_dict.items())


def _with_timeout(call, seconds: float = 10.0):
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "hung on a FIFO"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


@RunIf(linux_only=True)
def test_fifos_are_refused_before_they_are_opened(tmp_path, state_dict):
    os.mkfifo(tmp_path / "weights.pth")
    with pytest.raises(CheckpointLoadError, match=r"not a regular file but a FIFO"):
        _with_timeout(lambda: detect_checkpoint(tmp_path / "weights.pth"))
    directory = tmp_path / "hf"
    directory.mkdir()
    os.mkfifo(directory / "model.safetensors.index.json")
    with pytest.raises(CheckpointLoadError, match=r"not a regular file but a FIFO"):
        _with_timeout(lambda: detect_checkpoint(directory))
    index = write_checkpoint(state_dict, tmp_path / "index", "hf-index-safetensors")
    shard = next(index.parent.glob("*.safetensors"))
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(CheckpointLoadError, match=r"not a regular file but a FIFO"):
        _with_timeout(lambda: _open(index))


def test_integer_keys_get_a_clear_error(tmp_path):
    torch.save({0: torch.zeros(2), "weight": torch.ones(2)}, tmp_path / "int_keys.pth")
    with pytest.raises(CheckpointLoadError, match=r"1 key\(s\) that are not names: 0 \(int\)"):
        _open(tmp_path / "int_keys.pth")


@pytest.mark.parametrize("fmt", ["torch-zip", "torch-legacy", "safetensors"])
def test_file_truncated_during_a_read_raises_instead_of_crashing(tmp_path, state_dict, fmt):
    path = write_checkpoint(state_dict, tmp_path, fmt)
    opened = _open(path)
    os.truncate(path, path.stat().st_size // 3)  # what re-saving the checkpoint in place does to a reader
    with pytest.raises(CheckpointLoadError, match=r"ended before the tensor"):
        _read_every_tensor(opened.source, list(state_dict))
    with pytest.raises(CheckpointLoadError, match=r"changed while it was being loaded"):
        opened.check_unchanged()


def _read_every_tensor(source, names: list[str]) -> None:
    for name in names:
        source.read(name)


def test_file_replaced_during_a_load_is_noticed(tmp_path, state_dict):
    path = write_checkpoint(state_dict, tmp_path, "torch-zip")
    opened = _open(path)
    replacement = tmp_path / "new.pth"
    torch.save(state_dict, replacement)
    replacement.replace(path)  # an atomic re-save: the old file stays readable through the open descriptor
    assert torch.equal(opened.source.read("head.weight"), state_dict["head.weight"])
    with pytest.raises(CheckpointLoadError, match=r"changed while it was being loaded"):
        opened.check_unchanged()


class _UnseekableWriter:
    """A stream that cannot seek: zip writers then put each record's sizes in a data descriptor after its data."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> int:
        self.data += chunk
        return len(chunk)

    def flush(self) -> None:
        pass


def test_zip_with_data_descriptors_loads_exactly(tmp_path, state_dict):
    original = write_checkpoint(state_dict, tmp_path / "original", "torch-zip")
    with zipfile.ZipFile(original) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    stream = _UnseekableWriter()
    with zipfile.ZipFile(stream, "w") as archive:
        for name, data in entries:
            with archive.open(name, "w") as record:
                record.write(data)
    path = tmp_path / "streamed.pth"
    path.write_bytes(bytes(stream.data))
    opened = _open(path)
    assert all(torch.equal(opened.source.read(name), tensor) for name, tensor in state_dict.items())


def test_zip_length_field_changed_is_refused(tmp_path, state_dict):
    """A local header whose extra-field length shrank points its data into its own padding: the bytes no longer tile."""
    good = write_checkpoint(state_dict, tmp_path / "good", "torch-zip")
    data = bytearray(good.read_bytes())
    with zipfile.ZipFile(good) as archive:
        info = archive.getinfo(next(n for n in archive.namelist() if n.endswith("/data/3")))
    extra_length_at = info.header_offset + 28
    assert struct.unpack("<H", data[extra_length_at : extra_length_at + 2])[0] > 0  # torch pads to align the data
    data[extra_length_at : extra_length_at + 2] = b"\x00\x00"
    crafted = tmp_path / "crafted.pth"
    crafted.write_bytes(bytes(data))
    _assert_refused_everywhere(crafted, r"unaccounted bytes|overlap", tmp_path)
