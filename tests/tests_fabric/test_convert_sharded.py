"""`lightning-fsdp convert DIRECTORY FILE`: a sharded checkpoint consolidated offline, compared with Lightning's."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.memory import PEAK_GROWTH
from tests.tests_fabric.helpers.models import Block
from tests.tests_fabric.helpers.runif import RunIf
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state
from tests.tests_fabric.test_cli import _cli
from tests.tests_fabric.test_fsdp2 import _Model, _parallelize
from tests.tests_fabric.test_save_consolidated import _compare_files, _Model1, _train

# The offline consolidation is part of the saving extension (#28): it is not carried upstream with the core.


def _consolidate_and_compare(directory: str) -> str:
    """Rank 0: our conversion (through the command line) and Lightning's consolidation of ``directory``, compared."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    ours, reference = f"{directory}.ours.ckpt", f"{directory}.lightning.ckpt"
    result = _cli("convert", directory, ours)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {ours}: ")
    torch.save(_load_distributed_checkpoint(Path(directory)), reference)
    _compare_files(ours, reference)
    assert not [name for name in os.listdir(Path(ours).parent) if name.endswith(".tmp")]
    return ours


def _fsdp1(checkpoint_dir: str) -> int:
    strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")
    fabric = Fabric(accelerator="cpu", devices=3, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(1)
    with fabric.init_module():
        model = _Model1(tie_weights=False)  # a unit of two elements: rank 2's shard of it is empty
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    _train(fabric, model, optimizer)
    expected = gather_full_state(model, optimizer)
    directory = f"{checkpoint_dir}/fsdp1"
    fabric.save(directory, {"model": model, "optimizer": optimizer, "step": 2, "hparams": {"lr": 0.01, "name": "x"}})
    if fabric.global_rank == 0:
        _consolidate_and_compare(directory)
    fabric.barrier()
    # the consolidated file restores the model and the optimizer through `fabric.load`
    fabric.seed_everything(2)
    with fabric.init_module():
        fresh = _Model1(tie_weights=False)
    fresh = fabric.setup_module(fresh)
    fresh_optimizer = fabric.setup_optimizers(torch.optim.Adam(fresh.parameters(), lr=0.5))
    loaded = {"model": fresh, "optimizer": fresh_optimizer, "step": 0, "hparams": None}
    fabric.load(f"{directory}.ours.ckpt", loaded)
    assert (loaded["step"], loaded["hparams"]) == (2, {"lr": 0.01, "name": "x"})
    assert_same_state(gather_full_state(fresh, fresh_optimizer), expected)
    return 1


def test_fsdp1_sharded_checkpoint_consolidates_as_lightning_does(tmp_path: Path) -> None:
    assert run_distributed(_fsdp1, str(tmp_path), devices=3) == [1] * 3


def _fsdp2(checkpoint_dir: str, layouts: list[str]) -> int:
    for layout in layouts:
        data_parallel = 2 if layout == "fsdp_tensor_parallel" else 4
        strategy = ModelParallelStrategy(
            _parallelize(layout), data_parallel_size=data_parallel, tensor_parallel_size=4 // data_parallel
        )
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
        fabric.launch()
        fabric.seed_everything(1)
        model = fabric.setup_module(_Model())
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01)))
        _train(fabric, model, optimizer)
        expected = gather_full_state(model, optimizer)
        directory = f"{checkpoint_dir}/{layout}"
        fabric.save(directory, {"step": 2, "model": model, "optimizer": optimizer})
        if fabric.global_rank == 0:
            if layout == "fsdp_tensor_parallel":
                # a column split (RowwiseParallel's weight): assembled in one buffer, not streamed by rows
                from lightning_fsdp.loading.sharded_metadata import read_dcp_metadata

                entry = read_dcp_metadata(Path(directory)).state_dict_metadata["model.blocks.0.fc_out.weight"]
                assert any(chunk.offsets[1] != 0 for chunk in entry.chunks)
            _consolidate_and_compare(directory)
        fabric.barrier()
        fabric.seed_everything(2)
        fresh = fabric.setup_module(_Model())
        fresh_optimizer = fabric.setup_optimizers(torch.optim.Adam(fresh.parameters(), lr=torch.tensor(0.5)))
        loaded = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
        fabric.load(f"{directory}.ours.ckpt", loaded)
        assert loaded["step"] == 2
        assert_same_state(gather_full_state(fresh, fresh_optimizer), expected)
    return len(layouts)


