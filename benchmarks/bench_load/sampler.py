"""Reading ``/proc``: the memory sampler, and the counters that a rank reads of itself (its I/O, its peak RSS).

The sampler reads the memory of every rank process in background threads (see the package docstring).

"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any


def _read_fields(path: str, keys: tuple[str, ...]) -> dict[str, int] | None:
    """The first number after ``key:`` on the lines of a ``/proc`` file (kB in ``status``, bytes in ``io``)."""
    try:
        with open(path, "rb") as file:
            text = file.read().decode()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in keys:
            values[name] = int(rest.split()[0])
    return values


def _write_proc(path: str, text: str) -> bool:
    """Write to a kernel control file under ``/proc``; return whether the kernel took it (some need root)."""
    try:
        with open(path, "w") as file:
            file.write(text)
        return True
    except OSError:
        return False


def _read_io() -> dict[str, int] | None:
    """This process's I/O counters (all its threads, also ended ones), or ``None`` without I/O accounting.

    ``read_bytes``: bytes this process made the kernel fetch from storage (page-cache misses, read-ahead and the
    faults on memory-mapped files included). ``rchar``: bytes that its ``read``-family calls returned, page-cache hits
    included; not what memory-mapped pages bring in, and not sockets read with ``recv`` (gloo's traffic).

    """
    values = _read_fields("/proc/self/io", _IO_KEYS)
    return values if values and len(values) == len(_IO_KEYS) else None


_IO_KEYS = ("read_bytes", "rchar")
_STATUS_KEYS = ("RssAnon", "RssFile", "RssShmem")
_ROLLUP_KEYS = ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_cpu_seconds() -> float:
    """CPU time that processes of the whole machine ran since boot (user, nice and system time), in seconds.

    Interrupt time is left out: it is mostly the ranks' own loopback traffic and disk reads.

    """
    with open("/proc/stat") as file:
        fields = file.readline().split()
    return sum(int(v) for v in fields[1:4]) / _CLOCK_TICKS


def _process_cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime of all threads


@dataclass
class _PssReading:
    t: float
    pss_anon: int
    pss_file: int
    pss_shmem: int
    rss_anon: tuple[int, int]  # RssAnon just before and just after reading smaps_rollup
    rss_file: int
    rss_shmem: int


@dataclass
class _Tick:
    t: float
    rows: list[tuple[int, ...]]  # per rank: RssAnon, RssFile, RssShmem (kB)
    cached: int  # the node's page cache (kB)
    busy_cpu: float  # seconds, whole machine
    ranks_cpu: float  # seconds, the ranks
    own_cpu: float  # seconds, this process


@dataclass
class Sampler:
    """Reads the memory of the rank processes in background threads (see the module docstring)."""

    pids: list[int]
    interval: float = 0.010
    pss_duty: float = 0.2
    ticks: list[_Tick] = field(default_factory=list)
    readings: list[list[_PssReading]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.readings = [[] for _ in self.pids]
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._fast, daemon=True),
            threading.Thread(target=self._pss, daemon=True),
        ]

    def start(self) -> Sampler:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    @staticmethod
    def _raise_priority(realtime: bool) -> None:
        # The ranks keep every core busy; a sampler that waits for a core misses peaks. The fast sampler does a few
        # microseconds of work per tick, so a real-time priority cannot starve anything.
        tid = threading.get_native_id()
        with contextlib.suppress(OSError, AttributeError):
            if realtime:
                os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
                return
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, -10)

    def _fast(self) -> None:
        self._raise_priority(realtime=True)
        next_tick = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            rows = []
            for pid in self.pids:
                status = _read_fields(f"/proc/{pid}/status", _STATUS_KEYS) or {}
                rows.append(tuple(status.get(key, 0) for key in _STATUS_KEYS))
            cached = (_read_fields("/proc/meminfo", ("Cached",)) or {}).get("Cached", 0)
            ranks_cpu = sum(_process_cpu_seconds(pid) for pid in self.pids)
            own = os.times()
            self.ticks.append(_Tick(now, rows, cached, _busy_cpu_seconds(), ranks_cpu, own.user + own.system))
            next_tick = max(next_tick + self.interval, time.monotonic())
            self._stop.wait(next_tick - time.monotonic())

    def _pss(self) -> None:
        self._raise_priority(realtime=False)
        index = 0
        while not self._stop.is_set():
            pid = self.pids[index]
            start = time.monotonic()
            before = _read_fields(f"/proc/{pid}/status", _STATUS_KEYS)
            rollup = _read_fields(f"/proc/{pid}/smaps_rollup", _ROLLUP_KEYS)
            after = _read_fields(f"/proc/{pid}/status", _STATUS_KEYS)
            took = time.monotonic() - start
            if before and after and rollup and "Pss_Anon" in rollup:
                self.readings[index].append(
                    _PssReading(
                        start + took / 2,
                        rollup["Pss_Anon"],
                        rollup["Pss_File"],
                        rollup.get("Pss_Shmem", 0),
                        (before["RssAnon"], after["RssAnon"]),
                        (before["RssFile"] + after["RssFile"]) // 2,
                        (before["RssShmem"] + after["RssShmem"]) // 2,
                    )
                )
            index = (index + 1) % len(self.pids)
            # Keep the share of a core that page-table walks take (and the lock they hold in the rank) bounded.
            self._stop.wait(max(0.005, took * (1 / self.pss_duty - 1)))

    def series(self, node_of: list[int]) -> list[dict[str, Any]]:
        """Per tick: total anonymous, file-backed and shmem (PSS estimates), and per-node values, in bytes."""
        times = [[r.t for r in readings] for readings in self.readings]
        out = []
        for tick in self.ticks:
            anon = file = shmem = rss = 0.0
            node_anon: dict[int, float] = {}
            node_file: dict[int, float] = {}
            for i, (rss_anon, rss_file, rss_shmem) in enumerate(tick.rows):
                rss += rss_anon + rss_file + rss_shmem
                reading = _nearest(self.readings[i], times[i], tick.t)
                file_share = reading.pss_file / reading.rss_file if reading and reading.rss_file else 1.0
                shmem_share = reading.pss_shmem / reading.rss_shmem if reading and reading.rss_shmem else 1.0
                anon += rss_anon
                file += rss_file * min(file_share, 1.0)
                shmem += rss_shmem * min(shmem_share, 1.0)
                node_anon[node_of[i]] = node_anon.get(node_of[i], 0) + rss_anon
                node_file[node_of[i]] = node_file.get(node_of[i], 0) + rss_file * min(file_share, 1.0)
            out.append(
                {
                    "t": tick.t,
                    "anon": anon * 1024,
                    "file": file * 1024,
                    "shmem": shmem * 1024,
                    "pss": (anon + file + shmem) * 1024,
                    "rss": rss * 1024,
                    "cached": tick.cached * 1024,
                    "busy_cpu": tick.busy_cpu,
                    "ranks_cpu": tick.ranks_cpu,
                    "own_cpu": tick.own_cpu,
                    "node_anon": {k: v * 1024 for k, v in node_anon.items()},
                    "node_file": {k: v * 1024 for k, v in node_file.items()},
                }
            )
        return out


def _nearest(readings: list[_PssReading], times: list[float], t: float) -> _PssReading | None:
    if not readings:
        return None
    index = bisect.bisect_left(times, t)
    candidates = [readings[i] for i in (index - 1, index) if 0 <= i < len(readings)]
    return min(candidates, key=lambda r: abs(r.t - t))
