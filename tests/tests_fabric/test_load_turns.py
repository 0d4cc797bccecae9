"""Sources that must be read whole are loaded in node turns; failures reach every rank.

A file loaded with `weights_only=False` may hold any object, so it is read whole, in turns; with the default
`weights_only=True` every format, the legacy one included, is read by byte ranges and needs no turns.
"""

import ctypes
import itertools
import time
from datetime import timedelta

import torch
from lightning.fabric import Fabric

from lightning_fsdp import CheckpointLoadError, FSDPStrategy
from lightning_fsdp.loading import formats
from tests.tests_fabric.helpers.checkpoints import write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer
from tests.tests_fabric.helpers.runif import RunIf
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state


def _record_materialized_intervals(intervals: list) -> None:
    """Wrap the loader's own reading and closing (not a mock: the real functions run) to time each rank's copy."""
    read, close = formats.load_torch_file, formats.OpenedCheckpoint.close

    def timed_read(*args, **kwargs):
        intervals.append([time.monotonic(), None])
        time.sleep(0.3)  # hold the copy a little longer, so that overlapping turns could not go unnoticed
        return read(*args, **kwargs)

    def timed_close(opened):
        close(opened)
        if intervals and intervals[-1][1] is None:
            intervals[-1][1] = time.monotonic()

    formats.load_torch_file, formats.OpenedCheckpoint.close = timed_read, timed_close


def _launch(devices: int, num_nodes: int = 1, **strategy_kwargs) -> Fabric:
    fabric = Fabric(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=FSDPStrategy(auto_wrap_policy={Block}, **strategy_kwargs),
    )
    fabric.launch()
    return fabric


def _sharded_model(fabric: Fabric, **model_kwargs) -> torch.nn.Module:
    with fabric.init_module(empty_init=True):
        model = TinyTransformer(**model_kwargs)
    return fabric.setup_module(model)


def _load_in_turns(path: str, expected_path: str, concurrency: int, num_nodes: int) -> tuple:
    fabric = _launch(devices=2, num_nodes=num_nodes, load_concurrency=concurrency, timeout=timedelta(seconds=2))
    model = _sharded_model(fabric)
    intervals: list = []
    _record_materialized_intervals(intervals)
    # Each rank holds the copy for 0.3 s plus its reading; with k=1 the last of 2 ranks waits longer than the 2 s
    # process-group timeout only if turns used collectives. They use the store, so no timeout may fire.
    fabric.load(path, {"model": model}, weights_only=False)
    assert_same_state(gather_full_state(model)["model"], torch.load(expected_path, weights_only=True))
    return fabric.node_rank, tuple(intervals[0])


def _overlaps(intervals: list[tuple[float, float]]) -> bool:
    ordered = sorted(intervals)
    return any(later[0] < earlier[1] for earlier, later in itertools.pairwise(ordered))


def _write_legacy_fabric_checkpoint(tmp_path):
    torch.manual_seed(0)
    state_dict = TinyTransformer().state_dict()
    torch.save(state_dict, tmp_path / "expected.pt")
    path = tmp_path / "legacy.ckpt"
    torch.save({"model": state_dict, "step": 1}, path, _use_new_zipfile_serialization=False)
    return path


def test_trusted_file_is_read_one_rank_per_node_at_a_time(tmp_path):
    path = _write_legacy_fabric_checkpoint(tmp_path)
    results = run_distributed(
        _load_in_turns, str(path), str(tmp_path / "expected.pt"), 1, 2, devices=2, num_nodes=2, timeout=300
    )
    by_node = {node: [interval for n, interval in results if n == node] for node in (0, 1)}
    for node, intervals in by_node.items():
        assert len(intervals) == 2
        assert not _overlaps(intervals), f"node {node}: two ranks held the file at once: {intervals}"
    # Nodes do not wait for each other: the first turns of both nodes overlap.
    first_turns = [min(intervals) for intervals in by_node.values()]
    assert _overlaps(first_turns), f"nodes waited for each other: {by_node}"


def test_trusted_file_with_all_ranks_at_once(tmp_path):
    path = _write_legacy_fabric_checkpoint(tmp_path)
    results = run_distributed(_load_in_turns, str(path), str(tmp_path / "expected.pt"), 2, 1, devices=2)
    assert _overlaps([interval for _, interval in results])


