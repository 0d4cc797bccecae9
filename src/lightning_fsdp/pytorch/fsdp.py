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
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import FSDPStrategy as _FSDPStrategy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.devices import _check_cluster_environment, _check_distinct_devices
from lightning_fsdp.loading.quiet import torch_internal_warnings_silenced
from lightning_fsdp.pytorch.checkpoints import TrainerCheckpoints
from lightning_fsdp.strategy import _full_state_dict_type, cpu_wrapper_kwargs, wrap_on_cpu

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.strategies.fsdp import _POLICY, _SHARDING_STRATEGY
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffload, MixedPrecision


class FSDPStrategy(TrainerCheckpoints, _FSDPStrategy):
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

    _fsdp2 = False
    _sharded_module_key = "model"
    _upstream_module = "lightning.pytorch.strategies.fsdp"

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

    def _saves_without_gather(self) -> bool:
        # FSDP1 with flat parameters (`use_orig_params=False`): upstream's full optimizer state fails to re-key
        # ("Each parameter should only map to one parameter name"), so there is no file of upstream's to write
        return (
            self._state_dict_type == "full"
            and self.parallel_devices is not None
            and bool(self.kwargs.get("use_orig_params", True))
        )

    def _saves_sharded(self) -> bool:
        return self._state_dict_type == "sharded"

    def _upstream_save_context(self) -> AbstractContextManager:
        return torch_internal_warnings_silenced()

    def _gathered_module_state(self) -> dict[str, Any]:
        if self._state_dict_type != "full" or not self._on_cpu():
            return super()._gathered_module_state()
        assert self.model is not None
        # on a CPU model, FSDP's offload to CPU returns views of storage that it frees right after: assemble without it
        with _full_state_dict_type(self.model, rank0_only=True, offload_to_cpu=False):
            return self.model.state_dict()

    def _gathered_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._state_dict_type != "full" or not self._on_cpu():
            return super()._gathered_optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType

        assert self.model is not None
        with _full_state_dict_type(self.model, rank0_only=True, offload_to_cpu=False):
            state_dict = FSDP.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:
                # upstream's format: keyed by index, as a plain optimizer saves it
                state_dict = FSDP.rekey_optim_state_dict(state_dict, OptimStateKeyType.PARAM_ID, self.model)
            return state_dict

    def _on_cpu(self) -> bool:
        return self.parallel_devices is not None and self.root_device.type == "cpu"
