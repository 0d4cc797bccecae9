"""Load any supported checkpoint into an FSDP module and its optimizers: validated, shard-local, in node turns.

This module knows torch and FSDP, not Fabric: the strategy passes plain modules, optimizers and key names.

Upstream destination: ``src/lightning/fabric/strategies/fsdp.py`` (the body of ``FSDPStrategy.load_checkpoint``) and
``src/lightning/fabric/utilities/load.py``.
"""

import math
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.fabric.strategies.fsdp import _has_fsdp_modules
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.formats import (
    ByteRangeSource,
    CheckpointFormat,
    DetectedCheckpoint,
    DictSource,
    SafetensorsSource,
    TensorSource,
    _NotLocatable,
    as_mapping,
    check_all_tensors,
    load_torch_file,
    open_index,
    read_legacy_layout,
)
from lightning_fsdp.loading.optimizer import local_optimizer_state
from lightning_fsdp.loading.progress import LoadProgress
from lightning_fsdp.loading.shard_local import (
    ModuleTargets,
    ShardLocalUnsupported,
    collect_targets,
    copy_into_module,
)
from lightning_fsdp.loading.turns import StaggeredLoad
from lightning_fsdp.loading.validation import LoadPlan, TargetSpec, plan_load


@dataclass(frozen=True)
class LoadRequest:
    """What to load from a checkpoint file, and how."""

    module: Module
    module_key: str | None
    """The key of the module in a Fabric checkpoint; ``None`` for ``load_raw`` (the file is the module's state)."""
    optimizers: Mapping[str, Optimizer] = field(default_factory=dict)
    metadata_keys: frozenset[str] = frozenset()
    """Other keys the caller asked for (``step``, ...), restored from a Fabric checkpoint."""
    strict: bool = True
    weights_only: bool = True


@dataclass
class LoadResult:
    """What a load restored and what it left out."""

    metadata: dict[str, Any]
    """The requested non-module, non-optimizer entries found in the checkpoint."""
    remainder: dict[str, Any]
    """Entries of a Fabric checkpoint that nobody asked for."""
    plan: LoadPlan
    raw: bool
    """Whether the file was a raw module state dict rather than a Fabric checkpoint."""


@dataclass
class _Opened:
    source: TensorSource
    entries: dict[str, Any]
    """The non-module top-level entries of a Fabric checkpoint (optimizers and metadata); empty for raw files."""
    raw: bool


@dataclass
class _Prepared:
    opened: _Opened
    collected: ModuleTargets | None
    plan: LoadPlan
    optimizer_states: dict[str, dict]


_warned_fallbacks: set[str] = set()


def open_checkpoint(detected: DetectedCheckpoint, module_key: str | None, weights_only: bool) -> _Opened:
    """Open a checkpoint file and tell a raw module state dict from a Fabric checkpoint by its content."""
    if detected.format is CheckpointFormat.SAFETENSORS:
        return _Opened(SafetensorsSource(detected.path), {}, raw=True)
    if detected.format is CheckpointFormat.HF_INDEX:
        return _Opened(open_index(detected.path, weights_only), {}, raw=True)
    if detected.format is CheckpointFormat.FABRIC_SHARDED:
        raise ValueError("A sharded checkpoint is loaded with `load_sharded_checkpoint`")
    lazy = detected.format.lazy
    content = as_mapping(load_torch_file(detected.path, detected.format, weights_only), detected.path)
    module_entry = content.get(module_key) if module_key is not None else None
    if isinstance(module_entry, Mapping):
        entries = {key: value for key, value in content.items() if key != module_key}
        return _Opened(DictSource(module_entry, lazy=lazy), entries, raw=False)
    if content and not any(isinstance(value, Tensor) for value in content.values()):
        keys = ", ".join(repr(key) for key in list(content)[:10])
        if module_key is None:
            raise CheckpointLoadError(
                f"The file {str(detected.path)!r} is not a raw module state dict but a checkpoint with the entries"
                f" {keys}. Load it with `fabric.load(path, {{'model': model, ...}})`, naming the entry of the model."
            )
        raise CheckpointLoadError(
            f"The checkpoint {str(detected.path)!r} has no entry {module_key!r} for the model, and it is not a raw"
            f" module state dict either. Its entries are {keys}: pass the model under the key it was saved with,"
            " e.g. `fabric.load(path, {'model': model})`."
        )
    return _Opened(DictSource(content, lazy=lazy), {}, raw=True)


