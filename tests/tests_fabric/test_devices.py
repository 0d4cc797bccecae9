"""The device each rank selects, and the checks that keep the ranks of a node off each other's device.

No GPU exists on the machines that run this suite, so CUDA is mocked here: ``torch.cuda.device_count`` and
``torch.cuda.is_available`` report two GPUs, ``torch.cuda.set_device`` records the device instead of selecting it, and
joining the process group is skipped. What is tested is the device each rank *would* select and that an inconsistent
environment is refused *before* any device is selected. The standalone tests in ``test_two_nodes.py`` check the same
on real GPUs.
"""

import os
from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment
from torch import nn

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.devices import (
    _check_cluster_environment,
    _check_distinct_devices,
    _check_placement,
    _own_cuda_device,
)
from tests.tests_fabric.helpers.distributed import run_distributed

# Node rank 1 of 2 nodes x 2 GPUs, local rank 1: global rank 3, device cuda:1.
_TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "test",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
    "ROLE_RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
}
_SLURM = {
    "SLURM_JOB_NAME": "train",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_NNODES": "2",
}
_LAUNCH_VARIABLES = (
    *_TORCHRUN,
    *_SLURM,
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "LT_CLI_USED",
    "SLURM_JOB_ID",
)


@pytest.fixture
def launch_env(monkeypatch):
    """Start from an environment without any launcher's variables; return a function that sets some."""
    for name in _LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")

    def set_env(*variables: dict[str, str]) -> None:
        for group in variables:
            for name, value in group.items():
                monkeypatch.setenv(name, value)

    return set_env


@pytest.fixture
def mocked_cuda():
    """Two mocked GPUs; ``set_device`` is recorded, the process group is not joined (see the module docstring)."""
    with ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.device_count", return_value=2))
        stack.enter_context(mock.patch("torch.cuda.is_available", return_value=True))
        stack.enter_context(mock.patch("lightning.fabric.accelerators.cuda._check_cuda_matmul_precision"))
        stack.enter_context(mock.patch.object(FSDPStrategy, "_setup_distributed"))
        yield stack.enter_context(mock.patch("torch.cuda.set_device"))


def _cuda_fabric(**kwargs) -> Fabric:
    return Fabric(accelerator="cuda", devices=2, num_nodes=2, strategy=FSDPStrategy(), **kwargs)


@pytest.mark.parametrize(
    ("variables", "environment"),
    [
        pytest.param([_TORCHRUN], TorchElasticEnvironment, id="torchrun"),
        pytest.param([_SLURM], SLURMEnvironment, id="slurm"),
        pytest.param([_TORCHRUN, _SLURM], TorchElasticEnvironment, id="torchrun-and-slurm"),
    ],
)
def test_node_rank_1_selects_its_local_rank_device(launch_env, mocked_cuda, variables, environment):
    launch_env(*variables)
    fabric = _cuda_fabric()
    assert type(fabric.strategy.cluster_environment) is environment
    fabric.strategy.setup_environment()
    assert (fabric.global_rank, fabric.node_rank, fabric.local_rank, fabric.world_size) == (3, 1, 1, 4)
    assert fabric.device == torch.device("cuda", 1)
    mocked_cuda.assert_called_once_with(torch.device("cuda", 1))


def test_torchrun_under_one_slurm_task_per_node_is_fine(launch_env, mocked_cuda):
    """``srun --ntasks-per-node=1 torchrun ...``: SLURM's variables describe the launchers (2 tasks), not the ranks."""
    launch_env(_TORCHRUN, {**_SLURM, "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"})
    launch_env({"SLURM_NTASKS_PER_NODE": "1"})
    fabric = _cuda_fabric()
    fabric.strategy.setup_environment()
    mocked_cuda.assert_called_once_with(torch.device("cuda", 1))


def test_contradicting_torchrun_and_slurm_variables_raise(launch_env, mocked_cuda):
    """Both launchers describe four processes, but disagree about which one this is: no device may be chosen."""
    launch_env(_TORCHRUN, {**_SLURM, "SLURM_PROCID": "2", "SLURM_LOCALID": "0"})
    fabric = _cuda_fabric()
    with pytest.raises(RuntimeError, match="refuses to select a device") as error:
        fabric.strategy.setup_environment()
    message = str(error.value)
    assert "SLURM (`srun`) says local rank 0 (SLURM_LOCALID=0), but `TorchElasticEnvironment` read 1" in message
    assert "global rank 2 (SLURM_PROCID=2)" in message
    assert "LOCAL_RANK=1" in message
    assert "Fabric(plugins=[TorchElasticEnvironment()])" in message
    mocked_cuda.assert_not_called()


