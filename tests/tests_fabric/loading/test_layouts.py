"""The shard-layout seam in one process: planning, a faked sharded layout, the copy and the optimizer slicing.

The fake layout is FSDP1's: two parameters ``a`` (3 elements) and ``b`` (2x4) flattened into one flat parameter of 11
elements, padded to 12 and split over two ranks, so rank 0 holds ``a`` and the first 3 elements of ``b`` and rank 1
the last 5 elements of ``b`` and one element of padding.
"""

import itertools
import math

import pytest
import torch
from torch import nn

from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.optimizer import local_optimizer_state
from lightning_fsdp.loading.shard_local import (
    ModuleTargets,
    OptimizerParam,
    Run,
    Target,
    copy_into_module,
    whole_target,
)
from lightning_fsdp.loading.sources import DictSource, TensorRef, TensorSpec
from lightning_fsdp.loading.validation import TargetSpec, plan_load

_SHARD = 6
# rank -> {name: runs (start in the flattened tensor, count, offset in the rank's shard)}
_RUNS = {0: {"a": [Run(0, 3, 0)], "b": [Run(0, 3, 3)]}, 1: {"a": [], "b": [Run(3, 5, 0)]}}


def _checkpoint() -> dict[str, torch.Tensor]:
    return {
        "a": torch.arange(3, dtype=torch.float32),
        "b": torch.arange(8, dtype=torch.float32).reshape(2, 4) + 10,
        "scale": torch.tensor([0.5, 1.5]),
    }


def _fake_layout(rank: int, tied_alias: str | None = None) -> tuple[ModuleTargets, nn.Parameter, torch.Tensor]:
    """This rank's targets: the flat parameter ``a`` + ``b`` and a whole buffer ``scale``."""
    flat_param = nn.Parameter(torch.full((_SHARD,), -1.0))
    scale = torch.zeros(2)
    collected = ModuleTargets()
    parts = []
    for name, shape in (("a", (3,)), ("b", (2, 4))):
        names = [name] + ([tied_alias] if tied_alias and name == "b" else [])
        target = Target(names, shape, torch.float32, local=flat_param.data, runs=_RUNS[rank][name])
        collected.targets.append(target)
        parts.append((target, target.runs))
    collected.targets.append(whole_target("scale", scale, None, collected))
    collected.optimizer_params[id(flat_param)] = OptimizerParam(_SHARD, parts, lambda flat: flat)
    return collected, flat_param, scale


