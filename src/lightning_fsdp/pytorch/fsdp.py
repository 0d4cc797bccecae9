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
"""The Trainer's ``FSDPStrategy``, extended as Fabric's is: CPU ranks, shard-local resumes, weights from elsewhere.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import FSDPStrategy as _FSDPStrategy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.devices import _check_cluster_environment, _check_distinct_devices
from lightning_fsdp.loading.quiet import torch_internal_warnings_silenced
from lightning_fsdp.pytorch.loading import is_fitting, load_weights, resume
from lightning_fsdp.pytorch.saving import (
    Deferred,
    fill_gathered,
    hooks_allow_stand_ins,
    save_without_gather,
)
from lightning_fsdp.saving.background import sharded_saves_in_background
from lightning_fsdp.strategy import _full_state_dict_type, cpu_wrapper_kwargs, wrap_on_cpu
from lightning_fsdp.strategy_options import CheckpointOptions

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.strategies.fsdp import _POLICY, _SHARDING_STRATEGY
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffload, MixedPrecision


class FSDPStrategy(CheckpointOptions, _FSDPStrategy):
    r"""The Trainer's :class:`~lightning.pytorch.strategies.FSDPStrategy`, on CPU too, with shard-local loads.

    It accepts every argument of the upstream class and behaves the same on CUDA. In addition:

    - it runs on CPU with the ``gloo`` backend (``Trainer(accelerator="cpu", strategy=FSDPStrategy())``);
    - ``trainer.fit(model, ckpt_path=...)`` resumes from a full checkpoint shard-locally: each rank reads and keeps
      only its slices of the model and of the optimizer state, also on another number of ranks than it was saved
      with; a sharded checkpoint goes through the same validated reader as Fabric's;
    - :meth:`load_weights` (or the :class:`~lightning_fsdp.pytorch.LoadWeights` callback) starts training from weights
      that Lightning did not write: a raw state dict, a ``.safetensors`` file, a Hugging Face checkpoint, in local
      or object storage, or the weights alone of a Trainer checkpoint.

    Its parameters are upstream's, in the same order, with the same defaults, followed by two keyword-only ones:

    Arguments:
        load_concurrency: How many ranks of a node may hold a checkpoint that must be read whole (a pickled file
            loaded with ``weights_only=False``) in host memory at the same time; see
            :class:`lightning_fsdp.FSDPStrategy`.
        load_progress: Show a progress bar while loading, once per node, when the output is a terminal.
        save_in_background: Write checkpoints in the background: ``trainer.save_checkpoint`` (and so
            ``ModelCheckpoint``) returns once every rank holds a copy of its slices; the next save, a resume,
            :meth:`wait_for_save` and the end of the run wait for it (see :mod:`lightning_fsdp.saving.background`).
            The host memory of that copy is reserved after an optimizer's first step, in a thread.

    """

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: Union[bool, "CPUOffload", None] = None,
        mixed_precision: Optional["MixedPrecision"] = None,
        auto_wrap_policy: Optional["_POLICY"] = None,
        activation_checkpointing: type[Module] | list[type[Module]] | None = None,
        activation_checkpointing_policy: Optional["_POLICY"] = None,
        sharding_strategy: "_SHARDING_STRATEGY" = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "full",
        device_mesh: Union[tuple[int, int], "DeviceMesh"] | None = None,
        *,
        load_concurrency: int | Literal["auto"] = "auto",
        load_progress: bool = True,
        save_in_background: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            cpu_offload=cpu_offload,
            mixed_precision=mixed_precision,
            auto_wrap_policy=auto_wrap_policy,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_policy=activation_checkpointing_policy,
            sharding_strategy=sharding_strategy,
            state_dict_type=state_dict_type,
            device_mesh=device_mesh,
            **kwargs,
        )
        self._init_checkpoint_options(load_concurrency, load_progress, save_in_background)

    @override
    def setup_environment(self) -> None:
        if self._on_cpu() and self.cpu_offload.offload_params:
            raise ValueError(
                "`FSDPStrategy(cpu_offload=True)` moves the parameters from an accelerator to host memory, and this"
                ' Trainer runs on CPU (`accelerator="cpu"`), where FSDP would fail at the first forward. On CPU the'
                " parameters are in host memory already: remove `cpu_offload=True`, or run on GPUs"
                ' (`accelerator="gpu"`).'
            )
        _check_cluster_environment(self.cluster_environment, self.parallel_devices, self.num_nodes)
        # Upstream builds a tuple `device_mesh` on CUDA unconditionally: build it for the device type in use.
        mesh_shape = self.kwargs.get("device_mesh")
        if self._on_cpu() and isinstance(mesh_shape, tuple):
            del self.kwargs["device_mesh"]
        super().setup_environment()
        _check_distinct_devices(self.global_rank, self.node_rank, self.local_rank, self.root_device, self.world_size)
        if self._on_cpu() and isinstance(mesh_shape, tuple):
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh("cpu", mesh_shape)

    @override
    def _setup_model(self, model: Module) -> Module:
        """Upstream's wrapping; on CPU with ``device_id=self.root_device`` (upstream passes its index, ``None``)."""
        if not self._on_cpu():
            return super()._setup_model(model)
        return wrap_on_cpu(self, model, self.kwargs)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        if not self._on_cpu():
            with super().model_sharded_context():
                yield
            return
        from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **cpu_wrapper_kwargs(self, self.kwargs)):
            yield

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state for a checkpoint: a stand-in that :meth:`save_checkpoint` fills without a gather.

        See :mod:`lightning_fsdp.pytorch.saving`. Where the save cannot serve, upstream's state (for a full checkpoint,
        gathered on rank 0).

        """
        assert self.model is not None
        if self._saves_without_gather() and hooks_allow_stand_ins(self.lightning_module._trainer):
            return Deferred(self.model)
        return self._gathered_module_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        """An optimizer's state for a checkpoint: a stand-in, as for :meth:`lightning_module_state_dict`."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._saves_without_gather() and hooks_allow_stand_ins(self.lightning_module._trainer):
            return Deferred(optimizer)
        return self._gathered_optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Save a checkpoint; a full one (``state_dict_type="full"``) without a gather, each rank its own slices.

        The file is the one upstream writes, byte for byte, written by every rank at once into a temporary file that
        replaces ``filepath`` once every rank has succeeded (:func:`lightning_fsdp.saving.save_full_checkpoint`);
        its folder is created as upstream creates it. Where that cannot serve (an ``on_save_checkpoint`` hook that
        changed the model's or an optimizer's state, a layout the writer does not know), the states are gathered on
        rank 0 and saved as upstream saves them, with one warning.

        """
        self.wait_for_save()
        if (
            self.model is not None
            and self._saves_without_gather()
            and storage_options is None
            and save_without_gather(self, checkpoint, filepath, fsdp2=False)
        ):
            return
        fill_gathered(checkpoint, self._gathered_module_state, self._gathered_optimizer_state)
        saves = self._background_saves if self._state_dict_type == "sharded" else None
        with (
            torch_internal_warnings_silenced(),
            sharded_saves_in_background(saves, "lightning.pytorch.strategies.fsdp"),
        ):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _saves_without_gather(self) -> bool:
        # FSDP1 with flat parameters (`use_orig_params=False`): upstream's full optimizer state fails to re-key
        # ("Each parameter should only map to one parameter name"), so there is no file of upstream's to write
        return (
            self._state_dict_type == "full"
            and self.parallel_devices is not None
            and bool(self.kwargs.get("use_orig_params", True))
        )

    def _gathered_module_state(self) -> dict[str, Any]:
        if self._state_dict_type != "full" or not self._on_cpu():
            return super().lightning_module_state_dict()
        assert self.model is not None
        # on a CPU model, FSDP's offload to CPU returns views of storage that it frees right after: assemble without it
        with _full_state_dict_type(self.model, rank0_only=True, offload_to_cpu=False):
            return self.model.state_dict()

    def _gathered_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._state_dict_type != "full" or not self._on_cpu():
            return super().optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType

        assert self.model is not None
        with _full_state_dict_type(self.model, rank0_only=True, offload_to_cpu=False):
            state_dict = FSDP.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:
                # upstream's format: keyed by index, as a plain optimizer saves it
                state_dict = FSDP.rekey_optim_state_dict(state_dict, OptimStateKeyType.PARAM_ID, self.model)
            return state_dict

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and, when fitting, the optimizers from a checkpoint; return its other entries.

        A full checkpoint file is read shard-locally (see :func:`lightning_fsdp.pytorch.loading.resume`), on any number
        of ranks; a sharded directory goes through Fabric's validated reader. Unlike upstream, the returned checkpoint
        holds neither ``state_dict`` nor ``optimizer_states``: the model and optimizers hold them already, and a copy
        of the full optimizer state on every rank is what a shard-local load avoids.

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
            "FSDPStrategy",
            sharded_module_key="model",
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
        return load_weights(self, path, self.model, strict, weights_only, "FSDPStrategy", sharded_module_key="model")

    def _on_cpu(self) -> bool:
        return self.parallel_devices is not None and self.root_device.type == "cpu"
