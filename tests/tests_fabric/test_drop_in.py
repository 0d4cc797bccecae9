"""A faithful drop-in: the same call raises what upstream's class raises, keeps its seams, and works unlaunched.

Each error case runs the same call on upstream's `FSDPStrategy` and on this package's, so these tests fail when
Lightning changes a message or an exception type. A strategy that was never launched has no process group: unit
tests build one and call its methods directly, and every path must then work as a single process.
"""

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.fabric.strategies import FSDPStrategy as UpstreamFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as UpstreamModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_fsdp import CheckpointLoadError, CheckpointPathError, FSDPStrategy, ModelParallelStrategy
from tests.tests_fabric.helpers.checkpoints import FORMATS, write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import TinyTransformer

# It compares this package's class with upstream's, which are one class once the change is upstream.


def _fsdp_model() -> Any:
    """A stand-in that upstream's `_has_fsdp_modules` takes for an FSDP model (a real one needs a process group)."""
    model = mock.Mock(spec=FullyShardedDataParallel)
    model.modules.return_value = [model]
    return model


def _strategy(cls: type, launched_devices: bool, **kwargs: Any) -> UpstreamFSDPStrategy:
    strategy = cls(parallel_devices=[torch.device("cpu")] * 2 if launched_devices else None, **kwargs)
    assert type(strategy) is cls  # `lightning_fsdp.enable()` must not be in effect here
    return strategy


def _error_of(call: Callable[[], Any]) -> Exception:
    try:
        call()
    except Exception as error:
        return error
    raise AssertionError("The call raised nothing")


def _assert_raises_as_upstream(method: str, launched_devices: bool, strategy_kwargs: dict, **kwargs: Any) -> Exception:
    """Upstream's exception type, and upstream's message at the start of ours (tests in the wild `match` on it)."""
    theirs = _error_of(
        lambda: getattr(_strategy(UpstreamFSDPStrategy, launched_devices, **strategy_kwargs), method)(**kwargs)
    )
    ours = _error_of(lambda: getattr(_strategy(FSDPStrategy, launched_devices, **strategy_kwargs), method)(**kwargs))
    assert isinstance(ours, type(theirs)), f"upstream raised {theirs!r}, this package {ours!r}"
    assert str(ours).startswith(str(theirs)), f"upstream: {theirs}\nthis package: {ours}"
    return ours


def _linear_sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


_STATE_CASES = {
    "state-none": lambda: None,
    "state-empty": dict,
    "lone-optimizer": _linear_sgd,
    "no-model": lambda: {"other": "data"},
    "model-not-fsdp": lambda: {"model": nn.Linear(2, 2), "optimizer": _linear_sgd()},
    "several-fsdp-models": lambda: {"model1": _fsdp_model(), "model2": _fsdp_model()},
}


@pytest.mark.parametrize("launched_devices", [True, False], ids=["with-devices", "without-devices"])
@pytest.mark.parametrize("case", list(_STATE_CASES))
def test_load_checkpoint_checks_arguments_as_upstream(tmp_path, case, launched_devices):
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save(nn.Linear(2, 2).state_dict(), checkpoint)
    _assert_raises_as_upstream("load_checkpoint", launched_devices, {}, path=checkpoint, state=_STATE_CASES[case]())


_PATH_CASES = {
    # (upstream's API, what the path is) -> (the state, the path, what this package adds to upstream's message)
    "load-empty-directory": (lambda: {"model": _fsdp_model()}, "empty", "holds no checkpoint"),
    "load-missing-path": (lambda: {"model": _fsdp_model()}, "missing.pt", "does not exist"),
    "load-directory-without-checkpoint": (lambda: {"model": _fsdp_model()}, "other", "holds no checkpoint"),
    "load_raw-empty-directory": (lambda: nn.Linear(2, 2), "empty", "holds no checkpoint"),
    "load_raw-missing-path": (lambda: nn.Linear(2, 2), "missing.pt", "does not exist"),
}


