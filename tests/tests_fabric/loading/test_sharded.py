"""Reading a sharded (DCP) checkpoint safely: no code from its pickles, only regular files, nothing written on error."""

import collections
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric import Fabric
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.sharded import load_sharded_checkpoint
from lightning_fsdp.loading.sharded_metadata import (
    check_sharded_request,
    check_storage_files,
    read_dcp_metadata,
    read_sharded_metadata,
    stored_entries,
)
from lightning_fsdp.loading.sharded_readers import CheckedFileSystemReader
from tests.tests_fabric.helpers.checkpoints import MarkerPayload
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.hostile_dcp import (
    copy_checkpoint,
    corrupt_entry,
    read_metadata,
    replace_entry,
    replace_with_fifo,
    truncate_shard,
    write_metadata,
)
from tests.tests_fabric.helpers.models import Block, TinyTransformer
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state


def _setup(fabric: Fabric, seed: int) -> tuple:
    fabric.seed_everything(seed)
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    fabric.backward(model(torch.zeros(1, 2, dtype=torch.long)).sum())  # a step, so that the optimizer has state
    optimizer.step()
    return model, optimizer


def _save(path: str) -> None:
    strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model, optimizer = _setup(fabric, seed=1)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    expected = gather_full_state(model, optimizer)
    if fabric.global_rank == 0:
        torch.save(expected, f"{path}.expected")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A sharded checkpoint as `fabric.save` writes it from 2 ranks (sharded tensors), with Adam's state."""
    path = tmp_path_factory.mktemp("sharded") / "checkpoint"
    run_distributed(_save, str(path), devices=2)
    return path


@pytest.fixture
def checkpoint(saved, tmp_path) -> Path:
    return copy_checkpoint(saved, tmp_path / "checkpoint")


def test_reads_the_metadata_that_fabric_writes(checkpoint):
    metadata = read_dcp_metadata(checkpoint)
    assert metadata == read_metadata(checkpoint)
    assert any(len(getattr(entry, "chunks", ())) == 2 for entry in metadata.state_dict_metadata.values())
    assert "optimizer.param_groups.0.lr" in metadata.state_dict_metadata  # a non-tensor entry
    assert stored_entries(checkpoint) == {"model", "optimizer"}
    check_storage_files(checkpoint, metadata)
    assert check_sharded_request(checkpoint, "model", ["optimizer"], ["step"], strict=True, weights_only=True) == (
        {"step": 3},
        {"model", "optimizer"},
    )


def test_metadata_payload_is_not_run(checkpoint, tmp_path):
    marker = tmp_path / "marker"
    metadata = read_metadata(checkpoint)
    metadata.version = MarkerPayload(marker)
    write_metadata(checkpoint, metadata)
    for read in (
        lambda: read_dcp_metadata(checkpoint),
        lambda: stored_entries(checkpoint),
        lambda: check_sharded_request(checkpoint, "model", [], [], strict=True, weights_only=True),
    ):
        with pytest.raises(CheckpointLoadError, match=r"Refused to unpickle `io\.open`.*payload was not run"):
            read()
        assert not marker.exists()
    read_metadata(checkpoint)  # what torch's reader does: the payload runs
    assert marker.exists()


def test_metadata_with_other_types_needs_weights_only_false(checkpoint):
    metadata = read_metadata(checkpoint)
    metadata.version = collections.Counter(a=1)  # harmless, but not a type of torch's checkpoint metadata
    write_metadata(checkpoint, metadata)
    with pytest.raises(CheckpointLoadError, match=r"`collections\.Counter`.*`weights_only=False`"):
        read_dcp_metadata(checkpoint)
    assert read_dcp_metadata(checkpoint, weights_only=False).version == {"a": 1}


def _first_shard_record(metadata):
    return next(info for index, info in metadata.storage_data.items() if index.fqn.startswith("model."))


def _grow_first_chunk(metadata):
    entry = metadata.state_dict_metadata["model.head.weight"]
    entry.chunks[0].sizes = torch.Size([size + 1 for size in entry.chunks[0].sizes])


@pytest.mark.parametrize(
    ("tamper", "pattern"),
    [
        (lambda m: setattr(_first_shard_record(m), "relative_path", "../other.distcp"), r"outside the checkpoint"),
        (lambda m: setattr(_first_shard_record(m), "offset", -1), r"has offset -1"),
        (_grow_first_chunk, r"'model\.head\.weight'.*outside"),
        (lambda m: m.storage_data.pop(next(iter(m.storage_data))), r"has no storage record"),
        (lambda m: m.planner_data.update({"model.scale": ("model", "other")}), r"'model\.scale' has the path"),
        (lambda m: m.state_dict_metadata.update({"model.scale": 3}), r"'model\.scale' is a int"),
    ],
    ids=["path outside", "negative offset", "chunk outside tensor", "no storage record", "planner path", "entry type"],
)
def test_inconsistent_metadata_is_refused(checkpoint, tamper, pattern):
    metadata = read_metadata(checkpoint)
    tamper(metadata)
    write_metadata(checkpoint, metadata)
    with pytest.raises(CheckpointLoadError, match=rf"is not valid: .*{pattern}"):
        read_dcp_metadata(checkpoint)


