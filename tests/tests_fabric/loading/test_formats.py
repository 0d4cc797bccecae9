"""Format detection and reading, in one process: every format, and every kind of bad input."""

import json
from pathlib import Path

import pytest
import torch

from lightning_fsdp.layouts.targets import ModuleTargets, Run, Target
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.formats import CheckpointFormat, detect_checkpoint, load_torch_file, open_checkpoint
from lightning_fsdp.loading.shard_local import copy_into_module
from lightning_fsdp.loading.sources import ByteRangeSource, DictSource
from lightning_fsdp.loading.validation import plan_load
from tests.tests_fabric.helpers.checkpoints import (
    FORMATS,
    MarkerPayload,
    retag_storages,
    write_bad_inputs,
    write_checkpoint,
)
from tests.tests_fabric.helpers.models import TinyTransformer
from tests.tests_fabric.helpers.runif import RunIf

_EXPECTED_FORMAT = {
    "torch-zip": CheckpointFormat.TORCH_ZIP,
    "torch-legacy": CheckpointFormat.TORCH_LEGACY,
    "safetensors": CheckpointFormat.SAFETENSORS,
    "hf-index-safetensors": CheckpointFormat.HF_INDEX,
    "hf-index-bin": CheckpointFormat.HF_INDEX,
    "hf-directory": CheckpointFormat.HF_INDEX,
}


@pytest.fixture
def state_dict():
    torch.manual_seed(0)
    return TinyTransformer().state_dict()


