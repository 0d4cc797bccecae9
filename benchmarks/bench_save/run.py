"""Save the same sharded model and Adam state with Lightning's full save and with lightning-fsdp's, and compare.

For each strategy family (FSDP1, FSDP2) and implementation, a fresh group of CPU rank processes (gloo) builds the
synthetic transformer of ``bench_load`` (``--size``), shards it, fills every rank's shards from a seed of its own
(so that two runs hold the same values), takes one Adam step, and saves ``{"model", "optimizer", "step"}`` with
``state_dict_type="full"`` / ``save_distributed_checkpoint=False``. Each rank measures its own save: the time between
two barriers, the peak of its anonymous resident memory (``RssAnon``, sampled every 5 ms by a thread) during the save,
and the bytes it wrote (``wchar`` of ``/proc/self/io``). The peak is given above two levels: above the process's
start (after its imports, before the model exists: the rank's shards and Adam state plus whatever the save adds; a
gather shows here as rank 0 holding several times what the others hold), and above base (what the rank held just
before the save: the save's own memory). "lightning" is the strategy's parent path
(Lightning's gather: FSDP's full state dict and ``FSDP.optim_state_dict`` on rank 0, which writes; for FSDP1 the CPU
variant of it that this package's strategy runs, since FSDP's CPU offload cannot run on a CPU model); "lightning-fsdp"
is this package's gather-free save. After its save, the lightning-fsdp run zeroes its model and optimizer state and
loads the file back with this package's ``fabric.load``: every rank's shards must hash as before the save. The parent
then compares the two files bit-exact (``torch.load(mmap=True)`` of Lightning's against Lightning's own lazy reader
of ours: keys in order, dtypes, shapes, bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from benchmarks.bench_load.checkpoints import PRESETS, Block, Model

from lightning_fsdp.saving.consolidated_write import _preallocate

_SAMPLE_S = 0.005


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _io(key: str) -> int:
    with open("/proc/self/io") as file:
        for line in file:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class _PeakAnon:
    """The peak of this process's ``RssAnon`` while it runs (bytes)."""

    def __init__(self) -> None:
        self.peak = _status_kb("RssAnon") * 1024
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_kb("RssAnon") * 1024)
            time.sleep(_SAMPLE_S)

    def __enter__(self) -> _PeakAnon:
        self._thread.start()
        return self

    def __exit__(self, *args: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kb("RssAnon") * 1024)


