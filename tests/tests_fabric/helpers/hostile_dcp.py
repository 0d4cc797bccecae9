"""Turn a sharded checkpoint that ``fabric.save`` wrote into a hostile or broken one, as an attacker or bad copy would.

Each function rewrites the files of a checkpoint directory in place, in the format torch's reader expects, so only
the one thing that the test is about is wrong.
"""

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)


def read_metadata(path: Path) -> Metadata:
    with open(path / ".metadata", "rb") as file:
        return pickle.load(file)


def write_metadata(path: Path, metadata: Any) -> None:
    with open(path / ".metadata", "wb") as file:
        pickle.dump(metadata, file)


def copy_checkpoint(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def replace_entry(path: Path, fqn: str, value: Any) -> None:
    """Store ``value`` under ``fqn``: a tensor as one chunk, anything else as a non-tensor (bytes) entry."""
    metadata = read_metadata(path)
    shard = path / "__0_0.distcp"
    offset = shard.stat().st_size
    with open(shard, "ab") as file:
        torch.save(value, file)
    length = shard.stat().st_size - offset
    for index in [index for index in metadata.storage_data if index.fqn == fqn]:
        del metadata.storage_data[index]
    if isinstance(value, torch.Tensor):
        origin = torch.Size([0] * value.dim())
        chunk = ChunkStorageMetadata(offsets=origin, sizes=value.size())
        metadata.state_dict_metadata[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=value.dtype), value.size(), [chunk]
        )
        index = MetadataIndex(fqn, origin)
    else:
        metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
        index = MetadataIndex(fqn)
    metadata.storage_data[index] = _StorageInfo(shard.name, offset, length)
    write_metadata(path, metadata)


def corrupt_entry(path: Path, fqn: str) -> None:
    """Overwrite the bytes of ``fqn``'s first chunk with zeros: the file keeps its size, the entry is unreadable."""
    metadata = read_metadata(path)
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
    with open(path / info.relative_path, "r+b") as file:
        file.seek(info.offset)
        file.write(bytes(info.length))


def truncate_shard(path: Path, name: str = "__0_0.distcp") -> None:
    shard = path / name
    with open(shard, "r+b") as file:
        file.truncate(shard.stat().st_size // 2)


def replace_with_fifo(file: Path) -> None:
    file.unlink()
    os.mkfifo(file)
