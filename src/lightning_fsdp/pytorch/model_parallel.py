# Copyright The lightning-fsdp developers.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The Trainer's ``ModelParallelStrategy`` (FSDP2, tensor parallelism) with the loading of Fabric's.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.pytorch.loading import is_fitting, load_weights, resume
from lightning_fsdp.pytorch.saving import (
    Deferred,
    fill_gathered,
    hooks_allow_stand_ins,
    save_without_gather,
)
from lightning_fsdp.saving.background import sharded_saves_in_background
from lightning_fsdp.strategy_options import CheckpointOptions


class ModelParallelStrategy(CheckpointOptions, _ModelParallelStrategy):
    r"""The Trainer's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`, with shard-local loads.

    It accepts every argument of the upstream class and behaves the same, except for loading:
    ``trainer.fit(model, ckpt_path=...)`` restores a full checkpoint (``save_distributed_checkpoint=False``)
    shard-locally, each rank reading only the slices of the model and of the optimizer state that its ``DTensor``
    parameters hold, on any device mesh; a distributed checkpoint goes through the same validated reader as Fabric's;
    :meth:`load_weights` (or the :class:`~lightning_fsdp.pytorch.LoadWeights` callback) loads weights from elsewhere.

    Arguments:
        load_concurrency: See :class:`lightning_fsdp.FSDPStrategy`.
        load_progress: Show a progress bar while loading, once per node, when the output is a terminal.
        save_in_background: Write full checkpoints in the background: ``trainer.save_checkpoint`` (and so
            ``ModelCheckpoint``) returns once every rank holds a copy of its slices; the next save, a resume,
            :meth:`wait_for_save` and the end of the run wait for it (see :mod:`lightning_fsdp.saving.background`).

    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        *,
        load_concurrency: int | Literal["auto"] = "auto",
        load_progress: bool = True,
        save_in_background: bool = False,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_checkpoint_options(load_concurrency, load_progress, save_in_background)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """A stand-in that :meth:`save_checkpoint` fills without a gather, for a full checkpoint; else upstream's."""
        assert self.model is not None
        if self._saves_without_gather() and hooks_allow_stand_ins(self.lightning_module._trainer):
            return Deferred(self.model)
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """A stand-in, as for :meth:`lightning_module_state_dict`; else upstream's."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._saves_without_gather() and hooks_allow_stand_ins(self.lightning_module._trainer):
            return Deferred(optimizer)
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Save a checkpoint; a full one (``save_distributed_checkpoint=False``) without a gather.

        See :meth:`lightning_fsdp.pytorch.FSDPStrategy.save_checkpoint`.

        """
        self.wait_for_save()
        if (
            self.model is not None
            and self._saves_without_gather()
            and storage_options is None
            and save_without_gather(self, checkpoint, filepath, fsdp2=True)
        ):
            return
        fill_gathered(checkpoint, super().lightning_module_state_dict, super().optimizer_state)
        saves = self._background_saves if self._save_distributed_checkpoint else None
        with sharded_saves_in_background(saves, "lightning.pytorch.strategies.model_parallel"):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _saves_without_gather(self) -> bool:
        return not self._save_distributed_checkpoint and self.parallel_devices is not None

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and, when fitting, the optimizers; return the checkpoint's other entries.

        See :meth:`lightning_fsdp.pytorch.FSDPStrategy.load_checkpoint`.

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
            "ModelParallelStrategy",
            sharded_module_key="state_dict",
        )

    def load_weights(self, path: _PATH, strict: bool = True, weights_only: bool = True) -> dict[str, Any]:
        """Load the model's weights alone; see :meth:`lightning_fsdp.pytorch.FSDPStrategy.load_weights`."""
        assert self.model is not None, "`load_weights` needs the model set up: call it once the Trainer has started"
        return load_weights(
            self, path, self.model, strict, weights_only, "ModelParallelStrategy", sharded_module_key="state_dict"
        )
