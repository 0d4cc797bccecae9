"""The one entry point of loading: detect, open, validate on every rank, then copy each rank's own slices.

This module knows torch and FSDP, not Fabric: the strategy passes plain modules, optimizers and key names, and gets
back the metadata it restores into the user's state.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.strategies.fsdp import _has_fsdp_modules
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.core.fsdp import _extra_states, _set_extra_states
from lightning_fsdp.core.fsdp import _join as join
from lightning_fsdp.layouts.fsdp1 import collect_targets
from lightning_fsdp.layouts.fsdp2 import collect_dtensor_targets, has_dtensor_params
from lightning_fsdp.layouts.optimizer import local_optimizer_state
from lightning_fsdp.layouts.targets import ModuleTargets, ShardLocalUnsupported, TargetSpec, clean_name
from lightning_fsdp.loading.conversions import with_declared_conversions
from lightning_fsdp.loading.errors import (
    CheckpointKeyError,
    CheckpointLoadError,
    described,
    quoted_names,
    unexpected_cause,
)
from lightning_fsdp.loading.formats import (
    CheckpointFormat,
    DetectedCheckpoint,
    OpenedCheckpoint,
    detect_checkpoint,
    open_checkpoint,
)
from lightning_fsdp.loading.materialize import init_record
from lightning_fsdp.loading.progress import LoadProgress
from lightning_fsdp.loading.quiet import torch_internal_warnings_silenced
from lightning_fsdp.loading.shard_local import copy_into_module
from lightning_fsdp.loading.sources import TensorSource, is_extra_state_name, materialize
from lightning_fsdp.loading.torch_pickle import first_line
from lightning_fsdp.loading.turns import StaggeredLoad
from lightning_fsdp.loading.validation import NamePlan, Rename, check_whole_module, plan_load


@dataclass(frozen=True)
class LoadRequest:
    """What to load from a checkpoint, and how."""

    module: Module
    module_key: str | None
    """The key of the module in a Fabric checkpoint; ``None`` for ``load_raw`` (the file is the module's state)."""
    optimizers: Mapping[str, Optimizer] = field(default_factory=dict)
    metadata_keys: frozenset[str] = frozenset()
    """Other keys the caller asked for (``step``, ...), restored from a Fabric checkpoint."""
    strict: bool = True
    weights_only: bool = True
    rename: Rename | None = None
    """Maps the checkpoint's names to the model's (see :func:`~.validation.check_rename`); ``None`` aligns a
    prefix automatically where exactly one makes every model tensor match, ``{}`` keeps the names as they are."""
    optimizer_list: str | None = None
    """The entry of a checkpoint file that holds the optimizers' states as a list, in the order of ``optimizers``
    (the Trainer's ``"optimizer_states"``); ``None``: each optimizer's state is the entry under its own key."""
    weights_alone: str = "`fabric.load_raw(path, model)`"
    """The call that loads a file's weights alone, which errors about a raw state dict suggest."""


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits: what turns and agreement need to know."""

    world_size: int = 1
    node_rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1


@dataclass(frozen=True)
class LoadOptions:
    """How to load: turns and progress."""

    concurrency: int | Literal["auto"] = "auto"
    """Ranks per node that may hold a source read whole at once (see :class:`~.turns.StaggeredLoad`)."""
    progress: bool | None = None
    """``None`` shows a bar on a terminal, ``True`` always, ``False`` never."""
    namespace: str | None = None
    """Where this load's agreements meet in the process group's store: the same on every rank and new for every load
    (rank 0 makes it, and it travels with the path broadcast: see ``loading_calls.broadcast_load_path``). Required with
    several ranks."""


@dataclass
class LoadResult:
    """What a load restored and what it left out."""

    metadata: dict[str, Any]
    """The requested non-module, non-optimizer entries found in the checkpoint."""
    remainder: dict[str, Any]
    """Entries of a Fabric checkpoint that nobody asked for."""
    skipped: str = ""
    """With ``strict=False``: what was left out, for a warning (empty when nothing was)."""
    written: frozenset[str] | None = None
    """The model's names of the tensors the load wrote (tied aliases included); ``None``: every persistent one."""


@dataclass
class _Prepared:
    plan: NamePlan
    source: TensorSource
    """The checkpoint's tensors, with the model's declared conversions applied (see :mod:`.conversions`)."""
    optimizer_states: dict[str, dict]
    fallback_optimizers: set[str]
    written: frozenset[str] = frozenset()
    extra_states: dict[str, Module] = field(default_factory=dict)
    """The model's modules with an extra state (the core's ``_extra_states``), by the name of its entry."""
    module_extras: dict[str, Any] = field(default_factory=dict)
    """The checkpoint's extra states that are not tensors (``OpenedCheckpoint.module_extras``)."""


_warned_fallbacks: set[str] = set()


def load(path: Path, request: LoadRequest, ranks: RankInfo, options: LoadOptions) -> LoadResult:
    """Load the checkpoint at ``path`` into ``request.module`` (and its optimizers), the same way on every rank.

    The ranks first agree whether every one of them can load its part shard-locally (if one cannot, they all take
    FSDP's own path). Every rank detects and opens the checkpoint and validates it against its own part of the model;
    the ranks agree (on the process group's store) before any rank writes, so a failure anywhere leaves every model
    untouched and raises the same :class:`CheckpointLoadError` on every rank. Then each rank copies only its own
    slices, and the ranks agree once more: an error in the copy (an I/O error, a file changed under the load) is raised
    on every rank, saying that the model is partially loaded. A file that must be read whole (a trusted pickle, with
    ``weights_only=False``) is read in node turns instead: at most ``options.concurrency`` ranks of a node hold it at
    a time, and each validates it in its own turn.

    """
    bar = LoadProgress(local_rank=ranks.local_rank, node_rank=ranks.node_rank, enabled=options.progress)
    stagger = StaggeredLoad(
        options.concurrency,
        node_rank=ranks.node_rank,
        local_rank=ranks.local_rank,
        local_world_size=ranks.local_world_size,
        progress=bar,
        description=f"Loading {str(path)!r}",
        namespace=options.namespace,
    )
    with bar, stagger, _one_error_type():
        # Everything runs inside the agreement, the first step too: a rank that fails anywhere tells the others, which
        # raise at once instead of waiting for it. The path first, the model second, as upstream checks them.
        detected = detect_checkpoint(path)
        collected = _module_targets(request.module)
        bar.set_totals(*_local_totals(collected))
        # FSDP's path runs collectives and the shard-local one does not: one rank that cannot serve its part
        # shard-locally takes every rank with it, or the others would wait for it until the process group timed out.
        if stagger.any_rank(collected is None) and collected is not None:
            _warn_fallback("another rank cannot load its part of the model shard-locally")
            collected = None
        if detected.format in (CheckpointFormat.FABRIC_SHARDED, CheckpointFormat.SAFETENSORS_SHARDS):
            result = _load_sharded(detected, request, stagger)
        elif collected is not None and detected.reads_whole(request.weights_only):
            with stagger.turn(source_bytes=detected.nbytes):
                opened = open_checkpoint(detected, request.module_key, request.weights_only)
                result = _load_file(request, opened, collected, ranks, bar)
        else:
            # FSDP's own path (collected is None) runs collectives, which must never run inside a turn.
            opened = open_checkpoint(detected, request.module_key, request.weights_only)
            result = _load_file(request, opened, collected, ranks, bar, stagger)
    _warn_uninitialized(path, request.module, result.written)
    return result


@contextmanager
def _one_error_type() -> Iterator[None]:
    """Every failure of a load is a :class:`CheckpointLoadError` with a short message; the error is its ``cause``.

    An unexpected error (a bug, an I/O error) becomes a plain ``CheckpointLoadError``, whatever its type: only the
    checks that stand for upstream's raise its types (``CheckpointKeyError``, ``CheckpointValueError``), so that code
    that catches ``KeyError`` for a missing key does not catch a bug too.

    """
    try:
        yield
    except CheckpointLoadError:
        raise
    except Exception as error:
        message = f"{type(error).__name__}: {first_line(error)}"
        raise CheckpointLoadError(message, cause=error) from unexpected_cause(error)


def _load_file(
    request: LoadRequest,
    opened: OpenedCheckpoint,
    collected: ModuleTargets | None,
    ranks: RankInfo,
    bar: LoadProgress,
    stagger: StaggeredLoad | None = None,
) -> LoadResult:
    """Validate, agree (unless inside a turn), copy, and collect the metadata; the source is closed at the end."""
    try:
        prepared = _prepare(request, opened, collected)
        if stagger is not None:
            stagger.agree_on_success()
        try:
            _apply(request, collected, prepared, ranks.world_size, bar)
            opened.check_unchanged()
        except Exception as error:
            what = (
                "The model and optimizer on the failing rank are"
                if request.optimizers
                else "The model on the failing rank is"
            )
            reason = described(error).rstrip(".")
            failure = CheckpointLoadError(
                f"Writing the checkpoint into the model failed after it was validated: {reason}. {what} now"
                " partially loaded, and the other ranks may have loaded fully, so the ranks differ: load the checkpoint"
                " again before using the model.",
                cause=error,
            )
            raise failure from unexpected_cause(error)
        requested = {key: opened.entries[key] for key in request.metadata_keys if key in opened.entries}
        remainder = {
            key: value
            for key, value in opened.entries.items()
            if key not in request.metadata_keys and key not in request.optimizers and key != request.optimizer_list
        }
        # Whatever the caller keeps must outlive the source, which is closed (and, in a turn, freed) right after.
        # One copy of both keeps an object that they share shared, as `torch.load` returns it.
        requested, remainder = materialize((requested, remainder))
        return LoadResult(requested, remainder, prepared.plan.skipped_summary(), prepared.written)
    finally:
        opened.close()


def _load_sharded(detected: DetectedCheckpoint, request: LoadRequest, stagger: StaggeredLoad) -> LoadResult:
    # Imported here: torch's distributed checkpoint package cannot be imported where `torch.distributed` is unavailable.
    from lightning_fsdp.loading.sharded import load_sharded_checkpoint
    from lightning_fsdp.loading.sharded_metadata import (
        check_sharded_request,
        module_entry,
        read_checked_metadata,
        read_safetensors_shards_metadata,
    )

    path = detected.path

    if request.rename is not None:
        raise CheckpointLoadError(
            f"{str(path)!r} is a sharded checkpoint, whose tensors are read by their names in the model: `rename`"
            " applies to checkpoint files only. Load it without `rename`."
        )
    optimizer_keys = list(request.optimizers)
    # Read, unpickled and checked once: the check and the load below use the same metadata.
    if detected.format is CheckpointFormat.SAFETENSORS_SHARDS:
        dcp_metadata = read_safetensors_shards_metadata(detected)
    else:
        dcp_metadata = read_checked_metadata(path, request.weights_only)
    key = module_entry(dcp_metadata, request.module_key)  # `None`: the directory is a raw module state dict
    if key is None:
        _check_raw_request(request)
    metadata, stored = check_sharded_request(
        path, key, optimizer_keys, request.metadata_keys, request.strict, request.weights_only, dcp_metadata
    )
    stagger.agree_on_success()  # before the collectives of the distributed checkpoint reader
    present = {k: optimizer for k, optimizer in request.optimizers.items() if key is not None and k in stored}
    skipped = load_sharded_checkpoint(
        path, request.module, key, present, request.strict, request.weights_only, dcp_metadata
    )
    requested = {k: metadata.pop(k) for k in request.metadata_keys if k in metadata}
    return LoadResult(requested, metadata, skipped)


def _module_targets(module: Module) -> ModuleTargets | None:
    """The shard-local targets of ``module``, or ``None`` (with a one-time warning) where FSDP's own path must serve."""
    collect = collect_dtensor_targets if has_dtensor_params(module) else collect_targets
    try:
        return collect(module)
    except ShardLocalUnsupported as reason:
        _warn_fallback(str(reason))
        return None


def _prepare(request: LoadRequest, opened: OpenedCheckpoint, collected: ModuleTargets | None) -> _Prepared:
    """Check everything that can be checked before the model is touched, and compute each rank's slices.

    Nothing is written into the module or optimizers here, so an error leaves them exactly as they were.

    """
    _check_requested_keys(request, opened)
    check_whole_module(request.module)
    extra_states = _extra_states(request.module)
    targets = collected.specs() if collected is not None else _unsharded_specs(request.module, extra_states)
    source = with_declared_conversions(request.module, opened.source, targets)
    # a module's extra state is set whole, whatever it holds (a tensor too): it is matched apart from the tensors
    tensor_names = {name for target in targets for name in target.names}
    # in the file's order, the same on every rank (the messages list them so)
    extra_entries = [name for name in source.specs() if is_extra_state_name(name) and name not in tensor_names]
    excluded = set(extra_entries)
    plan = plan_load(
        targets,
        {name: spec for name, spec in source.specs().items() if name not in excluded},
        strict=request.strict,
        rename=request.rename,
        ties=_ties(request.module),
        extra_states=extra_states,
        extra_entries=[*extra_entries, *opened.module_extras],
    )
    optimizer_states: dict[str, dict] = {}
    fallback: set[str] = set()
    for key, saved in _saved_optimizer_states(request, opened).items():
        optimizer = request.optimizers[key]
        if collected is not None:
            optimizer_states[key] = local_optimizer_state(optimizer, collected, saved)
        else:
            optimizer_states[key] = materialize(saved)
            fallback.add(key)
    written = frozenset(name for target in targets if target.names[0] in plan.sources for name in target.names)
    return _Prepared(plan, source, optimizer_states, fallback, written, extra_states, opened.module_extras)


def _apply(
    request: LoadRequest,
    collected: ModuleTargets | None,
    prepared: _Prepared,
    world_size: int,
    bar: LoadProgress,
) -> None:
    if collected is not None:
        copy_into_module(collected, prepared.plan, prepared.source, on_tensor=bar.update)
    else:
        state_dict = {target: prepared.source.read(name) for target, name in prepared.plan.sources.items()}
        _load_with_fsdp_state_dict(request.module, state_dict, world_size)
    # the core's setting of extra states; those that are not tensors were unpickled with the file's other objects
    extras = prepared.module_extras
    values = {
        name: materialize(extras[entry]) if entry in extras else prepared.source.read(entry)
        for name, entry in prepared.plan.extra_sources.items()
    }
    _set_extra_states(values, prepared.extra_states)
    for key, state in prepared.optimizer_states.items():
        optimizer = request.optimizers[key]
        if key in prepared.fallback_optimizers:
            _load_optimizer_with_fsdp(request.module, optimizer, state, world_size)
        else:
            optimizer.load_state_dict(state)


def _check_requested_keys(request: LoadRequest, opened: OpenedCheckpoint) -> None:
    if opened.raw:
        _check_raw_request(request)
        return
    # a list of optimizer states may be absent (a checkpoint saved without them): the optimizers are left as they are
    listed = request.optimizers if request.optimizer_list is None else []
    absent = sorted(key for key in [*listed, *request.metadata_keys] if key not in opened.entries)
    if absent and request.strict:
        raise CheckpointKeyError(
            f"The checkpoint has no entry {', '.join(repr(k) for k in absent)} that the state asks for. Its entries"
            f" are {', '.join(repr(k) for k in opened.top_level_keys)}. To load what is there, pass `strict=False`."
        )


def _saved_optimizer_states(request: LoadRequest, opened: OpenedCheckpoint) -> dict[str, Any]:
    """The checkpoint's state of each requested optimizer that it holds, by the optimizer's key."""
    if request.optimizer_list is None:
        return {key: opened.entries[key] for key in request.optimizers if key in opened.entries}
    saved = opened.entries.get(request.optimizer_list)
    if saved is None or not request.optimizers:
        return {}
    if not isinstance(saved, (list, tuple)):
        raise CheckpointLoadError(
            f"The checkpoint's {request.optimizer_list!r} is a {type(saved).__name__}, not a list of optimizer states."
        )
    if len(saved) != len(request.optimizers):
        # upstream's message (the Trainer's `FSDPStrategy`), then how to start from the weights alone
        raise CheckpointLoadError(
            f"You have configured {len(request.optimizers)} optimizers but the checkpoint contains {len(saved)}"
            " optimizers to load. Please resume training with the same number of optimizers or edit the checkpoint"
            f" manually to remove states. To start from the checkpoint's weights alone, use {request.weights_alone}."
        )
    return dict(zip(request.optimizers, saved, strict=True))


def _check_raw_request(request: LoadRequest) -> None:
    """A raw module state dict (a file or a sharded directory) holds no optimizer state and no other objects."""
    requested = sorted([*request.optimizers, *request.metadata_keys])
    if requested and request.strict:
        raise CheckpointKeyError(
            "The checkpoint is a raw module state dict: it holds the model's weights only, not the requested"
            f" {', '.join(repr(k) for k in requested)}. To load the weights alone, pass `strict=False` (the other"
            f" objects are left untouched) or use {request.weights_alone}."
        )


def _unsharded_specs(module: Module, extra_states: Mapping[str, Module]) -> list[TargetSpec]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    specs = []
    # Only on the fallback path: FSDP1 units this path does not know are unsharded to read their full shapes.
    with FSDP.summon_full_params(module, writeback=False) if _has_fsdp_modules(module) else nullcontext():
        for name, tensor in module.state_dict(keep_vars=True).items():
            if name not in extra_states:  # set whole, apart from the tensors
                specs.append(TargetSpec((name,), tuple(tensor.shape), tensor.dtype))
    return specs


def _load_with_fsdp_state_dict(module: Module, state_dict: dict[str, Any], world_size: int) -> None:
    """Upstream's path: FSDP's full-state-dict loading (all-gathers each unit). Used where the fast path cannot."""
    from lightning.fabric.strategies.model_parallel import _load_raw_module_state

    with torch_internal_warnings_silenced():
        _load_raw_module_state(state_dict, module=module, world_size=world_size, strict=False)


def _load_optimizer_with_fsdp(module: Module, optimizer: Optimizer, state: Mapping, world_size: int) -> None:
    if has_dtensor_params(module):
        _load_optimizer_with_dtensors(module, optimizer, state)
        return
    from lightning.fabric.strategies.fsdp import _get_full_state_dict_context
    from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with (
        torch_internal_warnings_silenced(),
        _get_full_state_dict_context(module, world_size=world_size, rank0_only=False),
    ):
        rekeyed = _rekey_optimizer_state_if_needed(dict(state), module)
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(module, optimizer, rekeyed))


