"""A full (consolidated) checkpoint written by every rank: each writes its own slices into one ``torch.save`` file.

Every rank plans the same archive (:mod:`.archive`) from metadata alone: the names, shapes and dtypes of the model's
tensors (the loading side's layout seam, :func:`~lightning_fsdp.loading.shard_local.collect_targets` for FSDP1 and
:func:`~lightning_fsdp.loading.fsdp2_layout.collect_dtensor_targets` for FSDP2 and tensor parallelism, says which
ranges of which full tensor each rank holds) and of the optimizer states, which the ranks exchange once through the
process group's store (per parameter: the state's keys, the dtypes of the per-element states, and the small values
such as ``step``). The big storages come first in the file, at offsets that depend only on their sizes; each rank
writes the ranges it holds there with positioned writes (``os.pwrite``), straight from its shard's memory, and
computes a partial CRC-32 (:mod:`.crc`). Rank 0 then writes every local header, the storages of small tensors (the
optimizer's ``step``, a tensor ``lr``, tensors of the other entries), the pickle and the zip directory. Tensor data
never moves between ranks.

The file appears under its name only when every rank has succeeded: it is written as a temporary file in the same
directory, each rank flushes it to disk (``fsync``), the ranks agree on the process group's store
(:class:`~lightning_fsdp.loading.agreement.Agreement`: a rank that fails or dies is noticed by the others), and rank 0
renames it. On any failure every rank raises the same :class:`CheckpointSaveError`, the temporary file is removed and
an earlier file at the path is left as it was.

Host memory per rank: its shard (already there) plus, for tensors on an accelerator, one staging buffer of at most
:data:`STAGING_BYTES`; rank 0 in addition holds the pickle and the small tensors.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import pickle
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.loading.agreement import Agreement
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.shard_local import ModuleTargets, Run, ShardLocalUnsupported, Target, clean_name
from lightning_fsdp.saving import archive
from lightning_fsdp.saving.crc import SparseCrc, combine_sparse

#: Bytes of a tensor on an accelerator copied to host memory at a time before they are written.
STAGING_BYTES = 64 * 2**20
#: The most bytes one ``os.pwrite`` call is given (Linux writes at most about 2 GiB per call).
_WRITE_BYTES = 1 << 30
#: A state tensor that is not per element (``step``) is pickled by rank 0; larger ones are not served.
_SMALL_STATE_NUMEL = 4096


class CheckpointSaveError(RuntimeError):
    """Saving a checkpoint failed on at least one rank; the message names the rank(s) and their errors."""


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
        from lightning_fsdp.loading.fsdp2_layout import collect_dtensor_targets

        return collect_dtensor_targets(module)
    from lightning_fsdp.loading.shard_local import collect_targets

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
    buffer_names: set[str] = set()
    for name, submodule in module.named_modules(remove_duplicate=False):
        module_order.setdefault(clean_name(name), len(module_order))
        for buffer_name, buffer in submodule._buffers.items():
            if buffer is not None and buffer_name not in submodule._non_persistent_buffers_set:
                buffer_names.add(clean_name(f"{name}.{buffer_name}" if name else buffer_name))
    entries = []
    for position, target in enumerate(collected.targets):
        for alias, name in enumerate(target.names):
            owner = name.rpartition(".")[0]
            key = (module_order.get(owner, len(module_order)), name in buffer_names, position, alias)
            entries.append((key, name, target))
    entries.sort(key=lambda entry: entry[0])
    return [(name, target) for _, name, target in entries]


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
    placed: list[archive.RecordLayout]
    end: int
    optimizer_states: dict[str, dict[int, list[tuple[str, str, Any]]]]
    """Per optimizer and parameter index: the merged ``(key, kind, dtype or value)`` of its state."""
    writes: set[str]
    """The labels of the records that this rank writes its slices of."""


def _merge(
    plan: _Plan, reports: list[_Report], rank_index: int, flat_optimizer_order: bool, safetensors: bool = False
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
    if safetensors:
        placed, end = _safetensors_layout(records)
    else:
        names = [(archive.storage_record_name(str(index)), record.nbytes) for index, record in enumerate(records)]
        placed, end = archive.plan_records(names, 0)
    return _Layout(records, by_label, placed, end, merged_states, writes)


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _safetensors_header(records: list[_Record]) -> bytes:
    """The safetensors header (length prefix included): the tensors back to back, in ``records`` order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for record in records:
        if record.dtype not in _SAFETENSORS_DTYPES:
            raise SaveUnsupported(f"safetensors has no dtype for {record.dtype} ({record.label!r})")
        name = record.label.removeprefix("model/")
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[record.dtype],
            "shape": list(record.shape),
            "data_offsets": [offset, offset + record.nbytes],
        }
        offset += record.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def _safetensors_layout(records: list[_Record]) -> tuple[list[archive.RecordLayout], int]:
    start = len(_safetensors_header(records))
    placed = []
    for record in records:
        placed.append(archive.RecordLayout(record.label, 0, start, record.nbytes))
        start += record.nbytes
    return placed, start


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


