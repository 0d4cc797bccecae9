"""Hostile and broken sharded checkpoints through `fabric.load` on several ranks: one short error on every rank, fast,
no code from the checkpoint run, the model and the optimizer untouched. The same cases with FSDP1 (`FSDPStrategy`) and
FSDP2 (`ModelParallelStrategy`, whose model state is `DTensor` objects): both go through the same validated reader."""

import re
import time
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.loading.errors import CheckpointLoadError
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

_DEVICES = 2


def _payload_in_metadata(path: Path) -> None:
    metadata = read_metadata(path)
    metadata.version = MarkerPayload(path.parent / f"{path.name}.marker")
    write_metadata(path, metadata)


_METADATA_REFUSED = r"Refused to unpickle `io\.open` from the sharded checkpoint's metadata file .*payload was not run"

#: name -> (tamper with a copy of the checkpoint, the error expected, how to load: "load", "load_raw", or
#: "weights_only=True" for `fabric.load(..., weights_only=True)`)
_CASES = {
    "code in .metadata": (_payload_in_metadata, _METADATA_REFUSED, "load"),
    "code in .metadata, weights_only=True": (_payload_in_metadata, _METADATA_REFUSED, "weights_only=True"),
    "code in .metadata, load_raw": (_payload_in_metadata, _METADATA_REFUSED, "load_raw"),
    "code in a non-tensor entry": (
        lambda p: replace_entry(p, "optimizer.param_groups.0.lr", MarkerPayload(p.parent / f"{p.name}.marker")),
        r"Reading the optimizer state 'optimizer' .* failed on rank\(s\) 0, 1: Refused to unpickle `io\.open` from"
        r" the entry 'optimizer\.param_groups\.0\.lr' .*payload was not run",
        "load",
    ),
    "optimizer state of other parameters": (
        lambda p: replace_entry(p, "optimizer.param_groups.0.params", ["head.weight"]),
        r"The optimizer state 'optimizer' of the sharded checkpoint .* belongs to other parameters: its parameter"
        r" groups hold 1 parameter\(s\) in 1 group\(s\), the optimizer's 17 in 1.*\. Nothing was loaded\.",
        "load",
    ),
    "code where a tensor belongs": (
        lambda p: replace_entry(p, "model.blocks.1.fc_in.weight", MarkerPayload(p.parent / f"{p.name}.marker")),
        r"does not match the model; nothing was loaded.*'model\.blocks\.1\.fc_in\.weight': checkpoint holds a"
        r" non-tensor object, model a tensor of shape \(48, 16\)",
        "load",
    ),
    "code in meta.pt": (
        lambda p: torch.save({"step": MarkerPayload(p.parent / f"{p.name}.marker")}, p / "meta.pt"),
        r"The metadata file '.*meta\.pt' of the sharded checkpoint could not be read: Weights only load failed.*"
        r" If you trust the file, load it with `weights_only=False`\.",
        "load",
    ),
    "int where a tensor belongs": (
        lambda p: replace_entry(p, "model.blocks.1.fc_in.weight", 7),
        r"does not match the model; nothing was loaded.*'model\.blocks\.1\.fc_in\.weight': checkpoint holds a"
        r" non-tensor object, model a tensor of shape \(48, 16\)",
        "load",
    ),
    "tensor of another shape": (
        lambda p: replace_entry(p, "model.head.weight", torch.zeros(16, 37)),
        r"'model\.head\.weight': checkpoint shape \(16, 37\), model \(37, 16\)",
        "load",
    ),
    "FIFO shard": (
        lambda p: replace_with_fifo(p / "__1_0.distcp"),
        r"__1_0\.distcp' is not a regular file but a FIFO",
        "load",
    ),
    "truncated shard": (lambda p: truncate_shard(p, "__0_0.distcp"), r"__0_0\.distcp' .* is truncated", "load"),
    "unreadable tensor": (
        lambda p: corrupt_entry(p, "model.blocks.2.fc_out.weight"),
        r"Reading the model from .* failed on rank\(s\) 0: Unsupported operand 0\. An entry is corrupt",
        "load",
    ),
}


def _fully_shard(model: nn.Module, device_mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _strategy(fsdp: str) -> FSDPStrategy | ModelParallelStrategy:
    if fsdp == "fsdp1":
        return FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")
    return ModelParallelStrategy(_fully_shard, data_parallel_size=_DEVICES, tensor_parallel_size=1)


def _load_each(work: str, fsdp: str) -> dict[str, tuple[str, float, bool]]:
    fabric = Fabric(accelerator="cpu", devices=_DEVICES, strategy=_strategy(fsdp))
    fabric.launch()
    fabric.seed_everything(1)
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    fabric.backward(model(torch.zeros(1, 2, dtype=torch.long)).sum())
    optimizer.step()
    saved = Path(work) / "saved"
    fabric.save(saved, {"model": model, "optimizer": optimizer})

    fabric.backward(model(torch.ones(1, 2, dtype=torch.long)).sum())
    optimizer.step()  # the model now differs from the checkpoint: a partial load would show
    before = gather_full_state(model, optimizer)
    if fabric.global_rank == 0:
        for index, (tamper, _, _) in enumerate(_CASES.values()):
            tamper(copy_checkpoint(saved, Path(work) / f"case-{index}"))
    fabric.barrier()

    outcomes = {}
    for index, (case, (_, _, how)) in enumerate(_CASES.items()):
        path = Path(work) / f"case-{index}"
        start = time.monotonic()
        try:
            if how == "load_raw":
                fabric.load_raw(path, model)
            else:
                weights_only = True if how == "weights_only=True" else None
                fabric.load(path, {"model": model, "optimizer": optimizer}, weights_only=weights_only)
        except CheckpointLoadError as error:
            message = str(error)
        else:
            message = "no error"
        outcomes[case] = (message, time.monotonic() - start, Path(f"{path}.marker").exists())
        assert_same_state(gather_full_state(model, optimizer), before)  # nothing was written, on any rank
    return outcomes


@pytest.mark.parametrize("fsdp", ["fsdp1", "fsdp2"])
def test_hostile_sharded_checkpoints_raise_the_same_error_on_every_rank(tmp_path, fsdp):
    per_rank = run_distributed(_load_each, str(tmp_path), fsdp, devices=_DEVICES, timeout=120)
    for case, (_, pattern, _) in _CASES.items():
        messages = {outcomes[case][0] for outcomes in per_rank}
        assert len(messages) == 1, f"{case}: ranks disagree: {messages}"
        message = messages.pop()
        assert re.search(pattern, message, flags=re.DOTALL), f"{case}: {message!r} does not match {pattern!r}"
        assert "Traceback" not in message, case
        assert len(message) < 1500, f"{case}: {len(message)} characters: {message}"
        assert not any(outcomes[case][2] for outcomes in per_rank), f"{case}: the payload ran"
        slowest = max(outcomes[case][1] for outcomes in per_rank)
        assert slowest < 5, f"{case}: took {slowest:.1f}s"
