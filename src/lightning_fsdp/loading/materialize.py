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
"""Materialise a model created on the meta device while it is sharded, and remember what nothing initialised.

``fabric.init_module(empty_init=True)`` creates every tensor on the meta device. FSDP1 materialises each unit as it
wraps it, by calling ``reset_parameters()`` of every module that holds tensors; Fabric's ``ModelParallelStrategy``
(FSDP2, tensor parallelism) calls ``to_empty`` and ``reset_parameters()`` after ``parallelize_fn``. Both leave a
module without such a method (a Hugging Face ``LlamaRMSNorm``, a rotary embedding whose ``inv_freq`` is a
non-persistent buffer) holding arbitrary memory, and ``to_empty`` unties weights that two modules share.
:class:`MetaMaterializer` replaces both: for each module it allocates the tensors on the rank's device (a ``DTensor``
as its local shard only), reusing the tensor already allocated for one that two modules share, then runs the module's
initialisation: the model's own (``_init_weights`` of the Hugging Face model that contains it), then
``reset_parameters()`` if that left a tensor unwritten. Tensors of the module that were materialised before (by the
user) keep their values. It records which tensors each initialisation wrote; those that none did are filled with NaN
(floating point) and named in an :class:`InitRecord` on the set-up module, which the loader reads to warn about what a
load left uninitialised, and to advise re-tying a missing tied weight.

It lives with the loading code because the loader reads its record; the strategies only create it.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import Embedding, Module, Parameter
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from lightning_fsdp.core.fsdp import _join as join
from lightning_fsdp.layouts.fsdp2 import ambiguous_strided_dim, local_indices
from lightning_fsdp.layouts.targets import clean_name

_RECORD_ATTRIBUTE = "_meta_init_record"


@dataclass
class InitRecord:
    """What ``setup_module`` knows about a model's tensors that the loader needs: ties, and what is uninitialised."""

    ties: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Name -> the other names of the same tensor, as the model was before wrapping (shared parameters, buffers)."""
    uninitialized: set[str] = field(default_factory=set)
    """Names of tensors materialised from the meta device that no initialisation and no load has written yet."""


def init_record(module: Module) -> InitRecord | None:
    """The record that ``setup_module`` attached to ``module``, if it is the module that ``setup_module`` returned."""
    record = vars(module).get(_RECORD_ATTRIBUTE)  # not `getattr`: FSDP forwards unknown names to the wrapped module
    return record if isinstance(record, InitRecord) else None


def attach_init_record(module: Module, record: InitRecord) -> None:
    """Keep ``record`` with the module that ``setup_module`` returns, for the loads into it."""
    setattr(module, _RECORD_ATTRIBUTE, record)


def shared_tensor_names(module: Module) -> dict[str, tuple[str, ...]]:
    """Name -> the other names of the same parameter or buffer, for every tensor that ``module`` holds twice."""
    groups: dict[int, list[str]] = {}
    for name, tensor in _named_tensors(module):
        groups.setdefault(id(tensor), []).append(clean_name(name))
    ties: dict[str, tuple[str, ...]] = {}
    for names in groups.values():
        unique = list(dict.fromkeys(names))
        for name in unique if len(unique) > 1 else ():
            ties[name] = tuple(other for other in unique if other != name)
    return ties


@dataclass
class _Materialized:
    """A meta tensor, the tensor that replaced it (weakly: FSDP frees it once flattened), its names, and its state."""

    meta: torch.Tensor
    tensor: "weakref.ref[torch.Tensor]"
    names: list[str]
    initialized: bool = False


class MetaMaterializer:
    """Materialises a model created on the meta device, module by module; see the module's docstring.

    As FSDP1's ``param_init_fn`` it is called once per module of each unit that FSDP wraps, parents before children;
    tied tensors stay tied within a unit (the only place where FSDP1 supports them). For a model that FSDP2 or tensor
    parallelism sharded on the meta device, :meth:`materialize` does the whole model at once. Modules whose tensors
    are all materialised already are skipped.

    Args:
        root: The model: the names recorded are the names of its tensors.
        device: Where to allocate the tensors (the rank's own device).

    """

    def __init__(self, root: Module, device: torch.device) -> None:
        self.device = device
        self._module_names: dict[int, list[str]] = {}
        for name, submodule in root.named_modules(remove_duplicate=False):
            self._module_names.setdefault(id(submodule), []).append(name)
        self._model_init = {**_model_init_functions(root), **_adapter_init_functions(root)}
        self._materialized: dict[int, _Materialized] = {}

    def __call__(self, module: Module) -> None:
        self._initialize(module, self._allocate(module))

    def materialize(self, root: Module) -> None:
        """Materialise every module of ``root``, a model whose parameters may be ``DTensor`` objects on meta.

        Every tensor is allocated first, each ``DTensor`` as its local shard only, and FSDP2 takes the new shards as
        its own (as after ``to_empty``); then each module is initialised, parents before children.

        """
        created = [(module, self._allocate(module)) for module in root.modules()]
        _adopt_fsdp2_shards(root)
        for module, entries in created:
            self._initialize(module, entries)

    def uninitialized(self) -> set[str]:
        """The names of the tensors that no initialisation wrote (a later one that shares them may have)."""
        return {name for entry in self._materialized.values() if not entry.initialized for name in entry.names}

    def _allocate(self, module: Module) -> list[_Materialized]:
        """Replace the module's own meta tensors with empty ones on the device; a shared one is allocated once."""
        created = []
        prefixes = self._module_names.get(id(module), [])
        for registry in (module._parameters, module._buffers):
            for name, tensor in registry.items():
                if tensor is None or not tensor.is_meta:
                    continue
                entry = self._materialized.get(id(tensor))
                replacement = entry.tensor() if entry is not None else None
                if replacement is None:
                    # A DTensor's `empty_like` allocates its local shard only.
                    replacement = torch.empty_like(tensor, device=self.device)
                    if isinstance(tensor, Parameter):
                        replacement = Parameter(replacement, requires_grad=tensor.requires_grad)
                    entry = _Materialized(tensor, weakref.ref(replacement), [])
                    self._materialized[id(tensor)] = entry
                entry.names.extend(clean_name(join(prefix, name)) for prefix in prefixes)
                registry[name] = replacement
                created.append(entry)
        return created

    def _initialize(self, module: Module, created: list[_Materialized]) -> None:
        """Initialise the tensors just allocated for ``module``; fill those that nothing wrote with NaN."""
        if not created:
            return
        with torch.no_grad():
            kept = _tensors_kept(module, created)
            with _sharded_padding_row_zeroed_locally(module):
                unwritten = self._run_initialization(module, created)
            for tensor, value in kept:
                tensor.copy_(value)
            for entry in unwritten:
                tensor = entry.tensor()
                if tensor is not None and tensor.is_floating_point():
                    # Uninitialised memory that reaches the logits makes them silently wrong; NaN makes them loudly so.
                    tensor.fill_(float("nan"))

    def _run_initialization(self, module: Module, created: list[_Materialized]) -> list[_Materialized]:
        """Run the model's initialisation, then ``reset_parameters()`` if needed; return what neither wrote."""
        unwritten = [entry for entry in created if not entry.initialized]
        steps: list[Callable[[], Any]] = []
        model_init = self._model_init.get(id(module))
        if model_init is not None:
            steps.append(lambda: model_init(module))
        reset_parameters = getattr(module, "reset_parameters", None)
        if callable(reset_parameters):
            steps.append(reset_parameters)
        for step in steps:
            if not unwritten:
                break
            with _WriteRecorder() as recorder:
                step()
            for entry in unwritten:
                entry.initialized = recorder.wrote(module, entry)
            unwritten = [entry for entry in unwritten if not entry.initialized]
        return unwritten


class _WriteRecorder(TorchDispatchMode):
    """Records the storages that operators write into (``normal_``, ``copy_``, ``fill_``, ... through any view)."""

    def __init__(self) -> None:
        super().__init__()
        self._written: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        schema_arguments = func._schema.arguments
        for index, argument in enumerate(schema_arguments):
            alias = argument.alias_info
            if alias is None or not alias.is_write:
                continue
            value = args[index] if index < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(tensor, torch.Tensor):
                    self._written.update(_storage_keys(tensor))
        return func(*args, **kwargs)

    def wrote(self, module: Module, entry: _Materialized) -> bool:
        tensor = entry.tensor()
        if tensor is None:
            return True
        current = [value for value in (*module._parameters.values(), *module._buffers.values()) if value is not None]
        if not any(value is tensor for value in current):
            return True  # the initialisation replaced it with a tensor of its own
        # No storage with elements on this rank (an empty tensor or shard): nothing here to initialise.
        return all(key in self._written for key in _storage_keys(tensor))


def _storage_keys(tensor: torch.Tensor) -> list[int]:
    """The storages that hold ``tensor``'s elements on this rank: its own, or a ``DTensor``'s local shard's."""
    if is_traceable_wrapper_subclass(tensor):
        inner_names, _ = tensor.__tensor_flatten__()
        inners = [getattr(tensor, name) for name in inner_names]  # a DTensor's include its device mesh
        return [key for inner in inners if isinstance(inner, torch.Tensor) for key in _storage_keys(inner)]
    if tensor.is_meta:
        return []
    storage = tensor.untyped_storage()
    return [storage.data_ptr()] if storage.nbytes() else []


def _tensors_kept(module: Module, created: list[_Materialized]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The module's own tensors that were materialised before (by the user), each with a copy of its values."""
    allocated = {id(tensor) for entry in created if (tensor := entry.tensor()) is not None}
    own = (*module._parameters.values(), *module._buffers.values())
    return [(tensor, tensor.clone()) for tensor in own if tensor is not None and id(tensor) not in allocated]


@contextmanager
def _sharded_padding_row_zeroed_locally(module: Module) -> Iterator[None]:
    """Initialise an embedding whose weight is a sharded ``DTensor`` with its padding row zeroed in the local shard.

    ``nn.Embedding.reset_parameters()`` and Hugging Face's ``_init_weights`` zero ``weight[padding_idx]``; indexing a
    ``DTensor`` that is sharded along its rows gathers the whole weight on every rank and zeroes the gathered copy,
    so the row would keep its random values. The initialisation runs without ``padding_idx`` instead, then each rank
    zeroes the row if its shard holds it.

    """
    from torch.distributed.tensor import DTensor

    weight = module._parameters.get("weight") if isinstance(module, Embedding) else None
    padding_idx = getattr(module, "padding_idx", None)
    mesh = weight.device_mesh if isinstance(weight, DTensor) else None
    coordinate = mesh.get_coordinate() if mesh is not None else None
    held = None
    if isinstance(weight, DTensor) and padding_idx is not None and coordinate is not None:
        shape, placements = tuple(weight.shape), tuple(weight.placements)
        if ambiguous_strided_dim(shape, tuple(mesh.shape), placements) is None:
            held = local_indices(shape, mesh.shape, coordinate, placements)
    if held is None or weight.is_meta:  # not a DTensor, or placements that only DTensor itself knows
        yield
        return
    module.padding_idx = None
    try:
        yield
    finally:
        module.padding_idx = padding_idx
    local_row = 0
    for rows in held[0]:
        if padding_idx in rows:
            weight.to_local()[local_row + padding_idx - rows.start].zero_()
        local_row += len(rows)


def _adopt_fsdp2_shards(root: Module) -> None:
    """Let FSDP2 take the sharded parameters just registered on its modules as its own, padding them as it needs.

    FSDP2 does this itself after ``nn.Module._apply`` (``to_empty``) and in its lazy initialisation; doing it now
    keeps its state consistent from ``setup_module`` on (a load, a ``reshard()``, a state dict before any forward).

    """
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            for param_group in _fsdp_param_groups(module):
                for fsdp_param in param_group.fsdp_params:
                    fsdp_param.reset_sharded_param()


def _fsdp_param_groups(module: Module) -> list[Any]:
    """The FSDP2 parameter groups of ``module``: a list since torch 2.13, at most one group before it."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return groups
    group = state._fsdp_param_group
    return [] if group is None else [group]


def _model_init_functions(root: Module) -> dict[int, Callable[[Module], None]]:
    """For each module inside a Hugging Face model: that model's ``_init_weights`` (the nearest one, as HF does)."""
    transformers = sys.modules.get("transformers")  # a model of that library means it is imported already
    pretrained_model = getattr(transformers, "PreTrainedModel", None)
    if pretrained_model is None:
        return {}
    functions: dict[int, Callable[[Module], None]] = {}
    stack: list[tuple[Module, Callable[[Module], None] | None]] = [(root, None)]
    while stack:
        module, init = stack.pop()
        if isinstance(module, pretrained_model) and callable(getattr(module, "_init_weights", None)):
            init = module._init_weights
        if init is not None:
            functions[id(module)] = init
        stack.extend((child, init) for child in module.children())
    return functions


def _adapter_init_functions(root: Module) -> dict[int, Callable[[Module], None]]:
    """For each module holding a peft LoRA adapter's weights: the initialisation that peft gives a new adapter.

    peft initialises an adapter when it adds it; on the meta device that wrote nothing, and the model's own
    initialisation would make ``lora_B`` random, so a new adapter would change the model's output before any training.
    The adapter's ``init_lora_weights`` decides, as in peft: ``True`` (its default) initialises ``lora_A`` as
    ``nn.Linear`` does and ``lora_B`` to zero; ``"gaussian"`` draws ``lora_A`` from a normal distribution with standard
    deviation ``1 / r``; ``False`` leaves both as ``nn.Linear`` initialises them. An embedding's adapter has
    ``lora_embedding_A`` zero and ``lora_embedding_B`` standard normal (both normal with ``False``). Schemes computed
    from the base weights (PiSSA, OLoRA, LoftQ, ...) cannot be computed before they are loaded: those adapters start
    as with ``True``, with a warning.

    """
    lora = sys.modules.get("peft.tuners.lora.layer")  # a model with a LoRA adapter means peft imported it already
    lora_layer = getattr(lora, "LoraLayer", None)
    if lora_layer is None:
        return {}
    functions: dict[int, Callable[[Module], None]] = {}
    stack: list[tuple[Module, Any]] = [(root, None)]
    while stack:
        module, configs = stack.pop()
        configs = getattr(module, "peft_config", configs)  # a PeftModel's or LoraModel's adapter name -> config
        if isinstance(module, lora_layer):
            schemes = {adapter: _lora_init_scheme(configs, adapter) for adapter in module.r}
            for adapter, rank in module.r.items():
                if adapter in module.lora_A:
                    functions[id(module.lora_A[adapter])] = _lora_a_init(schemes[adapter], rank)
                    functions[id(module.lora_B[adapter])] = _lora_b_init(schemes[adapter])
            for name, zero_when_new in (("lora_embedding_A", True), ("lora_embedding_B", False)):
                holder = getattr(module, name, None)
                if holder is not None and len(holder):
                    functions[id(holder)] = _lora_embedding_init(schemes, zero_when_new)
        stack.extend((child, configs) for child in module.children())
    return functions


def _lora_init_scheme(configs: Any, adapter: str) -> Any:
    """The adapter's ``init_lora_weights`` (``True``, ``False`` or ``"gaussian"``), ``True`` for what meta cannot do."""
    config = configs.get(adapter) if isinstance(configs, dict) else None
    scheme = getattr(config, "init_lora_weights", True)
    if scheme is True or scheme is False or (isinstance(scheme, str) and scheme.lower() == "gaussian"):
        return scheme
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(
        f"The LoRA adapter {adapter!r} asks for `init_lora_weights={scheme!r}`, which peft computes from the base"
        " weights; a model created with `init_module(empty_init=True)` has none yet, so the adapter starts as with"
        " `init_lora_weights=True` (`lora_B` zero: the adapter changes nothing until trained). For that scheme, create"
        " the adapter on a model whose base weights are loaded, or load the adapter from a file."
    )
    return True


def _lora_a_init(scheme: Any, rank: int) -> Callable[[Module], None]:
    def initialize(module: Module) -> None:
        reset_parameters = getattr(module, "reset_parameters", None)
        if callable(reset_parameters):  # nn.Linear, nn.Conv*: what peft's default does for `lora_A`
            reset_parameters()
        if isinstance(scheme, str):  # "gaussian"
            torch.nn.init.normal_(module.weight, std=1 / rank)

    return initialize


def _lora_b_init(scheme: Any) -> Callable[[Module], None]:
    def initialize(module: Module) -> None:
        reset_parameters = getattr(module, "reset_parameters", None)
        if scheme is False and callable(reset_parameters):
            reset_parameters()
            return
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            tensor.zero_()

    return initialize


def _lora_embedding_init(schemes: dict[str, Any], zero_when_new: bool) -> Callable[[Module], None]:
    def initialize(holder: Module) -> None:
        for adapter, tensor in holder.named_parameters(recurse=False):
            if zero_when_new and schemes.get(adapter) is not False:
                tensor.zero_()
            else:
                tensor.normal_()

    return initialize


def _named_tensors(module: Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)
