"""Agreement across ranks: every rank returns or raises the same error, and every wait ends, on every store type.

The agreement logic runs on ranks simulated by threads sharing a store; what needs real processes (a rank killed
outright, the store's host dying, torch's own logging) runs on real processes and gloo process groups, launched here
rather than by ``run_distributed``, which fails a run whose rank does not return.
"""

import itertools
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lightning_fsdp.distributed import agreement
from lightning_fsdp.distributed.agreement import Agreement, poll_until
from lightning_fsdp.loading.errors import (
    CheckpointKeyError,
    CheckpointLoadError,
    CheckpointPathError,
    CheckpointValueError,
)
from lightning_fsdp.loading.progress import LoadProgress
from lightning_fsdp.loading.turns import StaggeredLoad

#: In the tests, a rank whose heartbeat stands still this long is dead (the default is half a minute).
_TEST_UNRESPONSIVE_AFTER_S = 2.0
_TEST_HEARTBEAT_S = 0.25


# ---------------------------------------------------------------------------------------------------------------------
# Ranks simulated by threads


def _in_threads(world_size: int, fn: Callable[[int, dist.Store], Any], make_store: Callable[[], dist.Store]) -> list:
    """Run ``fn(rank, store)`` for each rank in its own thread; return ``("ok", value)`` or ``("raised", error)``."""
    outcomes: list = [None] * world_size

    def run(rank: int) -> None:
        try:
            outcomes[rank] = ("ok", fn(rank, make_store()))
        except BaseException as error:
            outcomes[rank] = ("raised", error)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a simulated rank is still waiting"
    return outcomes


def _hash_store() -> Callable[[], dist.Store]:
    store = dist.HashStore()
    return lambda: store


def _file_store(tmp_path: Path, world_size: int) -> Callable[[], dist.Store]:
    path = str(tmp_path / "store")
    return lambda: dist.FileStore(path, world_size)


@pytest.fixture(params=["hash", "file"])
def make_store(request, tmp_path) -> Callable[[], dist.Store]:
    return _hash_store() if request.param == "hash" else _file_store(tmp_path, 3)


@pytest.fixture
def fast_heartbeats(monkeypatch):
    monkeypatch.setattr(agreement, "_UNRESPONSIVE_AFTER_S", _TEST_UNRESPONSIVE_AFTER_S)
    monkeypatch.setattr(agreement, "_HEARTBEAT_S", _TEST_HEARTBEAT_S)


def test_every_rank_returns_when_none_failed(make_store):
    def rank_fn(rank: int, store: dist.Store) -> int:
        with Agreement(store=store, rank=rank, world_size=3, namespace="test") as agreed:
            assert agreed.distributed
            time.sleep(0.1 * rank)
            agreed.agree()
            agreed.agree()
        return rank

    assert _in_threads(3, rank_fn, make_store) == [("ok", 0), ("ok", 1), ("ok", 2)]


def test_any_rank_tells_every_rank_whether_one_set_the_flag(make_store):
    def rank_fn(rank: int, store: dist.Store) -> tuple[bool, bool, bool]:
        with Agreement(store=store, rank=rank, world_size=3, namespace="test") as agreed:
            time.sleep(0.05 * rank)
            # Each call counts afresh: rank 2 alone, then nobody, then everybody.
            return agreed.any_rank(rank == 2), agreed.any_rank(False), agreed.any_rank(True)

    assert _in_threads(3, rank_fn, make_store) == [("ok", (True, False, True))] * 3


def test_any_rank_with_a_single_process_is_the_flag():
    with Agreement() as agreed:
        assert agreed.any_rank(True) is True
        assert agreed.any_rank(False) is False


