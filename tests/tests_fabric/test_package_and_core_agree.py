"""Where the package's loader and the core's (what goes upstream) both serve a load, they give the same result.

The package loads with the core's layouts, name matching and optimizer slicing, and reads each slice by positioned
reads straight into the parameter; the core is the series proposed to Lightning. Each case loads the same file into
fresh objects twice through Fabric, once with this package's ``load_checkpoint`` and once with the core's on the same
strategy object, and compares what every rank holds afterwards (its shards, its optimizer state and groups, the
entries moved into ``state`` and the returned remainder), types, dtypes and devices included, then one optimizer step.
The cases are those the two layers have disagreed on or could drift on: a Fabric full checkpoint with Adam, a full
checkpoint whose optimizer state is keyed by parameter index (as a single-device run saves it), a raw state dict and a
``.safetensors`` file (``load_raw``), and a raw state dict with a missing and an unexpected name loaded with
``strict=False``, each on FSDP1 and FSDP2.
"""

from functools import partial
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.core.fsdp import FSDPStrategy as CoreFSDPStrategy
from lightning_fsdp.core.model_parallel import ModelParallelStrategy as CoreModelParallelStrategy
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import TinyTransformer
from tests.tests_fabric.test_load_against_upstream import _assert_identical, _fabric, _local, _make, _step

_CORE = {FSDPStrategy: CoreFSDPStrategy, ModelParallelStrategy: CoreModelParallelStrategy}


def _through(fabric: Fabric, core: bool, load: Any) -> Any:
    strategy_class = type(fabric.strategy)
    method = _CORE[strategy_class].load_checkpoint if core else strategy_class.load_checkpoint
    with mock.patch.object(strategy_class, "load_checkpoint", method):
        return load()


def _full(fabric: Fabric, path: str, core: bool) -> dict[str, Any]:
    model, optimizer = _make(fabric, seed=2, tensor_lr=False)
    state = {"model": model, "optimizer": optimizer}
    remainder = _through(fabric, core, lambda: fabric.load(path, state))
    assert _local(model, optimizer)["state"], f"{path}: no optimizer state was loaded"
    loaded = {**_local(model, optimizer), "remainder": remainder}
    _step(fabric, model, optimizer, 3)
    return {"loaded": loaded, "stepped": _local(model, optimizer)}


def _raw(fabric: Fabric, path: str, core: bool, strict: bool = True) -> dict[str, Any]:
    model, optimizer = _make(fabric, seed=2, tensor_lr=False)
    _through(fabric, core, lambda: fabric.load_raw(path, model, strict=strict))
    loaded = _local(model, optimizer)
    _step(fabric, model, optimizer, 3)
    return {"loaded": loaded, "stepped": _local(model, optimizer)}


def _compare(fsdp: int, directory: str) -> list[str]:
    from safetensors.torch import save_file

    fabric = _fabric(fsdp)
    # a Fabric full checkpoint with Adam (its state keyed by names)
    model, optimizer = _make(fabric, seed=1, tensor_lr=False)
    for step in range(2):
        _step(fabric, model, optimizer, step)
    fabric.save(f"{directory}/fabric.ckpt", {"model": model, "optimizer": optimizer, "step": torch.tensor(2)})
    # a single-device run's checkpoint: Adam's state keyed by parameter index, and tied weights
    torch.manual_seed(4)
    single = TinyTransformer(tie_weights=False)
    single_optimizer = torch.optim.Adam(single.parameters(), lr=0.01)
    single(torch.randint(0, 37, (2, 5))).sum().backward()
    single_optimizer.step()
    if fabric.global_rank == 0:
        torch.save({"model": single.state_dict(), "optimizer": single_optimizer.state_dict()}, f"{directory}/int.pt")
        torch.save(single.state_dict(), f"{directory}/raw.pth")
        save_file({k: v.contiguous() for k, v in single.state_dict().items()}, f"{directory}/model.safetensors")
        # one tensor missing and one the model does not have: `strict=False` loads the rest, by the core's matching
        cut = dict(single.state_dict())
        cut["not.in.the.model"] = cut.pop(next(iter(cut)))
        torch.save(cut, f"{directory}/partial.pth")
    fabric.barrier()

    compared = []
    for name, path, load in (
        ("fabric checkpoint", "fabric.ckpt", _full),
        ("index-keyed optimizer state", "int.pt", _full),
        ("raw state dict", "raw.pth", _raw),
        ("safetensors", "model.safetensors", _raw),
        ("partial raw state dict, strict=False", "partial.pth", partial(_raw, strict=False)),
    ):
        ours = load(fabric, f"{directory}/{path}", core=False)
        core = load(fabric, f"{directory}/{path}", core=True)
        _assert_identical(ours, core, f"fsdp{fsdp}, {name}")
        compared.append(name)
    return compared


@pytest.mark.parametrize("fsdp", [1, 2], ids=["fsdp1", "fsdp2"])
def test_package_and_core_load_alike(tmp_path, fsdp):
    results = run_distributed(_compare, fsdp, str(tmp_path), devices=2)
    cases = [
        "fabric checkpoint",
        "index-keyed optimizer state",
        "raw state dict",
        "safetensors",
        "partial raw state dict, strict=False",
    ]
    assert results == [cases] * 2