def test_metadata_that_is_not_metadata_is_refused(checkpoint):
    write_metadata(checkpoint, {"model.scale": 1})
    with pytest.raises(CheckpointLoadError, match=r"is not valid: it holds a dict, not torch's checkpoint `Metadata`"):
        read_dcp_metadata(checkpoint)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [".metadata", "__1_0.distcp", "meta.pt"])
def test_fifo_is_refused_before_it_is_opened(checkpoint, name):
    replace_with_fifo(checkpoint / name)
    start = time.monotonic()
    with pytest.raises(CheckpointLoadError, match=r"is not a regular file but a FIFO"):
        check_sharded_request(checkpoint, "model", [], [], strict=True, weights_only=True)
    assert time.monotonic() - start < 5


def test_missing_or_truncated_shard_is_refused(checkpoint):
    truncate_shard(checkpoint, "__1_0.distcp")
    with pytest.raises(
        CheckpointLoadError, match=r"__1_0\.distcp' of the sharded checkpoint is truncated: .* up to byte"
    ):
        check_storage_files(checkpoint, read_dcp_metadata(checkpoint))
    (checkpoint / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointLoadError, match=r"__1_0\.distcp' does not exist"):
        check_sharded_request(checkpoint, "model", [], [], strict=True, weights_only=True)


def test_meta_pt_runs_no_code(checkpoint, tmp_path):
    marker = tmp_path / "marker"
    torch.save({"step": MarkerPayload(marker)}, checkpoint / "meta.pt")
    with pytest.raises(
        CheckpointLoadError, match=r"meta\.pt' of the sharded checkpoint could not be read.*weights_only"
    ):
        read_sharded_metadata(checkpoint, weights_only=True)
    assert not marker.exists()


