"""Where upstream raises a ``KeyError`` or a ``ValueError``, this package's error is one too, on every rank.

Code written against Lightning's own strategies catches what they raise (``except KeyError`` around a ``fabric.load``
of a checkpoint that lacks the optimizer). This package's errors say more, and are :class:`CheckpointLoadError`\\ s,
but each is also of upstream's type: a ``CheckpointKeyError`` is a ``KeyError``, a ``CheckpointValueError`` a
``ValueError``. Each case loads the same file through this package's ``load_checkpoint`` and through upstream's
(run on the same strategy object, as in ``test_load_against_upstream.py``), on FSDP1 and FSDP2 over two CPU ranks:

- a Fabric checkpoint without the optimizer that the state asks for: upstream ``KeyError: 'optimizer'``;
- a checkpoint that holds the model under another key (``{"state_dict": ...}``): upstream ``KeyError: 'model'``;
- a raw state dict loaded with an optimizer in the state: upstream ``KeyError: 'model'``.

A checkpoint's optimizer with another number of parameter groups is the core's ``ValueError``; upstream fails there
with an ``IndexError`` from inside torch, which is not a behaviour to keep, so that case compares with the core.
"""

from typing import Any
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric

from lightning_fsdp import (
    CheckpointKeyError,
    CheckpointLoadError,
    CheckpointValueError,
    FSDPStrategy,
    ModelParallelStrategy,
)
from lightning_fsdp.core.fsdp import FSDPStrategy as CoreFSDPStrategy
from lightning_fsdp.core.model_parallel import ModelParallelStrategy as CoreModelParallelStrategy
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.test_load_against_upstream import _UPSTREAM, _fabric, _make

_CORE = {FSDPStrategy: CoreFSDPStrategy, ModelParallelStrategy: CoreModelParallelStrategy}


def _raised(fabric: Fabric, body: Any, path: str, state: dict[str, Any]) -> BaseException:
    """The exception that ``fabric.load`` raises with ``body`` as the strategy's ``load_checkpoint``."""
    strategy_class = type(fabric.strategy)
    with mock.patch.object(strategy_class, "load_checkpoint", body):
        try:
            fabric.load(path, state)
        except Exception as error:
            return error
    raise AssertionError(f"loading {path!r} raised nothing")


def _run(fsdp: int, directory: str) -> list[str]:
    fabric = _fabric(fsdp)
    model, optimizer = _make(fabric, seed=1, tensor_lr=False)
    fabric.save(f"{directory}/weights.ckpt", {"model": model})
    fabric.save(f"{directory}/full.ckpt", {"model": model, "optimizer": optimizer})
    state_dict = torch.load(f"{directory}/weights.ckpt", weights_only=True)["model"]
    if fabric.global_rank == 0:
        torch.save({"state_dict": state_dict}, f"{directory}/other_key.ckpt")
        torch.save(state_dict, f"{directory}/raw.pt")
    fabric.barrier()
    strategy_class = type(fabric.strategy)
    ours, upstream = strategy_class.load_checkpoint, _UPSTREAM[strategy_class].load_checkpoint
    done = []
    for case, file, key, with_optimizer in (
        ("missing optimizer", "weights.ckpt", "optimizer", True),
        ("another key", "other_key.ckpt", "model", False),
        ("raw with an optimizer", "raw.pt", "optimizer", True),
    ):
        errors = []
        for body in (ours, upstream):
            model, optimizer = _make(fabric, seed=2, tensor_lr=False)
            state = {"model": model, "optimizer": optimizer} if with_optimizer else {"model": model}
            errors.append(_raised(fabric, body, f"{directory}/{file}", state))
        ours_error, upstream_error = errors
        assert type(upstream_error) is KeyError, f"{case}: upstream raised {upstream_error!r}"
        assert isinstance(ours_error, CheckpointKeyError), f"{case}: {ours_error!r}"
        assert isinstance(ours_error, KeyError)
        assert isinstance(ours_error, CheckpointLoadError)
        # the message is the package's, not a key's repr, and names the key
        assert str(ours_error).startswith("Loading '"), str(ours_error)
        assert repr(key) in str(ours_error), str(ours_error)
        done.append(case)

    # another number of parameter groups: the core's `ValueError`, and the package's
    errors = []
    for body in (ours, _CORE[strategy_class].load_checkpoint):
        model, _ = _make(fabric, seed=2, tensor_lr=False)
        params = list(model.parameters())
        groups = [{"params": params[:2]}, {"params": params[2:]}]
        optimizer = fabric.setup_optimizers(torch.optim.Adam(groups, lr=0.01))
        errors.append(_raised(fabric, body, f"{directory}/full.ckpt", {"model": model, "optimizer": optimizer}))
    ours_error, core_error = errors
    assert type(core_error) is ValueError, repr(core_error)
    assert isinstance(ours_error, CheckpointValueError), repr(ours_error)
    assert "1 parameter group(s), the optimizer has 2" in str(ours_error)
    done.append("parameter groups")
    return done


@pytest.mark.parametrize("fsdp", [1, 2], ids=["fsdp1", "fsdp2"])
def test_errors_keep_upstreams_types(tmp_path, fsdp):
    results = run_distributed(_run, fsdp, str(tmp_path), devices=2)
    cases = ["missing optimizer", "another key", "raw with an optimizer", "parameter groups"]
    assert results == [cases] * 2
