"""Checkpoints saved in the background: the save returns once every rank holds its own copy of its slices.

A strategy made with ``save_in_background=True`` hands the rest of each gather-free full save (the positioned writes,
``fsync``, the ranks' agreement and the rename; :func:`lightning_fsdp.saving.consolidated.save` with ``hand_off``) to
one thread of :class:`BackgroundSaves`, and training goes on. The file appears under its name, complete, when every
rank has written and agreed, as with the synchronous save; on any failure no file replaces the earlier one and the
temporary file is removed. At most one save is in flight per strategy: the next save, a load, ``teardown`` and
:meth:`BackgroundSaves.wait` wait for it, and raise its error (a :class:`~.consolidated.CheckpointSaveError`, the
same on every rank) there. A process that exits with a save in flight finishes it first (the thread is not a daemon)
and prints its error if it failed and nobody waited for it.

Host memory: one copy of what the rank writes (its slices of the model and of the optimizer state), in one arena
(:class:`HostBuffers`) that the next save reuses. The strategy reserves it at an optimizer's first step, in a thread
that allocates it and touches every page, so that the first save copies into memory that is ready instead of
waiting for the kernel to map 1 GB of pages. The background thread meets the other ranks on the process group's
store, never in a collective, so it does not interleave with the training loop's collectives.

The export of the weights (:func:`lightning_fsdp.saving.save_safetensors`) hands off the same way. A sharded
checkpoint (:func:`sharded_saves_in_background`) is copied with torch's staging utilities into buffers of its own,
and torch's distributed checkpoint ``save`` writes it in the same thread, on a gloo group of its own.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from __future__ import annotations

import atexit
import importlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_fsdp.loading.errors import load_errors_printed_once_per_node

_pending: weakref.WeakSet[BackgroundSaves] = weakref.WeakSet()
#: Where each copy starts in the arena: a multiple of this many bytes (a cache line; any dtype's size divides it).
_ALIGNMENT = 64


class HostBuffers:
    """The host memory that a save in the background copies the rank's slices into: one arena, reused by every save.

    :meth:`reserve_for` sizes it from an optimizer after its first step (its parameters' local shards and their state,
    which is what a full save writes, but for the buffers of the model) and allocates it in a thread; :meth:`views`
    lays out one save's copies in it, waiting for that thread first. What does not fit in the arena (a model's
    buffers, or the state of an optimizer that took no step yet) gets memory of its own, kept for the next save too.

    """

    def __init__(self) -> None:
        self.arena: Tensor | None = None
        self._overflow: dict[int, Tensor] = {}
        self._reserved: dict[int, int] = {}
        self._reserving: threading.Thread | None = None

    def reserve_for(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the arena ready, in a thread, for the state of ``optimizer`` (once per optimizer) and its parameters."""
        if id(optimizer) in self._reserved:
            return
        nbytes, pin = _host_copy_bytes(optimizer)
        self._reserved[id(optimizer)] = nbytes
        self._wait_reserved()
        total = sum(self._reserved.values())
        if self.arena is not None and self.arena.numel() >= total:
            return
        self._reserving = threading.Thread(
            target=self._allocate, args=(total, pin), name="lightning-fsdp-host-buffers", daemon=True
        )
        self._reserving.start()

    def _allocate(self, nbytes: int, pin: bool) -> None:
        try:
            arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            arena.zero_()  # every page touched here: the kernel maps them now, not while the first save copies
        except (MemoryError, RuntimeError):
            # no traceback from a thread in the middle of training: the save allocates what it needs itself, and
            # raises there, in its own error, if the memory is still not to be had
            return
        self.arena = arena

    def _wait_reserved(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def views(self, sizes: list[tuple[int, torch.dtype]], pin: bool) -> list[Tensor]:
        """One 1-D tensor of ``numel`` elements of ``dtype`` per entry of ``sizes``, in the arena where they fit.

        Without an arena (no optimizer stepped), or in one that is pinned where ``pin`` is not (or the reverse), or
        more than twice as large as both this save and the reservation need (the model shrank: no more than one copy
        is held), an arena of exactly what ``sizes`` need replaces it. A save of less than the reservation (an export
        of the weights alone) uses the start of the arena.

        """
        self._wait_reserved()
        ends = []
        end = 0
        for numel, dtype in sizes:
            end = -(-end // _ALIGNMENT) * _ALIGNMENT + numel * dtype.itemsize
            ends.append(end)
        arena = self.arena
        if arena is None or arena.is_pinned() != pin or arena.numel() > 2 * max(end, sum(self._reserved.values())):
            arena = self.arena = torch.empty(end, dtype=torch.uint8, pin_memory=pin)
            self._overflow.clear()
        views = []
        for index, ((numel, dtype), stop) in enumerate(zip(sizes, ends, strict=True)):
            start = stop - numel * dtype.itemsize
            if stop <= arena.numel():
                views.append(arena[start:stop].view(dtype))
                continue
            buffer = self._overflow.get(index)
            if buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.is_pinned() != pin:
                buffer = self._overflow[index] = torch.empty(numel, dtype=dtype, pin_memory=pin)
            views.append(buffer)
        for index in [index for index in self._overflow if index >= len(sizes)]:
            del self._overflow[index]
        return views


def _host_copy_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, bool]:
    """The arena bytes that a save's copies of ``optimizer``'s parameters and their state take, and whether on a GPU."""
    from torch.distributed.tensor import DTensor

    nbytes, pin = 0, False
    for group in optimizer.param_groups:
        for param in group["params"]:
            tensors = [param, *(v for v in optimizer.state.get(param, {}).values() if isinstance(v, Tensor))]
            for tensor in tensors:
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if local.dim() == 0:
                    continue  # a scalar state (Adam's `step`) is pickled, not copied
                nbytes = -(-nbytes // _ALIGNMENT) * _ALIGNMENT + local.numel() * local.element_size()
                pin = pin or local.device.type == "cuda"
    return nbytes, pin


class BackgroundSaves:
    """The saves of one strategy that run in the background: at most one at a time."""

    def __init__(self) -> None:
        self.buffers = HostBuffers()
        """The host memory of the rank's slices, kept from one save to the next."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""
        self._group: Any = None
        self._staged: dict[str, Any] | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a save is still being written."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, rest: Callable[[], None], what: str = "the checkpoint") -> None:
        """Run ``rest`` (the remainder of a save) in the background; the previous save must have been waited for."""
        assert self._thread is None, "a save is in flight: `wait()` first"
        self._what = what
        self._thread = threading.Thread(target=self._run, args=(rest,), name="lightning-fsdp-save", daemon=False)
        _pending.add(self)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error if it failed (the earlier file is then untouched)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self, rest: Callable[[], None]) -> None:
        try:
            rest()
        except BaseException as error:
            self._error = error

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of a distributed checkpoint's state dict in host memory.

        The buffers of the previous copy are reused where the structure is the same. torch's own staging utilities
        make it: they know ``ShardedTensor`` and ``DTensor``.

        """
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self._staged is not None:
            try:
                return _copy_state_dict(state_dict, self._staged, type_check=False)
            except Exception:  # another structure (another model, a new optimizer state): new buffers below
                self._staged = None
        self._staged = _create_cpu_state_dict(state_dict)
        return _copy_state_dict(state_dict, self._staged, type_check=False)

    def process_group(self) -> Any:
        """A gloo group of all ranks for the background writes of sharded checkpoints (created once, on every rank).

        torch's distributed checkpoint ``save`` runs its collectives in the thread that writes: on a group of their
        own, they never interleave with the training loop's collectives on the default group.

        """
        if self._group is None:
            self._group = torch.distributed.new_group(backend="gloo")
        return self._group


@contextmanager
def sharded_saves_in_background(saves: BackgroundSaves | None, strategy_module: str) -> Iterator[None]:
    """Within it, the sharded save of Lightning's ``strategy_module`` writes in the background.

    The call copies every rank's shards (``ShardedTensor`` or ``DTensor`` local shards, and the other tensors) into
    host buffers that the next sharded save reuses, then torch's distributed checkpoint ``save`` writes the copy in the
    thread of :meth:`BackgroundSaves.start`, on a process group of its own (:meth:`BackgroundSaves.process_group`):
    the next save, a load, ``teardown`` and ``wait_for_save`` wait for it and raise its error. Lightning writes the
    checkpoint's other entries (``meta.pt``) in the call, as before.

    """
    if saves is None:  # not made with `save_in_background=True`, or not a sharded save: Lightning's, in the call
        yield
        return
    from torch.distributed.checkpoint import save

    def save_in_background(converted_state: dict[str, Any], path: Path) -> None:
        staged = saves.stage(converted_state)
        group = saves.process_group()
        saves.start(lambda: save(staged, checkpoint_id=path, process_group=group), what=repr(str(path)))

    module = importlib.import_module(strategy_module)
    synchronous = module._distributed_checkpoint_save
    module._distributed_checkpoint_save = save_in_background  # for this call only: the strategy's save is Lightning's
    try:
        yield
    finally:
        module._distributed_checkpoint_save = synchronous


def wait_for_save(strategy: Any) -> None:
    """Wait for the save in flight of a strategy made with ``save_in_background=True`` (its ``_background_saves``).

    Its error is raised here, on every rank, and printed in full by one rank per node, as a load's.

    """
    saves = strategy._background_saves
    if saves is not None:
        with load_errors_printed_once_per_node(strategy.global_rank, strategy.local_rank):
            saves.wait()


@atexit.register
def _report_unwaited_failures() -> None:
    """At exit (after the interpreter has joined the save threads): say what failed that nobody waited for."""
    for saves in list(_pending):
        try:
            saves.wait()
        except BaseException as error:
            print(
                f"lightning-fsdp: the background save of {saves._what} did not complete: {type(error).__name__}:"
                f" {error}",
                file=sys.stderr,
            )
