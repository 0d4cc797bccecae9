"""The `lightning-fsdp` command line: `inspect` and `convert` on every format, bad input, and convert's memory."""

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.cli import main
from tests.tests_fabric.helpers.checkpoints import FORMATS, write_bad_inputs, write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.memory import PEAK_GROWTH
from tests.tests_fabric.helpers.models import Block, TinyTransformer
from tests.tests_fabric.helpers.runif import RunIf
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state


def _cli(*args: str) -> subprocess.CompletedProcess:
    """Run the command line in this process (importing torch in a new one for each call would be slow)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's --help and usage errors
            code = exit.code
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


@pytest.fixture(scope="module")
def state_dict():
    torch.manual_seed(0)
    return TinyTransformer().state_dict()


def test_help_reads_well():
    result = _cli("--help")
    assert result.returncode == 0
    for text in ("inspect", "convert", "safetensors", "index.json", "fabric.load"):
        assert text in result.stdout
    assert _cli("convert", "--help").returncode == 0


def test_console_script_is_installed(tmp_path):
    """The installed `lightning-fsdp` executable runs, and reports bad input with exit code 2 and no traceback."""
    executable = shutil.which("lightning-fsdp", path=os.pathsep.join([str(Path(sys.executable).parent), ""]))
    assert executable is not None
    assert subprocess.run([executable, "--help"], capture_output=True, timeout=60).returncode == 0
    result = subprocess.run([executable, "inspect", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("lightning-fsdp inspect: error: The checkpoint path")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("fmt", FORMATS)
def test_inspect_every_format(tmp_path, state_dict, fmt):
    path = write_checkpoint(state_dict, tmp_path, fmt)
    text = _cli("inspect", str(path))
    assert text.returncode == 0, text.stderr
    assert "format:" in text.stdout
    assert f"tensors:  {len(state_dict)} " in text.stdout
    summary = json.loads(_cli("inspect", str(path), "--json").stdout)
    assert summary["tensors"] == len(state_dict)
    assert summary["tensor_bytes"] == sum(t.numel() * t.element_size() for t in state_dict.values())
    assert summary["dtypes"] == {"float32": len(state_dict)}
    assert summary["lazy"] is True  # a legacy raw state dict is read by byte ranges too
    assert summary["format"] == {"torch-zip": "torch-zip", "torch-legacy": "torch-legacy"}.get(
        fmt, "safetensors" if fmt == "safetensors" else "hf-index"
    )
    assert summary["largest_tensor"] in ("embedding.weight", "head.weight", "blocks.0.fc_in.weight")


def test_inspect_fabric_checkpoints(tmp_path, state_dict):
    torch.save({"model": state_dict, "step": 3}, tmp_path / "full.ckpt")
    summary = json.loads(_cli("inspect", str(tmp_path / "full.ckpt"), "--json").stdout)
    assert summary["kind"] == "fabric checkpoint"
    assert summary["top_level_keys"] == ["model", "step"]
    assert summary["tensors"] == len(state_dict)


def test_inspect_and_convert_safetensors_slices(tmp_path):
    """The safetensors slices of torch's `HuggingFaceStorageWriter`: described with their tensors' whole shapes; a
    sharded checkpoint already, so there is nothing to convert."""
    from tests.tests_fabric.loading.test_safetensors_slices import _full_state, _write_slices

    _write_slices(tmp_path / "slices", [(0, 4), (4, 7)])
    summary = json.loads(_cli("inspect", str(tmp_path / "slices"), "--json").stdout)
    expected = _full_state()
    assert (summary["format"], summary["kind"], summary["files"], summary["tensors"]) == (
        "safetensors-shards",
        "sharded checkpoint (safetensors slices)",
        2,
        len(expected),
    )
    assert summary["tensor_bytes"] == sum(tensor.nbytes for tensor in expected.values())
    assert summary["dtypes"] == {"bfloat16": 1, "float32": 2}
    assert summary["largest_tensor"] == "embedding.weight"
    result = _cli("convert", str(tmp_path / "slices"), str(tmp_path / "out"))
    assert result.returncode == 2
    assert "is a sharded checkpoint already: there is nothing to do" in result.stderr


def test_convert_summary_counts_in_words(tmp_path):
    """One tensor in one chunk is said so: not "1 tensors" in "1 chunks"."""
    torch.save({"model": {"w": torch.ones(4, 4)}, "step": 3}, tmp_path / "one.pt")
    output = str(tmp_path / "out")
    result = _cli("convert", str(tmp_path / "one.pt"), output, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"wrote {output}: 1 tensor, 64 B in 1 chunk under 'model'; load it with fabric.load({output!r}, {{'model':"
        " model})",
        "kept metadata: step",
    ]


def test_bad_input_is_a_message_and_exit_code_not_a_traceback(tmp_path, state_dict):
    for case, (path, _) in write_bad_inputs(tmp_path, state_dict).items():
        commands = [["convert", str(path), str(tmp_path / f"out-{case}")]]
        if case != "non-tensor values":  # a file `inspect` can describe, but that holds no module state to convert
            commands.append(["inspect", str(path)])
        for command in commands:
            result = _cli(*command)
            assert result.returncode == 2, (case, command, result.stdout, result.stderr)
            assert "Traceback" not in result.stderr, (case, result.stderr)
            assert result.stderr.startswith(f"lightning-fsdp {command[0]}: error: "), (case, result.stderr)
    result = _cli("convert", str(write_checkpoint(state_dict, tmp_path / "ok", "torch-zip")), str(tmp_path))
    assert result.returncode == 2
    assert "not an empty directory" in result.stderr
    assert _cli("inspect").returncode == 2  # argparse's usage error


_RAISE_IN_DESCRIBE = """
import sys
import traceback
import lightning_fsdp.loading.convert as convert
from torch.distributed.checkpoint.api import CheckpointException

