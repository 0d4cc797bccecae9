"""Demo: load a consolidated checkpoint that Fabric did not write into an FSDP model sharded over CPU ranks.

It writes a raw module state dict (like lit-llama's ``lit-llama.pth``) in torch's zip format and in the legacy
format, and a Fabric checkpoint in the legacy format; launches several CPU ranks (gloo), creates the model on the meta
device, shards it, and loads each file with ``fabric.load(path, {"model": model})``: every rank reads only the bytes
of its own slices, by positioned reads at offsets that the file's own structure proves; then the Fabric checkpoint
once more as a trusted file (``weights_only=False``), which is read whole, in node turns, one rank at a time. Before
each load the model is filled with NaN; each rank samples its own memory while loading; the table shows the peak
above the model's base. After each load every parameter is compared with the file's tensor, bit for bit, through
FSDP's own all-gather. Then it trains a step, saves a full checkpoint with the optimizer's state without a gather
(every rank writes its own slices into the one file), and reloads it into the model and optimizer filled with NaN:
each rank's slices must come back bit for bit.

Run it with ``make demo`` (or ``python examples/demo.py --devices 4 --width 1024 --depth 8``).
"""

import argparse
import gc
import threading
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_fsdp import FSDPStrategy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 4 * width, bias=False)
        self.fc_out = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(torch.nn.functional.gelu(self.fc_in(self.norm(x))))


