"""How often one `fabric.load` makes the ranks wait for each other: the path broadcast and three agreements, no more.

Collectives are counted by wrapping `torch.distributed`'s functions (the real ones run), and agreements by wrapping
`Agreement.agree`. Fabric's own barrier after the load is counted apart: it is Fabric's, not the strategy's.
"""

import functools

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.loading.agreement import Agreement
from tests.tests_fabric.helpers.checkpoints import write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer

_COLLECTIVES = (
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "gather_object",
    "scatter_object_list",
)


def _count_synchronisations(path: str, state_keys: tuple[str, ...]) -> dict[str, int]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    state = {key: state[key] for key in state_keys}
    counts: dict[str, int] = {}

    def counted(name, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return function(*args, **kwargs)

        return wrapper

    originals = {name: getattr(dist, name) for name in _COLLECTIVES}
    agree = Agreement.agree
    fabric.barrier()
    for name, function in originals.items():
        setattr(dist, name, counted(name, function))
    Agreement.agree = counted("agreement", agree)
    try:
        fabric.load(path, state)
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        Agreement.agree = agree
    return counts


@pytest.mark.parametrize(
    ("fmt", "state_keys"),
    [("torch-zip", ("model",)), ("safetensors", ("model",)), ("fabric-full", ("model", "optimizer", "step"))],
)
def test_one_load_is_the_path_broadcast_and_three_agreements(tmp_path, fmt, state_keys):
    torch.manual_seed(0)
    model = TinyTransformer()
    if fmt == "fabric-full":
        optimizer = torch.optim.Adam(model.parameters())
        names = [name for name, _ in model.named_parameters()]
        saved = optimizer.state_dict()
        groups = [{**group, "params": [names[i] for i in group["params"]]} for group in saved["param_groups"]]
        path = tmp_path / "full.ckpt"
        torch.save({"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": groups}, "step": 3}, path)
    else:
        path = write_checkpoint(model.state_dict(), tmp_path, fmt)
    for counts in run_distributed(_count_synchronisations, str(path), state_keys, devices=2, timeout=120):
        # Fabric's own barrier after the load is not the strategy's.
        # Agreements: shard-local on every rank or on none; validated before any write; copied.
        assert counts == {"broadcast_object_list": 1, "agreement": 3, "barrier": 1}, counts


def _load_with_one_rank_unable(path: str) -> list[str]:
    import warnings

    from lightning_fsdp.loading import loader
    from lightning_fsdp.loading.shard_local import ShardLocalUnsupported

    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    if fabric.global_rank == 1:

        def unsupported(module):
            raise ShardLocalUnsupported("a layout that only rank 1 has")

        loader.collect_targets = unsupported
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load_raw(path, model)
    expected = torch.load(path, weights_only=True)
    with FullyShardedDataParallel.summon_full_params(model):
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, expected[name.removeprefix("_forward_module.")]), name
    return [str(warning.message) for warning in caught if "shard-locally" in str(warning.message)]


def test_one_rank_that_cannot_load_shard_locally_takes_every_rank_to_fsdps_path(tmp_path):
    """Otherwise the other ranks would copy their slices and wait while that rank waits in FSDP's collectives."""
    torch.manual_seed(0)
    path = write_checkpoint(TinyTransformer().state_dict(), tmp_path, "torch-zip")
    warned = run_distributed(_load_with_one_rank_unable, str(path), devices=2, timeout=120)
    assert any("another rank cannot load its part" in message for message in warned[0]), warned