@pytest.mark.parametrize("case", list(_PATH_CASES))
def test_path_errors_are_upstreams_and_ours(tmp_path, case):
    """Upstream's `ValueError` for a path that is not a checkpoint, which is also a `CheckpointLoadError`.

    The message starts with what is wrong, as this package found it. Upstream's text follows for a path that exists
    (upstream's tests `match` on it); for a path that does not exist, it would only mislead ("must be a single file").

    """
    make_state, name, our_reason = _PATH_CASES[case]
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    torch.save({}, tmp_path / "other" / "notes.pt")  # a file, but no `.metadata`, index or `model.safetensors`
    path = tmp_path / name
    theirs = _error_of(lambda: _strategy(UpstreamFSDPStrategy, True).load_checkpoint(path=path, state=make_state()))
    error = _error_of(lambda: _strategy(FSDPStrategy, True).load_checkpoint(path=path, state=make_state()))
    assert isinstance(error, type(theirs))
    assert isinstance(error, ValueError)
    assert isinstance(error, CheckpointPathError)
    assert our_reason in str(error).splitlines()[0]
    assert (str(theirs) in str(error)) == path.exists()


@pytest.mark.parametrize("raw", [False, True], ids=["load", "load_raw"])
def test_model_parallel_path_errors_are_upstreams_and_ours(tmp_path, raw):
    """`ModelParallelStrategy` answers a directory that holds no checkpoint as upstream does, after the model search."""
    path = tmp_path / "empty"
    path.mkdir()
    errors = []
    # Upstream's own tests patch its model search this way: a model on one process has no `DTensor` parameters.
    with mock.patch("lightning.fabric.strategies.model_parallel._has_dtensor_modules", return_value=True):
        for cls in (UpstreamModelParallelStrategy, ModelParallelStrategy):
            model = nn.Linear(2, 2)
            strategy = cls(parallelize_fn=lambda module, _: module)
            load = functools.partial(strategy.load_checkpoint, path, state=model if raw else {"model": model})
            errors.append(_error_of(load))
    theirs, ours = errors
    assert isinstance(ours, type(theirs)), f"upstream raised {theirs!r}, this package {ours!r}"
    assert isinstance(ours, CheckpointPathError)
    # What is wrong comes first; upstream's text follows, for code that matches it (the directory exists).
    assert "holds no checkpoint" in str(ours).splitlines()[0]
    assert str(theirs) in str(ours), f"upstream: {theirs}\nthis package: {ours}"


@pytest.mark.parametrize("raw", [False, True], ids=["load", "load_raw"])
def test_a_missing_remote_object_is_a_path_error_as_upstreams(raw):
    """An fsspec URL is read by this package; nothing there is upstream's `ValueError`, and ours says so."""
    path = "memory://checkpoints/model.ckpt"
    errors = [
        _error_of(
            functools.partial(
                _strategy(cls, launched_devices=True).load_checkpoint,
                path,
                state=nn.Linear(2, 2) if raw else {"model": _fsdp_model()},
            )
        )
        for cls in (UpstreamFSDPStrategy, FSDPStrategy)
    ]
    theirs, ours = errors
    assert isinstance(ours, type(theirs)), f"upstream raised {theirs!r}, this package {ours!r}"
    assert isinstance(ours, CheckpointPathError)
    assert "'memory:///checkpoints/model.ckpt' does not exist" in str(ours).splitlines()[0]


@pytest.mark.parametrize("cls", [FSDPStrategy, ModelParallelStrategy])
def test_the_path_is_checked_before_the_model(tmp_path, cls):
    """An empty file is refused even for the model double of Lightning's own unit tests, whose layout cannot be read."""
    path = tmp_path / "full.ckpt"
    path.touch()
    model = mock.Mock(spec=nn.Module)  # what upstream's tests pass: `modules()` is not iterable
    model.parameters.return_value = [torch.zeros(2, 1)]
    strategy = cls(parallelize_fn=lambda module, _: module) if cls is ModelParallelStrategy else cls()
    with pytest.raises(CheckpointLoadError, match=r"is empty \(0 bytes\)"):
        strategy.load_checkpoint(path, state=model)


def test_what_upstream_cannot_read_is_not_a_path_error(tmp_path):
    """A Hugging Face directory is no checkpoint to upstream, but this package reads it: no `ValueError`."""
    torch.manual_seed(0)
    source = nn.Linear(4, 4)
    directory = write_checkpoint(source.state_dict(), tmp_path / "hf", "hf-directory")
    model = nn.Linear(4, 4)
    assert FSDPStrategy().load_checkpoint(directory, model) == {}
    torch.testing.assert_close(model.state_dict(), source.state_dict())
    # A checkpoint that this package reads but that does not fit the model is not upstream's path error either.
    with pytest.raises(CheckpointLoadError, match="shape") as info:
        FSDPStrategy().load_checkpoint(directory, nn.Linear(4, 5))
    assert not isinstance(info.value, ValueError)


