"""Checkpoints as users get them: a whole checkpoint for `load_raw`, names that differ by a prefix, a submodule."""

import logging
import re
import warnings

import lightning_utilities.core.rank_zero as rank_zero_module
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.layouts.targets import TargetSpec
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.formats import detect_checkpoint, open_checkpoint
from lightning_fsdp.loading.sources import TensorSpec
from lightning_fsdp.loading.validation import check_rename, plan_load
from tests.tests_fabric.helpers.checkpoints import write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state

_INFO = "The checkpoint's names match the model's once"


class CausalLM(nn.Module):
    """A base model under ``model`` and a head next to it, like Hugging Face's ``LlamaForCausalLM``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyTransformer()
        self.lm_head = nn.Linear(37, 5, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))


class LitTiny(LightningModule):
    """A LightningModule around the tiny transformer, as the Trainer saves it: its weights under ``state_dict``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyTransformer()

    def training_step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.1)


@pytest.fixture
def state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return TinyTransformer().state_dict()


def _targets(state: dict[str, torch.Tensor], prefix: str = "") -> list[TargetSpec]:
    return [TargetSpec((prefix + name,), tuple(t.shape), t.dtype) for name, t in state.items()]


def _specs(state: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in state.items()}


def _prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + name: tensor for name, tensor in state.items()}


def _causal_lm_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**_prefixed(state, "model."), "lm_head.weight": torch.full((5, 37), 0.25)}


# ---------------------------------------------------------------------------------------------------------------------
# Planning: renames, automatic alignment, advice (no processes)


@pytest.mark.parametrize(
    ("checkpoint_prefix", "model_prefix", "aligned"),
    [
        ("_orig_mod.", "", {"_orig_mod.": ""}),  # saved after `torch.compile`
        ("module.", "", {"module.": ""}),  # saved under DDP
        ("model.", "", {"model.": ""}),  # a LightningModule's `self.model`
        ("net.", "", {"net.": ""}),  # any attribute: found from the names themselves
        ("", "model.", {"": "model."}),  # the model is the wrapper
        ("", "_orig_mod.", {"": "_orig_mod."}),  # a compiled model
    ],
)
def test_one_prefix_is_aligned_automatically(state_dict, caplog, checkpoint_prefix, model_prefix, aligned):
    specs = _specs(_prefixed(state_dict, checkpoint_prefix))
    with caplog.at_level(logging.INFO):
        plan = plan_load(_targets(state_dict, model_prefix), specs, strict=True)
    assert plan.aligned == aligned
    # The copy reads each tensor by its name in the file.
    assert plan.sources == {model_prefix + name: checkpoint_prefix + name for name in state_dict}
    assert not plan.missing
    assert not plan.unexpected
    infos = [record.getMessage() for record in caplog.records if record.getMessage().startswith(_INFO)]
    assert len(infos) == 1, infos
    assert f"rename={aligned!r}" in infos[0]
    assert "rename={}" in infos[0]  # how to turn it off


def test_names_that_match_are_left_alone(state_dict, caplog):
    with caplog.at_level(logging.INFO):
        plan = plan_load(_targets(state_dict), _specs(state_dict), strict=True)
    assert plan.aligned == {}
    assert plan.sources == {name: name for name in state_dict}
    assert not [record for record in caplog.records if record.getMessage().startswith(_INFO)]


def test_causal_lm_checkpoint_into_the_base_model(state_dict):
    """LlamaForCausalLM's file (``model.*`` and ``lm_head.weight``) into a bare LlamaModel."""
    targets, specs = _targets(state_dict), _specs(_causal_lm_state(state_dict))
    pattern = (
        r"(?s)1 unexpected key\(s\).*'lm_head\.weight'.*aligned by `rename=\{'model\.': ''\}`.*"
        r"pass `rename=\{'model\.': '', 'lm_head\.': None\}`.*fabric\.strategy\.load_options.*`strict=False`"
    )
    with pytest.raises(CheckpointLoadError, match=pattern):
        plan_load(targets, specs, strict=True)
    # Both suggestions work: the exact rename with strict=True, or strict=False.
    plan = plan_load(targets, specs, strict=True, rename={"model.": "", "lm_head.": None})
    assert plan.sources == {name: f"model.{name}" for name in state_dict}
    assert not plan.unexpected
    plan = plan_load(targets, specs, strict=False)
    assert plan.sources == {name: f"model.{name}" for name in state_dict}
    assert plan.unexpected == ["lm_head.weight"]
    assert plan.skipped_summary() == "1 unexpected key(s) ignored ('lm_head.weight')"


