"""The environment variables that launchers, cluster schedulers and Fabric set, in one place."""

import os
from collections.abc import Mapping

#: What torchrun, Fabric's launcher and `fabric run` set for each rank.
LAUNCHER_VARIABLES = frozenset(
    {"GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RANK", "ROLE_RANK"}
    | {"WORLD_SIZE"}
)
#: Prefixes of the variables of schedulers and of Lightning itself.
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PL_", "LT_", "OMPI_", "PMI_", "LSB_", "JSM_")


def without_launcher_variables(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A copy of ``environ`` for a process that must start as a user's fresh job, not as a rank of this one."""
    return {
        name: value
        for name, value in environ.items()
        if name not in LAUNCHER_VARIABLES and not name.startswith(LAUNCHER_PREFIXES)
    }
