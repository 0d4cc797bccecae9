import argparse
import gc
import json

import pytest
import torch
import torch.nn as nn

from lightning.fabric.accelerators import CPUAccelerator
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning_fsdp.core.fsdp import (
    FSDPStrategy,
    _check_module_state,
    _copy_module_state,
    _extra_states,
    _fsdp_layout,
    _load_full_checkpoint,
)
from tests_fabric.helpers.runif import RunIf


def _spawn_on_cpu(fn, *args):
    """Run ``fn(strategy, *args)`` on two CPU ranks, each with its process group set up."""
    strategy = FSDPStrategy(
        accelerator=CPUAccelerator(),
        parallel_devices=[torch.device("cpu")] * 2,
        cluster_environment=LightningEnvironment(),
    )
    launcher = _MultiProcessingLauncher(strategy=strategy, start_method="spawn")
    launcher.launch(_set_up_and_run, strategy, fn, *args)


def _set_up_and_run(strategy, fn, *args):
    strategy.setup_environment()
    fn(strategy, *args)
    # The sharded modules hold the process group in reference cycles (an error's traceback adds more): free them while
    # the interpreter is alive. Left to its teardown, a gloo thread can abort the rank ("terminate called without an
    # active exception"), about one run in twelve of the error test here.
    gc.collect()


def _model():
    # odd sizes: the last rank's shard of a unit is uneven, and some parameters end in the padding
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.LayerNorm(3))


def _sharded(strategy, use_orig_params=True):
    from torch.distributed.fsdp import FullyShardedDataParallel

    with torch.device("cpu"):
        model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.LayerNorm(3))
    for param in model.parameters():
        torch.nn.init.zeros_(param)
    # wrapped by hand, so that `setup_module` leaves the device as given (CPU)
    model = FullyShardedDataParallel(model, device_id=strategy.root_device, use_orig_params=use_orig_params)
    return strategy.setup_module(model)


def _full_state_dict(model):
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_equal_state(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0)


def _write_torch_files(path):
    state_dict = _model().state_dict()
    torch.save(state_dict, path / "model.pt")
    torch.save(state_dict, path / "legacy.pt", _use_new_zipfile_serialization=False)
    return state_dict