def test_several_fitting_prefixes_are_not_guessed(state_dict):
    specs = _specs({**_prefixed(state_dict, "student."), **_prefixed(state_dict, "teacher.")})
    pattern = r"several prefixes.*`rename=\{'student\.': ''\}` or `rename=\{'teacher\.': ''\}`"
    with pytest.raises(CheckpointLoadError, match=pattern):
        plan_load(_targets(state_dict), specs, strict=False)
    plan = plan_load(_targets(state_dict), specs, strict=True, rename={"student.": "", "teacher.": None})
    assert plan.sources == {name: f"student.{name}" for name in state_dict}


def test_a_prefix_that_leaves_model_tensors_missing_is_advised_not_applied(state_dict):
    partial = _prefixed({k: v for k, v in state_dict.items() if not k.startswith("blocks.0.")}, "module.")
    targets = _targets(state_dict)
    with pytest.raises(CheckpointLoadError) as raised:
        plan_load(targets, _specs(partial), strict=True)
    message = str(raised.value)
    assert "with `rename={'module.': ''}` and `strict=False`, 13 of the model's 18 tensors load" in message
    # The old advice did not work for this file: a `torch.load` one-liner, and `strict=False` alone (nothing matches).
    assert "torch.load" not in message
    assert "To load only the tensors that match" not in message
    plan = plan_load(targets, _specs(partial), strict=False, rename={"module.": ""})
    assert len(plan.sources) == 13
    assert plan.missing == [name for name in state_dict if name.startswith("blocks.0.")]


def test_nothing_in_common_gives_no_advice_that_fails(state_dict):
    with pytest.raises(CheckpointLoadError) as raised:
        plan_load(_targets(state_dict), _specs({"other.weight": torch.zeros(2)}), strict=True)
    assert "strict=False" not in str(raised.value)
    assert "rename" not in str(raised.value)