def _reassemble(shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    flat = torch.cat(shards)[:11]
    return {"a": flat[:3], "b": flat[3:].reshape(2, 4)}


def test_plan_maps_tied_aliases_and_casts():
    specs = {"embedding.weight": TensorSpec((4, 2), torch.bfloat16), "bias": TensorSpec((2,), torch.float32)}
    targets = [
        TargetSpec(("head.weight", "embedding.weight"), (4, 2), torch.float32),
        TargetSpec(("bias",), (2,), torch.float32),
    ]
    plan = plan_load(targets, specs, strict=True)
    assert plan.sources == {"head.weight": "embedding.weight", "bias": "bias"}
    assert plan.casts == {"head.weight": (torch.bfloat16, torch.float32)}
    assert not plan.missing
    assert not plan.unexpected


def test_plan_reports_every_problem_at_once():
    specs = {"a": TensorSpec((3,), torch.float32), "extra": TensorSpec((1,), torch.float32)}
    targets = [
        TargetSpec(("a",), (4,), torch.float32),
        TargetSpec(("b",), (2,), torch.float32),
    ]
    with pytest.raises(CheckpointLoadError, match="nothing was loaded") as error:
        plan_load(targets, specs, strict=True)
    message = str(error.value)
    assert "1 missing key(s)" in message
    assert "'b'" in message
    assert "1 unexpected key(s)" in message
    assert "'extra'" in message
    assert "'a': checkpoint (3,), model (4,)" in message
    # A shape mismatch is an error without strictness too; missing and unexpected keys are not.
    with pytest.raises(CheckpointLoadError, match="shape mismatch"):
        plan_load(targets, specs, strict=False)
    plan = plan_load([*targets[1:], TargetSpec(("a",), (3,), torch.float32)], specs, strict=False)
    assert plan.missing == ["b"]
    assert plan.unexpected == ["extra"]


def test_plan_refuses_integer_to_float_casts():
    with pytest.raises(CheckpointLoadError, match="cannot be cast"):
        plan_load([TargetSpec(("a",), (3,), torch.float32)], {"a": TensorSpec((3,), torch.int64)}, strict=True)


def test_fake_layout_totals_and_specs():
    collected, _, _ = _fake_layout(rank=1, tied_alias="head.weight")
    assert [spec.names for spec in collected.specs()] == [("a",), ("b", "head.weight"), ("scale",)]
    assert [target.local_numel for target in collected.targets] == [0, 5, 2]


def test_copy_writes_each_ranks_runs_only():
    checkpoint = _checkpoint()
    shards = []
    for rank in (0, 1):
        collected, flat_param, scale = _fake_layout(rank)
        plan = plan_load(collected.specs(), DictSource(checkpoint).specs(), strict=True)
        written = []
        copy_into_module(collected, plan, DictSource(checkpoint), on_tensor=written.append)
        assert sum(written) == 4 * (6 if rank == 0 else 5) + 4 * 2
        assert torch.equal(scale, checkpoint["scale"])
        shards.append(flat_param.data)
    assert shards[1][-1] == -1.0  # the padding is never written
    full = _reassemble(shards)
    assert torch.equal(full["a"], checkpoint["a"])
    assert torch.equal(full["b"], checkpoint["b"])


def test_copy_reads_through_tied_alias_and_casts():
    checkpoint = {name: value.to(torch.bfloat16) for name, value in _checkpoint().items()}
    checkpoint["head.weight"] = checkpoint.pop("b")
    collected, flat_param, _ = _fake_layout(rank=0, tied_alias="head.weight")
    plan = plan_load(collected.specs(), DictSource(checkpoint).specs(), strict=True)
    copy_into_module(collected, plan, DictSource(checkpoint))
    assert flat_param.dtype == torch.float32
    assert torch.equal(flat_param.data, torch.tensor([0.0, 1.0, 2.0, 10.0, 11.0, 12.0]))


def test_copy_skips_tensors_missing_with_strict_false():
    checkpoint = {"b": _checkpoint()["b"]}
    collected, flat_param, scale = _fake_layout(rank=0)
    plan = plan_load(collected.specs(), DictSource(checkpoint).specs(), strict=False)
    copy_into_module(collected, plan, DictSource(checkpoint))
    assert torch.equal(flat_param.data, torch.tensor([-1.0, -1.0, -1.0, 10.0, 11.0, 12.0]))
    assert torch.equal(scale, torch.zeros(2))


def _full_optimizer_state(lazy: bool) -> dict:
    tensors = {
        "a.exp_avg": torch.arange(3, dtype=torch.float32) + 100,
        "b.exp_avg": torch.arange(8, dtype=torch.float32).reshape(2, 4) + 200,
    }
    source = DictSource(tensors)

    def value(name: str):
        return TensorRef(source, name) if lazy else tensors[name]

    return {
        "state": {
            "a": {"step": torch.tensor(3.0), "exp_avg": value("a.exp_avg")},
            "b": {"step": torch.tensor(3.0), "exp_avg": value("b.exp_avg")},
        },
        "param_groups": [{"lr": 0.5, "params": ["a", "b"]}],
    }


@pytest.mark.parametrize("lazy", [False, True], ids=["tensors", "tensor_refs"])
def test_optimizer_state_is_sliced_like_the_parameter(lazy):
    full_state = _full_optimizer_state(lazy)
    shards = []
    for rank in (0, 1):
        collected, flat_param, _ = _fake_layout(rank)
        optimizer = torch.optim.SGD([flat_param], lr=0.1)
        local = local_optimizer_state(optimizer, collected, full_state)
        assert local["param_groups"] == [{"lr": 0.5, "params": [0]}]
        assert torch.equal(local["state"][0]["step"], torch.tensor(3.0))
        shards.append(local["state"][0]["exp_avg"])
        optimizer.load_state_dict(local)
        assert optimizer.param_groups[0]["lr"] == 0.5
    assert shards[1][-1] == 0.0  # padding
    full = _reassemble(shards)
    assert torch.equal(full["a"], torch.arange(3, dtype=torch.float32) + 100)
    assert torch.equal(full["b"], torch.arange(8, dtype=torch.float32).reshape(2, 4) + 200)


def test_optimizer_state_of_whole_parameter_keeps_its_shape():
    collected = ModuleTargets()
    weight = nn.Parameter(torch.zeros(2, 3))
    collected.targets.append(whole_target("w", weight, weight, collected))
    state = {"state": {"w": {"exp_avg": torch.ones(2, 3)}}, "param_groups": [{"lr": 1.0, "params": ["w"]}]}
    local = local_optimizer_state(torch.optim.SGD([weight], lr=0.1), collected, state)
    assert torch.equal(local["state"][0]["exp_avg"], torch.ones(2, 3))


def test_optimizer_state_of_wrong_shape_is_refused_before_anything_is_written():
    full_state = _full_optimizer_state(lazy=True)
    full_state["state"]["b"]["exp_avg"] = torch.zeros(4, 2)
    collected, flat_param, _ = _fake_layout(rank=0)
    with pytest.raises(CheckpointLoadError, match=r"'exp_avg' of 'b' has shape \(4, 2\), but the parameter"):
        local_optimizer_state(torch.optim.SGD([flat_param], lr=0.1), collected, full_state)


def test_optimizer_state_incomplete_or_inconsistent_unit():
    collected, flat_param, _ = _fake_layout(rank=0)
    optimizer = torch.optim.SGD([flat_param], lr=0.1)
    full_state = _full_optimizer_state(lazy=False)
    del full_state["state"]["a"]
    with pytest.raises(CheckpointLoadError, match="no entry for 'a'"):
        local_optimizer_state(optimizer, collected, full_state)
    full_state = _full_optimizer_state(lazy=False)
    del full_state["state"]["a"]["step"]
    with pytest.raises(CheckpointLoadError, match="inconsistent"):
        local_optimizer_state(optimizer, collected, full_state)
    full_state = _full_optimizer_state(lazy=False)
    full_state["param_groups"].append({"lr": 1.0, "params": []})
    with pytest.raises(CheckpointLoadError, match="2 parameter group"):
        local_optimizer_state(optimizer, collected, full_state)


def _chunked(full: torch.Tensor, mesh_shape, coordinate, placements) -> torch.Tensor:
    """What a ``DTensor`` rank holds, computed independently with ``torch.chunk``."""
    from torch.distributed.tensor import Shard

    local = full
    for size, index, placement in zip(mesh_shape, coordinate, placements, strict=True):
        if isinstance(placement, Shard):
            pieces = torch.chunk(local, size, dim=placement.dim)
            local = pieces[index] if index < len(pieces) else local.narrow(placement.dim, 0, 0)
    return local


def _from_runs(full: torch.Tensor, box_shape, runs) -> torch.Tensor:
    flat = torch.full((math.prod(box_shape),), -1, dtype=full.dtype)
    for run in runs:
        flat[run.offset : run.offset + run.count] = full.reshape(-1)[run.start : run.start + run.count]
    return flat.view(box_shape)


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "placements"),
    [
        ((5, 3), (2,), ("S0",)),  # uneven: 3 and 2 rows
        ((1, 4), (2,), ("S0",)),  # an empty last shard
        ((5,), (4,), ("S0",)),  # 2, 2, 1 and an empty shard
        ((7, 3), (2, 2), ("R", "S0")),  # HSDP: replicated across the first mesh dimension
        ((6, 5), (2, 2), ("S0", "S1")),  # FSDP x tensor parallel (row-wise): one run per row
        ((4, 6, 3), (3,), ("S1",)),  # a middle dimension: one run per outer index
        ((6, 4), (2, 2), ("S0", "S0")),  # both mesh dimensions shard the same tensor dimension
        ((), (2,), ("R",)),  # a scalar
    ],
)
def test_dtensor_box_and_runs_match_torch_chunk(shape, mesh_shape, placements):
    from torch.distributed.tensor import Replicate, Shard

    from lightning_fsdp.loading.fsdp2_layout import box_runs, local_box

    placements = [Replicate() if p == "R" else Shard(int(p[1])) for p in placements]
    full = torch.arange(math.prod(shape)).reshape(shape)
    for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
        expected = _chunked(full, mesh_shape, coordinate, placements)
        box_shape, box_offset = local_box(shape, mesh_shape, coordinate, placements)
        assert box_shape == tuple(expected.shape), coordinate
        runs = box_runs(shape, box_shape, box_offset)
        assert torch.equal(_from_runs(full, box_shape, runs), expected), coordinate
        whole_rows = all(p == Replicate() or p.dim == 0 for p in placements)
        assert len(runs) <= (1 if whole_rows else math.prod(box_shape[:-1]))


def test_dtensor_box_refuses_unknown_placements():
    from torch.distributed.tensor import Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from lightning_fsdp.loading.fsdp2_layout import local_box

    assert local_box((4, 4), (2,), (0,), [Partial()]) is None
    assert local_box((4, 4), (2, 2), (0, 0), [_StridedShard(0, split_factor=2), Shard(0)]) is None
