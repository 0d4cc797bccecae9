"""The device each rank selects, and the checks that keep the ranks of a node off each other's device.

Both strategies run the same checks: ``FSDPStrategy`` (FSDP1) and ``ModelParallelStrategy`` (FSDP2), so the tests of a
strategy's behaviour run with each (``strategy_name``).

No GPU exists on the machines that run this suite, so CUDA is mocked here: ``torch.cuda.device_count`` and
``torch.cuda.is_available`` report two GPUs, ``torch.cuda.set_device`` records the device instead of selecting it, and
joining the process group (and building ``ModelParallelStrategy``'s device mesh on it) is skipped. What is tested is the
device each rank *would* select and that an inconsistent environment is refused *before* any device is selected. The
tests that join a real (gloo) process group run on CPU; the standalone tests in ``test_two_nodes.py`` check the same
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

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.devices import (
    _check_cluster_environment,
    _check_distinct_devices,
    _check_placement,
)
from lightning_fsdp.devices import own_device_context as _own_device_context
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import TinyTransformer, make_batch

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
        # ModelParallelStrategy's own `_setup_distributed` runs (its device check finds no process group and returns)
        stack.enter_context(mock.patch("lightning.fabric.strategies.model_parallel._init_dist_connection"))
        stack.enter_context(mock.patch("lightning.fabric.strategies.model_parallel._setup_device_mesh"))
        yield stack.enter_context(mock.patch("torch.cuda.set_device"))


def _parallelize(model: nn.Module, device_mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _strategy(name: str, parallelize_fn=_parallelize):
    if name == "fsdp":
        return FSDPStrategy()
    return ModelParallelStrategy(parallelize_fn, data_parallel_size=4, tensor_parallel_size=1)


@pytest.fixture(params=["fsdp", "model_parallel"])
def strategy_name(request) -> str:
    return request.param


def _cuda_fabric(strategy_name: str = "fsdp", **kwargs) -> Fabric:
    return Fabric(accelerator="cuda", devices=2, num_nodes=2, strategy=_strategy(strategy_name), **kwargs)


@pytest.mark.parametrize(
    ("variables", "environment"),
    [
        pytest.param([_TORCHRUN], TorchElasticEnvironment, id="torchrun"),
        pytest.param([_SLURM], SLURMEnvironment, id="slurm"),
        pytest.param([_TORCHRUN, _SLURM], TorchElasticEnvironment, id="torchrun-and-slurm"),
    ],
)
def test_node_rank_1_selects_its_local_rank_device(launch_env, mocked_cuda, strategy_name, variables, environment):
    launch_env(*variables)
    fabric = _cuda_fabric(strategy_name)
    assert type(fabric.strategy.cluster_environment) is environment
    fabric.strategy.setup_environment()
    assert (fabric.global_rank, fabric.node_rank, fabric.local_rank, fabric.world_size) == (3, 1, 1, 4)
    assert fabric.device == torch.device("cuda", 1)
    mocked_cuda.assert_called_once_with(torch.device("cuda", 1))


def test_torchrun_under_one_slurm_task_per_node_is_fine(launch_env, mocked_cuda, strategy_name):
    """``srun --ntasks-per-node=1 torchrun ...``: SLURM's variables describe the launchers (2 tasks), not the ranks."""
    launch_env(_TORCHRUN, {**_SLURM, "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"})
    launch_env({"SLURM_NTASKS_PER_NODE": "1"})
    fabric = _cuda_fabric(strategy_name)
    fabric.strategy.setup_environment()
    mocked_cuda.assert_called_once_with(torch.device("cuda", 1))


def test_contradicting_torchrun_and_slurm_variables_raise(launch_env, mocked_cuda, strategy_name):
    """Both launchers describe four processes, but disagree about which one this is: no device may be chosen."""
    launch_env(_TORCHRUN, {**_SLURM, "SLURM_PROCID": "2", "SLURM_LOCALID": "0"})
    fabric = _cuda_fabric(strategy_name)
    with pytest.raises(RuntimeError, match="refuses to select a device") as error:
        fabric.strategy.setup_environment()
    message = str(error.value)
    assert message.startswith(f"`{type(fabric.strategy).__name__}.setup_environment` refuses to select a device")
    assert "SLURM (`srun`) says local rank 0 (SLURM_LOCALID=0), but `TorchElasticEnvironment` read 1" in message
    assert "global rank 2 (SLURM_PROCID=2)" in message
    assert "LOCAL_RANK=1" in message
    assert "Fabric(plugins=[TorchElasticEnvironment()])" in message
    mocked_cuda.assert_not_called()


