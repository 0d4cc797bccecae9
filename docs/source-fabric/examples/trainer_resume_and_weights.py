"""The Trainer with this package's strategy: start from weights Lightning did not write, save, resume shard-locally.

``lightning_fsdp.pytorch.FSDPStrategy`` is the Trainer's ``FSDPStrategy`` with Fabric's loading and saving: here it
runs on two CPU ranks. The first run starts from a ``.safetensors`` file (``LoadWeights``, each rank reading only its
slices) and ``ModelCheckpoint`` saves a full checkpoint without a gather (every rank writes its own slices of the model
and of the optimizer state into the one file). The second run resumes from that checkpoint (``ckpt_path="last"``),
each rank reading only its slices again: the model, AdamW's state, the step and the loops.

Run it with ``python trainer_resume_and_weights.py``: the Trainer launches the second process itself. It needs no GPU.
"""

# Checked by tests/tests_fabric/test_docs_examples.py: rank 0 prints (or the package logs) lines containing
# expect: training starts from pretrained.safetensors at step 0: head.bias = [0.5, 0.5, 0.5]
# expect: without a gather: each of the 2 ranks wrote its own slices into the one file
# expect: saved checkpoints/last.ckpt at step 4
# expect: training starts from last.ckpt at step 4: head.bias
# expect: trained to step 6

import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fsdp.pytorch import FSDPStrategy, LoadWeights


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def pretrained_weights(path: str) -> None:
    """Weights that the Trainer did not write: a safetensors file, as a converted or downloaded checkpoint is."""
    torch.manual_seed(1)
    weights = Classifier().state_dict()
    weights["head.bias"] = torch.full((3,), 0.5)
    save_file(weights, f"{path}.{os.getpid()}.tmp")  # every process of the run writes the same file
    os.replace(f"{path}.{os.getpid()}.tmp", path)


def trainer(max_steps: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(state_dict_type="full"),  # a full checkpoint: one file
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


class PrintStart(pl.Callback):
    """Rank 0 prints where training starts: the step, and the head's bias (gathered from the ranks' slices)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
            bias = [round(value, 4) for value in pl_module.head.bias.tolist()]
        if trainer.global_rank == 0:
            source = os.path.basename(trainer.ckpt_path) if trainer.ckpt_path else "pretrained.safetensors"
            print(f"training starts from {source} at step {trainer.global_step}: head.bias = {bias}")


def main() -> None:
    pretrained_weights("pretrained.safetensors")
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 16), torch.randint(0, 3, (64,))), batch_size=8)

    checkpoint = ModelCheckpoint(dirpath="checkpoints", save_last=True)
    first = trainer(4, callbacks=[LoadWeights("pretrained.safetensors"), PrintStart(), checkpoint])
    first.fit(Classifier(), data)
    if first.global_rank == 0:
        step = torch.load("checkpoints/last.ckpt", weights_only=True)["global_step"]
        print(f"saved checkpoints/last.ckpt at step {step}")

    # "last": Lightning finds the newest `last*.ckpt` of the run's ModelCheckpoint, as it does without this package
    second = trainer(6, callbacks=[PrintStart(), ModelCheckpoint(dirpath="checkpoints", save_last=True)])
    second.fit(Classifier(), data, ckpt_path="last")
    if second.global_rank == 0:
        print(f"trained to step {second.global_step}")


if __name__ == "__main__":
    main()
