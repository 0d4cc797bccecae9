"""A full (consolidated) checkpoint written by every rank: each writes its own slices into one ``torch.save`` file.

Every rank plans the same archive (:mod:`.archive`) from metadata alone: the names, shapes and dtypes of the model's
tensors (the loading side's layout seam, :func:`~lightning_fsdp.layouts.fsdp1.collect_targets` for FSDP1 and
:func:`~lightning_fsdp.layouts.fsdp2.collect_dtensor_targets` for FSDP2 and tensor parallelism, says which
ranges of which full tensor each rank holds) and of the optimizer states, which the ranks exchange once through the
process group's store (per parameter: the state's keys, the dtypes of the per-element states, and the small values
such as ``step``). The big storages come first in the file, at offsets that depend only on their sizes; each rank
writes the ranges it holds there with positioned writes (``os.pwrite``), straight from its shard's memory, and
computes a partial CRC-32 (:mod:`.crc`). Rank 0 then writes every local header, the storages of small tensors (the
optimizer's ``step``, a tensor ``lr``, tensors of the other entries), the pickle and the zip directory. Tensor data
never moves between ranks.

The file appears under its name only when every rank has succeeded: it is written as a temporary file in the same
directory, each rank flushes it to disk (``fsync``), the ranks agree on the process group's store
(:class:`~lightning_fsdp.distributed.agreement.Agreement`: a rank that fails or dies is noticed by the others), and rank
0 renames it. On any failure every rank raises the same :class:`CheckpointSaveError`, the temporary file is removed and
an earlier file at the path is left as it was.

Host memory per rank: its shard (already there) plus, for tensors on an accelerator, one staging buffer of at most
:data:`STAGING_BYTES`; rank 0 in addition holds the pickle and the small tensors.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import math
import os
import pickle
import struct
import sys
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.distributed.agreement import Agreement
from lightning_fsdp.layouts.targets import ModuleTargets, Run, ShardLocalUnsupported, Target, clean_name
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.saving import archive, export
from lightning_fsdp.saving.crc import SparseCrc, combine_sparse

#: Bytes of a tensor on an accelerator copied to host memory at a time before they are written.
STAGING_BYTES = 64 * 2**20
#: The most bytes one ``os.pwrite`` call is given (Linux writes at most about 2 GiB per call).
_WRITE_BYTES = 1 << 30
#: A state tensor that is not per element (``step``) is pickled by rank 0; larger ones are not served.
_SMALL_STATE_NUMEL = 4096


class CheckpointSaveError(RuntimeError):
    """Saving a checkpoint failed on at least one rank; the message names the rank(s) and their errors.

    ``failed_ranks`` lists the ranks that failed, ``cause`` is this rank's own error (``None`` where it did not fail).

    """

    failed_ranks: tuple[int, ...] = ()
    cause: BaseException | None = None


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


def _module_metadata(module: Module) -> OrderedDict:
    """The ``_metadata`` that ``Module.state_dict`` attaches: each module's version, by its (unclean) name."""
    metadata: OrderedDict = OrderedDict()

    def visit(submodule: Module, prefix: str) -> None:
        metadata[prefix[:-1]] = {"version": submodule._version}
        for name, child in submodule._modules.items():
            if child is not None:
                visit(child, prefix + name + ".")

    visit(module, "")
    return metadata