class Model(nn.Module):
    def __init__(self, width: int, depth: int, vocab: int = 512) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _memory_mib() -> tuple[float, float]:
    """This process's proportional set size: (anonymous, file-backed) MiB. Shared file pages count once per node."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0])
    return fields.get("Pss_Anon", 0) / 1024, fields.get("Pss_File", 0) / 1024


class _PeakSampler:
    """Samples this process's memory every 10 ms while a load runs, relative to its base before the load."""

    def __init__(self) -> None:
        self.base = _memory_mib()
        self.samples: list[tuple[float, float, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            anon, file = _memory_mib()
            self.samples.append((time.time(), anon - self.base[0], file - self.base[1]))
            time.sleep(0.01)

    def __enter__(self) -> "_PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *args: object) -> None:
        self._done.set()
        self._thread.join()


def _torch_load_on_every_rank(fabric: Fabric, path: Path) -> tuple[float, list]:
    """The pattern this package replaces: every rank reads the whole file, and all hold their copy at once."""
    fabric.barrier()
    with _PeakSampler() as sampler:
        start = time.perf_counter()
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
        fabric.barrier()  # every rank holds its copy now
        seconds = time.perf_counter() - start
        del state_dict
    every_rank: list = [None] * fabric.world_size
    torch.distributed.all_gather_object(every_rank, sampler.samples)
    return seconds, every_rank


def _load_and_measure(fabric: Fabric, path: Path, model: nn.Module, trusted: bool) -> tuple[float, list]:
    with torch.no_grad():  # each load starts from a model that holds no weights, so the check below proves the load
        for parameter in model.parameters():
            parameter.fill_(float("nan"))
    fabric.barrier()
    with _PeakSampler() as sampler:
        start = time.perf_counter()
        fabric.load(path, {"model": model}, weights_only=not trusted)
        seconds = time.perf_counter() - start
    every_rank: list = [None] * fabric.world_size
    torch.distributed.all_gather_object(every_rank, sampler.samples)
    return seconds, every_rank


def _assert_model_is_file(fabric: Fabric, model: nn.Module, path: Path) -> None:
    """Every parameter of the model equals the file's tensor bit for bit (dtype and every element).

    The full parameters come from FSDP's own all-gather of the shards (``summon_full_params``), not from this package,
    so a slice written to the wrong place, or one not written, fails the check. It runs after the memory was measured.

    """
    expected = torch.load(path, mmap=True, weights_only=True)
    with FullyShardedDataParallel.summon_full_params(model, writeback=False):
        for wrapped_name, parameter in model.module.named_parameters():
            name = wrapped_name.replace("_fsdp_wrapped_module.", "")  # the names without FSDP's inner wrappers
            assert parameter.dtype == expected[name].dtype, name
            assert torch.equal(parameter, expected[name]), f"{name} differs from {path}"
    fabric.barrier()


def _local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of this rank's slices of the parameters and of the optimizer's state."""
    tensors = [parameter.detach().clone() for parameter in model.parameters()]
    for state in optimizer.state_dict()["state"].values():
        tensors.extend(value.detach().clone() for _, value in sorted(state.items()))
    return tensors


def _fill_nan(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for tensor in [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values())]:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))


def _mib(value: float) -> str:
    """MiB without a sign for what rounds to zero (a sampled base can exceed a later sample by a few KiB)."""
    return "0" if abs(value) < 0.5 else f"{value:.0f}"


def _peaks(every_rank: list) -> tuple[list[tuple[float, float]], float]:
    """Each rank's peak (anonymous, file-backed) MiB above its base, and the peak of all ranks' sum at once."""
    per_rank = [(max(s[1] for s in samples), max(s[2] for s in samples)) for samples in every_rank]
    # All ranks together: at each 20 ms step, add up every rank's latest sample.
    start = min(samples[0][0] for samples in every_rank)
    end = max(samples[-1][0] for samples in every_rank)
    total_peak, step = 0.0, 0.02
    for index in range(int((end - start) / step) + 1):
        moment = start + index * step
        latest = [[s for s in samples if s[0] <= moment] for samples in every_rank]
        total_peak = max(total_peak, sum(found[-1][1] + found[-1][2] for found in latest if found))
    return per_rank, total_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="CPU ranks (processes)")
    parser.add_argument("--width", type=int, default=1024, help="model width; 1024 with depth 8 is 68M parameters")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--workdir", default="demo_output")
    args = parser.parse_args()
    started = time.perf_counter()

    workdir = Path(args.workdir)
    zip_path, legacy_path = workdir / "lit-llama.pth", workdir / "lit-llama-legacy.pth"
    legacy_fabric_path = workdir / "fabric-legacy.ckpt"
    # full checkpoints: `fabric.save` writes one file, every rank its own slices of it (no gather on rank 0)
    strategy = FSDPStrategy(auto_wrap_policy={Block}, load_concurrency=1, state_dict_type="full")
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()

    if fabric.global_rank == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        state_dict = Model(args.width, args.depth).state_dict()
        torch.save(state_dict, zip_path)
        torch.save(state_dict, legacy_path, _use_new_zipfile_serialization=False)
        torch.save({"model": state_dict}, legacy_fabric_path, _use_new_zipfile_serialization=False)
        del state_dict
    fabric.barrier()
    size_mib = zip_path.stat().st_size / 2**20
    fabric.print(f"Checkpoint: a raw module state dict of {size_mib:.0f} MiB ({args.devices} CPU ranks, gloo)")

    with fabric.init_module(empty_init=True):
        model = Model(args.width, args.depth)
    model = fabric.setup_module(model)

    seconds, every_rank = _torch_load_on_every_rank(fabric, zip_path)
    rows = [("plain `torch.load` on every rank (the file only, not loaded)", seconds, *_peaks(every_rank))]
    files = (
        ("raw zip, byte ranges", zip_path, False),
        ("raw legacy, byte ranges", legacy_path, False),
        ("Fabric legacy, byte ranges", legacy_fabric_path, False),
        ("Fabric legacy, trusted (weights_only=False): read whole, turns k=1", legacy_fabric_path, True),
    )
    for label, path, trusted in files:
        seconds, every_rank = _load_and_measure(fabric, path, model, trusted)
        _assert_model_is_file(fabric, model, zip_path)
        rows.append((label, seconds, *_peaks(every_rank)))

    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(fabric.global_rank))
    loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    fabric.backward(loss)
    optimizer.step()

    # A full checkpoint with the optimizer, written without a gather; then reloaded into the model and optimizer
    # filled with NaN: each rank's slices must come back bit for bit.
    full_path = workdir / "full.ckpt"
    trained = _local_state(model, optimizer)
    fabric.barrier()
    with _PeakSampler() as sampler:
        start = time.perf_counter()
        fabric.save(full_path, {"model": model, "optimizer": optimizer, "step": 1})
        save_seconds = time.perf_counter() - start
    save_peaks: list = [None] * fabric.world_size
    torch.distributed.all_gather_object(save_peaks, sampler.samples)
    _fill_nan(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(full_path, state)
    reloaded = _local_state(model, optimizer)
    assert len(reloaded) == len(trained), (len(reloaded), len(trained))
    for before, after in zip(trained, reloaded, strict=True):
        assert before.dtype == after.dtype, "the reloaded state differs in dtype"
        assert torch.equal(before, after), "the reloaded state differs"
    fabric.barrier()

    if fabric.global_rank == 0:
        print("\nPeak memory while loading, above the base before the load (PSS: shared file pages count once).")
        print("Per rank: anonymous + file-backed MiB. All ranks: the peak of their sum at the same moment.\n")
        ranks = " | ".join(f"rank {rank}" for rank in range(fabric.world_size))
        print(f"| file | load time | {ranks} | all ranks at once |")
        print("| --- | --- | " + " | ".join("---" for _ in range(fabric.world_size)) + " | --- |")
        for label, seconds, per_rank, total in rows:
            cells = " | ".join(f"{_mib(anon)} + {_mib(file)}" for anon, file in per_rank)
            share = max(total, 0) / size_mib
            print(f"| {label} | {seconds:.2f} s | {cells} | {_mib(total)} MiB ({share:.2f}x the file) |")
        print("\nEach load started from a model filled with NaN; after it, every parameter equalled the file's tensor")
        print("bit for bit (FSDP's own all-gather of the shards, compared with `torch.equal`).")
        print("A rank's memory counts what the process holds (PSS). The page cache that the kernel keeps for the file")
        print("is not the process's, so a load by positioned reads shows about 0x the file: only the rank's own")
        print("slices pass through its memory, and the model's shards were allocated before the load.")
        save_anon = [max(sample[1] for sample in samples) for samples in save_peaks]
        full_mib = full_path.stat().st_size / 2**20
        print(
            f"\nTrained one step (loss {loss.item():.4f}) and saved {full_path} ({full_mib:.0f} MiB: model, AdamW"
            f" state, step) in {save_seconds:.2f} s without a gather: every rank wrote its own slices; peak anonymous"
            f" memory above base per rank {' / '.join(_mib(value) for value in save_anon)} MiB."
        )
        print(
            f"Reloaded it into the model and optimizer filled with NaN (step={state['step']}): every rank's slices"
            " of the parameters and of the AdamW state equal the saved ones bit for bit."
        )
        written = sum(file.stat().st_size for file in workdir.rglob("*") if file.is_file()) / 2**20
        print(f"The demo wrote {written:.0f} MiB to {workdir.resolve()}; `make clean` removes it.")
        print(f"It ran for {time.perf_counter() - started:.0f} s (launch, files, loads, checks, training, save)")


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
