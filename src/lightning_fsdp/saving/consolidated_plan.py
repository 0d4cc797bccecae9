"""The gather-free save's plan: what each rank holds, and the file's layout that every rank computes alike.

Each rank collects its slices of the model's tensors (the layouts of :mod:`lightning_fsdp.layouts`) and of the
optimizer states, and reports what it holds (:class:`_Report`); from every rank's report each computes the same
layout (:func:`_merge`): the storage records of one ``torch.save`` archive (or of a safetensors export), the big ones
first at offsets that depend only on their sizes, and which rank writes which ranges of them (:func:`_local_writes`).
A state that the save cannot serve raises :class:`SaveUnsupported`, and the caller falls back to the gather.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.core.fsdp import _extra_states
from lightning_fsdp.layouts.targets import ModuleTargets, Run, Target, clean_name
from lightning_fsdp.saving import archive, export

#: A state tensor that is not per element (``step``) is pickled by rank 0; larger ones are not served.
_SMALL_STATE_NUMEL = 4096


class SaveUnsupported(Exception):
    """The gather-free save cannot serve this state; the message says why (the caller falls back to the gather)."""


@dataclass(frozen=True)
class Ranks:
    """A process's rank among ``world_size``."""

    rank: int
    world_size: int


# --------------------------------------------------------------------------------------------------------------------
# What each rank holds


@dataclass
class _LocalWrite:
    """Ranges of one storage record that this rank writes from ``flat`` (a 1-D view of its memory)."""

    record: int
    flat: Tensor
    runs: list[Run]


@dataclass
class _ParamReport:
    """One optimizer parameter's state on one rank: per key, ``("elem", dtype)`` or ``("value", object)``."""

    keys: list[tuple[str, str, Any]]


@dataclass
class _Report:
    """What a rank tells the others before anything is written."""

    reason: str | None = None
    optimizers: dict[str, dict[int, _ParamReport]] = field(default_factory=dict)
    holdings: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Per record label: how many elements this rank holds, and a digest of which. Ranks that hold the same elements
    (replicas: HSDP, replicated or unsharded tensors) write them once; every element must be written once."""


@dataclass
class _Plan:
    """A rank's view of the save: the module's tensors, the optimizers' local states."""

    collected: ModuleTargets
    optimizers: dict[str, tuple[Optimizer, dict, list[Tensor]]]
    entries: list[tuple[str, Target]]
    """The model's state-dict entries in ``Module.state_dict`` order: ``(name, target)``."""


def _collect(module: Module, fsdp2: bool) -> ModuleTargets:
    if fsdp2:
        from lightning_fsdp.layouts.fsdp2 import collect_dtensor_targets

        return collect_dtensor_targets(module)
    from lightning_fsdp.layouts.fsdp1 import collect_targets

    return collect_targets(module)


def _holding(runs: list[Run]) -> tuple[int, str]:
    digest = hashlib.blake2b(digest_size=16)
    for run in sorted(runs, key=lambda run: run.start):
        digest.update(struct.pack("<QQ", run.start, run.count))
    return sum(run.count for run in runs), digest.hexdigest()


def _model_runs(target: Target) -> list[Run]:
    return [Run(0, target.local_numel, 0)] if target.tensor is not None else target.runs


def _state_dict_order(module: Module, collected: ModuleTargets) -> list[tuple[str, Target]]:
    """The entries of ``module.state_dict()``: every name of every target, in the order ``Module.state_dict`` gives.

    ``Module.state_dict`` visits modules depth first, and in each module its own parameters, then its persistent
    buffers. With FSDP1 the original parameters of a unit may not be registered on their modules any more
    (``use_orig_params=False``), so the position of a name is found from its owning module's (cleaned) name and its
    kind; within one module the layouts keep the parameters' registration order.
    """
    module_order: dict[str, int] = {}
    for name, _ in module.named_modules(remove_duplicate=False):
        module_order.setdefault(clean_name(name), len(module_order))
    buffer_names = _persistent_buffer_names(module)
    entries = []
    for position, target in enumerate(collected.targets):
        for alias, name in enumerate(target.names):
            owner = name.rpartition(".")[0]
            key = (module_order.get(owner, len(module_order)), name in buffer_names, position, alias)
            entries.append((key, name, target))
    entries.sort(key=lambda entry: entry[0])
    return [(name, target) for _, name, target in entries]


