"""Small crafted files that must cost little and say nothing raw, loaded through `fabric.load` on real ranks."""

import time

import torch
from lightning.fabric import Fabric

from lightning_fsdp import CheckpointLoadError, FSDPStrategy
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer
from tests.tests_fabric.helpers.state import gather_full_state

_DEVICES = 2


def shared_tuples(depth: int) -> tuple:
    """``x0 = ()``, ``x(k+1) = (xk, xk)``: a few bytes per level pickled, ``2**depth`` paths to walk naively."""
    value: tuple = ()
    for _ in range(depth):
        value = (value, value)
    return value


def _load_with_hparams(path: str) -> tuple[float, int, bool, int]:
    fabric = Fabric(accelerator="cpu", devices=_DEVICES, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    start = time.monotonic()
    remainder = fabric.load(path, {"model": model})
    elapsed = time.monotonic() - start
    hparams, shared_levels = remainder["hparams"], 0
    while hparams and hparams[0] is hparams[1]:  # as shared in the remainder as in the file
        hparams, shared_levels = hparams[0], shared_levels + 1
    weights = gather_full_state(model)["model"].values()
    return elapsed, shared_levels, all(torch.equal(t, torch.ones_like(t)) for t in weights), remainder["step"]


def test_shared_references_forty_levels_deep_load_in_linear_time(tmp_path):
    torch.manual_seed(0)
    state_dict = {name: torch.ones_like(tensor) for name, tensor in TinyTransformer().state_dict().items()}
    path = tmp_path / "hparams.ckpt"
    torch.save({"model": state_dict, "step": 1, "hparams": shared_tuples(40)}, path)
    assert path.stat().st_size < 64 * 1024
    outcomes = run_distributed(_load_with_hparams, str(path), devices=_DEVICES, timeout=120)
    for elapsed, shared_levels, loaded, step in outcomes:
        assert (shared_levels, loaded, step) == (40, True, 1)
        assert elapsed < 30  # every rank spun forever before: the walk doubled per level


def _messages_of_failed_loads(paths: list[str]) -> list[str]:
    fabric = Fabric(accelerator="cpu", devices=_DEVICES, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    messages = []
    for path in paths:
        try:
            fabric.load(path, {"model": model})
        except CheckpointLoadError as error:
            messages.append(str(error))
        else:
            messages.append("no error")
    return messages


def test_text_from_the_file_reaches_every_rank_escaped(tmp_path):
    # A global name with terminal escape sequences (torch's refusal quotes it), and shard names with a newline.
    from tests.tests_fabric.loading.test_bounded_parsing import (
        assert_no_control_characters,
        write_index_with_crafted_shard_names,
        write_pickle_with_crafted_global,
    )

    paths = [
        str(write_pickle_with_crafted_global(tmp_path / "evil.pth")),
        str(write_index_with_crafted_shard_names(tmp_path / "hf")),
    ]
    outcomes = run_distributed(_messages_of_failed_loads, paths, devices=_DEVICES, timeout=120)
    for messages in outcomes:
        assert "Refused to unpickle" in messages[0]
        assert "PWNED" in messages[0]
        assert "do not exist" in messages[1]
        assert "forged log line" in messages[1]
        for message in messages:
            assert_no_control_characters(message)