def _parallelize(model: Model, device_mesh: Any) -> Model:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    digest = hashlib.blake2b(digest_size=16)
    tensors = [_local(p.detach()) for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [_local(v) for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _train_step(fabric: Any, model: Any, optimizer: Any, width: int) -> None:
    fabric.backward(model(torch.randn(2, width)).sum())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _any_rank(fabric: Any, flag: bool) -> bool:
    return bool(fabric.all_reduce(torch.tensor(float(flag)), reduce_op="sum") > 0)


def _trained_one_step(cfg: dict[str, Any], rank: int, full: bool) -> tuple[Any, Any, Any]:
    """The benchmark's model and Adam, sharded on this rank with random weights, after one step; ``full`` chooses
    a full-checkpoint save (the strategy's ``state_dict_type="full"``, ``save_distributed_checkpoint=False``)."""
    from lightning.fabric import Fabric

    from lightning_fsdp import FSDPStrategy, ModelParallelStrategy

    ranks = cfg["ranks"]
    background = cfg.get("implementation") == "background"
    if cfg["strategy"] == "fsdp2":
        strategy = ModelParallelStrategy(
            _parallelize,
            data_parallel_size=ranks,
            tensor_parallel_size=1,
            save_distributed_checkpoint=not full,
            save_in_background=background,
        )
    else:
        strategy = FSDPStrategy(
            auto_wrap_policy={Block}, state_dict_type="full" if full else "sharded", save_in_background=background
        )
    fabric = Fabric(accelerator="cpu", devices=ranks, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = Model(cfg["width"], cfg["depth"])
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(1234 + rank)
    with torch.no_grad():
        for param in model.parameters():
            local = _local(param)
            local.copy_(torch.randn(local.shape, generator=generator) * 0.02)
    torch.manual_seed(0)
    fabric.backward(model(torch.randn(2, cfg["width"])).sum())
    optimizer.step()
    return fabric, model, optimizer


class _Phases:
    """Where a save's time goes on this rank: the exclusive time of each named function while it runs.

    The functions of the gather-free save (``saving.consolidated``) are wrapped for the measured save only; a call
    inside another one (a write inside the zip directory's) counts for the inner one alone, so the parts add up to
    the time spent in them, and "other" is the rest of the save's time (copies, Python, the barrier after it).

    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[list[float]] = []
        self._patches: list[Any] = []

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return original(*args, **kwargs)
            finally:
                start, children = self._stack.pop()
                elapsed = time.perf_counter() - start
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - children
                if self._stack:
                    self._stack[-1][1] += elapsed

        self._patches.append(mock.patch.object(owner, attribute, timed))

    def __enter__(self) -> _Phases:
        from lightning_fsdp.distributed.agreement import Agreement
        from lightning_fsdp.saving import consolidated, consolidated_write
        from lightning_fsdp.saving.crc import SparseCrc

        # each function where the save calls it from (the steps in `consolidated`, the writes in `consolidated_write`)
        self.wrap(consolidated, "_plan", "plan")
        self.wrap(consolidated, "_merge", "plan")
        self.wrap(consolidated, "_local_writes", "plan")
        self.wrap(consolidated, "_skeleton_state", "pickle and zip directory")
        self.wrap(consolidated, "_finish", "pickle and zip directory")
        for module in (consolidated, consolidated_write):
            self.wrap(module, "_pwrite_all", "write")
            self.wrap(module, "_fsync_directory", "fsync")
        self.wrap(SparseCrc, "add", "crc")
        self.wrap(consolidated.os, "fsync", "fsync")
        for method in ("agree", "any_rank", "__enter__", "__exit__"):
            self.wrap(Agreement, method, "agreement (waits for the other ranks)")
        self.wrap(consolidated, "_exchange", "agreement (waits for the other ranks)")
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *args: object) -> None:
        for patch in reversed(self._patches):
            patch.stop()


class _RecordedWrites(_Phases):
    """The byte ranges that this rank's gather-free save writes (``_pwrite_all``), in its order: the pattern floor's.

    Its patches sit inside those of :class:`_Phases` (entered after them), so the writes are timed as well.

    """

    def __init__(self) -> None:
        super().__init__()
        self.ranges: list[tuple[int, int]] = []

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        if attribute != "_pwrite_all":
            return
        original = getattr(owner, attribute)

        def recorded(fd: int, data: memoryview, offset: int) -> None:
            self.ranges.append((offset, data.nbytes))
            original(fd, data, offset)

        self._patches.append(mock.patch.object(owner, attribute, recorded))


class _TimedReservation:
    """When the thread that reserves the background saves' host memory ran (``HostBuffers._allocate``), if it did."""

    def __init__(self) -> None:
        self.start = self.end = 0.0

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def overlap(self, start: float, end: float) -> float:
        """The part of ``start``..``end`` during which the reservation ran."""
        return max(0.0, min(end, self.end) - max(start, self.start))

    def __enter__(self) -> _TimedReservation:
        from lightning_fsdp.saving.background import HostBuffers

        allocate = HostBuffers._allocate

        def timed(buffers: HostBuffers, nbytes: int, pin: bool) -> None:
            self.start = time.perf_counter()
            try:
                allocate(buffers, nbytes, pin)
            finally:
                self.end = time.perf_counter()

        self._patch = mock.patch.object(HostBuffers, "_allocate", timed)
        self._patch.start()
        return self

    def __exit__(self, *args: object) -> None:
        self._patch.stop()


def _worker(cfg: dict[str, Any], rank: int, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)

    import lightning_fsdp.saving

    start = _status_kb("RssAnon") * 1024
    reservation = _TimedReservation()
    with reservation:
        fabric, model, optimizer = _trained_one_step(cfg, rank, full=True)
    optimizer.zero_grad(set_to_none=True)
    # a second step, in every case (the files compare the same state): with background saves, the first step started
    # reserving their host memory in a thread, and a run trains on meanwhile, so this step is timed alongside it
    # (against the quiet steps at the end: what the reservation costs training); the first save then waits until the
    # reservation is done
    step_start = time.perf_counter()
    _train_step(fabric, model, optimizer, cfg["width"])
    fabric.barrier()
    step_while_reserving = time.perf_counter() - step_start
    arena_bytes = 0
    if cfg["implementation"] == "background":
        buffers = fabric.strategy._background_saves.buffers
        buffers._wait_reserved()
        arena_bytes = buffers.arena.numel() if buffers.arena is not None else 0
    before = _digest(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 1}
    fabric.barrier()
    base = _status_kb("RssAnon") * 1024
    wchar = _io("wchar")
    phases = _Phases()
    with _PeakAnon() as peak:
        start = time.perf_counter()
        if cfg["implementation"] == "lightning":
            with mock.patch.object(lightning_fsdp.saving, "save_full_checkpoint", return_value=False):
                fabric.save(cfg["path"], state)
        elif cfg["implementation"] == "lightning-fsdp":
            with phases, _RecordedWrites() as writes:
                fabric.save(cfg["path"], state)
        else:
            fabric.save(cfg["path"], state)
        fabric.barrier()
        seconds = time.perf_counter() - start
        steps_during = 0
        if cfg["implementation"] == "background":
            # training goes on while the file is written: count the steps until this rank's part of the save is done
            blocked = seconds
            # every rank steps while any rank's part is in flight: a step's collectives need every rank
            while _any_rank(fabric, fabric.strategy._background_saves.in_flight):
                _train_step(fabric, model, optimizer, cfg["width"])
                steps_during += 1
            fabric.strategy.wait_for_save()
            fabric.barrier()
            seconds = time.perf_counter() - start
    result = {
        "rank": rank,
        "seconds": seconds,
        "second_step": step_while_reserving,
        "steps_during": steps_during,
        "base": base,
        "peak_above_base": peak.peak - base,
        "peak_above_start": peak.peak - start,
        "written": _io("wchar") - wchar,
        "phases": phases.seconds,
    }
    if cfg["implementation"] == "background":
        result["reserve_seconds"] = reservation.seconds
        result["reserve_overlap"] = reservation.overlap(step_start, step_start + step_while_reserving)
        result["arena_bytes"] = arena_bytes
        result["blocked"] = blocked
        result["training_seconds"] = seconds - blocked
        # a second save, as every save after the first: the host buffers of the first are reused (no allocation)
        fabric.barrier()
        start = time.perf_counter()
        fabric.save(cfg["path"] + ".second", state)
        fabric.barrier()
        result["blocked_second"] = time.perf_counter() - start
        fabric.strategy.wait_for_save()
        fabric.barrier()
        if rank == 0:
            os.remove(cfg["path"] + ".second")
        # the same number of steps without a save in flight, for steps per second against
        start = time.perf_counter()
        for _ in range(max(steps_during, 1)):
            _train_step(fabric, model, optimizer, cfg["width"])
        fabric.barrier()
        result["quiet_steps_seconds"] = time.perf_counter() - start
    if cfg["implementation"] == "lightning-fsdp":
        result["writes"] = writes.ranges
        result["rounds"] = _rounds(fabric, cfg, state, writes.ranges, seconds, phases.seconds)
        with torch.no_grad():
            for param in model.parameters():
                _local(param).zero_()
            for param_state in optimizer.state.values():
                for value in param_state.values():
                    if isinstance(value, torch.Tensor):
                        _local(value).zero_()
        fabric.load(cfg["path"], {"model": model, "optimizer": optimizer, "step": 0})
        result["load_back_exact"] = _digest(model, optimizer) == before
    results.put(result)


def _write_floor(path: str, ranges: list[tuple[int, int]], total: int, reserve: bool) -> float:
    """Write ``ranges`` of a ``total``-byte file at ``path``, then ``fsync``: a floor under the save; this rank's time.

    Every rank of the default process group calls it with its own ranges. The bytes come from memory filled before the
    clock starts, by positioned writes of 64 MiB, as the gather-free save writes: no pickle, no CRC, no copy, no
    agreement. Rank 0 creates the file (with ``reserve``, it also reserves its blocks first, as the save does, and the
    other ranks wait for that as the save's do) and removes it after. Time between two barriers, as the saves.

    """
    import torch.distributed as dist

    chunk = 64 * 2**20
    buffer = memoryview(bytearray(os.urandom(1024) * (chunk // 1024)))  # held before the clock starts
    if dist.get_rank() == 0:
        with open(path, "wb"):
            pass
    dist.barrier()
    descriptor = os.open(path, os.O_WRONLY)
    try:
        dist.barrier()
        start = time.perf_counter()
        if reserve:
            if dist.get_rank() == 0:
                _preallocate(descriptor, total)
            dist.barrier()
        for offset, nbytes in ranges:
            stop = offset + nbytes
            while offset < stop:
                offset += os.pwrite(descriptor, buffer[: min(chunk, stop - offset)], offset)
        os.fsync(descriptor)
        dist.barrier()
        seconds = time.perf_counter() - start
    finally:
        os.close(descriptor)
    if dist.get_rank() == 0:
        os.remove(path)
    return seconds


def _synced(fabric: Any) -> None:
    """Write back every dirty page of the machine before the next measurement (each writes the file's 3.2 GB)."""
    if fabric.global_rank == 0:
        os.sync()
    fabric.barrier()


def _rounds(
    fabric: Any, cfg: dict[str, Any], state: dict[str, Any], ranges: list, first: float, first_phases: dict
) -> list[dict]:
    """``cfg["rounds"]`` rounds of the synchronous save and its two floors, in these processes, one after the other.

    Each round times the save and splits its time by function (the first round's is the measured save, ``first``,
    ``first_phases``), then the contiguous floor (each rank writes its own quarter of a file of the save's size) and
    the pattern floor (each rank writes the byte ranges that its save wrote, ``ranges``, in its order, into blocks
    reserved first). Taking the three within seconds of each other, in the same processes, lets a ratio be read per
    round: how fast a machine takes writes can change from one minute to the next (on the development machine, with
    the memory it gives the page cache: ``benchmarks/README.md``), which ratios of separate runs mistake for the
    save's cost.

    """
    total = os.stat(cfg["path"]).st_size
    rank, ranks = fabric.global_rank, fabric.world_size
    quarter = [(total * rank // ranks, total * (rank + 1) // ranks - total * rank // ranks)]
    floor_path = cfg["path"] + ".floor"
    rounds = []
    for index in range(cfg["rounds"]):
        seconds, phases = first, first_phases
        if index:
            _synced(fabric)
            timed = _Phases()
            with timed:
                start = time.perf_counter()
                fabric.save(cfg["path"], state)
                fabric.barrier()
                seconds = time.perf_counter() - start
            phases = timed.seconds
        _synced(fabric)
        floor = _write_floor(floor_path, quarter, total, reserve=False)
        _synced(fabric)
        pattern = _write_floor(floor_path, ranges, total, reserve=True)
        rounds.append({"save": seconds, "floor": floor, "pattern": pattern, "phases": phases})
    return rounds


def _run_case(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one case (:func:`_worker`) on fresh rank processes; their results, by rank."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    # every case starts with no dirty pages of the case before it being written back meanwhile (each writes 3.2 GB)
    os.sync()
    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    port = find_free_network_port()
    processes = [context.Process(target=_worker, args=(cfg, r, port, results)) for r in range(cfg["ranks"])]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    if any(process.exitcode != 0 for process in processes):
        raise RuntimeError(f"a rank failed in {cfg['strategy']}/{cfg.get('phase', 'save')}/{cfg['implementation']}")
    outcome = [results.get() for _ in processes]
    return sorted(outcome, key=lambda item: item["rank"])


def _identical(actual: Any, expected: Any, path: str = "") -> str | None:
    """The first difference between two loaded checkpoints, or ``None``."""
    if type(actual) is not type(expected):
        return f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        if (actual.dtype, actual.shape) != (expected.dtype, expected.shape):
            return f"{path}: {actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}"
        left, right = actual.contiguous().reshape(-1), expected.contiguous().reshape(-1)
        return None if torch.equal(left.view(torch.uint8), right.view(torch.uint8)) else f"{path}: bytes differ"
    if isinstance(expected, dict):
        if list(actual) != list(expected):
            return f"{path}: keys differ"
        for key in expected:
            difference = _identical(actual[key], expected[key], f"{path}.{key}")
            if difference:
                return difference
        return None
    if isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            return f"{path}: lengths differ"
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            difference = _identical(a, e, f"{path}[{index}]")
            if difference:
                return difference
        return None
    return None if actual == expected else f"{path}: {actual!r} != {expected!r}"


def _compare(ours: Path, reference: Path) -> str:
    from lightning.fabric.utilities.load import _lazy_load, _materialize_tensors

    difference = _identical(_materialize_tensors(_lazy_load(ours)), torch.load(reference, mmap=True, weights_only=True))
    return "bit-exact" if difference is None else f"DIFFERENT ({difference})"


def _background_row(strategy: str, runs: dict[str, list[dict[str, Any]]], verdict: str) -> str:
    ranks, synchronous = runs["background"], runs["lightning-fsdp"]
    blocked = max(rank["blocked"] for rank in ranks)
    blocked_second = max(rank["blocked_second"] for rank in ranks)
    complete = max(rank["seconds"] for rank in ranks)
    sync_seconds = max(rank["seconds"] for rank in synchronous)
    rank0 = ranks[0]
    if rank0["steps_during"]:
        during = rank0["steps_during"] / rank0["training_seconds"]
        quiet = rank0["steps_during"] / rank0["quiet_steps_seconds"]
        steps = f"{during:.2f} / {quiet:.2f} = {during / quiet:.2f}"
    else:
        steps = "n/a (the write ended before a step did)"
    return (
        f"| {strategy} | {blocked:.2f} s | {blocked_second:.2f} s | {complete:.1f} s | {sync_seconds:.1f} s |"
        f" {blocked / sync_seconds:.3f} / {blocked_second / sync_seconds:.3f} |"
        f" {rank0['steps_during']} | {steps} | {_gb(max(rank['arena_bytes'] for rank in ranks))}"
        f" ({max(rank['reserve_seconds'] for rank in ranks):.2f} s) | {_reserving_step(ranks, synchronous)} |"
        f" {_gb(max(rank['peak_above_base'] for rank in ranks))} | {verdict} |"
    )


def _reserving_step(ranks: list[dict[str, Any]], synchronous: list[dict[str, Any]]) -> str:
    """The second training step, alongside the reservation, against the same step of the synchronous save's run (no
    reservation there): the slowest rank's of each."""
    during = max(rank["second_step"] for rank in ranks)
    without = max(rank["second_step"] for rank in synchronous)
    overlap = min(rank["reserve_overlap"] for rank in ranks)
    return f"{during:.2f} s / {without:.2f} s = {during / without:.2f} (reserving during {overlap:.2f} s of it)"


def _ratio_of_rank_0(ranks: list[dict[str, Any]], key: str) -> float:
    return ranks[0][key] / max(max(rank[key] for rank in ranks[1:]), 1)


def _floor_lines(strategy: str, rounds: list[dict[str, float]], ranks: int, size: int) -> list[str]:
    """The synchronous save against its floors: each round's times and ratios, and their medians."""

    def listed(key: str) -> str:
        return ", ".join(f"{item[key]:.2f}" for item in rounds) + " s"

    def ratios(key: str) -> tuple[str, float]:
        values = [item["save"] / item[key] for item in rounds]
        return ", ".join(f"{value:.2f}x" for value in values), statistics.median(values)

    per_round, median = ratios("floor")
    per_round_pattern, median_pattern = ratios("pattern")
    return [
        f"- {strategy}: {len(rounds)} round(s), each the synchronous save, then the write floor ({ranks} processes"
        f" writing the file's {_gb(size)} in contiguous parts by positioned writes, then `fsync`), then the pattern"
        f" floor (the same processes writing the save's own byte ranges in its order, into blocks reserved first),"
        f" in the same processes: saves {listed('save')}; floors {listed('floor')}; pattern floors"
        f" {listed('pattern')}",
        f"- {strategy}: the synchronous save over the write floor of its round: {per_round}, median {median:.2f}x"
        f" (target <= 1.5: {'met' if median <= 1.5 else 'NOT met'}); over the pattern floor: {per_round_pattern},"
        f" median {median_pattern:.2f}x; the pattern floor over the write floor, median"
        f" {statistics.median(item['pattern'] / item['floor'] for item in rounds):.2f}x",
    ]


def _split(seconds: float, phases: dict[str, float]) -> str:
    """A save's ``seconds`` split by the functions that :class:`_Phases` timed, and the rest."""
    parts = sorted(phases.items(), key=lambda item: -item[1])
    other = seconds - sum(phases.values())
    return ", ".join(
        [
            *(f"{name} {part:.2f} s" for name, part in parts),
            f"other (copies, Python, the barrier after it) {other:.2f} s",
        ]
    )


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB" if abs(value) >= 1e8 else f"{value / 1e6:.1f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_save", description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1gb", choices=sorted(PRESETS))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--strategy", default="both", choices=("fsdp1", "fsdp2", "both"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_save"))
    parser.add_argument("--output", type=Path, default=None, help="also write the Markdown table here")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="how many rounds of the synchronous save, the write floor and the pattern floor (medians count)",
    )
    parser.add_argument(
        "--keep-files",
        action="store_true",
        help="keep the checkpoints in the workdir (by default each strategy's are deleted once measured: 3.2 GB each"
        " for the 1gb size)",
    )
    args = parser.parse_args(argv)
    width, depth = PRESETS[args.size]
    args.workdir.mkdir(parents=True, exist_ok=True)
    strategies = ("fsdp1", "fsdp2") if args.strategy == "both" else (args.strategy,)
    rows = [
        "| strategy | save | time | rank 0 peak anon above start | other ranks' (max) | rank 0 peak anon above base |"
        " other ranks' (max) | written (wchar), rank 0 | written (wchar), each other rank | file | load-back |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    targets = []
    background_rows = [
        "| strategy | training blocked, first save | blocked, next saves | file complete after | synchronous save |"
        " blocked / synchronous (first / next) | steps during the write (rank 0) | steps/s during / without a save |"
        " host memory reserved at the first step (its thread's time, max rank) | the second training step, during"
        " the reservation / in the synchronous save's run | host memory above base during the save (max rank) |"
        " file vs Lightning's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    measured: dict[str, Any] = {}
    rounds: dict[str, list[dict[str, float]]] = {}
    file_bytes: dict[str, int] = {}
    for strategy in strategies:
        runs = {}
        for implementation in ("lightning", "lightning-fsdp", "background"):
            path = args.workdir / f"{strategy}-{implementation}.ckpt"
            cfg = {
                "strategy": strategy,
                "implementation": implementation,
                "ranks": args.ranks,
                "width": width,
                "depth": depth,
                "path": str(path),
                "rounds": args.rounds,
            }
            print(f"bench_save: {strategy} {implementation} ...", flush=True)
            runs[implementation] = _run_case(cfg)
        ours, reference = args.workdir / f"{strategy}-lightning-fsdp.ckpt", args.workdir / f"{strategy}-lightning.ckpt"
        verdict = _compare(ours, reference)
        background_verdict = _compare(args.workdir / f"{strategy}-background.ckpt", reference)
        background_rows.append(_background_row(strategy, runs, background_verdict))
        for implementation, ranks in runs.items():
            if implementation == "background":
                continue
            seconds = max(rank["seconds"] for rank in ranks)
            others = [rank["peak_above_base"] for rank in ranks[1:]]
            others_start = [rank["peak_above_start"] for rank in ranks[1:]]
            path = args.workdir / f"{strategy}-{implementation}.ckpt"
            load_back = (
                "n/a"
                if implementation == "lightning"
                else ("exact on every rank" if all(r["load_back_exact"] for r in ranks) else "DIFFERENT")
            )
            rows.append(
                f"| {strategy} | {implementation} | {seconds:.1f} s | {_gb(ranks[0]['peak_above_start'])} |"
                f" {_gb(max(others_start))} | {_gb(ranks[0]['peak_above_base'])} |"
                f" {_gb(max(others))} | {_gb(ranks[0]['written'])} |"
                f" {', '.join(_gb(r['written']) for r in ranks[1:])} | {_gb(path.stat().st_size)} |"
                f" {load_back}{'; file vs Lightning: ' + verdict if implementation == 'lightning-fsdp' else ''} |"
            )
        ours_ranks, lightning_ranks = runs["lightning-fsdp"], runs["lightning"]
        ratio_memory = _ratio_of_rank_0(ours_ranks, "peak_above_start")
        extra = ours_ranks[0]["peak_above_base"] - max(r["peak_above_base"] for r in ours_ranks[1:])
        lightning_seconds = max(r["seconds"] for r in lightning_ranks)
        ratio_time = max(r["seconds"] for r in ours_ranks) / lightning_seconds
        # each round's slowest rank, as every time of the table
        rounds[strategy] = [
            {key: max(rank["rounds"][index][key] for rank in ours_ranks) for key in ("save", "floor", "pattern")}
            for index in range(args.rounds)
        ]
        median_save = statistics.median(item["save"] for item in rounds[strategy])
        targets.append(
            f"- {strategy}: rank 0's peak anonymous memory above start / other ranks' largest = {ratio_memory:.2f}"
            f" (target <= 1.2: {'met' if ratio_memory <= 1.2 else 'NOT met'}; Lightning's gather:"
            f" {_ratio_of_rank_0(lightning_ranks, 'peak_above_start'):.2f}); the save's own memory (above base),"
            f" rank 0 minus the other ranks' largest = {_gb(extra)}, rank 0 / other ranks' largest ="
            f" {_ratio_of_rank_0(ours_ranks, 'peak_above_base'):.2f}; time / Lightning's = {ratio_time:.2f}"
            f" (target <= 0.5: {'met' if ratio_time <= 0.5 else 'NOT met'}; the median of the {args.rounds} rounds'"
            f" saves, {median_save:.1f} s, / Lightning's = {median_save / lightning_seconds:.2f})"
        )
        targets.extend(_floor_lines(strategy, rounds[strategy], args.ranks, ours.stat().st_size))
        # where each round's save went on its slowest rank
        slowest_in_round = [
            max(ours_ranks, key=lambda r, i=index: r["rounds"][i]["save"]) for index in range(args.rounds)
        ]
        targets.append(
            f"- {strategy}: where each round's save went on its slowest rank: "
            + "; ".join(
                f"round {index + 1} (rank {rank['rank']}), {rank['rounds'][index]['save']:.2f} s:"
                f" {_split(rank['rounds'][index]['save'], rank['rounds'][index]['phases'])}"
                for index, rank in enumerate(slowest_in_round)
            )
        )
        measured[strategy] = runs
        file_bytes[strategy] = ours.stat().st_size
        if not args.keep_files:
            for implementation in runs:
                (args.workdir / f"{strategy}-{implementation}.ckpt").unlink(missing_ok=True)
    text = "\n".join(
        [*rows, "", *targets, "", "Saving in the background (`save_in_background=True`):", "", *background_rows]
    )
    text += "\n"
    print(text)
    summary = {"runs": measured, "rounds": rounds, "file_bytes": file_bytes}
    (args.workdir / "results.json").write_text(json.dumps(summary, indent=1))
    if args.output is not None:
        args.output.write_text(text)
    return 0
