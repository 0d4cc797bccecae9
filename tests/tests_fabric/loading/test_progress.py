"""The load progress bar: once per node, node totals and turns, and silent wherever nobody should see it."""

import io
import os
import time

import pytest

from lightning_fsdp.loading import progress as progress_module
from lightning_fsdp.loading.progress import PROGRESS_ENV_VAR, LoadProgress
from lightning_fsdp.loading.turns import StaggeredLoad
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.loading.test_turns import _init_process_group


class _Terminal(io.StringIO):
    """Output that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _show_at_once(monkeypatch):
    # The bar shows only after a second; these tests are shorter. (Forked processes inherit the patch.)
    monkeypatch.setattr(progress_module, "_SHOW_AFTER_S", 0.0)
    monkeypatch.delenv(PROGRESS_ENV_VAR, raising=False)


def _run(progress: LoadProgress) -> None:
    with progress:
        progress.set_turn(1, 4)
        for _ in range(3):
            progress.update(512 * 1024)
            time.sleep(0.01)


def test_shows_bytes_tensors_and_turn_on_a_terminal():
    output = _Terminal()
    progress = LoadProgress(total_bytes=3 * 512 * 1024, total_tensors=3, local_rank=0, node_rank=1, file=output)
    assert progress.shown
    _run(progress)
    text = output.getvalue()
    assert "Loading checkpoint [node 1]" in text
    assert "1.50MB/1.50MB" in text
    assert "tensors 3/3, turn 2/4" in text
    assert "B/s" in text


@pytest.mark.parametrize(
    ("output", "kwargs", "env"),
    [
        pytest.param(io.StringIO(), {}, None, id="not-a-terminal"),
        pytest.param(_Terminal(), {"enabled": False}, None, id="disabled-by-argument"),
        pytest.param(_Terminal(), {}, "0", id="disabled-by-env"),
        pytest.param(_Terminal(), {"enabled": True}, "off", id="env-wins-over-argument"),
        pytest.param(_Terminal(), {"local_rank": 1}, None, id="not-local-rank-0"),
        pytest.param(_Terminal(), {"local_rank": 1, "enabled": True}, "1", id="never-on-other-local-ranks"),
    ],
)
def test_silent(output, kwargs, env, monkeypatch):
    if env is not None:
        monkeypatch.setenv(PROGRESS_ENV_VAR, env)
    progress = LoadProgress(total_bytes=10, **kwargs, file=output)
    assert not progress.shown
    _run(progress)
    assert output.getvalue() == ""


@pytest.mark.parametrize(("kwargs", "env"), [({"enabled": True}, None), ({}, "1")])
def test_forced_on_any_output(kwargs, env, monkeypatch):
    if env is not None:
        monkeypatch.setenv(PROGRESS_ENV_VAR, env)
    output = io.StringIO()
    progress = LoadProgress(**kwargs, file=output)
    assert progress.shown
    _run(progress)
    assert "tensors 3, turn 2/4" in output.getvalue()


def test_short_loads_draw_nothing(monkeypatch):
    monkeypatch.setattr(progress_module, "_SHOW_AFTER_S", 60.0)
    output = _Terminal()
    _run(LoadProgress(total_bytes=10, file=output))
    assert output.getvalue() == ""


def test_stderr_by_default(capsys):
    # Under pytest, stderr is captured and not a terminal: nothing is drawn.
    progress = LoadProgress()
    assert not progress.shown
    _run(progress)
    assert capsys.readouterr().err == ""


def _node_progress(output_dir: str, devices: int, num_nodes: int) -> None:
    progress_module._SHOW_AFTER_S = 0.0  # draw from the start: turns hand over fast, the load may take under 1 s
    rank, node_rank, local_rank = _init_process_group(devices, num_nodes)
    ranks = {"node_rank": node_rank, "local_rank": local_rank}
    with open(os.path.join(output_dir, f"rank{rank}.txt"), "w") as output:
        progress = LoadProgress(total_bytes=10 * 1024, total_tensors=10, **ranks, enabled=True, file=output)
        load = StaggeredLoad(1, **ranks, local_world_size=devices, progress=progress, namespace="test")
        with progress, load, load.turn():
            for _ in range(10):
                progress.update(1024)
                time.sleep(0.03)


def test_one_bar_per_node_with_the_node_totals(tmp_path):
    run_distributed(_node_progress, str(tmp_path), 2, 2, devices=2, num_nodes=2, timeout=60)
    outputs = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(4)]
    # Local rank 0 of each node draws; the other ranks write nothing.
    assert outputs[1] == outputs[3] == ""
    for node, text in ((0, outputs[0]), (1, outputs[2])):
        final = text.rstrip().rsplit("\r", 1)[-1]
        assert f"[node {node}]" in final
        # The totals of both ranks of the node (10 KiB and 10 tensors each), in the last of two turns.
        assert "20.0kB/20.0kB" in final
        assert "tensors 20/20, turn 2/2" in final
