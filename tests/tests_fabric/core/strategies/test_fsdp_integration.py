import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lightning.fabric import Fabric
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning_fsdp.core.fsdp import FSDPStrategy
from tests_fabric.helpers.runif import RunIf

# The bodies of the tests below take a launched `Fabric`, so that they run the same on two CPU ranks with gloo.


class _Model(nn.Module):
    """Odd sizes (uneven shards, padding in the last one) and a buffer created on ``"cuda"`` in ``__init__``, as
    rotary caches and masks are."""

    def __init__(self, buffer_device="cpu"):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.LayerNorm(3))
        self.register_buffer("mask", torch.ones(3, device=buffer_device), persistent=False)

    def reset_parameters(self):
        # FSDP calls it on a module with tensors of its own that was created on the meta device
        self.mask.fill_(1)

    def forward(self, x):
        return self.layers(x) * self.mask


def _source_model(buffer_device="cpu"):
    torch.manual_seed(0)
    return _Model(buffer_device)


def _setup(fabric, empty_init=False):
    with fabric.init_module(empty_init=empty_init):
        model = _Model(fabric.device.type)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.5))
    return model, optimizer


def _train_step(fabric, model, optimizer):
    torch.manual_seed(1)
    batch = torch.randn(4, 5, device=fabric.device)
    fabric.backward(model(batch).sum())
    optimizer.step()
    optimizer.zero_grad()


def _state_dict_type(model):
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.state_dict_type(
        model._forward_module,
        StateDictType.FULL_STATE_DICT,
        # gathered on the GPU and copied to the CPU as Lightning saves it; on CPU ranks (gloo), offloading
        # segfaults in torch 2.13, so the gathered tensors are copied by `_full_state`
        FullStateDictConfig(offload_to_cpu=torch.cuda.is_available(), rank0_only=False),
        FullOptimStateDictConfig(offload_to_cpu=torch.cuda.is_available(), rank0_only=False),
    )


def _full_state(model):
    """The model's state gathered from the shards of all ranks, as an unsharded model holds it."""
    with _state_dict_type(model):
        return {name: tensor.cpu() for name, tensor in model._forward_module.state_dict().items()}


def _full_optimizer_state(model, optimizer):
    """The optimizer's state gathered from the shards of all ranks, keyed by parameter name."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with _state_dict_type(model):
        state = FSDP.optim_state_dict(model._forward_module, optimizer.optimizer)
    state["state"] = {
        name: {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in param_state.items()}
        for name, param_state in state["state"].items()
    }
    return state


def _assert_equal_state(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        # bit for bit, and in the saved dtype
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0)


def _assert_equal_optimizer_state(actual, expected):
    assert actual["state"].keys() == expected["state"].keys(), (sorted(actual["state"]), sorted(expected["state"]))
    for name in expected["state"]:
        _assert_equal_state(actual["state"][name], expected["state"][name])


def _assert_on_device(model, optimizer, device):
    for param in model.parameters():
        assert param.device == device
    for param_state in optimizer.optimizer.state.values():
        for value in param_state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # Adam's `step` stays on the CPU
                assert value.device == device


def _expected_device(fabric):
    cpu_offload = fabric.strategy.cpu_offload
    return torch.device("cpu") if cpu_offload is not None and cpu_offload.offload_params else fabric.device


def _run_load_full_checkpoint(fabric, tmp_path, empty_init=False):
    path = Path(fabric.broadcast(str(tmp_path / "full.ckpt")))
    with fabric.init_module():
        source = _source_model(fabric.device.type)
    model = fabric.setup_module(source)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    _train_step(fabric, model, optimizer)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    # the unsharded reference: the full checkpoint as the file holds it
    saved = torch.load(path, map_location="cpu", weights_only=True)

    loaded, loaded_optimizer = _setup(fabric, empty_init=empty_init)
    state = {"model": loaded, "optimizer": loaded_optimizer, "step": 0}
    assert fabric.load(path, state) == {}
    assert state["step"] == 3
    _assert_equal_state(_full_state(loaded), saved["model"])
    reloaded = _full_optimizer_state(loaded, loaded_optimizer)
    assert reloaded["param_groups"][0]["lr"] == 0.01
    _assert_equal_optimizer_state(reloaded, saved["optimizer"])
    _assert_on_device(loaded, loaded_optimizer, _expected_device(fabric))


@RunIf(min_cuda_gpus=2, standalone=True)
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_shard_local_load_full_checkpoint(tmp_path, use_orig_params):
    """A full checkpoint with Adam state loads into an FSDP model, each rank on its own GPU."""
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, use_orig_params=use_orig_params, state_dict_type="full")
    fabric = Fabric(accelerator="cuda", devices=2, strategy=strategy)
    fabric.launch()
    _run_load_full_checkpoint(fabric, tmp_path)


@RunIf(min_cuda_gpus=2, standalone=True)
@pytest.mark.parametrize(
    ("strategy_kwargs", "precision", "empty_init"),
    [
        pytest.param({"cpu_offload": True}, "32-true", False, id="cpu_offload"),
        pytest.param({}, "bf16-mixed", False, id="bf16-mixed"),
        pytest.param({}, "32-true", True, id="empty_init"),
    ],
)
def test_shard_local_load_full_checkpoint_settings(tmp_path, strategy_kwargs, precision, empty_init):
    """A full checkpoint loads with CPU offloading, with mixed precision, and into a model created on the meta
    device."""
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="full", **strategy_kwargs)
    fabric = Fabric(accelerator="cuda", devices=2, strategy=strategy, precision=precision)
    fabric.launch()
    _run_load_full_checkpoint(fabric, tmp_path, empty_init=empty_init)


def _tagged_with_every_gpu(state_dict):
    """The tensors put on the GPUs in turn, so that the file's storages are tagged ``cuda:0``, ``cuda:1``, ..."""
    count = torch.cuda.device_count()
    return {name: tensor.to(torch.device("cuda", i % count)) for i, (name, tensor) in enumerate(state_dict.items())}


