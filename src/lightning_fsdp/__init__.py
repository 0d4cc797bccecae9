"""lightning-fsdp: memory-bounded, device-correct checkpoint loading for Lightning Fabric's ``FSDPStrategy``.

The public names are imported on first use (:pep:`562`), so that ``lightning-fsdp inspect``, which reads only the
file's structure, does not pay for importing Lightning and torch's FSDP modules. ``from lightning_fsdp import
FSDPStrategy`` and ``lightning_fsdp.FSDPStrategy`` work as they would with eager imports.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from lightning_fsdp._versions import _check_supported_versions

_check_supported_versions()

from lightning_fsdp.__about__ import __version__  # noqa: E402

if TYPE_CHECKING:
    from lightning_fsdp.loading.convert import convert_checkpoint
    from lightning_fsdp.loading.errors import (
        CheckpointKeyError,
        CheckpointLoadError,
        CheckpointPathError,
        CheckpointValueError,
    )
    from lightning_fsdp.model_parallel import ModelParallelStrategy
    from lightning_fsdp.opt_in import disable, enable, is_enabled
    from lightning_fsdp.strategy import FSDPStrategy

#: Each public name and the module that defines it.
_PUBLIC = {
    "CheckpointKeyError": "lightning_fsdp.loading.errors",
    "CheckpointLoadError": "lightning_fsdp.loading.errors",
    "CheckpointPathError": "lightning_fsdp.loading.errors",
    "CheckpointValueError": "lightning_fsdp.loading.errors",
    "FSDPStrategy": "lightning_fsdp.strategy",
    "ModelParallelStrategy": "lightning_fsdp.model_parallel",
    "convert_checkpoint": "lightning_fsdp.loading.convert",
    "disable": "lightning_fsdp.opt_in",
    "enable": "lightning_fsdp.opt_in",
    "is_enabled": "lightning_fsdp.opt_in",
}

__all__ = [
    "CheckpointKeyError",
    "CheckpointLoadError",
    "CheckpointPathError",
    "CheckpointValueError",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "__version__",
    "convert_checkpoint",
    "disable",
    "enable",
    "is_enabled",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later look-ups find it without calling this again
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
