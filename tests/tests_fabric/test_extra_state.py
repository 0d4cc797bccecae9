"""Modules that save an extra state (``get_extra_state``), as Transformer Engine's layers do, load and save whole.

``Module.load_state_dict`` calls ``set_extra_state`` with the entry ``<module>._extra_state``, which may hold any
object (Transformer Engine keeps its FP8 metadata in a byte tensor). The package matches these entries by the core's
matching and sets them with the core's ``_set_extra_states``, so it gives what the core and upstream give: a missing
one is a strict error that leaves the model as it was, an unexpected one too, ``strict=False`` leaves it as it was,
and an automatic prefix alignment renames them with the tensors. The gather-free save falls back to Lightning's own
save for such a model (only ``torch.save`` pickles an arbitrary object), so the file holds them as Lightning's does.
A sharded checkpoint (torch's distributed checkpoint, which stores a dict under the path of each of its leaves) loads
them too, one written by Fabric or by ``convert_checkpoint``. Each case runs on FSDP1 and FSDP2, on two CPU ranks.
"""

import os
from contextlib import nullcontext
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy, convert_checkpoint
from lightning_fsdp.core.fsdp import FSDPStrategy as CoreFSDPStrategy
from lightning_fsdp.core.model_parallel import ModelParallelStrategy as CoreModelParallelStrategy
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.saving import CheckpointSaveError, save_safetensors
from tests.tests_fabric.helpers.distributed import run_distributed

_CORE = {FSDPStrategy: CoreFSDPStrategy, ModelParallelStrategy: CoreModelParallelStrategy}


class Counted(nn.Linear):
    """A layer whose extra state is a plain object."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts = {"calls": 0}

    def get_extra_state(self) -> Any:
        return self.counts

    def set_extra_state(self, state: Any) -> None:
        self.counts = state


class Tagged(nn.Linear):
    """A layer whose extra state is a byte tensor, as Transformer Engine's FP8 metadata."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = torch.zeros(3, dtype=torch.uint8)

    def get_extra_state(self) -> Any:
        return self.tag

    def set_extra_state(self, state: Any) -> None:
        self.tag = state


def _model() -> nn.Sequential:
    return nn.Sequential(Counted(8, 16), nn.ReLU(), Tagged(16, 4))


