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

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import fsdp as _upstream
from lightning.fabric.strategies.strategy import _apply_filter
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.core.fsdp import FSDPStrategy as _CoreFSDPStrategy
from lightning_fsdp.devices import (
    _check_cluster_environment,
    _check_distinct_devices,
    _check_placement,
    on_own_device,
)
from lightning_fsdp.loading.errors import load_errors_printed_once_per_node
from lightning_fsdp.loading.materialize import (
    InitRecord,
    MetaMaterializer,
    attach_init_record,
    shared_tensor_names,
)
from lightning_fsdp.loading.quiet import torch_internal_warnings_silenced
from lightning_fsdp.loading_calls import (
    broadcast_load_path,
    load_into_state,
    load_request,
    raise_if_path_refused,
)
from lightning_fsdp.saving.background import sharded_saves_in_background
from lightning_fsdp.strategy_options import CheckpointOptions

if TYPE_CHECKING:
    from lightning.fabric.strategies.fsdp import _POLICY, _SHARDING_STRATEGY
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffload, MixedPrecision


class FSDPStrategy(CheckpointOptions, _CoreFSDPStrategy):
    r"""Fabric's :class:`~lightning.fabric.strategies.FSDPStrategy` that also runs on CPU.

    It accepts every argument of the upstream class and behaves the same on CUDA. In addition:

    - it runs on CPU with the ``gloo`` backend (``Fabric(accelerator="cpu", strategy=FSDPStrategy(...))``), so
      sharded training, saving and loading can be tested without a GPU;
    - ``empty_init=True`` (meta-device initialization) works on CPU as on GPU;
    - :meth:`load_checkpoint` (``fabric.load``, ``fabric.load_raw``) reads raw module state dicts, safetensors and
      Hugging Face checkpoints besides Fabric's own, shard-locally and without one copy of the file per rank.

    Its parameters are upstream's, in the same order, with the same defaults and annotations (``**kwargs`` go to
    :class:`torch.distributed.fsdp.FullyShardedDataParallel`), followed by two keyword-only ones:

    Arguments:
        load_concurrency: How many ranks of a node may hold a checkpoint that must be read whole (a pickled file
            loaded with ``weights_only=False``) in host memory at the same time. ``"auto"`` (default) derives it
            from the memory available to the node (or its cgroup) and the file's size; ``1`` means one rank at a
            time. With ``weights_only=True`` (the default) every format is read by byte ranges and needs no turns.
        load_progress: Show a progress bar while loading, once per node, when the output is a terminal. The
            environment variable ``LIGHTNING_FSDP_PROGRESS=0`` turns it off too.
        save_in_background: Write checkpoints in the background: ``fabric.save`` returns once every rank holds a
            copy of its slices, and the file appears when every rank has written it (a sharded checkpoint: torch's
            distributed checkpoint writes the directory, in the strategy's thread). The next save, a load and
            :meth:`wait_for_save` wait for it and raise its error (see :mod:`lightning_fsdp.saving.background`).
            The host memory it copies into, one copy of the rank's slices, is reserved after an optimizer's first
            step, in a thread, and held from then on.

    """

    # Upstream's parameters and annotations (forward references as upstream's strings), then this package's
    # keyword-only ones: `inspect.signature` of both classes compares equal parameter by parameter.
    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: Union[bool, "CPUOffload", None] = None,
        mixed_precision: Optional["MixedPrecision"] = None,
        auto_wrap_policy: Optional["_POLICY"] = None,
        activation_checkpointing: type[Module] | list[type[Module]] | None = None,
        activation_checkpointing_policy: Optional["_POLICY"] = None,
        sharding_strategy: "_SHARDING_STRATEGY" = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "sharded",
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
            precision=precision,
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
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Upstream's context, with the rank's own GPU current (:func:`~lightning_fsdp.devices.on_own_device`)."""
        return on_own_device(self.root_device, super().module_init_context(empty_init=empty_init))

    @override
    def setup_environment(self) -> None:
        if self.root_device.type == "cpu" and self.cpu_offload.offload_params:
            # FSDP accepts it and fails at the first forward, deep inside torch: refuse it before any process group
            raise ValueError(
                "`FSDPStrategy(cpu_offload=True)` moves the parameters from an accelerator to host memory, and this"
                ' strategy runs on CPU (`accelerator="cpu"`), where FSDP would fail at the first forward ("Cannot'
                ' access accelerator device when none is available"). On CPU the parameters are in host memory'
                ' already: remove `cpu_offload=True`, or run on GPUs (`accelerator="cuda"`).'
            )
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

        Upstream's method, with the placement of every parameter and buffer checked before and after wrapping. On
        CPU, where upstream's ``device_id=self.root_device.index`` is ``None`` and FSDP refuses it, the model is
        wrapped here with ``device_id=self.root_device``, as upstream does it otherwise.

        A model created on the meta device (``fabric.init_module(empty_init=True)``) is materialised unit by unit on
        the rank's device, as FSDP does, unless a ``param_init_fn`` was given: tensors that two modules share stay
        one tensor, and each module is initialised by the model's own initialisation (``_init_weights`` of a Hugging
        Face model, which also computes buffers such as RoPE's ``inv_freq``) and by ``reset_parameters()`` where that
        leaves a tensor unwritten; a module without either is allowed. Floating-point tensors that nothing wrote are
        filled with NaN, and a load that leaves any of them unwritten warns, naming them.

        """
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = any(isinstance(submodule, FullyShardedDataParallel) for submodule in module.modules())
        if not wrapped:
            _check_placement(module, self.root_device, where="before wrapping")
        record = InitRecord(ties=shared_tensor_names(module))
        materializer = None
        if (
            not wrapped
            and self._fsdp_kwargs.get("param_init_fn") is None
            and _upstream._has_meta_device_parameters_or_buffers(module)
        ):
            materializer = MetaMaterializer(module, self.root_device)
        with _fsdp_kwargs_added(self._fsdp_kwargs, param_init_fn=materializer):
            if self.root_device.type != "cpu":
                module = super().setup_module(module)
            else:
                module = self._setup_module_on_cpu(module)
        if materializer is not None:
            record.uninitialized = materializer.uninitialized()
        attach_init_record(module, record)
        _check_placement(module, self.root_device, where="after wrapping")
        return module

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        """Upstream's context; on CPU, with the device passed to FSDP as in :meth:`setup_module`."""
        if self.root_device.type != "cpu":
            return super().module_sharded_context()
        from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        return enable_wrap(wrapper_cls=FullyShardedDataParallel, **cpu_wrapper_kwargs(self, self._fsdp_kwargs))

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
        (``state_dict_type="full"``) is written by every rank, each its own slices, without a gather
        (:func:`lightning_fsdp.saving.save_full_checkpoint`); where that cannot serve the state, and for a sharded
        checkpoint, this calls upstream's method, except for a full checkpoint of a strategy set up on CPU: it is
        assembled on rank 0 without CPU offloading, because on a CPU model FSDP's offload returns views of storage it
        frees right after, which crashes.

        """
        self.wait_for_save()
        if self._state_dict_type == "full" and storage_options is None and self.parallel_devices is not None:
            from lightning_fsdp.saving import save_full_checkpoint

            module = _single_fsdp_module(state, saving=True)
            with load_errors_printed_once_per_node(self.global_rank, self.local_rank):
                if save_full_checkpoint(
                    self, path, state, filter, module, fsdp2=False, background=self._background_saves
                ):
                    return None
        if self._state_dict_type != "full" or not self._set_up_on_cpu():
            saves = self._background_saves if self._state_dict_type == "sharded" else None
            with (
                torch_internal_warnings_silenced(),
                sharded_saves_in_background(saves, "lightning.fabric.strategies.fsdp"),
            ):
                return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        if storage_options is not None:
            raise TypeError(
                "`FSDPStrategy.save_checkpoint(..., storage_options=...)` is not supported because"
                " `FSDPStrategy` does not use the `CheckpointIO`."
            )
        path = Path(self.broadcast(path))
        if path.is_dir() and not _upstream._is_sharded_checkpoint(path):
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
        module = _single_fsdp_module(state, saving=True)
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
        state into its shard, reading only those bytes, at offsets that the file's own structure proves (the zip
        directory, the safetensors header, the legacy format's pickles), by positioned reads. A pickled file loaded
        with ``weights_only=False`` may hold any object and is read whole, by at most ``load_concurrency`` ranks of a
        node at a time. The model's names, shapes and dtypes, and the optimizer state's names and shapes, are checked
        on every rank before anything is written, so a failed load leaves the model as it was, and an error on any
        rank is raised on every rank as the same :class:`~lightning_fsdp.CheckpointLoadError`; an error during the
        copy says that the model is partially loaded. (With a source read whole, each rank checks in its own turn: a
        failure that only a later rank hits leaves the earlier ranks loaded, and the error names the failing rank.)

        The arguments are checked as upstream checks them, with upstream's exception types and messages. A path that
        upstream refuses too (neither a file nor a directory of checkpoint shards) and that holds nothing this method
        reads raises a :class:`~lightning_fsdp.CheckpointPathError`, both a ``ValueError`` (upstream's type) and a
        ``CheckpointLoadError``.

        A remote file (an fsspec URL such as ``s3://...``, with the ``storage_options`` of :meth:`load_options`) is
        read the same way, each rank fetching only its own byte ranges; a remote sharded directory too, by the same
        validated reader.

        Args:
            path: A checkpoint file or directory.
            state: The model (``fabric.load_raw``), or a dict with the model, optimizers and other state to restore
                in place (``fabric.load``).
            strict: Whether the checkpoint must hold exactly the model's tensors and every requested key.
                ``strict=False`` loads what matches and warns about what it skipped.
            weights_only: Unpickle only tensors and plain containers (the default, also when ``None``). Pass
                ``False`` only for a file you trust: unpickling can run code.

        """
        self.wait_for_save()
        state, module_key = _checked_state(state)
        request = load_request(state, module_key, strict, weights_only is not False, self._load_rename)
        # broadcast the path from rank 0 to ensure all the states are loaded from a common path (with the namespace of
        # this load's agreements)
        path, namespace = broadcast_load_path(self, path)
        with load_errors_printed_once_per_node(self.global_rank, self.local_rank):
            try:
                return load_into_state(self, path, state, request, namespace)
            except Exception as error:
                raise_if_path_refused(
                    path,
                    error,
                    raw=request.module_key is None,
                    strategy="FSDPStrategy",
                    shards="FSDP checkpoint shards",
                )
                raise

    def _set_up_on_cpu(self) -> bool:
        # Upstream reads `root_device` only once the devices are set; a strategy built without them is never on CPU.
        return self.parallel_devices is not None and self.root_device.type == "cpu"

    def _setup_module_on_cpu(self, module: Module) -> Module:
        """Upstream's ``setup_module`` with ``device_id=self.root_device``, for a CPU device (its index is ``None``)."""
        return wrap_on_cpu(self, module, self._fsdp_kwargs)


