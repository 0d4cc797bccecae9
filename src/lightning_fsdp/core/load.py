# Copyright The Lightning AI team.
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
"""Reading raw module state dicts lazily: torch files, safetensors files and Hugging Face sharded checkpoints.

Destination: ``src/lightning/fabric/utilities/load.py`` (module-level functions).
"""

import json
import math
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from lightning_utilities.core.imports import RequirementCache
from torch import Tensor

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, _load
from lightning.fabric.utilities.load import _NotYetLoadedTensor
from lightning.fabric.utilities.types import _PATH

_SAFETENSORS_AVAILABLE = RequirementCache("safetensors")


def _is_safetensors_file(path: _PATH) -> bool:
    """Whether ``path`` is a safetensors file, told from its header (an 8-byte length, then a JSON object)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as file:
        head = file.read(9)
    if len(head) < 9:
        return False
    header_size = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and header_size <= path.stat().st_size - 8


def _find_hf_index(path: _PATH) -> Optional[Path]:
    """The Hugging Face index of a sharded checkpoint: ``path`` itself (``*.index.json``) or the one in its folder."""
    path = Path(path)
    if path.is_file():
        return path if path.name.endswith(".index.json") else None
    if not path.is_dir():
        return None
    indexes = sorted(path.glob("*.index.json"))
    if len(indexes) > 1:
        names = ", ".join(index.name for index in indexes)
        raise ValueError(f"The folder {str(path)!r} holds several checkpoint indexes ({names}). Pass one of them.")
    return indexes[0] if indexes else None


def _is_raw_checkpoint_file(path: _PATH) -> bool:
    """Whether ``path`` is a checkpoint that only a raw module state dict can be: safetensors or a sharded index."""
    return _is_safetensors_file(path) or _find_hf_index(path) is not None


def _lazy_load_state_dict(path: _PATH, weights_only: Optional[bool] = None) -> Mapping[str, Any]:
    """Open a checkpoint file without reading its tensors into memory.

    A ``torch.save`` file is memory-mapped (tensors are read where they are touched), a ``.safetensors`` file and the
    shards of a Hugging Face index are opened with :func:`safetensors.safe_open` (values are slices that read what
    they are indexed with), and the ``.bin`` shards of an index are memory-mapped. A ``torch.save`` file in the legacy
    (non-zip) format and a file in object storage cannot be memory-mapped and are read whole. ``weights_only`` is passed
    to :func:`torch.load`.

    """
    if not _is_local_file_protocol(path):
        # object storage cannot be memory-mapped: the file is read whole (see `_is_mmappable`)
        return _load(path, map_location="cpu", weights_only=weights_only)
    index = _find_hf_index(path)
    if index is not None:
        return _ShardedStateDict(index, weights_only)
    if _is_safetensors_file(path):
        return _SafetensorsStateDict(path)
    # the legacy format cannot be memory-mapped: it is read whole (see `_is_mmappable`)
    mmap = zipfile.is_zipfile(path)
    return torch.load(path, mmap=mmap, map_location="cpu", weights_only=weights_only)


def _is_mmappable(path: _PATH) -> bool:
    """Whether :func:`_lazy_load_state_dict` reads ``path`` lazily (a legacy-format torch file has to be read whole)."""
    if not _is_local_file_protocol(path):
        return False
    return _find_hf_index(path) is not None or _is_safetensors_file(path) or zipfile.is_zipfile(path)


class _SafetensorsStateDict(Mapping):
    """The tensors of a ``.safetensors`` file by name, each a slice object that reads only what it is indexed with."""

    def __init__(self, path: _PATH) -> None:
        if not _SAFETENSORS_AVAILABLE:
            raise ModuleNotFoundError(
                f"Loading {str(path)!r} requires the `safetensors` package: {_SAFETENSORS_AVAILABLE.message}"
            )
        from safetensors import safe_open

        self._file = safe_open(str(path), framework="pt", device="cpu")
        self._keys = list(self._file.keys())

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self._file.get_slice(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class _ShardedStateDict(Mapping):
    """The tensors of a Hugging Face sharded checkpoint by name, opened lazily shard by shard."""

    def __init__(self, index: Path, weights_only: Optional[bool]) -> None:
        with open(index) as file:
            weight_map = json.load(file).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"The index {str(index)!r} has no `weight_map`: it is not a Hugging Face index.")
        folder = index.parent.resolve()
        for shard in set(weight_map.values()):
            if not (folder / shard).resolve().is_relative_to(folder):
                raise ValueError(f"The index {str(index)!r} names a shard outside its folder: {shard!r}.")
        self._weight_map = weight_map
        self._folder = folder
        self._weights_only = weights_only
        self._shards: dict[str, Mapping[str, Any]] = {}

    def __getitem__(self, key: str) -> Any:
        shard = self._weight_map[key]
        if shard not in self._shards:
            self._shards[shard] = _lazy_load_state_dict(self._folder / shard, self._weights_only)
        return self._shards[shard][key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)


def _shape_of(value: Any) -> torch.Size:
    """The shape of a tensor or of a safetensors slice."""
    return value.shape if isinstance(value, Tensor) else torch.Size(value.get_shape())


def _read_flat(value: Any, start: int, stop: int) -> Tensor:
    """Elements ``start:stop`` of the flattened tensor, reading only the rows that hold them from a lazy source."""
    if isinstance(value, Tensor):
        return value.reshape(-1)[start:stop]
    shape = _shape_of(value)
    if len(shape) == 0:
        return value[...].reshape(-1)[start:stop]
    row = math.prod(shape[1:])
    first, last = start // row, -(-stop // row) if row else 0
    rows = value[first:last].reshape(-1)
    return rows[start - first * row : stop - first * row]


def _read_box(value: Any, box: tuple[slice, ...]) -> Tensor:
    """The sub-tensor ``value[box]``, reading only what it holds from a lazy source."""
    return value[box] if box else value[...]


def _is_raw_state_dict(checkpoint: Mapping[str, Any]) -> bool:
    """Whether a checkpoint is a module state dict alone (``torch.save(model.state_dict())``): every value a tensor."""
    return bool(checkpoint) and all(isinstance(value, (Tensor, _NotYetLoadedTensor)) for value in checkpoint.values())
