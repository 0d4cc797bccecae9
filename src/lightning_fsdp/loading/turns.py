"""Rank-staggered turns: at most ``k`` ranks of a node hold a materialised checkpoint source in memory at a time.

A source that cannot be read lazily (a legacy pickle file, a state dict that has to be transformed) is materialised
whole in host memory. If every rank of a node does that at once, the node holds one copy per rank. The turns here let
at most ``k`` ranks of each node do it at the same time, in the order of their local ranks; nodes proceed in parallel.

The schedule runs on the process group's key-value store, inside an
:class:`~lightning_fsdp.distributed.agreement.Agreement` that it waits through: no collective runs inside or between
turns, so a rank may wait for its turn for hours without tripping the process-group timeout, and a rank that fails or
dies is noticed by the others while they wait.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch.distributed as dist

from lightning_fsdp.distributed.agreement import Agreement
from lightning_fsdp.distributed.memory import available_memory, return_freed_memory
from lightning_fsdp.loading.progress import LoadProgress, NodeSnapshot

#: The keys of a node's progress in the store, besides ``ranks`` (how many ranks have added their totals).
_TOTALS_KEYS = ("bytes", "tensors", "total_bytes", "total_tensors", "fetched")
#: The share of the memory available to the node that ``load_concurrency="auto"`` lets the copies of a source take.
_AUTO_MEMORY_FRACTION = 0.8


def validate_concurrency(concurrency: Any) -> int | Literal["auto"]:
    """Check a ``load_concurrency`` value as the strategy receives it, and return it.

    Raises:
        ValueError: If it is neither a positive integer nor ``"auto"``.

    """
    if isinstance(concurrency, str) and concurrency == "auto":
        return "auto"
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(
            f"`FSDPStrategy(load_concurrency={concurrency!r})` is not supported. Pass a positive integer, the number"
            " of ranks per node that may hold a materialised checkpoint source at the same time (`1`: one rank at a"
            " time), or `'auto'` to derive it from the memory the node has free."
        )
    return concurrency


def resolve_concurrency(concurrency: int | Literal["auto"], source_bytes: int, local_world_size: int) -> int:
    """The number of ranks of a node that may hold a materialised source at the same time.

    Args:
        concurrency: A positive integer, or ``"auto"``: as many copies of the source as fit in
            ``80%`` of the memory available to the node, counted from ``MemAvailable`` in ``/proc/meminfo`` (or
            ``psutil`` where there is no ``/proc``) and bounded by the memory limit of the process's cgroup (v1 or
            v2), if there is one. If the available memory cannot be found, ``"auto"`` means ``1``.
        source_bytes: The size of the source once materialised, in bytes.
        local_world_size: The number of ranks on the node.

    Returns:
        An integer between ``1`` and ``local_world_size``.

    Raises:
        ValueError: If ``concurrency`` is neither a positive integer nor ``"auto"``.

    """
    concurrency = validate_concurrency(concurrency)
    if local_world_size < 1:
        raise ValueError(f"`local_world_size` must be at least 1, got {local_world_size}.")
    if concurrency != "auto":
        return min(concurrency, local_world_size)
    if source_bytes <= 0:
        return local_world_size
    available = available_memory()
    if available is None:
        return 1
    fitting = int(available * _AUTO_MEMORY_FRACTION) // source_bytes
    return max(1, min(local_world_size, fitting))


@dataclass(frozen=True)
class Turn:
    """A rank's place in its node's schedule."""

    index: int
    """The rank's turn on its node, from ``0``: ``local_rank // concurrency``."""
    count: int
    """The number of turns on the node: ``ceil(local_world_size / concurrency)``."""
    concurrency: int
    """The number of ranks of the node that may be inside a turn at the same time."""


