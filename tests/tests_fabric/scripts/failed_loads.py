"""Four loads that fail, on 2 CPU ranks that Fabric launches itself, printed as a user's terminal shows them.

Usage: python failed_loads.py WORKDIR

Each failure is printed by ``sys.excepthook``, the hook that prints an uncaught exception (torch's, which prefixes each
line with the rank); after each, rank 0 prints ``=== end of <case>`` once both ranks have printed. The last load's error
is left uncaught, as in a user's script: the script exits with it.
"""

# lightning-fsdp: package-only (it measures what this package prints)
import gc
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy


def main() -> None:
    work = Path(sys.argv[1])
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy())
    fabric.launch()
    if fabric.global_rank == 0:
        torch.save(nn.Linear(4, 4).state_dict(), work / "other-shape.pt")
        torch.save(nn.Linear(8, 8).state_dict(), work / "model.pt")
        data = (work / "model.pt").read_bytes()
        (work / "truncated.pt").write_bytes(data[: len(data) // 2])
    fabric.barrier()
    model = fabric.setup_module(nn.Linear(8, 8))
    # On one rank only, a rename that matches no name: a failure that the other rank reports (as a file that one
    # node cannot read would be).
    one_rank_fails = {"": "other."} if fabric.global_rank == 1 else {}
    cases = {
        "path typo": (work / "modle.pt", {}),
        "shape mismatch": (work / "other-shape.pt", {}),
        "rank 1 fails": (work / "model.pt", one_rank_fails),
    }
    for case, (path, rename) in cases.items():
        try:
            with fabric.strategy.load_options(rename=rename):
                fabric.load_raw(path, model)
        except Exception as error:
            # What every rank caught, for the test to read (a file: the terminal shows only what a user would see).
            with open(work / f"caught-rank{fabric.global_rank}.txt", "a") as caught:
                print(case, type(error).__name__, type(error.cause).__name__, sep="|", file=caught)
            sys.excepthook(*sys.exc_info())
            sys.stderr.flush()
        fabric.barrier()
        if fabric.global_rank == 0:
            print(f"=== end of {case}", file=sys.stderr, flush=True)
        fabric.barrier()
    fabric.load(work / "truncated.pt", {"model": model})


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
