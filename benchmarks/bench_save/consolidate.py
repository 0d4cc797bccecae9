"""Offline consolidation of a sharded checkpoint: Lightning's ``consolidate_checkpoint`` against ``convert``.

``python -m benchmarks.bench_save.consolidate --size medium --ranks 2`` (from the repository root) writes a sharded
checkpoint (``fabric.save`` with ``ModelParallelStrategy``, FSDP2, or ``FSDPStrategy(state_dict_type="sharded")``,
FSDP1) of ``bench_load``'s synthetic transformer with Adam state on CPU ranks, then consolidates it into one file
twice, each in a fresh process: ``python -m lightning.fabric.utilities.consolidate_checkpoint DIR --output_file F``
and ``python -m lightning_fsdp.cli convert DIR F``. For each it reports the wall time and the process's peak resident
memory (``ru_maxrss`` from ``wait4``), beside the peak of a process that only imports the same modules (the
baseline); dirty pages are written back (``sync``) before each. Lightning's ``torch.save`` does not ``fsync`` the
file; ``convert`` does (in its time): the ``sync`` right after each run is timed too. Then it compares the two
files: ``torch.load(mmap=True)`` of each, keys in order, dtypes, shapes, bytes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from benchmarks.bench_load.checkpoints import PRESETS
from benchmarks.bench_save.run import _identical, _trained_one_step

_BASELINES = {
    "lightning": "import torch, torch.distributed.checkpoint, lightning.fabric.utilities.consolidate_checkpoint",
    "lightning-fsdp": "import torch, torch.distributed.checkpoint, tqdm, lightning_fsdp.cli,"
    " lightning_fsdp.saving.offline, lightning_fsdp.loading.convert",
}


def _writer(cfg: dict[str, Any], rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    fabric, model, optimizer = _trained_one_step(cfg, rank, full=False)
    fabric.save(cfg["path"], {"model": model, "optimizer": optimizer, "step": 1, "hparams": {"lr": 1e-3}})


def _write(cfg: dict[str, Any]) -> None:
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    context = multiprocessing.get_context("spawn")
    port = find_free_network_port()
    processes = [context.Process(target=_writer, args=(cfg, rank, port)) for rank in range(cfg["ranks"])]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    if any(process.exitcode != 0 for process in processes):
        raise RuntimeError("a rank failed while writing the sharded checkpoint")


def _measure(command: list[str]) -> tuple[float, int]:
    """Run ``command``; return its wall time in seconds and its peak resident memory in bytes."""
    start = time.perf_counter()
    process = subprocess.Popen(command)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{command} exited with {process.returncode}")
    return seconds, usage.ru_maxrss * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_save.consolidate", description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp2", choices=("fsdp1", "fsdp2"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_consolidate"))
    args = parser.parse_args(argv)
    width, depth = PRESETS[args.size]
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    sharded = args.workdir / "sharded"
    cfg = {"ranks": args.ranks, "strategy": args.strategy, "width": width, "depth": depth, "path": str(sharded)}
    start = time.perf_counter()
    _write(cfg)
    written = time.perf_counter() - start
    size = sum(path.stat().st_size for path in sharded.iterdir())
    print(f"wrote {sharded} ({size / 1e9:.3f} GB, {len(list(sharded.iterdir()))} files) in {written:.1f} s")
    commands = {
        "lightning": [
            sys.executable,
            "-m",
            "lightning.fabric.utilities.consolidate_checkpoint",
            str(sharded),
            "--output_file",
            str(args.workdir / "lightning.ckpt"),
        ],
        "lightning-fsdp": [
            sys.executable,
            "-m",
            "lightning_fsdp.cli",
            "convert",
            str(sharded),
            str(args.workdir / "lightning-fsdp.ckpt"),
            "--no-progress",
        ],
    }
    rows = []
    for name, command in commands.items():
        _, baseline = _measure([sys.executable, "-c", _BASELINES[name]])
        os.sync()  # the previous step's dirty pages written back first: neither run is throttled by the other's
        seconds, peak = _measure(command)
        start = time.perf_counter()
        os.sync()  # what is still to reach the disk: Lightning's file (no fsync); ours is flushed already
        rows.append((name, seconds, time.perf_counter() - start, peak, baseline))
    lightning = torch.load(args.workdir / "lightning.ckpt", mmap=True, weights_only=True)
    ours = torch.load(args.workdir / "lightning-fsdp.ckpt", mmap=True, weights_only=True)
    difference = _identical(ours, lightning)
    largest = max(
        (value.nbytes for value in _tensors(lightning)),
        default=0,
    )
    print(f"\n{args.size} model, {args.strategy}, {args.ranks} ranks; checkpoint {size / 1e9:.3f} GB;")
    print(f"largest tensor {largest / 2**20:.1f} MiB; torch {torch.__version__}\n")
    print("| consolidation | time | then `sync` | peak RSS | import-only baseline | peak above baseline | file |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, seconds, flush, peak, baseline in rows:
        file = (args.workdir / f"{name}.ckpt").stat().st_size
        print(
            f"| {name} | {seconds:.1f} s | {flush:.1f} s | {peak / 2**20:.0f} MiB | {baseline / 2**20:.0f} MiB |"
            f" {(peak - baseline) / 2**20:.0f} MiB | {file / 1e9:.3f} GB |"
        )
    print(f"\nfiles: {'identical (keys in order, dtypes, shapes, bytes)' if difference is None else difference}")
    return 0 if difference is None else 1


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in _tensors(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in _tensors(value)]
    return []


if __name__ == "__main__":
    sys.exit(main())
