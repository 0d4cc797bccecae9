"""One measured load: fresh rank processes under the sampler, and what their memory and results say."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoints import FORMAT_TITLES, STRATEGY_TITLES
from .object_store import NODE_APP_ID, REMOTE_IMPLEMENTATIONS
from .output import _log
from .sampler import Sampler, _PssReading, _write_proc

if TYPE_CHECKING:
    from .object_store import ObjectStore

_BUSY_MACHINE = 0.25  # cores used by other processes during a load above which its time is marked
_COLD_FILE = "cold (the checkpoint's pages evicted)"  # `--cache file`


@dataclass
class Case:
    format: str
    implementation: str  # "upstream", "core", "ours", or one of the remote implementations (`REMOTE_IMPLEMENTATIONS`)
    load_concurrency: int | str | None = None
    label: str = ""
    unavailable: str | None = None
    weights_only: bool = True
    strategy: str = "fsdp"  # "fsdp" (`FSDPStrategy`, FSDP1) or "fsdp2" (`ModelParallelStrategy`, `fully_shard`)

    @property
    def title(self) -> str:
        """The checkpoint and how it is unpickled, as the tables name it."""
        return FORMAT_TITLES[self.format] + ("" if self.weights_only else ", `weights_only=False`")

    @property
    def strategy_title(self) -> str:
        return STRATEGY_TITLES[self.strategy]

    @property
    def key(self) -> tuple[str, str, bool, str, int | str | None]:
        return self.strategy, self.format, self.weights_only, self.implementation, self.load_concurrency


class MemoryLimit:
    """Confines the rank processes of a run: a memory cgroup (v1) for the whole job, or ``ulimit -v`` per rank.

    Each rank enters the limit itself before it starts Python (a shell that moves its own pid into the cgroup, or sets
    its address-space limit, then replaces itself with the rank), so nothing else of this process is confined.

    """

    def wrap(self, command: list[str]) -> list[str]:
        raise NotImplementedError

    def close(self) -> dict[str, Any]:
        """Remove the limit once the ranks have exited; return what it saw (peak usage, OOM kills)."""
        return {}


def _drop_page_cache() -> bool:
    os.sync()
    return _write_proc("/proc/sys/vm/drop_caches", "1\n")


def _evict_from_page_cache(paths: list[Path]) -> bool:
    """Drop only these files' pages from the page cache (no root needed, other processes keep theirs)."""
    os.sync()
    try:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except (OSError, AttributeError):
        return False
    return True


def _warm_page_cache(path: Path) -> None:
    with open(path, "rb") as file:
        while file.read(64 * 2**20):
            pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _warm_files(entry: dict[str, Any]) -> list[Path]:
    """The files of a checkpoint: the file itself, or an index and its shards."""
    return [Path(entry["path"]), *(Path(p) for p in entry.get("parts", []))]


