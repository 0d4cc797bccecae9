"""Capacity: the largest model whose full checkpoint (with Adam state) loads under a fixed memory cap for the job.

For each strategy family and implementation a :class:`Ladder` of model sizes (depths of the synthetic transformer at a
fixed width) doubles the depth until a load does not fit, then bisects between the last size that loaded and the
first that did not. Each load runs its ranks in a fresh memory cgroup (v1) with the cap as its limit; an OOM kill in
it means "does not fit" and leaves the rest of the machine alone. Each size's checkpoint is written once, loaded by
every implementation whose ladder asks for it, and deleted.

"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoints import STRATEGY_TITLES, write_checkpoints
from .output import _gb, _log
from .runner import Case, MemoryLimit, run_case

_CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
_counter = itertools.count()


@dataclass
class Ladder:
    """Sizes to try: ``start``, doubling while they fit (up to ``limit``), then ``bisections`` bisection steps.

    Sizes are integers (depths). :meth:`next_size` says what to try next (``None``: done); :meth:`record` takes the
    outcome. ``largest_fit`` and ``smallest_fail`` are the answer (``None``: no size fitted / none failed).

    """

    start: int
    limit: int
    bisections: int = 1
    largest_fit: int | None = None
    smallest_fail: int | None = None
    tried: list[tuple[int, bool]] = field(default_factory=list)
    _bisected: int = 0

    def next_size(self) -> int | None:
        if self.smallest_fail is None:  # still doubling
            if self.largest_fit is None:
                return self.start
            following = min(2 * self.largest_fit, self.limit)
            return following if following > self.largest_fit else None
        if self.largest_fit is None or self._bisected >= self.bisections:
            return None
        if self.smallest_fail - self.largest_fit <= 1:
            return None
        return (self.largest_fit + self.smallest_fail) // 2

    def record(self, size: int, fits: bool) -> None:
        if self.smallest_fail is not None and self.largest_fit is not None:
            self._bisected += 1
        self.tried.append((size, fits))
        if fits:
            self.largest_fit = size if self.largest_fit is None else max(self.largest_fit, size)
        else:
            self.smallest_fail = size if self.smallest_fail is None else min(self.smallest_fail, size)


def search(fits: Callable[[int], bool], start: int, limit: int, bisections: int = 1) -> Ladder:
    """Run one ladder to its end with ``fits(size)`` as the judge (what the capacity mode does for each case)."""
    ladder = Ladder(start, limit, bisections)
    while (size := ladder.next_size()) is not None:
        ladder.record(size, fits(size))
    return ladder


class CgroupLimit(MemoryLimit):
    """A child memory cgroup (v1) of this process's own, with ``limit_bytes`` as its limit (memory and memory+swap)."""

    def __init__(self, limit_bytes: int) -> None:
        self.path = _own_memory_cgroup() / f"bench_load_{os.getpid()}_{next(_counter)}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        memsw = self.path / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(limit_bytes))

    def wrap(self, command: list[str]) -> list[str]:
        script = 'echo $$ > "$1/cgroup.procs" || exit 97; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", str(self.path), *command]

    def close(self) -> dict[str, Any]:
        seen: dict[str, Any] = {"limit": "cgroup"}
        with contextlib.suppress(OSError, ValueError):
            seen["cgroup_peak_usage"] = int((self.path / "memory.max_usage_in_bytes").read_text())
            seen["cgroup_failcnt"] = int((self.path / "memory.failcnt").read_text())
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    seen["oom_kills"] = int(value)
        with contextlib.suppress(OSError):
            (self.path / "memory.force_empty").write_text("1")  # hand its page cache back before it goes
        with contextlib.suppress(OSError):
            self.path.rmdir()
        return seen


class UlimitLimit(MemoryLimit):
    """``ulimit -v`` per rank: a share of the cap as address space. Approximate (see :func:`_make_limit`)."""

    def __init__(self, per_rank_bytes: int) -> None:
        self.per_rank_kib = per_rank_bytes // 1024

    def wrap(self, command: list[str]) -> list[str]:
        return ["/bin/sh", "-c", 'ulimit -v "$1" || exit 97; shift; exec "$@"', "sh", str(self.per_rank_kib), *command]

    def close(self) -> dict[str, Any]:
        return {"limit": "ulimit -v"}


def _own_memory_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _CGROUP_ROOT / path.lstrip("/")
    raise OSError("no memory cgroup (v1) in /proc/self/cgroup")