def _other_gpus(fabric):
    if fabric.device.type != "cuda":
        return []
    return [index for index in range(torch.cuda.device_count()) if index != fabric.device.index]


def _run_load_raw_state_dict(fabric, tmp_path):
    path = Path(fabric.broadcast(str(tmp_path / "model.pt")))
    expected = _source_model().state_dict()
    if fabric.global_rank == 0:
        # on GPUs, a file saved from GPUs: a rank must read it without allocating memory on another rank's GPU
        torch.save(_tagged_with_every_gpu(expected) if fabric.device.type == "cuda" else expected, path)
    fabric.barrier()
    allocated = {}
    for index in _other_gpus(fabric):
        torch.cuda.reset_peak_memory_stats(index)
        allocated[index] = torch.cuda.memory_allocated(index)

    model, optimizer = _setup(fabric)
    fabric.load_raw(path, model)
    _assert_equal_state(_full_state(model), expected)
    _assert_on_device(model, optimizer, fabric.device)

    model, optimizer = _setup(fabric)
    assert fabric.load(path, {"model": model}) == {}
    _assert_equal_state(_full_state(model), expected)
    _assert_on_device(model, optimizer, fabric.device)
    # not a byte more on another GPU at any time during the loads
    for index, before in allocated.items():
        assert torch.cuda.max_memory_allocated(index) == before


@RunIf(min_cuda_gpus=2, standalone=True)
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_shard_local_load_raw_state_dict(tmp_path, use_orig_params):
    """A raw state dict (``torch.save(model.state_dict())``) loads with ``load_raw`` and with ``load``."""
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, use_orig_params=use_orig_params)
    fabric = Fabric(accelerator="cuda", devices=2, strategy=strategy)
    fabric.launch()
    _run_load_raw_state_dict(fabric, tmp_path)


def _run_load_optimizer_state_keyed_by_index(fabric, tmp_path):
    path = Path(fabric.broadcast(str(tmp_path / "single-device.ckpt")))
    # a checkpoint of a single-device run: the optimizer's state is keyed by the parameters' indices
    source = _source_model()
    source_optimizer = torch.optim.Adam(source.parameters(), lr=0.01)
    for _ in range(2):
        source(torch.randn(4, 5)).sum().backward()
        source_optimizer.step()
    if fabric.global_rank == 0:
        torch.save({"model": source.state_dict(), "optimizer": source_optimizer.state_dict(), "step": 2}, path)
    fabric.barrier()

    model, optimizer = _setup(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(path, state) == {}
    assert state["step"] == 2
    _assert_equal_state(_full_state(model), source.state_dict())
    reloaded = _full_optimizer_state(model, optimizer)
    assert reloaded["param_groups"][0]["lr"] == 0.01
    names = [name for name, _ in source.named_parameters()]
    expected = {names[index]: param_state for index, param_state in source_optimizer.state_dict()["state"].items()}
    # every parameter's exp_avg, exp_avg_sq and step, as the single-device run left them
    _assert_equal_optimizer_state(reloaded, {"state": expected})
    _assert_on_device(model, optimizer, fabric.device)


@RunIf(min_cuda_gpus=2, standalone=True)
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_shard_local_load_optimizer_state_keyed_by_index(tmp_path, use_orig_params):
    """The optimizer state of a single-device run (keyed by index, not by name) loads into an FSDP model."""
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, use_orig_params=use_orig_params)
    fabric = Fabric(accelerator="cuda", devices=2, strategy=strategy)
    fabric.launch()
    _run_load_optimizer_state_keyed_by_index(fabric, tmp_path)


