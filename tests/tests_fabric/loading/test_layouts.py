"""The shard-layout seam in one process: planning, a faked sharded layout, the copy and the optimizer slicing.

The fake layout is FSDP1's: two parameters ``a`` (3 elements) and ``b`` (2x4) flattened into one flat parameter of 11
elements, padded to 12 and split over two ranks, so rank 0 holds ``a`` and the first 3 elements of ``b`` and rank 1
the last 5 elements of ``b`` and one element of padding.
"""

import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from lightning_fsdp.layouts.optimizer import local_optimizer_state
from lightning_fsdp.layouts.targets import ModuleTargets, OptimizerParam, Run, Target, TargetSpec
from lightning_fsdp.loading.errors import CheckpointLoadError
from lightning_fsdp.loading.shard_local import copy_into_module
from lightning_fsdp.loading.sources import DictSource, TensorRef, TensorSpec
from lightning_fsdp.loading.validation import plan_load

_SHARD = 6
# rank -> {name: runs (start in the flattened tensor, count, offset in the rank's shard)}
_RUNS = {0: {"a": [Run(0, 3, 0)], "b": [Run(0, 3, 3)]}, 1: {"a": [], "b": [Run(3, 5, 0)]}}


def _whole_target(name: str, tensor: torch.Tensor, param, collected: ModuleTargets) -> Target:
    """A tensor that every rank holds whole; a parameter among them gets its optimizer state whole too."""
    target = Target([name], tuple(tensor.shape), tensor.dtype, tensor=tensor)
    if param is not None:
        numel, shape = param.numel(), param.shape
        collected.optimizer_params[id(param)] = OptimizerParam(
            numel, [(target, [Run(0, numel, 0)])], lambda flat: flat.view(shape)
        )
    return target


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
    collected.targets.append(_whole_target("scale", scale, None, collected))
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
    collected.targets.append(_whole_target("w", weight, weight, collected))
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


