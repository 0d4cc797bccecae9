"""Cross-rank agreement on the process group's key-value store: every rank returns, or every rank raises the same error.

No collective runs here: ranks meet by polling the store, so a rank may wait for hours (for a turn, for a slow rank)
without tripping the process-group timeout. Every wait is bounded all the same:

- a rank that fails publishes its error, and the ranks that wait see it within a poll interval; every rank then waits
  for the outcome of every other rank's work in the same stage (a failure, a success, or a rank found dead), so that
  every rank raises the same error naming the same ranks, however far apart in time they failed;
- a rank that dies without a word (``SIGKILL``, the out-of-memory killer) stops its heartbeat: while an agreement is
  open, a daemon thread on every rank bumps that rank's counter in the store every second, and a waiting rank declares
  a rank dead once its counter has not moved for ``_UNRESPONSIVE_AFTER_S`` seconds of the waiter's own monotonic clock
  (counters, not timestamps: the clocks of the nodes differ). The first rank to notice publishes it as that rank's
  failure, so every rank raises the same error;
- a store that cannot be reached (its host, rank 0 without a launcher, died) fails the next store operation at once.

Each block meets under its own namespace in the store, which the caller gives, the same on every rank and new for
every block (the loader's is made on rank 0 by :func:`new_namespace` and travels with the path broadcast). Nothing a
rank did or failed to do in one block (fail before the first agreement, skip the block, be interrupted) can shift
where the ranks meet in the next one: there is no count of agreements that each rank keeps for itself. A rank that
never joins a block (it failed before it, or was killed) shows no heartbeat there, and is named as such, not as dead.
The keys of a finished block are deleted once every rank has passed an agreement of a later block on the same store,
so that no rank can still read them: the store does not grow with the number of loads.

The waits poll with non-blocking operations (``check``, ``add``) and short sleeps, never the store's blocking
``wait``: its timeout raises a different exception per store type (``FileStore``: a plain ``RuntimeError``), and
``TCPStore`` logs a warning for every slice that times out.

The heartbeat thread shares the store with the main thread. That is safe: ``TCPStore``'s client serialises operations
on its one connection with a mutex, ``FileStore`` and ``HashStore`` lock as well, ``PrefixStore`` delegates, and torch
releases the GIL inside each operation. Since no blocking ``wait`` runs while an agreement is open, a heartbeat never
queues behind one.

Layer: shared infrastructure (``lightning_fsdp.distributed``), used by loading and saving; not part of the core.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from types import TracebackType
from typing import Any, NamedTuple

import torch.distributed as dist

from lightning_fsdp.loading.errors import (
    CheckpointLoadError,
    described,
    error_class,
    unexpected_cause,
    upstream_kind,
)

#: Where the agreements' keys live in the store.
_KEY_ROOT = "lightning_fsdp/agreement"
#: Polling starts fast (a condition that holds at once costs nothing) and backs off to this interval.
_POLL_MIN_S = 0.005
_POLL_MAX_S = 0.2
#: How often each rank bumps its heartbeat counter, and how often a waiting rank reads the others'.
_HEARTBEAT_S = 1.0
#: A rank whose heartbeat counter has not moved for this long is declared dead. A rank that waits notices it within
#: ``_UNRESPONSIVE_AFTER_S + _HEARTBEAT_S + _POLL_MAX_S`` and raises.
_UNRESPONSIVE_AFTER_S = 30.0
#: How long rank 0 waits, at the end of an agreement, for the others to have read the outcome (without a launcher it
#: hosts the store: it must not exit before the others have read it).
_LEAVE_GRACE_S = 5.0
#: Error messages are cut to this length in the store.
_MAX_MESSAGE_CHARS = 2000

#: The keys that this process used in blocks it has left, by the store they live on: deleted once every rank has passed
#: an agreement of a later block on that store (see :meth:`Agreement.discard_later`).
_finished_keys: list[tuple[dist.Store, dist.Store, str]] = []
_finished_keys_lock = threading.Lock()


def new_namespace() -> str:
    """A name for one block's keys that no other block on any store uses: rank 0 makes it and sends it to the others."""
    return secrets.token_hex(8)