_SAVE_CASES = {
    "storage-options": ({}, {"state": {}, "storage_options": object()}),
    "no-model": ({}, {"state": {}}),
    "model-not-fsdp": ({}, {"state": {"model": nn.Linear(2, 2)}}),
    "several-fsdp-models": ({}, {"state": {"a": _fsdp_model(), "b": _fsdp_model()}}),
    "filter-with-sharded": ({"state_dict_type": "sharded"}, {"state": {}, "filter": {"model": lambda *_: True}}),
    "unknown-state-dict-type": ({"state_dict_type": "invalid"}, {"state": {"model": _fsdp_model()}}),
}


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
@pytest.mark.parametrize("launched_devices", [True, False], ids=["with-devices", "without-devices"])
@pytest.mark.parametrize("case", list(_SAVE_CASES))
def test_save_checkpoint_checks_arguments_as_upstream(tmp_path, case, launched_devices, state_dict_type):
    """With or without devices: this class only reads `root_device` where upstream does (a full save on CPU)."""
    strategy_kwargs, call_kwargs = _SAVE_CASES[case]
    strategy_kwargs = {"state_dict_type": state_dict_type, **strategy_kwargs}
    _assert_raises_as_upstream(
        "save_checkpoint", launched_devices, strategy_kwargs, path=tmp_path / "ckpt", **call_kwargs
    )


@pytest.mark.parametrize("launched_devices", [True, False], ids=["with-devices", "without-devices"])
def test_save_full_checkpoint_refuses_a_directory_as_upstream(tmp_path, launched_devices):
    (tmp_path / "not-a-checkpoint").mkdir()
    error = _assert_raises_as_upstream(
        "save_checkpoint",
        launched_devices,
        {"state_dict_type": "full"},
        path=tmp_path / "not-a-checkpoint",
        state={"model": _fsdp_model()},
    )
    assert isinstance(error, IsADirectoryError)


@pytest.mark.parametrize("cls", [UpstreamModelParallelStrategy, ModelParallelStrategy])
def test_model_parallel_save_refuses_a_directory_before_reading_the_state(tmp_path, cls):
    """Lightning's own `test_save_checkpoint_path_exists`: the path is checked before `state` is read (a `Mock`)."""
    (tmp_path / "not-empty").mkdir()
    (tmp_path / "not-empty" / "file").touch()
    strategy = cls(parallelize_fn=lambda model, _: model, save_distributed_checkpoint=False)
    with pytest.raises(IsADirectoryError, match="exists and is a directory"):
        strategy.save_checkpoint(path=tmp_path / "not-empty", state=mock.Mock())


@mock.patch("lightning.fabric.strategies.fsdp.torch.save")
@mock.patch("lightning.fabric.strategies.fsdp._get_full_state_dict_context")
def test_save_checkpoint_without_devices_is_upstreams(full_context, torch_save, tmp_path):
    """Without devices nothing is known to run on CPU: upstream's method runs, with its helpers."""
    model = _fsdp_model()
    broadcast = mock.Mock(side_effect=lambda obj, src=0: obj)
    strategy = FSDPStrategy(state_dict_type="full")
    with mock.patch.object(UpstreamFSDPStrategy, "broadcast", broadcast):
        strategy.save_checkpoint(tmp_path / "full.pt", {"model": model, "step": 3})
    broadcast.assert_called_once_with(tmp_path / "full.pt")
    full_context.assert_called_once_with(model, world_size=1)
    torch_save.assert_called_once()
    assert torch_save.call_args.args[0]["step"] == 3


def test_load_checkpoint_loads_from_the_broadcast_path(tmp_path):
    """The path comes from `self.broadcast` (rank 0's path), as upstream's; patching it reaches this class."""
    torch.manual_seed(0)
    rank_zero_file = tmp_path / "rank0.pt"
    source = nn.Linear(3, 3)
    torch.save(source.state_dict(), rank_zero_file)
    broadcast = mock.Mock(return_value=str(rank_zero_file))
    model = nn.Linear(3, 3)
    with mock.patch.object(UpstreamFSDPStrategy, "broadcast", broadcast):
        FSDPStrategy().load_checkpoint(tmp_path / "this-rank-sees-another-path.pt", model)
    broadcast.assert_called_once()
    torch.testing.assert_close(model.state_dict(), source.state_dict())


