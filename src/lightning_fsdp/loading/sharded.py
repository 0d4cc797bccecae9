"""Load a sharded checkpoint directory (torch distributed checkpoint) into an FSDP1 or FSDP2 module and its optimizers.

Each rank reads only its own shards through torch's distributed checkpoint (DCP) reader, with guards that upstream
lacks: the metadata is read without running code and checked, and every file too, before anything is opened
(:mod:`lightning_fsdp.loading.sharded_metadata`); the non-tensor entries are unpickled with ``weights_only`` and a
checkpoint in object storage is read by exact range requests (:mod:`lightning_fsdp.loading.sharded_readers`). Here:

- The checkpoint's entries (tensor or not, global shape, dtype) are compared with the model's sharded state dict and
  the optimizers' before anything is read, and everything is read before anything is written: a failed load leaves
  the model and the optimizers as they were.
- A failure inside DCP (a ``CheckpointException``, which is a ``BaseException`` with every rank's traceback in its
  message) is raised as one short :class:`CheckpointLoadError`, with the ranks that failed.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import functools
import pickle
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.layouts.fsdp2 import has_dtensor_params
from lightning_fsdp.loading.errors import (
    CheckpointLoadError,
    quoted_names,
    shown_items,
    unexpected_cause,
)
from lightning_fsdp.loading.files import (
    CheckpointPath,
)
from lightning_fsdp.loading.quiet import torch_internal_warnings_silenced
from lightning_fsdp.loading.sharded_metadata import _SafetensorsSliceInfo, read_checked_metadata
from lightning_fsdp.loading.sharded_readers import CheckedFileSystemReader, SafetensorsSlicesReader, _unpickling_reason
from lightning_fsdp.loading.sources import is_extra_state_name, materialize
from lightning_fsdp.loading.torch_pickle import first_line
from lightning_fsdp.loading.validation import name_problems, strict_false_fix

_T = TypeVar("_T")


def load_sharded_checkpoint(
    path: CheckpointPath,
    module: Module,
    module_key: str | None,
    optimizers: Mapping[str, Optimizer],
    strict: bool,
    weights_only: bool = True,
    dcp_metadata: Metadata | None = None,
) -> str:
    """Restore ``module`` and ``optimizers`` from the shards in ``path`` (after :func:`~.check_sharded_request`).

    ``module`` is an FSDP1 module (its sharded state dict holds ``ShardedTensor`` objects) or a module of ``DTensor``
    parameters (FSDP2, tensor parallelism); only how the model's and the optimizers' state dicts are taken and given
    back differs. ``module_key`` is what :func:`~.module_entry` returned: ``None`` where the checkpoint is the module's
    state itself (it holds no optimizer state then). ``dcp_metadata``, when given, is what
    :func:`~.read_checked_metadata` returned for ``path``: it is not read again.

    Every rank must call it (it runs collectives). The entries are checked against the model and the optimizers,
    then everything is read, then written: when it raises, the model and the optimizers are unchanged.

    Returns:
        What ``strict=False`` left out (missing and unexpected model keys), or an empty string.

    Raises:
        CheckpointLoadError: If the checkpoint does not match the model, or a file is unsafe or unreadable, or the
            distributed checkpoint reader failed on any rank (the same error on every rank).

    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    metadata = dcp_metadata if dcp_metadata is not None else read_checked_metadata(path, weights_only)
    slices = any(isinstance(info, _SafetensorsSliceInfo) for info in metadata.storage_data.values())
    reader = (SafetensorsSlicesReader if slices else CheckedFileSystemReader)(path, metadata, weights_only=weights_only)
    dtensors = has_dtensor_params(module)
    with torch_internal_warnings_silenced(), _sharded_state_dict_context(module, dtensors):
        model_state = _model_state_to_read_into(module, dtensors)
        # DCP names an entry by its path in the state dict it reads into, as in the one that was saved.
        module_state = model_state if module_key is None else {module_key: model_state}
        prefix = "" if module_key is None else f"{module_key}."
        skipped = _check_against_model(metadata, prefix, model_state, list(optimizers), strict)
        read_optimizer_state = _read_dtensor_optimizer_state if dtensors else _read_flat_optimizer_state
        write_optimizers = [
            read_optimizer_state(path, module, model_state, key, optimizer, reader, strict)
            for key, optimizer in optimizers.items()
        ]
        planner = DefaultLoadPlanner(allow_partial_load=not strict)
        _dcp_call(
            f"Reading the model from {str(path)!r}",
            lambda: dcp.load(module_state, storage_reader=reader, planner=planner),
        )
        module.load_state_dict(model_state, strict=strict)
        for write_optimizer in write_optimizers:
            write_optimizer()
    return skipped