def describe_checkpoint(path, weights_only=True):
    try:
        raise ValueError("Size mismatch for 'model.head.weight'")
    except ValueError as error:
        summary = traceback.extract_tb(error.__traceback__)
        raise CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (error, summary)}) from None

convert.describe_checkpoint = describe_checkpoint

from lightning_fsdp.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_base_exception_is_one_line_without_traceback(tmp_path):
    """torch's `CheckpointException` is a BaseException whose text embeds each rank's traceback: one line each."""
    command = [sys.executable, "-c", _RAISE_IN_DESCRIBE, "inspect", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "lightning-fsdp inspect: error: the distributed checkpoint reader failed on rank 0: ValueError: Size mismatch"
        " for 'model.head.weight'\n"
    )


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ValueError("first\nsecond\n\nthird"), "ValueError: first\n    second\n    third"),
        (RuntimeError(), "RuntimeError"),
        (type("Fatal", (BaseException,), {})("stop"), "Fatal: stop"),
    ],
)
def test_unexpected_errors_are_reported_by_type(monkeypatch, tmp_path, error, expected):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr("lightning_fsdp.loading.convert.describe_checkpoint", fail)
    result = _cli("inspect", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr == f"lightning-fsdp inspect: error: {expected}\n"


def test_interrupt_exits_130(monkeypatch, tmp_path):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("lightning_fsdp.loading.convert.describe_checkpoint", interrupt)
    result = _cli("inspect", str(tmp_path))
    assert (result.returncode, result.stderr) == (130, "lightning-fsdp: interrupted\n")


@RunIf(linux_only=True)
def test_pipe_into_head_is_quiet(tmp_path):
    """`head` exits after 10 bytes while the command still writes: no error, no traceback, the exit code of SIGPIPE."""
    from safetensors.torch import save_file

    # So many keys that the output (they are all listed) is larger than a pipe's buffer (64 KiB).
    many_tensors = tmp_path / "many.safetensors"
    save_file({f"transformer.layers.{i:05d}.attention.weight": torch.zeros(1) for i in range(3000)}, many_tensors)
    cli = f"{shlex.quote(sys.executable)} -m lightning_fsdp.cli inspect {shlex.quote(str(many_tensors))} --json"
    command = f"set -o pipefail; {cli} | head -c 10"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert result.stdout == '{\n  "path"'
    assert result.stderr == ""
    assert result.returncode == 141


def _load_converted(accelerator: str, devices: int, paths: dict[str, str], expected_path: str) -> int:
    expected = torch.load(expected_path, weights_only=True)
    for name, path in paths.items():
        fabric = Fabric(accelerator=accelerator, devices=devices, strategy=FSDPStrategy(auto_wrap_policy={Block}))
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = TinyTransformer()
        model = fabric.setup_module(model)
        state = {"model": model, "step": 0} if name == "fabric-full" else {"model": model}
        fabric.load(path, state)
        try:
            assert_same_state(gather_full_state(model)["model"], expected)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
        assert state.get("step", 5) == 5  # the metadata of a Fabric checkpoint is kept
    return len(paths)


def _convert_every_format(tmp_path: Path, state_dict: dict) -> tuple[dict[str, str], str]:
    torch.save(state_dict, tmp_path / "expected.pt")
    sources = {fmt: write_checkpoint(state_dict, tmp_path / "in" / fmt, fmt) for fmt in FORMATS}
    torch.save({"model": state_dict, "step": 5, "optimizer": {"state": {}, "param_groups": []}}, tmp_path / "f.ckpt")
    sources["fabric-full"] = tmp_path / "f.ckpt"
    outputs = {}
    for name, source in sources.items():
        output = tmp_path / "out" / name
        # A small chunk size, so that tensors are split into several chunks that ranks read in part.
        result = _cli("convert", str(source), str(output), "--chunk-mb", "0.001")
        assert result.returncode == 0, result.stderr
        assert "fabric.load" in result.stdout
        outputs[name] = str(output)
    return outputs, str(tmp_path / "expected.pt")


@pytest.mark.parametrize("devices", [1, 4])
def test_converted_checkpoints_load_bit_exact(tmp_path, state_dict, devices):
    outputs, expected_path = _convert_every_format(tmp_path, state_dict)
    assert (
        run_distributed(_load_converted, "cpu", devices, outputs, expected_path, devices=devices)
        == [len(outputs)] * devices
    )


@RunIf(min_cuda_gpus=2, standalone=True)
def test_converted_checkpoints_load_bit_exact_cuda(tmp_path, state_dict):
    outputs, expected_path = _convert_every_format(tmp_path, state_dict)
    results = run_distributed(_load_converted, "cuda", 2, outputs, expected_path, devices=2, start_method="spawn")
    assert results == [len(outputs)] * 2


_MEASURE = (
    """
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint  # convert imports it on first use: the baseline's, not the conversion's memory
from lightning_fsdp.loading.convert import convert_checkpoint
"""
    + PEAK_GROWTH
    + """
convert, _ = peak_growth(lambda: convert_checkpoint(sys.argv[1], sys.argv[2]))
whole, state = peak_growth(lambda: {k: v.clone() for k, v in torch.load(sys.argv[3], weights_only=True).items()})
print(convert, whole)
"""
)


@RunIf(linux_only=True)
@pytest.mark.parametrize("fmt", ["torch-zip", "safetensors"])
def test_convert_peak_memory_stays_near_the_largest_tensor(tmp_path, fmt):
    """Peak resident memory of `convert`, sampled every millisecond in a process of its own, for a 144 MiB file.

    The largest tensor is 32 MiB: converting must need at most 1.5 times that above the interpreter's baseline. The
    same sampler, on a plain `torch.load` of the file, must see the whole file (so it would notice a full copy).
    """
    tensors = {f"layer{i}.weight": torch.randn(1024, 4096) for i in range(7)}  # 16 MiB each
    tensors["embedding.weight"] = torch.randn(2048, 4096)  # 32 MiB, the largest
    source = write_checkpoint(tensors, tmp_path / "source", fmt)
    reference = write_checkpoint(tensors, tmp_path / "reference", "torch-zip")
    largest_kib, file_kib = 32 * 1024, 144 * 1024
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(source), str(tmp_path / "out"), str(reference)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    convert_kib, whole_kib = map(int, result.stdout.split())
    print(f"{fmt}: convert's peak grew by {convert_kib / 1024:.1f} MiB, a full read's by {whole_kib / 1024:.1f} MiB")
    assert whole_kib >= 0.9 * file_kib
    assert convert_kib <= 1.5 * largest_kib


def test_names_from_the_file_reach_the_terminal_escaped(tmp_path):
    from tests.tests_fabric.loading.test_bounded_parsing import write_pickle_with_crafted_global

    attack = "\x1b]0;PWNED\x07\x1b[2J"
    path = tmp_path / "names.ckpt"
    checkpoint = {"model": {f"w{attack}": torch.ones(2)}, f"step{attack}": 1, f"optimizer{attack}": [torch.ones(1)]}
    torch.save(checkpoint, path)
    inspected = _cli("inspect", str(path))
    converted = _cli("convert", str(path), str(tmp_path / "out"), "--no-progress")
    refused = _cli("inspect", str(write_pickle_with_crafted_global(tmp_path / "evil.pth")))
    assert (inspected.returncode, converted.returncode, refused.returncode) == (0, 0, 2)
    assert r"w\x1b]0;PWNED\x07\x1b[2J" in inspected.stdout
    for output in (inspected.stdout, converted.stdout, refused.stderr):
        assert not [char for char in output if not char.isprintable() and char != "\n"], output


_INSPECT_THEN_LIST_MODULES = """
import json
import sys
from lightning_fsdp.cli import main
code = main(sys.argv[1:])
print(json.dumps(sorted(sys.modules)))
sys.exit(code)
"""


@pytest.mark.parametrize("fmt", ["torch-zip", "safetensors"])
def test_inspect_imports_neither_lightning_nor_torch_distributed_modules(tmp_path, state_dict, fmt):
    """`inspect` reads a file's structure: Lightning, FSDP and DCP, which take seconds to import, stay unimported."""
    path = write_checkpoint(state_dict, tmp_path, fmt)
    command = [sys.executable, "-c", _INSPECT_THEN_LIST_MODULES, "inspect", str(path)]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    *printed, modules = result.stdout.splitlines()
    # how long it took, last: the whole command, start-up and imports included, not only the reading
    timing = re.fullmatch(r"time: +([0-9.]+) s \(the command, start-up included; ([0-9.]+) s reading\)", printed[-1])
    assert timing, printed
    total, reading = float(timing.group(1)), float(timing.group(2))
    # the interpreter's start counts too (measured from the process's start), and never more than the test saw
    assert reading <= total <= elapsed + 0.05, (reading, total, elapsed)
    imported = json.loads(modules)
    assert "lightning_fsdp.loading.formats" in imported  # it did read the file
    heavy = ("lightning", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.tensor")
    assert [name for name in imported if name in heavy or name.startswith(tuple(f"{h}." for h in heavy))] == []


_SLOW_START_THEN_INSPECT = """
import sys, time

time.sleep(1.5)  # a slow start-up, as the interpreter's and torch's imports are on a busy machine
from lightning_fsdp.cli import main

sys.exit(main(sys.argv[1:]))
"""


@RunIf(linux_only=True)
def test_inspect_time_is_the_whole_command(tmp_path, state_dict):
    """A run whose start-up alone took 1.5 s says at least that: `time:` once said only the reading (1.17 s of 3 s)."""
    path = write_checkpoint(state_dict, tmp_path, "torch-zip")
    command = [sys.executable, "-c", _SLOW_START_THEN_INSPECT, "inspect", str(path)]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    timing = re.match(r"time: +([0-9.]+) s", result.stdout.splitlines()[-1])
    assert timing, result.stdout
    assert 1.5 <= float(timing.group(1)) <= elapsed + 0.05, (timing.group(0), elapsed)


def test_version_prints_the_package_version():
    from lightning_fsdp.__about__ import __version__

    result = _cli("--version")
    assert (result.returncode, result.stdout) == (0, f"lightning-fsdp {__version__}\n")


def test_the_package_imports_its_public_names_on_first_use():
    """`import lightning_fsdp` is cheap; each public name is still there, the same object as in its own module."""
    import lightning_fsdp
    from lightning_fsdp.loading.errors import CheckpointLoadError

    assert lightning_fsdp.FSDPStrategy is FSDPStrategy
    assert lightning_fsdp.CheckpointLoadError is CheckpointLoadError
    assert set(lightning_fsdp.__all__) <= set(dir(lightning_fsdp))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lightning_fsdp.nope  # noqa: B018
