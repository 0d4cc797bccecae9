"""Raw module state dicts in every format, through `fabric.load` and `fabric.load_raw`, on real processes."""

import pytest
import torch
from lightning.fabric import Fabric

from lightning_fsdp import FSDPStrategy
from tests.tests_fabric.helpers.checkpoints import FORMATS, write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer
from tests.tests_fabric.helpers.runif import RunIf
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state


def _source_state(tie_weights: bool, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyTransformer(tie_weights=tie_weights)
    with torch.no_grad():
        model.scale.uniform_()  # a buffer whose value differs from what `reset_parameters` gives
    return {name: tensor.to(dtype) for name, tensor in model.state_dict().items()}


def _fresh_model(fabric: Fabric, empty_init: bool, tie_weights: bool) -> torch.nn.Module:
    fabric.seed_everything(7)  # different weights from the source's
    with fabric.init_module(empty_init=empty_init):
        model = TinyTransformer(tie_weights=tie_weights)
    return fabric.setup_module(model)


def _load_all(accelerator: str, devices: int, paths: dict[str, str], expected_path: str) -> int:
    expected = torch.load(expected_path, weights_only=True)
    loads = 0
    for name, path in paths.items():
        for empty_init in (False, True):
            # Tied weights with meta-device initialization (the strategy keeps ties), untied ones without it.
            tie_weights = empty_init
            for api in ("load", "load_raw"):
                fabric = Fabric(
                    accelerator=accelerator, devices=devices, strategy=FSDPStrategy(auto_wrap_policy={Block})
                )
                fabric.launch()
                model = _fresh_model(fabric, empty_init, tie_weights)
                if api == "load":
                    assert fabric.load(path, {"model": model}) == {}
                else:
                    fabric.load_raw(path, model)
                actual = gather_full_state(model)["model"]
                try:
                    assert_same_state(actual, {k: v.to(actual[k].dtype) for k, v in expected.items()})
                except AssertionError as error:
                    raise AssertionError(f"{name}, empty_init={empty_init}, {api}: {error}") from None
                loads += 1
    return loads


def _write_all_formats(tmp_path, dtype=torch.float32):
    state = _source_state(tie_weights=True, dtype=dtype)
    expected_path = tmp_path / "expected.pt"
    torch.save({k: v.clone() for k, v in state.items()}, expected_path)
    paths = {fmt: str(write_checkpoint(state, tmp_path / fmt, fmt)) for fmt in FORMATS}
    return paths, str(expected_path)


@pytest.mark.parametrize("devices", [1, 4])
def test_every_format_loads_bit_exact(tmp_path, devices):
    paths, expected_path = _write_all_formats(tmp_path)
    results = run_distributed(_load_all, "cpu", devices, paths, expected_path, devices=devices, timeout=400)
    assert results == [len(paths) * 4] * devices


def test_lower_precision_file_is_cast(tmp_path):
    """A bf16 file loads into an fp32 model: each value is the bf16 value, cast."""
    paths, expected_path = _write_all_formats(tmp_path, dtype=torch.bfloat16)
    subset = {fmt: paths[fmt] for fmt in ("torch-zip", "safetensors")}
    assert run_distributed(_load_all, "cpu", 2, subset, expected_path, devices=2) == [8, 8]


@RunIf(min_cuda_gpus=2, standalone=True)
def test_every_format_loads_bit_exact_cuda(tmp_path):
    paths, expected_path = _write_all_formats(tmp_path)
    results = run_distributed(_load_all, "cuda", 2, paths, expected_path, devices=2, start_method="spawn")
    assert results == [len(paths) * 4] * 2
