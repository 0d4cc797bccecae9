"""Strict and non-strict loading of raw files and Fabric checkpoints, on real processes."""

import warnings

import pytest
import torch
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy, convert_checkpoint
from lightning_fsdp.loading.errors import CheckpointLoadError
from tests.tests_fabric.helpers.checkpoints import write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state


def _setup(fabric: Fabric, seed: int):
    fabric.seed_everything(seed)
    with fabric.init_module(empty_init=True):
        model = TinyTransformer()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    # one step, so that the optimizer has state that a wrong load would change
    fabric.backward(model(torch.zeros(1, 2, dtype=torch.long)).sum())
    optimizer.step()
    return model, optimizer


def _strictness(paths: dict[str, str]) -> bool:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    expected = torch.load(paths["expected"], weights_only=True)
    model, optimizer = _setup(fabric, seed=5)
    before = gather_full_state(model, optimizer)

    # A raw file holds weights only: asking for more is an error with strict=True, and nothing is written.
    state = {"model": model, "optimizer": optimizer, "step": 0}
    with pytest.raises(CheckpointLoadError, match=r"(?s)raw module state dict.*'optimizer', 'step'.*strict=False"):
        fabric.load(paths["raw"], state)
    assert_same_state(gather_full_state(model, optimizer), before)

    # With strict=False the weights load and the rest is left untouched.
    assert fabric.load(paths["raw"], state, strict=False) == {}
    after = gather_full_state(model, optimizer)
    assert_same_state(after["model"], expected)
    assert_same_state(after["optimizer"], before["optimizer"])
    assert state["step"] == 0

    # A partial file with strict=False loads the intersection and reports what it skipped.
    model, optimizer = _setup(fabric, seed=6)
    before = gather_full_state(model)["model"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(paths["partial"], {"model": model}, strict=False)
    if fabric.global_rank == 0:
        text = " ".join(str(w.message) for w in caught)
        assert "missing key(s) left as they were" in text, text
        assert "'blocks.0.norm.weight'" in text
        assert "1 unexpected key(s) ignored ('extra.weight')" in text
    actual = gather_full_state(model)["model"]
    for name, tensor in actual.items():
        reference = before[name] if name.startswith("blocks.0.") else expected[name]
        assert torch.equal(tensor, reference), name

    # The same file with strict=True names what is wrong, and writes nothing.
    with pytest.raises(CheckpointLoadError, match=r"(?s)missing key.*'blocks.0.norm.weight'.*unexpected key.*'extra"):
        fabric.load(paths["partial"], {"model": model})
    assert_same_state(gather_full_state(model)["model"], actual)

    # A Fabric checkpoint without a requested key: an error with strict=True, the key left as is with strict=False.
    state = {"model": model, "step": 1, "epoch": 7}
    with pytest.raises(CheckpointLoadError, match=r"no entry 'epoch'"):
        fabric.load(paths["fabric"], state)
    fabric.load(paths["fabric"], state, strict=False)
    assert state["step"] == 42
    assert state["epoch"] == 7
    assert_same_state(gather_full_state(model)["model"], expected)

    # A sharded checkpoint (here converted from the raw file) is checked the same way before anything is read.
    model, optimizer = _setup(fabric, seed=8)
    before = gather_full_state(model, optimizer)
    state = {"model": model, "optimizer": optimizer}
    with pytest.raises(CheckpointLoadError, match=r"no entry 'optimizer'.*strict=False"):
        fabric.load(paths["sharded"], state)
    assert_same_state(gather_full_state(model, optimizer), before)
    with pytest.raises(CheckpointLoadError, match=r"no entry 'net' for the model.*'model'"):
        fabric.load(paths["sharded"], {"net": model})
    fabric.load(paths["sharded"], state, strict=False)
    after = gather_full_state(model, optimizer)
    assert_same_state(after["model"], expected)
    assert_same_state(after["optimizer"], before["optimizer"])
    return True


def test_strict_and_non_strict(tmp_path):
    torch.manual_seed(0)
    state_dict = TinyTransformer().state_dict()
    paths = {"expected": str(tmp_path / "expected.pt"), "fabric": str(tmp_path / "fabric.ckpt")}
    torch.save(state_dict, paths["expected"])
    torch.save({"model": state_dict, "step": 42}, paths["fabric"])
    paths["raw"] = str(write_checkpoint(state_dict, tmp_path / "raw", "torch-zip"))
    partial = {k: v for k, v in state_dict.items() if not k.startswith("blocks.0.")}
    partial["extra.weight"] = torch.ones(3)
    paths["partial"] = str(write_checkpoint(partial, tmp_path / "partial", "safetensors"))
    paths["sharded"] = convert_checkpoint(paths["raw"], tmp_path / "sharded").output
    assert run_distributed(_strictness, paths, devices=2) == [True, True]
