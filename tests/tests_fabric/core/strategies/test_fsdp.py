import argparse
import gc
import json
from unittest import mock

import pytest
import torch
import torch.nn as nn

from lightning.fabric.accelerators import CPUAccelerator
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning_fsdp.core.fsdp import FSDPStrategy, _load_full_checkpoint
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


def _write_raw_files(path):
    state_dict = _model().state_dict()
    torch.save(state_dict, path / "model.pt")
    torch.save(state_dict, path / "legacy.pt", _use_new_zipfile_serialization=False)
    _save_safetensors(state_dict, path / "model.safetensors")
    first, second = list(state_dict)[:2], list(state_dict)[2:]
    _save_safetensors({k: state_dict[k] for k in first}, path / "model-00001-of-00002.safetensors")
    _save_safetensors({k: state_dict[k] for k in second}, path / "model-00002-of-00002.safetensors")
    weight_map = dict.fromkeys(first, "model-00001-of-00002.safetensors")
    weight_map.update(dict.fromkeys(second, "model-00002-of-00002.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return state_dict


def _run_load_raw(strategy, tmp_path):
    expected = _model().state_dict()
    for name in ("model.pt", "legacy.pt", "model.safetensors", "model.safetensors.index.json"):
        model = _sharded(strategy)
        strategy.load_checkpoint(tmp_path / name, model)
        _assert_equal_state(_full_state_dict(model), expected)
        model = _sharded(strategy, use_orig_params=False)
        assert strategy.load_checkpoint(tmp_path / name, {"model": model}) == {}
        _assert_equal_state(_full_state_dict(model), expected)


@RunIf(min_torch="2.4")
def test_fsdp_load_raw_state_dict_shard_local(tmp_path):
    """A raw state dict loads into an FSDP model from a torch file (zip or legacy), safetensors or an index."""
    _write_raw_files(tmp_path)
    _spawn_on_cpu(_run_load_raw, tmp_path)


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
        _load_full_checkpoint(path, {"model": model}, True, None, strategy.local_rank, 2)
    if strategy.global_rank == 1:
        # the rank whose file could not be read left its shards as they were
        for param, previous in zip(model.parameters(), before):
            torch.testing.assert_close(param, previous, rtol=0, atol=0)


@RunIf(min_torch="2.4")
def test_fsdp_load_error_on_one_rank_raises_on_every_rank(tmp_path):
    _write_raw_files(tmp_path)
    data = (tmp_path / "model.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    _spawn_on_cpu(_run_error_on_one_rank, tmp_path)


def test_fsdp_module_init_context_sets_own_device(monkeypatch):
    """Tensors created on ``"cuda"`` inside ``init_module`` land on the rank's own GPU (CUDA mocked)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    strategy = FSDPStrategy(
        parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)],
        cluster_environment=LightningEnvironment(),
    )
    with (
        mock.patch("torch.cuda.device") as cuda_device,
        mock.patch.object(FSDPStrategy.__mro__[1], "module_init_context", return_value=mock.MagicMock()),
        strategy.module_init_context(empty_init=False),
    ):
        pass
    cuda_device.assert_called_once_with(torch.device("cuda", 1))


def _save_safetensors(tensors, path):
    # `safetensors` is optional: the tests that write such files are skipped without it
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file(tensors, path)
