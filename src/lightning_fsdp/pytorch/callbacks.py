"""The Trainer's way to start from weights that Lightning did not write: a callback that loads them shard-locally.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_fsdp.loading.validation import Rename, check_rename


class LoadWeights(Callback):
    """Load the model's weights from a checkpoint at the start of ``trainer.fit`` (or of validate, test, predict).

    The weights come from a raw state dict (``lit-llama.pth``), a ``.safetensors`` file, a Hugging Face checkpoint
    (its ``*.index.json`` or folder), a sharded directory, or a checkpoint that the Trainer wrote (its model weights
    alone: fine-tuning from a resume file), in local or object storage. They are loaded shard-locally into the
    set-up model by the strategy's :meth:`~lightning_fsdp.pytorch.checkpoints.TrainerCheckpoints.load_weights`, with
    Fabric's name checks, rename advice and errors. A run that resumes (``trainer.fit(model, ckpt_path=...)``) takes
    its weights from that checkpoint instead, and this callback loads nothing.

    Example::

        trainer = Trainer(strategy=lightning_fsdp.pytorch.FSDPStrategy(), callbacks=[LoadWeights("lit-llama.pth")])
        trainer.fit(model)

    Args:
        path: The checkpoint (a file, a folder, or a URL such as ``s3://bucket/model.safetensors``).
        strict: Whether the checkpoint must hold exactly the model's tensors; ``False`` loads what matches and warns.
        rename: Maps the checkpoint's names to the model's (see
            :meth:`~lightning_fsdp.strategy_options.CheckpointOptions.load_options`).
        storage_options: Options of the fsspec file system that reads a URL.
        weights_only: Unpickle only tensors and plain containers (the default). ``False`` only for a trusted file.

    """

    def __init__(
        self,
        path: _PATH,
        strict: bool = True,
        rename: Rename | None = None,
        storage_options: Mapping[str, Any] | None = None,
        weights_only: bool = True,
    ) -> None:
        check_rename(rename)
        self.path = path
        self.strict = strict
        self.rename = rename
        self.storage_options = storage_options
        self.weights_only = weights_only

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._load(trainer)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not trainer.training and not trainer.sanity_checking and trainer.state.fn == "validate":
            self._load(trainer)

    @override
    def on_test_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._load(trainer)

    @override
    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._load(trainer)

    def _load(self, trainer: "pl.Trainer") -> None:
        strategy = trainer.strategy
        if not hasattr(strategy, "load_weights"):
            raise TypeError(
                f"`LoadWeights` loads through the strategies of `lightning_fsdp.pytorch`, and this Trainer runs"
                f" {type(strategy).__name__}. Use `Trainer(strategy=lightning_fsdp.pytorch.FSDPStrategy())` (or"
                " `ModelParallelStrategy`), or call `lightning_fsdp.enable()` before creating the Trainer."
            )
        if trainer.ckpt_path is not None:
            rank_zero_info(
                f"`LoadWeights` did not load {str(self.path)!r}: the Trainer resumed from {str(trainer.ckpt_path)!r},"
                " whose weights it keeps."
            )
            return
        with strategy.load_options(rename=self.rename, storage_options=self.storage_options):
            strategy.load_weights(self.path, strict=self.strict, weights_only=self.weights_only)