def test_slurm_variables_preferred_over_torchrun_raise(launch_env, mocked_cuda):
    """The original cause: SLURM's variables read inside torchrun's processes, so a node's ranks all read local rank 0.

    With one SLURM task per node running torchrun, every process of node 1 reads ``SLURM_LOCALID=0`` and
    ``SLURM_PROCID=1``, and would select ``cuda:0``.

    """
    launch_env(_TORCHRUN, {**_SLURM, "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"})
    launch_env({"SLURM_NTASKS_PER_NODE": "1"})
    fabric = _cuda_fabric(plugins=[SLURMEnvironment()])
    assert fabric.device == torch.device("cuda", 0)  # the pile-up that the check refuses
    with pytest.raises(RuntimeError, match="refuses to select a device") as error:
        fabric.strategy.setup_environment()
    message = str(error.value)
    assert "global rank 1 != node rank 1 x 2 devices per node + local rank 0 = 2" in message
    assert "world size 2 != 2 nodes x 2 devices per node = 4" in message
    assert "(SLURM_LOCALID=0)" in message
    assert "torchrun started this process" in message
    mocked_cuda.assert_not_called()


@pytest.mark.parametrize(("rank", "fails"), [("2", False), ("3", True)])
def test_every_rank_of_a_node_reading_local_rank_0_raises(launch_env, mocked_cuda, rank, fails):
    """A launcher that sets ``RANK`` but ``LOCAL_RANK=0`` for every process of node 1: rank 3 would take cuda:0."""
    launch_env({"RANK": rank, "LOCAL_RANK": "0", "NODE_RANK": "1", "WORLD_SIZE": "4"})
    fabric = _cuda_fabric()
    assert type(fabric.strategy.cluster_environment) is LightningEnvironment
    if not fails:
        fabric.strategy.setup_environment()
        mocked_cuda.assert_called_once_with(torch.device("cuda", 0))
        return
    with pytest.raises(RuntimeError, match=r"torchrun .* says global rank 3 \(RANK=3\), but `LightningEnvironment`"):
        fabric.strategy.setup_environment()
    mocked_cuda.assert_not_called()


def test_world_size_not_nodes_times_devices_raises(launch_env, mocked_cuda):
    launch_env(_TORCHRUN, {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "2"})
    fabric = _cuda_fabric()
    with pytest.raises(RuntimeError, match="refuses to select a device") as error:
        fabric.strategy.setup_environment()
    message = str(error.value)
    assert "node rank 2 is not in 0..1 (2 nodes)" in message
    assert "world size 8 != 2 nodes x 2 devices per node = 4" in message
    assert "world size        8    (WORLD_SIZE=8)" in message
    assert "`num_nodes` the number of nodes" in message
    mocked_cuda.assert_not_called()


def test_device_index_beyond_the_visible_devices_raises(launch_env, monkeypatch):
    """``Fabric(devices=2)`` on a node that sees one GPU: local rank 1 would ask for a device that does not exist."""
    launch_env({"LOCAL_RANK": "1", "NODE_RANK": "1"})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    environment = LightningEnvironment()
    environment.set_global_rank(3)
    environment.set_world_size(4)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    with mock.patch("torch.cuda.device_count", return_value=1), pytest.raises(RuntimeError) as error:
        _check_cluster_environment(environment, devices, num_nodes=2)
    assert "device cuda:1 is not one of the 1 visible CUDA devices (CUDA_VISIBLE_DEVICES=3)" in str(error.value)


def test_local_rank_beyond_the_devices_per_node_raises(launch_env):
    launch_env({"LOCAL_RANK": "2"})
    environment = LightningEnvironment()
    environment.set_global_rank(2)
    environment.set_world_size(2)
    with pytest.raises(RuntimeError, match=r"local rank 2 is not in 0..1 \(2 devices per node\)"):
        _check_cluster_environment(environment, [torch.device("cpu")] * 2, num_nodes=1)


def test_a_consistent_cpu_environment_passes(launch_env):
    launch_env({"LOCAL_RANK": "1", "NODE_RANK": "1"})
    environment = LightningEnvironment()
    environment.set_global_rank(3)
    environment.set_world_size(4)
    _check_cluster_environment(environment, [torch.device("cpu")] * 2, num_nodes=2)
    _check_cluster_environment(None, None, num_nodes=2)  # nothing to check before Fabric configured the strategy


