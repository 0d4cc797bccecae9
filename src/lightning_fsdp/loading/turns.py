"""Rank-staggered turns: at most ``k`` ranks of a node hold a materialised checkpoint source in memory at a time.

A source that cannot be read lazily (a legacy pickle file, a state dict that has to be transformed) is materialised
whole in host memory. If every rank of a node does that at once, the node holds one copy per rank. The turns here let
at most ``k`` ranks of each node do it at the same time, in the order of their local ranks; nodes proceed in parallel.

The schedule runs entirely on the process group's key-value store, polled with short sleeps: no collective runs inside
or between turns, so a rank may wait for its turn for hours without tripping the process-group timeout, and a rank
that fails tells the others through the store, so that they stop waiting within a fraction of a second.

Upstream destination: ``src/lightning/fabric/utilities/load.py``.
"""

import ctypes
import gc
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch.distributed as dist

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.progress import LoadProgress, _NodeSnapshot

#: The share of the memory available to the node that ``load_concurrency="auto"`` lets the copies of a source take.
_AUTO_MEMORY_FRACTION = 0.8
#: cgroup v1 reports "no limit" as a number close to 2**63.
_CGROUP_V1_UNLIMITED = 1 << 60
#: Where this module's keys live in the process group's store.
_KEY_ROOT = "lightning_fsdp/staggered_load"
#: Polling starts fast (a turn that is free at once costs nothing) and backs off to this interval.
_POLL_MIN_S = 0.005
_POLL_MAX_S = 0.2
#: How long one blocking wait for a turn lasts before the waiting rank looks for failures again.
_WAIT_SLICE_S = 0.2
#: Once a failure is known, how long a rank waits for the others to reach the agreement before it raises anyway (the
#: ranks that are not busy inside their own turn arrive within one poll interval).
_FAILURE_GRACE_S = 5.0
#: How long a rank waits, at the end of an agreement, for the others to have read its outcome (the rank that hosts the
#: store must not exit before the others have read it).
_LEAVE_GRACE_S = 5.0
#: Error messages are cut to this length in the store.
_MAX_MESSAGE_CHARS = 2000


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
    available = _available_memory()
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
    polled every few milliseconds to 0.2 seconds. No collective runs inside a turn or while waiting for one, so
    waiting never trips the process-group timeout, however long the turns. Do not run a collective between a turn
    and the next agreement either: the ranks leave their turns at different times, and a collective would make the
    early ones wait under the timeout. A rank that fails publishes its error; ranks waiting for a turn then raise
    within a poll interval, and every rank raises the same error once it reaches the agreement.

    A process that is killed outright (for example by the kernel's out-of-memory killer) publishes nothing: its
    launcher (``torchrun``, Fabric's) is expected to end the other processes.

    Args:
        concurrency: At most this many ranks per node inside a turn at the same time, or ``"auto"`` (see
            :func:`resolve_concurrency`; it is resolved on local rank 0 of each node, so all ranks of a node follow
            the same schedule, and nodes may differ).
        node_rank: The rank of this process's node.
        local_rank: The rank of this process within its node; it orders the turns.
        local_world_size: The number of processes on each node.
        progress: A progress bar to feed with the node's totals and current turn, if any.
        description: What is being done, for error messages (``"Loading the checkpoint failed on rank 3: ..."``).

    Example::

        with StaggeredLoad("auto", node_rank=node_rank, local_rank=local_rank, local_world_size=n) as load:
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
        self._description = description
        self._rank = 0
        self._world_size = 1
        self._store: dist.Store | None = None
        self._channel: _StoreNodeChannel | None = None
        self._turns = 0
        self._agreements = 0
        self._published = False
        self._agreed_failure: CheckpointLoadError | None = None

    @property
    def distributed(self) -> bool:
        """Whether the ranks coordinate through a process group (``False`` with a single process)."""
        return self._store is not None

    def __enter__(self) -> "StaggeredLoad":
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        root = _default_store()
        # Each rank counts its own loads; all ranks run the same loads in the same order, so the counts agree and
        # every load gets fresh keys.
        call = _store_op(self._description, root.add, f"{_KEY_ROOT}/calls/{self._rank}", 1)
        self._store = dist.PrefixStore(f"{_KEY_ROOT}/{call}/", root)
        if self._progress is not None:
            self._channel = _StoreNodeChannel(self._store, self._node_rank, self._local_world_size)
            self._progress._attach(self._channel)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        if self._store is None or (exc is not None and exc is self._agreed_failure):
            return False
        if exc is not None and not isinstance(exc, Exception):
            # An interrupt or exit: tell the others, do not make the user wait for them.
            self._publish(exc)
            return False
        self.agree_on_success(exc)
        return False

    @contextmanager
    def turn(self, source_bytes: int = 0) -> Iterator[Turn]:
        """Wait for this rank's turn on its node, and hold it for the duration of the block.

        Args:
            source_bytes: The size of the source once materialised; used to resolve ``"auto"`` (on local rank 0).

        Yields:
            This rank's :class:`Turn`.

        Raises:
            CheckpointLoadError: If another rank failed while this one waited (this rank's turn does not start). An
                exception raised in the block is published to the other ranks and propagates.

        """
        if self._store is None:
            concurrency = resolve_concurrency(self._concurrency, source_bytes, self._local_world_size)
            turn = _turn_of(self._local_rank, self._local_world_size, concurrency)
            if self._progress is not None:
                self._progress.set_turn(turn.index, turn.count)
            yield turn
            return

        node = dist.PrefixStore(f"turn{self._turns}/node{self._node_rank}/", self._store)
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
            self._wait_until_left(node, self._local_rank - concurrency + 1)
            node.add("started", 1)
            started = True
            self._refresh_progress(force=True)
            try:
                yield turn
            except BaseException as error:
                if self._is_own_failure(error):
                    self._publish(error)
                raise
        finally:
            # Before the next rank of the node comes in (if one still waits), free what reference cycles still hold
            # and give the freed memory back to the system.
            if started and self._ranks_still_waiting(node, concurrency):
                gc.collect()
            if started:
                _return_freed_memory()
            if self._progress is not None:
                self._progress.refresh(force=True)
            left = int(_store_op(self._description, node.add, "done", 1))
            # Wakes the rank that waits for exactly this many to have left (see `_wait_until_left`).
            _store_op(self._description, node.set, f"left/{left}", "1")

    def _wait_until_left(self, node: dist.Store, count: int) -> None:
        """Block until ``count`` ranks of the node have left their turn, raising as soon as any rank has failed.

        The wait is the store's own (``wait`` on the key the ``count``-th rank sets as it leaves), so the next rank
        starts the moment a slot frees, without polling; it is cut into short slices to check for failures.

        """
        if count <= 0:
            if self._failures():
                raise _agreed_error(self._description, self._failures(), waiting=True)
            return
        key = f"left/{count}"
        while True:
            failures = self._failures()
            if failures:
                raise _agreed_error(self._description, failures, waiting=True)
            try:
                node.wait([key], timedelta(seconds=_WAIT_SLICE_S))
            except dist.DistStoreError:  # the slice ended: look for failures, then wait again
                self._refresh_progress()
                continue
            except dist.DistError as error:
                raise CheckpointLoadError(
                    f"{self._description} could not reach the process group's store: the process that hosts it"
                    " (usually rank 0) has probably exited after an error. See the other ranks' output for it."
                ) from error
            # A failing rank publishes before it leaves: read the failures once more before starting.
            failures = self._failures()
            if failures:
                raise _agreed_error(self._description, failures, waiting=True)
            return

    def _ranks_still_waiting(self, node: dist.Store, concurrency: int) -> bool:
        # Rank ``i`` waits until ``i - k + 1`` ranks are done: once ``n - k`` are, nobody waits.
        done = int(_store_op(self._description, node.add, "done", 0))
        return done < self._local_world_size - concurrency

    def agree_on_success(self, error: BaseException | None = None) -> None:
        """Wait for every rank, then return on all of them, or raise the same error on all of them.

        It runs on the store, like the turns: waiting for a rank that is still inside a long turn never trips the
        process-group timeout. Call it outside turns, and before any collective that follows turns. Once a failure is
        known, it waits a few seconds at most, for the ranks that are not busy inside a turn, then raises. After it
        raised, the load is over: it raises the same error again if called again.

        Args:
            error: This rank's own failure, if it had one (an error that :meth:`turn` raised because another rank
                failed is recognised and not counted as this rank's failure).

        Raises:
            CheckpointLoadError: If any rank failed, naming the failing rank(s) and their errors; on a failing rank it
                is chained to ``error``. With a single process, ``error`` itself is raised.

        """
        if self._store is None:
            if error is not None:
                raise error
            return
        if self._agreed_failure is not None:
            raise self._agreed_failure
        own_failure = error is not None and self._is_own_failure(error)
        if own_failure:
            self._publish(error)
        key = f"agreement{self._agreements}"
        self._agreements += 1
        _store_op(self._description, self._store.add, key, 1)
        delay = _POLL_MIN_S
        while True:
            arrived = int(_store_op(self._description, self._store.add, key, 0))
            # Read after the arrivals: a failing rank publishes before it arrives.
            if self._failures():
                break
            if arrived >= self._world_size:
                self._leave(f"{key}/read", expected=self._world_size)
                self._refresh_progress(force=True)
                return
            self._refresh_progress()
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)
        # After a failure, the ranks may be at different agreements (or still waiting for a turn): they all meet here.
        failures = self._meet_after_failure()
        self._agreed_failure = _agreed_error(self._description, failures)
        raise self._agreed_failure from (error if own_failure else None)

    def _meet_after_failure(self) -> dict[int, str]:
        """Wait for the other ranks to learn of the failure (a few seconds at most), and read every rank's failure."""
        assert self._store is not None
        _store_op(self._description, self._store.add, "failed", 1)
        deadline = time.monotonic() + _FAILURE_GRACE_S
        delay = _POLL_MIN_S
        while (arrived := int(_store_op(self._description, self._store.add, "failed", 0))) < self._world_size:
            if time.monotonic() > deadline:
                break
            self._refresh_progress()
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)
        failures = self._failures()
        self._leave("failed/read", expected=min(arrived, self._world_size))
        return failures

    def _node_concurrency(self, node: dist.Store, source_bytes: int) -> int:
        if self._concurrency != "auto":
            return resolve_concurrency(self._concurrency, source_bytes, self._local_world_size)
        # Each rank would read a slightly different amount of free memory: local rank 0 decides for its node.
        if self._local_rank == 0:
            concurrency = resolve_concurrency("auto", source_bytes, self._local_world_size)
            node.set("concurrency", str(concurrency))
            return concurrency
        self._wait_for(lambda: node.check(["concurrency"]))
        return int(node.get("concurrency"))

    def _wait_for(self, ready: Any) -> None:
        """Poll until ``ready()`` holds, raising as soon as any rank has published a failure."""
        assert self._store is not None
        delay = _POLL_MIN_S
        while True:
            is_ready = _store_op(self._description, ready)
            # Read after ``ready``: a failing rank publishes before it lets the next rank in, so a rank never starts a
            # turn after a failure it could have seen.
            failures = self._failures()
            if failures:
                raise _agreed_error(self._description, failures, waiting=True)
            if is_ready:
                return
            self._refresh_progress()
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)

    def _failures(self) -> dict[int, str]:
        assert self._store is not None
        store = self._store
        if not _store_op(self._description, store.check, ["failures"]):
            return {}
        failures = {}
        for line in _store_op(self._description, store.get, "failures").decode("utf-8").splitlines():
            if line:
                record = json.loads(line)
                failures.setdefault(int(record["rank"]), str(record["message"]))
        return failures

    def _publish(self, error: BaseException) -> None:
        """Tell the other ranks that this one failed (once per load)."""
        if self._published or self._store is None:
            return
        self._published = True
        message = str(error) if isinstance(error, CheckpointLoadError) else f"{type(error).__name__}: {error}"
        if len(message) > _MAX_MESSAGE_CHARS:
            message = message[: _MAX_MESSAGE_CHARS - 3] + "..."
        record = json.dumps({"rank": self._rank, "message": message}) + "\n"
        # If the store is gone, so is the job: the original error is what matters.
        with suppress(dist.DistError):
            self._store.append("failures", record)

    def _is_own_failure(self, error: BaseException) -> bool:
        """Whether ``error`` happened on this rank, rather than reporting another rank's failure."""
        if isinstance(error, CheckpointLoadError) and error.failed_ranks:
            return self._rank in error.failed_ranks
        return True

    def _leave(self, key: str, expected: int) -> None:
        """Let rank 0 leave last, once the ``expected`` ranks that arrived have read the outcome (or after a while).

        ``init_process_group``'s default rendezvous hosts the store in rank 0's process: if rank 0 raised and exited
        first, the others could not read the outcome. (Under ``torchrun`` the agent hosts it; waiting is harmless.)

        """
        assert self._store is not None
        # This rank has read the outcome already: if the store is gone now, nothing is lost.
        with suppress(dist.DistError):
            if self._rank != 0:
                self._store.add(key, 1)
                return
            deadline = time.monotonic() + _LEAVE_GRACE_S
            delay = _POLL_MIN_S
            while int(self._store.add(key, 0)) < expected - 1 and time.monotonic() < deadline:
                time.sleep(delay)
                delay = min(2 * delay, _POLL_MAX_S)

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

    def start_turn(self, turn_store: dist.Store, concurrency: int, count: int) -> None:
        self._turn_store, self._concurrency, self._turn_count = turn_store, concurrency, count

    def add_totals(self, total_bytes: int, total_tensors: int) -> None:
        # Every key exists once this rank's ``add`` ran, so ``exchange`` reads them all in one request.
        amounts = {"bytes": 0, "tensors": 0, "total_bytes": total_bytes, "total_tensors": total_tensors, "ranks": 1}
        for key, amount in amounts.items():
            self._store.add(key, amount)

    def exchange(self, bytes_done: int, tensors_done: int, read: bool) -> _NodeSnapshot | None:
        try:
            if bytes_done:
                self._store.add("bytes", bytes_done)
            if tensors_done:
                self._store.add("tensors", tensors_done)
            if not read:
                return None
            keys = ["bytes", "tensors", "total_bytes", "total_tensors", "ranks"]
            done_bytes, done_tensors, total_bytes, total_tensors, ranks = map(int, self._store.multi_get(keys))
            turn = None
            if self._turn_store is not None:
                started = int(self._turn_store.add("started", 0))
                turn = (max(started - 1, 0) // self._concurrency, self._turn_count)
        except dist.DistError:
            return None  # progress is best effort; the schedule reports a lost store
        if ranks < self._local_world_size:  # the node's totals are known once every rank has added its own
            total_bytes = total_tensors = 0
        return _NodeSnapshot(done_bytes, done_tensors, total_bytes, total_tensors, turn)


def _return_freed_memory() -> None:
    """Return the heap memory that freed tensors leave behind to the system (glibc only; elsewhere a no-op).

    Tensors below glibc's mmap threshold (up to 32 MiB) come from the heap, and glibc keeps freed heap memory for
    reuse: without this, a rank would still hold most of a materialised source after its turn, and the next rank's
    copy would come on top of it.

    """
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _turn_of(local_rank: int, local_world_size: int, concurrency: int) -> Turn:
    return Turn(
        index=local_rank // concurrency, count=math.ceil(local_world_size / concurrency), concurrency=concurrency
    )


def _default_store() -> dist.Store:
    # The key-value store that ``init_process_group`` rendezvoused through. Torch has no public accessor for it; this
    # private one has been stable since torch 1.x, and every process group has such a store.
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _store_op(description: str, operation: Any, *args: Any) -> Any:
    """Run one store operation; a store that cannot be reached means another process ended the job."""
    try:
        return operation(*args)
    except dist.DistError as error:
        raise CheckpointLoadError(
            f"{description} could not reach the process group's store: the process that hosts it (usually rank 0)"
            " has probably exited after an error. See the other ranks' output for it."
        ) from error


def _agreed_error(description: str, failures: dict[int, str], waiting: bool = False) -> CheckpointLoadError:
    ranks = sorted(failures)
    by_message: dict[str, list[int]] = {}
    for rank in ranks:
        by_message.setdefault(failures[rank], []).append(rank)
    groups = list(by_message.items())
    plural = "s" if len(ranks) > 1 else ""
    if len(groups) == 1:
        message = f"{description} failed on rank{plural} {_format_ranks(ranks)}: {failures[ranks[0]]}"
    else:
        lines = [f"- rank{'s' if len(group) > 1 else ''} {_format_ranks(group)}: {text}" for text, group in groups]
        message = f"{description} failed on ranks {_format_ranks(ranks)}:\n" + "\n".join(lines)
    if waiting:
        message += "\n(This rank stopped waiting for its turn.)"
    return CheckpointLoadError(message, failed_ranks=tuple(ranks))


def _format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts, start = [], 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
            first, last = ranks[start], ranks[i - 1]
            parts.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ", ".join(parts)


def _available_memory(
    meminfo: str = "/proc/meminfo", self_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup"
) -> int | None:
    """The bytes of memory this process's node can still give it: the system's, bounded by its cgroup's limit."""
    found = (_system_available(meminfo), _cgroup_available(self_cgroup, cgroup_root))
    known = [value for value in found if value is not None]
    return min(known) if known else None


def _system_available(meminfo: str) -> int | None:
    try:
        text = Path(meminfo).read_text()
    except OSError:
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.virtual_memory().available)
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            value, *unit = line.split()[1:]
            return int(value) * (1024 if unit and unit[0].lower() == "kb" else 1)
    return None


