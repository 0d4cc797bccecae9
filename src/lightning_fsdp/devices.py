# Copyright The lightning-fsdp developers.
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
"""The rank's own device on every node: checks that no two ranks of a node can end up on the same device.

A rank's device is ``parallel_devices[local_rank]``, so everything hinges on the local rank that the cluster
environment reports. When it is wrong (every process of a node reads local rank 0, for instance because a scheduler's
variables were read instead of the launcher's), every rank of the node silently selects ``cuda:0``. The helpers here
check, before a device is selected, that the ranks, the node count and the devices per node fit together and that no
two launchers describe the process differently; after the process group exists, that no two ranks share a logical
slot or a physical GPU; and after ``setup_module``, that no parameter or buffer lives on another rank's GPU. Both
:class:`lightning_fsdp.FSDPStrategy` (FSDP1) and :class:`lightning_fsdp.ModelParallelStrategy` (FSDP2, tensor
parallelism) run them; the messages name the strategy that refused.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import itertools
import os
import socket
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass

import torch
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from torch.nn import Module

from lightning_fsdp.layouts.targets import clean_name

_MAX_LISTED = 10
# Prefixes that Fabric's and `torch.compile`'s wrappers insert into parameter names (FSDP's and activation
# checkpointing's are removed by torch's `clean_tensor_name`); removed so that errors show the names the user knows.
_WRAPPER_PREFIXES = ("_forward_module.", "_orig_mod.")


@dataclass(frozen=True)
class _Launcher:
    """The variables through which a launcher tells a process where it stands."""

    name: str
    global_rank: str
    local_rank: str
    node_rank: str
    world_size: str

    def variables(self) -> tuple[str, ...]:
        return (self.global_rank, self.local_rank, self.node_rank, self.world_size)


_TORCHRUN = _Launcher("torchrun (also used by `fabric run`)", "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")
_SLURM = _Launcher("SLURM (`srun`)", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS")
_LAUNCHERS = (_TORCHRUN, _SLURM)


@dataclass(frozen=True)
class _Reading:
    """One value the strategy relies on, and where it came from."""

    label: str
    value: int
    source: str
    variable: str | None = None  # the environment variable it was read from, if any


def _check_cluster_environment(
    environment: ClusterEnvironment | None,
    parallel_devices: list[torch.device] | None,
    num_nodes: int,
    strategy: str = "FSDPStrategy",
) -> None:
    """Check that the cluster environment gives this process a rank and a device that no other process can have.

    Run it before the device is selected (``torch.cuda.set_device``) and before the process group is joined. The
    checks are: local rank within the devices of a node, node rank within the nodes, ``global rank = node rank x
    devices per node + local rank``, ``world size = nodes x devices per node``, the CUDA device index within the
    visible devices, and, when the variables of another launcher describe the same processes, that they agree.

    Args:
        environment: The strategy's cluster environment.
        parallel_devices: The devices of one node, indexed by local rank.
        num_nodes: The number of nodes given to ``Fabric(num_nodes=...)``.
        strategy: The name of the strategy that runs the check, for the message.

    Raises:
        RuntimeError: If any check fails. The message lists every failed check, the values read and the environment
            variables they were read from, and how to fix the launch.

    """
    if environment is None or not parallel_devices:
        return
    readings = _read_environment(environment, parallel_devices, num_nodes)
    if not all(isinstance(reading.value, int) for reading in readings):
        # An environment that reports no integer ranks (a test double) gives nothing to check: upstream uses them as is.
        return
    global_rank, local_rank, node_rank, world_size, per_node, nodes = (reading.value for reading in readings)
    problems = []
    if not 0 <= local_rank < per_node:
        problems.append(f"local rank {local_rank} is not in 0..{per_node - 1} ({per_node} devices per node)")
    if not 0 <= node_rank < nodes:
        problems.append(f"node rank {node_rank} is not in 0..{nodes - 1} ({nodes} nodes)")
    expected_rank = node_rank * per_node + local_rank
    if global_rank != expected_rank:
        problems.append(
            f"global rank {global_rank} != node rank {node_rank} x {per_node} devices per node + local rank"
            f" {local_rank} = {expected_rank}"
        )
    if world_size != nodes * per_node:
        problems.append(f"world size {world_size} != {nodes} nodes x {per_node} devices per node = {nodes * per_node}")
    if 0 <= local_rank < per_node:
        problems.extend(_device_problems(parallel_devices[local_rank]))
    contradictions = _launcher_contradictions(environment, readings)
    if not problems and not contradictions:
        return
    raise RuntimeError(_environment_error(strategy, environment, readings, problems, contradictions))


def _read_environment(
    environment: ClusterEnvironment, parallel_devices: list[torch.device], num_nodes: int
) -> tuple[_Reading, ...]:
    """Read global rank, local rank, node rank, world size, devices per node and nodes, each with its source."""
    name = type(environment).__name__
    methods = ("global_rank", "local_rank", "node_rank", "world_size")
    if isinstance(environment, TorchElasticEnvironment | SLURMEnvironment):
        launcher = _TORCHRUN if isinstance(environment, TorchElasticEnvironment) else _SLURM
        variables: list[str | None] = list(launcher.variables())
        sources = [_variable(var) for var in launcher.variables()]
    elif isinstance(environment, LightningEnvironment):
        node_variable = "NODE_RANK" if "NODE_RANK" in os.environ else "GROUP_RANK"
        variables = [None, "LOCAL_RANK", node_variable, None]
        sources = [
            "computed by Fabric: node rank x devices per node + local rank",
            f"{_variable('LOCAL_RANK')}, else 0",
            f"{_variable(node_variable)}, else 0",
            "computed by Fabric: nodes x devices per node",
        ]
    else:
        variables = [None] * 4
        sources = [f"`{name}.{method}()`" for method in methods]
    values = [getattr(environment, method)() for method in methods]
    devices = ", ".join(str(device) for device in parallel_devices)
    return (
        *(
            _Reading(label, value, source, variable)
            for label, value, source, variable in zip(
                ("global rank", "local rank", "node rank", "world size"), values, sources, variables, strict=True
            )
        ),
        _Reading("devices per node", len(parallel_devices), f"`Fabric(devices=...)`: {devices}"),
        _Reading("nodes", num_nodes, "`Fabric(num_nodes=...)`"),
    )


def _variable(name: str) -> str:
    value = os.environ.get(name)
    return f"{name} unset" if value is None else f"{name}={value}"


def _device_problems(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return []
    count = torch.cuda.device_count()
    if device.index is not None and 0 <= device.index < count:
        return []
    return [
        f"device {device} is not one of the {count} visible CUDA devices"
        f" ({_variable('CUDA_VISIBLE_DEVICES')}): it must be in cuda:0..cuda:{count - 1}"
    ]


def _launcher_contradictions(environment: ClusterEnvironment, readings: tuple[_Reading, ...]) -> list[str]:
    """Compare the values the environment gave with those of every other launcher whose variables are set.

    A launcher's variables describe the same processes as the environment when its world size equals the environment's
    (``srun --ntasks-per-node=1 torchrun ...`` sets ``SLURM_NTASKS`` to the number of nodes, not of processes: then
    SLURM's variables describe the launchers and are ignored). Variables that the environment itself read are skipped.

    """
    if isinstance(environment, SLURMEnvironment) or SLURMEnvironment.job_name() in ("bash", "interactive"):
        # In an interactive SLURM session, SLURM's variables describe the shell, not the processes.
        launchers = [launcher for launcher in _LAUNCHERS if launcher is not _SLURM]
    else:
        launchers = list(_LAUNCHERS)
    if isinstance(environment, TorchElasticEnvironment):
        launchers = [launcher for launcher in launchers if launcher is not _TORCHRUN]
    world_size = readings[3].value
    contradictions = []
    for launcher in launchers:
        if _int_variable(launcher.world_size) != world_size:
            continue
        for reading, variable in zip(readings[:3], launcher.variables()[:3], strict=True):
            value = _int_variable(variable)
            if value is None or value == reading.value or variable == reading.variable:
                continue
            contradictions.append(
                f"{launcher.name} says {reading.label} {value} ({variable}={value}), but `{type(environment).__name__}`"
                f" read {reading.value} ({reading.source})"
            )
    return contradictions


def _int_variable(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    try:
        return int(value)
    except ValueError:
        return None


def _environment_error(
    strategy: str,
    environment: ClusterEnvironment,
    readings: tuple[_Reading, ...],
    problems: list[str],
    contradictions: list[str],
) -> str:
    name = type(environment).__name__
    width = max(len(reading.label) for reading in readings)
    lines = [
        f"`{strategy}.setup_environment` refuses to select a device for this process: the cluster environment is"
        " inconsistent, and going on would put several ranks of a node on the same device (typically `cuda:0`).",
        "",
        "Problems:",
        *(f"  - {problem}" for problem in [*problems, *contradictions]),
        "",
        f"Values read by `{name}`:",
        *(f"  {reading.label:<{width}}  {reading.value:<4} ({reading.source})" for reading in readings),
    ]
    others = [
        f"  {launcher.name}: " + ", ".join(_variable(var) for var in launcher.variables())
        for launcher in _LAUNCHERS
        if any(var in os.environ for var in launcher.variables())
    ]
    if others:
        lines += ["", "Launcher variables set in this process:", *others]
    lines += ["", "HINT:"]
    if "TORCHELASTIC_RUN_ID" in os.environ and not isinstance(environment, TorchElasticEnvironment):
        lines.append(
            f"  - torchrun started this process (`TORCHELASTIC_RUN_ID` is set), but Fabric reads `{name}`: let Fabric"
            " read torchrun's variables with `Fabric(plugins=[TorchElasticEnvironment()])`."
        )
    if contradictions:
        lines.append(
            "  - Two launchers describe this process differently. Start each process with one of them: either let SLURM"
            " start one task per device (`srun --ntasks-per-node=<devices>` running the script, no torchrun), or one"
            " task per node that runs `torchrun`/`fabric run` (`srun --ntasks-per-node=1`). To choose explicitly, pass"
            " the environment: `Fabric(plugins=[TorchElasticEnvironment()])` or `Fabric(plugins=[SLURMEnvironment()])`."
        )
    if problems:
        lines.append(
            "  - Make `Fabric(devices=..., num_nodes=...)` match the launch: `devices` is the number of processes per"
            " node (`--nproc-per-node`, `--devices`, `--ntasks-per-node`) and `num_nodes` the number of nodes"
            " (`--nnodes`, `--num-nodes`, `--nodes`); give each node its own node rank (`--node-rank`), and check"
            " `CUDA_VISIBLE_DEVICES` on every node."
        )
    return "\n".join(lines)


def _check_distinct_devices(
    global_rank: int,
    node_rank: int,
    local_rank: int,
    device: torch.device,
    world_size: int,
    strategy: str = "FSDPStrategy",
) -> None:
    """Check, across all ranks, that no two share a (node rank, local rank) slot or a physical CUDA device.

    A collective: every rank must call it, after the default process group was initialized. Every rank raises the
    same error, so no rank is left waiting.

    Args:
        global_rank: This process's global rank.
        node_rank: This process's node rank.
        local_rank: This process's local rank.
        device: The device this process selected.
        world_size: The number of processes.
        strategy: The name of the strategy that runs the check, for the message.

    Raises:
        RuntimeError: If two ranks share a slot or a GPU. The message names the ranks and what they share.

    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized() or world_size < 2:
        return
    mine = (global_rank, node_rank, local_rank, str(device), _physical_device(device))
    everyone: list[tuple | None] = [None] * world_size
    torch.distributed.all_gather_object(everyone, mine)
    slots: dict[tuple[int, int], list[int]] = {}
    gpus: dict[str, list[tuple[int, str]]] = {}
    for rank, node, local, selected, physical in (entry for entry in everyone if entry is not None):
        slots.setdefault((node, local), []).append(rank)
        if physical is not None:
            gpus.setdefault(physical, []).append((rank, selected))
    problems = [
        f"ranks {ranks} all report node rank {node} and local rank {local}"
        for (node, local), ranks in sorted(slots.items())
        if len(ranks) > 1
    ]
    problems += [
        f"ranks {[rank for rank, _ in users]} all use the same physical GPU {physical}"
        f" (selected as {', '.join(sorted({selected for _, selected in users}))})"
        for physical, users in sorted(gpus.items())
        if len(users) > 1
    ]
    if problems:
        raise RuntimeError(
            f"`{strategy}.setup_environment` found ranks that share a device:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
            + "\nHINT: every process of a node needs its own local rank (`LOCAL_RANK`, `SLURM_LOCALID`) and its own"
            " GPU. Launch one process per device with `fabric run`, `torchrun` or `srun --ntasks-per-node=<devices>`,"
            " and do not give the processes of one node different `CUDA_VISIBLE_DEVICES` that overlap."
        )


def _physical_device(device: torch.device) -> str | None:
    """Identify a CUDA device across processes (host and UUID), whatever ``CUDA_VISIBLE_DEVICES`` each one has."""
    if device.type != "cuda":
        return None
    properties = torch.cuda.get_device_properties(device)
    return f"{socket.gethostname()}/{getattr(properties, 'uuid', device.index)}"


def _check_placement(module: Module, device: torch.device, where: str, strategy: str = "FSDPStrategy") -> None:
    """Check that no parameter or buffer of ``module`` lives on a CUDA device other than ``device``.

    CPU tensors (``cpu_offload``, models not moved yet) and meta tensors are allowed. A ``DTensor`` (FSDP2, tensor
    parallelism) is checked by this rank's local shard: its ``.device`` is the device of its local tensor, not only the
    device type of its mesh.

    Args:
        module: The module to check, wrapped, sharded or not.
        device: The rank's own device.
        where: Says when the check ran, for the message (``"before wrapping"``, ``"after wrapping"``).
        strategy: The name of the strategy that runs the check, for the message.

    Raises:
        RuntimeError: Naming the misplaced tensors, their device and the likely causes.

    """
    if not any(_misplaced(tensor, device) for tensor in itertools.chain(module.parameters(), module.buffers())):
        return
    misplaced = [(name, tensor.device) for name, tensor in _named_tensors(module) if _misplaced(tensor, device)]
    listed = [f"  {name} on {tensor_device}" for name, tensor_device in misplaced[:_MAX_LISTED]]
    if len(misplaced) > _MAX_LISTED:
        listed.append(f"  ... and {len(misplaced) - _MAX_LISTED} more")
    raise RuntimeError(
        f"`{strategy}.setup_module` found {len(misplaced)} parameter(s) or buffer(s) {where} on a CUDA device that"
        f" is not this rank's own ({device}):\n"
        + "\n".join(listed)
        + "\nLikely causes: a device hard-coded in the model (`device='cuda:0'`, `.cuda(0)`, `.to('cuda:0')`), or a"
        " checkpoint loaded with `torch.load` without `map_location` (its tensors go back to the device they were"
        " saved from)."
        "\nHINT: create the model inside `fabric.init_module()` and tensors with `device=fabric.device`, and load"
        " checkpoints with `fabric.load_raw(path, model)` or `torch.load(path, map_location='cpu')`."
    )


def _misplaced(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == "cuda" and tensor.device != device


def _named_tensors(module: Module) -> Iterator[tuple[str, torch.Tensor]]:
    named: Iterable[tuple[str, torch.Tensor]] = (*module.named_parameters(), *module.named_buffers())
    for name, tensor in named:
        yield _clean_name(name), tensor


def _clean_name(name: str) -> str:
    name = clean_name(name)
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def own_device_context(device: torch.device) -> AbstractContextManager:
    """Make the rank's own GPU the current device, so that tensors created on ``"cuda"`` land there.

    Launching already calls ``torch.cuda.set_device`` on the rank's device; this keeps ``init_module`` right where
    something (a library, a user's code) changed the current device since.

    """
    return torch.cuda.device(device) if device.type == "cuda" else ExitStack()


def on_own_device(device: torch.device, context: AbstractContextManager) -> AbstractContextManager:
    """``context`` (a strategy's ``module_init_context``) entered with the rank's own GPU current."""
    stack = ExitStack()
    stack.enter_context(own_device_context(device))
    stack.enter_context(context)
    return stack