def test_byte_entries_are_unpickled_weights_only(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "dcp"
    groups = {"lr": 0.5, "betas": (0.9, 0.99), "params": ["a.weight"]}
    dcp.save({"groups": groups, "blob": MarkerPayload(marker), "t": torch.ones(2)}, checkpoint_id=path, no_dist=True)
    reader = CheckedFileSystemReader(path, read_dcp_metadata(path))
    state = {"groups": {"lr": None, "betas": None, "params": None}, "t": torch.zeros(2)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert state == {"groups": groups, "t": state["t"]}
    assert torch.equal(state["t"], torch.ones(2))

    with pytest.raises(CheckpointException) as caught:
        dcp.load({"blob": None}, storage_reader=reader, no_dist=True)
    (error, _), *_ = caught.value.failures.values()
    assert isinstance(error, CheckpointLoadError)
    assert "Refused to unpickle `io.open` from the entry 'blob'" in str(error)
    assert "payload was not run" in str(error)
    assert not marker.exists()
    dcp.load({"blob": None}, storage_reader=FileSystemReader(path), no_dist=True)  # torch's reader runs it
    assert marker.exists()
    marker.unlink()
    trusted = CheckedFileSystemReader(path, read_dcp_metadata(path, weights_only=False), weights_only=False)
    dcp.load({"blob": None}, storage_reader=trusted, no_dist=True)  # and so does a load that trusts the file
    assert marker.exists()


@pytest.mark.parametrize("change", ["rewritten in place", "replaced by a new file"])
def test_shard_file_changed_while_it_is_read_is_an_error(tmp_path, monkeypatch, change):
    """A save into the same directory while it is loaded: what was read may mix two versions, so the load fails."""
    path = tmp_path / "dcp"
    dcp.save({"a": torch.ones(64), "b": torch.full((64,), 2.0)}, checkpoint_id=path, no_dist=True)
    (shard,) = path.glob("*.distcp")
    os.utime(shard, (1, 1))  # saved long ago: a write now changes the modification time, whatever its resolution
    reader = CheckedFileSystemReader(path, read_dcp_metadata(path))
    slice_file = CheckedFileSystemReader._slice_file

    def slice_then_change(self, file, sinfo):
        if change == "rewritten in place":
            with open(shard, "r+b") as rewriting:
                rewriting.seek(sinfo.offset)
                rewriting.write(b"\0" * sinfo.length)
        else:
            replacement = tmp_path / "new.distcp"
            replacement.write_bytes(shard.read_bytes())
            replacement.replace(shard)  # an atomic re-save: the open descriptor still reads the old file
        monkeypatch.setattr(CheckedFileSystemReader, "_slice_file", slice_file)  # once
        return slice_file(self, file, sinfo)

    monkeypatch.setattr(CheckedFileSystemReader, "_slice_file", slice_then_change)
    state = {"a": torch.zeros(64), "b": torch.zeros(64)}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(state, storage_reader=reader, no_dist=True)
    (error, _), *_ = caught.value.failures.values()
    assert isinstance(error, CheckpointLoadError)
    assert f"The file {str(shard)!r} was changed while it was being loaded" in str(error)


def _load_broken_checkpoints(saved: str, work: str) -> dict[str, str]:
    """On one rank: each broken checkpoint raises one short error and leaves the model and optimizer unchanged."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    model, optimizer = _setup(fabric, seed=2)
    before = gather_full_state(model, optimizer)
    marker = Path(work) / "marker"
    cases = {
        "int entry": (lambda p: replace_entry(p, "model.blocks.1.fc_in.weight", 7), r"non-tensor object"),
        "shape": (lambda p: replace_entry(p, "model.head.weight", torch.zeros(3, 3)), r"checkpoint shape \(3, 3\)"),
        "dtype": (
            lambda p: replace_entry(p, "model.embedding.weight", torch.zeros(37, 16, dtype=torch.int64)),
            r"dtype torch\.int64, model torch\.float32 \(cannot be cast\)",
        ),
        "optimizer state shape": (
            lambda p: replace_entry(p, "optimizer.state.head.weight.exp_avg", torch.zeros(2, 2)),
            r"'optimizer\.state\.head\.weight\.exp_avg': checkpoint \(2, 2\), parameter \(37, 16\)",
        ),
        "optimizer state of no parameter": (
            lambda p: replace_entry(p, "optimizer.state.ghost.weight.exp_avg", torch.zeros(2)),
            r"'optimizer\.state\.ghost\.weight\.exp_avg': state of a parameter the model does not have",
        ),
        "bytes payload": (
            lambda p: replace_entry(p, "optimizer.param_groups.0.lr", MarkerPayload(marker)),
            r"Reading the optimizer state 'optimizer' .* failed on rank\(s\) 0: Refused to unpickle `io\.open` from the"
            r" entry 'optimizer\.param_groups\.0\.lr'",
        ),
        "unreadable tensor": (
            lambda p: corrupt_entry(p, "model.blocks.2.fc_out.weight"),
            r"Reading the model from .* failed on rank\(s\) 0: Unsupported operand 0\. An entry is corrupt",
        ),
    }
    messages = {}
    for index, (case, (tamper, pattern)) in enumerate(cases.items()):
        path = copy_checkpoint(Path(saved), Path(work) / f"case-{index}")
        tamper(path)
        with pytest.raises(CheckpointLoadError, match=pattern) as caught:
            fabric.load(path, {"model": model, "optimizer": optimizer})
        messages[case] = str(caught.value)
        assert_same_state(gather_full_state(model, optimizer), before)
    assert not marker.exists()
    assert isinstance(caught.value.__cause__, CheckpointException)  # the last case: chained, not in the message

    # strict=False leaves out a missing key and says so; strict=True refuses, before anything is written.
    path = copy_checkpoint(Path(saved), Path(work) / "partial")
    metadata = read_metadata(path)
    del metadata.state_dict_metadata["model.scale"]
    write_metadata(path, metadata)
    leaving = r"leaving the model's 1 missing tensor\(s\) \('scale'\) as they were, pass `strict=False`"
    with pytest.raises(CheckpointLoadError, match=rf"(?s)1 missing key\(s\).*'scale'.*{leaving}"):
        fabric.load(path, {"model": model})
    assert_same_state(gather_full_state(model, optimizer), before)
    skipped = load_sharded_checkpoint(path, model._forward_module, "model", {}, strict=False)  # as Fabric unwraps it
    assert skipped == "1 missing key(s) left as they were ('scale')"
    expected = torch.load(f"{saved}.expected", weights_only=True)
    for name, tensor in gather_full_state(model)["model"].items():
        assert torch.equal(tensor, (before if name == "scale" else expected)["model"][name]), name

    # The checkpoint itself still loads, bit-exact, and so it does when the caller trusts it.
    model, optimizer = _setup(fabric, seed=3)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(saved, state)
    assert state["step"] == 3
    assert_same_state(gather_full_state(model, optimizer), expected)
    model, optimizer = _setup(fabric, seed=4)
    assert (
        load_sharded_checkpoint(
            Path(saved), model._forward_module, "model", {"optimizer": optimizer.optimizer}, True, weights_only=False
        )
        == ""
    )
    assert_same_state(gather_full_state(model, optimizer), expected)
    return messages


def test_broken_checkpoint_leaves_the_model_unchanged(saved, tmp_path):
    (messages,) = run_distributed(_load_broken_checkpoints, str(saved), str(tmp_path), devices=1)
    for case, message in messages.items():
        assert "Traceback" not in message, case
        assert len(message) < 800, f"{case}: {len(message)} characters"