def _cgroup_available(self_cgroup: str, cgroup_root: str) -> int | None:
    """The smallest ``limit - usage`` over the process's cgroup and its ancestors (v2, or v1's memory controller).

    Usage counts page cache that can be reclaimed (``inactive_file``) as free, as the kernel would before it kills.

    """
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(cgroup_root)
    available = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if hierarchy == "0" and not controllers:  # v2: the unified hierarchy, mounted at the root or under "unified"
            for mount in (root, root / "unified"):
                available.append(_walk_cgroup(mount, relative, "memory.max", "memory.current", "inactive_file"))
        elif "memory" in controllers.split(","):  # v1
            available.append(
                _walk_cgroup(
                    root / "memory", relative, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
                )
            )
    known = [value for value in available if value is not None]
    return min(known) if known else None


def _walk_cgroup(mount: Path, relative: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    # Inside a container the process's cgroup is usually the mount's root; on a host it is the path under the mount.
    directory = mount / relative
    if not directory.is_dir():
        directory = mount
    available = []
    while True:
        value = _cgroup_level_available(directory, limit_file, usage_file, inactive_key)
        if value is not None:
            available.append(value)
        if directory == mount or mount not in directory.parents:
            break
        directory = directory.parent
    return min(available) if available else None


def _cgroup_level_available(directory: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit_text = (directory / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _CGROUP_V1_UNLIMITED:
            return None
        usage = int((directory / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
                break
    except (OSError, ValueError):
        pass
    return max(int(limit_text) - max(usage - inactive, 0), 0)