def _with_exact_embedding(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor without the model's prefix `model.`, plus the embedding under its exact name `model.`."""
    return {**state_dict, "model.embedding.weight": torch.full_like(state_dict["embedding.weight"], 0.125)}


def test_an_exact_name_wins_over_the_alignment(state_dict):
    """Adding `model.` would load 'embedding.weight' where the file holds 'model.embedding.weight': not applied."""
    targets, specs = _targets(state_dict, "model."), _specs(_with_exact_embedding(state_dict))
    others = [name for name in state_dict if name != "embedding.weight"]
    # strict=False matches names exactly, as strict=True does, and says why the prefix was not added.
    plan = plan_load(targets, specs, strict=False)
    assert plan.aligned == {}
    assert plan.sources == {"model.embedding.weight": "model.embedding.weight"}
    assert plan.missing == [f"model.{name}" for name in others]
    assert plan.unexpected == list(state_dict)
    summary = plan.skipped_summary()
    assert summary.endswith(
        "names matched exactly, because once the prefix 'model.' is added to them, 'embedding.weight' would be loaded"
        " into 'model.embedding.weight', which the checkpoint holds by its exact name 'model.embedding.weight' (an"
        " exact name always wins over the automatic alignment)"
    ), summary
    # strict=True refuses the same plan, and names the two ways out.
    with pytest.raises(CheckpointLoadError) as raised:
        plan_load(targets, specs, strict=True)
    message = str(raised.value)
    assert f"{len(others)} missing key(s)" in message
    assert "The names were not aligned automatically: once the prefix 'model.' is added to them" in message
    value = "{'': 'model.', 'model.embedding.weight': None}"
    assert f"`rename={value}` loads the renamed tensors and leaves out the exactly named ones" in message
    assert "`strict=False` loads only the tensors whose names match exactly" in message
    assert "fabric.strategy.load_options" in message
    # The advised rename loads every tensor, strictly.
    plan = plan_load(targets, specs, strict=True, rename={"": "model.", "model.embedding.weight": None})
    assert plan.sources == {f"model.{name}": name for name in state_dict}
    # An alignment that keeps every exact match is applied: removing `module.` leaves 'head.weight' feeding its own.
    checkpoint = {(name if name == "head.weight" else f"module.{name}"): t for name, t in state_dict.items()}
    plan = plan_load(_targets(state_dict), _specs(checkpoint), strict=True)
    assert plan.aligned == {"module.": ""}
    assert plan.sources == {name: name if name == "head.weight" else f"module.{name}" for name in state_dict}


def test_explicit_rename(state_dict):
    targets = _targets(state_dict)
    causal = _specs(_causal_lm_state(state_dict))

    def callable_rename(name: str) -> str | None:
        return None if name == "lm_head.weight" else name.removeprefix("model.")

    plan = plan_load(targets, causal, strict=True, rename=callable_rename)
    assert plan.sources == {name: f"model.{name}" for name in state_dict}
    assert plan.aligned == {}
    # The longest prefix wins; names that no prefix matches keep their name.
    mixed = _specs({**_prefixed(state_dict, "a.b."), "a.extra": torch.zeros(1)})
    plan = plan_load(targets, mixed, strict=False, rename={"a.": "x.", "a.b.": ""})
    assert plan.sources == {name: f"a.b.{name}" for name in state_dict}
    assert plan.unexpected == ["a.extra"]
    # An explicit rename is not aligned further: `{}` turns the automatic alignment off.
    with pytest.raises(CheckpointLoadError, match=r"(?s)18 missing.*After `rename`, the checkpoint's names read"):
        plan_load(targets, _specs(_prefixed(state_dict, "module.")), strict=True, rename={})


def test_bad_renames_are_refused(state_dict):
    specs = _specs(_causal_lm_state(state_dict))
    with pytest.raises(CheckpointLoadError, match=r"two checkpoint tensors the same name 'weight'"):
        plan_load(_targets(state_dict), specs, strict=False, rename=lambda name: "weight")
    with pytest.raises(CheckpointLoadError, match=r"returned 3 \(int\) for the checkpoint tensor"):
        plan_load(_targets(state_dict), specs, strict=False, rename=lambda name: 3)
    with pytest.raises(TypeError, match=r"must be a callable .* got list"):
        check_rename(["model."])
    with pytest.raises(TypeError, match=r"holds 'model\.': 0"):
        check_rename({"model.": 0})
    check_rename({"model.": "", "lm_head.": None})
    check_rename(str.upper)
    check_rename(None)


# ---------------------------------------------------------------------------------------------------------------------
# `load_raw` of a whole checkpoint: its one module entry (no processes)


def test_load_raw_takes_the_one_module_entry(tmp_path, state_dict):
    trainer = {"state_dict": state_dict, "epoch": 3, "optimizer_states": [{"state": {}, "param_groups": []}]}
    # a tensor beside the module state (`"step": torch.tensor(3)`) does not make the file a raw state dict
    fabric_tensor_step = {"model": state_dict, "step": torch.tensor(3)}
    contents = {"fabric": {"model": state_dict, "step": 3}, "trainer": trainer, "tensor_step": fabric_tensor_step}
    for name, content in contents.items():
        torch.save(content, tmp_path / f"{name}.ckpt")
        for weights_only in (True, False):
            opened = open_checkpoint(detect_checkpoint(tmp_path / f"{name}.ckpt"), None, weights_only)
            assert set(opened.source.specs()) == set(state_dict)
            assert torch.equal(opened.source.read("head.weight"), state_dict["head.weight"])
            assert opened.entries == {}  # the rest is not read: `load_raw` returns nothing
            opened.close()


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (
            {"model_state_dict": "STATE", "optimizer_state_dict": {"state": {}, "param_groups": []}, "epoch": 1},
            r"no entry 'model' for the model.*weights are under 'model_state_dict'\. Load them with"
            r" `fabric.load\(path, \{'model_state_dict': model\}\)`\.$",
        ),
        (
            {"module": "STATE", "ema": "STATE"},
            r"2 of them hold a module state \('module', 'ema'\)\. Name the one to load as the key of the model:"
            r" `fabric.load\(path, \{'module': model\}\)` or `fabric.load\(path, \{'ema': model\}\)`\.$",
        ),
        ({"optimizer": {"state": {}, "param_groups": []}, "step": 1}, r"none of them holds a module state"),
        # a tensor beside the module state does not make the file a raw state dict (it did: "not tensors" was raised)
        (
            {"state_dict": "STATE", "step": torch.tensor(3)},
            r"weights are under 'state_dict'\. Load them with `fabric.load_raw\(path, model\)` or",
        ),
        ({"weight": torch.ones(2), "note": "x"}, r"not a raw module state dict either: beside tensors it holds 'note'"),
        ({}, r"is empty: it has no entry 'model' for the model"),
    ],
)
def test_fabric_load_without_the_model_entry_names_the_calls_that_work(tmp_path, state_dict, content, pattern):
    content = {
        key: state_dict if isinstance(value, str) and value == "STATE" else value for key, value in content.items()
    }
    torch.save(content, tmp_path / "other.ckpt")
    with pytest.raises(CheckpointLoadError, match=pattern) as error:
        open_checkpoint(detect_checkpoint(tmp_path / "other.ckpt"), "model", weights_only=True)
    assert "{'model': model}" not in str(error.value)  # never the call that just failed
    assert isinstance(error.value, KeyError)  # upstream's type: `KeyError: 'model'`


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (
            {"model": "MODEL", "state_dict": "STATE"},
            r"2 of them hold a module state \('model', 'state_dict'\).*`fabric.load\(path, \{'model': model\}\)` or"
            r" `fabric.load\(path, \{'state_dict': model\}\)`",
        ),
        (
            {"model": "MODEL", "ema": "STATE", "step": 1},
            r"entries 'model', 'ema', 'step', and 2 of them.*`fabric.load\(path, \{'ema': model\}\)`",
        ),
        (
            {"student": "MODEL", "step": 1},
            r"1 of them hold a module state \('student'\).*takes one entry named 'model' or 'state_dict'.*"
            r"`fabric.load\(path, \{'student': model\}\)`",
        ),
        (
            {"optimizer": {"state": {}, "param_groups": []}, "step": 1},
            r"none of them holds a module state \(a dict of tensors\): it holds no model weights to load\.",
        ),
        ({}, r"is empty: it holds no model weights\. Check the path\."),
    ],
)
def test_load_raw_refuses_an_ambiguous_checkpoint(tmp_path, state_dict, content, pattern):
    content = {key: state_dict if value in ("MODEL", "STATE") else value for key, value in content.items()}
    torch.save(content, tmp_path / "ambiguous.ckpt")
    with pytest.raises(CheckpointLoadError, match=pattern):
        open_checkpoint(detect_checkpoint(tmp_path / "ambiguous.ckpt"), None, weights_only=True)


