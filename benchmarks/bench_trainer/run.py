"""The Trainer's full save and resume with Lightning's strategies and with lightning-fsdp's, side by side.

For each strategy family (the Trainer's ``FSDPStrategy``, FSDP1, and ``ModelParallelStrategy``, FSDP2) and
implementation, a fresh group of CPU rank processes (gloo, started as a cluster starts them: ``LOCAL_RANK`` set, so the
Trainer launches nothing) runs a real ``Trainer.fit`` of ``bench_load``'s synthetic transformer (``--size``) with
AdamW:

- **save**: one training step, then ``trainer.save_checkpoint(path)`` (what ``ModelCheckpoint`` calls) of a full
  checkpoint (``state_dict_type="full"`` / ``save_distributed_checkpoint=False``). "lightning" is the Trainer's
  gathered save (the model's and optimizers' full states assembled on rank 0, which writes; for FSDP1 the CPU variant
  that ``lightning_fsdp.pytorch.FSDPStrategy`` runs, since FSDP's CPU offload cannot run on a CPU model, for FSDP2
  Lightning's own methods); "lightning-fsdp" the gather-free save. Each rank records a digest of its shards and
  optimizer state.
- **resume**: ``trainer.fit(model, ckpt_path=<lightning-fsdp's file>)``. "lightning" is Lightning's own
  ``load_checkpoint`` (on this package's FSDP1 subclass, which runs on CPU; Lightning's ``ModelParallelStrategy`` runs
  on CPU as it is); "lightning-fsdp" this package's. After the restore every rank's shards and optimizer state must
  hash as at the save.

Each rank measures the call (``trainer.save_checkpoint``, ``strategy.load_checkpoint``) between two barriers: the time,
and the peak of its anonymous resident memory (``RssAnon``, sampled every 5 ms) above what it held just before. The
parent prints a Markdown table with the ratios, and compares the two saved files (keys in order, dtypes, shapes,
bytes). A benchmark, not a test: no number makes it fail.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from benchmarks.bench_load.checkpoints import PRESETS, Block, Model
from benchmarks.bench_save.run import _compare, _digest, _gb, _PeakAnon, _run_case, _status_kb


def _lightning_module(width: int, depth: int, fsdp2: bool) -> Any:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Model(width, depth)

        def configure_model(self) -> None:
            if not fsdp2:
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Module()


def _strategy(cfg: dict[str, Any]) -> Any:
    from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy
    from lightning.pytorch.strategies import ModelParallelStrategy as LightningModelParallelStrategy

    from lightning_fsdp.pytorch import FSDPStrategy, ModelParallelStrategy

    upstream = cfg["implementation"] == "lightning"
    if cfg["strategy"] == "fsdp2":
        kwargs = {"data_parallel_size": cfg["ranks"], "tensor_parallel_size": 1, "save_distributed_checkpoint": False}
        strategy = ModelParallelStrategy(**kwargs)
        if upstream and cfg["phase"] == "resume":
            strategy = LightningModelParallelStrategy(**kwargs)
    else:
        strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
        if upstream and cfg["phase"] == "resume":
            # Lightning's own method, on the subclass that runs on CPU
            strategy.load_checkpoint = LightningFSDPStrategy.load_checkpoint.__get__(strategy)
    if upstream and cfg["phase"] == "save":
        strategy._saves_without_gather = lambda: False  # the states gathered on rank 0, as Lightning saves them
    return strategy


def _measured(strategy: Any, call: Any, result: dict[str, Any]) -> Any:
    strategy.barrier()
    base = _status_kb("RssAnon") * 1024
    with _PeakAnon() as peak:
        start = time.perf_counter()
        value = call()
        strategy.barrier()
        result["seconds"] = time.perf_counter() - start
    result["peak_above_base"] = peak.peak - base
    return value


def _worker(cfg: dict[str, Any], rank: int, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    os.environ.update(WORLD_SIZE=str(cfg["ranks"]))
    torch.set_num_threads(1)
    import lightning.pytorch as pl

    strategy = _strategy(cfg)
    torch.manual_seed(0)  # the same weights and data in every run: the two saves write the same values
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, cfg["width"])), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg["ranks"],
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = _lightning_module(cfg["width"], cfg["depth"], cfg["strategy"] == "fsdp2")
    result: dict[str, Any] = {"rank": rank}
    if cfg["phase"] == "save":
        trainer.fit(module, data)
        result["digest"] = _digest(trainer.strategy.model, trainer.optimizers[0])
        _measured(trainer.strategy, lambda: trainer.save_checkpoint(cfg["path"]), result)
    else:
        load = trainer.strategy.load_checkpoint

        def measured_load(*args: Any, **kwargs: Any) -> Any:
            checkpoint = _measured(trainer.strategy, lambda: load(*args, **kwargs), result)
            result["digest"] = _digest(trainer.strategy.model, trainer.strategy.optimizers[0])
            return checkpoint

        trainer.strategy.load_checkpoint = measured_load
        trainer.fit(module, data, ckpt_path=cfg["path"])
        assert trainer.global_step == 1
    results.put(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1gb", choices=sorted(PRESETS))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--strategy", default="both", choices=("fsdp1", "fsdp2", "both"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_trainer"))
    parser.add_argument("--output", type=Path, default=None, help="also write the Markdown table here")
    args = parser.parse_args(argv)
    width, depth = PRESETS[args.size]
    args.workdir.mkdir(parents=True, exist_ok=True)
    strategies = ("fsdp1", "fsdp2") if args.strategy == "both" else (args.strategy,)
    rows = [
        "| strategy | call | implementation | time | rank 0 peak anon above base | other ranks' (max) | result |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios, measured = [], {}
    for strategy in strategies:
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for phase in ("save", "resume"):
            for implementation in ("lightning", "lightning-fsdp"):
                name = "lightning-fsdp" if phase == "resume" else implementation  # every resume reads our file
                cfg = {
                    "strategy": strategy,
                    "phase": phase,
                    "implementation": implementation,
                    "ranks": args.ranks,
                    "width": width,
                    "depth": depth,
                    "path": str(args.workdir / f"{strategy}-{name}.ckpt"),
                }
                print(f"bench_trainer: {strategy} {phase} {implementation} ...", flush=True)
                runs[phase, implementation] = _run_case(cfg, _worker)
        saved = {rank["rank"]: rank["digest"] for rank in runs["save", "lightning-fsdp"]}
        verdict = _compare(
            args.workdir / f"{strategy}-lightning-fsdp.ckpt", args.workdir / f"{strategy}-lightning.ckpt"
        )
        for (phase, implementation), ranks in runs.items():
            if phase == "save":
                outcome = f"file vs Lightning's: {verdict}" if implementation == "lightning-fsdp" else "reference file"
            else:
                exact = all(rank["digest"] == saved[rank["rank"]] for rank in ranks)
                outcome = "exact on every rank" if exact else "DIFFERENT"
            call = "trainer.save_checkpoint" if phase == "save" else "fit(ckpt_path=...) restore"
            rows.append(
                f"| {strategy} | {call} | {implementation} | {max(r['seconds'] for r in ranks):.1f} s |"
                f" {_gb(ranks[0]['peak_above_base'])} | {_gb(max(r['peak_above_base'] for r in ranks[1:]))} |"
                f" {outcome} |"
            )
        for phase in ("save", "resume"):
            ours, theirs = runs[phase, "lightning-fsdp"], runs[phase, "lightning"]
            time_ratio = max(r["seconds"] for r in ours) / max(r["seconds"] for r in theirs)
            memory_ratio = max(r["peak_above_base"] for r in ours) / max(max(r["peak_above_base"] for r in theirs), 1)
            ratios.append(
                f"- {strategy} {phase}: time / Lightning's = {time_ratio:.2f}; largest peak anonymous memory above"
                f" base of any rank / Lightning's = {memory_ratio:.3f}"
            )
        measured[strategy] = {f"{phase}/{implementation}": ranks for (phase, implementation), ranks in runs.items()}
    text = "\n".join([*rows, "", *ratios]) + "\n"
    print(text)
    (args.workdir / "results.json").write_text(json.dumps(measured, indent=1))
    if args.output is not None:
        args.output.write_text(text)
    return 0
