"""Rank-staggered turns on real processes and real gloo process groups: order, failures, timeouts, memory arithmetic."""

import itertools
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp.loading import turns
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.turns import StaggeredLoad, Turn, resolve_concurrency, validate_concurrency
from tests.tests_fabric.helpers.distributed import run_distributed

_GiB = 1 << 30


def _init_process_group(devices: int, num_nodes: int, timeout: float = 60.0) -> tuple[int, int, int]:
    """Join the group that ``run_distributed`` set up; return ``(global_rank, node_rank, local_rank)``."""
    node_rank, local_rank = int(os.environ["NODE_RANK"]), int(os.environ["LOCAL_RANK"])
    rank = node_rank * devices + local_rank
    dist.init_process_group("gloo", rank=rank, world_size=devices * num_nodes, timeout=timedelta(seconds=timeout))
    return rank, node_rank, local_rank


def _timed_turns(concurrency: int, devices: int, num_nodes: int, duration: float) -> dict:
    _, node_rank, local_rank = _init_process_group(devices, num_nodes)
    load = StaggeredLoad(
        concurrency, node_rank=node_rank, local_rank=local_rank, local_world_size=devices, namespace="test"
    )
    with load, load.turn(source_bytes=1) as turn:
        entered = time.monotonic()
        time.sleep(duration)
        left = time.monotonic()
    return {"node": node_rank, "local": local_rank, "turn": turn, "entered": entered, "left": left}


def _max_inside_at_once(records: list[dict]) -> int:
    events = sorted([(r["entered"], 1) for r in records] + [(r["left"], -1) for r in records])
    inside = most = 0
    for _, change in events:
        inside += change
        most = max(most, inside)
    return most


def test_one_at_a_time_per_node_and_nodes_in_parallel():
    records = run_distributed(_timed_turns, 1, 3, 2, 0.4, devices=3, num_nodes=2, timeout=60)
    for node in (0, 1):
        mine = sorted((r for r in records if r["node"] == node), key=lambda r: r["local"])
        assert [r["turn"] for r in mine] == [Turn(index=i, count=3, concurrency=1) for i in range(3)]
        # In local-rank order, each turn starts after the previous one ended: never two inside at once.
        for before, after in itertools.pairwise(mine):
            assert after["entered"] >= before["left"]
        assert _max_inside_at_once(mine) == 1
    # The nodes do not wait for each other: turns of different nodes run at the same time.
    assert _max_inside_at_once(records) == 2


def test_two_at_a_time_overlap():
    records = run_distributed(_timed_turns, 2, 4, 1, 0.5, devices=4, timeout=60)
    assert [r["turn"].index for r in records] == [0, 0, 1, 1]
    assert {r["turn"].count for r in records} == {2}
    assert _max_inside_at_once(records) == 2
    first, second = records[:2], records[2:]
    assert min(r["entered"] for r in second) >= min(r["left"] for r in first)


def _failing_load(where: str, failing_rank: int, devices: int, num_nodes: int) -> dict:
    rank, node_rank, local_rank = _init_process_group(devices, num_nodes)
    durations = {0: 0.3, 1: 0.3, 2: 1.5, 3: 0.3}  # rank 2 (node 1) is busy in a long turn when the failure happens
    outcome = {"rank": rank, "entered": False, "failed_at": None, "stopped_waiting_at": None}
    try:
        with StaggeredLoad(
            1, node_rank=node_rank, local_rank=local_rank, local_world_size=devices, namespace="test"
        ) as load:
            if where == "before_turn" and rank == failing_rank:
                time.sleep(0.2)
                outcome["failed_at"] = time.monotonic()
                raise ValueError(f"boom on rank {rank}, before its turn")
            try:
                with load.turn(source_bytes=1):
                    outcome["entered"] = True
                    if where == "in_turn" and rank == failing_rank:
                        time.sleep(0.2)
                        outcome["failed_at"] = time.monotonic()
                        raise ValueError(f"boom on rank {rank}, in its turn")
                    time.sleep(durations[rank])
            except CheckpointLoadError:
                outcome["stopped_waiting_at"] = time.monotonic()
                raise
    except CheckpointLoadError as error:
        outcome.update(
            raised_at=time.monotonic(),
            message=str(error),
            failed_ranks=error.failed_ranks,
            cause=type(error.__cause__).__name__ if error.__cause__ else None,
        )
    else:
        outcome["raised_at"] = None
    return outcome