def module_targets(module: Module) -> ModuleTargets | None:
    """The shard-local targets of ``module``, or ``None`` (with a one-time warning) where FSDP's own path must serve.

    Call it before any turn: the fallback path runs collectives, which must never run inside a turn.

    """
    try:
        return collect_targets(module)
    except ShardLocalUnsupported as reason:
        _warn_fallback(str(reason))
        return None


def prepare_load(request: LoadRequest, opened: _Opened, collected: ModuleTargets | None) -> _Prepared:
    """Check everything that can be checked before the model is touched, and compute each rank's slices.

    Nothing is written into the module or optimizers here, so an error leaves them exactly as they were.

    """
    _check_requested_keys(request, opened)
    targets = collected.specs() if collected is not None else _unsharded_specs(request.module)
    plan = plan_load(targets, opened.source.specs(), strict=request.strict)

    optimizer_states = {}
    for key, optimizer in request.optimizers.items():
        if key not in opened.entries:
            continue  # absent and `strict=False`: left untouched
        saved = opened.entries[key]
        if collected is None:
            optimizer_states[key] = _materialize(saved)
            continue
        try:
            optimizer_states[key] = local_optimizer_state(optimizer, collected, saved)
        except ShardLocalUnsupported as reason:
            _warn_fallback(f"optimizer {key!r}: {reason}")
            optimizer_states[key] = {"__fallback__": _materialize(saved)}
    return _Prepared(opened, collected, plan, optimizer_states)


def apply_load(request: LoadRequest, prepared: _Prepared, world_size: int, on_tensor: Any = None) -> None:
    """Write the prepared tensors into the module and optimizers."""
    if prepared.collected is not None:
        copy_into_module(prepared.collected, prepared.plan, prepared.opened.source, on_tensor=on_tensor)
    else:
        _load_with_fsdp_state_dict(request.module, prepared, world_size)
    for key, state in prepared.optimizer_states.items():
        optimizer = request.optimizers[key]
        if prepared.collected is None or "__fallback__" in state:
            _load_optimizer_with_fsdp(request.module, optimizer, state.get("__fallback__", state), world_size)
        else:
            optimizer.load_state_dict(state)


def collect_metadata(request: LoadRequest, opened: _Opened, materialize: bool) -> tuple[dict, dict]:
    """Split the remaining entries of a Fabric checkpoint into the requested metadata and the rest."""
    requested = {key: opened.entries[key] for key in request.metadata_keys if key in opened.entries}
    remainder = {
        key: value
        for key, value in opened.entries.items()
        if key not in request.metadata_keys and key not in request.optimizers
    }
    if materialize:
        return _materialize(requested), _materialize(remainder)
    return _materialize(requested), remainder


def release(prepared: _Prepared | None) -> None:
    """Drop every reference to the source, so that the turn's end (which collects garbage) returns its memory."""
    if prepared is not None:
        prepared.opened.source.close()
        prepared.opened.entries.clear()
        prepared.optimizer_states.clear()


