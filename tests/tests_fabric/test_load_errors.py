"""Bad input through `fabric.load` on several ranks: one clear error on every rank, fast, the model untouched."""

import time
from pathlib import Path

import torch
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.loading.errors import CheckpointLoadError
from tests.tests_fabric.helpers.checkpoints import write_bad_inputs, write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state

_DEVICES = 4


def _write_cases(tmp_path: Path) -> dict[str, tuple[str, str]]:
    torch.manual_seed(0)
    state_dict = TinyTransformer().state_dict()
    cases = {name: (str(path), pattern) for name, (path, pattern) in write_bad_inputs(tmp_path, state_dict).items()}
    other = write_checkpoint(TinyTransformer(width=8, depth=4).state_dict(), tmp_path / "other", "torch-zip")
    cases["checkpoint of a different model"] = (
        str(other),
        r"does not match the model; nothing was loaded.*unexpected key.*shape mismatch",
    )
    # A whole DDP-prefixed file is aligned automatically (tests/tests_fabric/test_names.py); a partial one is not.
    partial = {f"module.{k}": v for k, v in state_dict.items() if k != "head.weight"}
    prefixed = write_checkpoint(partial, tmp_path / "ddp", "safetensors")
    cases["names with a DDP prefix, one tensor short"] = (
        str(prefixed),
        r"with `rename=\{'module\.': ''\}` and `strict=False`, 17 of the model's 18 tensors load",
    )
    return cases


def _load_each(cases: dict[str, tuple[str, str]]) -> dict[str, tuple[str, float]]:
    fabric = Fabric(accelerator="cpu", devices=_DEVICES, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    before = gather_full_state(model, optimizer)
    outcomes = {}
    for case, (path, _) in cases.items():
        start = time.monotonic()
        try:
            fabric.load(path, {"model": model})
        except CheckpointLoadError as error:
            outcomes[case] = (str(error), time.monotonic() - start)
        else:
            outcomes[case] = ("no error", 0.0)
        assert_same_state(gather_full_state(model, optimizer), before)  # nothing was written
    return outcomes


def test_bad_input_raises_the_same_clear_error_on_every_rank(tmp_path):
    import re

    cases = _write_cases(tmp_path)
    per_rank = run_distributed(_load_each, cases, devices=_DEVICES, timeout=300)
    for case, (_, pattern) in cases.items():
        messages = {outcomes[case][0] for outcomes in per_rank}
        assert len(messages) == 1, f"{case}: ranks disagree: {messages}"
        message = messages.pop()
        assert re.search(pattern, message, flags=re.DOTALL), f"{case}: {message!r} does not match {pattern!r}"
        assert "Traceback" not in message
        slowest = max(outcomes[case][1] for outcomes in per_rank)
        assert slowest < 20, f"{case}: took {slowest:.1f}s"