def _load_optimizer_with_dtensors(module: Module, optimizer: Optimizer, state: Mapping) -> None:
    """Upstream's path for FSDP2 and tensor parallelism: each full state tensor is broadcast from rank 0."""
    from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    rekeyed = _rekey_optimizer_state_if_needed(dict(state), module)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(module, optimizer, optim_state_dict=rekeyed, options=options)


def _ties(module: Module) -> dict[str, set[str]]:
    """Model name -> the names it is tied to, as the model was before wrapping or as a Hugging Face model declares.

    ``setup_module`` records the tensors that the model held twice; a Hugging Face model's ``all_tied_weights_keys``
    holds the ties that its config asks for.

    """
    record = init_record(module)
    ties: dict[str, set[str]] = {name: set(others) for name, others in (record.ties if record else {}).items()}
    for module_name, submodule in module.named_modules():
        declared = vars(submodule).get("all_tied_weights_keys")  # not `getattr`: FSDP forwards unknown names
        if not isinstance(declared, Mapping):
            continue
        for target, source in declared.items():
            if isinstance(target, str) and isinstance(source, str):
                target, source = clean_name(join(module_name, target)), clean_name(join(module_name, source))
                ties.setdefault(target, set()).add(source)
                ties.setdefault(source, set()).add(target)
    return ties


