"""How often one `fabric.load` makes the ranks wait for each other: the path broadcast and three agreements, no more.

Collectives are counted by wrapping `torch.distributed`'s functions (the real ones run), and agreements by wrapping
`Agreement.agree`. Fabric's own barrier after the load is counted apart: it is Fabric's, not the strategy's.

And what a failed load leaves behind: nothing. A failure injected on one rank at each stage of a load is raised on
every rank at once, and the next load on the same processes works.
"""

import functools
import time

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.distributed.agreement import Agreement
from tests.tests_fabric.helpers.checkpoints import write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer, make_batch
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state

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

    from lightning_fsdp.layouts.targets import ShardLocalUnsupported
    from lightning_fsdp.loading import loader

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


# ---------------------------------------------------------------------------------------------------------------------
# A failure on one rank, at each stage of a load, then a valid load on the same processes

#: ``(stage, the loader's function that fails on rank 1, the error, weights_only)``, in the order of a load.
_STAGES = (
    ("detecting", "detect_checkpoint", OSError("injected while detecting"), True),
    ("collecting targets", "collect_targets", MemoryError("injected while collecting targets"), True),
    ("opening", "open_checkpoint", OSError("injected while opening"), True),
    ("validating", "plan_load", ValueError("injected while validating"), True),
    ("copying", "copy_into_module", OSError("injected while copying"), True),
    ("reading metadata", "materialize", MemoryError("injected while reading metadata"), True),
    ("in a turn", "plan_load", ValueError("injected in a turn"), False),
)


def _fail_at(error: BaseException):
    def fail(*args, **kwargs):
        raise error

    return fail


def _train_step(fabric: Fabric, model, optimizer, step: int) -> None:
    inputs, targets = make_batch(step)
    fabric.backward(torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))
    optimizer.step()
    optimizer.zero_grad()


def _load_and_check(fabric, model, optimizer, path: str, expected: dict, step: int, weights_only: bool) -> None:
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state, weights_only=weights_only)
    assert state["step"] == step
    assert_same_state(gather_full_state(model, optimizer), expected)


def _a_failure_at_each_stage(directory: str) -> list[dict]:
    from lightning_fsdp import loading_calls
    from lightning_fsdp.distributed import agreement
    from lightning_fsdp.loading import loader

    strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full", load_concurrency=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup_module(TinyTransformer())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    checkpoints = []
    for step in (1, 2):
        _train_step(fabric, model, optimizer, step)
        path = f"{directory}/step{step}.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})
        checkpoints.append((path, gather_full_state(model, optimizer), step))

    outcomes = []
    stages = [*_STAGES, ("after the path broadcast", None, MemoryError("injected after the path broadcast"), True)]
    for index, (stage, function, error, weights_only) in enumerate(stages):
        # Inject on rank 1 only; each valid load after a failure reads the checkpoint the model does not hold yet.
        module, name = (loader, function) if function else (loading_calls, "load")
        original = getattr(module, name)
        bounds = agreement._UNRESPONSIVE_AFTER_S, agreement._HEARTBEAT_S
        if function is None:
            # Before the load's agreement: the other rank waits for it until the liveness bound, shortened here.
            agreement._UNRESPONSIVE_AFTER_S, agreement._HEARTBEAT_S = 2.0, 0.25
        if fabric.global_rank == 1:
            setattr(module, name, _fail_at(error))
        started = time.monotonic()
        try:
            fabric.load(checkpoints[index % 2][0], {"model": model, "optimizer": optimizer, "step": 0})
        except Exception as raised:
            outcome = {"stage": stage, "elapsed": time.monotonic() - started, "type": type(raised).__name__}
            outcome["message"] = str(raised)
            outcome["failed_ranks"] = getattr(raised, "failed_ranks", None)
        else:
            outcome = {"stage": stage, "elapsed": time.monotonic() - started, "type": None}
        finally:
            setattr(module, name, original)
            agreement._UNRESPONSIVE_AFTER_S, agreement._HEARTBEAT_S = bounds
        path, expected, step = checkpoints[(index + 1) % 2]
        _load_and_check(fabric, model, optimizer, path, expected, step, weights_only)
        outcome["next_load"] = "ok"
        outcomes.append(outcome)
    return outcomes


def test_after_a_failure_on_one_rank_at_any_stage_the_next_load_works(tmp_path):
    """Every rank raises the failing rank's own error at once, and the next load on the same processes succeeds."""
    per_rank = run_distributed(_a_failure_at_each_stage, str(tmp_path), devices=2, timeout=180)
    stages = [*_STAGES, ("after the path broadcast", None, None, True)]
    for index, (stage, _, error, _) in enumerate(stages):
        outcomes = [per_rank[rank][index] for rank in range(2)]
        assert all(outcome["stage"] == stage and outcome["next_load"] == "ok" for outcome in outcomes), outcomes
        if error is None:
            continue
        # The same error on both ranks, naming rank 1 and the real cause, well within the liveness bound (30 s).
        assert {outcome["type"] for outcome in outcomes} == {"CheckpointLoadError"}, outcomes
        assert {outcome["failed_ranks"] for outcome in outcomes} == {(1,)}, outcomes
        (message,) = {outcome["message"] for outcome in outcomes}
        assert "failed on rank 1: " in message, message
        assert str(error) in message, message
        assert "stopped responding" not in message, message
        assert "did not join" not in message, message
        assert max(outcome["elapsed"] for outcome in outcomes) < 10.0, outcomes
    # A rank that fails between the path broadcast and the load never joins the load: the other names it as absent
    # (not as dead) once the liveness bound has passed, and the next load works all the same.
    failing, waiting = per_rank[1][-1], per_rank[0][-1]
    assert failing["type"] == "MemoryError", failing
    assert waiting["type"] == "CheckpointLoadError", waiting
    assert waiting["failed_ranks"] == (1,), waiting
    assert "failed on rank 1: rank 1 did not join within 2 s" in waiting["message"], waiting
    assert 2.0 <= waiting["elapsed"] < 10.0, waiting