def _parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=device_mesh["data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _fabric(fsdp: int, sharded: bool = False) -> Fabric:
    if fsdp == 1:
        state_dict_type = "sharded" if sharded else "full"
        strategy: Any = FSDPStrategy(auto_wrap_policy={Counted, Tagged}, state_dict_type=state_dict_type)
    else:
        strategy = ModelParallelStrategy(_parallelize, save_distributed_checkpoint=sharded)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def _extra(model: nn.Module) -> tuple[Any, Any]:
    counted = next(module for module in model.modules() if isinstance(module, Counted))
    tagged = next(module for module in model.modules() if isinstance(module, Tagged))
    return counted.counts, tagged.tag.tolist()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of each parameter (a ``DTensor``'s local tensor)."""
    params = model.named_parameters()
    return {name: getattr(param, "_local_tensor", param).detach().clone() for name, param in params}


def _fresh(fabric: Fabric) -> nn.Module:
    fabric.seed_everything(7)
    return fabric.setup_module(_model())


def _through_core(fabric: Fabric) -> Any:
    strategy_class = type(fabric.strategy)
    return mock.patch.object(strategy_class, "load_checkpoint", _CORE[strategy_class].load_checkpoint)


def _run(fsdp: int, directory: str) -> list[str]:
    fabric = _fabric(fsdp)
    torch.manual_seed(3)
    source = _model()
    source[0].counts = {"calls": 3}
    source[2].tag = torch.tensor([1, 2, 3], dtype=torch.uint8)
    state_dict = source.state_dict()
    if fabric.global_rank == 0:
        torch.save({"model": state_dict, "step": 1}, f"{directory}/full.ckpt")
        torch.save(state_dict, f"{directory}/raw.pt")
        torch.save({f"module.{name}": value for name, value in state_dict.items()}, f"{directory}/prefixed.pt")
        without = {name: value for name, value in state_dict.items() if name != "0._extra_state"}
        torch.save(without, f"{directory}/without.pt")
        torch.save({**state_dict, "1._extra_state": {"calls": 1}}, f"{directory}/unexpected.pt")
    fabric.barrier()
    expected = ({"calls": 3}, [1, 2, 3])
    done = []

    # a Fabric checkpoint and a raw one set both extra states, as the core sets them
    for name, load in (
        ("full", lambda model: fabric.load(f"{directory}/full.ckpt", {"model": model})),
        ("raw", lambda model: fabric.load_raw(f"{directory}/raw.pt", model)),
    ):
        model = _fresh(fabric)
        load(model)
        assert _extra(model) == expected, name
        core_model = _fresh(fabric)
        with _through_core(fabric):
            load(core_model)
        assert _extra(core_model) == expected, name
        core_weights = _weights(core_model)
        assert all(torch.equal(value, core_weights[key]) for key, value in _weights(model).items()), name
        done.append(name)

    # a missing extra state is a strict error that leaves the model as it was
    model = _fresh(fabric)
    before = _weights(model)
    missing = r"1 missing key\(s\), in the model but not the checkpoint: '0._extra_state'"
    leaving = r"leaving the model's 1 missing extra state\(s\) \('0._extra_state'\) as they were, pass `strict=False`"
    with pytest.raises(CheckpointLoadError, match=f"(?s){missing}.*{leaving}"):
        fabric.load_raw(f"{directory}/without.pt", model)
    assert _extra(model) == ({"calls": 0}, [0, 0, 0])
    assert all(torch.equal(value, before[key]) for key, value in _weights(model).items())
    # ... and `strict=False` loads the rest, leaving it as it was, and says so
    skipped = r"1 missing extra state\(s\) left as they were \('0._extra_state'\)"
    with pytest.warns(UserWarning, match=skipped) if fabric.global_rank == 0 else nullcontext():
        fabric.load_raw(f"{directory}/without.pt", model, strict=False)
    assert _extra(model) == ({"calls": 0}, [1, 2, 3])
    done.append("missing")

    # an extra state that no module takes is an unexpected key
    model = _fresh(fabric)
    unexpected = r"1 unexpected key\(s\), in the checkpoint but not the model: '1._extra_state'"
    with pytest.raises(CheckpointLoadError, match=unexpected):
        fabric.load_raw(f"{directory}/unexpected.pt", model)
    assert _extra(model) == ({"calls": 0}, [0, 0, 0])
    fabric.load_raw(f"{directory}/unexpected.pt", model, strict=False)
    assert _extra(model) == expected
    done.append("unexpected")

    # the automatic alignment of a prefix renames the extra states with the tensors
    model = _fresh(fabric)
    fabric.load_raw(f"{directory}/prefixed.pt", model)
    assert _extra(model) == expected
    done.append("aligned")

    # `convert_checkpoint` writes them into the sharded checkpoint, which loads them back
    if fabric.global_rank == 0:
        convert_checkpoint(f"{directory}/full.ckpt", f"{directory}/converted-{fsdp}")
    fabric.barrier()
    model = _fresh(fabric)
    fabric.load(f"{directory}/converted-{fsdp}", {"model": model})
    assert _extra(model) == expected
    done.append("converted")

    # the save holds them as Lightning's own save does (the package falls back to it for such a model, and says why)
    fallback = r"by gathering it on rank 0 \(Lightning's way\).*the model saves an extra state \('0._extra_state'"
    with pytest.warns(UserWarning, match=fallback) if fabric.global_rank == 0 else nullcontext():
        fabric.save(f"{directory}/saved-{fsdp}.ckpt", {"model": model})
    fabric.barrier()
    saved = torch.load(f"{directory}/saved-{fsdp}.ckpt", weights_only=True)["model"]
    assert saved["0._extra_state"] == {"calls": 3}
    assert saved["2._extra_state"].tolist() == [1, 2, 3]
    assert saved.keys() == state_dict.keys()
    for name, value in state_dict.items():
        if name != "0._extra_state":
            assert torch.equal(saved[name], value), name
    done.append("saved")

    # `save_safetensors` has no gather to fall back to: it refuses, on every rank, and writes nothing
    refused = r"cannot write .*: the model saves an extra state \('0._extra_state'"
    with pytest.raises(CheckpointSaveError, match=refused):
        save_safetensors(fabric, f"{directory}/export-{fsdp}.safetensors", model)
    assert not os.path.exists(f"{directory}/export-{fsdp}.safetensors")
    done.append("safetensors refused")
    return done


@pytest.mark.parametrize("fsdp", [1, 2], ids=["fsdp1", "fsdp2"])
def test_extra_states_load_and_save_whole(tmp_path, fsdp):
    results = run_distributed(_run, fsdp, str(tmp_path), devices=2)
    cases = ["full", "raw", "missing", "unexpected", "aligned", "converted", "saved", "safetensors refused"]
    assert results == [cases] * 2


def _run_sharded(fsdp: int, directory: str) -> tuple[Any, Any]:
    fabric = _fabric(fsdp, sharded=True)
    model = _fresh(fabric)
    for module in model.modules():
        if isinstance(module, Counted):
            module.counts = {"calls": 5, "scales": [0.5, 2.0]}
        if isinstance(module, Tagged):
            module.tag = torch.tensor([4, 5, 6], dtype=torch.uint8)
    fabric.save(f"{directory}/sharded", {"model": model})
    loaded = _fresh(fabric)
    # the distributed checkpoint reads into the structure of the state that it is given, as in Lightning's own load
    next(module for module in loaded.modules() if isinstance(module, Counted)).counts = {"calls": 0, "scales": [1.0]}
    fabric.load(f"{directory}/sharded", {"model": loaded})
    assert all(torch.equal(value, _weights(model)[key]) for key, value in _weights(loaded).items())
    # a key of the extra state that the checkpoint lacks: the fix names the extra state, not a tensor
    other = _fresh(fabric)
    next(module for module in other.modules() if isinstance(module, Counted)).counts = {"calls": 0, "new": 1}
    leaving = r"leaving the model's 1 missing extra state\(s\) \('0._extra_state'\) as they were"
    with pytest.raises(CheckpointLoadError, match=f"(?s)missing key.*'0._extra_state.new'.*{leaving}"):
        fabric.load(f"{directory}/sharded", {"model": other})
    return _extra(loaded)


@pytest.mark.parametrize("fsdp", [1, 2], ids=["fsdp1", "fsdp2"])
def test_extra_states_in_a_sharded_checkpoint(tmp_path, fsdp):
    """The distributed checkpoint stores a dict under its leaves' paths: they are the extra state's, not unexpected."""
    results = run_distributed(_run_sharded, fsdp, str(tmp_path), devices=2)
    assert results == [({"calls": 5, "scales": [0.5, 2.0]}, [4, 5, 6])] * 2


def test_convert_writes_an_extra_state_that_holds_a_tensor(tmp_path):
    """An extra state is written whole, a tensor inside it included, as the distributed checkpoint writes objects."""
    import torch.distributed.checkpoint as dcp

    extra = {"scale": torch.arange(3.0), "calls": 2}
    torch.save({"w": torch.ones(4, 4), "m._extra_state": extra}, tmp_path / "raw.pt")
    result = convert_checkpoint(tmp_path / "raw.pt", tmp_path / "out")
    assert (result.tensors, result.chunks) == (1, 1)  # the extra state is no chunk of a tensor
    state = {"model": {"w": torch.zeros(4, 4), "m._extra_state": {"scale": torch.zeros(3), "calls": 0}}}
    with pytest.warns(UserWarning, match="assuming the intent is to load in a single process"):
        dcp.load(state, checkpoint_id=tmp_path / "out", no_dist=True)
    assert torch.equal(state["model"]["w"], torch.ones(4, 4))
    assert torch.equal(state["model"]["m._extra_state"]["scale"], extra["scale"])
    assert state["model"]["m._extra_state"]["calls"] == 2


@pytest.mark.parametrize("fabric_checkpoint", [False, True], ids=["raw", "fabric"])
def test_extra_state_bytes_come_from_the_file_and_code_in_one_never_runs(tmp_path, fabric_checkpoint):
    """A tensor inside an extra state is read by its proven byte range; a pickled payload there is refused unrun."""
    from lightning_fsdp.loading.formats import detect_checkpoint, open_checkpoint
    from lightning_fsdp.loading.sources import TensorRef, materialize
    from tests.tests_fabric.helpers.checkpoints import MarkerPayload

    def save(extra: Any, path: Any) -> None:
        state = {"w": torch.ones(2, 3), "m._extra_state": extra}
        torch.save({"model": state, "step": 1} if fabric_checkpoint else state, path)

    key = "model" if fabric_checkpoint else None
    save({"scale": torch.arange(4.0), "calls": 2}, tmp_path / "extra.pt")
    opened = open_checkpoint(detect_checkpoint(tmp_path / "extra.pt"), key, weights_only=True)
    assert set(opened.source.specs()) == {"w"}
    assert isinstance(opened.module_extras["m._extra_state"]["scale"], TensorRef)
    extra = materialize(opened.module_extras)["m._extra_state"]
    assert torch.equal(extra["scale"], torch.arange(4.0))
    assert extra["calls"] == 2
    opened.close()

    marker = tmp_path / "ran"
    save(MarkerPayload(marker), tmp_path / "payload.pt")
    with pytest.raises(CheckpointLoadError, match="Refused to unpickle"):
        open_checkpoint(detect_checkpoint(tmp_path / "payload.pt"), key, weights_only=True)
    assert not marker.exists()
