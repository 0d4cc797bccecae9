"""A real ``Trainer.fit`` on CPU ranks with this package's Trainer ``FSDPStrategy``, as users run it.

The Trainer starts the other ranks by running this script again (its subprocess launcher). Modes:

- ``save``: fit a few steps, then save a checkpoint (``--state-dict-type full|sharded``) to ``--ckpt``, and write
  the state at the end of training to ``--report``;
- ``resume``: ``trainer.fit(model, ckpt_path=--ckpt)`` with ``max_steps`` equal to the saved step, so that nothing
  trains after the restore; rank 0 writes what the strategy holds then (the model's and optimizer's full states, in
  the format the Trainer saves them, and the global step) to ``--report``. ``--loader upstream`` restores with
  Lightning's own ``FSDPStrategy.load_checkpoint`` instead, for comparison;
- ``weights``: fit zero steps with ``LoadWeights(--ckpt, **--load-options)`` and report the model's state.
"""

import argparse
import json
import sys

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.strategies import FSDPStrategy as UpstreamFSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_fsdp.pytorch import FSDPStrategy, LoadWeights, ModelParallelStrategy


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 8)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, tokens):
        return self.head(self.block(self.embedding(tokens) * self.scale))

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        return nn.functional.cross_entropy(self(tokens), target)  # through `forward`: FSDP2 gathers there

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class FSDP2Model(Model):
    """The same model, sharded with FSDP2 (``fully_shard``) for ``ModelParallelStrategy``."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.block:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


class UpstreamLoading(FSDPStrategy):
    """This package's strategy (it runs on CPU) with Lightning's own ``load_checkpoint``."""

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        return UpstreamFSDPStrategy.load_checkpoint(self, checkpoint_path, weights_only=weights_only)


class Report(pl.Callback):
    """Rank 0 writes the strategy's state at the start of training (after a restore), or at its end (``at_end``)."""

    def __init__(self, path: str, at_end: bool) -> None:
        self.path = path
        self.at_end = at_end

    def on_train_start(self, trainer, pl_module):
        if not self.at_end:
            self._report(trainer)

    def on_train_end(self, trainer, pl_module):
        if self.at_end:
            self._report(trainer)

    def _report(self, trainer):
        strategy = trainer.strategy
        # the full states (gathered on rank 0), in the format of the Trainer's full checkpoint, whatever it saves
        # (gathered, not the stand-ins that the gather-free save fills)
        full = {"_state_dict_type": "full", "_save_distributed_checkpoint": False}
        saves = {name: getattr(strategy, name) for name in full if hasattr(strategy, name)}
        for name in saves:
            setattr(strategy, name, full[name])
        strategy._saves_without_gather = lambda: False
        state = {"state_dict": strategy.lightning_module_state_dict(), "global_step": trainer.global_step}
        if trainer.optimizers:
            state["optimizer_states"] = [strategy.optimizer_state(optimizer) for optimizer in trainer.optimizers]
        del strategy._saves_without_gather
        for name, value in saves.items():
            setattr(strategy, name, value)
        if trainer.global_rank == 0:
            torch.save(state, self.path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "resume", "weights"])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--state-dict-type", default="full")
    parser.add_argument("--loader", default="ours")
    parser.add_argument("--report")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--wrap", action="store_true", help="wrap each Linear in its own FSDP unit")
    parser.add_argument("--flat-params", action="store_true", help="use_orig_params=False")
    parser.add_argument("--strategy", choices=["fsdp", "model_parallel"], default="fsdp")
    parser.add_argument("--gathered", help="also save the checkpoint with upstream's gather, to this path")
    parser.add_argument("--background", action="store_true", help="save_in_background=True")
    parser.add_argument("--load-options", default="{}", help="LoadWeights' keyword arguments, as JSON")
    args = parser.parse_args()

    model_class = Model
    if args.strategy == "model_parallel":
        model_class = FSDP2Model
        strategy = ModelParallelStrategy(
            data_parallel_size=args.devices * args.num_nodes,
            tensor_parallel_size=1,
            save_distributed_checkpoint=args.state_dict_type == "sharded",
            save_in_background=args.background,
        )
    else:
        kwargs = {"state_dict_type": args.state_dict_type, "save_in_background": args.background}
        if args.wrap:
            kwargs["auto_wrap_policy"] = {nn.Linear}
        if args.flat_params:
            kwargs["use_orig_params"] = False
        strategy = (UpstreamLoading if args.loader == "upstream" else FSDPStrategy)(**kwargs)
    callbacks = [Report(args.report, at_end=args.mode == "save")] if args.report else []
    if args.mode == "weights":
        callbacks.insert(0, LoadWeights(args.ckpt, **json.loads(args.load_options)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, 11, (64,)), torch.randint(0, 3, (64,)))
    loader = DataLoader(data, batch_size=4)
    if args.mode == "save":
        trainer.fit(model_class(), loader)
        trainer.save_checkpoint(args.ckpt)
        if args.background and args.state_dict_type == "sharded":
            # the background sharded save copied the shards into host buffers of its own before it returned
            print(f"sharded save staged in host memory: {strategy._background_saves._staged is not None}", flush=True)
        if args.gathered:
            strategy._saves_without_gather = lambda: False  # the states gathered on rank 0, as upstream saves them
            trainer.save_checkpoint(args.gathered)
    elif args.mode == "resume":
        trainer.fit(model_class(), loader, ckpt_path=args.ckpt)
    else:
        trainer.fit(model_class(), loader)


if __name__ == "__main__":
    main()
    sys.exit(0)
