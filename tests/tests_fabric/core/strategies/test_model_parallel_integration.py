from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lightning.fabric import Fabric
from lightning_fsdp.core.model_parallel import ModelParallelStrategy
from tests_fabric.helpers.runif import RunIf

# The bodies of the tests below take a launched `Fabric`, so that they run the same on two CPU ranks with gloo.


class _FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        # odd sizes where they can be: FSDP2's shards of `w2` and `norm` are uneven over two ranks (tensor
        # parallelism splits `w1`'s rows and `w2`'s columns, evenly)
        self.w1 = nn.Linear(6, 8)
        self.w2 = nn.Linear(8, 5)
        self.norm = nn.LayerNorm(5)

    def forward(self, x):
        return self.norm(self.w2(torch.relu(self.w1(x))))


def _parallelize(model, device_mesh):
    from torch.distributed._composable.fsdp.fully_shard import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if device_mesh["tensor_parallel"].size() > 1:
        parallelize_module(model, device_mesh["tensor_parallel"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if device_mesh["data_parallel"].size() > 1:
        fully_shard(model.w1, mesh=device_mesh["data_parallel"])
        fully_shard(model.w2, mesh=device_mesh["data_parallel"])
        fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _source_model():
    torch.manual_seed(0)
    return _FeedForward()


def _setup(fabric, empty_init=False):
    with fabric.init_module(empty_init=empty_init):
        model = _FeedForward()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.5))
    return model, optimizer


def _train_step(fabric, model, optimizer):
    torch.manual_seed(1)
    batch = torch.randn(4, 6, device=fabric.device)
    fabric.backward(model(batch).sum())
    optimizer.step()
    optimizer.zero_grad()


def _assert_local_equal(tensor, source):
    """The rank's part of ``tensor`` (a DTensor or a plain tensor) is the same slice of ``source``, bit for bit."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(tensor, DTensor):
        # each rank cuts its slice from its own copy of the source (`src_data_rank=None`: no communication)
        source = distribute_tensor(
            source.to(tensor.device), tensor.device_mesh, tensor.placements, src_data_rank=None
        ).to_local()
        tensor = tensor.to_local()
    torch.testing.assert_close(tensor.cpu(), source.cpu(), rtol=0, atol=0)


def _assert_equal_module_state(fabric, model, expected):
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        _assert_local_equal(tensor, expected[name])
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        torch.testing.assert_close(full.cpu(), expected[name], rtol=0, atol=0)
        assert tensor.device == fabric.device


def _assert_equal_optimizer_state(fabric, model, optimizer, expected_by_name):
    """Every parameter's Adam state is the source's, sliced as the parameter is."""
    params = dict(model.module.named_parameters())
    state = optimizer.optimizer.state
    assert {name for name, param in params.items() if param in state} == set(expected_by_name)
    for name, param_state in expected_by_name.items():
        loaded = state[params[name]]
        assert loaded.keys() == param_state.keys()
        for key, value in param_state.items():
            _assert_local_equal(loaded[key], value)
            if key != "step":  # Adam's `step` stays on the CPU
                assert loaded[key].device == fabric.device


def _run_load_full_checkpoint(fabric, tmp_path, empty_init=False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    path = Path(fabric.broadcast(str(tmp_path / "full.ckpt")))
    source = _source_model()
    model = fabric.setup_module(source)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    _train_step(fabric, model, optimizer)
    # a full checkpoint as `ModelParallelStrategy(save_distributed_checkpoint=False)` writes it: keyed by name
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    saved = torch.load(path, map_location="cpu", weights_only=True)

    loaded, loaded_optimizer = _setup(fabric, empty_init=empty_init)
    state = {"model": loaded, "optimizer": loaded_optimizer, "step": 0}
    assert fabric.load(path, state) == {}
    assert state["step"] == 3
    _assert_equal_module_state(fabric, loaded, saved["model"])
    _assert_equal_optimizer_state(fabric, loaded, loaded_optimizer, saved["optimizer"]["state"])
    options = StateDictOptions(full_state_dict=True)
    reloaded = get_optimizer_state_dict(loaded.module, loaded_optimizer.optimizer, options=options)
    assert reloaded["param_groups"] == saved["optimizer"]["param_groups"]


def _fabric(tensor_parallel_size, accelerator="cuda", precision="32-true"):
    strategy = ModelParallelStrategy(
        _parallelize,
        data_parallel_size=2 // tensor_parallel_size,
        tensor_parallel_size=tensor_parallel_size,
        save_distributed_checkpoint=False,
    )
    return Fabric(accelerator=accelerator, devices=2, strategy=strategy, precision=precision)


@RunIf(min_torch="2.4", min_cuda_gpus=2, standalone=True)
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_shard_local_load_full_checkpoint(tmp_path, tensor_parallel_size):
    """A full checkpoint with Adam state loads into FSDP2 shards (or tensor-parallel shards) on each rank's GPU."""
    fabric = _fabric(tensor_parallel_size)
    fabric.launch()
    _run_load_full_checkpoint(fabric, tmp_path)