def run_case(
    args: argparse.Namespace,
    meta: dict[str, Any],
    case: Case,
    run_dir: Path,
    limit: MemoryLimit | None = None,
    store: ObjectStore | None = None,
) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("rank-*.json"):
        stale.unlink()
    remote = store is not None and case.implementation in REMOTE_IMPLEMENTATIONS
    per_node = args.ranks // args.nodes
    k = case.load_concurrency
    cfg = {
        "strategy": case.strategy,
        "implementation": case.implementation,
        "format": case.format,
        "path": meta["files"][case.format]["path"],
        "width": meta["config"]["width"],
        "depth": meta["config"]["depth"],
        "key_order": meta["key_order"],
        "ranks_per_node": per_node,
        "nodes": args.nodes,
        "settle": args.settle,
        "run_dir": str(run_dir),
        "load_concurrency": per_node if k == "all" else k,
        "weights_only": case.weights_only,
        "remote_url": store.urls[case.format] if remote else None,
        "storage_options": store.storage_options if remote else None,
        "device": getattr(args, "device", "cpu"),
    }
    cfg_path = run_dir / "config.json"
    cfg_path.write_text(json.dumps(cfg))

    cache = "warm"
    files = _warm_files(meta["files"][case.format])
    if args.cache == "cold":
        cache = "cold" if _drop_page_cache() else "warm (could not drop the page cache)"
    elif args.cache == "file":
        cache = _COLD_FILE if _evict_from_page_cache(files) else "warm (could not evict the checkpoint)"
    if not cache.startswith("cold"):
        for path in files:
            _warm_page_cache(path)

    if remote:
        store.reset()
    port = _free_port()
    threads = max(1, (os.cpu_count() or 1) // per_node)
    processes, node_of = [], []
    for rank in range(args.ranks):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "NODE_RANK": str(rank // per_node),
            "LOCAL_RANK": str(rank % per_node),
            "WORLD_SIZE": str(args.ranks),
            "OMP_NUM_THREADS": str(threads),  # what torchrun sets: cores divided among the node's ranks
            "PYTHONWARNINGS": "ignore",
        }
        if remote:
            env["AWS_SDK_UA_APP_ID"] = NODE_APP_ID.format(rank // per_node)  # the server counts per node by it
        if remote and case.implementation == "master-s3":
            # Lightning master's own code, first on the path; its `get_filesystem(url)` passes no options, so the
            # endpoint and the credentials reach botocore through the environment, as a user would configure them.
            env["PYTHONPATH"] = os.pathsep.join([str(args.lightning_master), env.get("PYTHONPATH", "")])
            env.update(store.environment)
        log = open(run_dir / f"rank-{rank}.log", "w")  # noqa: SIM115 (closed below)
        command = [sys.executable, str(Path(__file__).resolve().parent), "--_worker", str(cfg_path)]
        if limit is not None:
            command = limit.wrap(command)
        processes.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        node_of.append(rank // per_node)
    sampler = Sampler([p.pid for p, _ in processes], interval=args.interval / 1000).start()

    deadline = time.monotonic() + args.timeout
    failed_at = None
    while time.monotonic() < deadline:
        codes = [p.poll() for p, _ in processes]
        if all(code is not None for code in codes):
            break
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 10:
            break  # the other ranks wait in a collective that will never complete
        time.sleep(0.05)
    timed_out = any(p.poll() is None for p, _ in processes) and failed_at is None
    for process, log in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
        log.close()
    sampler.stop()
    confined = limit.close() if limit is not None else {}
    served = _served(store.counters(), args.nodes) if remote else {}

    ranks = []
    for rank in range(args.ranks):
        path = run_dir / f"rank-{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.is_file() else {"rank": rank, "phase": "?"})
    result: dict[str, Any] = {
        "cache": cache,
        "page_cache_dropped": cache.startswith("cold"),
        "ranks_per_node": per_node,
        "threads_per_rank": threads,
        "exit_codes": [p.returncode for p, _ in processes],
        "timed_out": timed_out,
        **confined,
        **served,
    }
    errors = [f"rank {r['rank']}: {r['error']}" for r in ranks if "error" in r]
    if errors or timed_out or any(r.get("phase") != "done" for r in ranks):
        phase = next((r["phase"] for r in ranks if "error" in r), ranks[0].get("phase"))
        reason = errors[0] if errors else ("timed out" if timed_out else "a rank exited without a result")
        result["error"] = f"failed during {phase}: {reason}"
        result["failed_phase"] = phase
        # Every rank passed the barriers after the load, so every rank's load returned.
        result["loaded"] = phase in ("verify", "done")
        result["logs"] = str(run_dir)
        _log(f"    {result['error']} (logs in {run_dir})")
        return result
    result.update(_measure(sampler, node_of, ranks, meta, case))
    return result


def _served(counters: dict[str, Any], nodes: int) -> dict[str, Any]:
    """What the S3 server sent each node during the run (bodies of ``GET`` responses) and its requests."""
    per_node = [counters["nodes"].get(str(node), {"get_bytes": 0, "requests": 0}) for node in range(nodes)]
    other = counters["nodes"].get("other", {"get_bytes": 0, "requests": 0})
    return {
        "served_per_node": [n["get_bytes"] for n in per_node],
        "requests_per_node": [n["requests"] for n in per_node],
        "served_untagged": other["get_bytes"],
        "server_peak_rss": counters["peak_rss"],
        "server_cpu_seconds": counters["cpu_seconds"],
    }


def _measure(
    sampler: Sampler, node_of: list[int], ranks: list[dict[str, Any]], meta: dict[str, Any], case: Case
) -> dict[str, Any]:
    series = sampler.series(node_of)

    def window(start: float, end: float) -> list[dict[str, Any]]:
        inside = [s for s in series if start <= s["t"] <= end]
        if inside:
            return inside
        # A window shorter than the sampling interval: the nearest tick on each side.
        before = [s for s in series if s["t"] < start][-1:]
        after = [s for s in series if s["t"] > end][:1]
        return before + after

    base_start = max(r["t_base_start"] for r in ranks)
    base_end = min(r["t_base_end"] for r in ranks)
    load_start = min(r["t_load_start"] for r in ranks)
    load_end = max(r["t_load_end"] for r in ranks)
    after_start = load_end + 0.3 * (min(r["t_after_end"] for r in ranks) - load_end)
    after_end = min(r["t_after_end"] for r in ranks)
    base = window(base_start + 0.3 * (base_end - base_start), base_end)
    load = window(load_start, load_end)
    after = window(after_start, after_end)

    def median(samples: list[dict[str, Any]], key: str) -> float:
        return statistics.median(s[key] for s in samples)

    def peak(key: str) -> float:
        return max(s[key] for s in load)

    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(load)]
    out: dict[str, Any] = {
        "load_seconds": max(r["load_seconds"] for r in ranks),
        "base_pss": median(base, "pss"),
        "base_anon": median(base, "anon"),
        "base_file": median(base, "file"),
        "peak_pss": peak("pss"),
        "peak_anon": peak("anon"),
        "peak_file": peak("file"),
        "peak_shmem": peak("shmem"),
        "after_pss": median(after, "pss"),
        "page_cache_growth": max(0.0, peak("cached") - median(base, "cached")),
        "peak_node_anon": max(max(s["node_anon"].values()) for s in load),
        "peak_node_file": max(max(s["node_file"].values()) for s in load),
        "samples_in_load": len(load),
        "max_sample_gap_ms": 1000 * max(gaps, default=0.0),
        "gaps_over_20ms": sum(gap > 0.020 for gap in gaps),
        "peak_rss_sampled": peak("rss"),
    }
    # What sampling can have missed: the kernel's per-rank RSS peaks, summed, bound the peak of the ranks' total RSS
    # from above (tightly when the ranks peak together, loosely when they take turns).
    if all(r.get("peak_rss_reset") for r in ranks):
        out["peak_rss_sum_of_rank_peaks"] = sum(r["peak_rss"] for r in ranks)
    # How busy the machine was with other work during the load (a shared machine makes times noisy).
    first, last = load[0], load[-1]
    span = last["t"] - first["t"]
    if span > 0:
        others = (last["busy_cpu"] - first["busy_cpu"]) - (last["ranks_cpu"] - first["ranks_cpu"])
        others -= last["own_cpu"] - first["own_cpu"]
        out["other_cpu_cores"] = max(0.0, others / span)
        out["ranks_cpu_cores"] = (last["ranks_cpu"] - first["ranks_cpu"]) / span
    out["above_base"] = out["peak_pss"] - out["base_pss"]
    # Anonymous memory the load added, less Adam's state, which every load of the optimizer must allocate (the ranks
    # compute it from their parameter shards: 2 tensors of the shard's size and a step each).
    out["optimizer_state_bytes"] = sum(r.get("optimizer_state_bytes", 0) for r in ranks)
    if any("optimizer_state_allocated" in r for r in ranks):
        out["optimizer_state_allocated"] = sum(r.get("optimizer_state_allocated", 0) for r in ranks)
    out["anon_above_base"] = out["peak_anon"] - out["base_anon"]
    out["anon_above_base_less_optimizer"] = out["anon_above_base"] - out["optimizer_state_bytes"]
    out["file_above_base"] = out["peak_file"] - out["base_file"]

    # How good the fast series is: anonymous memory of status vs smaps_rollup, and how often PSS was read.
    readings = [r for per_rank in sampler.readings for r in per_rank]
    if readings:
        # `Pss_Anon` against `RssAnon`, in the readings taken while anonymous memory stood still (the page-table walk
        # takes tens of milliseconds, and a tensor allocated and freed meanwhile is counted by one and not the other).
        steady = [r for r in readings if abs(r.rss_anon[0] - r.rss_anon[1]) <= 1024 + r.rss_anon[0] // 1000]
        out["steady_anon_readings"] = len(steady)
        out["max_anon_mismatch"] = 1024 * max(
            (max(0, min(r.rss_anon) - r.pss_anon, r.pss_anon - max(r.rss_anon)) for r in steady), default=0
        )
        intervals = [b.t - a.t for per_rank in sampler.readings for a, b in itertools.pairwise(per_rank)]
        out["pss_interval_ms"] = 1000 * statistics.median(intervals) if intervals else None
        # The peak of the exact PSS readings (each rank's latest one, summed), as a cross-check of the estimate.
        latest: dict[int, _PssReading] = {}
        merged = sorted((r.t, i, r) for i, per_rank in enumerate(sampler.readings) for r in per_rank)
        exact_peak_file = 0.0
        for t, i, reading in merged:
            latest[i] = reading
            if load_start <= t <= load_end and len(latest) == len(sampler.readings):
                exact_peak_file = max(exact_peak_file, sum(r.pss_file for r in latest.values()) * 1024)
        out["peak_file_exact_readings"] = exact_peak_file

    out.update(_reads(ranks, node_of))
    out.update(_gpu_memory(ranks))
    out.update(_correctness(ranks, meta, case))
    return out


def _gpu_memory(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """GPU memory of the load (``--device cuda``), from each rank's allocator: the largest of the GPUs, in bytes.

    Each rank has a GPU of its own, so the figures are per GPU: base before the load, peak during it
    (``torch.cuda.max_memory_allocated``, reset before the load), and what stays allocated after it.
    """
    if not all("gpu_peak" in r for r in ranks):
        return {}
    return {
        "gpu_base": max(r["gpu_base"] for r in ranks),
        "gpu_peak": max(r["gpu_peak"] for r in ranks),
        "gpu_above_base": max(r["gpu_peak"] - r["gpu_base"] for r in ranks),
        "gpu_after": max(r["gpu_after"] for r in ranks),
    }


def _reads(ranks: list[dict[str, Any]], node_of: list[int]) -> dict[str, Any]:
    """What the ranks read during the load (``/proc/<pid>/io``), per rank and summed per node, in bytes."""
    if not all("io" in r for r in ranks):
        return {}
    out: dict[str, Any] = {}
    if all("fetched" in r for r in ranks):
        out["fetched_per_node"] = [0] * (max(node_of) + 1)
        for node, rank in zip(node_of, ranks, strict=True):
            out["fetched_per_node"][node] += rank["fetched"]
    for key in ("read_bytes", "rchar"):
        per_rank = [r["io"][key] for r in ranks]
        per_node = [0] * (max(node_of) + 1)
        for node, value in zip(node_of, per_rank, strict=True):
            per_node[node] += value
        out[f"{key}_per_rank"] = per_rank
        out[f"{key}_per_node"] = per_node
    return out


def _correctness(ranks: list[dict[str, Any]], meta: dict[str, Any], case: Case) -> dict[str, Any]:
    got = {name: value for r in ranks for name, value in r.get("checksums", {}).items()}
    wrong = []
    for name, (total, weighted, scale) in meta["checksums"].items():
        value = got.get(name)
        tolerance = 1e-9 * scale + 1e-12
        if value is None or abs(value[0] - total) > tolerance or abs(value[1] - weighted) > tolerance:
            wrong.append(name)
    problems = [p for r in ranks for p in r.get("optimizer_problems", [])]
    checked = sum(r.get("optimizer_checked", 0) for r in ranks)
    ok = not wrong and not problems and (case.format != "full" or checked > 0)
    detail = []
    if wrong:
        detail.append(f"{len(wrong)} of {len(meta['checksums'])} parameters differ (e.g. {wrong[0]})")
    if problems:
        detail.append(f"optimizer state differs ({problems[0]})")
    if case.format == "full" and not checked:
        detail.append("no optimizer state was loaded")
    return {"correct": ok, "correct_detail": "; ".join(detail)}
