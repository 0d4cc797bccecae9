"""Named tensors read from checkpoint files by exact, proven byte ranges.

Every tensor that a file holds is described by a :class:`TensorLocation`: where its storage's bytes are in the file
(as the file's own structure says: the zip directory, the safetensors header, the legacy pickles), and how the tensor
sits in that storage. A :class:`ByteRangeSource` reads those bytes with positioned reads into fresh memory, so a rank
touches only its own slices, memory never grows with the file, and a file that shrinks or changes during a load gives
an error instead of a ``SIGBUS``.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import ctypes
import math
import mmap
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.files import (
    CheckpointPath,
    OpenFile,
    StorageFile,
    StoragePath,
    check_local_file_unchanged,
    close_file,
    open_file,
    read_exactly,
    require_regular_file,
)

#: Reads at least this large get an anonymous mapping of their own (see :meth:`ByteRangeSource.read_flat`).
_OWN_MAPPING_BYTES = 2**20
#: A safetensors file or a Hugging Face index naming more tensors is refused before its entries are checked one by one:
#: the largest models have a few hundred thousand tensors in all, and each costs every rank time and memory to check.
MAX_TENSORS = 500_000
#: Containers nested deeper than this are refused (walks recurse; real checkpoints nest a handful of levels).
MAX_NESTING = 100


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of a tensor in a checkpoint, known without reading its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class TensorSource(ABC):
    """Named tensors that can be read whole or as a range of their flattened elements.

    A range read returns only the elements asked for, so a rank reads only the bytes of its own shard.

    """

    @abstractmethod
    def specs(self) -> Mapping[str, TensorSpec]:
        """Shape and dtype of every tensor, read from the file's metadata without reading tensor data."""

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """Return the whole tensor."""

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Return elements ``[start, stop)`` of the flattened tensor."""
        return self.read(name).reshape(-1)[start:stop]

    def read_flat_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Write elements ``[start, start + out.numel())`` of the flattened tensor into ``out`` (cast as needed)."""
        out.copy_(self.read_flat(name, start, start + out.numel()))

    @abstractmethod
    def check_unchanged(self) -> None:
        """Raise if a file this source reads changed since it was opened."""

    @abstractmethod
    def close(self) -> None:
        """Release open files and memory."""


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's elements are in a file: a storage's byte range, and the tensor's place in that storage."""

    file: CheckpointPath
    storage_offset: int
    """Absolute byte offset of the storage's first byte in ``file``."""
    storage_nbytes: int
    spec: TensorSpec
    element_offset: int = 0
    """The tensor's first element within the storage."""
    stride: tuple[int, ...] | None = None
    """The tensor's strides, or ``None`` when it is contiguous."""

    def check(self, name: str, file_size: int) -> None:
        """Raise if the tensor does not fit in its storage, or the storage not in the file."""
        if self.storage_offset < 0 or self.storage_offset + self.storage_nbytes > file_size:
            raise _out_of_bounds(self.file, name, "its bytes lie outside the file")
        if self.element_offset < 0 or any(size < 0 for size in self.spec.shape):
            raise _out_of_bounds(self.file, name, "it has a negative size or offset")
        if self.spec.numel == 0:
            return
        strides = self.stride if self.stride is not None else _contiguous_strides(self.spec.shape)
        if any(step < 0 for step in strides):
            raise _out_of_bounds(self.file, name, "it has a negative stride")
        last = self.element_offset + sum((size - 1) * step for size, step in zip(self.spec.shape, strides, strict=True))
        if (last + 1) * self.spec.dtype.itemsize > self.storage_nbytes:
            raise _out_of_bounds(self.file, name, "it needs more bytes than its storage holds")