def _claim_the_same_slot() -> list[str]:
    """Two processes that both report node rank 0, local rank 0, and (mocked) the same physical GPU."""
    rank = int(os.environ["NODE_RANK"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    messages = []
    try:
        _check_distinct_devices(rank, node_rank=0, local_rank=0, device=torch.device("cpu"), world_size=2)
    except RuntimeError as error:
        messages.append(str(error))
    with mock.patch("lightning_fsdp.devices._physical_device", return_value="host/GPU-0"):
        try:
            _check_distinct_devices(rank, node_rank=rank, local_rank=0, device=torch.device("cpu"), world_size=2)
        except RuntimeError as error:
            messages.append(str(error))
    _check_distinct_devices(rank, node_rank=rank, local_rank=0, device=torch.device("cpu"), world_size=2)
    return messages


def test_ranks_sharing_a_slot_or_a_gpu_all_raise():
    results = run_distributed(_claim_the_same_slot, devices=1, num_nodes=2, timeout=60)
    assert results[0] == results[1], "every rank raises the same error, so none is left waiting"
    same_slot, same_gpu = results[0]
    assert "ranks [0, 1] all report node rank 0 and local rank 0" in same_slot
    assert "ranks [0, 1] all use the same physical GPU host/GPU-0" in same_gpu


def _fake_module(**tensors: torch.device) -> SimpleNamespace:
    named = [(name.replace("__", "."), SimpleNamespace(device=device)) for name, device in tensors.items()]
    return SimpleNamespace(named_parameters=lambda: named[:-1], named_buffers=lambda: named[-1:])


def test_placement_check_names_tensors_on_another_gpu():
    # Tensors on CUDA cannot be created without a GPU; the check only reads ``.device``, so stand-ins carry one.
    module = _fake_module(
        _fsdp_wrapped_module__head__weight=torch.device("cuda", 0),
        embedding__weight=torch.device("cuda", 1),
        blocks__0__fc_in__weight=torch.device("cpu"),
        rope_cache=torch.device("cuda", 0),
    )
    with pytest.raises(RuntimeError, match="2 parameter") as error:
        _check_placement(module, torch.device("cuda", 1), where="after wrapping")
    message = str(error.value)
    assert "head.weight on cuda:0" in message
    assert "rope_cache on cuda:0" in message
    assert "embedding" not in message
    assert "blocks" not in message
    assert "not this rank's own (cuda:1)" in message
    assert "map_location" in message
    assert "hard-coded" in message


def test_placement_check_lists_at_most_ten_tensors():
    module = _fake_module(**{f"layer{index}": torch.device("cuda", 0) for index in range(15)})
    with pytest.raises(RuntimeError, match=r"and 5 more"):
        _check_placement(module, torch.device("cuda", 1), where="before wrapping")


def test_placement_check_accepts_cpu_meta_and_own_gpu_tensors():
    module = _fake_module(a=torch.device("cpu"), b=torch.device("meta"), c=torch.device("cuda", 1))
    _check_placement(module, torch.device("cuda", 1), where="after wrapping")
    _check_placement(nn.Linear(2, 2), torch.device("cpu"), where="after wrapping")


def test_module_init_context_makes_the_own_gpu_current(launch_env, mocked_cuda):
    """Inside ``init_module()``, ``"cuda"`` must mean the rank's own GPU; with ``empty_init=True`` tensors are meta."""
    launch_env(_TORCHRUN)
    fabric = _cuda_fabric()
    with mock.patch("torch.cuda.device") as cuda_device:
        with fabric.strategy.module_init_context(empty_init=True):
            layer = nn.Linear(2, 2)
        cuda_device.assert_called_once_with(torch.device("cuda", 1))
        cuda_device.return_value.__enter__.assert_called_once()
        cuda_device.return_value.__exit__.assert_called_once()
    assert layer.weight.device == torch.device("meta")


def test_own_cuda_device_is_a_no_op_on_cpu():
    with _own_cuda_device(torch.device("cpu")):
        assert torch.empty(1).device == torch.device("cpu")
    strategy = Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy()).strategy
    with strategy.module_init_context(empty_init=True):
        assert nn.Linear(2, 2).weight.device == torch.device("meta")
