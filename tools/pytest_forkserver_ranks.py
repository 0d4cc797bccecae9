"""A pytest plugin for the checks against Lightning's code: ranks start from a fork server instead of ``spawn``.

Lightning's CPU tests (and the core's, written in its conventions) launch their ranks with
``_MultiProcessingLauncher(strategy, start_method="spawn")``: every rank is a fresh interpreter that imports torch and
Lightning again, about 4 s of CPU on the 2-core CI machine, which was most of these checks' time. Under this plugin
such a launcher launches with ``"forkserver"`` instead (its ``_start_method`` reads ``"spawn"`` outside the launch),
whose server imports torch and Lightning once; each rank forks from it with them loaded. The code under test is the
same; what differs is how a rank process starts (``spawn`` also restores a few global flags in the rank and stops
sharing CPU tensors of the arguments, neither of which these tests rely on). The server never runs a torch op, so a
rank forked from it has no OpenMP threads that a fork would leave dead.

Used by tools/test_patched_upstream.sh, tools/test_core_on_sdist.sh and tools/test_series.py
(``-p pytest_forkserver_ranks``, with ``tools/`` on ``PYTHONPATH``). It imports nothing of this project. Measured on
2026-12-04 (2 cores, nothing else running): the three checks took 64 s together, 247 s with ``spawn``; the same tests
passed.
"""

import multiprocessing
from typing import Any

_PRELOAD = ["torch", "torch.distributed.fsdp", "lightning.fabric"]


def pytest_configure(config: object) -> None:
    """Make every ``spawn`` launch of Lightning's multiprocessing launcher use the fork server."""
    from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    original = _MultiProcessingLauncher.launch

    def launch(self: _MultiProcessingLauncher, function: Any, *args: Any, **kwargs: Any) -> Any:
        if self._start_method != "spawn":
            return original(self, function, *args, **kwargs)
        # for the launch only: a test that inspects the launcher still finds the start method it asked for
        self._start_method = "forkserver"
        try:
            return original(self, function, *args, **kwargs)
        finally:
            self._start_method = "spawn"

    _MultiProcessingLauncher.launch = launch