@RunIf(min_torch="2.4", min_cuda_gpus=2, standalone=True)
@pytest.mark.parametrize(
    ("precision", "empty_init"),
    [pytest.param("bf16-mixed", False, id="bf16-mixed"), pytest.param("32-true", True, id="empty_init")],
)
def test_shard_local_load_full_checkpoint_settings(tmp_path, precision, empty_init):
    """A full checkpoint loads with mixed precision, and into a model created on the meta device."""
    fabric = _fabric(1, precision=precision)
    fabric.launch()
    _run_load_full_checkpoint(fabric, tmp_path, empty_init=empty_init)


def _run_load_optimizer_state_keyed_by_index(fabric, tmp_path):
    path = Path(fabric.broadcast(str(tmp_path / "single-device.ckpt")))
    # a checkpoint of a single-device run: the optimizer's state is keyed by the parameters' indices
    source = _source_model()
    source_optimizer = torch.optim.Adam(source.parameters(), lr=0.01)
    for _ in range(2):
        source(torch.randn(4, 6)).sum().backward()
        source_optimizer.step()
    if fabric.global_rank == 0:
        torch.save({"model": source.state_dict(), "optimizer": source_optimizer.state_dict(), "step": 2}, path)
    fabric.barrier()

    model, optimizer = _setup(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(path, state) == {}
    assert state["step"] == 2
    _assert_equal_module_state(fabric, model, source.state_dict())
    names = [name for name, _ in source.named_parameters()]
    expected = {names[index]: param_state for index, param_state in source_optimizer.state_dict()["state"].items()}
    # every parameter's exp_avg, exp_avg_sq and step, as the single-device run left them
    _assert_equal_optimizer_state(fabric, model, optimizer, expected)
    assert optimizer.param_groups[0]["lr"] == 0.01


@RunIf(min_torch="2.4", min_cuda_gpus=2, standalone=True)
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_shard_local_load_optimizer_state_keyed_by_index(tmp_path, tensor_parallel_size):
    """The optimizer state of a single-device run (keyed by index, not by name) loads into the shards."""
    fabric = _fabric(tensor_parallel_size)
    fabric.launch()
    _run_load_optimizer_state_keyed_by_index(fabric, tmp_path)


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

    model, _ = _setup(fabric)
    fabric.load_raw(path, model)
    _assert_equal_module_state(fabric, model, expected)

    model, _ = _setup(fabric, empty_init=True)
    assert fabric.load(path, {"model": model}) == {}
    _assert_equal_module_state(fabric, model, expected)
    # not a byte more on another GPU at any time during the loads
    for index, before in allocated.items():
        assert torch.cuda.max_memory_allocated(index) == before


@RunIf(min_torch="2.4", min_cuda_gpus=2, standalone=True)
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_shard_local_load_raw_state_dict(tmp_path, tensor_parallel_size):
    """A raw state dict (``torch.save(model.state_dict())``) loads with ``load_raw`` and with ``load``."""
    fabric = _fabric(tensor_parallel_size)
    fabric.launch()
    _run_load_raw_state_dict(fabric, tmp_path)
