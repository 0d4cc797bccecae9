"""The README's main job, ``make demo`` (``examples/demo.py``), run small, as a user runs it: a script in a process."""

import os
import subprocess
import sys
from pathlib import Path

import lightning_fsdp
from tests.tests_fabric.helpers.env import without_launcher_variables

_DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.py"


def test_demo_checks_every_load_and_the_full_save_bit_for_bit(tmp_path):
    env = without_launcher_variables()
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(lightning_fsdp.__file__).resolve().parents[1]), env.get("PYTHONPATH")])
    )
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, str(_DEMO), "--devices", "2", "--width", "64", "--depth", "2", "--workdir", "out"]
    process = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    out = process.stdout
    # the demo asserts on every rank (an assertion fails the run); what it prints says which checks ran
    assert out.count("| raw zip, byte ranges |") == 1
    assert "every parameter equalled the file's tensor\nbit for bit" in out
    assert "without a gather: every rank wrote its own slices" in out
    assert "equal the saved ones bit for bit" in out
    assert (tmp_path / "out" / "full.ckpt").is_file()
    assert "It ran for " in out
