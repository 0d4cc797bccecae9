import gc
import json
from functools import partial

import pytest
import torch
import torch.nn as nn

from lightning.fabric import Fabric
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning_fsdp.core.fsdp import _check_module_state, _copy_module_state, _local_optimizer_state
from lightning_fsdp.core.model_parallel import ModelParallelStrategy, _dtensor_layout
from tests_fabric.helpers.runif import RunIf


class _SpawnedModelParallelStrategy(ModelParallelStrategy):
    # the ranks run the test function in processes spawned from the test, not as copies of the test command
    def _configure_launcher(self):
        self._launcher = _MultiProcessingLauncher(self, start_method="spawn")


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(7, 6)  # 7 rows: 4 and 3 over two ranks
        self.w1 = nn.Linear(6, 4)
        self.w2 = nn.Linear(4, 6)
        self.gate = nn.Parameter(torch.randn(1, 6))  # one row: the second rank's shard is empty
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.embedding.weight  # tied
        self.register_buffer("scale", torch.rand(6))
        self.register_buffer("calls", torch.zeros(1), persistent=False)

    def forward(self, x):
        return self.head(self.w2(torch.relu(self.w1(self.embedding(x) * self.scale * self.gate))))


def _parallelize(model, device_mesh):
    from torch.distributed._composable.fsdp.fully_shard import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if device_mesh["tensor_parallel"].size() > 1:
        parallelize_module(model, device_mesh["tensor_parallel"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if device_mesh["data_parallel"].size() > 1:
        fully_shard(model.w1, mesh=device_mesh["data_parallel"])
        fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _launch(fabric, fn, *args):
    fabric.launch(partial(_run_and_collect, fn), *args)


def _run_and_collect(fn, fabric, *args):
    fn(fabric, *args)
    # The FSDP2 modules hold the process group in reference cycles: free them while the interpreter is alive. Left to
    # its teardown, a gloo thread can abort the rank ("terminate called without an active exception").
    gc.collect()


def _fabric(tensor_parallel_size=1, save_distributed_checkpoint=True):
    strategy = _SpawnedModelParallelStrategy(
        _parallelize,
        data_parallel_size=2 // tensor_parallel_size,
        tensor_parallel_size=tensor_parallel_size,
        save_distributed_checkpoint=save_distributed_checkpoint,
    )
    return Fabric(accelerator="cpu", devices=2, strategy=strategy)


def _state_dict():
    torch.manual_seed(0)
    return _Model().state_dict()


def _setup(fabric):
    with torch.device("cpu"):
        model = _Model()
    for tensor in model.state_dict().values():
        tensor.zero_()
    return fabric.setup_module(model)


def _full_state(model):
    return {
        name: tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        for name, tensor in model.state_dict().items()
    }


def _assert_equal_state(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0)


def _write_torch_files(path):
    state_dict = _state_dict()
    torch.save(state_dict, path / "model.pt")
    torch.save(state_dict, path / "legacy.pt", _use_new_zipfile_serialization=False)


def _write_safetensors_files(path):
    state_dict = _state_dict()
    del state_dict["head.weight"]  # safetensors refuses tensors that share memory: the tied weight is saved once
    _save_safetensors(state_dict, path / "model.safetensors")
    first, second = list(state_dict)[:3], list(state_dict)[3:]
    _save_safetensors({k: state_dict[k] for k in first}, path / "model-00001-of-00002.safetensors")
    _save_safetensors({k: state_dict[k] for k in second}, path / "model-00002-of-00002.safetensors")
    weight_map = dict.fromkeys(first, "model-00001-of-00002.safetensors")
    weight_map.update(dict.fromkeys(second, "model-00002-of-00002.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _run_load_torch_files(fabric, tmp_path, names):
    expected = _state_dict()
    for name in names:
        model = _setup(fabric)
        fabric.load_raw(tmp_path / name, model)
        _assert_equal_state(_full_state(model), expected)
        model = _setup(fabric)
        assert fabric.load(tmp_path / name, {"model": model}) == {}
        _assert_equal_state(_full_state(model), expected)


def _run_load_safetensors_files(fabric, tmp_path):
    expected = _state_dict()
    for name in ("model.safetensors", "model.safetensors.index.json", ""):
        # the tied weight is written once, from the name that the file holds
        model = _setup(fabric)
        fabric.load_raw(tmp_path / name, model, strict=False)
        _assert_equal_state(_full_state(model), expected)
        model = _setup(fabric)
        assert fabric.load(tmp_path / name, {"model": model}, strict=False) == {}
        _assert_equal_state(_full_state(model), expected)


@RunIf(min_torch="2.4")
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_model_parallel_load_raw_state_dict(tmp_path, tensor_parallel_size):
    """A raw state dict (``torch.save(model.state_dict())``) loads with both load methods."""
    _write_torch_files(tmp_path)
    _launch(_fabric(tensor_parallel_size), _run_load_torch_files, tmp_path, ["model.pt"])


@RunIf(min_torch="2.4")
def test_model_parallel_load_legacy_format_in_turns(tmp_path):
    """A file in the legacy format, which cannot be memory-mapped, is read whole by one rank of a node at a time."""
    _write_torch_files(tmp_path)
    _launch(_fabric(), _run_load_torch_files, tmp_path, ["legacy.pt"])


@RunIf(min_torch="2.4")
def test_model_parallel_load_safetensors_and_hf_index(tmp_path):
    """A ``.safetensors`` file and a Hugging Face index (the file or its folder) load with both load methods."""
    _write_safetensors_files(tmp_path)
    _launch(_fabric(), _run_load_safetensors_files, tmp_path)


def _train_step(model, optimizer):
    model(torch.arange(7).reshape(1, 7)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _run_load_full_checkpoint(fabric, tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(1)
    model = fabric.setup_module(_Model())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    _train_step(model, optimizer)
    # a full checkpoint as `ModelParallelStrategy(save_distributed_checkpoint=False)` writes it
    fabric.save(tmp_path / "full.ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    saved = torch.load(tmp_path / "full.ckpt", weights_only=True)

    loaded = _setup(fabric)
    loaded_optimizer = fabric.setup_optimizers(torch.optim.Adam(loaded.parameters(), lr=0.5))
    state = {"model": loaded, "optimizer": loaded_optimizer, "step": 0}
    assert fabric.load(tmp_path / "full.ckpt", state) == {}
    assert state["step"] == 1
    _assert_equal_state(_full_state(loaded), saved["model"])
    options = StateDictOptions(full_state_dict=True)
    reloaded = get_optimizer_state_dict(loaded.module, loaded_optimizer.optimizer, options=options)
    assert reloaded["param_groups"] == saved["optimizer"]["param_groups"]
    assert reloaded["state"].keys() == saved["optimizer"]["state"].keys()
    for name, param_state in saved["optimizer"]["state"].items():
        _assert_equal_state(reloaded["state"][name], param_state)
    # the optimizer continues exactly where the saved one was
    _train_step(model, optimizer)
    _train_step(loaded, loaded_optimizer)
    _assert_equal_state(_full_state(loaded), _full_state(model))

    # an optimizer that does not fit the saved one: the error comes before the model is written
    untouched = _setup(fabric)
    before = _full_state(untouched)
    rest = [param for param in untouched.parameters() if param is not untouched.w1.weight]
    groups = [{"params": [untouched.w1.weight]}, {"params": rest}]
    state = {"model": untouched, "optimizer": torch.optim.Adam(groups)}
    with pytest.raises(ValueError, match=r"has 1 parameter group\(s\), the optimizer has 2"):
        fabric.load(tmp_path / "full.ckpt", state)
    _assert_equal_state(_full_state(untouched), before)


@RunIf(min_torch="2.4")
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_model_parallel_load_full_checkpoint_shard_local(tmp_path, tensor_parallel_size):
    """A full checkpoint restores the model and the Adam state, each rank copying only its slices."""
    fabric = _fabric(tensor_parallel_size, save_distributed_checkpoint=False)
    _launch(fabric, _run_load_full_checkpoint, tmp_path)


def _run_strict_error(fabric, tmp_path):
    model = _setup(fabric)
    before = _full_state(model)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "w1.bias"') as error:
        fabric.load_raw(tmp_path / "partial.pt", model)
    messages = [None, None]
    torch.distributed.all_gather_object(messages, str(error.value))
    assert messages[0] == messages[1]
    # names were checked before anything was written
    _assert_equal_state(_full_state(model), before)
    fabric.load_raw(tmp_path / "partial.pt", model, strict=False)
    assert torch.equal(_full_state(model)["w1.weight"], _state_dict()["w1.weight"])


@RunIf(min_torch="2.4")
def test_model_parallel_load_raw_strict_error_on_every_rank(tmp_path):
    state_dict = _state_dict()
    del state_dict["w1.bias"]
    torch.save(state_dict, tmp_path / "partial.pt")
    _launch(_fabric(), _run_strict_error, tmp_path)


class _CountingSource:
    """A tensor of a lazily read checkpoint that counts the elements read from it."""

    read = 0

    def __init__(self, tensor):
        self.tensor = tensor

    def get_shape(self):
        return list(self.tensor.shape)

    def __getitem__(self, box):
        value = self.tensor[box]
        _CountingSource.read += value.numel()
        return value


def _run_reads_own_box(fabric):
    model = _setup(fabric)
    state_dict = {name: _CountingSource(tensor) for name, tensor in _state_dict().items()}
    layout = _dtensor_layout(model)
    _copy_module_state(state_dict, _check_module_state(state_dict, model, layout, strict=True), layout)
    local_numel = sum(tensor.to_local().numel() for tensor in model.parameters()) + model.scale.numel()
    assert _CountingSource.read == local_numel
    assert local_numel < sum(tensor.numel() for tensor in _state_dict().values())
    _assert_equal_state(_full_state(model), _state_dict())


@RunIf(min_torch="2.4")
def test_model_parallel_load_reads_only_own_shards():
    _launch(_fabric(), _run_reads_own_box)


def _run_int_keyed_optimizer_state(fabric, tmp_path):
    model = _setup(fabric)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    fabric.load(tmp_path / "single.ckpt", {"model": model, "optimizer": optimizer})
    saved = torch.load(tmp_path / "single.ckpt")["optimizer"]
    params = list(model.parameters())
    assert len(params) == len(saved["state"])
    for index, param in enumerate(params):
        for key, value in saved["state"][index].items():
            loaded = optimizer.state[param][key]
            loaded = loaded.full_tensor() if hasattr(loaded, "full_tensor") else loaded
            torch.testing.assert_close(loaded, value, rtol=0, atol=0)
    assert optimizer.param_groups[0]["lr"] == 0.01


@RunIf(min_torch="2.4")
def test_model_parallel_load_optimizer_state_keyed_by_index(tmp_path):
    """An optimizer state saved without a strategy (keyed by parameter index) is restored into the DTensor shards."""
    torch.manual_seed(0)
    model = _Model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "single.ckpt")
    _launch(_fabric(), _run_int_keyed_optimizer_state, tmp_path)


def test_model_parallel_layout_names_parameters_as_the_state_dict():
    """A module wrapped for activation checkpointing: its parameters keep their state-dict names, so that the optimizer
    state of a full checkpoint, keyed by those names or by index, reaches every parameter."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)), nn.Linear(2, 1))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 2)).sum().backward()
    optimizer.step()
    by_index = optimizer.state_dict()
    names = list(model.state_dict())
    by_name = {
        "state": {names[index]: value for index, value in by_index["state"].items()},
        "param_groups": [{**by_index["param_groups"][0], "params": names}],
    }
    layout = _dtensor_layout(model)
    assert layout.param_names == names
    for saved in (by_index, by_name):
        local = _local_optimizer_state(saved, optimizer, layout)
        assert sorted(local["state"]) == [0, 1, 2, 3]
        for index, param_state in local["state"].items():
            torch.testing.assert_close(param_state["exp_avg"], by_index["state"][index]["exp_avg"], rtol=0, atol=0)


class _WithExtraState(nn.Linear):
    """A layer that saves an extra state beside its tensors, as Transformer Engine's layers do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extra = {"calls": 0}

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def _write_extra_state_files(path):
    source = nn.Sequential(_WithExtraState(5, 7), nn.ReLU(), nn.Linear(7, 3))
    source[0].extra = {"calls": 3}
    state_dict = source.state_dict()
    torch.save({"model": state_dict}, path / "full.ckpt")
    del state_dict["0._extra_state"]
    torch.save(state_dict, path / "without.pt")
    return source


def _shard_whole(model, device_mesh):
    from torch.distributed._composable.fsdp.fully_shard import fully_shard

    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _run_extra_state(fabric, tmp_path):
    model = fabric.setup_module(nn.Sequential(_WithExtraState(5, 7), nn.ReLU(), nn.Linear(7, 3)))
    layer = model.module[0]
    assert "0._extra_state" in _dtensor_layout(model.module).extra_states
    assert "0._extra_state" not in _dtensor_layout(model.module).shards
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0._extra_state"'):
        fabric.load_raw(tmp_path / "without.pt", model)
    assert layer.extra == {"calls": 0}
    fabric.load(tmp_path / "full.ckpt", {"model": model})
    assert layer.extra == {"calls": 3}


@RunIf(min_torch="2.4")
def test_model_parallel_load_sets_extra_state(tmp_path):
    """A module's extra state (``get_extra_state``) is set from the checkpoint, and missing it is a strict error."""
    _write_extra_state_files(tmp_path)
    strategy = _SpawnedModelParallelStrategy(
        _shard_whole, data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False
    )
    _launch(Fabric(accelerator="cpu", devices=2, strategy=strategy), _run_extra_state, tmp_path)


def _save_safetensors(tensors, path):
    # `safetensors` is optional: the tests that write such files are skipped without it
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file(tensors, path)
