"""Fine-tune from a consolidated checkpoint on two nodes: the whole journey in one script.

A LLaMA-like model is created on the meta device (``empty_init=True``), sharded, given its optimizer, filled with the
weights of a raw ``lit-llama.pth`` (a ``torch.save(model.state_dict())`` that Fabric did not write), trained, saved as
one full checkpoint that every rank writes its own slices of (no gather), and resumed from that file into a fresh
model and optimizer. Two checks say that nothing was lost on the way: the full checkpoint written right after the load
equals ``lit-llama.pth`` bit for bit, and the resumed model and optimizer equal the ones that were saved, bit for bit,
on every rank.

On a cluster, run it on each node with the launcher you use for training, for example::

    fabric run --accelerator=cuda --devices=8 --num-nodes=2 --node-rank=<0 or 1> \\
        --main-address=<first node> --main-port=29500 fine_tune_on_two_nodes.py --checkpoint lit-llama.pth

On one machine, ``python fine_tune_on_two_nodes.py`` writes a stand-in ``lit-llama.pth`` and starts two "nodes" of two
CPU ranks itself: two launches with ``NODE_RANK=0`` and ``NODE_RANK=1``, as two machines would run it. No GPU needed.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: 4 ranks on 2 nodes
# expect: step 0: the full checkpoint written by every rank equals lit-llama.pth, bit for bit
# expect: saved step 2 to out/step-2.ckpt
# expect: resumed from out/step-2.ckpt at step 2: model and optimizer identical to the saved ones on all 4 ranks

import argparse
import gc
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy


class Block(nn.Module):
    """A pre-norm residual block with a SwiGLU feed-forward, as in LLaMA (attention left out to stay small)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.gate = nn.Linear(width, 2 * width, bias=False)
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def create_model_and_optimizer(fabric: Fabric) -> tuple[nn.Module, torch.optim.Optimizer]:
    # The model is created on the meta device: no memory and no initialization on any rank. `setup_module` shards it
    # and gives each rank's slices memory on the rank's own device; the optimizer is created from the sharded
    # parameters. Loading writes into those parameters in place, so it comes after both.
    with fabric.init_module(empty_init=True):
        model = Model()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, optimizer


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of what this rank holds: its slices of the parameters and of the optimizer's state."""
    tensors = [parameter.detach().clone() for parameter in model.parameters()]
    for state in optimizer.state_dict()["state"].values():
        tensors.extend(value.detach().clone() for _, value in sorted(state.items()))
    return tensors


def say(fabric: Fabric, text: str) -> None:
    """Print on the first rank of the first node only (``fabric.print`` prints on the first rank of every node)."""
    if fabric.global_rank == 0:
        print(text, flush=True)


def train(fabric: Fabric, checkpoint: Path, out: Path) -> None:
    say(fabric, f"{fabric.world_size} ranks on {fabric.strategy.num_nodes} nodes")
    model, optimizer = create_model_and_optimizer(fabric)
    # `lit-llama.pth` holds the model's state dict alone: `load_raw`. Every rank reads only its own slices of it.
    fabric.load_raw(checkpoint, model)

    # A full checkpoint (`state_dict_type="full"`): one file, which every rank writes its own slices of, in a folder
    # that every node sees (a shared file system; without one, rank 0 gathers everything and writes alone).
    out.mkdir(parents=True, exist_ok=True)
    fabric.save(out / "step-0.ckpt", {"model": model})
    if fabric.global_rank == 0:
        saved = torch.load(out / "step-0.ckpt", mmap=True, weights_only=True)["model"]
        original = torch.load(checkpoint, mmap=True, weights_only=True)
        assert saved.keys() == original.keys(), (saved.keys(), original.keys())
        for name, tensor in original.items():
            assert saved[name].dtype == tensor.dtype, name
            assert torch.equal(saved[name], tensor), name
        say(fabric, f"step 0: the full checkpoint written by every rank equals {checkpoint.name}, bit for bit")

    generator = torch.Generator().manual_seed(fabric.global_rank)  # every rank trains on its own batches
    for step in range(1, 3):
        tokens = torch.randint(0, 256, (4, 33), generator=generator, device="cpu").to(fabric.device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        say(fabric, f"step {step}: loss {loss.item():.4f}")
    fabric.save(out / "step-2.ckpt", {"model": model, "optimizer": optimizer, "step": 2})
    say(fabric, f"saved step 2 to {out / 'step-2.ckpt'}")

    # Resume as a new run would: a fresh model and optimizer, then the full checkpoint, each rank reading its slices.
    expected = local_state(model, optimizer)
    model, optimizer = create_model_and_optimizer(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(out / "step-2.ckpt", state)
    resumed = local_state(model, optimizer)
    identical = len(resumed) == len(expected) and all(
        a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(resumed, expected, strict=True)
    )
    assert identical, f"the resumed state differs from the saved one on rank {fabric.global_rank}"
    agreed = fabric.all_reduce(torch.tensor(1.0, device=fabric.device), reduce_op="sum")  # every rank got here
    say(
        fabric,
        f"resumed from {out / 'step-2.ckpt'} at step {state['step']}: model and optimizer identical to the saved ones"
        f" on all {int(agreed)} ranks",
    )
    fabric.barrier()  # leave together: a rank that exits first can make the others' last collective abort


def main(args: argparse.Namespace) -> None:
    strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
    if os.environ.get("LT_CLI_USED") == "1":
        # under `fabric run`: its --accelerator, --devices and --num-nodes go to Fabric, and the processes exist
        fabric = Fabric(strategy=strategy)
    else:
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        fabric = Fabric(accelerator=accelerator, devices=args.devices, num_nodes=args.nodes, strategy=strategy)
        fabric.launch()
    train(fabric, Path(args.checkpoint), Path(args.out))


def two_nodes_on_this_machine(args: argparse.Namespace) -> int:
    """Write a stand-in ``lit-llama.pth``, then run this script as node 0 and node 1 of a two-node run, here."""
    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():
        torch.manual_seed(0)
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        torch.save(Model().state_dict(), checkpoint)
    with socket.socket() as probe:  # a free port for the rendezvous, which node 0 hosts
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = [
        subprocess.Popen(
            [sys.executable, __file__, *sys.argv[1:], "--nodes", "2"],
            env={**os.environ, "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        )
        for node in range(2)
    ]
    return max(node.wait() for node in nodes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default="lit-llama.pth", help="a raw state dict of `Model`")
    parser.add_argument("--out", default="out", help="where the full checkpoints go (shared by all nodes)")
    parser.add_argument("--nodes", type=int, default=2, help="number of nodes (not under `fabric run`)")
    parser.add_argument("--devices", type=int, default=2, help="processes (GPUs) per node (not under `fabric run`)")
    arguments = parser.parse_args()
    launched = any(name in os.environ for name in ("NODE_RANK", "LOCAL_RANK", "LT_CLI_USED", "TORCHELASTIC_RUN_ID"))
    if not launched:
        sys.exit(two_nodes_on_this_machine(arguments))
    main(arguments)
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive (a gloo thread left to the interpreter's exit can abort the process).
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