def _write_safetensors_files(path):
    state_dict = _model().state_dict()
    _save_safetensors(state_dict, path / "model.safetensors")
    first, second = list(state_dict)[:2], list(state_dict)[2:]
    _save_safetensors({k: state_dict[k] for k in first}, path / "model-00001-of-00002.safetensors")
    _save_safetensors({k: state_dict[k] for k in second}, path / "model-00002-of-00002.safetensors")
    weight_map = dict.fromkeys(first, "model-00001-of-00002.safetensors")
    weight_map.update(dict.fromkeys(second, "model-00002-of-00002.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _run_load_raw(strategy, tmp_path, names):
    expected = _model().state_dict()
    for name in names:
        model = _sharded(strategy)
        strategy.load_checkpoint(tmp_path / name, model)
        _assert_equal_state(_full_state_dict(model), expected)
        model = _sharded(strategy, use_orig_params=False)
        assert strategy.load_checkpoint(tmp_path / name, {"model": model}) == {}
        _assert_equal_state(_full_state_dict(model), expected)


@RunIf(min_torch="2.4")
def test_fsdp_load_raw_state_dict(tmp_path):
    """A raw state dict (``torch.save(model.state_dict())``) loads with both load methods."""
    _write_torch_files(tmp_path)
    _spawn_on_cpu(_run_load_raw, tmp_path, ["model.pt"])


@RunIf(min_torch="2.4")
def test_fsdp_load_legacy_format_in_turns(tmp_path):
    """A file in the legacy format, which cannot be memory-mapped, is read whole by one rank of a node at a time."""
    _write_torch_files(tmp_path)
    _spawn_on_cpu(_run_load_raw, tmp_path, ["legacy.pt"])


@RunIf(min_torch="2.4")
def test_fsdp_load_safetensors_and_hf_index(tmp_path):
    """A ``.safetensors`` file and a Hugging Face index (the file or its folder) load with both load methods."""
    _write_safetensors_files(tmp_path)
    _spawn_on_cpu(_run_load_raw, tmp_path, ["model.safetensors", "model.safetensors.index.json", ""])


class _CountingSource:
    """A tensor of a lazily read checkpoint that counts the elements read from it."""

    read = 0

    def __init__(self, tensor):
        self.tensor = tensor

    def get_shape(self):
        return list(self.tensor.shape)

    def __getitem__(self, index):
        value = self.tensor[index]
        _CountingSource.read += value.numel()
        return value


def _run_reads_own_shards(strategy):
    model = _sharded(strategy)
    # rows of 7 elements: a rank whose shard starts or ends inside a row reads that row whole
    state_dict = {name: _CountingSource(tensor) for name, tensor in _model().state_dict().items()}
    layout = _fsdp_layout(model)
    _copy_module_state(state_dict, _check_module_state(state_dict, model, layout, strict=True), layout)
    total = sum(tensor.numel() for tensor in _model().state_dict().values())
    assert 0 < _CountingSource.read < total * 3 // 4
    _assert_equal_state(_full_state_dict(model), _model().state_dict())


@RunIf(min_torch="2.4")
def test_fsdp_load_reads_only_own_shards():
    """Each rank reads from the checkpoint only the rows that hold its shard of each tensor."""
    _spawn_on_cpu(_run_reads_own_shards)


def _run_load_full_checkpoint(strategy, tmp_path, use_orig_params):
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _sharded(strategy, use_orig_params)
    with FSDP.summon_full_params(model, writeback=True):
        for param in model.parameters():
            param.data.normal_()
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    optim_config = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config, optim_config):
        checkpoint = {
            "model": model.state_dict(),
            "optimizer": FSDP.optim_state_dict(model, optimizer),
            "step": 3,
            "hparams": argparse.Namespace(lr=0.01),  # any object: a full checkpoint is unpickled in full by default
        }
    if strategy.global_rank == 0:
        torch.save(checkpoint, tmp_path / "full.ckpt")
    strategy.barrier()

    loaded = _sharded(strategy, use_orig_params)
    loaded_optimizer = torch.optim.Adam(loaded.parameters(), lr=torch.tensor(0.5))
    state = {"model": loaded, "optimizer": loaded_optimizer, "step": 0}
    remainder = strategy.load_checkpoint(tmp_path / "full.ckpt", state)
    assert remainder == {"hparams": argparse.Namespace(lr=0.01)}
    assert state["step"] == 3
    _assert_equal_state(_full_state_dict(loaded), checkpoint["model"])
    # the optimizer continues exactly where the saved one was
    assert loaded_optimizer.param_groups[0]["lr"] == torch.tensor(0.01)
    with FSDP.state_dict_type(loaded, StateDictType.FULL_STATE_DICT, config, optim_config):
        reloaded = FSDP.optim_state_dict(loaded, loaded_optimizer)
    assert reloaded["state"].keys() == checkpoint["optimizer"]["state"].keys()
    for name, param_state in checkpoint["optimizer"]["state"].items():
        _assert_equal_state(reloaded["state"][name], param_state)


@RunIf(min_torch="2.4")
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp_load_full_checkpoint_shard_local(tmp_path, use_orig_params):
    """A full checkpoint restores the model and the optimizer, each rank copying only its slices."""
    _spawn_on_cpu(_run_load_full_checkpoint, tmp_path, use_orig_params)


def _run_strict_error(strategy, tmp_path):
    model = _sharded(strategy)
    before = _full_state_dict(model)
    optimizer = torch.optim.Adam(model.parameters())
    # a raw state dict holds no optimizer state
    with pytest.raises(KeyError, match="'optimizer' that does not exist in the loaded checkpoint"):
        strategy.load_checkpoint(tmp_path / "model.pt", {"model": model, "optimizer": optimizer})
    _assert_equal_state(_full_state_dict(model), before)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "2.bias"'):
        strategy.load_checkpoint(tmp_path / "partial.pt", model)
    # names were checked before anything was written
    _assert_equal_state(_full_state_dict(model), before)
    strategy.load_checkpoint(tmp_path / "partial.pt", model, strict=False)
    assert torch.equal(_full_state_dict(model)["0.weight"], _model().state_dict()["0.weight"])


@RunIf(min_torch="2.4")
def test_fsdp_load_raw_strict_error_leaves_model_untouched(tmp_path):
    state_dict = _model().state_dict()
    torch.save(state_dict, tmp_path / "model.pt")
    del state_dict["2.bias"]
    torch.save(state_dict, tmp_path / "partial.pt")
    _spawn_on_cpu(_run_strict_error, tmp_path)


def _run_error_on_one_rank(strategy, tmp_path):
    model = _sharded(strategy)
    before = [param.detach().clone() for param in model.parameters()]
    # the file on rank 1 was cut short (a copy that did not finish): torch's zip reader refuses it there
    path = tmp_path / ("model.pt" if strategy.global_rank == 0 else "truncated.pt")
    if strategy.global_rank == 0:
        error, match = RuntimeError, r"failed on rank\(s\) 1: RuntimeError: PytorchStreamReader"
    else:
        error, match = RuntimeError, "PytorchStreamReader failed reading zip archive"
    with pytest.raises(error, match=match):
        # called as the strategy calls it, past the broadcast of rank 0's path
        _load_full_checkpoint(strategy, path, model, _fsdp_layout(model), None, True, None)
    # every rank checks before any rank writes: rank 0, whose file was whole, left its shards as they were too
    for param, previous in zip(model.parameters(), before):
        torch.testing.assert_close(param, previous, rtol=0, atol=0)


@RunIf(min_torch="2.4")
def test_fsdp_load_error_on_one_rank_raises_on_every_rank(tmp_path):
    _write_torch_files(tmp_path)
    data = (tmp_path / "model.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    _spawn_on_cpu(_run_error_on_one_rank, tmp_path)


def _nested(strategy, use_orig_params):
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = _model()
    for param in model.parameters():
        torch.nn.init.zeros_(param)
    # the inner unit comes first in the flat parameters' order, last but one in the model's: the order of an
    # optimizer state keyed by index is the model's
    model[2] = FullyShardedDataParallel(model[2], device_id=strategy.root_device, use_orig_params=use_orig_params)
    model = FullyShardedDataParallel(model, device_id=strategy.root_device, use_orig_params=use_orig_params)
    return strategy.setup_module(model)


def _run_int_keyed_optimizer_state(strategy, tmp_path, use_orig_params):
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _nested(strategy, use_orig_params)
    before = _full_state_dict(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    # a full checkpoint whose optimizer has more parameter groups than this one is refused before anything is written
    with pytest.raises(ValueError, match="has 2 parameter group"):
        strategy.load_checkpoint(tmp_path / "two_groups.ckpt", {"model": model, "optimizer": optimizer})
    _assert_equal_state(_full_state_dict(model), before)
    strategy.load_checkpoint(tmp_path / "single.ckpt", {"model": model, "optimizer": optimizer})
    saved = torch.load(tmp_path / "single.ckpt")
    _assert_equal_state(_full_state_dict(model), saved["model"])
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    optim_config = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config, optim_config):
        reloaded = FSDP.optim_state_dict(model, optimizer)
    names = [name for name, _ in _model().named_parameters()]
    assert reloaded["state"].keys() == set(names)
    for index, name in enumerate(names):
        _assert_equal_state(reloaded["state"][name], saved["optimizer"]["state"][index])
    assert optimizer.param_groups[0]["lr"] == 0.01


@RunIf(min_torch="2.4")
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp_load_optimizer_state_keyed_by_index(tmp_path, use_orig_params):
    """An optimizer state saved without FSDP (keyed by parameter index) restores every parameter's state."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(checkpoint, tmp_path / "single.ckpt")
    checkpoint["optimizer"]["param_groups"].append({**checkpoint["optimizer"]["param_groups"][0], "params": []})
    torch.save(checkpoint, tmp_path / "two_groups.ckpt")
    _spawn_on_cpu(_run_int_keyed_optimizer_state, tmp_path, use_orig_params)


def _run_master_errors(strategy, tmp_path):
    model = _sharded(strategy)
    before = _full_state_dict(model)
    # a file that is neither a module state dict nor holds the requested key
    with pytest.raises(KeyError, match="'model'"):
        strategy.load_checkpoint(tmp_path / "other_key.ckpt", {"model": model})
    # `load_raw` reads the file as the module's state dict, even where it holds a Fabric checkpoint
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "model", "step"'):
        strategy.load_checkpoint(tmp_path / "fabric.ckpt", model)
    _assert_equal_state(_full_state_dict(model), before)


@RunIf(min_torch="2.4")
def test_fsdp_load_keeps_errors_for_other_checkpoints(tmp_path):
    """A checkpoint saved under another key, or a Fabric checkpoint given to ``load_raw``, raises as before."""
    torch.save({"state_dict": _model().state_dict()}, tmp_path / "other_key.ckpt")
    torch.save({"model": _model().state_dict(), "step": 1}, tmp_path / "fabric.ckpt")
    _spawn_on_cpu(_run_master_errors, tmp_path)


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


def _run_extra_state(strategy, tmp_path):
    from torch.distributed.fsdp import FullyShardedDataParallel

    with torch.device("cpu"):
        model = nn.Sequential(_WithExtraState(5, 7), nn.ReLU(), nn.Linear(7, 3))
    model = strategy.setup_module(FullyShardedDataParallel(model, device_id=strategy.root_device))
    layer = next(module for module in model.modules() if isinstance(module, _WithExtraState))
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0._extra_state"'):
        strategy.load_checkpoint(tmp_path / "without.pt", model)
    assert layer.extra == {"calls": 0}
    strategy.load_checkpoint(tmp_path / "full.ckpt", {"model": model})
    assert layer.extra == {"calls": 3}


@RunIf(min_torch="2.4")
def test_fsdp_load_sets_extra_state(tmp_path):
    """A module's extra state (``get_extra_state``) is set from the checkpoint, and missing it is a strict error."""
    # a module held under two names saves its extra state under each, and both are expected
    shared = _WithExtraState(5, 5)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert set(_extra_states(model)) == {name for name in model.state_dict() if name.endswith("_extra_state")}
    _write_extra_state_files(tmp_path)
    _spawn_on_cpu(_run_extra_state, tmp_path)


def _save_safetensors(tensors, path):
    # `safetensors` is optional: the tests that write such files are skipped without it
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file(tensors, path)


def _run_missing_keys(strategy, tmp_path):
    model = _sharded(strategy)
    before = _full_state_dict(model)
    optimizer = torch.optim.Adam(model.parameters())
    # a key that the checkpoint lacks is found before anything is written (master wrote the model first)
    for state in ({"model": model, "optimizer": optimizer}, {"model": model, "epoch": 0}):
        with pytest.raises(KeyError, match="that does not exist in the loaded checkpoint"):
            strategy.load_checkpoint(tmp_path / "fabric.ckpt", state)
        _assert_equal_state(_full_state_dict(model), before)
    # with `strict=False`, an optimizer without state in the checkpoint is left as it is (master raised `KeyError`)
    state = {"model": model, "optimizer": optimizer}
    remainder = strategy.load_checkpoint(tmp_path / "fabric.ckpt", state, strict=False)
    assert remainder == {"step": 1}
    assert optimizer.state_dict()["state"] == {}
    _assert_equal_state(_full_state_dict(model), _model().state_dict())


@RunIf(min_torch="2.4")
def test_fsdp_load_missing_keys_found_before_writing(tmp_path):
    """A requested key that a full checkpoint lacks raises before the model is written (skipped with strict=False)."""
    torch.save({"model": _model().state_dict(), "step": 1}, tmp_path / "fabric.ckpt")
    _spawn_on_cpu(_run_missing_keys, tmp_path)