def _one_rank_fails(paths: dict[str, str]) -> dict[str, tuple[str, float, bool]]:
    fabric = _launch(devices=4, load_concurrency=1)
    # Rank 2's model differs from the checkpoint, as if it ran a different config: only it fails validation.
    model = _sharded_model(fabric, vocab=41 if fabric.global_rank == 2 else 37)
    # Local shards only: a full state dict would need collectives, which a rank with another model cannot join.
    before = [tensor.detach().clone() for tensor in model.parameters()]
    outcomes = {}
    for name, path in paths.items():
        start = time.monotonic()
        try:
            fabric.load(path, {"model": model}, weights_only=not name.endswith("trusted"))
        except CheckpointLoadError as error:
            untouched = all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
            outcomes[name] = (str(error), time.monotonic() - start, untouched)
    return outcomes


def test_a_failing_rank_makes_every_rank_raise_promptly(tmp_path):
    torch.manual_seed(0)
    state_dict = TinyTransformer().state_dict()
    paths = {fmt: str(write_checkpoint(state_dict, tmp_path / fmt, fmt)) for fmt in ("torch-zip", "torch-legacy")}
    torch.save({"model": state_dict}, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    paths["legacy-fabric"] = paths["legacy-fabric-trusted"] = str(tmp_path / "legacy.ckpt")
    per_rank = run_distributed(_one_rank_fails, paths, devices=4, timeout=300)
    for fmt in paths:
        messages = {outcomes[fmt][0] for outcomes in per_rank}
        assert len(messages) == 1, messages
        message = messages.pop()
        assert "failed on rank 2" in message, message
        assert "shape mismatch" in message
        assert max(outcomes[fmt][1] for outcomes in per_rank) < 15
    # A source read by byte ranges is validated on every rank before any rank writes: no model changed.
    for fmt in ("torch-zip", "torch-legacy", "legacy-fabric"):
        assert all(outcomes[fmt][2] for outcomes in per_rank), fmt
    # In turns, ranks after the failing one never start (ranks before it have loaded, which is unavoidable).
    assert per_rank[3]["legacy-fabric-trusted"][2]


def _raw_legacy_without_turns(path: str, expected_path: str) -> int:
    fabric = _launch(devices=2, load_concurrency=1)
    model = _sharded_model(fabric)
    intervals: list = []
    _record_materialized_intervals(intervals)
    fabric.load(path, {"model": model})
    assert_same_state(gather_full_state(model)["model"], torch.load(expected_path, weights_only=True))
    return len(intervals)


def test_raw_legacy_file_is_read_by_byte_ranges_without_turns(tmp_path):
    """A legacy file's pickles come before its data and say where each tensor is: no rank reads the file whole."""
    torch.manual_seed(0)
    state_dict = TinyTransformer().state_dict()
    torch.save(state_dict, tmp_path / "expected.pt")
    path = write_checkpoint(state_dict, tmp_path, "torch-legacy")
    assert run_distributed(_raw_legacy_without_turns, str(path), str(tmp_path / "expected.pt"), devices=2) == [0, 0]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise AssertionError(f"no {field}")


def _load_and_measure(path: str) -> tuple[int, int]:
    """This rank's peak resident memory during the load and what it still holds after, both above its base."""
    fabric = _launch(devices=2, load_concurrency=1)
    model = _sharded_model(fabric, width=512, depth=4)  # 3 MiB tensors: glibc serves them from its heap, not mmap
    fabric.barrier()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the base must not hold freed heap memory that the load could reuse
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets the peak resident set size (VmHWM) to the current one
    base_rss, base_anonymous = _status_kib("VmRSS"), _status_kib("RssAnon")
    fabric.load(path, {"model": model}, weights_only=False)
    return _status_kib("VmHWM") - base_rss, _status_kib("RssAnon") - base_anonymous


@RunIf(linux_only=True)
def test_each_turn_returns_its_memory(tmp_path):
    """With k=1, each rank holds a copy of a source read whole during its turn, and gives it back when it ends.

    Tensors this small come from glibc's heap, which keeps freed memory unless the turn hands it back: a rank would
    then hold a copy after its turn, and the next rank's copy would come on top of it.
    """
    torch.manual_seed(0)
    path = tmp_path / "legacy.ckpt"
    torch.save({"model": TinyTransformer(width=512, depth=4).state_dict()}, path, _use_new_zipfile_serialization=False)
    file_kib = path.stat().st_size // 1024
    for peak_kib, kept_kib in run_distributed(_load_and_measure, str(path), devices=2):
        assert peak_kib >= 0.8 * file_kib, f"a rank's peak grew by {peak_kib} KiB only, for a {file_kib} KiB file"
        assert kept_kib <= 0.25 * file_kib, f"a rank kept {kept_kib} KiB after its turn, for a {file_kib} KiB file"