def test_slurm_variables_preferred_over_torchrun_raise(launch_env, mocked_cuda, strategy_name):
    """The original cause: SLURM's variables read inside torchrun's processes, so a node's ranks all read local rank 0.

    With one SLURM task per node running torchrun, every process of node 1 reads ``SLURM_LOCALID=0`` and
    ``SLURM_PROCID=1``, and would select ``cuda:0``.

    """
    launch_env(_TORCHRUN, {**_SLURM, "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"})
    launch_env({"SLURM_NTASKS_PER_NODE": "1"})
    fabric = _cuda_fabric(strategy_name, plugins=[SLURMEnvironment()])
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
def test_every_rank_of_a_node_reading_local_rank_0_raises(launch_env, mocked_cuda, strategy_name, rank, fails):
    """A launcher that sets ``RANK`` but ``LOCAL_RANK=0`` for every process of node 1: rank 3 would take cuda:0."""
    launch_env({"RANK": rank, "LOCAL_RANK": "0", "NODE_RANK": "1", "WORLD_SIZE": "4"})
    fabric = _cuda_fabric(strategy_name)
    assert type(fabric.strategy.cluster_environment) is LightningEnvironment
    if not fails:
        fabric.strategy.setup_environment()
        mocked_cuda.assert_called_once_with(torch.device("cuda", 0))
        return
    with pytest.raises(RuntimeError, match=r"torchrun .* says global rank 3 \(RANK=3\), but `LightningEnvironment`"):
        fabric.strategy.setup_environment()
    mocked_cuda.assert_not_called()


def test_world_size_not_nodes_times_devices_raises(launch_env, mocked_cuda, strategy_name):
    launch_env(_TORCHRUN, {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "2"})
    fabric = _cuda_fabric(strategy_name)
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


def test_an_environment_without_integer_ranks_is_not_checked():
    """A test double that reports only some ranks (as in Lightning's own unit tests) passes, as upstream takes it."""
    environment = mock.Mock(world_size=mock.Mock(return_value=8), local_rank=mock.Mock(return_value=1))
    _check_cluster_environment(environment, [torch.device("cpu")] * 4, num_nodes=2)


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