# ---------------------------------------------------------------------------------------------------------------------
# On a 2-rank FSDP model


def _fabric(**kwargs) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}, **kwargs))
    fabric.launch()
    return fabric


def _model(fabric: Fabric, seed: int, cls: type[nn.Module] = TinyTransformer) -> nn.Module:
    fabric.seed_everything(seed)
    with fabric.init_module(empty_init=True):
        model = cls()
    return fabric.setup_module(model)


def _load(fabric: Fabric, path: str, module: nn.Module, rename, strict: bool = True) -> None:
    """What users write: `fabric.load_raw` inside the strategy's `load_options`."""
    with fabric.strategy.load_options(rename=rename):
        fabric.load_raw(path, module, strict=strict)
    assert fabric.strategy._load_rename is None  # the option ends with the block


class _Infos(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(_INFO):
            self.messages.append(record.getMessage())


def _whole_checkpoints(paths: dict[str, str]) -> bool:
    expected = torch.load(paths["expected"], weights_only=True)
    # litgpt's fine-tuning scripts end with `fabric.save(path, {"model": model})`, and load it with `load_raw`.
    fabric = _fabric(state_dict_type="full")
    saved = _model(fabric, seed=1)
    fabric.save(paths["final"], {"model": saved, "step": 3})
    saved_state = gather_full_state(saved)["model"]
    model = _model(fabric, seed=2)
    fabric.load_raw(paths["final"], model)
    assert_same_state(gather_full_state(model)["model"], saved_state)
    # A Lightning Trainer checkpoint: its "state_dict".
    model = _model(fabric, seed=2)
    fabric.load_raw(paths["trainer"], model)
    assert_same_state(gather_full_state(model)["model"], expected)
    return True


def _trainer_checkpoint(path: str) -> bool:
    expected = torch.load(path, weights_only=True)["state_dict"]
    fabric = _fabric()
    model = _model(fabric, seed=2, cls=LitTiny)
    before = gather_full_state(model)["model"]
    # The call a Fabric user writes first is refused on every rank, naming the two calls that load this file.
    calls = r"`fabric.load_raw\(path, model\)` or `fabric.load\(path, \{'state_dict': model\}\)`\.$"
    with pytest.raises(CheckpointLoadError, match=rf"(?s)no entry 'model' for the model.*under 'state_dict'.*{calls}"):
        fabric.load(path, {"model": model})
    assert_same_state(gather_full_state(model)["model"], before)
    # Both load it bit-exact.
    fabric.load_raw(path, model)
    assert_same_state(gather_full_state(model)["model"], expected)
    model = _model(fabric, seed=2, cls=LitTiny)
    fabric.load(path, {"state_dict": model})
    assert_same_state(gather_full_state(model)["model"], expected)
    return True


def _prefixes(paths: dict[str, str]) -> bool:
    expected = torch.load(paths["expected"], weights_only=True)
    fabric = _fabric()
    infos = _Infos()
    rank_zero_module.log.addHandler(infos)  # named after the Lightning package imported last, which does not propagate
    # A compiled model's file loads as it is, and rank 0 says how its names were aligned.
    model = _model(fabric, seed=2)
    fabric.load_raw(paths["compiled"], model)
    assert_same_state(gather_full_state(model)["model"], expected)
    assert len(infos.messages) == (1 if fabric.global_rank == 0 else 0), infos.messages
    assert all("once the prefix '_orig_mod.' is removed" in message for message in infos.messages)

    # A LlamaForCausalLM index into the base model: strict, the error names the exact rename, which then works.
    model = _model(fabric, seed=2)
    before = gather_full_state(model)["model"]
    value = "{'model.': '', 'lm_head.': None}"
    with pytest.raises(
        CheckpointLoadError, match=rf"(?s)unexpected key.*'lm_head\.weight'.*`rename={re.escape(value)}`"
    ):
        fabric.load_raw(paths["causal_lm"], model)
    assert_same_state(gather_full_state(model)["model"], before)
    _load(fabric, paths["causal_lm"], model, rename={"model.": "", "lm_head.": None})
    assert_same_state(gather_full_state(model)["model"], expected)
    model = _model(fabric, seed=2)
    fabric.load_raw(paths["causal_lm"], model, strict=False)  # aligned, and the head left out with a warning
    assert_same_state(gather_full_state(model)["model"], expected)

    # A general mapping: a callable, on a file whose names no prefix explains.
    model = _model(fabric, seed=2)
    _load(fabric, paths["renamed"], model, rename=lambda name: name.replace("layer_", "blocks."))
    assert_same_state(gather_full_state(model)["model"], expected)
    # `rename` belongs to files: a sharded checkpoint is refused.
    with pytest.raises(CheckpointLoadError, match=r"sharded checkpoint.*`rename` applies to checkpoint files only"):
        _load(fabric, paths["sharded"], model, rename={"model.": ""})
    return True


def _submodule(paths: dict[str, str], use_orig_params: bool) -> bool:
    expected = torch.load(paths["expected"], weights_only=True)
    fabric = _fabric(use_orig_params=use_orig_params)
    model = _model(fabric, seed=2, cls=CausalLM)
    before = gather_full_state(model)["model"]
    # The submodule's embedding, head and buffer live in the FSDP unit around `CausalLM`: refused, with the way out.
    advice = r"rename=\{'': 'model\.'\}" if not use_orig_params else r"rename=\{'': '<the name of this module"
    pattern = rf"(?s)part of an FSDP model.*'embedding\.weight'.*held by an FSDP unit that wraps its parent.*{advice}"
    with pytest.raises(CheckpointLoadError, match=pattern):
        fabric.load_raw(paths["bare"], model.model)
    assert_same_state(gather_full_state(model)["model"], before)
    # The advice works: the top-level model, with the prefix added and the head left as it was.
    _load(fabric, paths["bare"], model, rename={"": "model."}, strict=False)
    after = gather_full_state(model)["model"]
    assert_same_state({k: v for k, v in after.items() if k.startswith("model.")}, _prefixed(expected, "model."))
    assert torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    return True


class Wrapper(nn.Module):
    """A model whose every name starts with `model.` (a LightningModule's `self.model`)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyTransformer()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def _exact_name_wins(paths: dict[str, str]) -> bool:
    checkpoint = torch.load(paths["exact_and_unprefixed"], weights_only=True)
    fabric = _fabric()
    model = _model(fabric, seed=2, cls=Wrapper)
    before = gather_full_state(model)["model"]
    # strict=True: refused, nothing written, the two ways out named.
    with pytest.raises(
        CheckpointLoadError, match=r"(?s)not aligned automatically.*'embedding\.weight' would be loaded"
    ):
        fabric.load_raw(paths["exact_and_unprefixed"], model)
    assert_same_state(gather_full_state(model)["model"], before)
    # strict=False: the exactly named tensor loads, nothing else; the warning says why.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load_raw(paths["exact_and_unprefixed"], model, strict=False)
    if fabric.global_rank == 0:
        text = " ".join(str(w.message) for w in caught)
        assert "names matched exactly, because once the prefix 'model.' is added to them" in text, text
    after = gather_full_state(model)["model"]
    expected = {**before, "model.embedding.weight": checkpoint["model.embedding.weight"]}
    assert_same_state(after, expected)
    # The advised rename loads the unprefixed tensors, strictly.
    _load(fabric, paths["exact_and_unprefixed"], model, rename={"": "model.", "model.embedding.weight": None})
    unprefixed = {k: v for k, v in checkpoint.items() if k != "model.embedding.weight"}
    assert_same_state(gather_full_state(model)["model"], _prefixed(unprefixed, "model."))
    return True


@pytest.fixture
def user_files(tmp_path, state_dict) -> dict[str, str]:
    paths = {name: str(tmp_path / f"{name}.ckpt") for name in ("expected", "final", "trainer", "compiled", "renamed")}
    torch.save(state_dict, paths["expected"])
    trainer = {"state_dict": state_dict, "epoch": 3, "global_step": 30, "callbacks": {}, "optimizer_states": []}
    torch.save(trainer, paths["trainer"])
    torch.save(_prefixed(state_dict, "_orig_mod."), paths["compiled"])
    torch.save({name.replace("blocks.", "layer_"): t for name, t in state_dict.items()}, paths["renamed"])
    paths["exact_and_unprefixed"] = str(tmp_path / "exact_and_unprefixed.ckpt")
    torch.save(_with_exact_embedding(state_dict), paths["exact_and_unprefixed"])
    paths["causal_lm"] = str(write_checkpoint(_causal_lm_state(state_dict), tmp_path / "hf", "hf-index-safetensors"))
    paths["bare"] = str(write_checkpoint(state_dict, tmp_path / "bare", "safetensors"))
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "meta.pt").write_bytes(b"")  # only detected: refused before it is read
    paths["sharded"] = str(tmp_path / "sharded")
    return paths


def test_load_raw_of_whole_checkpoints(user_files):
    assert run_distributed(_whole_checkpoints, user_files, devices=2) == [True, True]


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # lightning.pytorch 2.6 on torch 2.13
def test_a_lightning_trainer_checkpoint_through_fabric_load(tmp_path):
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(LitTiny(), DataLoader(torch.randint(0, 37, (4, 8)), batch_size=4))
    trainer.save_checkpoint(tmp_path / "trained.ckpt")
    assert run_distributed(_trainer_checkpoint, str(tmp_path / "trained.ckpt"), devices=2) == [True, True]


def test_names_that_differ(user_files):
    assert run_distributed(_prefixes, user_files, devices=2) == [True, True]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_loading_into_a_submodule_is_refused_with_a_way_out(user_files, use_orig_params):
    assert run_distributed(_submodule, user_files, use_orig_params, devices=2) == [True, True]


def test_an_exact_name_wins_on_a_sharded_model(user_files):
    assert run_distributed(_exact_name_wins, user_files, devices=2) == [True, True]


def test_strict_false_skips_say_what_the_tensors_hold_and_advise_the_rename():
    """`strict=False` with a mistyped name: the warning gives the rename the strict error gives, and what is left."""
    targets = [
        TargetSpec(("embed.weight",), (8, 4), torch.float32),
        TargetSpec(("lm_head.weight",), (8, 4), torch.float32),
    ]
    specs = {
        "embed.weight": TensorSpec((8, 4), torch.float32),
        "output.weight": TensorSpec((8, 4), torch.float32),
    }
    with pytest.raises(CheckpointLoadError) as strict_error:
        plan_load(targets, specs, strict=True)
    advice = "load_options(rename={'output.weight': 'lm_head.weight'})"
    assert advice in str(strict_error.value)
    summary = plan_load(targets, specs, strict=False).skipped_summary()
    assert "1 missing key(s) left as they were ('lm_head.weight')" in summary
    assert "they keep the values they had before the load" in summary
    assert advice in summary, summary