def _warn_uninitialized(path: Path, module: Module, written: frozenset[str] | None) -> None:
    """Forget what the load wrote; warn (rank 0) about the tensors that remain uninitialised since ``setup_module``."""
    record = init_record(module)
    if record is None or not record.uninitialized:
        return
    if written is None:
        record.uninitialized &= _non_persistent_buffer_names(module)
    else:
        record.uninitialized -= written
    if not record.uninitialized:
        return
    names = sorted(record.uninitialized)
    rank_zero_warn(
        f"After loading {str(path)!r}, the model still holds {len(names)} tensor(s) that nothing initialised:"
        f" {quoted_names(names)}. `fabric.init_module(empty_init=True)` created them on the meta device, and neither"
        " their module's `reset_parameters()` nor the model's own initialisation (`_init_weights` of a Hugging Face"
        " model) nor this checkpoint wrote them, so they hold NaN (floating point) or arbitrary values. Load a"
        " checkpoint that holds them, or give their modules a `reset_parameters()` that sets them (a non-persistent"
        " buffer, which no checkpoint holds, must be set there)."
    )


def _non_persistent_buffer_names(module: Module) -> set[str]:
    return {
        clean_name(join(module_name, name))
        for module_name, submodule in module.named_modules()
        for name in submodule._non_persistent_buffers_set
    }


def _warn_fallback(reason: str) -> None:
    if reason in _warned_fallbacks:
        return
    _warned_fallbacks.add(reason)
    rank_zero_warn(
        f"The checkpoint cannot be loaded shard-locally ({reason}); falling back to FSDP's full state-dict"
        " loading, which needs more memory (FSDP1 all-gathers every unit; FSDP2 broadcasts every tensor whole)."
    )


def _local_totals(collected: ModuleTargets | None) -> tuple[int, int]:
    """The bytes and tensors this rank writes at most (its slices), for the progress bar."""
    if collected is None:
        return 0, 0
    total = sum(target.local_numel * target.dtype.itemsize for target in collected.targets)
    return total, len(collected.targets)
