"""Progress of a long checkpoint load: one bar per node, on a terminal only.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import math
import os
import sys
import time
from types import TracebackType
from typing import NamedTuple, Protocol, TextIO

from tqdm import tqdm

from lightning_fsdp.loading.files import fetched_bytes

#: Set to ``0`` to turn the bar off, or to ``1`` to show it even when the output is not a terminal.
PROGRESS_ENV_VAR = "LIGHTNING_FSDP_PROGRESS"
_OFF_VALUES = ("0", "false", "no", "off")
_ON_VALUES = ("1", "true", "yes", "on")
#: A load shorter than this never draws a bar.
_SHOW_AFTER_S = 1.0
#: tqdm's default formats, with the unit after the byte counts ("1.50GB/3.00GB", not "1.50G/3.00G").
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
_COUNTER_FORMAT = "{desc}: {n_fmt}B [{elapsed}, {rate_fmt}{postfix}]"
#: How often a rank adds its counts to its node's totals (and the showing rank reads them back), at most.
_EXCHANGE_INTERVAL_S = 0.5


class NodeSnapshot(NamedTuple):
    """What all ranks of a node have loaded so far, and the turn the node is in."""

    bytes_done: int
    tensors_done: int
    total_bytes: int
    total_tensors: int
    turn: tuple[int, int] | None
    """``(index, count)`` of the turn the node is in (0-based), ``None`` before the first turn."""
    fetched: int = 0
    """The bytes the node's ranks fetched from object storage (:func:`~lightning_fsdp.loading.files.fetched_bytes`)."""


class NodeChannel(Protocol):
    """Adds one rank's counts to its node's totals, and reads them back; the turn schedule provides it."""

    def add_totals(self, total_bytes: int, total_tensors: int) -> None: ...

    def exchange(self, bytes_done: int, tensors_done: int, read: bool, fetched: int = 0) -> NodeSnapshot | None: ...