class _FakeFSDP(nn.Module):
    """Records how FSDP was called, without a process group."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.kwargs = kwargs


@pytest.mark.parametrize("device", [torch.device("cpu"), torch.device("cuda", 0)], ids=["cpu", "cuda"])
def test_setup_module_keeps_upstreams_seams(device):
    """Upstream's helpers are called through upstream's module (patchable); off CPU, upstream's method runs."""
    strategy = FSDPStrategy(parallel_devices=[device], activation_checkpointing_policy={nn.Linear})
    with (
        mock.patch("torch.distributed.fsdp.FullyShardedDataParallel", _FakeFSDP),
        mock.patch("lightning.fabric.strategies.fsdp._setup_activation_checkpointing") as checkpointing,
        mock.patch("lightning.fabric.strategies.fsdp._move_torchmetrics_to_device") as metrics,
        mock.patch("torch.distributed.fsdp.wrap.enable_wrap") as enable_wrap,
    ):
        wrapped = strategy.setup_module(nn.Sequential(nn.Linear(2, 2)))
        strategy.module_sharded_context()
    assert isinstance(wrapped, _FakeFSDP)
    checkpointing.assert_called_once_with(wrapped, strategy._activation_checkpointing_kwargs)
    metrics.assert_called_once_with(wrapped, device)
    # Upstream passes the index, which is `None` on CPU and refused by FSDP: the device itself serves there.
    expected_device_id = device if device.type == "cpu" else device.index
    assert wrapped.kwargs["device_id"] == expected_device_id
    assert enable_wrap.call_args.kwargs["device_id"] == expected_device_id


def _source_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return TinyTransformer().state_dict()


@pytest.mark.parametrize("launched_devices", [True, False], ids=["with-devices", "without-devices"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_unlaunched_load_raw_is_a_single_process_load(tmp_path, fmt, launched_devices):
    """No process group: every format loads into a plain module, as one process (no turns, no agreement)."""
    source = _source_state()
    path = write_checkpoint(source, tmp_path, fmt)
    for weights_only in (None, False):  # `False` reads a pickled file whole, in a turn: a no-op for one process
        model = TinyTransformer()
        strategy = _strategy(FSDPStrategy, launched_devices, load_concurrency=1)
        assert strategy.load_checkpoint(path, model, weights_only=weights_only) == {}
        torch.testing.assert_close(model.state_dict(), source)


def test_unlaunched_load_raw_matches_upstream(tmp_path):
    """Where upstream reads the file too (a zip file into a plain module), both give the same model."""
    source = _source_state()
    path = write_checkpoint(source, tmp_path, "torch-zip")
    ours, theirs = TinyTransformer(), TinyTransformer()
    FSDPStrategy().load_checkpoint(path, ours)
    UpstreamFSDPStrategy().load_checkpoint(path, theirs)
    torch.testing.assert_close(ours.state_dict(), theirs.state_dict())


def test_unlaunched_strategy_loads_nothing_into_a_dict_without_fsdp_model(tmp_path: Path):
    """`fabric.load` needs a model set up through the strategy (FSDP-wrapped), as upstream says."""
    path = write_checkpoint(_source_state(), tmp_path, "torch-zip")
    model = TinyTransformer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="Could not find a FSDP model in the provided checkpoint state"):
        FSDPStrategy().load_checkpoint(path, {"model": model})
    torch.testing.assert_close(model.state_dict(), before)


def _load_missing_path(path: str) -> tuple[bool, bool, str]:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy())
    fabric.launch()
    model = fabric.setup_module(TinyTransformer())
    try:
        fabric.load(path, {"model": model})
    except Exception as error:
        return isinstance(error, ValueError), isinstance(error, CheckpointLoadError), str(error)
    raise AssertionError("`fabric.load` of a missing path raised nothing")


def test_path_error_is_the_same_on_every_rank(tmp_path):
    """Launched: every rank goes through the loader (and its agreement), then raises upstream's error type."""
    path = str(tmp_path / "missing.pt")
    for is_value_error, is_load_error, message in run_distributed(_load_missing_path, path, devices=2):
        assert is_value_error
        assert is_load_error
        assert message.startswith(f"Loading {path!r} failed on ranks 0-1: The checkpoint path {path!r} does not exist")
        assert "does not point to a valid checkpoint" not in message
