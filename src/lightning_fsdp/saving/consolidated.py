"""A full (consolidated) checkpoint written by every rank: each writes its own slices into one ``torch.save`` file.

Every rank plans the same archive (:mod:`lightning_fsdp.saving.archive`) from metadata alone: the names, shapes and
dtypes of the model's tensors (the loading side's layout seam, :func:`~lightning_fsdp.layouts.fsdp1.collect_targets` for
FSDP1 and :func:`~lightning_fsdp.layouts.fsdp2.collect_dtensor_targets` for FSDP2 and tensor parallelism, says which
ranges of which full tensor each rank holds) and of the optimizer states, which the ranks exchange once through the
process group's store (per parameter: the state's keys, the dtypes of the per-element states, and the small values such
as ``step``). The big storages come first in the file, at offsets that depend only on their sizes; each rank writes the
ranges it holds there with positioned writes (``os.pwrite``), straight from its shard's memory, and computes a partial
CRC-32 (:mod:`lightning_fsdp.saving.crc`). Rank 0 then writes every local header, the storages of small tensors (the
optimizer's ``step``, a tensor ``lr``, tensors of the other entries), the pickle and the zip directory. Tensor data
never moves between ranks.

The file appears under its name only when every rank has succeeded: it is written as a temporary file in the same
directory, each rank flushes it to disk (``fsync``), the ranks agree on the process group's store
(:class:`~lightning_fsdp.distributed.agreement.Agreement`: a rank that fails or dies is noticed by the others), and rank
0 renames it. On any failure every rank raises the same :class:`CheckpointSaveError`, the temporary file is removed and
an earlier file at the path is left as it was.

Host memory per rank: its shard (already there) plus, for tensors on an accelerator, one staging buffer of at most
:data:`~lightning_fsdp.saving.consolidated_write.STAGING_BYTES`; rank 0 in addition holds the pickle and the small
tensors.

This module holds the save's steps, their agreements and what rank 0 pickles; the plan and the layout are in
:mod:`lightning_fsdp.saving.consolidated_plan`, the writes in :mod:`lightning_fsdp.saving.consolidated_write`.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from __future__ import annotations

import copy
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.distributed.agreement import Agreement
from lightning_fsdp.layouts.targets import ShardLocalUnsupported
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.saving import archive, export
from lightning_fsdp.saving.consolidated_plan import (
    Ranks,
    SaveUnsupported,
    _export_layout,
    _Layout,
    _local_writes,
    _merge,
    _Plan,
    _plan,
    _Report,
)
from lightning_fsdp.saving.consolidated_write import (
    _finish,
    _finish_export,
    _fsync_directory,
    _open_shared,
    _preallocate,
    _pwrite_all,
    _replace_directory,
    _snapshot,
    _write_runs,
)

if TYPE_CHECKING:
    from lightning_fsdp.saving.background import HostBuffers


class CheckpointSaveError(RuntimeError):
    """Saving a checkpoint failed on at least one rank; the message names the rank(s) and their errors.

    ``failed_ranks`` lists the ranks that failed, ``cause`` is this rank's own error (``None`` where it did not fail).

    """

    failed_ranks: tuple[int, ...] = ()
    cause: BaseException | None = None


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
    snapshot: HostBuffers | None = None
    """The host memory of a save in the background (:func:`save` with ``hand_off``), kept from one save to the
    next."""


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
                    assert request.snapshot is not None
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