class LoadProgress:
    """A progress bar for a long checkpoint load: bytes and tensors done, rate, and the turn the node is in.

    Every rank creates one and reports what it loaded with :meth:`update`; only local rank 0 of each node draws.
    When it is passed to :class:`~lightning_fsdp.loading.turns.StaggeredLoad`, the bar shows the totals of all ranks
    of the node and the node's current turn (``turn 3/8``), and keeps moving while local rank 0 waits for the others;
    otherwise it shows this rank's own counts and the turn given to :meth:`set_turn`.

    The bar is drawn through `tqdm <https://tqdm.github.io>`_, only after the load has run for a second, and only
    where someone can see it: by default when ``file`` is a terminal. It is never drawn when ``enabled=False`` or when
    the environment variable ``LIGHTNING_FSDP_PROGRESS=0`` is set; ``enabled=True`` or ``LIGHTNING_FSDP_PROGRESS=1``
    draws it even when the output is not a terminal (a log file). Nothing is written when it is not drawn.

    Args:
        total_bytes: The bytes this rank will load, if known (the node's total is the sum over its ranks); totals
            found later are given to :meth:`set_totals`.
        total_tensors: The tensors this rank will load, if known.
        local_rank: The rank of this process within its node; only ``0`` draws.
        node_rank: The rank of the node, shown in the bar's description when given (useful with several nodes).
        enabled: ``None`` (default) to draw on a terminal only, ``True`` to draw on any output, ``False`` never.
        description: The bar's label.
        file: Where to draw; ``sys.stderr`` by default. Whether it is a terminal is asked through its ``isatty()``.

    Example::

        with LoadProgress(total_bytes=nbytes, total_tensors=len(names), local_rank=local_rank) as progress:
            for name in names:
                tensor = read(name)
                progress.update(tensor.nbytes)

    """

    def __init__(
        self,
        total_bytes: int | None = None,
        total_tensors: int | None = None,
        *,
        local_rank: int = 0,
        node_rank: int | None = None,
        enabled: bool | None = None,
        description: str = "Loading checkpoint",
        file: TextIO | None = None,
    ) -> None:
        self._file = sys.stderr if file is None else file
        self._shown = _progress_shown(enabled, local_rank, self._file)
        self._description = description if node_rank is None else f"{description} [node {node_rank}]"
        self._totals_known = total_bytes is not None or total_tensors is not None
        self._total_bytes = total_bytes or 0
        self._total_tensors = total_tensors or 0
        self._bytes_done = 0
        self._tensors_done = 0
        self._pending_bytes = 0
        self._pending_tensors = 0
        self._turn: tuple[int, int] | None = None
        self._fetched_reported = fetched_bytes()
        self._fetched_start = self._fetched_reported
        self._channel: NodeChannel | None = None
        self._snapshot: NodeSnapshot | None = None
        self._last_exchange = -math.inf
        self._bar: tqdm | None = None
        self._closed = False

    @property
    def shown(self) -> bool:
        """Whether this process draws the bar (local rank 0, output allowed, not turned off)."""
        return self._shown

    def update(self, bytes_done: int, tensors_done: int = 1) -> None:
        """Record that this rank loaded ``bytes_done`` more bytes in ``tensors_done`` more tensors."""
        self._bytes_done += bytes_done
        self._tensors_done += tensors_done
        self._pending_bytes += bytes_done
        self._pending_tensors += tensors_done
        self.refresh()

    def set_totals(self, total_bytes: int, total_tensors: int) -> None:
        """Set this rank's totals, once, if they were not given at construction; they join the node's totals."""
        self._totals_known = True
        self._total_bytes, self._total_tensors = total_bytes, total_tensors
        if self._channel is not None:
            self._channel.add_totals(total_bytes, total_tensors)
        self.refresh(force=True)

    def set_turn(self, index: int, count: int) -> None:
        """Show ``turn index+1/count`` (``index`` is 0-based), unless the node's turn comes from the schedule."""
        self._turn = (index, count)
        self.refresh()

    def refresh(self, force: bool = False) -> None:
        """Add this rank's new counts to the node's totals and redraw; at most every half second unless ``force``."""
        if self._closed:
            return
        now = time.monotonic()
        if self._channel is not None and (force or now - self._last_exchange >= _EXCHANGE_INTERVAL_S):
            fetched, self._fetched_reported = fetched_bytes() - self._fetched_reported, fetched_bytes()
            snapshot = self._channel.exchange(self._pending_bytes, self._pending_tensors, self._shown, fetched)
            self._pending_bytes = self._pending_tensors = 0
            self._last_exchange = now
            if snapshot is not None:
                self._snapshot = snapshot
        self._draw()

    def close(self) -> None:
        """Send the last counts to the node and leave the finished bar on the screen."""
        if self._closed:
            return
        self.refresh(force=True)
        self._closed = True
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "LoadProgress":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def attach(self, channel: NodeChannel) -> None:
        """Report to, and draw from, the totals of the node that ``channel`` keeps (the turn schedule calls this).

        The node's totals are shown once every rank of the node has added its own: at once if they were given at
        construction, otherwise with :meth:`set_totals`.

        """
        self._channel = channel
        if self._totals_known:
            channel.add_totals(self._total_bytes, self._total_tensors)
        self.refresh(force=True)

    def _draw(self) -> None:
        if not self._shown:
            return
        if self._channel is not None and self._snapshot is not None:
            snapshot = self._snapshot
            done_bytes = snapshot.bytes_done + self._pending_bytes
            done_tensors = snapshot.tensors_done + self._pending_tensors
            total_bytes, total_tensors, turn = snapshot.total_bytes, snapshot.total_tensors, snapshot.turn
            fetched = snapshot.fetched
        else:
            done_bytes, done_tensors = self._bytes_done, self._tensors_done
            total_bytes, total_tensors, turn = self._total_bytes, self._total_tensors, self._turn
            fetched = fetched_bytes() - self._fetched_start
        if self._bar is None:
            self._bar = tqdm(
                desc=self._description,
                total=total_bytes or None,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self._file,
                mininterval=0.5,
                delay=_SHOW_AFTER_S,
                miniters=1,
                dynamic_ncols=True,
            )
        bar = self._bar
        if total_bytes and bar.total != total_bytes:
            bar.total = total_bytes
        bar.bar_format = _BAR_FORMAT if bar.total else _COUNTER_FORMAT
        postfix = f"tensors {done_tensors}" + (f"/{total_tensors}" if total_tensors else "")
        if turn is not None:
            postfix += f", turn {turn[0] + 1}/{turn[1]}"
        if fetched:
            postfix += f", fetched {tqdm.format_sizeof(fetched, 'B', 1024)}"
        changed = postfix != bar.postfix
        bar.set_postfix_str(postfix, refresh=False)
        # ``update`` (not assigning ``n``) keeps tqdm's rate estimate right; it redraws at most every ``mininterval``.
        if not bar.update(done_bytes - bar.n) and changed and time.time() >= bar.start_t + _SHOW_AFTER_S:
            bar.refresh()


def _progress_shown(enabled: bool | None, local_rank: int, file: TextIO) -> bool:
    if local_rank != 0 or enabled is False:
        return False
    setting = os.environ.get(PROGRESS_ENV_VAR, "").strip().lower()
    if setting in _OFF_VALUES:
        return False
    if enabled or setting in _ON_VALUES:
        return True
    isatty = getattr(file, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:  # a closed file
        return False