def test_a_failure_is_raised_on_every_rank_naming_the_rank(make_store):
    def rank_fn(rank: int, store: dist.Store) -> None:
        with Agreement("Reading 'x.ckpt'", store=store, rank=rank, world_size=3, namespace="test"):
            if rank == 1:
                raise ValueError("no such file")

    outcomes = _in_threads(3, rank_fn, make_store)
    assert all(kind == "raised" for kind, _ in outcomes)
    errors = [error for _, error in outcomes]
    assert all(isinstance(error, CheckpointLoadError) for error in errors)
    assert {str(error) for error in errors} == {"Reading 'x.ckpt' failed on rank 1: ValueError: no such file"}
    assert {error.failed_ranks for error in errors} == {(1,)}
    # The failing rank keeps its own exception as the cause; the others report it without one. An unexpected one (not
    # a `CheckpointLoadError`) is chained too, for its traceback to be printed.
    assert [type(error.cause) for error in errors] == [type(None), ValueError, type(None)]
    assert [type(error.__cause__) for error in errors] == [type(None), ValueError, type(None)]


def test_another_errors_text_reaches_every_rank_escaped(make_store):
    """A library's error may quote the file's text: a terminal's escape sequences, a newline."""

    def rank_fn(rank: int, store: dist.Store) -> None:
        with Agreement("Reading 'x.ckpt'", store=store, rank=rank, world_size=2, namespace="test"):
            if rank == 1:
                raise ValueError("unknown name 'w\x1b]0;PWNED\x07\nforged log line'")

    errors = [error for _, error in _in_threads(2, rank_fn, make_store)]
    assert {str(error) for error in errors} == {
        "Reading 'x.ckpt' failed on rank 1: ValueError: unknown name 'w\\x1b]0;PWNED\\x07\\nforged log line'"
    }
    assert all(char.isprintable() for error in errors for char in str(error))


def test_a_failing_ranks_own_checkpoint_load_error_is_kept_but_not_chained(make_store):
    """Its text is in the agreed error's message: a traceback that printed it again would show the user two errors."""

    def rank_fn(rank: int, store: dist.Store) -> None:
        with Agreement("Reading 'x.ckpt'", store=store, rank=rank, world_size=2, namespace="test"):
            if rank == 1:
                raise CheckpointLoadError("The file 'x.ckpt' is empty.")

    (_, on_rank_0), (_, on_rank_1) = _in_threads(2, rank_fn, make_store)
    assert str(on_rank_1) == "Reading 'x.ckpt' failed on rank 1: The file 'x.ckpt' is empty."
    assert str(on_rank_1.cause) == "The file 'x.ckpt' is empty."
    assert on_rank_1.cause.__traceback__ is not None
    assert on_rank_1.__cause__ is None
    assert on_rank_0.cause is None
    assert "".join(traceback.format_exception(on_rank_1)).count("is empty") == 1


def test_failures_of_several_ranks_are_listed_by_rank(make_store):
    def rank_fn(rank: int, store: dist.Store) -> None:
        with Agreement(store=store, rank=rank, world_size=3, namespace="test"):
            if rank != 1:
                raise KeyError(f"missing on rank {rank}")

    outcomes = _in_threads(3, rank_fn, make_store)
    messages = {str(error) for _, error in outcomes}
    assert messages == {
        "Loading the checkpoint failed on ranks 0, 2:\n"
        "- rank 0: KeyError: 'missing on rank 0'\n"
        "- rank 2: KeyError: 'missing on rank 2'"
    }


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        ({0: CheckpointKeyError, 2: CheckpointKeyError}, CheckpointKeyError),
        ({1: CheckpointValueError}, CheckpointValueError),
        ({0: CheckpointPathError}, CheckpointValueError),
        ({0: CheckpointKeyError, 2: CheckpointValueError}, CheckpointLoadError),
        # an unexpected `KeyError` (a bug) is not reported as a missing key
        ({0: KeyError, 2: ValueError}, CheckpointLoadError),
        ({2: OSError}, CheckpointLoadError),
    ],
)
def test_every_rank_raises_the_upstream_type_that_the_failures_share(make_store, raised, expected):
    """A ``CheckpointKeyError`` on the failing ranks is one on every rank: a ``KeyError``, as upstream's error."""

    def rank_fn(rank: int, store: dist.Store) -> None:
        with Agreement(store=store, rank=rank, world_size=3, namespace="test"):
            if rank in raised:
                raise raised[rank]("failed")

    outcomes = _in_threads(3, rank_fn, make_store)
    assert [type(error) for _, error in outcomes] == [expected] * 3