def test_fsdp2_sharded_checkpoint_consolidates_as_lightning_does(tmp_path: Path) -> None:
    layouts = ["fsdp", "fsdp_tensor_parallel"]
    assert run_distributed(_fsdp2, str(tmp_path), layouts, devices=4) == [len(layouts)] * 4


def _sharded_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], chunk_bytes: int) -> Path:
    """A sharded checkpoint of ``tensors`` under ``"model"``, each split into row chunks (as ranks' shards are)."""
    from lightning_fsdp.loading.convert import convert_checkpoint

    source = directory / "source.pt"
    torch.save({"model": tensors, "step": 7}, source)
    convert_checkpoint(source, directory / "sharded", chunk_bytes=chunk_bytes)
    source.unlink()
    return directory / "sharded"


def test_truncated_shard_is_one_error_and_no_file(tmp_path: Path) -> None:
    tensors = {f"layer{i}.weight": torch.randn(64, 32) for i in range(4)}
    sharded = _sharded_checkpoint(tmp_path, tensors, chunk_bytes=4096)
    shard = max(sharded.glob("*.distcp"), key=lambda path: path.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    output = tmp_path / "out" / "model.ckpt"
    output.parent.mkdir()
    result = _cli("convert", str(sharded), str(output))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("lightning-fsdp convert: error: The shard file ")
    assert "is truncated" in result.stderr
    assert os.listdir(output.parent) == []


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_consolidation_summary_counts_in_words(tmp_path: Path) -> None:
    """The summary counts tensors, other entries and `meta.pt` entries, never "0 other entries" or "1 tensors"."""
    import torch.distributed.checkpoint as dcp

    with_meta = _sharded_checkpoint(tmp_path, {"w": torch.ones(4, 4)}, chunk_bytes=4096)  # `meta.pt` holds "step"
    output = str(tmp_path / "with-meta.ckpt")
    result = _cli("convert", str(with_meta), output)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"wrote {output}: 1 tensor, 64 B (the largest 64 B); load it with torch.load({output!r}) or"
        f" fabric.load({output!r}, state)",
        "it also holds 1 entry from the checkpoint's meta.pt: step",
    ]
    state = {"model": {"w": torch.ones(4, 4), "b": torch.ones(4)}, "lr": 0.1}  # `lr`: an entry that is no tensor
    dcp.save(state, checkpoint_id=tmp_path / "objects", no_dist=True)
    output = str(tmp_path / "objects.ckpt")
    result = _cli("convert", str(tmp_path / "objects"), output)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"wrote {output}: 2 tensors, 80 B (the largest 64 B), and 1 other entry; load it with torch.load({output!r})"
        f" or fabric.load({output!r}, state)",
    ]


def test_corrupt_entry_found_mid_write_leaves_no_file(tmp_path: Path) -> None:
    """The shards pass every check but one entry's bytes are not a tensor: found once the file is half written."""
    from lightning_fsdp.loading.sharded_metadata import read_dcp_metadata

    tensors = {f"layer{i}.weight": torch.randn(64, 32) for i in range(4)}
    sharded = _sharded_checkpoint(tmp_path, tensors, chunk_bytes=4096)
    storage = read_dcp_metadata(sharded).storage_data
    last = max(storage, key=lambda index: (index.fqn, tuple(index.offset or ())))
    info = storage[last]
    with open(sharded / info.relative_path, "r+b") as file:
        file.seek(info.offset)
        file.write(b"\0" * min(info.length, 64))  # the entry's zip header: `torch.load` refuses it
    output = tmp_path / "out" / "model.ckpt"
    output.parent.mkdir()
    result = _cli("convert", str(sharded), str(output))
    assert result.returncode == 2
    assert result.stderr.startswith(f"lightning-fsdp convert: error: Reading the tensor {last.fqn!r} from "), (
        result.stderr
    )
    assert os.listdir(output.parent) == []  # neither the output nor the temporary file


_PAUSED_CONVERT = """
import signal, sys, time
from pathlib import Path

# A job started in the background by a non-interactive shell (CI) inherits SIGINT ignored; a terminal's Ctrl-C is not.
signal.signal(signal.SIGINT, signal.default_int_handler)

import lightning_fsdp.saving.offline as offline
from lightning_fsdp.cli import main

consolidate = offline.consolidate_sharded_checkpoint
ready = Path(sys.argv[3])

def paused(source, output, **kwargs):
    def after_first_piece(count):
        # the temporary file exists and holds data: wait here for the test's Ctrl-C
        ready.write_text("written")
        time.sleep(120)

    return consolidate(source, output, **{**kwargs, "on_bytes": after_first_piece})

offline.consolidate_sharded_checkpoint = paused
sys.exit(main(["convert", sys.argv[1], sys.argv[2], "--no-progress"]))
"""