def _check_requested_keys(request: LoadRequest, opened: _Opened) -> None:
    if opened.raw:
        requested = sorted([*request.optimizers, *request.metadata_keys])
        if requested and request.strict:
            raise CheckpointLoadError(
                "The checkpoint is a raw module state dict: it holds the model's weights only, not the requested"
                f" {', '.join(repr(k) for k in requested)}. To load the weights alone, pass `strict=False` (the other"
                " objects are left untouched) or use `fabric.load_raw(path, model)`."
            )
        return
    absent = sorted(key for key in [*request.optimizers, *request.metadata_keys] if key not in opened.entries)
    if absent and request.strict:
        raise CheckpointLoadError(
            f"The checkpoint has no entry {', '.join(repr(k) for k in absent)} that the state asks for. Its entries"
            f" are {', '.join(repr(k) for k in opened.entries)}. To load what is there, pass `strict=False`."
        )


def _unsharded_specs(module: Module) -> list[TargetSpec]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    specs = []
    # Only on the fallback path: FSDP1 units this path does not know are unsharded to read their full shapes.
    with FSDP.summon_full_params(module, writeback=False) if _has_fsdp_modules(module) else nullcontext():
        for name, tensor in module.state_dict(keep_vars=True).items():
            specs.append(TargetSpec((name,), tuple(tensor.shape), tensor.dtype))
    return specs


def _load_with_fsdp_state_dict(module: Module, prepared: _Prepared, world_size: int) -> None:
    """Upstream's path: FSDP's full-state-dict loading (all-gathers each unit). Used where the fast path cannot."""
    from lightning.fabric.strategies.model_parallel import _load_raw_module_state

    source = prepared.opened.source
    state_dict = {target: source.read(name) for target, name in prepared.plan.sources.items()}
    _load_raw_module_state(state_dict, module=module, world_size=world_size, strict=False)


def _load_optimizer_with_fsdp(module: Module, optimizer: Optimizer, state: Mapping, world_size: int) -> None:
    from lightning.fabric.strategies.fsdp import _get_full_state_dict_context
    from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with _get_full_state_dict_context(module, world_size=world_size, rank0_only=False):
        rekeyed = _rekey_optimizer_state_if_needed(dict(state), module)
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(module, optimizer, rekeyed))


def _warn_fallback(reason: str) -> None:
    if reason in _warned_fallbacks:
        return
    _warned_fallbacks.add(reason)
    rank_zero_warn(
        f"lightning-fsdp cannot load this checkpoint shard-locally ({reason}); falling back to FSDP's full state-dict"
        " loading, which all-gathers every unit and needs more memory."
    )