# Two "nodes" of one process each on one machine. Both processes see both GPUs, in the order 1,0, so that a tensor put
# on a device chosen by the wrong index lands on the other node's GPU: node 0 uses its visible `cuda:1` (a device
# chosen from the global rank, the local rank or `cuda:0` would be its `cuda:0`), node 1 its `cuda:0` (a device
# chosen from the global rank would be its `cuda:1`).
_NODE_DEVICES = {0: 1, 1: 0}


def _write_two_nodes_checkpoints(path, accelerator):
    source = _source_model()
    optimizer = torch.optim.Adam(source.parameters(), lr=0.01)
    source(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    names = [name for name, _ in source.named_parameters()]
    optimizer_state = optimizer.state_dict()
    # keyed by name, as a full checkpoint of FSDP holds it
    optimizer_state = {
        "state": {names[index]: value for index, value in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]} for group in optimizer_state["param_groups"]
        ],
    }
    checkpoint = {"model": source.state_dict(), "optimizer": optimizer_state}
    torch.save(checkpoint, path / "reference.ckpt")
    if accelerator == "cuda":
        # the checkpoint of a run on two GPUs: its storages are tagged `cuda:0` and `cuda:1`
        devices = iter([torch.device("cuda", 0), torch.device("cuda", 1)] * 100)

        def move(value):
            return value.to(next(devices)) if isinstance(value, torch.Tensor) else value

        checkpoint = {
            "model": {name: move(tensor) for name, tensor in checkpoint["model"].items()},
            "optimizer": {
                "state": {
                    name: {key: move(value) for key, value in param_state.items()}
                    for name, param_state in optimizer_state["state"].items()
                },
                "param_groups": optimizer_state["param_groups"],
            },
        }
    torch.save(checkpoint, path / "full.ckpt")
    torch.save(checkpoint["model"], path / "model.pt")


def _run_node(path, accelerator):
    """One node's process: a rank whose local rank and device index differ from its global rank."""
    path = Path(path)
    node_rank = int(os.environ["NODE_RANK"])
    devices = [_NODE_DEVICES[node_rank]] if accelerator == "cuda" else 1
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="full")
    fabric = Fabric(accelerator=accelerator, devices=devices, num_nodes=2, strategy=strategy)
    fabric.launch()
    assert (fabric.global_rank, fabric.local_rank, fabric.world_size) == (node_rank, 0, 2)
    expected_device = torch.device("cuda", _NODE_DEVICES[node_rank]) if accelerator == "cuda" else torch.device("cpu")
    assert fabric.device == expected_device

    with fabric.init_module():
        model = _Model(accelerator)
    # the tensor created on "cuda" in `__init__` lands on the rank's own GPU
    assert model.mask.device == expected_device
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.5))
    _assert_on_device(model, optimizer, expected_device)

    reference = torch.load(path / "reference.ckpt", weights_only=True)
    state = {"model": model, "optimizer": optimizer}
    assert fabric.load(path / "full.ckpt", state) == {}
    _assert_equal_state(_full_state(model), reference["model"])
    _assert_equal_optimizer_state(_full_optimizer_state(model, optimizer), reference["optimizer"])
    _assert_on_device(model, optimizer, expected_device)
    assert model.mask.device == expected_device

    model, optimizer = _setup(fabric)
    fabric.load_raw(path / "model.pt", model)
    _assert_equal_state(_full_state(model), reference["model"])
    _assert_on_device(model, optimizer, expected_device)

    if accelerator == "cuda":
        # nothing was ever allocated on the other GPU: not by `init_module`, nor by reading tensors saved from it
        other = 1 - expected_device.index
        assert torch.cuda.max_memory_allocated(other) == 0
        assert torch.cuda.memory_allocated(expected_device) > 0


def _run_two_nodes(tmp_path, accelerator):
    _write_two_nodes_checkpoints(tmp_path, accelerator)
    port = find_free_network_port()
    # where this module is imported from: the test process's `sys.path`
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"}
    }
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if accelerator == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")[:2]
        env["CUDA_VISIBLE_DEVICES"] = f"{visible[1]},{visible[0]}"
    code = f"from {__name__} import _run_node; _run_node({str(tmp_path)!r}, {accelerator!r})"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**env, "NODE_RANK": str(node_rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node_rank in range(2)
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=180)[0])
    finally:
        for process in processes:
            process.kill()
    for node_rank, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"node {node_rank} failed:\n{output}"


@RunIf(min_cuda_gpus=2, standalone=True)
def test_shard_local_load_on_two_nodes_uses_local_device(tmp_path):
    """Two nodes of one GPU each: every tensor of ``init_module`` and of a load lands on the rank's own GPU, and a
    checkpoint saved from other GPUs is read without allocating memory on them."""
    _run_two_nodes(tmp_path, "cuda")
