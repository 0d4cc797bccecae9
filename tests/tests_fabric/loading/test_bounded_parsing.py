"""Crafted files, in one process: walks, headers and indexes cost in proportion to them, and their text is escaped."""

import json
import struct
import sys
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from lightning_fsdp.loading import formats
from lightning_fsdp.loading.convert import convert_checkpoint, describe_checkpoint
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.formats import MAX_INDEX_BYTES, detect_checkpoint, open_checkpoint
from lightning_fsdp.loading.safetensors_header import MAX_HEADER_BYTES, read_safetensors_locations
from lightning_fsdp.loading.sources import MAX_TENSORS, materialize, walk_tensors
from tests.tests_fabric.helpers.checkpoints import write_checkpoint
from tests.tests_fabric.test_load_hostile_parsing import shared_tuples


def _shared_levels(value: tuple) -> int:
    levels = 0
    while isinstance(value, tuple) and len(value) == 2 and value[0] is value[1]:
        value, levels = value[0], levels + 1
    return levels


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
@pytest.mark.parametrize("weights_only", [True, False])
def test_every_walk_over_shared_references_is_linear(tmp_path, fmt, weights_only):
    # A tensor at the bottom of forty levels of shared tuples: 2**40 paths lead to it, one object holds it.
    path = tmp_path / "shared.ckpt"
    checkpoint = {"model": {"w": torch.ones(2, 3)}, "step": 1, "hparams": shared_tuples(40)}
    checkpoint["buffers"] = (torch.arange(3.0),)
    for _ in range(40):
        checkpoint["buffers"] = (checkpoint["buffers"], checkpoint["buffers"])
    torch.save(checkpoint, path, _use_new_zipfile_serialization=fmt == "zip")
    start = time.monotonic()
    opened = open_checkpoint(detect_checkpoint(path), "model", weights_only)
    try:
        entries = materialize(opened.entries)
    finally:
        opened.close()
    assert _shared_levels(entries["hparams"]) == 40
    assert _shared_levels(entries["buffers"]) == 40
    leaf = entries["buffers"]
    while len(leaf) == 2:
        leaf = leaf[0]
    assert torch.equal(leaf[0], torch.arange(3.0))
    assert [name for name, _ in walk_tensors(checkpoint)] == ["model.w", "buffers" + ".0" * 41]
    assert describe_checkpoint(path, weights_only).tensors == 2
    converted = convert_checkpoint(path, tmp_path / "converted", weights_only=weights_only)
    assert converted.skipped_keys == ["buffers"]
    metadata = torch.load(tmp_path / "converted" / "meta.pt", weights_only=True)
    assert _shared_levels(metadata["hparams"]) == 40  # written shared, so as small as the input
    assert time.monotonic() - start < 30  # each walk doubled its work per level before


def test_names_that_collide_still_read_their_own_tensors(tmp_path):
    # The dotted paths of `"a.b"` and `"a" -> "b"` are the same: each reference must still read its own tensor.
    path = tmp_path / "collide.ckpt"
    torch.save({"model": {"w": torch.ones(1)}, "extra": {"a.b": torch.zeros(2), "a": {"b": torch.ones(3)}}}, path)
    opened = open_checkpoint(detect_checkpoint(path), "model", weights_only=True)
    try:
        extra = materialize(opened.entries["extra"])
    finally:
        opened.close()
    assert torch.equal(extra["a.b"], torch.zeros(2))
    assert torch.equal(extra["a"]["b"], torch.ones(3))


def test_an_ordered_dict_stays_one_as_torch_load_returns_it(tmp_path):
    path = tmp_path / "ordered.ckpt"
    extra = OrderedDict([("b", torch.ones(2)), ("a", OrderedDict([("x", 1)])), ("plain", {"y": torch.zeros(1)})])
    torch.save({"model": {"w": torch.ones(1)}, "extra": extra}, path)
    opened = open_checkpoint(detect_checkpoint(path), "model", weights_only=True)
    try:
        loaded = materialize(opened.entries["extra"])
    finally:
        opened.close()
    assert type(loaded) is OrderedDict
    assert list(loaded) == ["b", "a", "plain"]
    assert type(loaded["a"]) is OrderedDict
    assert type(loaded["plain"]) is dict
    assert torch.equal(loaded["b"], torch.ones(2))


def test_containers_nested_beyond_any_checkpoint_are_refused(tmp_path):
    path = tmp_path / "deep.ckpt"
    deep: list = []
    for _ in range(2000):
        deep = [deep]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # only to write the file: torch's pickler recurses
    try:
        torch.save({"model": {"w": torch.ones(1)}, "deep": deep}, path)
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(CheckpointLoadError, match=r"nested more than 100 levels deep"):
        open_checkpoint(detect_checkpoint(path), "model", weights_only=True)


def _safetensors_of_empty_tensors(path: Path, count: int) -> Path:
    """A safetensors file whose header lists ``count`` empty tensors (about 60 bytes each), written quickly."""
    entries = (f'"t.{index}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}' for index in range(count))
    header = ("{" + ",".join(entries) + "}").encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def test_a_safetensors_header_with_more_tensors_than_the_limit_is_refused_before_it_is_parsed(tmp_path):
    path = _safetensors_of_empty_tensors(tmp_path / "many.safetensors", MAX_TENSORS + 1)
    start = time.monotonic()
    with pytest.raises(CheckpointLoadError, match=rf"describes {MAX_TENSORS + 1} tensors, more than .* {MAX_TENSORS}"):
        read_safetensors_locations(path)
    assert time.monotonic() - start < 10  # checking each of them took minutes and gigabytes on every rank
    assert len(read_safetensors_locations(_safetensors_of_empty_tensors(tmp_path / "few.safetensors", 10))) == 10