@pytest.mark.parametrize("fmt", FORMATS)
def test_detects_and_reads_every_format(tmp_path, state_dict, fmt):
    path = write_checkpoint(state_dict, tmp_path, fmt)
    detected = detect_checkpoint(path)
    assert detected.format is _EXPECTED_FORMAT[fmt]
    assert detected.nbytes > 0
    opened = open_checkpoint(detected, module_key=None, weights_only=True)
    assert opened.raw
    specs = opened.source.specs()
    assert set(specs) == set(state_dict)
    for name, tensor in state_dict.items():
        assert specs[name].shape == tuple(tensor.shape)
        assert specs[name].dtype == tensor.dtype
        assert torch.equal(opened.source.read(name), tensor)
        flat = tensor.reshape(-1)
        for start, stop in [(0, flat.numel()), (1, max(1, flat.numel() - 1)), (flat.numel() // 2, flat.numel())]:
            assert torch.equal(opened.source.read_flat(name, start, stop), flat[start:stop]), (name, start, stop)


def test_name_does_not_decide_the_format(tmp_path, state_dict):
    """A safetensors file named `.bin` and a torch file named `.safetensors` are read by content."""
    write_checkpoint(state_dict, tmp_path / "a", "safetensors").rename(tmp_path / "weights.bin")
    write_checkpoint(state_dict, tmp_path / "b", "torch-zip").rename(tmp_path / "weights.safetensors")
    assert detect_checkpoint(tmp_path / "weights.bin").format is CheckpointFormat.SAFETENSORS
    assert detect_checkpoint(tmp_path / "weights.safetensors").format is CheckpointFormat.TORCH_ZIP


@pytest.mark.parametrize("fmt", FORMATS)
def test_only_trusted_pickles_are_read_whole(tmp_path, state_dict, fmt):
    detected = detect_checkpoint(write_checkpoint(state_dict, tmp_path, fmt))
    assert not detected.reads_whole(weights_only=True)
    assert detected.reads_whole(weights_only=False) == (fmt in ("torch-zip", "torch-legacy", "hf-index-bin"))


@pytest.mark.parametrize("fmt", ["torch-zip", "torch-legacy", "safetensors", "hf-index-safetensors"])
def test_shards_are_read_straight_into_the_parameter(tmp_path, state_dict, fmt, monkeypatch):
    """A slice of the same dtype on the CPU goes from the file into the parameter's memory, with no buffer between,
    and autograd sees the write (the parameter's version changes, as it would with ``copy_``)."""
    opened = open_checkpoint(detect_checkpoint(write_checkpoint(state_dict, tmp_path, fmt)), None, weights_only=True)
    name, full = next((name, tensor) for name, tensor in state_dict.items() if tensor.dim() == 2)
    rows = full.shape[0] // 2
    param = torch.nn.Parameter(torch.full((full.shape[0] - rows, *full.shape[1:]), -1.0))
    version = param._version
    target = Target([name], tuple(full.shape), full.dtype, local=param.detach().view(-1))
    target.runs = [Run(rows * full.shape[1], param.numel(), 0)]
    plan = plan_load([target.spec], {name: opened.source.specs()[name]}, strict=True)

    def no_buffer(*args: object) -> None:
        raise AssertionError("read through a buffer")

    monkeypatch.setattr(ByteRangeSource, "_read_elements", no_buffer)
    copy_into_module(ModuleTargets(targets=[target]), plan, opened.source)
    opened.close()
    assert torch.equal(param.detach(), full[rows:])
    assert param._version > version


@RunIf(linux_only=True)
@pytest.mark.parametrize("fmt", ["torch-zip", "safetensors"])
def test_files_are_read_by_positioned_reads_not_mapped(tmp_path, state_dict, fmt):
    """No mapping of the file: a file truncated during a load gives an error, never a SIGBUS."""
    path = write_checkpoint(state_dict, tmp_path, fmt)
    opened = open_checkpoint(detect_checkpoint(path), module_key=None, weights_only=True)
    assert isinstance(opened.source, ByteRangeSource)
    values = {name: opened.source.read(name) for name in state_dict}
    assert str(path) not in Path("/proc/self/maps").read_text()
    assert all(torch.equal(values[name], tensor) for name, tensor in state_dict.items())
    opened.close()


def test_cuda_tagged_file_loads_on_cpu(tmp_path):
    """A file whose storages were saved from `cuda:0` loads onto the CPU on a machine without a GPU.

    No GPU exists here, so the file is produced by rewriting the location tags that `torch.save` records: the bytes
    are what `torch.save` writes for a tensor on `cuda:0`.
    """
    path = tmp_path / "cuda.pth"
    torch.save({"weight": torch.arange(6.0).reshape(2, 3)}, path)
    retag_storages(path, "cpu", "cuda:0")
    with pytest.raises(RuntimeError, match="CUDA"):  # what a plain `torch.load` does with such a file here
        torch.load(path, weights_only=True)
    loaded = load_torch_file(path, weights_only=True)  # read whole (for trusted files)
    assert loaded["weight"].device == torch.device("cpu")
    assert torch.equal(loaded["weight"], torch.arange(6.0).reshape(2, 3))
    opened = open_checkpoint(detect_checkpoint(path), module_key=None, weights_only=True)  # by byte ranges
    assert torch.equal(opened.source.read("weight"), torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("legacy", [False, True])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, legacy):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.pth"
    torch.save(
        {"weight": torch.zeros(2), "payload": MarkerPayload(marker)},
        path,
        _use_new_zipfile_serialization=not legacy,
    )
    detected = detect_checkpoint(path)
    with pytest.raises(CheckpointLoadError, match=r"Refused to unpickle.*weights_only=False"):
        open_checkpoint(detected, module_key=None, weights_only=True)
    assert not marker.exists()


def test_bad_input_gets_one_clear_error(tmp_path, state_dict):
    for case, (path, pattern) in write_bad_inputs(tmp_path, state_dict).items():
        with pytest.raises(CheckpointLoadError, match=pattern):
            open_checkpoint(detect_checkpoint(path), module_key=None, weights_only=True)
        print(f"{case}: ok")


def test_index_whose_shard_lacks_a_tensor(tmp_path, state_dict):
    index = write_checkpoint(state_dict, tmp_path, "hf-index-safetensors")
    content = json.loads(index.read_text())
    content["weight_map"]["extra.weight"] = next(iter(content["weight_map"].values()))
    index.write_text(json.dumps(content))
    with pytest.raises(CheckpointLoadError, match=r"not in the shard it points to.*extra.weight"):
        open_checkpoint(detect_checkpoint(index), module_key=None, weights_only=True)


def test_fabric_checkpoint_and_raw_file_told_apart(tmp_path, state_dict):
    torch.save({"model": state_dict, "step": 3}, tmp_path / "fabric.ckpt")
    opened = open_checkpoint(detect_checkpoint(tmp_path / "fabric.ckpt"), module_key="model", weights_only=True)
    assert not opened.raw
    assert opened.entries == {"step": 3}
    # `load_raw` (no key) takes the checkpoint's one module entry, as from a sharded checkpoint.
    opened = open_checkpoint(detect_checkpoint(tmp_path / "fabric.ckpt"), module_key=None, weights_only=True)
    assert set(opened.source.specs()) == set(state_dict)
    assert opened.entries == {}
    with pytest.raises(CheckpointLoadError, match=r"no entry 'net' for the model.*'model', 'step'"):
        open_checkpoint(detect_checkpoint(tmp_path / "fabric.ckpt"), module_key="net", weights_only=True)


@pytest.mark.parametrize("legacy", [False, True])
def test_views_and_fabric_checkpoints_are_read_by_byte_ranges(tmp_path, state_dict, legacy):
    transposed = dict(state_dict, **{"head.weight": state_dict["head.weight"].t().contiguous().t()})
    path = tmp_path / "fabric.ckpt"
    adam = {"state": {"head.weight": {"exp_avg": torch.ones(37, 16), "step": torch.tensor(3.0)}}, "param_groups": []}
    torch.save({"model": transposed, "optimizer": adam}, path, _use_new_zipfile_serialization=not legacy)
    opened = open_checkpoint(detect_checkpoint(path), module_key="model", weights_only=True)
    assert isinstance(opened.source, ByteRangeSource)
    for name, tensor in state_dict.items():
        assert torch.equal(opened.source.read(name), tensor)
        assert torch.equal(opened.source.read_flat(name, 1, 3), tensor.reshape(-1)[1:3])
    exp_avg = opened.entries["optimizer"]["state"]["head.weight"]["exp_avg"]
    assert tuple(exp_avg.shape) == (37, 16)  # a reference, read only where a rank needs it
    assert torch.equal(exp_avg.read_flat(5, 9), torch.ones(4))
    # A trusted file (weights_only=False) may hold any object: it is read whole.
    trusted = open_checkpoint(detect_checkpoint(path), module_key="model", weights_only=False)
    assert isinstance(trusted.source, DictSource)
    assert torch.equal(trusted.entries["optimizer"]["state"]["head.weight"]["exp_avg"], torch.ones(37, 16))


def test_a_directory_holding_one_file_suggests_the_file(tmp_path):
    """`fabric.load("ckpts/", ...)` where `fabric.save` wrote `ckpts/full.ckpt`: the error names the file."""
    (tmp_path / "one").mkdir()
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "one" / "full.ckpt")
    with pytest.raises(CheckpointLoadError, match="holds no checkpoint") as one:
        detect_checkpoint(tmp_path / "one")
    assert str(one.value).endswith(f"Did you mean {str(tmp_path / 'one' / 'full.ckpt')!r}?")
    (tmp_path / "two").mkdir()
    for name in ("a.ckpt", "b.ckpt"):
        torch.save({}, tmp_path / "two" / name)
    with pytest.raises(CheckpointLoadError, match="holds no checkpoint") as two:
        detect_checkpoint(tmp_path / "two")
    assert "Did you mean" not in str(two.value)  # several candidates: no guess


def test_a_directory_holding_one_checkpoint_file_among_others_suggests_it(tmp_path):
    """A run's folder, `fabric.save`'s `full.ckpt` beside a logger's `hparams.yaml`: the error names the file."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"model": {"w": torch.ones(2)}}, run / "full.ckpt")
    (run / "hparams.yaml").write_text("lr: 0.1\n")
    (run / "events.out.tfevents").write_bytes(b"\0" * 8)
    (run / "step-1.ckpt").mkdir()  # a directory named like a checkpoint file is no candidate
    with pytest.raises(CheckpointLoadError, match="holds no checkpoint") as error:
        detect_checkpoint(run)
    assert str(error.value).endswith(f"Did you mean {str(run / 'full.ckpt')!r}?")
    # one file, but nothing that looks like a checkpoint: no guess
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointLoadError, match="holds no checkpoint") as error:
        detect_checkpoint(notes)
    assert "Did you mean" not in str(error.value)


def test_a_text_file_shows_its_first_bytes_as_text_too(tmp_path):
    """An HTML error page saved in place of the weights: the error shows what it is, not only hexadecimal bytes."""
    (tmp_path / "model.bin").write_text("<html><body>403 Forbidden</body></html>")
    with pytest.raises(CheckpointLoadError) as error:
        detect_checkpoint(tmp_path / "model.bin")
    assert str(error.value).endswith(
        "Its first bytes are 3c 68 74 6d 6c 3e 3c 62 (as text: '<html><body>403 Forbidden</body></html>'). It is a web"
        " page (a download that returned an error page?): download the checkpoint again."
    )
    (tmp_path / "binary.bin").write_bytes(bytes(range(1, 40)))
    with pytest.raises(CheckpointLoadError) as error:
        detect_checkpoint(tmp_path / "binary.bin")
    assert str(error.value).endswith("Its first bytes are 01 02 03 04 05 06 07 08.")


def test_a_git_lfs_pointer_is_shown_as_text_and_named(tmp_path):
    """A clone without `git lfs pull`: the weights file is a pointer of three lines, shown escaped and cut short."""
    pointer = tmp_path / "model.pth"
    pointer.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'4d' * 32}\nsize 26953704\n")
    with pytest.raises(CheckpointLoadError) as error:
        detect_checkpoint(pointer)
    assert str(error.value).endswith(
        "Its first bytes are 76 65 72 73 69 6f 6e 20 (as text: 'version https://git-lfs.github.com/spec/'). It is a"
        " Git LFS pointer, not the file it stands for: fetch the file with `git lfs pull` in its repository."
    )


@pytest.mark.parametrize(
    ("content", "shown"),
    [
        ("Prüfsumme: ✓ fehlt\n".encode(), " (as text: 'Prüfsumme: ✓ fehlt\\n')."),
        # 161 bytes, of which the first 160 are read: the last of those characters is cut, and left out
        (("a" + "\U0001f600" * 45).encode(), f" (as text: {'a' + chr(0x1F600) * 39!r})."),
        ("abcd\u202eevil".encode(), "."),  # a format character that would reorder the terminal's text: not text
        (b"abcdefgh\xff\xfe", "."),  # not UTF-8
        (b"\t\n  \r\n\t  \n", "."),  # whitespace only: nothing to read
    ],
    ids=["utf-8", "cut character", "format character", "not utf-8", "whitespace"],
)
def test_only_printable_utf8_text_is_shown_as_text(tmp_path, content, shown):
    path = tmp_path / "file.ckpt"
    path.write_bytes(content)
    with pytest.raises(CheckpointLoadError) as error:
        detect_checkpoint(path)
    assert str(error.value).endswith(f"Its first bytes are {content[:8].hex(' ')}{shown}")