def _placements(codes: tuple[str, ...]) -> list:
    """``R`` is ``Replicate()``, ``S1`` is ``Shard(1)``, ``T0/2`` is ``_StridedShard(0, split_factor=2)``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = []
    for code in codes:
        if code == "R":
            placements.append(Replicate())
        elif code.startswith("T"):
            dim, split_factor = code[1:].split("/")
            placements.append(_StridedShard(int(dim), split_factor=int(split_factor)))
        else:
            placements.append(Shard(int(code[1:])))
    return placements


@contextmanager
def _fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """Make this process rank ``rank`` of a fake process group: ``distribute_tensor`` then splits without talking."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _torch_local(full: torch.Tensor, mesh_shape, placements) -> dict[tuple[int, ...], torch.Tensor]:
    """The local tensor of every mesh coordinate, as torch's own ``distribute_tensor`` makes it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    local = {}
    for rank in range(math.prod(mesh_shape)):
        with _fake_rank(rank, math.prod(mesh_shape)):
            mesh = init_device_mesh("cpu", tuple(mesh_shape))
            dtensor = distribute_tensor(full, mesh, placements, src_data_rank=None)
            local[tuple(mesh.get_coordinate())] = dtensor.to_local().clone()
    return local


def _from_runs(full: torch.Tensor, local_shape, runs) -> torch.Tensor:
    flat = torch.full((math.prod(local_shape),), -1, dtype=full.dtype)
    for run in runs:
        flat[run.offset : run.offset + run.count] = full.reshape(-1)[run.start : run.start + run.count]
    return flat.view(local_shape)


_LAYOUTS = [
    ((5, 3), (2,), ("S0",)),  # uneven: 3 and 2 rows
    ((1, 4), (2,), ("S0",)),  # an empty last shard
    ((5,), (4,), ("S0",)),  # 2, 2, 1 and an empty shard
    ((7, 3), (2, 2), ("R", "S0")),  # HSDP: replicated across the first mesh dimension
    ((6, 5), (2, 2), ("S0", "S1")),  # FSDP x tensor parallel (row-wise): one run per row
    ((4, 6, 3), (3,), ("S1",)),  # a middle dimension: one run per outer index
    ((6, 4), (2, 2), ("S0", "S0")),  # both mesh dimensions shard the same tensor dimension
    ((), (2,), ("R",)),  # a scalar
    # FSDP x tensor parallel (column-wise): fully_shard over a Shard(0) parameter
    ((8, 3), (2, 2), ("T0/2", "S0")),  # even: two row ranges per rank
    ((5, 3), (2, 2), ("T0/2", "S0")),  # uneven: 2 + 1 and 1 + 1 rows
    ((7, 2), (2, 2), ("T0/2", "S0")),  # uneven: 2 + 2 and 2 + 1 rows
    ((3, 2), (2, 2), ("T0/2", "S0")),  # a rank with an empty piece
    ((1, 4), (2, 2), ("T0/2", "S0")),  # three ranks of four hold nothing
    ((7,), (2, 2), ("T0/2", "S0")),  # a bias
    ((5, 6), (2, 2), ("T0/2", "S1")),  # Shard(1) after a strided Shard(0): a run per row of a column range
    ((5, 4, 3), (2, 2), ("T1/2", "S1")),  # a middle dimension of a 3-D tensor
    ((7, 4), (2, 2), ("T-2/2", "S-2")),  # negative dimensions
    ((11, 2), (3,), ("T0/2",)),  # a strided shard alone, split factor and mesh size differ
    ((9, 3), (2, 2, 2), ("R", "T0/2", "S0")),  # HSDP x tensor parallel on a 3-D mesh
    ((13, 2), (2, 2, 2), ("T0/4", "T0/2", "S0")),  # strided twice: FSDP over two tensor-parallel dimensions
]


@pytest.mark.parametrize(("shape", "mesh_shape", "codes"), _LAYOUTS)
def test_dtensor_indices_and_runs_match_distribute_tensor(shape, mesh_shape, codes):
    from lightning_fsdp.layouts.fsdp2 import index_runs, local_indices

    placements = _placements(codes)
    full = torch.arange(math.prod(shape)).reshape(shape)
    for coordinate, expected in _torch_local(full, mesh_shape, placements).items():
        indices = local_indices(shape, mesh_shape, coordinate, placements)
        local_shape = tuple(sum(len(block) for block in ranges) for ranges in indices)
        assert local_shape == tuple(expected.shape), coordinate
        for ranges in indices:  # maximal ascending ranges
            assert all(len(block) > 0 and block.step == 1 for block in ranges)
            assert all(left.stop < right.start for left, right in itertools.pairwise(ranges))
        runs = index_runs(shape, indices)
        assert torch.equal(_from_runs(full, local_shape, runs), expected), coordinate
        offsets = itertools.accumulate((run.count for run in runs), initial=0)
        assert [run.offset for run in runs] == list(offsets)[:-1], coordinate  # consecutive in the local tensor
        if all(getattr(placement, "dim", 0) % max(len(shape), 1) == 0 for placement in placements):
            assert len(runs) == (len(indices[0]) if shape else 1), coordinate  # rows held whole: a run per range


def _chunk_or_empty(tensor: torch.Tensor, pieces: int, index: int) -> torch.Tensor:
    chunks = torch.chunk(tensor, pieces) if len(tensor) else ()
    return chunks[index] if index < len(chunks) else tensor[:0]


@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2), (2, 3), (4, 2), (2, 2, 2)], ids=str)
def test_strided_indices_are_what_fully_shard_holds_or_refused(mesh_shape):
    """``fully_shard`` chunks each rank's tensor-parallel rows over the data-parallel ranks (the ``[dp, tp]`` or, with
    HSDP, ``[replicate, dp, tp]`` mesh): the indices must be those, or the layout must be refused on every rank."""
    from lightning_fsdp.layouts.fsdp2 import ambiguous_strided_dim, local_indices

    *replicate, dp, tp = mesh_shape
    placements = tuple(_placements(("R",) * len(replicate) + (f"T0/{tp}", "S0")))
    refused = 0
    for rows in range(40):
        agree = True
        for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
            tensor_parallel_rows = _chunk_or_empty(torch.arange(rows), tp, coordinate[-1])
            expected = _chunk_or_empty(tensor_parallel_rows, dp, coordinate[-2]).tolist()
            (indices,) = local_indices((rows,), mesh_shape, coordinate, placements)
            agree = agree and [i for block in indices for i in block] == expected
        ambiguous = ambiguous_strided_dim((rows,), mesh_shape, placements)
        assert ambiguous == (None if agree else 0), rows
        refused += not agree
        if rows % (dp * tp) == 0:
            assert agree, rows  # even sizes always load shard-locally
    assert (refused > 0) == (dp > 2), refused  # over two data-parallel ranks the readings always agree


def test_strided_layout_that_torch_reads_two_ways_is_refused():
    from lightning_fsdp.layouts.fsdp2 import ambiguous_strided_dim, local_indices

    placements = tuple(_placements(("T0/2", "S0")))
    # 7 rows over a 3 x 2 mesh: fully_shard gives rank (2, 0) nothing and (2, 1) row 6, the placements the reverse
    assert local_indices((7, 4), (3, 2), (2, 0), placements) == ([range(6, 7)], [range(4)])
    assert local_indices((7, 4), (3, 2), (2, 1), placements) == ([], [range(4)])
    assert ambiguous_strided_dim((7, 4), (3, 2), placements) == 0
    assert ambiguous_strided_dim((4, 7), (3, 2), tuple(_placements(("T1/2", "S1")))) == 1
    assert ambiguous_strided_dim((6, 4), (3, 2), placements) is None
    assert ambiguous_strided_dim((7, 4), (3, 2), tuple(_placements(("S0", "S0")))) is None  # no strided shard


def test_dtensor_indices_runs_of_a_strided_weight():
    from lightning_fsdp.layouts.fsdp2 import index_runs, local_indices

    placements = _placements(("T0/2", "S0"))
    # 7 rows over tensor parallel (4 and 3) then FSDP: [0, 1], [2, 3] | [4, 5], [6]
    assert local_indices((7, 3), (2, 2), (1, 1), placements) == ([range(6, 7)], [range(3)])
    assert index_runs((7, 3), ([range(6, 7)], [range(3)])) == [Run(18, 3, 0)]
    # one strided shard alone: 7 rows in two parts (4 and 3), rank 0 of 2 takes [0, 1] and [4, 5]
    indices = local_indices((7, 3), (2,), (0,), _placements(("T0/2",)))
    assert indices == ([range(0, 2), range(4, 6)], [range(3)])
    assert index_runs((7, 3), indices) == [Run(0, 6, 0), Run(12, 6, 6)]
    # and Shard(1) of that: a run per row and range of columns
    indices = local_indices((7, 4), (2, 2), (0, 1), _placements(("T0/2", "S1")))
    assert indices == ([range(0, 2), range(4, 6)], [range(2, 4)])
    assert index_runs((7, 4), indices) == [Run(4 * row + 2, 2, 2 * n) for n, row in enumerate((0, 1, 4, 5))]
    assert index_runs((2, 0), ([range(2)], [])) == []


def test_dtensor_indices_refuse_unknown_placements():
    from torch.distributed.tensor import Partial, Shard

    from lightning_fsdp.layouts.fsdp2 import local_indices

    assert local_indices((4, 4), (2,), (0,), [Partial()]) is None
    assert local_indices((4, 4), (2, 2), (0, 0), [Shard(0), Partial()]) is None
    assert local_indices((4,), (2,), (0,), [Shard(1)]) is None  # no such dimension


def _fully_shard_like_parameter(full: torch.Tensor, mesh_shape: tuple[int, int]) -> tuple[nn.Module, torch.Tensor]:
    """A module with an unset weight shaped like this rank's part of ``full`` that ``fully_shard`` over
    ``ColwiseParallel`` holds, and that part."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dp, tp = mesh_shape
    # Names per rank: DTensor caches meshes by their layout and names, which every fake rank shares otherwise.
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=(f"dp{rank}", f"tp{rank}"))
    dp_rank, tp_rank = mesh.get_coordinate()
    expected = _chunk_or_empty(_chunk_or_empty(full, tp, tp_rank), dp, dp_rank).clone()
    local = torch.full_like(expected, -1)
    placements = _placements((f"T0/{tp}", "S0"))
    module = nn.Module()
    module.weight = nn.Parameter(
        DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    )
    return module, expected


@pytest.mark.parametrize(("rows", "mesh_shape"), [(7, (2, 2)), (5, (2, 2)), (7, (3, 2))])
def test_collect_dtensor_targets_copies_strided_rows_or_refuses_on_every_rank(rows, mesh_shape):
    from lightning_fsdp.layouts.fsdp2 import collect_dtensor_targets
    from lightning_fsdp.layouts.targets import ShardLocalUnsupported

    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    refusals = []
    for rank in range(math.prod(mesh_shape)):
        with _fake_rank(rank, math.prod(mesh_shape)):
            module, expected = _fully_shard_like_parameter(full, mesh_shape)
            try:
                collected = collect_dtensor_targets(module)
            except ShardLocalUnsupported as reason:
                refusals.append(str(reason))
                continue
            source = DictSource({"weight": full})
            copy_into_module(collected, plan_load(collected.specs(), source.specs(), strict=True), source)
            assert torch.equal(module.weight.to_local(), expected), rank
    if mesh_shape == (3, 2):  # torch reads these placements in two ways: every rank falls back, none guesses
        assert len(refusals) == 6
        assert "which torch reads in two ways for 7 indices of dimension 0 over the mesh (3, 2)" in refusals[0]
    else:
        assert not refusals
