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
from typing import Any, Literal

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
from lightning.fabric.utilities.load import _move_state_into
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
from lightning_fsdp.loading.agreement import Agreement
from lightning_fsdp.loading.formats import CheckpointFormat, detect_checkpoint
from lightning_fsdp.loading.loader import LoadRequest, RankInfo, load_checkpoint_file
from lightning_fsdp.loading.sharded import check_sharded_request, load_sharded_checkpoint
from lightning_fsdp.loading.turns import validate_concurrency


class FSDPStrategy(_UpstreamFSDPStrategy):
    r"""Fabric's :class:`~lightning.fabric.strategies.FSDPStrategy` that also runs on CPU.

    It accepts every argument of the upstream class and behaves the same on CUDA. In addition:

    - it runs on CPU with the ``gloo`` backend (``Fabric(accelerator="cpu", strategy=FSDPStrategy(...))``), so
      sharded training, saving and loading can be tested without a GPU;
    - ``empty_init=True`` (meta-device initialization) works on CPU as on GPU;
    - :meth:`load_checkpoint` (``fabric.load``, ``fabric.load_raw``) reads raw module state dicts, safetensors and
      Hugging Face checkpoints besides Fabric's own, shard-locally and without one copy of the file per rank.

    Arguments:
        \*args: Passed to :class:`lightning.fabric.strategies.FSDPStrategy`.
        load_concurrency: How many ranks of a node may hold a checkpoint that must be read whole (a Fabric
            checkpoint in torch's legacy format) in host memory at the same time. ``"auto"`` (default) derives it
            from the memory available to the node (or its cgroup) and the file's size; ``1`` means one rank at a
            time. Files read lazily or by byte ranges (zip, safetensors, legacy-format raw state dicts) need no turns.
        load_progress: Show a progress bar while loading, once per node, when the output is a terminal. The
            environment variable ``LIGHTNING_FSDP_PROGRESS=0`` turns it off too.
        \**kwargs: Passed to :class:`lightning.fabric.strategies.FSDPStrategy`.

    """

    def __init__(
        self, *args: Any, load_concurrency: int | Literal["auto"] = "auto", load_progress: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.load_concurrency = validate_concurrency(load_concurrency)
        self.load_progress = load_progress

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

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint into the given model, optimizers and other state; return what nobody asked for.

        Besides the checkpoints that ``fabric.save`` writes (a sharded directory or a full file), this reads files
        that Fabric did not write: a raw module state dict (``torch.save``, zip or legacy format), a ``.safetensors``
        file, and a Hugging Face sharded checkpoint (an ``*.index.json`` or the directory holding it). The format is
        told from the content, not the name. A raw file restores the model alone: with ``strict=True`` asking for
        more (an optimizer, ``"step"``) is an error; with ``strict=False`` the rest of ``state`` is left untouched.

        Full files are loaded shard-locally: each rank copies only its own slice of every parameter and optimizer
        state into its shard, reading only those bytes (zip and safetensors files, and legacy-format raw state dicts,
        whose tensors are located from their pickles). A source that must be read whole (a legacy-format Fabric
        checkpoint) is read by at most ``load_concurrency`` ranks of a node at a time. Names, shapes and dtypes are
        checked on every rank before anything is written, so a failed load leaves the model as it was, and an error
        on any rank is raised on every rank. (With a source read whole, each rank checks in its own turn: a failure
        that only a later rank hits leaves the earlier ranks loaded, and the error names the failing rank.)

        Args:
            path: A checkpoint file or directory.
            state: The model (``fabric.load_raw``), or a dict with the model, optimizers and other state to restore
                in place (``fabric.load``).
            strict: Whether the checkpoint must hold exactly the model's tensors and every requested key.
                ``strict=False`` loads what matches and warns about what it skipped.
            weights_only: Unpickle only tensors and plain containers (the default, also when ``None``). Pass
                ``False`` only for a file you trust: unpickling can run code.

        """
        if not state:
            raise ValueError(
                f"Got `FSDPStrategy.load_checkpoint(..., state={state!r})`, but a state with at least a model to"
                " load into is required. Pass it like so: `fabric.load(path, {'model': model, ...})`."
            )
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "Loading a single optimizer object from a checkpoint is not supported yet with the FSDP strategy."
                " Load it together with its model: `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
            )
        path = Path(self.broadcast(path))
        ranks = self._rank_info()
        with Agreement(f"Reading {str(path)!r}"):  # a path that some rank cannot read fails on every rank
            detected = detect_checkpoint(path)
        safe = weights_only is not False

        if isinstance(state, Module):
            module_key, module, optimizers, metadata_keys = None, state, {}, frozenset()
        else:
            module_key = _fsdp_module_key(state)
            module = state[module_key]
            optimizers = {key: obj for key, obj in state.items() if isinstance(obj, Optimizer)}
            metadata_keys = frozenset(state) - {module_key} - set(optimizers)

        if detected.format is CheckpointFormat.FABRIC_SHARDED:
            key = module_key or "model"
            with Agreement(f"Loading {str(path)!r}") as agreement:
                metadata, stored = check_sharded_request(path, key, list(optimizers), metadata_keys, strict, safe)
                agreement.agree()  # before the collectives of the distributed checkpoint reader
                present = {k: optimizer for k, optimizer in optimizers.items() if k in stored}
                load_sharded_checkpoint(path, module, key, present, strict)
            if isinstance(state, Module):
                return {}
            _move_state_into(source=metadata, destination=state, keys=metadata_keys)
            return metadata

        request = LoadRequest(module, module_key, optimizers, metadata_keys, strict=strict, weights_only=safe)
        result = load_checkpoint_file(
            request, detected, ranks, concurrency=self.load_concurrency, progress=None if self.load_progress else False
        )
        skipped = result.plan.skipped_summary()
        if skipped:
            rank_zero_warn(f"Loaded {str(path)!r} with `strict=False`: {skipped}.")
        if isinstance(state, Module):
            return {}
        _move_state_into(source=result.metadata, destination=state, keys=metadata_keys)
        return result.remainder

    def _rank_info(self) -> RankInfo:
        return RankInfo(
            global_rank=self.global_rank,
            world_size=self.world_size,
            node_rank=self.node_rank,
            local_rank=self.local_rank,
            local_world_size=self.num_processes,
        )

    def _fsdp_wrapper_kwargs(self) -> dict[str, Any]:
        return {
            "cpu_offload": self.cpu_offload,
            "mixed_precision": self.mixed_precision_config,
            "sharding_strategy": self.sharding_strategy,
            "device_id": self.root_device,
            **self._fsdp_kwargs,
        }


def _fsdp_module_key(state: dict[str, Any]) -> str:
    keys = [key for key, obj in state.items() if _has_fsdp_modules(obj)]
    if len(keys) != 1:
        _single_fsdp_module(state, verb="load")  # raises the error that names the problem
    return keys[0]


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
