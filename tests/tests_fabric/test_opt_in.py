"""`lightning_fsdp.enable()`: unmodified scripts that construct upstream's `FSDPStrategy` get this package's."""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.accelerators import CPUAccelerator
from lightning.fabric.connector import _Connector
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import FSDPStrategy as UpstreamFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as UpstreamModelParallelStrategy

import lightning_fsdp
from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.env import without_launcher_variables
from tests.tests_fabric.helpers.models import TinyTransformer

_SCRIPT = Path(__file__).parent / "scripts" / "downstream_script.py"


@pytest.fixture(autouse=True)
def _disable_after():
    yield
    lightning_fsdp.disable()


def test_enable_is_idempotent_and_reversible():
    assert not lightning_fsdp.is_enabled()
    assert type(UpstreamFSDPStrategy()) is UpstreamFSDPStrategy

    lightning_fsdp.enable()
    lightning_fsdp.enable()
    assert lightning_fsdp.is_enabled()
    strategy = UpstreamFSDPStrategy(None, None, None, None, "gloo", state_dict_type="full", cpu_offload=True)
    assert type(strategy) is FSDPStrategy
    assert isinstance(strategy, UpstreamFSDPStrategy)
    assert strategy.process_group_backend == "gloo"
    assert strategy._state_dict_type == "full"
    assert strategy.cpu_offload.offload_params
    assert type(STRATEGY_REGISTRY.get("fsdp")) is FSDPStrategy
    assert type(FSDPStrategy(load_concurrency=1)) is FSDPStrategy
    assert Fabric(accelerator="cpu", devices=2, strategy=UpstreamFSDPStrategy()).strategy.root_device.type == "cpu"

    lightning_fsdp.disable()
    lightning_fsdp.disable()
    assert not lightning_fsdp.is_enabled()
    assert type(UpstreamFSDPStrategy(state_dict_type="full")) is UpstreamFSDPStrategy
    assert type(STRATEGY_REGISTRY.get("fsdp")) is UpstreamFSDPStrategy
    with pytest.raises(ValueError, match="FSDP is only available on GPU"):
        Fabric(accelerator="cpu", devices=2, strategy=UpstreamFSDPStrategy())


def test_model_parallel_strategy_is_covered_too():
    def parallelize(model, device_mesh):
        return model

    assert type(UpstreamModelParallelStrategy(parallelize)) is UpstreamModelParallelStrategy
    lightning_fsdp.enable()
    strategy = UpstreamModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    assert type(strategy) is ModelParallelStrategy
    assert isinstance(strategy, UpstreamModelParallelStrategy)
    assert strategy._data_parallel_size == 2
    lightning_fsdp.disable()
    assert type(UpstreamModelParallelStrategy(parallelize)) is UpstreamModelParallelStrategy
    upstream = inspect.signature(UpstreamModelParallelStrategy.__init__)
    assert inspect.signature(UpstreamModelParallelStrategy) == upstream.replace(
        parameters=list(upstream.parameters.values())[1:]
    )


def test_upstream_signature_is_kept():
    """Tools that build arguments from `inspect.signature` (jsonargparse, CLIs) still see upstream's parameters."""
    upstream = inspect.signature(UpstreamFSDPStrategy.__init__)
    expected = upstream.replace(parameters=list(upstream.parameters.values())[1:])
    lightning_fsdp.enable()
    assert inspect.signature(UpstreamFSDPStrategy) == expected
    lightning_fsdp.disable()
    assert inspect.signature(UpstreamFSDPStrategy) == expected


def test_string_form_runs_on_cpu_when_enabled():
    upstream_check = _Connector.__dict__["_check_strategy_and_fallback"]
    lightning_fsdp.enable()
    for accelerator in ("cpu", CPUAccelerator()):
        fabric = Fabric(accelerator=accelerator, devices=2, strategy="fsdp")
        assert type(fabric.strategy) is FSDPStrategy
        assert fabric.strategy.root_device == torch.device("cpu")
        assert fabric.strategy.num_processes == 2
    # CPU offloading has no meaning on CPU (and FSDP pins the offloaded memory): upstream's error, and what to do.
    with pytest.raises(ValueError, match="FSDP is only available on GPU") as info:
        Fabric(accelerator="cpu", devices=2, strategy="fsdp_cpu_offload")
    assert "use `strategy='fsdp'` on CPU" in str(info.value)

    lightning_fsdp.disable()
    assert _Connector.__dict__["_check_strategy_and_fallback"] is upstream_check
    for strategy in ("fsdp", "fsdp_cpu_offload"):
        with pytest.raises(ValueError, match="FSDP is only available on GPU") as info:
            Fabric(accelerator="cpu", devices=2, strategy=strategy)
        assert "lightning_fsdp" not in str(info.value)


def _string_form_on_cpu(checkpoint: str) -> str:
    lightning_fsdp.enable()
    fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp")
    fabric.launch()
    model = fabric.setup_module(TinyTransformer())
    fabric.load_raw(checkpoint, model)
    with torch.no_grad():
        expected = torch.load(checkpoint, weights_only=True)
        reference = TinyTransformer()
        reference.load_state_dict(expected)
        tokens = torch.arange(8).reshape(1, 8)
        torch.testing.assert_close(model(tokens), reference(tokens))
    return type(fabric.strategy).__name__


def test_string_form_trains_on_cpu_processes(tmp_path):
    torch.manual_seed(0)
    checkpoint = tmp_path / "model.pt"
    torch.save(TinyTransformer().state_dict(), checkpoint)
    assert run_distributed(_string_form_on_cpu, str(checkpoint), devices=2) == ["FSDPStrategy"] * 2


def _run_script(checkpoint: Path, *flags: str) -> subprocess.CompletedProcess:
    env = without_launcher_variables()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(_SCRIPT), str(checkpoint), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.parametrize("flag", ["--opt-in", "--opt-in-first"])
def test_downstream_script_with_the_one_line(tmp_path, flag):
    torch.manual_seed(0)
    checkpoint = tmp_path / "lit-llama.pth"
    torch.save(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).state_dict(), checkpoint)
    # The script's blocks hold their linear as `fc`: rename the keys as a converted checkpoint would have them.
    state = torch.load(checkpoint, weights_only=True)
    torch.save({f"{k.split('.')[0]}.fc.{k.split('.')[1]}": v for k, v in state.items()}, checkpoint)

    result = _run_script(checkpoint, flag)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "strategy: lightning_fsdp.strategy.FSDPStrategy" in result.stdout
    assert "loaded the raw checkpoint" in result.stdout


def test_downstream_script_without_it_fails_as_upstream_does(tmp_path):
    checkpoint = tmp_path / "lit-llama.pth"
    torch.save({}, checkpoint)
    result = _run_script(checkpoint)
    assert result.returncode != 0
    assert "FSDP is only available on GPU" in result.stderr
