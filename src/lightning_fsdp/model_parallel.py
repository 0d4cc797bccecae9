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
"""Fabric's ``ModelParallelStrategy`` (FSDP2, tensor parallelism), loading full checkpoints shard-locally.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import model_parallel as _upstream
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.core.model_parallel import ModelParallelStrategy as _CoreModelParallelStrategy
from lightning_fsdp.devices import (
    _check_cluster_environment,
    _check_distinct_devices,
    _check_placement,
    on_own_device,
)
from lightning_fsdp.layouts.fsdp2 import has_dtensor_params
from lightning_fsdp.loading.errors import load_errors_printed_once_per_node
from lightning_fsdp.loading.materialize import (
    InitRecord,
    MetaMaterializer,
    attach_init_record,
    shared_tensor_names,
)
from lightning_fsdp.loading_calls import (
    broadcast_load_path,
    load_into_state,
    load_request,
    raise_if_path_refused,
)
from lightning_fsdp.saving.background import sharded_saves_in_background
from lightning_fsdp.strategy_options import CheckpointOptions

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

TModel = TypeVar("TModel", bound=Module)


class ModelParallelStrategy(CheckpointOptions, _CoreModelParallelStrategy):
    r"""Fabric's :class:`~lightning.fabric.strategies.ModelParallelStrategy` that loads full checkpoints shard-locally.

    It behaves like the upstream class (FSDP2 and tensor parallelism applied by ``parallelize_fn``; on CPU with the
    ``gloo`` backend too). In addition, :meth:`load_checkpoint` (``fabric.load``, ``fabric.load_raw``) reads raw module
    state dicts, safetensors and Hugging Face checkpoints besides Fabric's own, and copies each rank's own slice of
    every tensor straight into its ``DTensor`` shards, without broadcasting full tensors. Like
    :class:`lightning_fsdp.FSDPStrategy`, it refuses a launch that would put two ranks of a node on the same device,
    and ``fabric.init_module()`` and :meth:`setup_module` keep every tensor on the rank's own device.

    Arguments:
        parallelize_fn: A function that applies parallelisms to a module. The strategy will provide the
            model and device mesh as input.
        data_parallel_size: The number of devices within a data-parallel group. Defaults to ``"auto"``, which
            sets this size to the number of nodes in the cluster.
        tensor_parallel_size: The number of devices within a tensor-parallel group. Defaults to ``"auto"``, which
            sets this size to the number of GPUs in a single node.
        save_distributed_checkpoint: If ``True``, each rank saves its shard of weights and optimizer states to a file.
            If ``False``, the full weights and optimizer states get assembled on rank 0 and saved to a single file.
        process_group_backend: The ``torch.distributed`` backend (default: chosen for the device).
        timeout: The timeout of the process group's collectives.
        load_concurrency: How many ranks of a node may hold a checkpoint that must be read whole (a pickled file
            loaded with ``weights_only=False``) in host memory at the same time; ``"auto"`` derives it from the
            memory available to the node. See :class:`lightning_fsdp.FSDPStrategy`.
        load_progress: Show a progress bar while loading, once per node, when the output is a terminal.
        save_in_background: Write checkpoints in the background, full ones and distributed ones; see
            :class:`lightning_fsdp.FSDPStrategy`.

    """

    def __init__(
        self,
        parallelize_fn: Callable[[TModel, "DeviceMesh"], TModel],
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        load_concurrency: int | Literal["auto"] = "auto",
        load_progress: bool = True,
        save_in_background: bool = False,
    ) -> None:
        super().__init__(
            parallelize_fn=parallelize_fn,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_checkpoint_options(load_concurrency, load_progress, save_in_background)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Upstream's context, with the rank's own GPU current (:func:`~lightning_fsdp.devices.on_own_device`)."""
        return on_own_device(self.root_device, super().module_init_context(empty_init=empty_init))

    @override
    def setup_environment(self) -> None:
        """Upstream's setup (device, process group, device mesh), refusing ranks that would share a device.

        Before a device is selected and the process group is joined, the ranks that the cluster environment reports
        must fit ``Fabric(devices=..., num_nodes=...)`` and the visible CUDA devices, and agree with the variables of
        any other launcher that describes this process; otherwise it raises, naming the values and where they were
        read. See :meth:`_setup_distributed` for the check that follows.

        """
        _check_cluster_environment(
            self.cluster_environment, self.parallel_devices, self.num_nodes, strategy=type(self).__name__
        )
        super().setup_environment()

    @override
    def _setup_distributed(self) -> None:
        """Upstream's process group, then a check across all ranks that no two share a node slot or a physical GPU.

        It runs here, before upstream's ``setup_environment`` builds the device mesh on the process group, so that
        ranks sharing a device all fail with the same clear error instead of inside the mesh's collectives.

        """
        super()._setup_distributed()
        _check_distinct_devices(
            self.global_rank,
            self.node_rank,
            self.local_rank,
            self.root_device,
            self.world_size,
            strategy=type(self).__name__,
        )

    @override
    def setup_module(self, module: Module) -> Module:
        """Applies ``parallelize_fn`` to the model, and materialises a model created on the meta device.

        Upstream's method, except for a model created on the meta device (``fabric.init_module(empty_init=True)``)
        that ``parallelize_fn`` left there: instead of upstream's ``to_empty()`` and ``reset_parameters()``, each
        ``DTensor`` parameter is allocated as its local shard on the rank's device, tensors that two modules share
        stay one tensor, and each module is initialised by the model's own initialisation (``_init_weights`` of a
        Hugging Face model, which also computes buffers such as RoPE's ``inv_freq``) and by ``reset_parameters()``
        where that leaves a tensor unwritten; a module without either is allowed. Tensors that ``parallelize_fn``
        materialised keep their values. Floating-point tensors that nothing wrote are filled with NaN, and a load
        that leaves any of them unwritten warns, naming them.

        Before ``parallelize_fn`` and after the module is set up, no parameter or buffer may live on a CUDA device other
        than the rank's own; a ``DTensor`` is checked by its local shard. CPU and meta tensors are allowed.

        """
        record = InitRecord()
        with _materializing_after_parallelize(self, record):
            module = super().setup_module(module)
        attach_init_record(module, record)
        _check_placement(module, self.root_device, where="after `parallelize_fn`", strategy=type(self).__name__)
        return module

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save model, optimizer, and other state; see upstream's method.

        A full checkpoint (``save_distributed_checkpoint=False``) is written by every rank, each its own slices,
        without a gather (:func:`lightning_fsdp.saving.save_full_checkpoint`); where that cannot serve the state,
        upstream's gather on rank 0 runs. Upstream's checks of the arguments and the path come first, in its order:
        a path that is a directory but not a sharded checkpoint raises upstream's ``IsADirectoryError`` before the
        state is read.

        """
        self.wait_for_save()
        if not self._save_distributed_checkpoint and storage_options is None:
            path = self.broadcast(path)
            if Path(path).is_dir() and not _upstream._is_sharded_checkpoint(Path(path)):
                return super().save_checkpoint(path, state, filter=filter)  # upstream's error
            modules = [obj for obj in state.values() if isinstance(obj, Module) and has_dtensor_params(obj)]
            if len(modules) == 1:
                from lightning_fsdp.saving import save_full_checkpoint

                with load_errors_printed_once_per_node(self.global_rank, self.local_rank):
                    if save_full_checkpoint(
                        self, path, state, filter, modules[0], fsdp2=True, background=self._background_saves
                    ):
                        return
        saves = self._background_saves if self._save_distributed_checkpoint else None
        with sharded_saves_in_background(saves, "lightning.fabric.strategies.model_parallel"):
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint into the given model, optimizers and other state; return what nobody asked for.

        Every checkpoint (a sharded directory or a full file that ``fabric.save`` wrote, a raw module state dict in zip
        or legacy format, a ``.safetensors`` file, a Hugging Face sharded checkpoint) is validated on every rank before
        anything is written. A full file is loaded shard-locally: each rank copies only its own slice of every
        parameter and optimizer state into its local ``DTensor`` shards, reading only those bytes. A sharded directory
        is read by the same validated reader as with :class:`lightning_fsdp.FSDPStrategy` (its metadata through an
        allow-list, every entry checked against the model first), each rank reading its own shards; ``load_raw``
        reads its model entry. See :meth:`lightning_fsdp.FSDPStrategy.load_checkpoint` for the formats, ``strict``
        and ``weights_only``.

        The arguments are checked in upstream's order, with its exception types and messages; a path that holds
        nothing this method reads raises a :class:`~lightning_fsdp.CheckpointPathError`, both a ``ValueError``
        (upstream's type) and a ``CheckpointLoadError``.

        A remote file (an fsspec URL such as ``s3://...``) is read the same way, each rank fetching only its own byte
        ranges; a remote sharded directory too, by the same validated reader.

        """
        self.wait_for_save()
        if not state:
            raise ValueError(
                f"Got {type(self).__name__}.load_checkpoint(..., state={state!r}) but a state with at least "
                " a model instance to reload is required. Pass it in like so:"
                f" {type(self).__name__}.load_checkpoint(..., state={{'model': model, ...}})"
            )
        path, namespace = broadcast_load_path(self, path)
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                f"Loading a single optimizer object from a checkpoint is not supported yet with {type(self).__name__}."
            )
        module_key = None if isinstance(state, Module) else _distributed_module_key(state)
        request = load_request(state, module_key, strict, weights_only is not False, self._load_rename)
        with load_errors_printed_once_per_node(self.global_rank, self.local_rank):
            try:
                return load_into_state(self, path, state, request, namespace)
            except Exception as error:
                raise_if_path_refused(
                    path,
                    error,
                    raw=module_key is None,
                    strategy=type(self).__name__,
                    shards="distributed checkpoint shards",
                )
                raise