def _optimizer_params(optimizer: Optimizer) -> list[Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _local_state(optimizer: Optimizer) -> dict:
    # The optimizer's own `state_dict` (references, no copies). Fabric's wrapper would ask the strategy, which gathers.
    return Optimizer.state_dict(optimizer)


def _plan(module: Module, optimizers: dict[str, Optimizer], fsdp2: bool, ranks: Ranks) -> tuple[_Plan, _Report]:
    collected = _collect(module, fsdp2)
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


# --------------------------------------------------------------------------------------------------------------------
# Writing


def _snapshot(writes: list[_LocalWrite], buffers: dict[int, Tensor]) -> list[_LocalWrite]:
    """The writes, from copies in host memory: one buffer per distinct memory written, reused from save to save.

    Several records may be written from the same memory (the optimizer state of an FSDP flat parameter holds the
    slices of several tensors): it is copied once. ``buffers`` keeps the copies by their order, which is the same from
    one save to the next of the same model and optimizers; a buffer of another size or dtype is replaced.

    """
    copies: dict[tuple[int, int, torch.dtype], Tensor] = {}
    copied = []
    for write in writes:
        key = (write.flat.data_ptr(), write.flat.numel(), write.flat.dtype)
        if key not in copies:
            slot = len(copies)
            buffer = buffers.get(slot)
            if buffer is None or buffer.dtype != write.flat.dtype or buffer.numel() != write.flat.numel():
                # pinned where the slices are on a GPU: the copy runs as a DMA and overlaps what follows
                pin = write.flat.device.type == "cuda"
                buffer = torch.empty(write.flat.numel(), dtype=write.flat.dtype, pin_memory=pin)
                buffers[slot] = buffer
            buffer.copy_(write.flat, non_blocking=buffer.is_pinned())
            copies[key] = buffer
        copied.append(_LocalWrite(write.record, copies[key], write.runs))
    for slot in [slot for slot in buffers if slot >= len(copies)]:
        del buffers[slot]  # the model shrank: hold no more than one copy of this save's slices
    if any(buffer.is_pinned() for buffer in copies.values()):
        torch.cuda.synchronize()
    return copied


def _preallocate(fd: int, size: int) -> None:
    """Reserve the blocks of the file's first ``size`` bytes before the ranks write their slices into them.

    Every rank writes its slices at scattered offsets; with the blocks reserved first, those writes allocate nothing
    (four ranks writing 3.2 GB took 10-35% less time with it than without, on ext4). Linux's ``fallocate`` only:
    ``posix_fallocate`` emulates it, where a file system lacks it, by writing every block, which would cost more than
    it saves on a network file system. Where it is not available, nothing happens.

    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate
    except (OSError, AttributeError):
        return
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate(fd, 0, 0, size)  # a failure (EOPNOTSUPP, ENOSPC) leaves it to the writes, which report it


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwrite(fd, data[:_WRITE_BYTES], offset)
        if written <= 0:
            raise OSError(errno.EIO, "os.pwrite wrote nothing")
        data = data[written:]
        offset += written


def _host_bytes(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous 1-D host tensor, without a copy."""
    return memoryview(tensor.view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")


def _write_runs(fds: list[int], writes: list[_LocalWrite], layout: _Layout, crc: bool = True) -> dict[int, int]:
    """Write this rank's runs; return the sparse CRC of every record (this rank's bytes, zeros elsewhere)."""
    by_record: dict[int, list[tuple[Run, Tensor]]] = {}
    for write in writes:
        by_record.setdefault(write.record, []).extend((run, write.flat) for run in write.runs if run.count)
    crcs = {}
    for index, record in enumerate(layout.records):
        placed = layout.placed[index]
        if placed is None:
            continue
        fd = fds[layout.files[index]]
        sparse = SparseCrc(record.nbytes) if crc else None
        itemsize = record.dtype.itemsize
        for run, flat in sorted(by_record.get(index, []), key=lambda item: item[0].start):
            piece = flat[run.offset : run.offset + run.count]
            if piece.dtype != record.dtype:
                raise SaveUnsupported(f"{record.label!r} is {piece.dtype} on this rank, {record.dtype} in the plan")
            step = max(STAGING_BYTES // itemsize, 1)
            for chunk_start in range(0, run.count, step):
                chunk = piece[chunk_start : chunk_start + step]
                if chunk.device.type != "cpu":
                    chunk = chunk.to("cpu")  # one staging buffer of at most STAGING_BYTES at a time
                data = _host_bytes(chunk)
                position = (run.start + chunk_start) * itemsize
                _pwrite_all(fd, data, placed.data_offset + position)
                if sparse is not None:
                    sparse.add(position, data)
        if sparse is not None:
            crcs[index] = sparse.value()
    return crcs


def _skeleton_model(plan: _Plan, layout: _Layout, module: Module, fsdp2: bool) -> dict:
    """The model's entry: ``Module.state_dict``'s ``OrderedDict`` (FSDP1) or ``get_model_state_dict``'s ``dict``."""
    entries = [(name, _stand_in(layout, f"model/{target.names[0]}")) for name, target in plan.entries]
    if fsdp2:
        return dict(entries)
    state = OrderedDict(entries)
    state._metadata = _module_metadata(module)  # type: ignore[attr-defined]
    return state


def _stand_in(layout: _Layout, label: str) -> archive.TensorStandIn:
    index = layout.by_label[label]
    record = layout.records[index]
    return archive.TensorStandIn(archive.StorageRef(str(index), record.dtype, record.numel), record.shape)


def _skeleton_optimizer(plan: _Plan, layout: _Layout, key: str, sorted_names: bool) -> dict:
    _, local, params = plan.optimizers[key]
    merged = layout.optimizer_states[key]
    state: dict[str, dict] = {}
    for index, param in enumerate(params):
        keys = merged.get(index)
        if keys is None:
            continue
        optimizer_param = plan.collected.optimizer_params[id(param)]
        for target, _ in optimizer_param.parts:
            name = target.names[0]
            state[name] = {
                state_key: _stand_in(layout, f"{key}/{name}/{state_key}") if kind == "elem" else value
                for state_key, kind, value in keys
            }
    if sorted_names:
        state = dict(sorted(state.items()))
    groups = []
    position = 0
    for group in local["param_groups"]:
        names = []
        for _ in group["params"]:
            optimizer_param = plan.collected.optimizer_params[id(params[position])]
            names.extend(target.names[0] for target, _ in optimizer_param.parts)
            position += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


@dataclass
class SaveRequest:
    """What to save and how, as the strategy hands it over."""

    path: Path
    state: dict[str, Any]
    module: Module
    fsdp2: bool
    namespace: str
    ranks: Ranks
    modules_first: bool = False
    """ModelParallelStrategy writes modules and optimizers first, then the other entries."""
    sorted_optimizer_names: bool = False
    """FSDP1 with ``use_orig_params=True`` lists the optimizer's state by sorted parameter names."""
    flat_optimizer_order: bool = False
    """FSDP1 with ``use_orig_params=False`` lists each parameter's per-element states before its other states."""
    optimizer_list: str | None = None
    """The entry of ``state`` that holds a list of optimizers (the Trainer's ``"optimizer_states"``); each is saved in
    its place in the list."""
    index_keys: list[str] | None = None
    """Key each optimizer's state by the index of its parameters in this list of names, as
    ``FSDP.rekey_optim_state_dict(..., OptimStateKeyType.PARAM_ID, model)`` does (the Trainer's full checkpoint);
    ``None`` keeps the names."""
    safetensors: bool = False
    """Write the model's tensors in ``.safetensors`` format instead (each tied tensor once; see :mod:`.export`)."""
    max_shard_size: int | None = None
    """With ``safetensors``: write a directory as ``save_pretrained`` does, with shards of at most this many bytes."""
    snapshot: dict[int, Tensor] = field(default_factory=dict)
    """Host buffers for a save in the background (:func:`save` with ``hand_off``), by record; kept from one save to
    the next, and reused where a record's size and dtype are unchanged."""


def temporary_path(path: Path, namespace: str) -> Path:
    """The name the file is written under until every rank has succeeded: hidden, in the same directory."""
    return path.with_name(f".{path.name}.{namespace}.tmp")


def save(
    request: SaveRequest,
    converted: Callable[[Any], Any],
    hand_off: Callable[[Callable[[], None]], None] | None = None,
) -> str | None:
    """Write the checkpoint; return ``None`` when written, or why it cannot be served (then nothing was written).

    ``converted`` turns an entry of the state that is neither the module nor an optimizer into what is saved for it
    (``obj.state_dict()`` for a stateful object), as the strategy does.

    With ``hand_off``, the save returns as soon as the ranks have agreed on the file's layout and this rank holds a
    copy of everything it writes (its slices, in ``request.snapshot`` buffers; on rank 0 the pickled entries too):
    ``hand_off`` gets the rest of the save (the writes, the agreement, the rename), to run in a background thread,
    where it raises what the synchronous save raises. The model and optimizers may change meanwhile: the file holds
    them as they were at the call.

    Raises:
        CheckpointSaveError: On every rank, if any rank failed (the temporary files are removed, the path untouched).

    """
    steps = _save_steps(request, converted, snapshot=hand_off is not None)
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    assert hand_off is not None

    def rest() -> None:
        try:
            next(steps)
        except StopIteration:
            return
        raise AssertionError("a save hands off once")

    hand_off(rest)
    return None


def _save_steps(request: SaveRequest, converted: Callable[[Any], Any], snapshot: bool) -> Iterator[None]:
    """The save, as a generator: with ``snapshot``, it yields once, where the rest may run in another thread."""
    ranks = request.ranks
    directory = request.safetensors and request.max_shard_size is not None
    tmp = temporary_path(request.path, request.namespace)
    optimizers = _optimizers(request)
    token = memoryview(request.namespace.encode())
    fds: list[int] = []
    try:
        with Agreement(f"Saving {str(request.path)!r}", namespace=request.namespace) as agreement:
            try:
                exported = None
                try:
                    plan, report = _plan(request.module, optimizers, request.fsdp2, ranks)
                    if request.safetensors:
                        exported = _export_layout(plan, request.module, request.max_shard_size)
                except (SaveUnsupported, ShardLocalUnsupported, export.ExportUnsupported) as reason:
                    plan, report = None, _Report(reason=str(reason))
                if not directory:
                    paths = [tmp]
                else:
                    paths = [tmp / file.name for file in exported.files] if exported is not None else []
                if ranks.rank == 0:
                    if not request.path.parent.is_dir():
                        raise FileNotFoundError(
                            f"The folder {str(request.path.parent)!r} to save {request.path.name!r} in does not exist."
                            f" Create it first (`os.makedirs({str(request.path.parent)!r}, exist_ok=True)`), as"
                            " Lightning's own full save needs it too."
                        )
                    # Rank 0 creates the files and marks them, so that the others can tell they see the same files.
                    if directory:
                        os.mkdir(tmp)
                    for file_path in paths:
                        fds.append(os.open(file_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
                        _pwrite_all(fds[-1], token, 0)
                reports = _exchange(agreement, "report", report, ranks)
                reason = next((r.reason for r in reports if r.reason is not None), None)
                layout = None
                if reason is None:
                    assert plan is not None
                    try:
                        layout = _merge(plan, reports, ranks.rank, request.flat_optimizer_order, exported)
                    except SaveUnsupported as unsupported:
                        reason = str(unsupported)
                if reason is None:
                    shared = True
                    if ranks.rank != 0:
                        fds, shared = _open_shared(paths, request.namespace)
                    elif exported is None:
                        # before the agreement below, which no rank leaves (to write) before rank 0 arrives
                        _preallocate(fds[0], layout.end)
                    if agreement.any_rank(not shared):
                        reason = "the ranks do not see the same file at the path (no file system shared between them)"
                if reason is not None:
                    return reason
                assert plan is not None
                assert layout is not None
                writes = _local_writes(plan, layout)
                full_state = None
                if ranks.rank == 0 and exported is None:
                    full_state = _skeleton_state(request, plan, layout, converted)
                if snapshot:
                    # the rank's own copy of what it writes; the caller's model and optimizers are free from here on
                    writes = _snapshot(writes, request.snapshot)
                    full_state = copy.deepcopy(full_state)
                    yield
                crcs = _write_runs(fds, writes, layout, crc=exported is None)
                for fd in fds:
                    os.fsync(fd)
            except BaseException as error:
                agreement.agree(error if isinstance(error, Exception) else None)
                raise
            if exported is None:
                all_crcs = _exchange(agreement, "crc", [crcs[index] for index in range(len(layout.records))], ranks)
            else:
                agreement.agree()
            if ranks.rank == 0:
                if exported is not None:
                    _finish_export(fds, exported, tmp if directory else None)
                else:
                    _finish(fds[0], layout, all_crcs, full_state)
                while fds:
                    os.close(fds.pop())
                if directory:
                    _replace_directory(tmp, request.path)
                else:
                    if request.path.is_dir():
                        import shutil

                        shutil.rmtree(request.path)
                    os.replace(tmp, request.path)
                _fsync_directory(request.path.parent)
    except CheckpointLoadError as error:
        # The agreement's report, as a save error: it chains this rank's own failure (none on the other ranks), not
        # the agreement's load-error type
        failure = CheckpointSaveError(str(error).replace("CheckpointLoadError", "CheckpointSaveError"))
        failure.failed_ranks = error.failed_ranks
        failure.cause = error.cause
        raise failure from error.__cause__
    finally:
        while fds:
            os.close(fds.pop())
        # Every rank has left the agreement: the files were renamed (nothing to remove), or the save failed or fell
        # back.
        if directory:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with suppress(FileNotFoundError):
                tmp.unlink()
    return None


def _open_shared(paths: list[Path], token: str) -> tuple[list[int], bool]:
    """Open the files that rank 0 created; whether each holds its mark (else the ranks do not share them)."""
    fds: list[int] = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            break
        fds.append(fd)
        if os.pread(fd, len(token.encode()), 0) != token.encode():
            break
    else:
        return fds, True
    for fd in fds:
        os.close(fd)
    return [], False


def _finish_export(fds: list[int], exported: export.ExportLayout, directory: Path | None) -> None:
    """Rank 0: every file's header; for a directory, the index and a transformers model's configuration."""
    for fd, file, end in zip(fds, exported.files, exported.ends, strict=True):
        _pwrite_all(fd, memoryview(file.header), 0)
        os.ftruncate(fd, end)
        os.fsync(fd)
    if directory is None:
        return
    if exported.index is not None:
        (directory / export.INDEX_NAME).write_bytes(exported.index)
    export.write_configuration(exported, str(directory))
    shards = {file.name for file in exported.files}
    for entry in os.scandir(directory):
        if entry.name not in shards and entry.is_file():
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_directory(directory)


def _replace_directory(new: Path, path: Path) -> None:
    """Rank 0: put the directory ``new`` at ``path``; an earlier directory there is replaced, or kept on failure.

    Where the system can (Linux ``renameat2(RENAME_EXCHANGE)``), the two directories are swapped in one step, so
    that ``path`` is always a complete directory; elsewhere the earlier one is first renamed aside (and back if the
    second rename fails). The earlier directory is then removed.
    """
    import shutil

    if not os.path.lexists(path):
        os.rename(new, path)
        return
    if _swap(new, path):
        shutil.rmtree(new, ignore_errors=True)  # now the earlier directory
        return
    aside = new.with_suffix(".old")
    os.rename(path, aside)
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(aside, path)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _swap(first: Path, second: Path) -> bool:
    """Exchange two paths atomically with Linux's ``renameat2``; ``False`` where it is not available."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0


def _exchange(agreement: Agreement, name: str, value: Any, ranks: Ranks) -> list[Any]:
    """Every rank's ``value`` through the store (no collective: a failed or dead rank is noticed by the others)."""
    store = agreement.store
    if store is None:
        agreement.agree()
        return [value]
    store.set(f"{name}/{ranks.rank}", pickle.dumps(value))
    agreement.agree()
    return [
        value if rank == ranks.rank else pickle.loads(store.get(f"{name}/{rank}")) for rank in range(ranks.world_size)
    ]


def _finish(fd: int, layout: _Layout, all_crcs: list[list[int]], full_state: Any) -> None:
    """Rank 0: the local headers of the storages, the small storages, the pickle, the small records, the directory."""
    directory: list[tuple[archive.RecordLayout, int]] = []
    for index, placed in enumerate(layout.placed):
        assert placed is not None  # every record of a torch.save archive is stored
        crc = combine_sparse([crcs[index] for crcs in all_crcs], placed.size)
        _pwrite_all(fd, memoryview(archive.local_header(placed, crc)), placed.header_offset)
        directory.append((placed, crc))

    small: list[tuple[str, bytes]] = []

    def new_storage(tensor: Tensor) -> archive.StorageRef:
        from torch.serialization import location_tag

        storage = tensor.untyped_storage()
        key = str(len(layout.records) + len(small))
        data = bytes(storage.cpu()) if storage.nbytes() else b""
        small.append((archive.storage_record_name(key), data))
        return archive.StorageRef(key, tensor.dtype, storage.nbytes() // tensor.dtype.itemsize, location_tag(storage))

    pickled = archive.pickle_state(full_state, new_storage)
    records = [*small, (f"{archive.PREFIX}/data.pkl", pickled), *archive.small_records()]
    placed_small, end = archive.plan_records([(name, len(data)) for name, data in records], layout.end)
    for placed, (_, data) in zip(placed_small, records, strict=True):
        crc = zlib.crc32(data)
        _pwrite_all(fd, memoryview(archive.local_header(placed, crc) + data), placed.header_offset)
        directory.append((placed, crc))
    central = archive.central_directory(directory, end)
    _pwrite_all(fd, memoryview(central), end)
    os.ftruncate(fd, end + len(central))
    os.fsync(fd)


def _optimizers(request: SaveRequest) -> dict[str, Optimizer]:
    """The optimizers to save, by the label of their place: a key of ``state``, or ``key/index`` in its list."""
    optimizers = {key: obj for key, obj in request.state.items() if isinstance(obj, Optimizer)}
    if request.optimizer_list is not None:
        for index, optimizer in enumerate(request.state.get(request.optimizer_list, [])):
            optimizers[f"{request.optimizer_list}/{index}"] = optimizer
    return optimizers


def _keyed_by_index(state: dict, names: list[str]) -> dict:
    """An optimizer state keyed by parameter names, keyed by the parameters' indices in ``names`` instead.

    The order of the entries is kept, and each group lists its indices sorted, as ``FSDP.rekey_optim_state_dict``
    (``OptimStateKeyType.PARAM_ID``) writes them.

    """
    index = {name: position for position, name in enumerate(names)}
    groups = [{**group, "params": sorted(index[name] for name in group["params"])} for group in state["param_groups"]]
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def _skeleton_state(request: SaveRequest, plan: _Plan, layout: _Layout, converted: Callable) -> dict:
    full: dict[str, Any] = {}
    other: dict[str, Any] = {}

    def optimizer_skeleton(label: str) -> dict:
        skeleton = _skeleton_optimizer(plan, layout, label, request.sorted_optimizer_names)
        return skeleton if request.index_keys is None else _keyed_by_index(skeleton, request.index_keys)

    for key, obj in request.state.items():
        if obj is request.module:
            full[key] = _skeleton_model(plan, layout, request.module, request.fsdp2)
        elif isinstance(obj, Optimizer):
            full[key] = optimizer_skeleton(key)
        elif key == request.optimizer_list:
            full[key] = [optimizer_skeleton(f"{key}/{index}") for index in range(len(obj))]
        elif request.modules_first:
            other[key] = converted(obj)
        else:
            full[key] = converted(obj)
    full.update(other)
    return full


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
