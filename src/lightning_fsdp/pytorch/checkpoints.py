"""What the Trainer's two strategies of this package do alike with checkpoints: save without a gather, resume, load.

:class:`lightning_fsdp.pytorch.FSDPStrategy` (FSDP1) and :class:`lightning_fsdp.pytorch.ModelParallelStrategy` (FSDP2)
list :class:`TrainerCheckpoints` first among their bases; each says which kind of model it holds and how Lightning's
own strategy gathers a full checkpoint where the gather-free save cannot serve.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.pytorch.loading import is_fitting, load_weights, resume
from lightning_fsdp.pytorch.saving import Deferred, fill_gathered, hooks_allow_stand_ins, save_without_gather
from lightning_fsdp.saving.background import sharded_saves_in_background
from lightning_fsdp.strategy_options import CheckpointOptions


class TrainerCheckpoints(CheckpointOptions):
    """The Trainer's checkpoints on this package's loader and writer (see :mod:`lightning_fsdp.pytorch.saving`)."""

    _fsdp2: bool
    """Whether the model's parameters are ``DTensor`` objects (FSDP2) rather than FSDP1 flat parameters."""
    _sharded_module_key: str
    """The model's key in the sharded checkpoints that Lightning's strategy writes."""
    _upstream_module: str
    """Lightning's module of the strategy, whose sharded save writes in the background here."""

    if TYPE_CHECKING:  # what Lightning's strategy, the other base, provides
        model: Module | None
        lightning_module: Any
        optimizers: list[Optimizer]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state for a checkpoint: a stand-in that :meth:`save_checkpoint` fills without a gather.

        Where the gather-free save cannot serve, Lightning's state (for a full checkpoint, gathered on rank 0).

        """
        assert self.model is not None
        if self._fills_stand_ins():
            return Deferred(self.model)  # type: ignore[return-value]
        return self._gathered_module_state()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """An optimizer's state for a checkpoint: a stand-in, as for :meth:`lightning_module_state_dict`."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._fills_stand_ins():
            return Deferred(optimizer)  # type: ignore[return-value]
        return self._gathered_optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Save a checkpoint; a full one without a gather, each rank writing its own slices.

        The file is the one Lightning writes, byte for byte, written by every rank at once into a temporary file that
        replaces ``filepath`` once every rank has succeeded (:func:`lightning_fsdp.saving.save_full_checkpoint`); its
        folder is created as Lightning creates it. Where that cannot serve (an ``on_save_checkpoint`` hook that changed
        the model's or an optimizer's state, a layout the writer does not know), the states are gathered on rank 0 and
        saved as Lightning saves them, with one warning. A sharded checkpoint is Lightning's, written in the
        background with ``save_in_background=True``.

        """
        self.wait_for_save()
        if (
            self.model is not None
            and self._saves_without_gather()
            and storage_options is None
            and save_without_gather(self, checkpoint, filepath, fsdp2=self._fsdp2)
        ):
            return
        fill_gathered(checkpoint, self._gathered_module_state, self._gathered_optimizer_state)
        saves = self._background_saves if self._saves_sharded() else None
        with self._upstream_save_context(), sharded_saves_in_background(saves, self._upstream_module):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and, when fitting, the optimizers from a checkpoint; return its other entries.

        A full checkpoint file is read shard-locally (see :func:`lightning_fsdp.pytorch.loading.resume`), on any number
        of ranks; a sharded directory goes through Fabric's validated reader. Unlike Lightning's, the returned
        checkpoint holds neither ``state_dict`` nor ``optimizer_states``: the model and optimizers hold them already,
        and a copy of the full optimizer state on every rank is what a shard-local load avoids.

        """
        self.wait_for_save()
        assert self.model is not None
        assert self.lightning_module is not None
        return resume(
            self,
            checkpoint_path,
            self.model,
            list(self.optimizers),
            is_fitting(self.lightning_module._trainer),
            self.lightning_module.strict_loading,
            weights_only,
            self._strategy_name(),
            sharded_module_key=self._sharded_module_key,
        )

    def load_weights(self, path: _PATH, strict: bool = True, weights_only: bool = True) -> dict[str, Any]:
        """Load the model's weights alone from ``path``, shard-locally, into the set-up model.

        ``path`` is a raw state dict (``torch.save(model.state_dict())``, zip or legacy format), a ``.safetensors``
        file, a Hugging Face checkpoint (its ``*.index.json`` or folder), a sharded directory, or a checkpoint that the
        Trainer wrote (its ``state_dict``; nothing else of it is restored), in local or object storage (with the
        ``storage_options`` of :meth:`load_options`). Names, shapes and dtypes are checked on every rank before
        anything is written, with Fabric's rename advice; ``strict=False`` loads what matches and warns about the
        rest. The :class:`~lightning_fsdp.pytorch.LoadWeights` callback calls this at the start of fitting.

        Returns:
            The checkpoint's entries that were not loaded (``{}`` for a file of weights alone).

        """
        assert self.model is not None, "`load_weights` needs the model set up: call it once the Trainer has started"
        return load_weights(
            self,
            path,
            self.model,
            strict,
            weights_only,
            self._strategy_name(),
            sharded_module_key=self._sharded_module_key,
        )

    def _strategy_name(self) -> str:
        """The name that errors give the strategy: Lightning's class's, which this one's shares."""
        return "ModelParallelStrategy" if self._fsdp2 else "FSDPStrategy"

    def _fills_stand_ins(self) -> bool:
        """Whether the save fills stand-ins without a gather: a full checkpoint, and no hook that reads the states."""
        return self._saves_without_gather() and hooks_allow_stand_ins(self.lightning_module._trainer)

    def _saves_without_gather(self) -> bool:
        raise NotImplementedError

    def _saves_sharded(self) -> bool:
        raise NotImplementedError

    def _upstream_save_context(self) -> AbstractContextManager:
        """What Lightning's own save runs inside (nothing here)."""
        return nullcontext()

    def _gathered_module_state(self) -> dict[str, Any]:
        return super().lightning_module_state_dict()  # type: ignore[misc]

    def _gathered_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return super().optimizer_state(optimizer)  # type: ignore[misc]