@pytest.mark.parametrize(("where", "failing_rank"), [("in_turn", 1), ("before_turn", 3)])
def test_a_failing_rank_makes_every_rank_raise_promptly(where, failing_rank):
    outcomes = run_distributed(_failing_load, where, failing_rank, 2, 2, devices=2, num_nodes=2, timeout=60)
    failed_at = outcomes[failing_rank]["failed_at"]
    assert failed_at is not None
    # Every rank raises, the same error, naming the failing rank and what happened there.
    assert all(o["raised_at"] is not None for o in outcomes)
    messages = {o["message"].split("\n(This rank")[0] for o in outcomes}
    assert len(messages) == 1
    (message,) = messages
    assert message.startswith(f"Loading the checkpoint failed on rank {failing_rank}: ValueError: boom on rank")
    assert {o["failed_ranks"] for o in outcomes} == {(failing_rank,)}
    # The failing rank keeps the original exception as the cause; the others report it without a traceback of theirs.
    assert outcomes[failing_rank]["cause"] == "ValueError"
    assert all(o["cause"] is None for o in outcomes if o["rank"] != failing_rank)
    # Promptly: the ranks waiting for a turn stop at once; the slowest waits for the turn that was running (1.5 s).
    waiting = [o for o in outcomes if o["stopped_waiting_at"] is not None]
    assert waiting
    assert all(not o["entered"] for o in waiting)
    assert max(o["stopped_waiting_at"] for o in waiting) - failed_at < 3.0
    assert max(o["raised_at"] for o in outcomes) - failed_at < 6.0


def _slow_turns_under_short_timeout(checkpoint_dir: str) -> dict:
    from lightning.fabric import Fabric

    from lightning_fsdp import FSDPStrategy

    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(timeout=timedelta(seconds=3)))
    fabric.launch()
    started = time.monotonic()
    load = StaggeredLoad(
        1, node_rank=fabric.node_rank, local_rank=fabric.local_rank, local_world_size=2, namespace="test"
    )
    with load, load.turn(source_bytes=1):
        time.sleep(4.0)  # longer than the process-group timeout: rank 1 waits this long for its turn, rank 0 as long
        # for the agreement at the end
    elapsed = time.monotonic() - started
    # The process group is healthy afterwards.
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum")
    # And the timeout is real: a rank that waits as long in a collective times out.
    timed_out = False
    if fabric.global_rank == 1:
        time.sleep(3.5)
    try:
        dist.barrier()
    except RuntimeError:
        timed_out = True
    return {"elapsed": elapsed, "total": total.item(), "timed_out": timed_out}


def test_slow_turns_do_not_trip_a_short_process_group_timeout(tmp_path):
    results = run_distributed(_slow_turns_under_short_timeout, str(tmp_path), devices=2, timeout=60)
    assert all(r["elapsed"] >= 7.5 for r in results)  # two turns of 4 s, one after the other
    assert [r["total"] for r in results] == [3.0, 3.0]
    assert results[0]["timed_out"]