class ByteRangeSource(TensorSource):
    """Tensors read with positioned reads of exactly the bytes asked for: nothing is mapped or cached.

    Each file is opened once (and checked to be a regular file); every location is checked against the file's size
    when the source is made. Each read returns fresh memory holding only the requested elements.

    """

    def __init__(self, locations: Mapping[str, TensorLocation]) -> None:
        self._locations = dict(locations)
        self._specs = {name: location.spec for name, location in self._locations.items()}
        self._files: dict[CheckpointPath, tuple[OpenFile, Any]] = {}
        try:
            for name, location in self._locations.items():
                location.check(name, self._open(location.file)[1].st_size)
        except BaseException:
            self.close()
            raise

    def _open(self, path: CheckpointPath) -> tuple[OpenFile, Any]:
        if path not in self._files:
            info = require_regular_file(path)
            if isinstance(path, StoragePath):
                self._files[path] = (open_file(path), info)
                return self._files[path]
            # O_NONBLOCK: should the path have become a FIFO since the check, opening it must not block.
            try:
                file = open_file(path)
            except OSError as error:
                raise CheckpointLoadError(
                    f"The checkpoint file {str(path)!r} cannot be opened: {error.strerror or error}."
                ) from None
            info = os.fstat(file)
            self._files[path] = (file, info)
            require_regular_file(path)  # the path, not only the descriptor, is checked once more after opening
        return self._files[path]

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def read(self, name: str) -> torch.Tensor:
        location = self._locations[name]
        if location.stride is None:
            return self.read_flat(name, 0, location.spec.numel).view(location.spec.shape)
        # A view with its own strides: read the span of the storage it covers, and view it the same way.
        span = 0
        if location.spec.numel:
            span = 1 + sum((size - 1) * step for size, step in zip(location.spec.shape, location.stride, strict=True))
        data = self._read_elements(name, location, location.element_offset, span)
        return data.as_strided(location.spec.shape, location.stride).clone()

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        location = self._locations[name]
        if location.stride is not None:
            return self.read(name).reshape(-1)[start:stop]
        stop = min(stop, location.spec.numel)
        start = min(max(start, 0), stop)
        return self._read_elements(name, location, location.element_offset + start, stop - start)

    def read_flat_into(self, name: str, start: int, out: torch.Tensor) -> None:
        location = self._locations[name]
        direct = location.stride is None and out.device.type == "cpu" and out.is_contiguous()
        if not direct or out.dtype != location.spec.dtype or out.numel() == 0 or out.requires_grad:
            super().read_flat_into(name, start, out)
            return
        if start < 0 or start + out.numel() > location.spec.numel:
            raise ValueError(f"elements [{start}, {start + out.numel()}) are outside the tensor {name!r}")
        # Straight into the destination's memory: no buffer of its own, no second copy. Autograd does not see this
        # write; a caller that writes into a tensor autograd tracks records it (`increment_version`).
        nbytes = out.numel() * out.element_size()
        destination = memoryview((ctypes.c_char * nbytes).from_address(out.data_ptr())).cast("B")
        self._read_into(name, location, location.element_offset + start, destination)

    def _read_elements(self, name: str, location: TensorLocation, first: int, count: int) -> torch.Tensor:
        dtype = location.spec.dtype
        nbytes = count * dtype.itemsize
        if nbytes <= 0:
            return torch.empty(0, dtype=dtype)
        # Large reads get memory of their own, returned to the system as soon as the tensor is dropped: from the heap,
        # freed blocks of this size tend to stay resident and the process would grow with every read.
        buffer = mmap.mmap(-1, nbytes) if nbytes >= _OWN_MAPPING_BYTES else bytearray(nbytes)
        self._read_into(name, location, first, memoryview(buffer))
        return torch.frombuffer(buffer, dtype=dtype)

    def _read_into(self, name: str, location: TensorLocation, first: int, destination: memoryview) -> None:
        """Fill ``destination`` with the elements of ``name``'s storage from element ``first`` on."""
        file, _ = self._open(location.file)
        offset = location.storage_offset + first * location.spec.dtype.itemsize
        if isinstance(file, StorageFile):  # exactly the slice's bytes, not the blocks that hold them
            file.read_into(offset, destination, f"the tensor {name!r}", cached=False)
            return
        read_exactly(file, offset, destination, location.file, f"the tensor {name!r}")

    def check_unchanged(self) -> None:
        for path, (file, opened) in self._files.items():
            if isinstance(file, StorageFile):
                file.check_unchanged()
                continue
            check_local_file_unchanged(path, file, opened)

    def close(self) -> None:
        for file, _ in self._files.values():
            close_file(file)
        self._files.clear()


class DictSource(TensorSource):
    """Tensors from an in-memory state dict (a checkpoint that had to be read whole)."""

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        check_state_dict(state_dict)
        self._state_dict = state_dict
        self._specs = {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in state_dict.items()}

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def read(self, name: str) -> torch.Tensor:
        return self._state_dict[name]

    def check_unchanged(self) -> None:
        pass  # read whole before the load began: nothing can change under it

    def close(self) -> None:
        self._state_dict = {}