def cgroups_writable() -> bool:
    """Whether this process may create a child memory cgroup and limit it (cgroup v1, usually as root)."""
    try:
        probe = CgroupLimit(2**40)
    except OSError:
        return False
    probe.close()
    return True


@dataclass
class _Probe:
    case: Case
    ladder: Ladder
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)


def _fits(result: dict[str, Any]) -> bool:
    """The load returned on every rank with the right values, or it returned and only the check after it ran out."""
    if "error" not in result:
        return bool(result.get("correct"))
    return _unverified(result)


def _unverified(result: dict[str, Any]) -> bool:
    # The check after the load gathers one FSDP unit (FSDP1) or one parameter (FSDP2) at a time: a few tens of MB
    # that can tip a job at the cap over it. The load itself fitted; its correctness is shown at the smaller sizes.
    return "error" in result and bool(result.get("loaded")) and bool(result.get("oom_kills"))


def _why_not(result: dict[str, Any]) -> str:
    if result.get("oom_kills"):
        return "OOM-killed"
    if result.get("timed_out"):
        return "timed out"
    if "error" in result:
        return "failed: " + result["error"][:120]
    return "loaded wrong values"


def run_capacity(args: argparse.Namespace, cases: list[Case]) -> tuple[str, dict[str, Any]]:
    """Every case's ladder, sizes shared: each size is written once, loaded by every ladder that asks, deleted."""
    use_cgroup = cgroups_writable()
    if not use_cgroup:
        _log(
            "    cannot create a memory cgroup (needs cgroup v1 and root): falling back to `ulimit -v` of the cap"
            f" divided by {args.ranks} per rank, which is approximate (it counts address space, mapped files too)"
        )
    probes = [_Probe(c, Ladder(args.capacity_start, args.capacity_max_depth, args.capacity_bisections)) for c in cases]
    width = args.capacity_width
    root = args.workdir / "capacity"
    sizes: dict[int, dict[str, Any]] = {}
    while pending := [(p, s) for p in probes if (s := p.ladder.next_size()) is not None]:
        depth = min(s for _, s in pending)
        size_dir = root / f"{width}x{depth}"
        meta = write_checkpoints(size_dir, width, depth, ["full"], rewrite=True)
        sizes[depth] = {"model_bytes": meta["model_bytes"], "file_bytes": meta["files"]["full"]["bytes"]}
        try:
            for probe, wanted in pending:
                if wanted != depth:
                    continue
                limit = CgroupLimit(args.cap) if use_cgroup else UlimitLimit(args.cap // args.ranks)
                label = f"{probe.case.strategy_title} {probe.case.label}"
                _log(f"    {label}, {width}x{depth} ({_gb(meta['model_bytes'])}) under {_gib(args.cap)} ...")
                run_dir = size_dir / "runs" / f"{probe.case.strategy}-{probe.case.implementation}"
                result = run_case(args, meta, probe.case, run_dir, limit)
                fits = _fits(result)
                probe.ladder.record(depth, fits)
                probe.outcomes[depth] = result
                peak = result.get("cgroup_peak_usage")
                _log(
                    f"      {('loaded (unchecked)' if _unverified(result) else 'loaded') if fits else _why_not(result)}"
                    + (f" in {result['load_seconds']:.1f} s" if "load_seconds" in result else "")
                    + (f", cgroup peak {_gb(peak)}" if peak else "")
                )
        finally:
            shutil.rmtree(size_dir, ignore_errors=True)
    return _render(args, probes, sizes, use_cgroup), _summary(probes, sizes)


def _size_text(depth: int | None, width: int, sizes: dict[int, dict[str, Any]]) -> str:
    if depth is None:
        return "none"
    size = sizes[depth]
    return f"{_gb(size['model_bytes'])} ({width}x{depth}, checkpoint {_gb(size['file_bytes'])})"


def _render(args: argparse.Namespace, probes: list[_Probe], sizes: dict[int, dict[str, Any]], cgroup: bool) -> str:
    width = args.capacity_width
    how = (
        "each load in a fresh memory cgroup (v1) whose limit (memory and memory+swap) is the cap, for all ranks"
        " together; a load that the kernel OOM-killed in it did not fit"
        if cgroup
        else f"`ulimit -v` of the cap divided by {args.ranks} per rank (no writable memory cgroup): approximate, it"
        " counts address space (mapped files, reservations), not memory"
    )
    lines = [
        f"### Capacity: the largest full checkpoint with Adam state that loads under {_gib(args.cap)}"
        f" ({args.ranks} ranks)",
        "",
        f"- Model sizes: {width}-wide blocks (two {width}x{4 * width} linears and a LayerNorm, fp32), the depth doubled"
        f" from {args.capacity_start} until a load did not fit, then {args.capacity_bisections} bisection step(s)"
        f" (at most depth {args.capacity_max_depth}).",
        f"- Limit: {how}. The page cache that the ranks fill counts against the limit too, but the kernel reclaims it"
        " before it kills.",
        "",
        "| strategy | implementation | largest that loaded | smallest that did not | why not | tried (depth: fits)"
        " | over upstream's |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    upstream = {p.case.strategy: p.ladder for p in probes if p.case.implementation == "upstream"}
    for probe in probes:
        ladder = probe.ladder
        why = _why_not(probe.outcomes[ladder.smallest_fail]) if ladder.smallest_fail is not None else ""
        ratio = ""
        if probe.case.implementation != "upstream" and probe.case.strategy in upstream:
            ratio = capacity_ratio(ladder, upstream[probe.case.strategy], sizes)
        tried = ", ".join(f"{d}: {_outcome(ok, probe.outcomes[d])}" for d, ok in ladder.tried)
        lines.append(
            f"| {STRATEGY_TITLES[probe.case.strategy]} | {probe.case.label}"
            f" | {_size_text(ladder.largest_fit, width, sizes)} | {_size_text(ladder.smallest_fail, width, sizes)}"
            f" | {why} | {tried} | {ratio} |"
        )
    lines += [
        "",
        "yes*: the load returned on every rank, then the check of its values (which gathers one FSDP unit or one"
        " parameter at a time) was OOM-killed: the load fitted, its values were not checked at that size.",
        "",
        "The ratio compares the model sizes that loaded; the true capacities lie between the largest that loaded and"
        " the smallest that did not, so a ratio is exact only to the ladder's step.",
    ]
    return "\n".join(lines) + "\n"


def _outcome(fits: bool, result: dict[str, Any]) -> str:
    return "no" if not fits else "yes*" if _unverified(result) else "yes"


def capacity_ratio(ours: Ladder, upstream: Ladder, sizes: dict[int, dict[str, Any]]) -> str:
    """Ours over upstream, by the model sizes that loaded, with the bounds that the ladders' steps leave."""

    def model(depth: int) -> float:
        return sizes[depth]["model_bytes"]

    if not ours.largest_fit or not upstream.largest_fit:
        return "n/a (a strategy loaded no size)"
    ratio = model(ours.largest_fit) / model(upstream.largest_fit)
    if upstream.smallest_fail is None:
        return f"n/a (upstream loaded every size up to {model(upstream.largest_fit) / 1e9:.2f} GB)"
    low = model(ours.largest_fit) / model(upstream.smallest_fail)
    if ours.smallest_fail is None:
        return f"at least {low:.1f}x (ours loaded every size tried)"
    high = model(ours.smallest_fail) / model(upstream.largest_fit)
    return f"{ratio:.1f}x (between {low:.1f}x and {high:.1f}x)"


def _summary(probes: list[_Probe], sizes: dict[int, dict[str, Any]]) -> dict[str, Any]:
    return {
        "sizes": sizes,
        "ladders": [
            {
                "case": vars(p.case),
                "largest_fit": p.ladder.largest_fit,
                "smallest_fail": p.ladder.smallest_fail,
                "tried": p.ladder.tried,
                "outcomes": {str(d): r for d, r in p.outcomes.items()},
            }
            for p in probes
        ],
    }


def _gib(value: int) -> str:
    return f"{value / 2**30:g} GiB"


def parse_bytes(text: str) -> int:
    """``6GiB``, ``3G``, ``512MiB``, ``800M`` or a number of bytes; G and M are binary, as memory limits are."""
    units = {"gib": 2**30, "g": 2**30, "mib": 2**20, "m": 2**20, "": 1}
    lowered = text.strip().lower()
    number = lowered.rstrip("gimb")
    unit = lowered[len(number) :]
    if unit not in units:
        raise argparse.ArgumentTypeError(f"expected a size such as 6GiB, 3G or 512MiB, got {text!r}")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 6GiB, 3G or 512MiB, got {text!r}") from None
    return int(value)