def _sharded_state_dict_context(module: Module, dtensors: bool) -> AbstractContextManager:
    """FSDP1 gives its sharded state dict inside this context; a module of ``DTensor`` parameters always does."""
    if dtensors:
        return nullcontext()
    from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context

    return _get_sharded_state_dict_context(module)


def _model_state_to_read_into(module: Module, dtensors: bool) -> dict[str, Any]:
    """The model's sharded state dict, holding tensors that the reader may fill before anything is written.

    FSDP1's sharded state dict holds copies of the local shards already; a module's own state dict holds its
    ``DTensor`` parameters themselves, which the reader would write one by one: those are replaced by copies.

    """
    state = module.state_dict()
    if dtensors:
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                state[name] = value.clone()
    return state


def _read_flat_optimizer_state(
    path: CheckpointPath,
    module: Module,
    model_state: Mapping[str, Any],
    key: str,
    optimizer: Optimizer,
    reader: "CheckedFileSystemReader",
    strict: bool,
) -> Callable[[], None]:
    """Read an FSDP1 optimizer's state (keyed by parameter names) and flatten it; return the call that loads it."""
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    optimizer_state = _dcp_call(
        f"Reading the optimizer state {key!r} from {str(path)!r}",
        lambda: load_sharded_optimizer_state_dict(
            model_state_dict=model_state, optimizer_key=key, storage_reader=reader
        ),
    )
    flattened = _dcp_call(
        f"Matching the optimizer state {key!r} of {str(path)!r} to the optimizer",
        lambda: FSDP.optim_state_dict_to_load(model=module, optim=optimizer, optim_state_dict=optimizer_state[key]),
    )
    # What `optimizer.load_state_dict` would refuse only after the model was written.
    sizes = [len(group["params"]) for group in flattened["param_groups"]]
    expected_sizes = [len(group["params"]) for group in optimizer.param_groups]
    if sizes != expected_sizes:
        raise _other_parameters(path, key, _group_sizes(sizes, expected_sizes))
    return functools.partial(optimizer.load_state_dict, flattened)


