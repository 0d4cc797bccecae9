"""Crafted files whose cost must stay proportional to their size, in one process: walks, headers and indexes."""

import sys
import time

import pytest
import torch

from lightning_fsdp.loading.convert import convert_checkpoint, describe_checkpoint
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.formats import detect_checkpoint, open_checkpoint
from lightning_fsdp.loading.sources import materialize, walk_tensors
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