def _refuse_to_share_a_device() -> dict[str, list[str]]:
    """Both processes of a node that would end up on the same device, launched once per strategy.

    First the original cause: one SLURM task started both processes, and Fabric reads SLURM's variables, so both read
    local rank 0 (and would select the same device). Each process must refuse before the process group exists. Then the
    launch is consistent, but both processes use the same (mocked) physical GPU: every rank must refuse once the
    process group exists, and ``ModelParallelStrategy`` before its device mesh is built on it.

    """
    slurm = {**_SLURM, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1"}
    slurm.update(SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1")
    messages: dict[str, list[str]] = {"before": [], "after": []}
    os.environ.update(slurm)
    for name in ("fsdp", "model_parallel"):
        strategy = _strategy(name, _parallelize)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[SLURMEnvironment()])
        with pytest.raises(RuntimeError) as error:
            fabric.launch()
        assert not torch.distributed.is_initialized()
        messages["before"].append(str(error.value).replace(type(strategy).__name__, "<strategy>"))
    for variable in slurm:
        del os.environ[variable]
    with mock.patch("lightning_fsdp.devices._physical_device", return_value="host/GPU-0"):
        for name in ("fsdp", "model_parallel"):
            strategy = _strategy(name, _parallelize)
            fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
            with pytest.raises(RuntimeError) as error:
                fabric.launch()
            assert torch.distributed.is_initialized()
            if name == "model_parallel":
                assert strategy._device_mesh is None, "the device mesh was built before the devices were checked"
            messages["after"].append(str(error.value).replace(type(strategy).__name__, "<strategy>"))
    return messages


def test_ranks_that_would_share_a_device_refuse_like_fsdp_strategy():
    results = run_distributed(_refuse_to_share_a_device, devices=2, timeout=60)
    for result in results:
        fsdp, model_parallel = result["before"]
        assert model_parallel == fsdp, "ModelParallelStrategy refuses with FSDPStrategy's message"
        assert fsdp.startswith("`<strategy>.setup_environment` refuses to select a device")
        assert "world size 1 != 1 nodes x 2 devices per node = 2" in fsdp
        assert "world size        1    (SLURM_NTASKS=1)" in fsdp
    # Both ranks read the same values; only the listing of this process's own launcher variables (LOCAL_RANK) differs.
    assert len({result["before"][0].split("Launcher variables")[0] for result in results}) == 1
    assert results[0]["after"] == results[1]["after"], "every rank raises the same error, so none is left waiting"
    fsdp, model_parallel = results[0]["after"]
    assert model_parallel == fsdp
    assert "ranks [0, 1] all use the same physical GPU host/GPU-0" in fsdp


def _set_up_and_train_model_parallel() -> dict:
    """A 2-rank gloo run of ``ModelParallelStrategy`` through ``setup_environment`` and ``setup_module``."""
    from torch.distributed.tensor import DTensor

    def parallelize(model: nn.Module, device_mesh) -> nn.Module:
        meta_shard = DTensor.from_local(torch.empty(2, device="meta"), device_mesh["data_parallel"], run_check=False)
        # A DTensor's `.device` is its local shard's, which the placement check reads, not its mesh's device type.
        assert meta_shard.device == torch.device("meta")
        assert device_mesh.device_type == "cpu"
        return _parallelize(model, device_mesh)

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    check_calls = []

    def check_distinct_devices(*args, **kwargs) -> None:
        # Record when the check runs (process group joined? mesh not built yet?), then run it.
        check_calls.append((torch.distributed.is_initialized(), strategy._device_mesh is None))
        _check_distinct_devices(*args, **kwargs)

    with mock.patch("lightning_fsdp.model_parallel._check_distinct_devices", side_effect=check_distinct_devices):
        fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    init_devices = {str(tensor.device) for tensor in model.parameters()}
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    parameters = list(model.parameters())
    _check_placement(model, torch.device("cuda", 1), where="after `parallelize_fn`")  # CPU shards are allowed
    inputs, targets = make_batch(0)
    loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    fabric.backward(loss)
    optimizer.step()
    return {
        "check_calls": check_calls,
        "init_devices": sorted(init_devices),
        "all_dtensors": all(isinstance(parameter, DTensor) for parameter in parameters),
        "devices": sorted({str(parameter.device) for parameter in parameters}),
        "local_devices": sorted({str(parameter.to_local().device) for parameter in parameters}),
        "loss": loss.item(),
    }


def test_model_parallel_two_ranks_on_cpu_set_up_and_train():
    results = run_distributed(_set_up_and_train_model_parallel, devices=2, timeout=60)
    for result in results:
        assert result["check_calls"] == [(True, True)], "the device check runs once, between process group and mesh"
        assert result["init_devices"] == ["meta"]
        assert result["all_dtensors"]
        assert result["devices"] == result["local_devices"] == ["cpu"]
    assert results[0]["loss"] == results[1]["loss"]


def _fake_module(**tensors: torch.device) -> SimpleNamespace:
    named = [(name.replace("__", "."), SimpleNamespace(device=device)) for name, device in tensors.items()]
    return SimpleNamespace(
        named_parameters=lambda: named[:-1],
        named_buffers=lambda: named[-1:],
        parameters=lambda: [tensor for _, tensor in named[:-1]],
        buffers=lambda: [tensor for _, tensor in named[-1:]],
    )


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


class _StandInModule(nn.Module):
    """A module whose parameters are stand-ins carrying a device: no CUDA tensor can be created here."""

    def __init__(self, **devices: torch.device) -> None:
        super().__init__()
        self.stand_ins = [
            (name.replace("__", "."), SimpleNamespace(device=device, is_meta=device.type == "meta"))
            for name, device in devices.items()
        ]

    def named_parameters(self, *args, **kwargs):
        return iter(self.stand_ins)

    def named_buffers(self, *args, **kwargs):
        return iter(())


def test_model_parallel_setup_module_checks_placement_around_parallelize_fn(launch_env, mocked_cuda):
    """Rank 3 (``cuda:1``): a model on ``cuda:0`` is refused before ``parallelize_fn``, a result on it after."""
    launch_env(_TORCHRUN)
    parallelize = mock.Mock(return_value=_StandInModule(head__weight=torch.device("cuda", 0)))
    fabric = Fabric(accelerator="cuda", devices=2, num_nodes=2, strategy=_strategy("model_parallel", parallelize))
    fabric.strategy.setup_environment()

    before = r"`ModelParallelStrategy.setup_module` found 1 parameter\(s\) or buffer\(s\) before `parallelize_fn`"
    with pytest.raises(RuntimeError, match=before) as error:
        fabric.strategy.setup_module(_StandInModule(weight=torch.device("cuda", 0), bias=torch.device("cuda", 1)))
    assert "weight on cuda:0" in str(error.value)
    assert "bias" not in str(error.value)
    parallelize.assert_not_called()

    with pytest.raises(RuntimeError, match=r"found 1 parameter\(s\) or buffer\(s\) after `parallelize_fn`") as error:
        fabric.strategy.setup_module(_StandInModule(weight=torch.device("cuda", 1)))
    assert "head.weight on cuda:0" in str(error.value)
    parallelize.assert_called_once()

    parallelize.return_value = placed = _StandInModule(weight=torch.device("cuda", 1), cache=torch.device("cpu"))
    assert fabric.strategy.setup_module(_StandInModule(weight=torch.device("cpu"))) is placed


def test_module_init_context_makes_the_own_gpu_current(launch_env, mocked_cuda, strategy_name):
    """Inside ``init_module()``, ``"cuda"`` must mean the rank's own GPU; with ``empty_init=True`` tensors are meta."""
    launch_env(_TORCHRUN)
    fabric = _cuda_fabric(strategy_name)
    with mock.patch("torch.cuda.device") as cuda_device:
        with fabric.strategy.module_init_context(empty_init=True):
            layer = nn.Linear(2, 2)
        cuda_device.assert_called_once_with(torch.device("cuda", 1))
        cuda_device.return_value.__enter__.assert_called_once()
        cuda_device.return_value.__exit__.assert_called_once()
    assert layer.weight.device == torch.device("meta")


def test_own_cuda_device_is_a_no_op_on_cpu(strategy_name):
    with _own_device_context(torch.device("cpu")):
        assert torch.empty(1).device == torch.device("cpu")
    strategy = Fabric(accelerator="cpu", devices=1, strategy=_strategy(strategy_name)).strategy
    with strategy.module_init_context(empty_init=True):
        assert nn.Linear(2, 2).weight.device == torch.device("meta")
