"""A gather-free full save that fails on one rank: one error on every rank, the earlier file kept, no temporary file."""

import errno
import os
import signal
import subprocess
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


def _setup(width: int) -> tuple[Fabric, nn.Module, torch.optim.Optimizer]:
    from lightning_fsdp.loading import agreement

    agreement._UNRESPONSIVE_AFTER_S = 3.0  # a killed rank is named within seconds, inside the runner's grace period
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="full")
    fabric = Fabric(accelerator="cpu", devices=3, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(1)
    model = fabric.setup_module(nn.Sequential(nn.Linear(width, width), nn.Linear(width, 3)))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    fabric.backward(model(torch.randn(2, width)).sum())
    optimizer.step()
    return fabric, model, optimizer


def _save_with_fault(path: str, fault: str, width: int) -> str:
    fabric, model, optimizer = _setup(width)
    real_pwrite = os.pwrite

    def failing_pwrite(fd: int, data: bytes, offset: int) -> int:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    faulty = fault in ("eio", "kill") and fabric.global_rank == 1
    with mock.patch("os.pwrite", failing_pwrite if faulty else real_pwrite):
        try:
            fabric.save(path, {"model": model, "optimizer": optimizer})
        except CheckpointSaveError as error:
            if fault == "kill":
                Path(f"{path}.error-{fabric.global_rank}").write_text(str(error))
            return str(error)
    return ""


def _assert_untouched(path: Path) -> None:
    assert path.read_bytes() == _EARLIER
    leftovers = [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_io_error_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    path.write_bytes(_EARLIER)
    errors = run_distributed(_save_with_fault, str(path), "eio", 8, devices=3)
    for error in errors:
        assert "rank 1" in error
        assert "Input/output error" in error
    _assert_untouched(path)


def test_killed_rank_fails_every_other_rank(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    path.write_bytes(_EARLIER)
    with pytest.raises(AssertionError, match=r"no result from ranks \[1\]"):
        run_distributed(_save_with_fault, str(path), "kill", 8, devices=3)
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
