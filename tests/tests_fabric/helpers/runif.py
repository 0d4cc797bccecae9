"""``RunIf``: skip a test unless the machine and the environment meet its requirements (as Lightning's suite does)."""

import os
import sys

import pytest
import torch
from packaging.version import Version


def RunIf(
    *,
    min_cuda_gpus: int = 0,
    min_torch: str | None = None,
    standalone: bool = False,
    skip_windows: bool = False,
    linux_only: bool = False,
) -> pytest.MarkDecorator:
    """Return a ``skipif`` marker that skips the test unless every condition holds.

    Args:
        min_cuda_gpus: The test needs at least this many CUDA devices.
        min_torch: The test needs at least this torch release.
        standalone: The test runs in its own process, only when ``PL_RUN_STANDALONE_TESTS=1`` (see
            ``tests/run_standalone_tests.sh``).
        skip_windows: The test does not run on Windows.
        linux_only: The test runs on Linux only (it reads ``/proc``).

    """
    conditions, reasons = [], []
    if min_cuda_gpus:
        conditions.append(torch.cuda.device_count() < min_cuda_gpus)
        reasons.append(f"GPUs>={min_cuda_gpus}")
    if min_torch:
        conditions.append(Version(torch.__version__).release < Version(min_torch).release)
        reasons.append(f"torch>={min_torch}")
    if standalone:
        conditions.append(os.getenv("PL_RUN_STANDALONE_TESTS", "0") != "1")
        reasons.append("standalone behavior (PL_RUN_STANDALONE_TESTS=1)")
    if skip_windows:
        conditions.append(sys.platform == "win32")
        reasons.append("unimplemented on Windows")
    if linux_only:
        conditions.append(not sys.platform.startswith("linux"))
        reasons.append("Linux only")
    reason = f"Requires: [{' + '.join(reasons)}]"
    # The keyword arguments are kept on the marker so that the conftest can select the standalone tests.
    return pytest.mark.skipif(any(conditions), reason=reason, min_cuda_gpus=min_cuda_gpus, standalone=standalone)