def cpu_wrapper_kwargs(strategy: Any, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """FSDP's arguments for a strategy's model on a CPU device: upstream's, with the device itself as ``device_id``.

    Upstream passes ``device_id=root_device.index``, which is ``None`` for a CPU device, and FSDP then refuses to run
    without an accelerator. ``strategy`` is Fabric's or the Trainer's ``FSDPStrategy``; ``fsdp_kwargs`` its own FSDP
    arguments (``_fsdp_kwargs`` and ``kwargs`` respectively).

    """
    return {
        "cpu_offload": strategy.cpu_offload,
        "mixed_precision": strategy.mixed_precision_config,
        "sharding_strategy": strategy.sharding_strategy,
        "device_id": strategy.root_device,
        **fsdp_kwargs,
    }


def wrap_on_cpu(strategy: Any, module: Module, fsdp_kwargs: dict[str, Any]) -> Module:
    """Wrap ``module`` as upstream's strategies (Fabric's and the Trainer's) do, on a CPU device.

    FSDP gets :func:`cpu_wrapper_kwargs`. ``fsdp_kwargs`` are the strategy's own, from which an ``auto_wrap_policy``
    is dropped (with upstream's warning) for a model that the user wrapped already.

    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(submodule, FullyShardedDataParallel) for submodule in module.modules()):
        # The user wrapped their submodules manually: the auto wrap policy must not wrap them again.
        if _upstream._has_meta_device_parameters_or_buffers(module):
            rank_zero_warn("The model is already wrapped in `FSDP` but there are still parameters on the meta device.")
        if fsdp_kwargs.pop("auto_wrap_policy", None) is not None:
            rank_zero_warn(
                "A FSDP `auto_wrap_policy` is set, but the model is already wrapped. The policy will be ignored."
            )
    else:
        module = FullyShardedDataParallel(module=module, **cpu_wrapper_kwargs(strategy, fsdp_kwargs))
    # Through upstream's module, so that patching upstream's helpers (as its tests do) reaches this path too.
    _upstream._move_torchmetrics_to_device(module, strategy.root_device)
    _upstream._setup_activation_checkpointing(module, strategy._activation_checkpointing_kwargs)
    return module


@contextmanager
def _fsdp_kwargs_added(fsdp_kwargs: dict[str, Any], **added: Any) -> Iterator[None]:
    """Pass ``added`` (except ``None`` values) to FSDP for one wrapping; the strategy's kwargs stay as they were."""
    added = {key: value for key, value in added.items() if value is not None}
    previous = {key: fsdp_kwargs[key] for key in added if key in fsdp_kwargs}
    fsdp_kwargs.update(added)
    try:
        yield
    finally:
        for key in added:
            if key in previous:
                fsdp_kwargs[key] = previous[key]
            else:
                fsdp_kwargs.pop(key, None)


def _checked_state(
    state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None,
) -> tuple[Module | dict[str, Any], str | None]:
    """Check ``state`` as upstream does, with its exception types and messages; return it and its module's key."""
    if not state:
        raise ValueError(
            f"Got FSDPStrategy.load_checkpoint(..., state={state!r}) but a state with at least "
            f" a model instance to reload is required. Pass it in like so:"
            " FSDPStrategy.load_checkpoint(..., state={'model': model, ...})"
            ". With Fabric: `fabric.load(path, {'model': model, ...})`, or `fabric.load_raw(path, model)` for a file"
            " that holds only the model's weights."
        )
    if isinstance(state, Module):
        return state, None
    if isinstance(state, Optimizer):
        raise NotImplementedError(
            "Loading a single optimizer object from a checkpoint is not supported yet with the FSDP strategy."
            " Load it together with its model: `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
        )
    return state, _fsdp_module_key(state)


def _fsdp_module_key(state: dict[str, Any]) -> str:
    keys = [key for key, obj in state.items() if _upstream._has_fsdp_modules(obj)]
    if len(keys) != 1:
        _single_fsdp_module(state, saving=False)  # raises the error that names the problem
    return keys[0]


def _single_fsdp_module(state: dict[str, Any], saving: bool) -> Module:
    """The one FSDP model in ``state``; upstream's ``ValueError`` (same text) if there is none or more than one."""
    verb, gerund = ("save", "saving") if saving else ("load", "loading")
    modules = [obj for obj in state.values() if _upstream._has_fsdp_modules(obj)]
    if not modules:
        raise ValueError(
            "Could not find a FSDP model in the provided checkpoint state. Please provide the model as"
            f" part of the state like so: `{verb}_checkpoint(..., state={{'model': model, ...}})`. Make sure"
            f" you set up the model (and optimizers if any) through the strategy before {gerund} the checkpoint."
        )
    if len(modules) > 1:
        raise ValueError(
            "Found multiple FSDP models in the given state. "
            f"{gerund.capitalize()} checkpoints with FSDP is"
            f" currently limited to a single model per checkpoint. To {verb} multiple models, call the"
            f" {verb} method for each model separately with a different path."
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
