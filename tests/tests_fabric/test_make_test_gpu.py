"""``make test-gpu`` (``tools/test_gpu.sh``) on a machine without a GPU: it says so, exits 0 and installs nothing.

What it does on a machine with a GPU (set-up, the CUDA tests, the benchmark on the GPU) is what it checks there.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(
        shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia/gpus").is_dir(),
        reason="a machine with an NVIDIA driver: `make test-gpu` runs the real check there",
    ),
]

_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs `make`")
def test_make_test_gpu_without_a_gpu_says_so_and_installs_nothing(tmp_path):
    venv = tmp_path / "venv"
    completed = subprocess.run(
        ["make", "-s", "test-gpu", f"VENV={venv}"], cwd=_ROOT, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "make test-gpu: no GPU on this machine" in completed.stdout
    assert not venv.exists()  # no virtual environment, no torch download: the check ends before its set-up


def test_script_without_a_gpu_exits_0(tmp_path):
    completed = subprocess.run(
        ["bash", str(_ROOT / "tools" / "test_gpu.sh")],
        env={**os.environ, "VENV": str(tmp_path / "venv")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "nothing to check: skipped" in completed.stdout
    assert not (tmp_path / "venv").exists()