def _persistent_buffer_names(module: Module) -> set[str]:
    """The (clean) names of the module's buffers that ``Module.state_dict`` holds."""
    names: set[str] = set()
    for name, submodule in module.named_modules(remove_duplicate=False):
        for buffer_name, buffer in submodule._buffers.items():
            if buffer is not None and buffer_name not in submodule._non_persistent_buffers_set:
                names.add(clean_name(f"{name}.{buffer_name}" if name else buffer_name))
    return names


def _optimizer_params(optimizer: Optimizer) -> list[Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _local_state(optimizer: Optimizer) -> dict:
    # The optimizer's own `state_dict` (references, no copies). Fabric's wrapper would ask the strategy, which gathers.
    return Optimizer.state_dict(optimizer)


def _plan(module: Module, optimizers: dict[str, Optimizer], fsdp2: bool, ranks: Ranks) -> tuple[_Plan, _Report]:
    collected = _collect(module, fsdp2)
    extra_states = _extra_states(module)
    if extra_states:
        # `get_extra_state` may return any object, which only the gather's `torch.save` pickles
        raise SaveUnsupported(f"the model saves an extra state ({', '.join(map(repr, list(extra_states)[:3]))})")
    for target in collected.targets:
        if not archive.storage_class_supported(target.dtype):
            raise SaveUnsupported(f"the tensor {target.names[0]!r} has the dtype {target.dtype}")
    report = _Report()
    for target in collected.targets:
        report.holdings[f"model/{target.names[0]}"] = _holding(_model_runs(target))
    plan_optimizers = {}
    for key, optimizer in optimizers.items():
        params = _optimizer_params(optimizer)
        local = _local_state(optimizer)
        param_reports: dict[int, _ParamReport] = {}
        for index, param in enumerate(params):
            optimizer_param = collected.optimizer_params.get(id(param))
            if optimizer_param is None:
                raise SaveUnsupported(f"the optimizer {key!r} holds a parameter that is not part of the model")
            state = local["state"].get(index)
            if not state:
                continue
            keys = []
            for state_key, value in state.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    flat = _local_flat(value)
                    if flat is None or flat.numel() != optimizer_param.numel:
                        raise SaveUnsupported(
                            f"the optimizer state {state_key!r} of {optimizer_param.parts[0][0].names[0]!r} is neither"
                            " a scalar nor shaped like its parameter's shard"
                        )
                    if not archive.storage_class_supported(flat.dtype):
                        raise SaveUnsupported(f"the optimizer state {state_key!r} has the dtype {flat.dtype}")
                    keys.append((state_key, "elem", flat.dtype))
                    for target, runs in optimizer_param.parts:
                        report.holdings[f"{key}/{target.names[0]}/{state_key}"] = _holding(runs)
                elif isinstance(value, Tensor):
                    if type(value) is not Tensor or value.numel() > _SMALL_STATE_NUMEL:
                        raise SaveUnsupported(f"the optimizer state {state_key!r} is a {type(value).__name__}")
                    keys.append((state_key, "value", value.detach().cpu().clone()))
                else:
                    keys.append((state_key, "value", value))
            param_reports[index] = _ParamReport(keys)
        report.optimizers[key] = param_reports
        plan_optimizers[key] = (optimizer, local, params)
    entries = _state_dict_order(module, collected)
    return _Plan(collected, plan_optimizers, entries), report


def _local_flat(value: Tensor) -> Tensor | None:
    from torch.distributed.tensor import DTensor

    local = value.to_local() if isinstance(value, DTensor) else value
    return local.view(-1) if local.is_contiguous() else None


# --------------------------------------------------------------------------------------------------------------------
# The layout that every rank computes alike


@dataclass
class _Record:
    label: str
    dtype: torch.dtype
    numel: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class _Layout:
    records: list[_Record]
    by_label: dict[str, int]
    placed: list[archive.RecordLayout | None]
    """Where each record's data goes (``None``: a record that a safetensors export does not store)."""
    end: int
    optimizer_states: dict[str, dict[int, list[tuple[str, str, Any]]]]
    """Per optimizer and parameter index: the merged ``(key, kind, dtype or value)`` of its state."""
    writes: set[str]
    """The labels of the records that this rank writes its slices of."""
    files: list[int] = field(default_factory=list)
    """Per record, the index of the file it goes to (a sharded safetensors export; else all in file 0)."""


def _merge(
    plan: _Plan,
    reports: list[_Report],
    rank_index: int,
    flat_optimizer_order: bool,
    exported: export.ExportLayout | None = None,
) -> _Layout:
    records: list[_Record] = []
    by_label: dict[str, int] = {}

    def add(label: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        by_label[label] = len(records)
        records.append(_Record(label, dtype, math.prod(shape), shape))

    for target in plan.collected.targets:
        add(f"model/{target.names[0]}", target.dtype, target.shape)
    merged_states: dict[str, dict[int, list[tuple[str, str, Any]]]] = {}
    for key, (_, _, params) in plan.optimizers.items():
        merged: dict[int, list[tuple[str, str, Any]]] = {}
        for index, param in enumerate(params):
            found = [report.optimizers[key][index].keys for report in reports if index in report.optimizers[key]]
            if not found:
                continue
            keys = found[0]
            for other in found[1:]:
                if [(k, kind) for k, kind, _ in other] != [(k, kind) for k, kind, _ in keys]:
                    raise SaveUnsupported(f"the ranks hold different optimizer states for parameter {index} of {key!r}")
            if flat_optimizer_order:  # FSDP1 flat parameters: FSDP lists the per-element states first
                keys = [entry for entry in keys if entry[1] == "elem"] + [e for e in keys if e[1] != "elem"]
            merged[index] = keys
            optimizer_param = plan.collected.optimizer_params[id(param)]
            for target, _ in optimizer_param.parts:
                for state_key, kind, dtype in keys:
                    if kind == "elem":
                        add(f"{key}/{target.names[0]}/{state_key}", dtype, target.shape)
        merged_states[key] = merged
    # One writer among the ranks that hold the same elements of a record; every element written once.
    writes: set[str] = set()
    for index, record in enumerate(records):
        groups: dict[str, list[int]] = {}
        counts: dict[str, int] = {}
        for rank, report in enumerate(reports):
            held = report.holdings.get(record.label)
            if held is not None and held[0]:
                groups.setdefault(held[1], []).append(rank)
                counts[held[1]] = held[0]
        total = sum(counts.values())
        if total != record.numel:
            raise SaveUnsupported(
                f"the ranks hold {total} distinct elements of {record.label!r} where it has {record.numel}"
                " (their slices overlap or leave gaps)"
            )
        for holders in groups.values():
            if holders[index % len(holders)] == rank_index:
                writes.add(record.label)
    if exported is not None:
        placed: list[archive.RecordLayout | None] = [None] * len(records)
        files = [0] * len(records)
        for index, record in enumerate(records):
            if index not in exported.placement:
                writes.discard(record.label)  # not stored (a name the model ignores on save)
                continue
            files[index], offset = exported.placement[index]
            placed[index] = archive.RecordLayout(record.label, 0, offset, record.nbytes)
        return _Layout(records, by_label, placed, max(exported.ends, default=0), merged_states, writes, files)
    names = [(archive.storage_record_name(str(index)), record.nbytes) for index, record in enumerate(records)]
    stored, end = archive.plan_records(names, 0)
    return _Layout(records, by_label, list(stored), end, merged_states, writes, [0] * len(records))


def _export_layout(plan: _Plan, module: Module, max_shard_size: int | None) -> export.ExportLayout:
    """The files of a safetensors export; its records are the model's targets, in order (as :func:`_merge` adds)."""
    record_of = {id(target): index for index, target in enumerate(plan.collected.targets)}
    buffers = _persistent_buffer_names(module)
    entries = [
        export.Entry(name, tuple(target.names), record_of[id(target)], target.dtype, target.shape, name not in buffers)
        for name, target in plan.entries
    ]
    return export.plan(entries, module, max_shard_size)


def _local_writes(plan: _Plan, layout: _Layout) -> list[_LocalWrite]:
    writes = []
    for target in plan.collected.targets:
        label = f"model/{target.names[0]}"
        if label not in layout.writes:
            continue
        record = layout.by_label[label]
        if target.tensor is not None:
            writes.append(_LocalWrite(record, target.tensor.detach().reshape(-1), [Run(0, target.local_numel, 0)]))
        elif target.runs:
            assert target.local is not None
            writes.append(_LocalWrite(record, target.local.detach(), target.runs))
    for key, (_, local, params) in plan.optimizers.items():
        for index, param in enumerate(params):
            state = local["state"].get(index)
            if not state:
                continue
            optimizer_param = plan.collected.optimizer_params[id(param)]
            for state_key, value in state.items():
                if not (isinstance(value, Tensor) and value.dim() > 0):
                    continue
                flat = _local_flat(value)
                assert flat is not None
                for target, runs in optimizer_param.parts:
                    label = f"{key}/{target.names[0]}/{state_key}"
                    if label in layout.writes and runs:
                        writes.append(_LocalWrite(layout.by_label[label], flat.detach(), runs))
    return writes
