"""The strategy class itself: compatibility with upstream, and what changes only through this class."""

import inspect
from datetime import timedelta

import lightning.fabric.strategies
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy as UpstreamFSDPStrategy
from lightning.fabric.strategies.fsdp import _FSDP_ALIASES

import lightning_fsdp
from lightning_fsdp import FSDPStrategy
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer


def test_is_an_upstream_fsdp_strategy():
    """Downstream code (litgpt's ``load_checkpoint``, Fabric's connector) dispatches on the upstream class."""
    strategy = FSDPStrategy()
    assert isinstance(strategy, UpstreamFSDPStrategy)
    assert isinstance(strategy, lightning.fabric.strategies.FSDPStrategy)
    assert isinstance(strategy, lightning.fabric.strategies.fsdp.FSDPStrategy)
    assert isinstance(strategy, lightning.fabric.strategies.ParallelStrategy)


def test_signature_is_upstreams_plus_ours():
    """Upstream's parameters in upstream's order, kinds, defaults and annotations, then ours, keyword-only.

    Fails when Lightning changes its signature, so that this class follows it.
    """
    upstream = list(inspect.signature(UpstreamFSDPStrategy).parameters.values())
    ours = list(inspect.signature(FSDPStrategy).parameters.values())
    assert [p.name for p in upstream][-1] == "kwargs"
    *upstream_named, upstream_kwargs = upstream
    *ours_named, load_concurrency, load_progress, save_in_background, ours_kwargs = ours
    for mine, theirs in zip(ours_named, upstream_named, strict=True):
        assert (mine.name, mine.kind, mine.default, mine.annotation) == (
            theirs.name,
            theirs.kind,
            theirs.default,
            theirs.annotation,
        )
    assert ours_kwargs == upstream_kwargs
    assert load_concurrency.kind is load_progress.kind is inspect.Parameter.KEYWORD_ONLY
    assert (load_concurrency.name, load_concurrency.default) == ("load_concurrency", "auto")
    assert (load_progress.name, load_progress.default) == ("load_progress", True)
    assert save_in_background.kind is inspect.Parameter.KEYWORD_ONLY
    assert (save_in_background.name, save_in_background.default) == ("save_in_background", False)
    assert inspect.signature(FSDPStrategy.__init__).return_annotation is None


def test_accepts_every_upstream_argument():
    """Every upstream parameter reaches upstream's `__init__`, by keyword and by position; FSDP's own kwargs too."""
    strategy = FSDPStrategy(
        cpu_offload=True,
        sharding_strategy="SHARD_GRAD_OP",
        state_dict_type="full",
        auto_wrap_policy={Block},
        activation_checkpointing_policy={Block},
        limit_all_gathers=True,
        load_concurrency=2,
    )
    assert strategy.cpu_offload.offload_params
    assert strategy.sharding_strategy.name == "SHARD_GRAD_OP"
    assert strategy._state_dict_type == "full"
    assert strategy._fsdp_kwargs["limit_all_gathers"] is True
    assert "load_concurrency" not in strategy._fsdp_kwargs
    assert strategy.load_concurrency == 2
    timeout = timedelta(seconds=5)
    devices = [torch.device("cpu")] * 2
    positional = FSDPStrategy(None, devices, None, None, "gloo", timeout, True, None, {Block}, None, None, "NO_SHARD")
    assert positional.parallel_devices == devices
    assert positional.process_group_backend == "gloo"
    assert positional._timeout == timeout
    assert positional.cpu_offload.offload_params
    assert positional.sharding_strategy.name == "NO_SHARD"
    assert "auto_wrap_policy" in positional._fsdp_kwargs
    with pytest.raises(TypeError, match="positional"):
        FSDPStrategy(*[None] * 14, 1)  # `load_concurrency` is keyword-only


@pytest.mark.parametrize("value", [0, -1, 1.5, "all", True])
def test_load_concurrency_is_validated(value):
    with pytest.raises(ValueError, match="load_concurrency"):
        FSDPStrategy(load_concurrency=value)


@pytest.mark.parametrize("strategy", ["fsdp", *_FSDP_ALIASES, UpstreamFSDPStrategy()])
def test_upstream_class_still_refuses_cpu(strategy):
    """Behaviour changes only through this package's class: upstream's keeps refusing CPU as it does today."""
    with pytest.raises(ValueError, match="FSDP is only available on GPU"):
        Fabric(accelerator="cpu", devices=2, strategy=strategy)


def test_fabric_accepts_our_class_on_cpu():
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy())
    assert isinstance(fabric.strategy, FSDPStrategy)
    assert fabric.strategy.root_device == torch.device("cpu")


def test_version_is_exposed():
    assert isinstance(lightning_fsdp.__version__, str)


def _upstream_wrap_on_cpu() -> str:
    """Upstream passes ``device_id=None`` on CPU, which torch's FSDP refuses."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy())
    fabric.launch()
    try:
        FullyShardedDataParallel(TinyTransformer(), device_id=None)
    except RuntimeError as error:
        upstream_error = str(error)
    else:  # pragma: no cover - means torch changed and the workaround may no longer be needed
        upstream_error = ""
    model = fabric.setup_module(TinyTransformer())
    assert next(model.parameters()).device.type == "cpu"
    return upstream_error


def test_cpu_wrapping_works_where_upstream_arguments_fail():
    (error,) = run_distributed(_upstream_wrap_on_cpu, devices=1)
    assert "FSDP needs a non-CPU accelerator device" in error


def test_cpu_offload_on_cpu_ranks_is_refused_before_the_process_group():
    """FSDP accepts `cpu_offload=True` on CPU and fails at the first forward; the strategy refuses it at launch."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy(cpu_offload=True))
    with pytest.raises(ValueError, match=r"`FSDPStrategy\(cpu_offload=True\)` moves the parameters .* remove"):
        fabric.launch()
    assert not torch.distributed.is_initialized()