def poll_until(
    condition: Callable[[], bool], timeout: float | None = None, between: Callable[[], None] | None = None
) -> bool:
    """Poll ``condition`` every 5 ms, backing off to every 0.2 s, until it holds: the one way this package waits.

    Args:
        condition: What to wait for. Without a ``timeout`` it must become true or raise (see :meth:`Agreement.wait_for`,
            which raises once any rank failed or stopped responding).
        timeout: Give up after this many seconds.
        between: Called between two polls (a progress bar's refresh); it may raise to end the wait.

    Returns:
        ``True`` once ``condition`` holds, ``False`` if ``timeout`` passed first.

    """
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = _POLL_MIN_S
    while not condition():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        if between is not None:
            between()
        time.sleep(delay)
        delay = min(2 * delay, _POLL_MAX_S)
    return True


class _Failure(NamedTuple):
    message: str
    unresponsive: bool
    """Whether another rank published it because the failed rank stopped responding."""
    kind: str | None = None
    """The upstream type that the error was (``"KeyError"``, ``"ValueError"``: see ``errors.upstream_kind``)."""


class Agreement:
    """A block of work that ends the same way on every rank: all return, or all raise the same error.

    Every rank enters it (it is a context manager) and makes the same calls to :meth:`agree`; leaving the block
    agrees once more. If any rank failed, every rank raises the same
    :class:`~lightning_fsdp.loading.errors.CheckpointLoadError`, naming the rank(s) that failed and their errors (on a
    failing rank, with the original exception as its ``cause``). A rank that is killed outright is named too
    (``rank 3 stopped responding (killed? out of memory?)``), about half a minute after it died. With a single
    process, or without an initialized process group, nothing waits and an exception propagates unchanged.

    Do not run a collective between a failure-prone step and the next :meth:`agree`: a rank that failed would not
    join it, and the others would wait in it under the process-group timeout.

    Args:
        description: What is being done, for error messages (``"Loading 'x.ckpt' failed on rank 3: ..."``).
        namespace: Where this block's keys live in the store: the same on every rank, and used by no earlier block on
            the same store (rank 0 makes one with :func:`new_namespace` and sends it with a collective that every rank
            runs before the block, as the loader does with the path broadcast). Required with several ranks.
        on_wait: Called while waiting, between polls (for example to keep a progress bar moving).
        store: The key-value store to meet on, with ``rank`` and ``world_size``. By default, the store, rank and world
            size of the default process group.
        rank: This process's rank among ``world_size``, with ``store``.
        world_size: The number of ranks that meet on ``store``.

    Example::

        namespace = broadcast(new_namespace())  # rank 0's, on every rank
        with Agreement("Reading 'x.ckpt'", namespace=namespace):
            detected = detect_checkpoint(path)  # a failure here, on any rank, is raised on every rank

    """

    def __init__(
        self,
        description: str = "Loading the checkpoint",
        *,
        namespace: str | None = None,
        on_wait: Callable[[], None] | None = None,
        store: dist.Store | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if store is not None and not 0 <= rank < world_size:
            raise ValueError(f"`Agreement(rank={rank}, world_size={world_size})`: the rank must be in the world.")
        self._description = description
        self._namespace = namespace
        self._on_wait = on_wait
        self._root = store
        self._rank = rank
        self._world_size = world_size
        self._store: dist.Store | None = None
        self._heartbeat: _Heartbeat | None = None
        self._liveness: _Liveness | None = None
        self._agreements = 0
        self._used_keys: list[tuple[dist.Store, str]] = []
        self._published = False
        self._agreed_failure: CheckpointLoadError | None = None
        self._lost_store: CheckpointLoadError | None = None

    @property
    def distributed(self) -> bool:
        """Whether the ranks meet on a store (``False`` with a single process)."""
        return self._store is not None

    @property
    def store(self) -> dist.Store | None:
        """The agreement's own namespace in the store, for the caller's keys (``None`` with a single process)."""
        return self._store

    def __enter__(self) -> Agreement:
        root = self._root
        if root is None:
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
                return self
            root, self._rank, self._world_size = _default_store(), dist.get_rank(), dist.get_world_size()
        if self._world_size == 1:
            return self
        if not self._namespace:
            raise ValueError(
                "`Agreement(namespace=...)` is required with several ranks: pass a name that is the same on every rank"
                " and new for every block, made on rank 0 with `new_namespace()` and sent to the others with a"
                " collective that every rank runs before the block."
            )
        self._root = root
        self._store = dist.PrefixStore(f"{_KEY_ROOT}/{self._namespace}/", root)
        alive = dist.PrefixStore("alive/", self._store)
        self.discard_later(alive, [str(self._rank)])
        self._heartbeat = _Heartbeat(alive, str(self._rank))
        self._liveness = _Liveness(alive, self._rank, self._world_size)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        if self._store is None:
            return False
        try:
            if exc is not None and exc in (self._agreed_failure, self._lost_store):
                return False
            if exc is not None and not isinstance(exc, Exception):
                # An interrupt or exit: tell the others, do not make the user wait for them.
                self.publish_failure(exc)
                self._mark_arrived()
                return False
            self.agree(exc)
            return False
        finally:
            assert self._heartbeat is not None
            self._heartbeat.stop()
            self._leave_keys_behind()

    def agree(self, error: BaseException | None = None) -> None:
        """Wait for every rank, then return on all of them, or raise the same error on all of them.

        Once a failure is known, it waits until every rank has reported its outcome of the same stage (a rank still
        busy with its work is waited for while its heartbeat moves; one that stopped responding is named as such), so
        that every rank raises the same error naming the same ranks. After it raised, the agreement is over: it
        raises the same error again if called again.

        Args:
            error: This rank's own failure, if it had one (an error that reports other ranks' failure, such as one that
                :meth:`wait_for` raised, is recognised and not counted as this rank's).

        Raises:
            CheckpointLoadError: If any rank failed or stopped responding, naming the rank(s) and their errors; on a
                failing rank, ``error`` is its ``cause``. With a single process, ``error`` itself is raised.

        """
        if self._store is None:
            if error is not None:
                raise error
            return
        if self._agreed_failure is not None:
            raise self._agreed_failure
        own_failure = error is not None and not _reports_others(error, self._rank)
        if own_failure:
            self.publish_failure(error)
        phase = self._agreements
        key = f"agreement{phase}"
        self._agreements += 1
        self.call(self._store.add, key, 1)
        store = self._store
        failures = self._wait(lambda: int(store.add(key, 0)) >= self._world_size, phase)
        if not failures:
            self._leave(f"{key}/read", expected=self._world_size)
            # Every rank has entered this block, so every rank has left the earlier ones: nobody reads their keys.
            _delete_finished_keys(self._root)
            return
        # After a failure, the ranks may be at different agreements (or waiting elsewhere): they all meet here.
        failures = self._meet_after_failure(failures, phase)
        self._agreed_failure = _agreed_error(self._description, failures)
        if own_failure:
            self._agreed_failure.cause = error
        raise self._agreed_failure from unexpected_cause(self._agreed_failure.cause)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank: an agreement (see :meth:`agree`) that also counts the ranks that set it.

        Every rank must call it at the same point. With a single process, ``flag`` itself is returned.

        Raises:
            CheckpointLoadError: If any rank failed or stopped responding, as :meth:`agree`.

        """
        if self._store is None:
            return flag
        key = f"any{self._agreements}"  # the agreement below takes this number: fresh keys for every call
        if flag:
            self.call(self._store.add, key, 1)
        self.agree()
        return int(self.call(self._store.add, key, 0)) > 0

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Poll until ``ready()`` holds, raising as soon as any rank has failed or stopped responding.

        Args:
            ready: The condition, usually a read of the store (its failures are reported as a lost store).
            what: What this rank waits for, for the error message (``"its turn"``).

        Raises:
            CheckpointLoadError: If a rank failed or stopped responding while this one waited, or if the store was
                lost. ``ready()`` is read before the failures: a rank that fails publishes before it lets others on.

        """
        if self._store is None:
            poll_until(ready, between=self._on_wait)
            return
        failures = self._wait(ready, self._agreements)
        if failures:
            raise _agreed_error(self._description, failures, note=f"(This rank stopped waiting for {what}.)")

    def publish_failure(self, error: BaseException) -> None:
        """Tell the other ranks that this one failed with ``error`` (once per agreement).

        An error that reports other ranks' failure (one that :meth:`wait_for` or :meth:`agree` raised) is not this
        rank's, and is not published.

        """
        if self._published or self._store is None or _reports_others(error, self._rank):
            return
        self._published = True
        message = described(error)
        if len(message) > _MAX_MESSAGE_CHARS:
            message = message[: _MAX_MESSAGE_CHARS - 3] + "..."
        self._append_failure(self._rank, message, self._agreements, kind=upstream_kind(error))

    def discard_later(self, store: dist.Store, keys: Iterable[str]) -> None:
        """Delete ``keys`` of ``store`` (a prefix store under :attr:`store`) once no rank can read them any more.

        They are deleted after this block, once every rank has passed an agreement of a later block on the same store
        (every rank has then left this one). Each rank names the keys it used; a key named by several ranks is deleted
        by each, harmlessly.

        """
        self._used_keys.extend((store, key) for key in keys)

    def call(self, operation: Callable[..., Any], *args: Any) -> Any:
        """Run one store operation; a store that cannot be reached becomes a :class:`CheckpointLoadError`.

        Once the store was lost, every later call raises the same error at once.

        """
        if self._lost_store is not None:
            raise self._lost_store
        try:
            return operation(*args)
        except RuntimeError as error:  # every store error (``DistError`` is one; ``FileStore`` raises its base class)
            self._lost_store = CheckpointLoadError(
                f"{self._description} could not reach the process group's store: the process that hosts it (rank 0,"
                " unless a launcher such as torchrun hosts it) has exited, after an error or killed (out of memory?)."
                " See that process's output, and the system log (`dmesg`)."
            )
            raise self._lost_store from error

    def _leave_keys_behind(self) -> None:
        """Hand this block's keys over for deletion, once every rank is in a later block (see :meth:`discard_later`)."""
        assert self._store is not None
        keys = ["failures", "failed/read", *(f"failed/{rank}" for rank in range(self._world_size))]
        for phase in range(self._agreements + 1):  # another rank may have reached one agreement more than this one
            keys += [f"agreement{phase}", f"agreement{phase}/read", f"any{phase}"]
        self.discard_later(self._store, keys)
        if self._rank == 0:  # the waiting ranks create the counters of ranks that never beat
            self.discard_later(dist.PrefixStore("alive/", self._store), [str(rank) for rank in range(self._world_size)])
        with _finished_keys_lock:
            _finished_keys.extend((self._root, store, key) for store, key in self._used_keys)
        self._used_keys = []

    def _wait(self, ready: Callable[[], bool], phase: int) -> dict[int, _Failure]:
        """Poll until ``ready()`` holds or a rank failed or stopped responding; return those failures (or none).

        Only failures up to ``phase`` count (see :meth:`_failures`): a rank that already passed this agreement may fail
        in the next phase while a slower rank still reads this one's outcome, which was a success.

        """
        assert self._liveness is not None
        liveness = self._liveness
        failures: dict[int, _Failure] = {}

        def settled() -> bool:
            nonlocal failures
            is_ready = self.call(ready)
            failures = self._failures(phase)
            if not failures and not is_ready:
                dead = self.call(liveness.unresponsive)
                for rank, joined in dead.items():
                    self._append_failure(rank, _unresponsive_message(rank, joined), phase, unresponsive=True)
                if dead:
                    failures = self._failures(phase)  # the first record of each rank wins, the same on every rank
            return is_ready or bool(failures)

        poll_until(settled, between=self._on_wait)
        return failures

    def _meet_after_failure(self, failures: dict[int, _Failure], phase: int) -> dict[int, _Failure]:
        """Wait until every rank has reported its outcome of this stage, or is known to be gone; read every failure.

        Every rank waits for the same set of outcomes, so every rank names the same failed ranks, however far apart
        they failed: a rank still busy with its work (alive: its heartbeat moves) is waited for, one that stopped
        responding or never joined is named as such after ``_UNRESPONSIVE_AFTER_S``.

        """
        assert self._store is not None
        assert self._liveness is not None
        store, liveness = self._store, self._liveness
        self._mark_arrived()
        arrived: set[int] = set()
        dead: set[int] = set()

        def everyone_reported() -> bool:
            nonlocal failures
            failures = self._failures(phase)
            missing = [rank for rank in range(self._world_size) if rank not in arrived]
            arrived.update(rank for rank in missing if self.call(store.check, [f"failed/{rank}"]))
            # Found dead by another rank, or by this one (a rank that published its error and was then killed keeps
            # its error as its failure: the first record of each rank wins).
            dead.update(rank for rank, failure in failures.items() if failure.unresponsive)
            waiting = set(range(self._world_size)) - arrived - dead
            if not waiting:
                return True
            for rank, joined in self.call(liveness.unresponsive).items():
                if rank in waiting:
                    dead.add(rank)
                    self._append_failure(rank, _unresponsive_message(rank, joined), phase, unresponsive=True)
            return False

        poll_until(everyone_reported, between=self._on_wait)
        failures = self._failures(phase)
        self._leave("failed/read", expected=len(arrived))
        return failures

    def _mark_arrived(self) -> None:
        """Tell the others that this rank has reported its outcome, and will not add a failure to this block."""
        assert self._store is not None
        with suppress(RuntimeError):  # the store is gone: the others notice it at their next operation
            self._store.set(f"failed/{self._rank}", "1")

    def _failures(self, phase: int) -> dict[int, _Failure]:
        """The failures published in the phases up to ``phase``: the work before agreement ``phase``, and earlier.

        A rank publishes a failure with the number of the agreement that its failing work precedes.

        """
        assert self._store is not None
        if not self.call(self._store.check, ["failures"]):
            return {}
        failures: dict[int, _Failure] = {}
        for line in self.call(self._store.get, "failures").decode("utf-8").splitlines():
            if line:
                record = json.loads(line)
                if int(record.get("phase", 0)) > phase:
                    continue
                kind = record.get("kind")
                failure = _Failure(
                    str(record["message"]),
                    bool(record.get("unresponsive", False)),
                    kind if isinstance(kind, str) else None,
                )
                failures.setdefault(int(record["rank"]), failure)
        return failures

    def _append_failure(
        self, rank: int, message: str, phase: int, unresponsive: bool = False, kind: str | None = None
    ) -> None:
        assert self._store is not None
        fields = {"rank": rank, "message": message, "phase": phase, "unresponsive": unresponsive, "kind": kind}
        record = json.dumps(fields) + "\n"
        # If the store is gone, so is the job: the original error is what matters.
        with suppress(RuntimeError):
            self._store.append("failures", record)

    def _leave(self, key: str, expected: int) -> None:
        """Let rank 0 leave last, once the ``expected`` ranks that arrived have read the outcome (or after a while).

        ``init_process_group``'s default rendezvous hosts the store in rank 0's process: if rank 0 raised and exited
        first, the others could not read the outcome. (Under ``torchrun`` the agent hosts it; waiting is harmless.)

        """
        assert self._store is not None
        store = self._store
        # This rank has read the outcome already: if the store is gone now, nothing is lost.
        with suppress(RuntimeError):
            if self._rank != 0:
                store.add(key, 1)
                return
            poll_until(lambda: int(store.add(key, 0)) >= expected - 1, timeout=_LEAVE_GRACE_S)


class _Heartbeat:
    """Bumps a rank's counter in the store every ``_HEARTBEAT_S`` seconds, from a daemon thread, until stopped."""

    def __init__(self, store: dist.Store, key: str) -> None:
        self._store = store
        self._key = key
        self._stopped = threading.Event()
        # The first beat before this returns: a rank killed right after it entered a block has joined it, and is named
        # as having stopped responding, not as never having joined.
        with suppress(RuntimeError):  # the store is gone: the main thread reports it at its next operation
            self._store.add(self._key, 1)
        self._thread = threading.Thread(target=self._beat, name="lightning_fsdp-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        # Bounded: an operation on a store whose host vanished may hang until the store's timeout; the thread is a
        # daemon, and ends after it.
        self._thread.join(timeout=5 * _HEARTBEAT_S)

    def _beat(self) -> None:
        while not self._stopped.wait(_HEARTBEAT_S):
            try:
                self._store.add(self._key, 1)
            except RuntimeError:
                return  # the store is gone: the main thread reports it at its next operation


class _Liveness:
    """Which other ranks' heartbeat counters have not moved for ``_UNRESPONSIVE_AFTER_S``, by this rank's clock."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self._store = store
        self._ranks = [other for other in range(world_size) if other != rank]
        self._keys = [str(other) for other in self._ranks]
        self._keys_exist = False
        self._last_change: dict[int, tuple[int, float]] = {}
        self._next_read = time.monotonic() + _HEARTBEAT_S

    def unresponsive(self) -> dict[int, bool]:
        """The ranks found dead, each with whether it ever beat (joined); read at most every ``_HEARTBEAT_S``.

        Between two reads it returns no rank.

        """
        now = time.monotonic()
        if now < self._next_read:
            return {}
        self._next_read = now + _HEARTBEAT_S
        dead = {}
        for rank, count in zip(self._ranks, self._read(), strict=True):
            last = self._last_change.get(rank)
            if last is None or last[0] != count:
                self._last_change[rank] = (count, now)
            elif now - last[1] > _UNRESPONSIVE_AFTER_S:
                dead[rank] = count > 0  # a heartbeat bumps its counter as soon as it starts
        return dead

    def _read(self) -> list[int]:
        if not self._keys_exist:
            # ``multi_get`` would block on the key of a rank that has not beaten yet: ``add(key, 0)`` creates it.
            if not self._store.check(self._keys):
                for key in self._keys:
                    self._store.add(key, 0)
            self._keys_exist = True
        return [int(value) for value in self._store.multi_get(self._keys)]


def _unresponsive_message(rank: int, joined: bool) -> str:
    if not joined:
        # Alive or not, it never got here: it may have failed before this block (and be waiting elsewhere).
        return (
            f"rank {rank} did not join within {_UNRESPONSIVE_AFTER_S:.0f} s: it has shown no heartbeat in the process"
            " group's store since this block began. It failed before it got here (its own output says why), or it was"
            " killed (out of memory?: see the system log, `dmesg`)."
        )
    return (
        f"rank {rank} stopped responding (killed? out of memory?): its heartbeat in the process group's store has not"
        f" moved for {_UNRESPONSIVE_AFTER_S:.0f} s. Its own output, the system log (`dmesg`) or the job scheduler's"
        " log say why it stopped."
    )


def _delete_finished_keys(root: dist.Store) -> None:
    """Delete the keys that this process left on ``root`` in earlier blocks (see :meth:`Agreement.discard_later`).

    Call it only once every rank is known to have entered a later block on ``root``.

    """
    with _finished_keys_lock:
        finished = [(store, key) for owner, store, key in _finished_keys if owner is root]
        _finished_keys[:] = [entry for entry in _finished_keys if entry[0] is not root]
    # Housekeeping: a store that fails now fails the next agreement too, which reports it.
    with suppress(RuntimeError):
        for store, key in finished:
            store.delete_key(key)


def _reports_others(error: BaseException, rank: int) -> bool:
    """Whether ``error`` reports other ranks' failure, rather than having happened on ``rank``."""
    return isinstance(error, CheckpointLoadError) and bool(error.failed_ranks) and rank not in error.failed_ranks


def _default_store() -> dist.Store:
    # The key-value store that ``init_process_group`` rendezvoused through. Torch has no public accessor for it; this
    # private one has been stable since torch 1.x, and every process group has such a store.
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _agreed_error(description: str, failures: dict[int, _Failure], note: str = "") -> CheckpointLoadError:
    ranks = sorted(failures)
    by_message: dict[str, list[int]] = {}
    for rank in ranks:
        by_message.setdefault(failures[rank].message, []).append(rank)
    groups = list(by_message.items())
    plural = "s" if len(ranks) > 1 else ""
    if len(groups) == 1:
        message = f"{description} failed on rank{plural} {_format_ranks(ranks)}: {groups[0][0]}"
    else:
        lines = [f"- rank{'s' if len(group) > 1 else ''} {_format_ranks(group)}: {text}" for text, group in groups]
        message = f"{description} failed on ranks {_format_ranks(ranks)}:\n" + "\n".join(lines)
    if note:
        message += f"\n{note}"
    # every rank raises the upstream type of the failure (`KeyError`, ...) where all failed ranks agree on it
    kinds = {failures[rank].kind for rank in ranks}
    return error_class(kinds.pop() if len(kinds) == 1 else None)(message, failed_ranks=tuple(ranks))


def _format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts, start = [], 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
            first, last = ranks[start], ranks[i - 1]
            parts.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ", ".join(parts)
