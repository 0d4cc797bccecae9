"""A gather-free full save that fails on one rank: one error on every rank, the earlier file kept, no temporary file."""

import errno
import os
import signal
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.saving import CheckpointSaveError
from tests.tests_fabric.helpers.distributed import run_distributed

# The gather-free save is an extension (#28): it is not carried upstream with the core.

_EARLIER = b"an earlier checkpoint"


def _setup(width: int, background: bool = False) -> tuple[Fabric, nn.Module, torch.optim.Optimizer]:
    from lightning_fsdp.distributed import agreement

    agreement._UNRESPONSIVE_AFTER_S = 3.0  # a killed rank is named within seconds, inside the runner's grace period
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="full", save_in_background=background)
    fabric = Fabric(accelerator="cpu", devices=3, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(1)
    model = fabric.setup_module(nn.Sequential(nn.Linear(width, width), nn.Linear(width, 3)))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    fabric.backward(model(torch.randn(2, width)).sum())
    optimizer.step()
    return fabric, model, optimizer


def _save_with_fault(path: str, fault: str, width: int, background: bool = False) -> str:
    fabric, model, optimizer = _setup(width, background)
    real_pwrite = os.pwrite
    store = torch.distributed.distributed_c10d._get_default_store()

    def failing_pwrite(fd: int, data: bytes, offset: int) -> int:
        if fault == "kill":
            if background:
                # die once every rank has returned from the call (Fabric's save ends with a barrier, which a rank
                # killed earlier fails): the error must come at the wait, with no collective in between
                while store.add("returned", 0) < fabric.world_size:
                    time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    faulty = fault in ("eio", "kill") and fabric.global_rank == 1
    with mock.patch("os.pwrite", failing_pwrite if faulty else real_pwrite):
        try:
            fabric.save(path, {"model": model, "optimizer": optimizer})
            store.add("returned", 1)
            if background:
                # the call returned before the write, and the error comes at the wait. Training goes on meanwhile,
                # except after a kill: a step's collectives would fail on the dead rank first, as they do in a run
                if fault != "kill":
                    _step(fabric, model, optimizer)
                fabric.strategy.wait_for_save()
        except CheckpointSaveError as error:
            if fault == "kill":
                Path(f"{path}.error-{fabric.global_rank}").write_text(str(error))
            return str(error)
    if fault == "kill":  # said in the test's failure: this rank's save did not raise
        Path(f"{path}.error-{fabric.global_rank}").write_text("(the save did not raise)")
    return ""


def _step(fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fabric.backward(model(torch.randn(2, model.module[0].in_features)).sum())
    optimizer.step()


def _assert_untouched(path: Path) -> None:
    assert path.read_bytes() == _EARLIER
    leftovers = [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


@pytest.mark.parametrize("background", [False, True], ids=["in-the-call", "in-the-background"])
def test_io_error_on_one_rank_fails_every_rank(tmp_path: Path, background: bool) -> None:
    path = tmp_path / "model.ckpt"
    path.write_bytes(_EARLIER)
    errors = run_distributed(_save_with_fault, str(path), "eio", 8, background, devices=3)
    for error in errors:
        assert "rank 1" in error
        assert "Input/output error" in error
    _assert_untouched(path)


@pytest.mark.parametrize("background", [False, True], ids=["in-the-call", "in-the-background"])
def test_killed_rank_fails_every_other_rank(tmp_path: Path, background: bool) -> None:
    path = tmp_path / "model.ckpt"
    path.write_bytes(_EARLIER)
    with pytest.raises(AssertionError, match=r"no result from ranks \[1\]"):
        run_distributed(_save_with_fault, str(path), "kill", 8, background, devices=3)
    for rank in (0, 2):
        error = Path(f"{path}.error-{rank}").read_text()
        assert "rank 1" in error
        assert "stopped responding" in error
    _assert_untouched(path)


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_disk_full_fails_every_rank(small_tmpfs: Path) -> None:
    path = small_tmpfs / "model.ckpt"
    path.write_bytes(_EARLIER)
    # 256 x 256 float32 weights with Adam's two states: 768 KiB, three times the file system's size
    errors = run_distributed(_save_with_fault, str(path), "none", 256, devices=3)
    for error in errors:
        assert "No space left on device" in error
    assert len(set(errors)) == 1
    _assert_untouched(path)


def _printed_cause(error: BaseException) -> BaseException | None:
    return error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def _save_into_missing_folder(path: str) -> tuple[str, list[str], bool]:
    from lightning_fsdp.loading.errors import _PRINTED_BY_LOCAL_RANK_ZERO

    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="full")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3)))
    try:
        fabric.save(path, {"model": model})
    except CheckpointSaveError as error:
        # the chain as Python prints it: a cause, or else a context that `raise ... from` did not suppress
        chain, cause = [], _printed_cause(error)
        while cause is not None:
            chain.append(type(cause).__name__)
            cause = _printed_cause(cause)
        return str(error), chain, hasattr(error, _PRINTED_BY_LOCAL_RANK_ZERO)
    raise AssertionError("the save into a missing folder did not fail")


def test_a_missing_folder_is_named_on_every_rank_and_printed_once_per_node(tmp_path):
    """The error names the folder and the fix, not the temporary file; it chains no load error; rank 1 prints a line."""
    folder = tmp_path / "newdir" / "sub"
    results = run_distributed(_save_into_missing_folder, str(folder / "full.ckpt"), devices=2)
    (message_0, chain_0, short_0), (message_1, chain_1, short_1) = results
    assert message_0 == message_1
    assert f"The folder {str(folder)!r} to save 'full.ckpt' in does not exist" in message_0
    assert "os.makedirs(" in message_0
    assert ".tmp" not in message_0
    assert chain_0 == ["FileNotFoundError"]  # rank 0's own failure, no `CheckpointLoadError` between
    assert chain_1 == []
    assert (short_0, short_1) == (False, True)  # rank 1's uncaught error would print one line, not the traceback
    assert not (tmp_path / "newdir").exists()
