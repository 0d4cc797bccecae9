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
from typing import Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy

from lightning_fsdp.pytorch.checkpoints import TrainerCheckpoints


class ModelParallelStrategy(TrainerCheckpoints, _ModelParallelStrategy):
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

    _fsdp2 = True
    _sharded_module_key = "state_dict"
    _upstream_module = "lightning.pytorch.strategies.model_parallel"

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

    def _saves_sharded(self) -> bool:
        return self._save_distributed_checkpoint

    def _saves_without_gather(self) -> bool:
        return not self._save_distributed_checkpoint and self.parallel_devices is not None