@contextmanager
def _materializing_after_parallelize(strategy: ModelParallelStrategy, record: InitRecord) -> Iterator[None]:
    """Materialise the model as soon as ``parallelize_fn`` returns it, inside upstream's ``setup_module``.

    Upstream's ``setup_module`` then finds nothing left on the meta device to materialise its way. The placement check
    and the shared tensors are taken just before ``parallelize_fn``, after upstream's own checks of the module; the
    shared tensors and what nothing initialised go into ``record``.

    """
    parallelize_fn = strategy._parallelize_fn

    def parallelize_and_materialize(module: Module, device_mesh: "DeviceMesh") -> Module:
        name = type(strategy).__name__
        _check_placement(module, strategy.root_device, where="before `parallelize_fn`", strategy=name)
        record.ties = shared_tensor_names(module)
        module = parallelize_fn(module, device_mesh)
        # Anything but a module: upstream raises its error.
        if isinstance(module, Module) and _has_meta_device_parameters_or_buffers(module):
            materializer = MetaMaterializer(module, strategy.root_device)
            materializer.materialize(module)
            record.uninitialized = materializer.uninitialized()
        return module

    strategy._parallelize_fn = parallelize_and_materialize
    try:
        yield
    finally:
        strategy._parallelize_fn = parallelize_fn


def _distributed_module_key(state: dict[str, Any]) -> str:
    keys = [
        key
        for key, obj in state.items()
        if _upstream._has_dtensor_modules(obj) or (isinstance(obj, Module) and has_dtensor_params(obj))
    ]
    if not keys:
        raise ValueError(
            "Could not find a distributed model in the provided checkpoint state. Please provide the model as"
            " part of the state like so: `load_checkpoint(..., state={'model': model, ...})`. Make sure"
            " you set up the model (and optimizers if any) through the strategy before loading the checkpoint."
        )
    if len(keys) > 1:
        raise ValueError(
            "Found multiple distributed models in the given state. Loading distributed checkpoints is"
            " currently limited to a single model per checkpoint. To load multiple models, call the"
            " load method for each model separately with a different path."
        )
    return keys[0]
