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


def _sequential() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _load_as_advised(path: str, expected_path: str) -> str:
    """Load a file with one mistyped name, take the rename the error advises, and load with exactly that."""
    import ast
    import re

    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={torch.nn.Linear}))
    fabric.launch()
    expected = torch.load(expected_path, weights_only=True)
    fabric.seed_everything(3)
    with fabric.init_module(empty_init=True):
        model = _sequential()
    model = fabric.setup_module(model)
    before = gather_full_state(model)["model"]
    with pytest.raises(CheckpointLoadError) as error:
        fabric.load_raw(path, model)
    message = str(error.value)
    assert_same_state(gather_full_state(model)["model"], before)
    advised = re.search(r"`with fabric\.strategy\.load_options\(rename=(\{[^`]*\})\):`", message)
    assert advised is not None, message
    with fabric.strategy.load_options(rename=ast.literal_eval(advised.group(1))):
        fabric.load_raw(path, model)
    loaded = gather_full_state(model)["model"]
    assert set(loaded) == set(expected)
    assert all(torch.equal(loaded[name], expected[name]) for name in expected), message
    return message


def test_a_mistyped_name_is_advised_as_a_rename_that_loads_exactly(tmp_path):
    """`2.wieght` in the file, `2.weight` in the model: the error gives the rename to paste; it loads every tensor."""
    torch.manual_seed(0)
    state_dict = _sequential().state_dict()
    torch.save(state_dict, tmp_path / "expected.pt")
    mistyped = {("2.wieght" if name == "2.weight" else name): tensor for name, tensor in state_dict.items()}
    path = write_checkpoint(mistyped, tmp_path / "mistyped", "safetensors")
    for message in run_distributed(_load_as_advised, str(path), str(tmp_path / "expected.pt"), devices=2):
        assert "`with fabric.strategy.load_options(rename={'2.wieght': '2.weight'}):`" in message, message
        # `strict=False` appears only to say that it would not load '2.weight'.
        assert "`strict=False` is not the fix: it would not load '2.weight'" in message, message
        assert "To load only the tensors that match" not in message


def _plan_error(targets: dict[str, tuple], checkpoint: dict[str, tuple], **kwargs) -> str:
    from lightning_fsdp.layouts.targets import TargetSpec
    from lightning_fsdp.loading.sources import TensorSpec
    from lightning_fsdp.loading.validation import plan_load

    with pytest.raises(CheckpointLoadError) as error:
        plan_load(
            [TargetSpec((name,), shape, torch.float32) for name, shape in targets.items()],
            {name: TensorSpec(shape, torch.float32) for name, shape in checkpoint.items()},
            strict=True,
            **kwargs,
        )
    return str(error.value)


def test_names_that_do_not_pair_get_no_rename_and_strict_false_names_what_it_leaves():
    """A mistyped name of another shape, or two mistyped names of one shape: no rename is guessed."""
    model = {"0.weight": (8, 4), "0.bias": (8,), "2.weight": (3, 8), "2.bias": (3,)}
    other_shape = {**{k: v for k, v in model.items() if k != "2.weight"}, "2.wieght": (3, 9)}
    square = {"0.weight": (4, 4), "0.bias": (4,), "2.weight": (4, 4), "2.bias": (4,)}
    ambiguous = {"0.wieght": (4, 4), "0.bias": (4,), "2.wieght": (4, 4), "2.bias": (4,)}
    for targets, checkpoint, left in (
        (model, other_shape, "('2.weight')"),
        (square, ambiguous, "('0.weight', '2.weight')"),
    ):
        message = _plan_error(targets, checkpoint)
        assert "rename" not in message, message
        assert (
            f"To load only the tensors that match, leaving the model's {left.count(',') + 1} missing tensor(s) {left}"
            " as they were, pass `strict=False`." in message
        ), message
    # Behind a prefix, the pair is advised with the prefix; a prefix that leaves tensors out names them.
    prefixed = {f"module.{'2.wieght' if k == '2.weight' else k}": v for k, v in model.items()}
    message = _plan_error(model, prefixed)
    assert "`with fabric.strategy.load_options(rename={'module.': '', 'module.2.wieght': '2.weight'}):`" in message
    partial = {f"module.{k}": v for k, v in other_shape.items()}
    message = _plan_error(model, partial)
    assert "rename={'module.': ''}` and `strict=False`, 3 of the model's 4 tensors load, and the other 1" in message
    assert "('2.weight') stay as they were" in message