@pytest.mark.parametrize("late_outcome", ["fails", "succeeds"])
def test_ranks_that_fail_far_apart_name_the_same_ranks(make_store, fast_heartbeats, late_outcome):
    """Rank 1 fails at once; rank 0 is busy for longer than a rank takes to be found dead (but alive: its heartbeat
    moves), then fails or succeeds. Every rank waits for every outcome, and raises the same error."""
    busy_s = 3 * _TEST_UNRESPONSIVE_AFTER_S

    def rank_fn(rank: int, store: dist.Store) -> None:
        with Agreement(store=store, rank=rank, world_size=3, namespace="test"):
            if rank == 1:
                raise ValueError("refused at once")
            if rank == 0:
                time.sleep(busy_s)
                if late_outcome == "fails":
                    raise ValueError("refused after a long parse")

    started = time.monotonic()
    outcomes = _in_threads(3, rank_fn, make_store)
    assert time.monotonic() - started >= busy_s
    messages = {str(error) for _, error in outcomes}
    if late_outcome == "fails":
        assert messages == {
            "Loading the checkpoint failed on ranks 0-1:\n"
            "- rank 0: ValueError: refused after a long parse\n"
            "- rank 1: ValueError: refused at once"
        }
    else:
        assert messages == {"Loading the checkpoint failed on rank 1: ValueError: refused at once"}
    assert {error.failed_ranks for _, error in outcomes} == {(0, 1) if late_outcome == "fails" else (1,)}


def test_a_failure_after_an_agreement_does_not_fail_it_for_a_rank_still_reading_it(make_store):
    """Ranks 1 and 2 pass the first agreement and fail in the work after it before rank 0 has read its outcome."""

    def rank_fn(rank: int, store: dist.Store) -> None:
        with Agreement(store=store, rank=rank, world_size=3, namespace="test") as agreed:
            if rank == 0:
                first_wait = agreed._wait

                def late(*args):
                    time.sleep(0.5)
                    agreed._wait = first_wait
                    return first_wait(*args)

                agreed._wait = late
            agreed.agree()
            raise KeyError(f"after the first agreement on rank {rank}")

    outcomes = _in_threads(3, rank_fn, make_store)
    assert {str(error) for _, error in outcomes} == {
        "Loading the checkpoint failed on ranks 0-2:\n"
        "- rank 0: KeyError: 'after the first agreement on rank 0'\n"
        "- rank 1: KeyError: 'after the first agreement on rank 1'\n"
        "- rank 2: KeyError: 'after the first agreement on rank 2'"
    }


def test_a_waiting_rank_stops_when_another_fails(make_store):
    waits = {}

    def rank_fn(rank: int, store: dist.Store) -> None:
        with Agreement(store=store, rank=rank, world_size=3, namespace="test") as agreed:
            if rank == 2:
                time.sleep(0.3)
                raise ValueError("boom")
            started = time.monotonic()
            try:
                # Nobody ever sets this key: only the failure ends the wait.
                agreed.wait_for(lambda: store.check(["never"]), "the moon")
            except CheckpointLoadError as error:
                waits[rank] = (time.monotonic() - started, str(error))
                raise

    outcomes = _in_threads(3, rank_fn, make_store)
    assert sorted(waits) == [0, 1]
    assert max(waited for waited, _ in waits.values()) < 2.0
    expected = "Loading the checkpoint failed on rank 2: ValueError: boom"
    assert {message for _, message in waits.values()} == {f"{expected}\n(This rank stopped waiting for the moon.)"}
    # Leaving the block, every rank raises the agreed error, without the note.
    assert {str(error) for _, error in outcomes} == {expected}


