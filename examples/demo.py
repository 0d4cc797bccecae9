"""Demo: load a consolidated checkpoint that Fabric did not write into an FSDP model sharded over CPU ranks.

It writes a raw module state dict (like lit-llama's ``lit-llama.pth``), launches several CPU ranks (gloo), creates
the model on the meta device, shards it, loads the file, trains a step, saves a sharded checkpoint, reloads it, and
reports what happened and how much memory each rank used.

Run it with ``make demo`` (or ``python examples/demo.py --devices 4 --width 1024``).
"""

import argparse
import resource
import time
from pathlib import Path

import psutil
import torch
from lightning.fabric import Fabric
from torch import nn

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


def _memory_mb() -> dict[str, float]:
    info = psutil.Process().memory_full_info()
    peak_rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"pss": info.pss / 2**20, "anon": (info.rss - info.shared) / 2**20, "peak_rss": peak_rss_kb / 2**10}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="CPU ranks (processes)")
    parser.add_argument("--width", type=int, default=1024, help="model width; 1024 with depth 8 is 34M parameters")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--workdir", default="demo_output")
    args = parser.parse_args()

    workdir = Path(args.workdir)
    raw_path = workdir / "lit-llama.pth"
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()

    if fabric.global_rank == 0 and not raw_path.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        torch.save(Model(args.width, args.depth).state_dict(), raw_path)
    fabric.barrier()
    size_mb = raw_path.stat().st_size / 2**20
    fabric.print(f"Raw module state dict: {raw_path} ({size_mb:.0f} MiB), {args.devices} CPU ranks, gloo backend")

    with fabric.init_module(empty_init=True):
        model = Model(args.width, args.depth)
    model = fabric.setup_module(model)
    before = _memory_mb()

    start = time.perf_counter()
    fabric.load_raw(raw_path, model)
    load_seconds = time.perf_counter() - start
    after = _memory_mb()

    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(fabric.global_rank))
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    fabric.backward(loss)
    optimizer.step()

    sharded_path = workdir / "sharded"
    fabric.save(sharded_path, {"model": model, "optimizer": optimizer, "step": 1})
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(sharded_path, state)

    rows = fabric.all_gather(torch.tensor([before["pss"], after["pss"], after["anon"], after["peak_rss"]]))
    if fabric.global_rank == 0:
        local_params = sum(p.numel() for p in model.parameters())
        print(f"Loaded in {load_seconds:.2f} s; rank 0 holds {local_params:,} parameters (its shard).")
        print(f"Trained one step (loss {loss.item():.4f}), saved and reloaded {sharded_path} (step={state['step']}).")
        print("\n| rank | PSS before load (MiB) | PSS after load (MiB) | anonymous after (MiB) | peak RSS (MiB) |")
        print("| --- | --- | --- | --- | --- |")
        for rank, row in enumerate(rows.view(-1, 4).tolist()):
            print(f"| {rank} | {row[0]:.0f} | {row[1]:.0f} | {row[2]:.0f} | {row[3]:.0f} |")
        total_pss = rows.view(-1, 4)[:, 1].sum().item()
        print(f"\nAll ranks together after load: {total_pss:.0f} MiB PSS for a {size_mb:.0f} MiB checkpoint.")


if __name__ == "__main__":
    main()
