"""lightning-fsdp: memory-bounded, device-correct checkpoint loading for Lightning Fabric's ``FSDPStrategy``."""

from typing import Any

from lightning_fsdp._versions import _check_supported_versions

_check_supported_versions()

from lightning_fsdp.__about__ import __version__  # noqa: E402
from lightning_fsdp.loading.errors import CheckpointLoadError, CheckpointPathError  # noqa: E402
from lightning_fsdp.model_parallel import ModelParallelStrategy  # noqa: E402
from lightning_fsdp.opt_in import disable, enable, is_enabled  # noqa: E402
from lightning_fsdp.strategy import FSDPStrategy  # noqa: E402


def __getattr__(name: str) -> Any:
    # `convert_checkpoint` needs torch's distributed checkpoint package, which cannot be imported where
    # `torch.distributed` is unavailable: it is imported on first use.
    if name == "convert_checkpoint":
        from lightning_fsdp.loading.convert import convert_checkpoint

        return convert_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointLoadError",
    "CheckpointPathError",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "__version__",
    "convert_checkpoint",
    "disable",
    "enable",
    "is_enabled",
]
