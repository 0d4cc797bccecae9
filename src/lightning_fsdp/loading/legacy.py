"""Read the structure of a legacy-format ``torch.save`` file and where each storage's bytes are, not its data.

The legacy format (``_use_new_zipfile_serialization=False``) is a sequence of pickles (magic number, protocol, system
info, the object, the storage keys) followed by each storage's element count and bytes, in the order of the keys. The
pickles come first, so the structure and every storage's offset are known after reading a few kilobytes; each count
is checked against what the pickle says the storage holds, and every storage against the file's end.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import os
import struct
from pathlib import Path
from typing import Any

import torch

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.files import close_file, open_file, open_stream, read_exactly, require_regular_file
from lightning_fsdp.loading.torch_pickle import StorageBytes, TorchFileStructure, unpickler_class, unpickling_errors

_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
_COUNT = struct.Struct("<q")


def read_legacy_structure(path: Path, weights_only: bool) -> TorchFileStructure:
    """Unpickle a legacy-format file's object with tensors on the meta device, and locate its storages.

    Raises:
        CheckpointLoadError: If the file is unsafe (with ``weights_only``), corrupt or truncated.

    """
    info = require_regular_file(path)
    unpickler = unpickler_class(weights_only)
    roots: dict[str, torch.TypedStorage] = {}
    view_storages: dict[str, torch.TypedStorage] = {}
    views: dict[int, tuple[str, int, int]] = {}  # view storage -> (root key, byte offset in the root, bytes)

    def persistent_load(saved_id: Any) -> Any:
        kind = saved_id[0].decode("ascii") if isinstance(saved_id[0], bytes) else saved_id[0]
        if kind == "module" and not weights_only:
            return saved_id[1]
        if kind != "storage" or len(saved_id) != 6:
            raise CheckpointLoadError(f"The file {str(path)!r} names an unknown kind of persistent object {kind!r}.")
        storage_type, key, _location, numel, view_metadata = saved_id[1:]
        dtype = getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(numel, int) or numel < 0:
            raise CheckpointLoadError(f"The file {str(path)!r} describes the storage {key!r} inconsistently.")
        if key not in roots:
            roots[key] = _meta_storage(numel * dtype.itemsize, dtype)
        if view_metadata is None:
            return roots[key]
        view_key, offset, view_numel = view_metadata
        if view_key not in view_storages:
            view_storages[view_key] = _meta_storage(view_numel * dtype.itemsize, dtype)
            cdata = view_storages[view_key]._untyped_storage._cdata
            views[cdata] = (key, offset * dtype.itemsize, view_numel * dtype.itemsize)
        return view_storages[view_key]

    with unpickling_errors(path, weights_only), open_stream(path) as file:
        if isinstance(path, Path) and os.fstat(file.fileno()).st_ino != info.st_ino:
            raise CheckpointLoadError(f"The file {str(path)!r} was replaced while it was being opened. Try again.")
        if unpickler(file).load() != _MAGIC_NUMBER:
            raise CheckpointLoadError(f"The file {str(path)!r} is a pickle, but not a `torch.save` checkpoint.")
        for _ in range(2):  # protocol version, system info
            unpickler(file).load()
        object_unpickler = unpickler(file)
        object_unpickler.persistent_load = persistent_load
        content = object_unpickler.load()
        keys = unpickler(file).load()
        if not isinstance(keys, list) or set(keys) != set(roots) or len(keys) != len(roots):
            raise CheckpointLoadError(
                f"The file {str(path)!r} is corrupt: its list of storages does not match the storages its object uses."
            )
        position = file.tell()
    storages: dict[int, StorageBytes] = {}
    root_offsets: dict[str, int] = {}
    file = open_file(path)
    try:
        for key in keys:
            storage = roots[key]
            count = bytearray(_COUNT.size)
            read_exactly(file, position, memoryview(count), path, f"the size of storage {key!r}")
            (numel,) = _COUNT.unpack(count)
            nbytes = storage._untyped_storage.nbytes()
            if numel * storage.dtype.itemsize != nbytes:
                raise CheckpointLoadError(
                    f"The file {str(path)!r} is corrupt: the storage {key!r} holds {numel} elements, its pickle says"
                    f" {storage.size()}. Re-copy or re-save it."
                )
            position += _COUNT.size
            if position + nbytes > info.st_size:
                raise CheckpointLoadError(
                    f"The file {str(path)!r} could not be read as a `torch.save` checkpoint: it is truncated."
                    " Re-copy it."
                )
            storages[storage._untyped_storage._cdata] = StorageBytes(position, nbytes)
            root_offsets[key] = position
            position += nbytes
    finally:
        close_file(file)
    for cdata, (key, offset, nbytes) in views.items():
        root = roots[key]._untyped_storage.nbytes()
        if offset < 0 or offset + nbytes > root:
            raise CheckpointLoadError(f"The file {str(path)!r} is corrupt: a view lies outside its storage {key!r}.")
        storages[cdata] = StorageBytes(root_offsets[key] + offset, nbytes)
    return TorchFileStructure(path, content, storages)


def _meta_storage(nbytes: int, dtype: torch.dtype) -> torch.TypedStorage:
    untyped = torch.UntypedStorage(nbytes, device="meta")
    return torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
