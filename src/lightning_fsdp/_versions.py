"""Checks that the installed ``lightning`` and ``torch`` are releases this package is tested with."""

import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

from lightning_fsdp.__about__ import _SUPPORTED_LIGHTNING, _SUPPORTED_TORCH


def _check_supported_versions() -> None:
    for package, (minimum, bound) in (("lightning", _SUPPORTED_LIGHTNING), ("torch", _SUPPORTED_TORCH)):
        try:
            installed = Version(version(package))
        except PackageNotFoundError:
            raise ImportError(
                f"`lightning_fsdp` needs `{package}>={minimum},<{bound}`, but `{package}` is not installed."
                f" Install it with `pip install '{package}>={minimum},<{bound}'`."
            ) from None
        if installed.release < Version(minimum).release:
            raise ImportError(
                f"`lightning_fsdp` needs `{package}>={minimum}`, found {package}=={installed}."
                f" Upgrade it with `pip install -U '{package}>={minimum},<{bound}'`."
            )
        if installed.release >= Version(bound).release:
            warnings.warn(
                f"`lightning_fsdp` is tested with `{package}>={minimum},<{bound}`, found {package}=={installed}."
                " It may work, but it relies on FSDP internals that can change between releases.",
                stacklevel=3,
            )
