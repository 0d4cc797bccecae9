"""Small crafted files that must cost little and say nothing raw, loaded through `fabric.load` on real ranks."""

import time

import torch
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy
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