def _read_dtensor_optimizer_state(
    path: CheckpointPath,
    module: Module,
    model_state: Mapping[str, Any],
    key: str,
    optimizer: Optimizer,
    reader: "CheckedFileSystemReader",
    strict: bool,
) -> Callable[[], None]:
    """Read the state of an optimizer of ``DTensor`` parameters; return the call that loads it.

    The state is read into a copy of what ``get_optimizer_state_dict`` gives (keyed by parameter names, with the
    parameters' placements), which holds the optimizer's own tensors. Like upstream, that call first gives an
    optimizer without state its initial state (a step with zero gradients and learning rate).

    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    template = _dcp_call(
        f"Taking the state of the optimizer {key!r}", lambda: get_optimizer_state_dict(module, optimizer)
    )
    expected_groups = [group["params"] for group in template["param_groups"]]
    optimizer_state = {key: materialize(template)}
    planner = DefaultLoadPlanner(allow_partial_load=not strict)
    _dcp_call(
        f"Reading the optimizer state {key!r} from {str(path)!r}",
        lambda: dcp.load(optimizer_state, storage_reader=reader, planner=planner),
    )
    groups = [group.get("params") for group in optimizer_state[key]["param_groups"]]
    if groups != expected_groups:
        raise _other_parameters(path, key, _group_differences(groups, expected_groups))
    return functools.partial(set_optimizer_state_dict, module, optimizer, optim_state_dict=optimizer_state[key])


def _group_differences(saved: list[Any], expected: list[list[str]]) -> str:
    """How the parameter names of an optimizer's saved groups differ from the optimizer's."""
    saved_names = [name for group in saved if isinstance(group, list) for name in group]
    sizes = [len(group) if isinstance(group, list) else 0 for group in saved]
    differences = [_group_sizes(sizes, [len(group) for group in expected])]
    known = {name for group in expected for name in group}
    stored = {name for name in saved_names if isinstance(name, str)}
    unknown = [name for name in saved_names if not isinstance(name, str) or name not in known]
    if unknown:
        differences.append(f"not in the optimizer: {quoted_names(unknown)}")
    absent = [name for group in expected for name in group if name not in stored]
    if absent:
        differences.append(f"not in the checkpoint: {quoted_names(absent)}")
    if not unknown and not absent:
        differences.append("the same names, grouped or ordered differently")
    return "; ".join(differences)


def _group_sizes(saved: list[int], expected: list[int]) -> str:
    return (
        f"its parameter groups hold {sum(saved)} parameter(s) in {len(saved)} group(s), the optimizer's"
        f" {sum(expected)} in {len(expected)}"
    )


def _other_parameters(path: CheckpointPath, key: str, differences: str) -> CheckpointLoadError:
    return CheckpointLoadError(
        f"The optimizer state {key!r} of the sharded checkpoint {str(path)!r} belongs to other parameters:"
        f" {differences}. Nothing was loaded. Pass the optimizer that was saved with this model, with the same"
        " parameter groups."
    )


def _check_against_model(
    metadata: Metadata, prefix: str, model_state: Mapping[str, Any], optimizer_keys: Sequence[str], strict: bool
) -> str:
    """Compare the checkpoint's entries with the model's state and raise one error listing the problems.

    ``prefix`` is that of the model's entries (``"model."``), or empty where the checkpoint is the module's state.

    Returns:
        What ``strict=False`` leaves out (missing and unexpected keys), or an empty string.

    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    entries = metadata.state_dict_metadata
    # DCP stores a nested value (a module's extra state that is a dict) under the dotted path of each of its leaves
    flat_state, paths = flatten_state_dict(dict(model_state))
    mismatches: list[str] = []
    missing = []
    for name, value in flat_state.items():
        entry = entries.get(prefix + name)
        if entry is None:
            missing.append(name)
        elif isinstance(value, torch.Tensor):
            problem = _tensor_mismatch(entry, tuple(value.size()), value.dtype)
            if problem:
                mismatches.append(f"{prefix + name!r}: {problem}")
        elif not isinstance(entry, BytesStorageMetadata):
            mismatches.append(f"{prefix + name!r}: checkpoint tensor, model {type(value).__name__}")
    unexpected = [
        fqn[len(prefix) :] for fqn in entries if fqn.startswith(prefix) and fqn[len(prefix) :] not in flat_state
    ]
    for key in optimizer_keys:
        mismatches += _optimizer_mismatches(entries, key, model_state)

    problems = name_problems(missing, unexpected) if strict else []
    if mismatches:
        problems.append(f"{len(mismatches)} entr(y/ies) that cannot be loaded: {shown_items(mismatches)}")
    if problems:
        # the fix names an extra state by its entry, not by the leaves that DCP stored it under
        extra = list(dict.fromkeys(str(paths[name][0]) for name in missing if _in_extra_state(paths[name])))
        tensors = [name for name in missing if not _in_extra_state(paths[name])]
        fix = f"\n{strict_false_fix(tensors, extra)}" if strict and not mismatches else ""
        raise CheckpointLoadError(
            "The sharded checkpoint does not match the model; nothing was loaded and the model is unchanged.\n- "
            + "\n- ".join(problems)
            + fix
        )
    skipped = []
    if missing:
        skipped.append(f"{len(missing)} missing key(s) left as they were ({quoted_names(missing)})")
    if unexpected:
        skipped.append(f"{len(unexpected)} unexpected key(s) ignored ({quoted_names(unexpected)})")
    return "; ".join(skipped)


