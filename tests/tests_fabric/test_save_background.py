"""Full checkpoints saved in the background (`save_in_background=True`): a snapshot, never a mix; failures raised later.

Each test runs real ranks (gloo) of Fabric with this package's strategies. The background write is held back until the
training loop has stepped (a test hook on the save thread), so that the file can only hold the state at the call if
the save copied it: the assertion does not depend on how fast the disk is.
"""

import errno
import os
import threading
from pathlib import Path
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.saving import CheckpointSaveError
from lightning_fsdp.saving.background import BackgroundSaves, HostBuffers
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.state import assert_identical

# Saving in the background is an extension (#36): it is not carried upstream with the core.

_EARLIER = b"an earlier checkpoint"


def _parallelize(model: nn.Module, device_mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer, mesh=device_mesh["data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _setup(strategy_name: str, sharded: bool = False) -> tuple[Fabric, nn.Module, torch.optim.Optimizer]:
    if strategy_name == "fsdp2":
        strategy = ModelParallelStrategy(
            _parallelize,
            data_parallel_size=2,
            tensor_parallel_size=1,
            save_distributed_checkpoint=sharded,
            save_in_background=True,
        )
    else:
        state_dict_type = "sharded" if sharded else "full"
        strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=state_dict_type, save_in_background=True)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(1)
    model = fabric.setup_module(nn.Sequential(nn.Linear(9, 16), nn.ReLU(), nn.Linear(16, 3)))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    _step(fabric, model, optimizer)
    return fabric, model, optimizer


def _step(fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fabric.backward(model(torch.randn(4, 9)).sum())
    optimizer.step()
    optimizer.zero_grad()


def _held_back_saves() -> tuple[threading.Event, mock._patch]:
    """A hook on the save thread: the background part of a save starts only once the event is set."""
    release = threading.Event()
    real_run = BackgroundSaves._run

    def run(self, rest):
        release.wait(timeout=60)
        real_run(self, rest)

    return release, mock.patch.object(BackgroundSaves, "_run", run)


def _save_steps_then_wait(strategy_name: str, folder: str) -> tuple[bool, bool, bool]:
    fabric, model, optimizer = _setup(strategy_name)
    background = fabric.strategy._background_saves
    state = {"model": model, "optimizer": optimizer, "step": 1}
    # the reference: the synchronous gather-free save of the same state (bit-exact with Lightning's, test_save_*)
    fabric.strategy._background_saves = None
    fabric.save(f"{folder}/reference.ckpt", state)
    fabric.strategy._background_saves = background

    # the first optimizer step reserved the host memory of the saves, in a thread: the first save copies into it
    background.buffers._wait_reserved()
    reserved = background.buffers.arena
    release, held_back = _held_back_saves()
    with held_back:
        fabric.save(f"{folder}/background.ckpt", state)
        in_reserved = reserved is not None and background.buffers.arena is reserved
        in_flight = background.in_flight and not Path(f"{folder}/background.ckpt").exists()
        for _ in range(3):  # training goes on while the save is in flight: the model and Adam's state change
            _step(fabric, model, optimizer)
        release.set()
        fabric.strategy.wait_for_save()
    arena = background.buffers.arena
    # a second save reuses the host memory of the first
    fabric.save(f"{folder}/second.ckpt", {"model": model, "optimizer": optimizer, "step": 4})
    fabric.strategy.wait_for_save()
    reused = in_reserved and background.buffers.arena is arena
    # a load waits for the save in flight: the file it reads is complete
    fabric.save(f"{folder}/third.ckpt", {"model": model, "optimizer": optimizer, "step": 5})
    remainder = fabric.load(f"{folder}/third.ckpt", {"model": model, "optimizer": optimizer})
    return in_flight, reused, remainder == {"step": 5}


@pytest.mark.parametrize("strategy_name", ["fsdp1", "fsdp2"])
def test_background_save_holds_the_state_at_the_call(strategy_name, tmp_path):
    """The optimizer steps three times while the file is written: the file holds the state at the call, bit for bit
    the synchronous save's; the first save copies into the host memory reserved at the first optimizer step, and the
    next save reuses it; a load waits for the save in flight."""
    results = run_distributed(_save_steps_then_wait, strategy_name, str(tmp_path), devices=2)
    assert [in_flight for in_flight, _, _ in results] == [True, True]
    assert all(reused for _, reused, _ in results)
    assert all(loaded for _, _, loaded in results)
    background, reference = (
        torch.load(tmp_path / f"{name}.ckpt", weights_only=True) for name in ("background", "reference")
    )
    assert_identical(background, reference)
    second = torch.load(tmp_path / "second.ckpt", weights_only=True)
    assert second["step"] == 4
    assert not torch.equal(second["model"]["0.weight"], background["model"]["0.weight"])  # the steps did train
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def _export_steps_then_wait(strategy_name: str, folder: str) -> bool:
    from lightning_fsdp.saving import save_safetensors

    fabric, model, optimizer = _setup(strategy_name)
    background = fabric.strategy._background_saves
    fabric.strategy._background_saves = None  # the reference: the synchronous export of the same weights
    save_safetensors(fabric, f"{folder}/reference.safetensors", model)
    save_safetensors(fabric, f"{folder}/reference", model, max_shard_size=300)
    fabric.strategy._background_saves = background

    release, held_back = _held_back_saves()
    with held_back:
        save_safetensors(fabric, f"{folder}/background.safetensors", model)
        in_flight = background.in_flight and not Path(f"{folder}/background.safetensors").exists()
        for _ in range(3):
            _step(fabric, model, optimizer)
        release.set()
        # the next export waits for this one, then runs in the background in its turn (a directory of shards)
        save_safetensors(fabric, f"{folder}/background", model, max_shard_size=300)
        fabric.strategy.wait_for_save()
    return in_flight


@pytest.mark.parametrize("strategy_name", ["fsdp1", "fsdp2"])
def test_background_export_holds_the_weights_at_the_call(strategy_name, tmp_path):
    """`save_safetensors` with `save_in_background=True`: the file holds the weights at the call although the
    optimizer steps during the write (byte for byte the synchronous export's), and a directory export follows it."""
    results = run_distributed(_export_steps_then_wait, strategy_name, str(tmp_path), devices=2)
    assert results == [True, True]
    assert (tmp_path / "background.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    shards = sorted(path.name for path in (tmp_path / "background").iterdir())
    assert shards == sorted(path.name for path in (tmp_path / "reference").iterdir())
    assert "model.safetensors.index.json" in shards
    # the directory was exported after the three steps: its weights differ from the first export's
    from safetensors.torch import load_file

    first = load_file(tmp_path / "background.safetensors")
    later = {}
    for name in shards:
        if name.endswith(".safetensors"):
            later.update(load_file(tmp_path / "background" / name))
    assert first.keys() == later.keys()
    assert any(not torch.equal(first[key], later[key]) for key in first)
    assert [p.name for p in tmp_path.rglob("*") if p.name.endswith(".tmp")] == []


def _local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    tensors = list(model.parameters())
    tensors += [value for state in optimizer.state.values() for _, value in sorted(state.items())]
    return [(t.to_local() if isinstance(t, DTensor) else t).detach().clone() for t in tensors]


def _same(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _sharded_steps_then_wait(strategy_name: str, folder: str) -> tuple[bool, bool, bool, bool]:
    import torch.distributed.checkpoint as dcp

    fabric, model, optimizer = _setup(strategy_name, sharded=True)
    background = fabric.strategy._background_saves
    state = {"model": model, "optimizer": optimizer, "step": 1}
    fabric.strategy._background_saves = None  # the reference: the synchronous sharded save of the same state
    fabric.save(f"{folder}/reference", state)
    fabric.strategy._background_saves = background

    # torch's writing thread starts only once the steps below have changed the model and Adam's state
    release = threading.Event()
    real_save = dcp.save

    def held_back_save(*args, **kwargs):
        release.wait(timeout=60)
        return real_save(*args, **kwargs)

    with mock.patch.object(dcp, "save", held_back_save):
        fabric.save(f"{folder}/background", state)
        in_flight = background.in_flight
        for _ in range(3):
            _step(fabric, model, optimizer)
        trained = _local_state(model, optimizer)
        release.set()
        fabric.strategy.wait_for_save()
    buffers = _data_pointers(background._staged)
    fabric.save(f"{folder}/second", state)  # the next sharded save copies into the same host buffers
    fabric.strategy.wait_for_save()
    reused = bool(buffers) and _data_pointers(background._staged) == buffers
    fabric.load(f"{folder}/reference", state)
    reference = _local_state(model, optimizer)
    fabric.load(f"{folder}/background", state)
    loaded = _local_state(model, optimizer)
    return in_flight, _same(loaded, reference), not _same(loaded, trained), reused


def _data_pointers(state: object) -> list[int]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return [pointer for value in state.values() for pointer in _data_pointers(value)]
    if isinstance(state, (list, tuple)):
        return [pointer for value in state for pointer in _data_pointers(value)]
    if isinstance(state, ShardedTensor):
        return [shard.tensor.data_ptr() for shard in state.local_shards()]
    if isinstance(state, DTensor):
        return [state.to_local().data_ptr()]
    return [state.data_ptr()] if isinstance(state, torch.Tensor) and state.dim() else []


@pytest.mark.parametrize("strategy_name", ["fsdp1", "fsdp2"])
def test_background_sharded_save_holds_the_state_at_the_call(strategy_name, tmp_path):
    """A sharded checkpoint (torch's asynchronous distributed checkpoint): the call returns before the directory is
    written, the optimizer steps three times before torch's thread writes it, and the directory loads back as the
    synchronous save's of the state at the call; the next sharded save reuses the host buffers."""
    results = run_distributed(_sharded_steps_then_wait, strategy_name, str(tmp_path), devices=2)
    assert results == [(True, True, True, True), (True, True, True, True)]


def _failing_background_save(path: str) -> tuple[str, str]:
    fabric, model, optimizer = _setup("fsdp1")
    real_pwrite = os.pwrite

    def failing_pwrite(fd: int, data: bytes, offset: int) -> int:
        if threading.current_thread().name == "lightning-fsdp-save" and fabric.global_rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    with mock.patch("os.pwrite", failing_pwrite):
        fabric.save(path, {"model": model, "optimizer": optimizer})  # returns: the failure comes later
        _step(fabric, model, optimizer)
        try:
            fabric.strategy.wait_for_save()
        except CheckpointSaveError as error:
            raised = str(error)
        else:
            raised = ""
    # the failure was raised once: the next save runs (and succeeds)
    fabric.save(path + ".next", {"model": model, "optimizer": optimizer})
    fabric.strategy.wait_for_save()
    return raised, Path(path).read_bytes().decode(errors="replace")


def test_a_failed_background_save_is_raised_on_every_rank_at_the_next_wait(tmp_path):
    """Disk full on rank 1 during the background write: the next wait raises the same error on both ranks, naming
    rank 1 and the cause; the earlier file is untouched and no temporary file is left."""
    path = tmp_path / "full.ckpt"
    path.write_bytes(_EARLIER)
    results = run_distributed(_failing_background_save, str(path), devices=2)
    for raised, content in results:
        assert "rank 1" in raised
        assert "No space left on device" in raised
        assert content == _EARLIER.decode()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    assert torch.load(tmp_path / "full.ckpt.next", weights_only=True).keys() == {"model", "optimizer"}


def test_host_buffers_reserve_at_the_first_step_and_lay_out_every_save():
    """The arena is sized from an optimizer after its step (parameters and state), allocated in a thread; a save's
    copies are laid out in it, what does not fit (a model's buffers) gets memory of its own, kept for the next save."""
    model = nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    buffers = HostBuffers()
    buffers.reserve_for(optimizer)
    buffers.reserve_for(optimizer)  # once per optimizer
    buffers._wait_reserved()
    arena = buffers.arena
    # the weight (32 floats) and Adam's two states of it, then the bias (4) and its two: each at a multiple of 64 bytes
    assert arena is not None
    assert arena.numel() == 3 * 128 + 64 + 64 + 16
    assert bool((arena == 0).all())  # every page touched in the thread
    sizes = [(32, torch.float32), (4, torch.float32)] * 3 + [(5, torch.int64)]  # and a buffer of the model
    views = buffers.views(sizes, pin=False)
    assert [(view.numel(), view.dtype) for view in views] == sizes
    in_arena = [view.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr() for view in views]
    assert in_arena == [True] * 6 + [False]
    starts = [view.data_ptr() - arena.data_ptr() for view in views[:6]]
    assert all(start % 64 == 0 for start in starts)
    assert starts == sorted(set(starts))
    again = buffers.views(sizes, pin=False)
    assert [view.data_ptr() for view in again] == [view.data_ptr() for view in views]  # reused, overflow included
    weights = buffers.views([(32, torch.float32), (4, torch.float32)], pin=False)  # an export: the arena's start
    assert buffers.arena is arena
    assert [view.data_ptr() for view in weights] == [view.data_ptr() for view in views[:2]]
    unreserved = HostBuffers()  # no optimizer stepped: the first save sizes the arena, and a smaller model shrinks it
    first = unreserved.views(sizes, pin=False)[0]
    assert unreserved.arena is not None
    assert first.data_ptr() == unreserved.arena.data_ptr()
    smaller = unreserved.views([(4, torch.float32)], pin=False)  # no more than one copy is held
    assert unreserved.arena.numel() == 16
    assert smaller[0].numel() == 4


def test_a_reservation_that_fails_leaves_the_save_to_allocate(monkeypatch):
    """Memory that cannot be had at the first step: no error from the thread; the save allocates what it needs."""
    model = nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    buffers = HostBuffers()
    real_empty = torch.empty

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)  # what an exception in a thread would print
    monkeypatch.setattr(torch, "empty", no_memory)
    buffers.reserve_for(optimizer)
    buffers._wait_reserved()
    assert buffers.arena is None
    assert raised == []
    monkeypatch.setattr(torch, "empty", real_empty)
    views = buffers.views([(32, torch.float32)], pin=False)
    assert buffers.arena is not None
    assert views[0].numel() == 32
