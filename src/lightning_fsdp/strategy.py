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
"""Fabric's ``FSDPStrategy``, extended to run on CPU and to load large checkpoints safely.

Upstream destination: ``src/lightning/fabric/strategies/fsdp.py``.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import FSDPStrategy as _UpstreamFSDPStrategy
from lightning.fabric.strategies.fsdp import (
    _has_fsdp_modules,
    _is_sharded_checkpoint,
    _move_torchmetrics_to_device,
    _setup_activation_checkpointing,
)
from lightning.fabric.strategies.strategy import _apply_filter
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.devices import (
    _check_cluster_environment,
    _check_distinct_devices,
    _check_placement,
    _own_cuda_device,
)


class FSDPStrategy(_UpstreamFSDPStrategy):
    r"""Fabric's :class:`~lightning.fabric.strategies.FSDPStrategy` that also runs on CPU.

    It accepts every argument of the upstream class and behaves the same on CUDA. In addition:

    - it runs on CPU with the ``gloo`` backend (``Fabric(accelerator="cpu", strategy=FSDPStrategy(...))``), so
      sharded training, saving and loading can be tested without a GPU;
    - ``empty_init=True`` (meta-device initialization) works on CPU as on GPU.

    Arguments:
        \*args: Passed to :class:`lightning.fabric.strategies.FSDPStrategy`.
        \**kwargs: Passed to :class:`lightning.fabric.strategies.FSDPStrategy`.

    """

    @override
    def setup_environment(self) -> None:
        # Refuse ranks that would share a device before one is selected and before the process group is joined.
        _check_cluster_environment(self.cluster_environment, self.parallel_devices, self.num_nodes)
        # Upstream builds a tuple ``device_mesh`` on CUDA unconditionally; build it for the device type in use.
        mesh_shape = self._fsdp_kwargs.get("device_mesh")
        if isinstance(mesh_shape, tuple):
            del self._fsdp_kwargs["device_mesh"]
        super().setup_environment()
        _check_distinct_devices(self.global_rank, self.node_rank, self.local_rank, self.root_device, self.world_size)
        if isinstance(mesh_shape, tuple):
            from torch.distributed.device_mesh import init_device_mesh

            self._fsdp_kwargs["device_mesh"] = init_device_mesh(self.root_device.type, mesh_shape)

    @override
    def setup_module(self, module: Module) -> Module:
        """Wraps the model into a :class:`~torch.distributed.fsdp.FullyShardedDataParallel` module.

        Unlike upstream, the device is passed to FSDP as a :class:`torch.device`, which FSDP accepts for CPU too.

        """
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(submodule, FullyShardedDataParallel) for submodule in module.modules()):
            # The user wrapped their submodules manually: the auto wrap policy must not wrap them again.
            if _has_meta_device_parameters_or_buffers(module):
                rank_zero_warn(
                    "The model is already wrapped in `FSDP` but there are still parameters on the meta device."
                )
            if self._fsdp_kwargs.pop("auto_wrap_policy", None) is not None:
                rank_zero_warn(
                    "A FSDP `auto_wrap_policy` is set, but the model is already wrapped. The policy will be ignored."
                )
        else:
            _check_placement(module, self.root_device, where="before wrapping")
            module = FullyShardedDataParallel(module=module, **self._fsdp_wrapper_kwargs())

        _move_torchmetrics_to_device(module, self.root_device)
        _setup_activation_checkpointing(module, self._activation_checkpointing_kwargs)
        _check_placement(module, self.root_device, where="after wrapping")
        return module

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Upstream's context (meta device with ``empty_init=True``), with the rank's own GPU as the current device.

        So a model that creates tensors on ``"cuda"`` inside ``fabric.init_module()`` puts them on the rank's GPU.

        """
        stack = ExitStack()
        stack.enter_context(_own_cuda_device(self.root_device))
        stack.enter_context(super().module_init_context(empty_init=empty_init))
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        return enable_wrap(wrapper_cls=FullyShardedDataParallel, **self._fsdp_wrapper_kwargs())

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save model, optimizer, and other state to a checkpoint on disk.

        See :meth:`lightning.fabric.strategies.FSDPStrategy.save_checkpoint`. A full checkpoint
        (``state_dict_type="full"``) is assembled on rank 0 with CPU offloading only where the model lives on an
        accelerator: on a CPU model, FSDP's offload returns views of storage it frees right after, which crashes.

        """
        if self._state_dict_type != "full" or self.root_device.type != "cpu":
            return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        if storage_options is not None:
            raise TypeError(
                "`FSDPStrategy.save_checkpoint(..., storage_options=...)` is not supported because"
                " `FSDPStrategy` does not use the `CheckpointIO`."
            )
        path = Path(self.broadcast(path))
        if path.is_dir() and not _is_sharded_checkpoint(path):
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
        module = _single_fsdp_module(state, verb="save")
        full_state = _full_state(module, state, filter or {}, offload_to_cpu=False)
        if self.global_rank == 0:
            if path.is_dir():
                import shutil

                shutil.rmtree(path)
            torch.save(full_state, path)

    def _fsdp_wrapper_kwargs(self) -> dict[str, Any]:
        return {
            "cpu_offload": self.cpu_offload,
            "mixed_precision": self.mixed_precision_config,
            "sharding_strategy": self.sharding_strategy,
            "device_id": self.root_device,
            **self._fsdp_kwargs,
        }


def _single_fsdp_module(state: dict[str, Any], verb: str) -> Module:
    modules = [obj for obj in state.values() if _has_fsdp_modules(obj)]
    if not modules:
        raise ValueError(
            f"Could not find a FSDP model in the provided checkpoint state. Please provide the model as part of the"
            f" state like so: `{verb}_checkpoint(..., state={{'model': model, ...}})`. Make sure you set up the model"
            " (and optimizers if any) through the strategy first."
        )
    if len(modules) > 1:
        raise ValueError(
            f"Found multiple FSDP models in the given state. `FSDPStrategy.{verb}_checkpoint` handles one model per"
            f" checkpoint: call it once per model, each with its own path."
        )
    return modules[0]


def _full_state(
    module: Module, state: dict[str, Any], filter: dict[str, Callable[[str, Any], bool]], offload_to_cpu: bool
) -> dict[str, Any]:
    """Assemble the full (unsharded) state of every object in ``state`` on rank 0; other ranks get partial data."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    full_state: dict[str, Any] = {}
    with _full_state_dict_type(module, rank0_only=True, offload_to_cpu=offload_to_cpu):
        for key, obj in state.items():
            if isinstance(obj, Module):
                converted = obj.state_dict()
            elif isinstance(obj, Optimizer):
                converted = FSDP.optim_state_dict(module, obj)
            else:
                converted = obj.state_dict() if isinstance(obj, _Stateful) else obj
            _apply_filter(key, filter, converted, full_state)
    return full_state


def _full_state_dict_type(module: Module, rank0_only: bool, offload_to_cpu: bool) -> AbstractContextManager:
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.state_dict_type(
        module=module,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=rank0_only),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=rank0_only),
    )
