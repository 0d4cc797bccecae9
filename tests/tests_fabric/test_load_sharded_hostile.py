"""Hostile and broken sharded checkpoints through `fabric.load` on several ranks: one short error on every rank, fast,
no code from the checkpoint run, the model and the optimizer untouched."""

import re
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.loading.errors import CheckpointLoadError
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.hostile_dcp import (
    MarkerPayload,
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


_CASES = {
    "code in .metadata": (
        _payload_in_metadata,
        r"Refused to unpickle `io\.open` from the sharded checkpoint's metadata file .*payload was not run",
    ),
    "code in a non-tensor entry": (
        lambda p: replace_entry(p, "optimizer.param_groups.0.lr", MarkerPayload(p.parent / f"{p.name}.marker")),
        r"Reading the optimizer state 'optimizer' .* failed on rank\(s\) 0, 1: Refused to unpickle `io\.open` from"
        r" the entry 'optimizer\.param_groups\.0\.lr' .*payload was not run",
    ),
    "int where a tensor belongs": (
        lambda p: replace_entry(p, "model.blocks.1.fc_in.weight", 7),
        r"does not match the model; nothing was loaded.*'model\.blocks\.1\.fc_in\.weight': checkpoint holds a"
        r" non-tensor object, model a tensor of shape \(48, 16\)",
    ),
    "tensor of another shape": (
        lambda p: replace_entry(p, "model.head.weight", torch.zeros(16, 37)),
        r"'model\.head\.weight': checkpoint shape \(16, 37\), model \(37, 16\)",
    ),
    "FIFO shard": (lambda p: replace_with_fifo(p / "__1_0.distcp"), r"__1_0\.distcp' is not a regular file but a FIFO"),
    "truncated shard": (lambda p: truncate_shard(p, "__0_0.distcp"), r"__0_0\.distcp' .* is truncated"),
    "unreadable tensor": (
        lambda p: corrupt_entry(p, "model.blocks.2.fc_out.weight"),
        r"Reading the model from .* failed on rank\(s\) 0: Unsupported operand 0\. An entry is corrupt",
    ),
}


def _load_each(work: str) -> dict[str, tuple[str, float, bool]]:
    strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")
    fabric = Fabric(accelerator="cpu", devices=_DEVICES, strategy=strategy)
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
        for index, (tamper, _) in enumerate(_CASES.values()):
            tamper(copy_checkpoint(saved, Path(work) / f"case-{index}"))
    fabric.barrier()

    outcomes = {}
    for index, case in enumerate(_CASES):
        path = Path(work) / f"case-{index}"
        start = time.monotonic()
        try:
            fabric.load(path, {"model": model, "optimizer": optimizer})
        except CheckpointLoadError as error:
            outcomes[case] = (str(error), time.monotonic() - start, Path(f"{path}.marker").exists())
        else:
            outcomes[case] = ("no error", 0.0, False)
        assert_same_state(gather_full_state(model, optimizer), before)  # nothing was written, on any rank
    return outcomes


def test_hostile_sharded_checkpoints_raise_the_same_error_on_every_rank(tmp_path):
    per_rank = run_distributed(_load_each, str(tmp_path), devices=_DEVICES, timeout=120)
    for case, (_, pattern) in _CASES.items():
        messages = {outcomes[case][0] for outcomes in per_rank}
        assert len(messages) == 1, f"{case}: ranks disagree: {messages}"
        message = messages.pop()
        assert re.search(pattern, message, flags=re.DOTALL), f"{case}: {message!r} does not match {pattern!r}"
        assert "Traceback" not in message, case
        assert len(message) < 1500, f"{case}: {len(message)} characters: {message}"
        assert not any(outcomes[case][2] for outcomes in per_rank), f"{case}: the payload ran"
        slowest = max(outcomes[case][1] for outcomes in per_rank)
        assert slowest < 5, f"{case}: took {slowest:.1f}s"