class StaggeredLoad:
    """One load, seen from one rank: rank-staggered turns, and agreement on success at the end.

    Every rank of the process group enters it (it is a context manager), enters the same turns in the same order
    (:meth:`turn`), and makes the same calls to :meth:`agree_on_success`. At the end it runs
    :meth:`agree_on_success`: every rank returns, or every rank raises the same
    :class:`~lightning_fsdp.loading.errors.CheckpointLoadError`, naming the rank(s) that failed (on a failing rank,
    chained to the original exception). With a single process, or without an initialized process group, the turns
    are free, nothing waits, and an exception propagates unchanged.

    How it keeps memory bounded: the ranks of a node take :meth:`turn` in the order of their local ranks, at most
    ``k`` at a time: local rank ``i`` enters once ``i - k + 1`` ranks of its node have left theirs, so a slot that
    frees up is taken at once (``Turn.index`` is ``i // k``). A rank counts as inside until its block ends, so the
    block must drop every reference to the materialised source (do the work in a function called inside the block,
    or ``del`` it) -- a copy that outlives the block is a copy the schedule does not bound. Nodes do not wait for
    each other.

    How it stays clear of timeouts and hangs: turns and agreements run on the process group's key-value store,
    polled every few milliseconds to 0.2 seconds (see :class:`~lightning_fsdp.distributed.agreement.Agreement`). No
    collective runs inside a turn or while waiting for one, so waiting never trips the process-group timeout, however
    long the turns. Do not run a collective between a turn and the next agreement either: the ranks leave their turns
    at different times, and a collective would make the early ones wait under the timeout. A rank that fails
    publishes its error; ranks waiting for a turn then raise within a poll interval, and every rank raises the same
    error once it reaches the agreement. A rank that is killed outright (by the out-of-memory killer, say) is declared
    dead by the waiting ranks within about half a minute, with or without a launcher that watches the ranks; a rank
    busy inside its own turn learns of it when the turn ends.

    Args:
        concurrency: At most this many ranks per node inside a turn at the same time, or ``"auto"`` (see
            :func:`resolve_concurrency`; it is resolved on local rank 0 of each node, so all ranks of a node follow
            the same schedule, and nodes may differ).
        node_rank: The rank of this process's node.
        local_rank: The rank of this process within its node; it orders the turns.
        local_world_size: The number of processes on each node.
        progress: A progress bar to feed with the node's totals and current turn, if any.
        description: What is being done, for error messages (``"Loading the checkpoint failed on rank 3: ..."``).
        namespace: Where this load's keys live in the store: the same on every rank and new for every load (see
            :class:`~lightning_fsdp.distributed.agreement.Agreement`). Required with several ranks.

    Example::

        namespace = broadcast(new_namespace())  # rank 0's, on every rank
        ranks = {"node_rank": node_rank, "local_rank": local_rank, "local_world_size": n}
        with StaggeredLoad("auto", **ranks, namespace=namespace) as load:
            check_names_and_shapes(...)  # a failure here, on any rank, is raised on every rank
            with load.turn(source_bytes=path.stat().st_size):
                copy_my_shards_from(path)  # reads the whole file, keeps only this rank's shards
            load.agree_on_success()  # before any collective, if the load goes on

    """

    def __init__(
        self,
        concurrency: int | Literal["auto"] = "auto",
        *,
        node_rank: int,
        local_rank: int,
        local_world_size: int,
        progress: LoadProgress | None = None,
        description: str = "Loading the checkpoint",
        namespace: str | None = None,
    ) -> None:
        self._concurrency = validate_concurrency(concurrency)
        if not 0 <= local_rank < local_world_size:
            raise ValueError(
                f"`StaggeredLoad(local_rank={local_rank}, local_world_size={local_world_size})`: the local rank must"
                " be at least 0 and smaller than the number of processes per node."
            )
        self._node_rank = node_rank
        self._local_rank = local_rank
        self._local_world_size = local_world_size
        self._progress = progress
        self._agreement = Agreement(description, namespace=namespace, on_wait=self._refresh_progress)
        self._channel: _StoreNodeChannel | None = None
        self._turns = 0

    @property
    def distributed(self) -> bool:
        """Whether the ranks coordinate through a process group (``False`` with a single process)."""
        return self._agreement.distributed

    def __enter__(self) -> StaggeredLoad:
        self._agreement.__enter__()
        store = self._agreement.store
        if store is not None and self._progress is not None:
            self._channel = _StoreNodeChannel(store, self._node_rank, self._local_world_size)
            self._agreement.discard_later(*self._channel.keys())
            self._progress.attach(self._channel)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        return self._agreement.__exit__(exc_type, exc, traceback)

    @contextmanager
    def turn(self, source_bytes: int = 0) -> Iterator[Turn]:
        """Wait for this rank's turn on its node, and hold it for the duration of the block.

        Args:
            source_bytes: The size of the source once materialised; used to resolve ``"auto"`` (on local rank 0).

        Yields:
            This rank's :class:`Turn`.

        Raises:
            CheckpointLoadError: If another rank failed or stopped responding while this one waited (this rank's turn
                does not start). An exception raised in the block is published to the other ranks and propagates.

        """
        store = self._agreement.store
        if store is None:
            concurrency = resolve_concurrency(self._concurrency, source_bytes, self._local_world_size)
            turn = _turn_of(self._local_rank, self._local_world_size, concurrency)
            if self._progress is not None:
                self._progress.set_turn(turn.index, turn.count)
            yield turn
            return

        agreement = self._agreement
        node = dist.PrefixStore(f"turn{self._turns}/node{self._node_rank}/", store)
        agreement.discard_later(node, ["concurrency", "started", "done"])
        self._turns += 1
        started = False
        concurrency = self._local_world_size
        try:
            concurrency = self._node_concurrency(node, source_bytes)
            turn = _turn_of(self._local_rank, self._local_world_size, concurrency)
            if self._channel is not None:
                self._channel.start_turn(node, concurrency, turn.count)
            # The ranks enter in the order of their local ranks: rank ``i`` once ``i - k + 1`` ranks of its node have
            # left, so that at most ``k`` are inside at any time.
            ahead = self._local_rank - concurrency + 1
            agreement.wait_for(lambda: ahead <= 0 or int(node.add("done", 0)) >= ahead, "its turn")
            agreement.call(node.add, "started", 1)
            started = True
            self._refresh_progress(force=True)
            try:
                yield turn
            except BaseException as error:
                agreement.publish_failure(error)
                raise
        finally:
            # Before the next rank of the node comes in (if one still waits), free what reference cycles still hold
            # and give the freed memory back to the system.
            if started and self._ranks_still_waiting(node, concurrency):
                gc.collect()
            if started:
                return_freed_memory()
            if self._progress is not None:
                self._progress.refresh(force=True)
            agreement.call(node.add, "done", 1)

    def agree_on_success(self, error: BaseException | None = None) -> None:
        """Wait for every rank, then return on all of them, or raise the same error on all of them.

        Call it outside turns, and before any collective that follows turns. See
        :meth:`~lightning_fsdp.distributed.agreement.Agreement.agree`.

        Args:
            error: This rank's own failure, if it had one (an error that :meth:`turn` raised because another rank
                failed is recognised and not counted as this rank's failure).

        Raises:
            CheckpointLoadError: If any rank failed or stopped responding, naming the rank(s) and their errors; on a
                failing rank it is chained to ``error``. With a single process, ``error`` itself is raised.

        """
        self._agreement.agree(error)
        self._refresh_progress(force=True)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (an agreement: call it outside turns, on every rank at the same point).

        See :meth:`~lightning_fsdp.distributed.agreement.Agreement.any_rank`.

        """
        answer = self._agreement.any_rank(flag)
        self._refresh_progress(force=True)
        return answer

    def _node_concurrency(self, node: dist.Store, source_bytes: int) -> int:
        if self._concurrency != "auto":
            return resolve_concurrency(self._concurrency, source_bytes, self._local_world_size)
        # Each rank would read a slightly different amount of free memory: local rank 0 decides for its node.
        if self._local_rank == 0:
            concurrency = resolve_concurrency("auto", source_bytes, self._local_world_size)
            self._agreement.call(node.set, "concurrency", str(concurrency))
            return concurrency
        self._agreement.wait_for(lambda: node.check(["concurrency"]), "its turn")
        return int(self._agreement.call(node.get, "concurrency"))

    def _ranks_still_waiting(self, node: dist.Store, concurrency: int) -> bool:
        # Rank ``i`` waits until ``i - k + 1`` ranks are done: once ``n - k`` are, nobody waits.
        done = int(self._agreement.call(node.add, "done", 0))
        return done < self._local_world_size - concurrency

    def _refresh_progress(self, force: bool = False) -> None:
        if self._progress is not None:
            self._progress.refresh(force=force)


class _StoreNodeChannel:
    """Adds a rank's progress to its node's totals in the store, and reads them back with the node's current turn."""

    def __init__(self, store: dist.Store, node_rank: int, local_world_size: int) -> None:
        self._store = dist.PrefixStore(f"progress/node{node_rank}/", store)
        self._local_world_size = local_world_size
        self._turn_store: dist.Store | None = None
        self._concurrency = 1
        self._turn_count = 1

    def keys(self) -> tuple[dist.Store, list[str]]:
        """The store that holds the node's totals, and their keys."""
        return self._store, [*_TOTALS_KEYS, "ranks"]

    def start_turn(self, turn_store: dist.Store, concurrency: int, count: int) -> None:
        self._turn_store, self._concurrency, self._turn_count = turn_store, concurrency, count

    def add_totals(self, total_bytes: int, total_tensors: int) -> None:
        # Every key exists once this rank's ``add`` ran, so ``exchange`` reads them all in one request.
        amounts = {"bytes": 0, "tensors": 0, "total_bytes": total_bytes, "total_tensors": total_tensors, "fetched": 0}
        amounts["ranks"] = 1
        with suppress(RuntimeError):  # progress is best effort; the schedule reports a lost store
            for key, amount in amounts.items():
                self._store.add(key, amount)

    def exchange(self, bytes_done: int, tensors_done: int, read: bool, fetched: int = 0) -> NodeSnapshot | None:
        try:
            if fetched:
                self._store.add("fetched", fetched)
            if bytes_done:
                self._store.add("bytes", bytes_done)
            if tensors_done:
                self._store.add("tensors", tensors_done)
            if not read:
                return None
            keys = [*_TOTALS_KEYS, "ranks"]
            done_bytes, done_tensors, total_bytes, total_tensors, node_fetched, ranks = map(
                int, self._store.multi_get(keys)
            )
            turn = None
            if self._turn_store is not None:
                started = int(self._turn_store.add("started", 0))
                turn = (max(started - 1, 0) // self._concurrency, self._turn_count)
        except RuntimeError:  # every store error is one
            return None
        if ranks < self._local_world_size:  # the node's totals are known once every rank has added its own
            total_bytes = total_tensors = 0
        return NodeSnapshot(done_bytes, done_tensors, total_bytes, total_tensors, turn, node_fetched)


def _turn_of(local_rank: int, local_world_size: int, concurrency: int) -> Turn:
    return Turn(
        index=local_rank // concurrency, count=math.ceil(local_world_size / concurrency), concurrency=concurrency
    )
