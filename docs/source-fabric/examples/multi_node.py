"""Check a multi-node launch: every rank prints where it stands, and rank 0 checks that no two ranks share a device.

Run it the way you run your training script, with the same launcher and the same options: on one machine with
``python multi_node.py`` (Fabric launches the second process itself), on each node with ``fabric run`` (which passes
its own ``--devices`` and ``--num-nodes`` to Fabric) or ``torchrun`` (then pass ``--nodes`` and ``--devices`` to the
script). It needs no GPU: without one, the ranks run on CPU.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints lines containing
# expect: 2 ranks on 1 node(s), each on a device of its own
# expect: local rank 1 on node 0

import argparse
import gc
import os

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (not under `fabric run`)")
    parser.add_argument("--devices", type=int, default=2, help="processes (GPUs) per node (not under `fabric run`)")
    args = parser.parse_args()

    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if os.environ.get("LT_CLI_USED") == "1":
        # Under `fabric run`, its --accelerator, --devices and --num-nodes go to Fabric, and the processes exist.
        fabric = Fabric(strategy=FSDPStrategy())
    else:
        fabric = Fabric(accelerator=accelerator, devices=args.devices, num_nodes=args.nodes, strategy=FSDPStrategy())
        fabric.launch()

    with fabric.init_module(empty_init=True):  # parameters on the meta device: no memory anywhere yet
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    model = fabric.setup_module(model)  # materialized and sharded on this rank's own device
    devices = sorted({str(parameter.device) for parameter in model.parameters()})

    # One line per rank; the order between ranks is not defined.
    print(
        f"rank {fabric.global_rank} of {fabric.world_size}: local rank {fabric.local_rank} on node {fabric.node_rank},"
        f" device {fabric.device}, parameters on {', '.join(devices)}",
        flush=True,
    )

    # Every rank's (node rank, local rank, device) at rank 0: no two may be the same.
    mine = torch.tensor([fabric.node_rank, fabric.local_rank, fabric.device.index or 0], device=fabric.device)
    everyone = fabric.all_gather(mine).reshape(-1, 3).tolist()
    on_gpu = fabric.device.type == "cuda"
    slots = {(node, device) if on_gpu else (node, local) for node, local, device in everyone}
    assert len(slots) == fabric.world_size, f"ranks share a device: {everyone}"
    nodes = len({node for node, _, _ in everyone})
    fabric.print(f"{fabric.world_size} ranks on {nodes} node(s), each on a device of its own")

    # Leave together: a rank that exits while others still talk to the process group can make them abort.
    fabric.barrier()


if __name__ == "__main__":
    main()
    # The FSDP modules hold the process group, in reference cycles: collect them and destroy the group while the
    # interpreter is alive. Left to its exit, a gloo thread still releasing the last collective's tensors can abort
    # the process ("terminate called without an active exception").
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