def _write_runs(fd: int, writes: list[_LocalWrite], layout: _Layout) -> dict[int, int]:
    """Write this rank's runs; return the sparse CRC of every record (this rank's bytes, zeros elsewhere)."""
    by_record: dict[int, list[tuple[Run, Tensor]]] = {}
    for write in writes:
        by_record.setdefault(write.record, []).extend((run, write.flat) for run in write.runs if run.count)
    crcs = {}
    for index, record in enumerate(layout.records):
        sparse = SparseCrc(record.nbytes)
        itemsize = record.dtype.itemsize
        base = layout.placed[index].data_offset
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
                _pwrite_all(fd, data, base + position)
                sparse.add(position, data)
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
    safetensors: bool = False
    """Write the model's tensors as one ``.safetensors`` file instead (each tied tensor once, under its first name)."""


def temporary_path(path: Path, namespace: str) -> Path:
    """The name the file is written under until every rank has succeeded: hidden, in the same directory."""
    return path.with_name(f".{path.name}.{namespace}.tmp")


def save(request: SaveRequest, converted: Callable[[Any], Any]) -> str | None:
    """Write the checkpoint; return ``None`` when written, or why it cannot be served (then nothing was written).

    ``converted`` turns an entry of the state that is neither the module nor an optimizer into what is saved for it
    (``obj.state_dict()`` for a stateful object), as the strategy does.

    Raises:
        CheckpointSaveError: On every rank, if any rank failed (the temporary file is removed, the path untouched).

    """
    ranks = request.ranks
    tmp = temporary_path(request.path, request.namespace)
    optimizers = {key: obj for key, obj in request.state.items() if isinstance(obj, Optimizer)}
    fd = -1
    try:
        with Agreement(f"Saving {str(request.path)!r}", namespace=request.namespace) as agreement:
            try:
                try:
                    plan, report = _plan(request.module, optimizers, request.fsdp2, ranks)
                except (SaveUnsupported, ShardLocalUnsupported) as reason:
                    plan, report = None, _Report(reason=str(reason))
                if ranks.rank == 0:
                    # Rank 0 creates the file and marks it, so that the others can tell they see the same file.
                    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    _pwrite_all(fd, memoryview(request.namespace.encode()), 0)
                reports = _exchange(agreement, "report", report, ranks)
                reason = next((r.reason for r in reports if r.reason is not None), None)
                layout = None
                if reason is None:
                    assert plan is not None
                    try:
                        layout = _merge(
                            plan, reports, ranks.rank, request.flat_optimizer_order, safetensors=request.safetensors
                        )
                    except SaveUnsupported as unsupported:
                        reason = str(unsupported)
                if reason is None:
                    shared = True
                    if ranks.rank != 0:
                        fd, shared = _open_shared(tmp, request.namespace)
                    if agreement.any_rank(not shared):
                        reason = "the ranks do not see the same file at the path (no file system shared between them)"
                if reason is not None:
                    return reason
                assert plan is not None
                assert layout is not None
                crcs = _write_runs(fd, _local_writes(plan, layout), layout)
                os.fsync(fd)
            except BaseException as error:
                agreement.agree(error if isinstance(error, Exception) else None)
                raise
            all_crcs = _exchange(agreement, "crc", [crcs[index] for index in range(len(layout.records))], ranks)
            if ranks.rank == 0:
                if request.safetensors:
                    _pwrite_all(fd, memoryview(_safetensors_header(layout.records)), 0)
                    os.ftruncate(fd, layout.end)
                    os.fsync(fd)
                else:
                    _finish(fd, request, plan, layout, all_crcs, converted)
                os.close(fd)
                fd = -1
                if request.path.is_dir():
                    import shutil

                    shutil.rmtree(request.path)
                os.replace(tmp, request.path)
                _fsync_directory(request.path.parent)
    except CheckpointLoadError as error:
        raise CheckpointSaveError(str(error).replace("CheckpointLoadError", "CheckpointSaveError")) from error
    finally:
        if fd >= 0:
            os.close(fd)
        # Every rank has left the agreement: the file was renamed (nothing to remove), or the save failed or fell back.
        with suppress(FileNotFoundError):
            tmp.unlink()
    return None


def _open_shared(tmp: Path, token: str) -> tuple[int, bool]:
    try:
        fd = os.open(tmp, os.O_RDWR)
    except FileNotFoundError:
        return -1, False
    return fd, os.pread(fd, len(token.encode()), 0) == token.encode()


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


def _finish(
    fd: int, request: SaveRequest, plan: _Plan, layout: _Layout, all_crcs: list[list[int]], converted: Callable
) -> None:
    """Rank 0: the local headers of the storages, the small storages, the pickle, the small records, the directory."""
    directory: list[tuple[archive.RecordLayout, int]] = []
    for index, placed in enumerate(layout.placed):
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

    full_state = _skeleton_state(request, plan, layout, converted)
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


def _skeleton_state(request: SaveRequest, plan: _Plan, layout: _Layout, converted: Callable) -> dict:
    full: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for key, obj in request.state.items():
        if obj is request.module:
            full[key] = _skeleton_model(plan, layout, request.module, request.fsdp2)
        elif isinstance(obj, Optimizer):
            full[key] = _skeleton_optimizer(plan, layout, key, request.sorted_optimizer_names)
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