def _materialize(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.clone()
    if isinstance(obj, Mapping):
        return {key: _materialize(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_materialize(value) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_materialize(value) for value in obj)
    return obj


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits: what turns and error agreement need to know."""

    global_rank: int = 0
    world_size: int = 1
    node_rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1


def load_checkpoint_file(
    request: LoadRequest,
    detected: DetectedCheckpoint,
    ranks: RankInfo,
    concurrency: int | str = "auto",
    progress: bool | None = None,
) -> LoadResult:
    """Load a checkpoint file into ``request.module`` (and its optimizers), the same way on every rank.

    Lazy sources (zip files through ``mmap``, safetensors) are read by all ranks at once, each touching only its own
    slices, and every rank validates the checkpoint before any rank writes. A source that must be materialised whole
    (a legacy-format file) is read in node turns: at most ``concurrency`` ranks of a node hold it at a time, and
    each frees it before the next turn. A failure on any rank raises the same error on every rank.

    Args:
        request: What to load.
        detected: The checkpoint, as :func:`~lightning_fsdp.loading.formats.detect_checkpoint` found it.
        ranks: This process's place in the job.
        concurrency: Ranks per node that may materialise a non-lazy source at once, or ``"auto"``.
        progress: ``None`` shows a bar on a terminal, ``True`` always, ``False`` never.

    """
    collected = module_targets(request.module)
    total_bytes, total_tensors = _local_totals(collected)
    bar = LoadProgress(
        total_bytes, total_tensors, local_rank=ranks.local_rank, node_rank=ranks.node_rank, enabled=progress
    )
    stagger = StaggeredLoad(
        concurrency,
        node_rank=ranks.node_rank,
        local_rank=ranks.local_rank,
        local_world_size=ranks.local_world_size,
        progress=bar,
        description=f"Loading {str(detected.path)!r}",
    )
    with bar, stagger:
        opened = _open_without_materializing(detected, request)
        if opened is not None or collected is None:
            # Every rank validates before any rank writes, so a failure anywhere leaves every model untouched. The
            # fallback path (collected is None) runs collectives, which must never run inside a turn.
            if opened is None:
                _warn_fallback("a source that must be read whole is read by every rank of the node at once")
                opened = open_checkpoint(detected, request.module_key, request.weights_only)
            prepared = prepare_load(request, opened, collected)
            stagger.agree_on_success()
            apply_load(request, prepared, ranks.world_size, on_tensor=bar.update)
            metadata, remainder = collect_metadata(request, opened, materialize=False)
            return LoadResult(metadata, remainder, prepared.plan, opened.raw)
        with stagger.turn(source_bytes=detected.nbytes):
            return _load_whole_in_turn(request, detected, collected, ranks, bar)


def _open_without_materializing(detected: DetectedCheckpoint, request: LoadRequest) -> _Opened | None:
    """Open the checkpoint so that ranks read only their own bytes, or return ``None`` if it must be read whole."""
    if detected.format is CheckpointFormat.TORCH_LEGACY:
        return open_legacy_by_byte_ranges(detected.path, request.module_key, request.weights_only)
    if detected.format is CheckpointFormat.HF_INDEX:
        try:
            return _Opened(open_index(detected.path, request.weights_only, materialize=False), {}, raw=True)
        except _NotLocatable:
            return None
    return open_checkpoint(detected, request.module_key, request.weights_only)


def open_legacy_by_byte_ranges(path: Path, module_key: str | None, weights_only: bool) -> _Opened | None:
    """Open a legacy-format raw state dict by byte ranges; ``None`` for files that must be read whole.

    A Fabric checkpoint in the legacy format is read whole (its optimizer state and metadata are used as tensors),
    and so is a file whose tensors cannot be located (storage views, non-contiguous tensors).

    """
    try:
        content, offsets = read_legacy_layout(path, weights_only)
    except _NotLocatable:
        return None
    content = as_mapping(content, path)
    if module_key is not None and isinstance(content.get(module_key), Mapping):
        return None
    if content and not any(isinstance(value, Tensor) for value in content.values()):
        return None  # not a raw state dict: `open_checkpoint` names what it is
    check_all_tensors(content)
    try:
        return _Opened(ByteRangeSource.from_legacy_layout(path, content, offsets), {}, raw=True)
    except _NotLocatable:
        return None


def _load_whole_in_turn(
    request: LoadRequest, detected: DetectedCheckpoint, collected: ModuleTargets, ranks: RankInfo, bar: LoadProgress
) -> LoadResult:
    """Materialise the source, copy this rank's slices, and drop the source before the turn ends."""
    prepared = None
    try:
        opened = open_checkpoint(detected, request.module_key, request.weights_only)
        prepared = prepare_load(request, opened, collected)
        apply_load(request, prepared, ranks.world_size, on_tensor=bar.update)
        # The source is freed when the turn ends: whatever the caller keeps is copied out of it first.
        metadata, remainder = collect_metadata(request, opened, materialize=True)
        return LoadResult(metadata, remainder, prepared.plan, opened.raw)
    finally:
        release(prepared)


def _local_totals(collected: ModuleTargets | None) -> tuple[int, int]:
    """The bytes and tensors this rank writes at most (its slices), for the progress bar."""
    if collected is None:
        return 0, 0
    total = 0
    for target in collected.targets:
        numel = target.slot.numel if target.slot is not None else math.prod(target.shape)
        total += numel * target.dtype.itemsize
    return total, len(collected.targets)
