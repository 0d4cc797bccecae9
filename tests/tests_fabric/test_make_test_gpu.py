"""``make test-gpu`` (``tools/test_gpu.sh``) on a machine without a GPU: it says so, exits 0 and installs nothing; and
with ``TEST_GPU_PYTHON`` (a faked driver here) it checks that interpreter's torch instead of setting one up.

What it does on a machine with a GPU (set-up, the CUDA tests, the benchmark on the GPU) is what it checks there.
"""

import os
import shutil
import subprocess
import sys
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


def test_script_with_test_gpu_python_uses_it_as_it_is(tmp_path):
    """``TEST_GPU_PYTHON`` names an interpreter to use without set-up: one whose torch is a CPU build is refused.

    A driver is faked by an ``nvidia-smi`` on ``PATH`` that lists one GPU, so the script goes past its first check; the
    interpreter is this test's own, whose torch is the CPU build here.
    """
    driver = tmp_path / "bin" / "nvidia-smi"
    driver.parent.mkdir()
    driver.write_text('#!/bin/sh\nif [ "$1" = "-L" ]; then echo "GPU 0: Fake (UUID: GPU-0)"; else echo Fake; fi\n')
    driver.chmod(0o755)
    completed = subprocess.run(
        ["bash", str(_ROOT / "tools" / "test_gpu.sh")],
        env={
            **os.environ,
            "PATH": f"{driver.parent}:{os.environ['PATH']}",
            "VENV": str(tmp_path / "venv"),
            "TEST_GPU_PYTHON": sys.executable,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert f"TEST_GPU_PYTHON={sys.executable}: no set-up" in completed.stdout
    assert "is a CPU build (or missing)" in completed.stdout
    assert not (tmp_path / "venv").exists()  # nothing installed