def test_a_rank_that_never_arrives_is_named_without_calling_it_dead(make_store, fast_heartbeats):
    """It may be alive, having failed before the block: it is named as absent, not as killed."""

    def rank_fn(rank: int, store: dist.Store) -> None:
        if rank == 2:
            return None  # never joins: it died before the load
        with Agreement(store=store, rank=rank, world_size=3, namespace="test"):
            pass
        return None

    started = time.monotonic()
    outcomes = _in_threads(3, rank_fn, make_store)
    elapsed = time.monotonic() - started
    errors = [error for kind, error in outcomes[:2]]
    assert all(isinstance(error, CheckpointLoadError) for error in errors)
    assert {error.failed_ranks for error in errors} == {(2,)}
    (message,) = {str(error) for error in errors}
    assert message.startswith(
        f"Loading the checkpoint failed on rank 2: rank 2 did not join within {_TEST_UNRESPONSIVE_AFTER_S:.0f} s:"
        " it has shown no heartbeat"
    )
    assert "stopped responding" not in message
    assert _TEST_UNRESPONSIVE_AFTER_S <= elapsed < _TEST_UNRESPONSIVE_AFTER_S + 3.0


def test_a_rank_that_fails_before_a_block_does_not_shift_the_next_one(make_store, fast_heartbeats):
    """Rank 1 fails before it enters the first block: the next block, in its own namespace, meets as if nothing was."""

    path_broadcast = threading.Barrier(3)  # the collective that every rank runs before each block

    def rank_fn(rank: int, store: dist.Store) -> list:
        outcomes = []
        for namespace in ("first", "second"):
            path_broadcast.wait()
            try:
                if rank == 1 and namespace == "first":
                    raise MemoryError("before the block")
                with Agreement(store=store, rank=rank, world_size=3, namespace=namespace) as agreed:
                    agreed.agree()
                outcomes.append("ok")
            except (CheckpointLoadError, MemoryError) as error:
                outcomes.append(str(error))
        return outcomes

    outcomes = _in_threads(3, rank_fn, make_store)
    assert outcomes[1] == ("ok", ["before the block", "ok"])
    for rank in (0, 2):
        _, (first, second) = outcomes[rank]
        assert first.startswith("Loading the checkpoint failed on rank 1: rank 1 did not join"), first
        assert second == "ok"


def test_a_block_needs_a_namespace_with_several_ranks():
    with pytest.raises(ValueError, match=r"`Agreement\(namespace=...\)` is required with several ranks"):
        Agreement(store=dist.HashStore(), rank=0, world_size=2).__enter__()


def test_a_rank_has_beaten_once_as_soon_as_it_entered_a_block():
    """A rank killed right after it entered a block is named as having stopped responding, never as not having joined:
    its first heartbeat is written before the block's body runs, not whenever the heartbeat thread first gets to."""
    store = dist.HashStore()
    heartbeat = agreement._Heartbeat(store, "beat")
    try:
        assert int(store.add("beat", 0)) >= 1
    finally:
        heartbeat.stop()


def test_a_live_rank_is_never_declared_dead_however_long_it_works(fast_heartbeats):
    store = dist.HashStore()

    def rank_fn(rank: int, _: dist.Store) -> None:
        with Agreement(store=store, rank=rank, world_size=2, namespace="test"):
            if rank == 1:
                time.sleep(1.5 * _TEST_UNRESPONSIVE_AFTER_S)  # its heartbeat goes on meanwhile

    assert _in_threads(2, rank_fn, lambda: store) == [("ok", None), ("ok", None)]