def _repeated_loads(devices: int) -> list:
    rank, node_rank, local_rank = _init_process_group(devices, 1)
    outcomes = []
    for index, (concurrency, failing_rank) in enumerate([(1, None), (2, 1), (1, None), (2, None)]):
        order = []
        try:
            with StaggeredLoad(
                concurrency,
                node_rank=node_rank,
                local_rank=local_rank,
                local_world_size=devices,
                namespace=f"load{index}",
            ) as load:
                for phase in range(2):
                    with load.turn() as turn:
                        order.append((phase, turn.index, turn.count))
                        if rank == failing_rank:
                            raise ValueError(f"load {index} fails")
                    load.agree_on_success()
        except CheckpointLoadError as error:
            outcomes.append(("failed", error.failed_ranks, str(error)))
        else:
            outcomes.append(("ok", order))
    return outcomes


def test_repeated_loads_do_not_collide():
    outcomes = run_distributed(_repeated_loads, 2, devices=2, timeout=60)
    for rank, per_rank in enumerate(outcomes):
        assert per_rank[0] == ("ok", [(0, rank, 2), (1, rank, 2)])
        assert per_rank[1] == ("failed", (1,), "Loading the checkpoint failed on rank 1: ValueError: load 1 fails")
        # The failure of the previous load does not leak into the next ones.
        assert per_rank[2] == ("ok", [(0, rank, 2), (1, rank, 2)])
        assert per_rank[3] == ("ok", [(0, 0, 1), (1, 0, 1)])


def _auto_concurrency_is_decided_per_node(devices: int) -> int:
    _, node_rank, local_rank = _init_process_group(devices, 1)
    # Each rank would see a different amount of free memory: room for 1 copy on local rank 0, 2 on local rank 1.
    turns.available_memory = lambda: int((local_rank + 1) * 10 * _GiB / turns._AUTO_MEMORY_FRACTION)
    load = StaggeredLoad("auto", node_rank=node_rank, local_rank=local_rank, local_world_size=devices, namespace="test")
    with load, load.turn(source_bytes=10 * _GiB) as turn:
        pass
    return turn.concurrency


def test_auto_concurrency_is_decided_by_local_rank_zero():
    assert run_distributed(_auto_concurrency_is_decided_per_node, 2, devices=2, timeout=60) == [1, 1]


def test_single_process_runs_the_body_and_propagates_errors():
    with StaggeredLoad(1, node_rank=0, local_rank=0, local_world_size=1) as load:
        assert not load.distributed
        with load.turn(source_bytes=_GiB) as turn:
            assert turn == Turn(index=0, count=1, concurrency=1)
        load.agree_on_success()
    with pytest.raises(ValueError, match="original"), StaggeredLoad(2, node_rank=0, local_rank=0, local_world_size=1):
        raise ValueError("original")


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "fast", None])
def test_invalid_concurrency(value):
    with pytest.raises(ValueError, match=r"`FSDPStrategy\(load_concurrency=.*\)` is not supported"):
        validate_concurrency(value)
    with pytest.raises(ValueError, match="load_concurrency"):
        StaggeredLoad(value, node_rank=0, local_rank=0, local_world_size=1)


def test_invalid_local_rank():
    with pytest.raises(ValueError, match="local rank must be"):
        StaggeredLoad(1, node_rank=0, local_rank=2, local_world_size=2)


def test_resolve_integer_concurrency():
    assert validate_concurrency("auto") == "auto"
    assert resolve_concurrency(1, 10 * _GiB, 8) == 1
    assert resolve_concurrency(3, 10 * _GiB, 8) == 3
    assert resolve_concurrency(16, 10 * _GiB, 8) == 8


def test_resolve_auto_concurrency(monkeypatch):
    monkeypatch.setattr(turns, "available_memory", lambda: 100 * _GiB)
    # 80% of the available memory: 80 GiB hold four copies of a 20 GiB source.
    assert resolve_concurrency("auto", 20 * _GiB, 8) == 4
    assert resolve_concurrency("auto", 20 * _GiB, 2) == 2
    assert resolve_concurrency("auto", 200 * _GiB, 8) == 1
    assert resolve_concurrency("auto", 0, 8) == 8
    monkeypatch.setattr(turns, "available_memory", lambda: None)
    assert resolve_concurrency("auto", 1, 8) == 1