def _in_extra_state(path: Sequence[Any]) -> bool:
    """Whether a flattened entry (its path in the state dict) is, or is in, a module's extra state."""
    return is_extra_state_name(path[0])


def _optimizer_mismatches(entries: Mapping[str, Any], key: str, model_state: Mapping[str, Any]) -> list[str]:
    # FSDP names the state of a parameter `<optimizer>.state.<parameter name>.<state name>`; state that is not a
    # scalar (Adam's `exp_avg`, SGD's `momentum_buffer`) has the parameter's shape.
    prefix = f"{key}.state."
    mismatches = []
    for fqn, entry in entries.items():
        if not fqn.startswith(prefix):
            continue
        rest = fqn[len(prefix) :]
        owner = _owning_tensor(rest, model_state)
        if owner is None:
            mismatches.append(f"{fqn!r}: state of a parameter the model does not have")
        elif isinstance(entry, TensorStorageMetadata) and entry.size.numel() != 1:
            shape = tuple(model_state[owner].size())
            if tuple(entry.size) != shape:
                mismatches.append(f"{fqn!r}: checkpoint {_shape(tuple(entry.size))}, parameter {_shape(shape)}")
    return mismatches


def _owning_tensor(name: str, model_state: Mapping[str, Any]) -> str | None:
    """The longest tensor name of the model that ``name`` extends by at least one dotted part."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:end])
        if isinstance(model_state.get(candidate), torch.Tensor):
            return candidate
    return None


def _tensor_mismatch(entry: Any, shape: tuple[int, ...], dtype: torch.dtype) -> str:
    if not isinstance(entry, TensorStorageMetadata):
        return f"checkpoint holds a non-tensor object, model a tensor of shape {_shape(shape)}"
    if tuple(entry.size) != shape:
        return f"checkpoint shape {_shape(tuple(entry.size))}, model {_shape(shape)}"
    stored = entry.properties.dtype
    if stored != dtype and not (stored.is_floating_point and dtype.is_floating_point):
        return f"checkpoint dtype {stored}, model {dtype} (cannot be cast)"
    return ""


def _dcp_call(what: str, call: Callable[[], _T]) -> _T:
    """Run a call into DCP, and turn its failure (on any rank) into one short error."""
    try:
        return call()
    except CheckpointLoadError:
        raise
    except CheckpointException as error:
        ranks = tuple(sorted(error.failures))
        causes = [failure[0] for failure in error.failures.values()]
        own = next((cause for cause in causes if isinstance(cause, CheckpointLoadError)), None)
        if own is not None:
            detail = str(own)
        elif causes and isinstance(causes[0], pickle.UnpicklingError):
            detail = (
                f"{_unpickling_reason(causes[0])}. An entry is corrupt, or is not a tensor as torch writes it: re-copy"
                " or re-save the checkpoint."
            )
        else:
            detail = first_line(causes[0]) if causes else "no details"
        cause = own if own is not None else error
        message = f"{what} failed on rank(s) {', '.join(map(str, ranks))}: {detail}"
        raise CheckpointLoadError(message, ranks, cause) from unexpected_cause(cause)
    except Exception as error:
        raise CheckpointLoadError(f"{what} failed: {first_line(error)}", cause=error) from unexpected_cause(error)


def _shape(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))})" if len(shape) != 1 else f"({shape[0]},)"