@RunIf(linux_only=True)
def test_interrupt_removes_the_temporary_file(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) while the temporary file is being written: exit code 130, and neither it nor the output is left.

    The conversion pauses after its first piece of tensor data (a hook on its progress callback), so that the signal
    always arrives mid-write, however fast the machine.
    """
    import signal
    import time

    tensors = {f"layer{i}.weight": torch.randn(64, 64) for i in range(4)}
    sharded = _sharded_checkpoint(tmp_path, tensors, chunk_bytes=4096)
    output = tmp_path / "out" / "model.ckpt"
    output.parent.mkdir()
    ready = tmp_path / "ready"
    command = [sys.executable, "-c", _PAUSED_CONVERT, str(sharded), str(output), str(ready)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready.exists(), process.communicate(timeout=10)
    assert [name.endswith(".tmp") for name in os.listdir(output.parent)] == [True]
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr == "lightning-fsdp: interrupted\n"
    assert os.listdir(output.parent) == []


def test_existing_output_is_refused(tmp_path: Path) -> None:
    sharded = _sharded_checkpoint(tmp_path, {"w": torch.ones(4, 4)}, chunk_bytes=4096)
    output = tmp_path / "model.ckpt"
    output.write_bytes(b"earlier")
    result = _cli("convert", str(sharded), str(output))
    assert result.returncode == 2
    assert "exists" in result.stderr
    assert output.read_bytes() == b"earlier"


_MEASURE = (
    """
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint  # imported by both on first use: the baseline's memory, not the conversion's
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning_fsdp.saving.offline import consolidate_sharded_checkpoint
"""
    + PEAK_GROWTH
    + """
ours, _ = peak_growth(lambda: consolidate_sharded_checkpoint(sys.argv[1], sys.argv[2]))
lightning, state = peak_growth(lambda: _load_distributed_checkpoint(Path(sys.argv[1])))
print(ours, lightning)
"""
)


@RunIf(linux_only=True)
def test_consolidation_peak_memory_stays_below_two_largest_tensors(tmp_path: Path) -> None:
    """Peak resident memory of the conversion, sampled every millisecond in a process of its own, for 144 MiB.

    The largest tensor is 32 MiB, every tensor saved in row chunks of 8 MiB (as four ranks' shards of it would be):
    the conversion must stay under twice the largest tensor above the interpreter's baseline (the bound for any
    layout), and near two chunks (the bound for row chunks: the reader's copy of a chunk and the buffer it fills). The
    same sampler, on Lightning's consolidation of the same directory, must see the whole checkpoint (so it would
    notice a full copy).
    """
    tensors = {f"layer{i}.weight": torch.randn(1024, 4096) for i in range(7)}  # 16 MiB each
    tensors["embedding.weight"] = torch.randn(2048, 4096)  # 32 MiB, the largest
    sharded = _sharded_checkpoint(tmp_path, tensors, chunk_bytes=8 * 2**20)
    largest_kib, chunk_kib, checkpoint_kib = 32 * 1024, 8 * 1024, 144 * 1024
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(sharded), str(tmp_path / "model.ckpt")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    ours_kib, lightning_kib = map(int, result.stdout.split())
    print(f"consolidation's peak grew by {ours_kib / 1024:.1f} MiB, Lightning's by {lightning_kib / 1024:.1f} MiB")
    assert lightning_kib >= 0.9 * checkpoint_kib
    assert ours_kib <= 2 * largest_kib
    assert ours_kib <= 3 * chunk_kib
    consolidated = torch.load(tmp_path / "model.ckpt", weights_only=True, mmap=True)
    assert consolidated["step"] == 7
    for name, tensor in tensors.items():
        assert torch.equal(consolidated["model"][name], tensor), name


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_tensor_without_a_storage_class_is_named_not_dropped(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.ones(4, 4), "scales": torch.zeros(8, dtype=torch.float8_e4m3fn)}}
    dcp.save(state, checkpoint_id=tmp_path / "sharded", no_dist=True)
    output = tmp_path / "out" / "model.ckpt"
    output.parent.mkdir()
    result = _cli("convert", str(tmp_path / "sharded"), str(output))
    assert result.returncode == 2
    assert "cannot stream" in result.stderr
    assert "model.scales (torch.float8_e4m3fn)" in result.stderr
    assert "consolidate_checkpoint" in result.stderr
    assert os.listdir(output.parent) == []