def test_liveness_counts_heartbeats_on_the_waiters_own_clock(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(agreement.time, "monotonic", lambda: clock[0])
    store = dist.HashStore()
    liveness = agreement._Liveness(store, rank=0, world_size=3)
    assert liveness.unresponsive() == {}  # read at most every heartbeat: nothing is read yet
    clock[0] += 1.0
    assert liveness.unresponsive() == {}  # ranks 1 and 2 have no counter yet: from now on they must beat
    for _ in range(40):
        clock[0] += 1.0
        store.add("1", 1)
        dead = liveness.unresponsive()
        assert 1 not in dead
        if dead:
            break
    # Rank 2 never beat: unresponsive once its counter stood still for longer than the limit, on rank 0's clock.
    assert dead == {2: False}
    assert clock[0] - 1001.0 > agreement._UNRESPONSIVE_AFTER_S


def test_default_detection_fits_in_a_minute():
    # A waiting rank reads the counters every heartbeat, declares a rank dead once its counter stood still for
    # `_UNRESPONSIVE_AFTER_S`, and sees it within a poll interval.
    worst_case = agreement._UNRESPONSIVE_AFTER_S + agreement._HEARTBEAT_S + agreement._POLL_MAX_S
    assert worst_case <= 60.0
    # And slow enough that a busy rank (a long GIL-holding call, swapping) is not declared dead by mistake.
    assert agreement._UNRESPONSIVE_AFTER_S >= 10 * agreement._HEARTBEAT_S


def test_poll_until():
    calls = []
    assert poll_until(lambda: len(calls) >= 3, between=lambda: calls.append(1))
    assert len(calls) == 3
    started = time.monotonic()
    assert not poll_until(lambda: False, timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 1.0


def test_single_process_propagates_errors_unchanged():
    with Agreement() as agreed:
        assert not agreed.distributed
        assert agreed.store is None
        agreed.agree()
    with pytest.raises(ValueError, match="original"), Agreement():
        raise ValueError("original")


def test_invalid_rank():
    with pytest.raises(ValueError, match="rank must be in the world"):
        Agreement(store=dist.HashStore(), rank=3, world_size=3)


# ---------------------------------------------------------------------------------------------------------------------
# Ranks on real processes


def _launch(
    fn: Callable[..., Any], args: tuple, world_size: int, mode: str, tmp_path: Path, timeout: float = 60.0
) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes in one gloo group; return survivors' results.

    ``mode`` says who hosts the store: ``"env"`` rank 0 (``env://`` from plain variables, as under ``srun``),
    ``"agent"`` this process (as torchrun's agent), ``"tcp"`` rank 0 (``tcp://``), ``"file"`` a file (``file://``).
    A rank that died returns nothing; an exception on a rank fails the call. Nothing is killed before ``timeout``.

    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "lightning_fsdp"])
    results = context.SimpleQueue()
    port = find_free_network_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size)}
    host = None
    if mode == "agent":
        host = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False)
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    init_method = {"env": "env://", "agent": "env://", "tcp": f"tcp://127.0.0.1:{port}"}.get(mode)
    if mode == "file":
        init_method = f"file://{tmp_path / 'store'}"
    processes = [
        context.Process(
            target=_entry,
            args=(fn, (rank, world_size, *args), {**env, "RANK": str(rank)}, init_method, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(timeout=max(deadline - time.monotonic(), 0.1))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    outcomes = {}
    while not results.empty():
        rank, ok, value = results.get()
        outcomes[rank] = (ok, value)
    del host
    failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
    assert not hung, f"ranks {hung} still ran after {timeout} s"
    assert not failures, "\n".join(failures)
    return {rank: value for rank, (_, value) in outcomes.items()}


def _entry(fn: Callable[..., Any], args: tuple, env: dict[str, str], init_method: str, results: Any) -> None:
    os.environ.update(env)
    rank, world_size = args[0], args[1]
    try:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        # Every rank is past the group's rendezvous before any of them can die: a rank killed while another still
        # reads the rendezvous keys from its store would fail `init_process_group`, not the code under test.
        dist.barrier()
        value = fn(*args)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    results.put((rank, True, value))


def _die(out_dir: str) -> None:
    Path(out_dir, "died_at").write_text(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)


def _one_rank_dies(rank: int, world_size: int, where: str, victim: int, out_dir: str, fast: bool) -> dict:
    """Turns with ``k=1`` (rank 0 holds the first for a second); ``victim`` is killed ``where`` it is."""
    if fast:
        agreement._UNRESPONSIVE_AFTER_S, agreement._HEARTBEAT_S = _TEST_UNRESPONSIVE_AFTER_S, _TEST_HEARTBEAT_S
    try:
        if where == "agreement":
            with Agreement(namespace="test") as agreed:
                if rank == victim:
                    _die(out_dir)
                agreed.agree()
        else:
            with StaggeredLoad(1, node_rank=0, local_rank=rank, local_world_size=world_size, namespace="test") as load:
                if where == "waiting" and rank == victim:
                    threading.Timer(0.5, _die, (out_dir,)).start()  # while it waits for rank 0 to leave its turn
                with load.turn():
                    if where == "in_turn" and rank == victim:
                        _die(out_dir)
                    time.sleep(1.0 if rank == 0 else 0.1)
    except CheckpointLoadError as error:
        return {"raised_at": time.monotonic(), "message": str(error), "failed_ranks": error.failed_ranks}
    return {"raised_at": None}


def _assert_survivors_name(outcomes: dict, victim: int, world_size: int, out_dir: Path, within: float) -> list:
    died_at = float((out_dir / "died_at").read_text())
    assert sorted(outcomes) == [rank for rank in range(world_size) if rank != victim]
    assert all(outcome["raised_at"] is not None for outcome in outcomes.values()), outcomes
    delays = [outcome["raised_at"] - died_at for outcome in outcomes.values()]
    assert max(delays) < within, delays
    for outcome in outcomes.values():
        assert f"rank {victim}" in outcome["message"]
        assert "(killed? out of memory?)" in outcome["message"] or "killed (out of memory?)" in outcome["message"]
    return delays


@pytest.mark.parametrize("mode", ["env", "agent"])
@pytest.mark.parametrize(
    ("where", "victim"),
    [
        pytest.param("waiting", 2, id="while-waiting-for-its-turn"),
        pytest.param("agreement", 1, id="while-the-others-wait-in-an-agreement"),
        pytest.param("in_turn", 1, id="inside-its-turn"),
    ],
)
def test_a_killed_rank_is_named_on_every_other_rank(where, victim, mode, tmp_path):
    outcomes = _launch(_one_rank_dies, (where, victim, str(tmp_path), True), 3, mode, tmp_path)
    _assert_survivors_name(outcomes, victim, 3, tmp_path, within=_TEST_UNRESPONSIVE_AFTER_S + 4.0)
    for outcome in outcomes.values():
        assert outcome["failed_ranks"] == (victim,)
        assert (
            f"failed on rank {victim}: rank {victim} stopped responding (killed? out of memory?)" in outcome["message"]
        )
    # Every survivor raises the same error (a rank that gave up waiting for its turn adds a note).
    assert len({outcome["message"].split("\n(This rank")[0] for outcome in outcomes.values()}) == 1


def test_a_killed_rank_is_named_with_a_file_store(tmp_path):
    outcomes = _launch(_one_rank_dies, ("in_turn", 1, str(tmp_path), True), 3, "file", tmp_path)
    _assert_survivors_name(outcomes, 1, 3, tmp_path, within=_TEST_UNRESPONSIVE_AFTER_S + 4.0)


def test_the_store_host_killed_is_a_clean_error_at_once(tmp_path):
    # Without a launcher, rank 0 hosts the store: when it dies, the others' next store operation fails.
    outcomes = _launch(_one_rank_dies, ("in_turn", 0, str(tmp_path), False), 3, "env", tmp_path)
    delays = _assert_survivors_name(outcomes, 0, 3, tmp_path, within=5.0)
    assert max(delays) < 2.0, delays
    for outcome in outcomes.values():
        assert "could not reach the process group's store" in outcome["message"]


def _turns_and_a_failure(rank: int, world_size: int) -> list:
    outcomes = []
    for failing_rank in (None, 1):
        entered = []
        try:
            namespace = f"load-{failing_rank}"
            with StaggeredLoad(
                1, node_rank=0, local_rank=rank, local_world_size=world_size, namespace=namespace
            ) as load:
                with load.turn() as turn:
                    entered.append((turn.index, time.monotonic()))
                    time.sleep(0.5)  # longer than the 0.2 s that `FileStore`'s blocking waits used to allow
                    entered.append((turn.index, time.monotonic()))
                    if rank == failing_rank:
                        raise ValueError("boom")
                load.agree_on_success()
        except CheckpointLoadError as error:
            outcomes.append(("failed", error.failed_ranks, str(error), entered))
        else:
            outcomes.append(("ok", entered))
    return outcomes


@pytest.mark.parametrize("mode", ["tcp", "file"])
def test_turns_and_failures_on_every_store_type(mode, tmp_path):
    per_rank = _launch(_turns_and_a_failure, (), 3, mode, tmp_path)
    ok = [per_rank[rank][0] for rank in range(3)]
    assert all(outcome[0] == "ok" for outcome in ok), ok
    intervals = sorted((outcome[1][0][1], outcome[1][1][1]) for outcome in ok)
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(intervals)), "turns overlapped"
    failed = [per_rank[rank][1] for rank in range(3)]
    assert {outcome[:3] for outcome in failed} == {
        ("failed", (1,), "Loading the checkpoint failed on rank 1: ValueError: boom")
    }
    assert failed[2][3] == [], "rank 2 took its turn after rank 1 failed"


def _keys_after_blocks(rank: int, world_size: int) -> dict[int, int]:
    from torch.distributed.distributed_c10d import _get_default_store

    keys_after = {}
    for block in range(4):
        progress = LoadProgress(local_rank=rank, enabled=False)
        ranks = {"node_rank": 0, "local_rank": rank, "local_world_size": world_size}
        with StaggeredLoad(1, **ranks, progress=progress, namespace=f"block{block}") as load:
            progress.set_totals(10, 1)
            load.any_rank(rank == 0)
            with load.turn():
                progress.update(10)
        dist.barrier()  # every rank is between two blocks
        keys_after[block] = _get_default_store().num_keys()
        dist.barrier()
    return keys_after


def test_the_keys_of_finished_loads_are_deleted(tmp_path):
    """The store holds the keys of one load, not of every load so far: they go once every rank is in a later one."""
    keys_after = _launch(_keys_after_blocks, (), 2, "env", tmp_path)[0]
    assert keys_after[1] == keys_after[3], keys_after


def _quiet_wait(rank: int, world_size: int, out_dir: str) -> str:
    path = os.path.join(out_dir, f"stderr{rank}.txt")
    saved = os.dup(2)
    # torch logs from C++: capture the file descriptor, not `sys.stderr`.
    with open(path, "w") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            load = StaggeredLoad(1, node_rank=0, local_rank=rank, local_world_size=world_size, namespace="test")
            with load, load.turn():
                time.sleep(2.5 if rank == 0 else 0.0)  # ranks 1 and 2 wait 2.5 s for their turn
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return Path(path).read_text()


def test_waiting_for_a_turn_prints_nothing(tmp_path):
    outputs = _launch(_quiet_wait, (str(tmp_path),), 3, "env", tmp_path)
    assert outputs == {0: "", 1: "", 2: ""}