def test_a_safetensors_header_larger_than_the_library_allows_is_refused_unread(tmp_path):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{")
        file.truncate(8 + MAX_HEADER_BYTES + 1)  # sparse: no disk space, and nothing of it is read
    with pytest.raises(CheckpointLoadError, match=rf"header is {MAX_HEADER_BYTES + 1} bytes, more than the limit"):
        read_safetensors_locations(path)


def test_a_repeated_name_in_a_safetensors_header_is_still_refused(tmp_path):
    entry = '"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'
    header = ("{" + entry + "," + entry.replace("[0,1]", "[1,2]") + "}").encode()
    path = tmp_path / "twice.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(CheckpointLoadError, match=r"the name 'w' appears twice"):
        read_safetensors_locations(path)


def test_an_index_larger_than_the_limit_is_refused_unread(tmp_path):
    path = tmp_path / "model.safetensors.index.json"
    with open(path, "wb") as file:
        file.write(b'{"weight_map": {')
        file.truncate(MAX_INDEX_BYTES + 1)
    start = time.monotonic()
    with pytest.raises(CheckpointLoadError, match=rf"holds {MAX_INDEX_BYTES + 1} bytes, more than the limit"):
        detect_checkpoint(tmp_path)
    assert time.monotonic() - start < 10


def test_an_index_naming_more_tensors_than_the_limit_is_refused(tmp_path):
    path = tmp_path / "model.safetensors.index.json"
    entries = ",".join(f'"layers.{index}.w":"model-{index % 100:05d}.safetensors"' for index in range(MAX_TENSORS + 1))
    path.write_text('{"weight_map":{' + entries + "}}")
    start = time.monotonic()
    with pytest.raises(CheckpointLoadError, match=rf"names up to {MAX_TENSORS + 1} tensors, more than the limit"):
        detect_checkpoint(path)
    assert time.monotonic() - start < 20  # 88 s and 1.8 GiB per rank before


def test_an_index_is_read_once_per_load(tmp_path, monkeypatch):
    state_dict = {"a": torch.ones(2), "b": torch.zeros(3)}
    index = write_checkpoint(state_dict, tmp_path / "hf", "hf-index-safetensors")
    reads = []
    original = formats.read_index
    monkeypatch.setattr(formats, "read_index", lambda path: reads.append(path) or original(path))
    opened = open_checkpoint(detect_checkpoint(index), None, weights_only=True)
    try:
        assert torch.equal(opened.source.read("b"), torch.zeros(3))
    finally:
        opened.close()
    assert len(reads) == 1  # detection and opening read it once between them


#: An escape sequence that retitles the terminal and clears it, a carriage return, and a Unicode line separator.
_TERMINAL_ATTACK = "\x1b]0;PWNED\x07\x1b[2J\r\u2028"


def assert_no_control_characters(message: str) -> None:
    raw = [char for char in message if not char.isprintable()]
    assert not raw, f"raw control characters {raw!r} in {message!r}"


def write_pickle_with_crafted_global(path: Path) -> Path:
    """A `torch.save` zip file whose pickle names a global that carries terminal escape sequences."""
    torch.save({"w": torch.ones(2)}, path)
    crafted = b"\x80\x02c" + f"os{_TERMINAL_ATTACK}".encode() + b"\nsystem\n(S'true'\ntR."
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in records:
            archive.writestr(name, crafted if name.endswith("/data.pkl") else data)
    return path


def write_index_with_crafted_shard_names(directory: Path) -> Path:
    """A Hugging Face index whose (missing) shard names carry a newline that would forge a log line, and escapes."""
    directory.mkdir()
    weight_map = {"w": "a.safetensors\nERROR forged log line", "v": f"b{_TERMINAL_ATTACK}.safetensors"}
    path = directory / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_a_global_name_with_terminal_escapes_is_quoted_escaped(tmp_path):
    path = write_pickle_with_crafted_global(tmp_path / "evil.pth")
    with pytest.raises(CheckpointLoadError, match="Refused to unpickle") as refused:
        open_checkpoint(detect_checkpoint(path), None, weights_only=True)
    assert_no_control_characters(str(refused.value))
    assert r"os\x1b]0;PWNED\x07\x1b[2J\r\u2028.system" in str(refused.value)


def test_shard_names_with_a_newline_are_quoted_escaped(tmp_path):
    path = write_index_with_crafted_shard_names(tmp_path / "hf")
    with pytest.raises(CheckpointLoadError, match="shard file") as refused:
        detect_checkpoint(path)
    assert_no_control_characters(str(refused.value))
    assert r"'a.safetensors\nERROR forged log line'" in str(refused.value)


def test_a_directory_listing_in_an_error_is_quoted_escaped(tmp_path):
    (tmp_path / "notes\x1b[2J.txt").write_text("")
    with pytest.raises(CheckpointLoadError, match="holds no checkpoint") as refused:
        detect_checkpoint(tmp_path)
    assert_no_control_characters(str(refused.value))


def test_a_global_name_with_terminal_escapes_in_sharded_metadata_is_quoted_escaped(tmp_path):
    from lightning_fsdp.loading.sharded_metadata import read_dcp_metadata

    (tmp_path / ".metadata").write_bytes(b"\x80\x02c" + f"os{_TERMINAL_ATTACK}".encode() + b"\nsystem\n(S'true'\ntR.")
    with pytest.raises(CheckpointLoadError, match="Refused to unpickle") as refused:
        read_dcp_metadata(tmp_path)
    assert_no_control_characters(str(refused.value))