class MergedSource(TensorSource):
    """Several sources seen as one (the shards of a Hugging Face index)."""

    def __init__(self, sources: list[TensorSource]) -> None:
        self._sources = sources
        self._owner: dict[str, TensorSource] = {}
        self._specs: dict[str, TensorSpec] = {}
        for source in sources:
            for name, spec in source.specs().items():
                self._owner[name] = source
                self._specs[name] = spec

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def read(self, name: str) -> torch.Tensor:
        return self._owner[name].read(name)

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._owner[name].read_flat(name, start, stop)

    def read_flat_into(self, name: str, start: int, out: torch.Tensor) -> None:
        self._owner[name].read_flat_into(name, start, out)

    def check_unchanged(self) -> None:
        for source in self._sources:
            source.check_unchanged()

    def close(self) -> None:
        for source in self._sources:
            source.close()


class TensorRef:
    """A tensor of a checkpoint that has not been read: its shape and dtype, and how to read all or part of it.

    Entries of a checkpoint other than the module's state (optimizer states, a step counter) hold these instead of
    tensors, so that each rank reads only the slices it keeps.

    """

    def __init__(self, source: TensorSource, name: str) -> None:
        self.source = source
        self.name = name
        self.spec = source.specs()[name]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.spec.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    def dim(self) -> int:
        return len(self.spec.shape)

    def numel(self) -> int:
        return self.spec.numel

    def read(self) -> torch.Tensor:
        return self.source.read(self.name)

    def read_flat(self, start: int, stop: int) -> torch.Tensor:
        return self.source.read_flat(self.name, start, stop)

    def read_flat_into(self, start: int, out: torch.Tensor) -> None:
        self.source.read_flat_into(self.name, start, out)

    def get_shape(self) -> list[int]:
        """The shape, as a safetensors slice gives it: the core reads this like one (``value[rows]``)."""
        return list(self.spec.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        """All of the tensor (``...``), or a range of its rows (``start:stop``), read as a safetensors slice reads."""
        if index is Ellipsis:
            return self.read()
        if isinstance(index, slice) and index.step in (None, 1) and self.spec.shape:
            rows = self.spec.shape[0]
            start, stop, _ = index.indices(rows)
            stop = max(start, stop)
            row = math.prod(self.spec.shape[1:])
            return self.read_flat(start * row, stop * row).view(stop - start, *self.spec.shape[1:])
        raise TypeError(f"A `TensorRef` reads `...` or a range of rows, not {index!r}.")

    def __repr__(self) -> str:
        return f"TensorRef({self.name!r}, shape={tuple(self.spec.shape)}, dtype={self.spec.dtype})"


def materialize(obj: Any) -> Any:
    """A copy of ``obj`` with every :class:`TensorRef` read and every tensor cloned (it outlives its source).

    Objects that ``obj`` holds more than once are copied once and stay shared in the copy, as ``torch.load`` returns
    them.

    """
    return map_tensors(obj, lambda _, tensor: (tensor.read() if isinstance(tensor, TensorRef) else tensor).clone())


def map_tensors(obj: Any, replace: Callable[[str, Any], Any], each_place: bool = False) -> Any:
    """``obj`` with each tensor (or :class:`TensorRef`) in its nested dicts, lists and tuples replaced.

    ``replace(path, tensor)`` gets the dotted path to the first place the tensor is found
    (``optimizer.state.w.exp_avg``). Every object is visited once, by identity, and one found again (a pickle shares
    references) gets the same result, so the work is linear in the size of the file it was unpickled from, sharing
    survives, and cycles end: a walk that followed every path would take time exponential in the depth of a chain of
    shared references, which a few kilobytes of pickle can make as deep as it likes.

    Args:
        obj: The unpickled object.
        replace: Called with the path and the tensor; returns what replaces it.
        each_place: Call ``replace`` at every place a tensor is found through distinct containers (a tied weight
            under both of its names), not once per tensor.

    Raises:
        CheckpointLoadError: If ``obj`` is nested deeper than any checkpoint needs.

    """
    done: dict[int, tuple[Any, Any]] = {}  # id -> (the object, kept alive so that its id stays its own; its result)

    def visit(value: Any, path: str, depth: int) -> Any:
        if id(value) in done:
            return done[id(value)][1]
        if isinstance(value, (torch.Tensor, TensorRef)):
            if each_place:
                return replace(path, value)
            result = replace(path, value)
        elif isinstance(value, (Mapping, list, tuple)):
            if depth > MAX_NESTING:
                raise CheckpointLoadError(
                    f"The checkpoint holds containers nested more than {MAX_NESTING} levels deep (at {path!r}), which"
                    " no checkpoint needs: it is corrupt or crafted. Save plain state dicts."
                )
            result = _rebuild(value, path, lambda item, item_path: visit(item, item_path, depth + 1), done)
        else:
            return value
        done[id(value)] = (value, result)
        return result

    return visit(obj, "", 0)


def _rebuild(value: Any, path: str, visit: Callable[[Any, str], Any], done: dict[int, tuple[Any, Any]]) -> Any:
    """A dict, list or tuple with each item visited; dicts and lists are registered before their items (cycles)."""
    if isinstance(value, tuple):
        items = tuple(visit(item, _child_path(path, index)) for index, item in enumerate(value))
        # A cycle through this tuple (via a list or dict inside it) built it already: keep that one.
        return done[id(value)][1] if id(value) in done else items
    # An `OrderedDict` stays one (`torch.load` returns it so, and optimizer code may rely on it); other mappings become
    # plain dicts: constructing an arbitrary class here could run its code.
    result: Any = (OrderedDict() if isinstance(value, OrderedDict) else {}) if isinstance(value, Mapping) else []
    done[id(value)] = (value, result)
    if isinstance(value, Mapping):
        for key, item in value.items():
            result[key] = visit(item, _child_path(path, key))
    else:
        result.extend(visit(item, _child_path(path, index)) for index, item in enumerate(value))
    return result


def walk_tensors(obj: Any) -> list[tuple[str, Any]]:
    """Every tensor (or :class:`TensorRef`) in nested dicts, lists and tuples, with the dotted path to it.

    A tensor held more than once is listed at each path by which it is reached through distinct containers (a tied
    weight under both of its names); a container held more than once is walked once (see :func:`map_tensors`).

    """
    found: list[tuple[str, Any]] = []

    def collect(path: str, tensor: Any) -> Any:
        found.append((path, tensor))
        return tensor

    map_tensors(obj, collect, each_place=True)
    return found


def is_extra_state_name(name: object) -> bool:
    """Whether ``name`` (any key of a state dict) names a module's extra state (``get_extra_state``): any object."""
    return isinstance(name, str) and (name == _EXTRA_STATE_KEY_SUFFIX or name.endswith(f".{_EXTRA_STATE_KEY_SUFFIX}"))


def split_extra_states(state_dict: Mapping[Any, Any]) -> tuple[dict[Any, Any], dict[str, Any]]:
    """A module state dict's tensors, and its extra states that are not tensors (they are set whole, not read).

    Raises:
        CheckpointLoadError: If a name is not a string, or a value that is not an extra state is not a tensor.

    """
    extras = {
        key: value
        for key, value in state_dict.items()
        if is_extra_state_name(key) and not isinstance(value, (torch.Tensor, TensorRef))
    }
    tensors = {key: value for key, value in state_dict.items() if key not in extras}
    check_state_dict(tensors)
    return tensors, extras


def check_state_dict(state_dict: Mapping[Any, Any]) -> None:
    """Raise if a module state dict has names that are not strings, or values that are not tensors."""
    not_names = [key for key in state_dict if not isinstance(key, str)]
    if not_names:
        shown = ", ".join(f"{key!r} ({type(key).__name__})" for key in not_names[:5])
        raise CheckpointLoadError(
            f"The state dict has {len(not_names)} key(s) that are not names: {shown}. A module state dict maps"
            " parameter and buffer names (strings) to tensors."
        )
    not_tensors = {k: type(v).__name__ for k, v in state_dict.items() if not isinstance(v, (torch.Tensor, TensorRef))}
    if not_tensors:
        shown = ", ".join(f"{k!r} ({t})" for k, t in list(not_tensors.items())[:5])
        raise CheckpointLoadError(
            f"The state dict holds {len(not_tensors)} value(s) that are not tensors where tensors are expected:"
            f" {shown}{', ...' if len(not_tensors) > 5 else ''}. A module state dict maps parameter and buffer"
            " names to tensors (and the names of extra states, `<module>._extra_state`, to any object)."
        )


def _child_path(path: str, key: Any) -> str:
    """The dotted path of the item ``key`` (any key of a dict, an index) of the container at ``path``.

    Not the core's ``_join`` of module names: this module is imported where Lightning is not (``lightning-fsdp
    inspect``), and a container's key may be empty or not a string.

    """
    return f"{path}.{key}" if path else str(key)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _out_of_bounds(path: Path, name: str, reason: str) -> CheckpointLoadError:
    return CheckpointLoadError(
        f"The file {str(path)!r} is corrupt: the tensor {name!r} cannot be read because {reason}. Re-copy or re-save"
        " the checkpoint."
    )
