"""FSDP2 (``fully_shard``) through ``lightning_fsdp.ModelParallelStrategy``: every format loads shard-locally.

Each rank copies its own slice of every tensor into its ``DTensor`` shards; the gathered model (and Adam's state)
must equal the checkpoint bit for bit, training must resume with the losses of the uninterrupted run, and the loader
must not fall back to upstream's broadcasting path. The model has a parameter of 5 rows (3 and 2 over two ranks) and
one of a single row (an empty shard on rank 1). FSDP x tensor parallel on a 2 x 2 mesh shards the tensor-parallel rows
strided (``_StridedShard``): each rank holds a piece of every tensor-parallel shard, uneven for the 5 rows of
``narrow`` (2 + 1 and 1 + 1 rows). Sharded directories (``save_distributed_checkpoint=True``), with FSDP and with FSDP x
tensor parallel, load through the validated sharded reader, bit for bit, with ``fabric.load`` and ``fabric.load_raw``.
"""

from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import CheckpointLoadError, ModelParallelStrategy
from lightning_fsdp.loading import loader
from tests.tests_fabric.helpers.checkpoints import FORMATS, write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, make_batch
from tests.tests_fabric.helpers.state import assert_same_state, gather_full_state


class _Model(nn.Module):
    def __init__(self, tie_weights: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(37, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(2))
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 16).unsqueeze(0))  # one row: rank 1's shard is empty
        self.narrow = nn.Linear(16, 5)  # five rows: three and two
        self.widen = nn.Linear(5, 16)
        self.head = nn.Linear(16, 37, bias=False)
        if tie_weights:
            self.head.weight = self.embedding.weight
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) * self.scale * self.gate
        for block in self.blocks:
            x = block(x)
        x = x + self.widen(torch.relu(self.narrow(x)))
        return self.head(x)


def _parallelize(layout: str):
    def parallelize(model: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if layout in ("tensor_parallel", "fsdp_tensor_parallel"):  # fc_in's rows, fc_out's columns: a run per row
            plan = {"fc_in": ColwiseParallel(), "fc_out": RowwiseParallel()}
            for block in model.blocks:
                parallelize_module(block, device_mesh["tensor_parallel"], plan)
            # Uneven rows: 3 and 2, then FSDP's pieces of those
            parallelize_module(
                model, device_mesh["tensor_parallel"], {"narrow": ColwiseParallel(output_layouts=Replicate())}
            )
            if layout == "tensor_parallel":
                return model
        # HSDP on the 2-D mesh: replicated across its first dimension, sharded across the second
        mesh = device_mesh if layout == "hsdp" else device_mesh["data_parallel"]
        options = {"reshard_after_forward": layout != "no_reshard_after_forward"}
        if layout == "cpu_offload":  # on a CPU mesh the shards stay where they are; the policy's code path still runs
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        return model

    return parallelize


def _fabric(devices: int, layout: str = "fsdp") -> Fabric:
    sharded = layout.startswith("sharded")  # "sharded", "sharded_<layout>": saved as a distributed checkpoint
    layout = layout.removeprefix("sharded_")
    data_parallel_size = {"tensor_parallel": 1, "hsdp": devices // 2, "fsdp_tensor_parallel": devices // 2}.get(
        layout, devices
    )
    strategy = ModelParallelStrategy(
        _parallelize(layout),
        data_parallel_size=data_parallel_size,
        tensor_parallel_size=devices // data_parallel_size,
        save_distributed_checkpoint=sharded,
    )
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    return fabric


def _make(fabric: Fabric, seed: int, tie_weights: bool = False):
    fabric.seed_everything(seed)
    model = fabric.setup_module(_Model(tie_weights))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    return model, optimizer


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    inputs, targets = make_batch(step)
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train(fabric: Fabric, model, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = _loss(model, step)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _full_checkpoints(checkpoint_dir: str, configs: list[str], devices: int) -> list[str]:
    done = []
    for name in configs:
        reshard = name != "no_reshard_after_forward"
        tie = name == "tied_weights"
        fabric = _fabric(devices, layout=name)
        model, optimizer = _make(fabric, seed=1, tie_weights=tie)
        _train(fabric, model, optimizer, range(2))
        saved = gather_full_state(model, optimizer)
        path = f"{checkpoint_dir}/{name}.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
        expected_losses = _train(fabric, model, optimizer, range(2, 4))

        fresh_model, fresh_optimizer = _make(fabric, seed=2, tie_weights=tie)
        if not reshard:  # the units hold their gathered parameters while the checkpoint is loaded
            with torch.no_grad():
                _loss(fresh_model, 0)
        state = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
        assert fabric.load(path, state) == {}
        assert state["step"] == 2
        if name.endswith("fsdp_tensor_parallel"):
            _assert_strided(fresh_model)
        assert not loader._warned_fallbacks, f"{name}: fell back: {loader._warned_fallbacks}"
        try:
            assert_same_state(gather_full_state(fresh_model, fresh_optimizer), saved)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
        resumed_losses = _train(fabric, fresh_model, fresh_optimizer, range(2, 4))
        assert resumed_losses == expected_losses, f"{name}: {resumed_losses} != {expected_losses}"
        if name.startswith("sharded"):  # `fabric.load_raw` reads the model's entry of the directory
            raw_model, _ = _make(fabric, seed=3)
            fabric.load_raw(path, raw_model)
            assert_same_state(gather_full_state(raw_model)["model"], saved["model"])
        done.append(name)
    return done


def _assert_strided(model: nn.Module) -> None:
    """The layout under test is really there: FSDP shards the tensor-parallel rows of ``narrow`` strided."""
    from torch.distributed.tensor.placement_types import _StridedShard

    weight = model.narrow.weight
    assert type(weight.placements[0]) is _StridedShard, weight.placements
    # 5 rows: 3 and 2 over tensor parallel, then 2 + 1 and 1 + 1 over FSDP
    rows = 2 if tuple(weight.device_mesh.get_coordinate()) == (0, 0) else 1
    assert weight.to_local().shape == (rows, 16)


def test_full_checkpoint_with_adam_loads_bit_exact_and_resumes(tmp_path):
    configs = ["fsdp", "no_reshard_after_forward", "tied_weights", "tensor_parallel", "cpu_offload"]
    results = run_distributed(_full_checkpoints, str(tmp_path), configs, 2, devices=2, timeout=300)
    assert results == [configs] * 2


def test_sharded_checkpoint_with_adam_loads_bit_exact_and_resumes(tmp_path):
    """A distributed checkpoint directory goes through the validated sharded reader, with `load` and `load_raw`."""
    results = run_distributed(_full_checkpoints, str(tmp_path), ["sharded"], 2, devices=2, timeout=120)
    assert results == [["sharded"]] * 2


def test_2d_meshes_full_and_sharded_checkpoints_load_bit_exact_and_resume(tmp_path):
    configs = ["hsdp", "fsdp_tensor_parallel", "sharded_fsdp_tensor_parallel"]
    results = run_distributed(_full_checkpoints, str(tmp_path), configs, 4, devices=4, timeout=300)
    assert results == [configs] * 4


def _raw_files(paths: dict[str, str], reference_path: str, devices: int, layout: str) -> list[str]:
    reference = torch.load(reference_path, weights_only=True)
    fabric = _fabric(devices, layout)
    done = []
    for fmt, path in paths.items():
        model, _ = _make(fabric, seed=5)
        if layout == "fsdp_tensor_parallel":
            _assert_strided(model)
        fabric.load_raw(path, model)
        assert not loader._warned_fallbacks, f"{fmt}: fell back: {loader._warned_fallbacks}"
        try:
            assert_same_state(gather_full_state(model)["model"], reference["state"])
        except AssertionError as error:
            raise AssertionError(f"{fmt}: {error}") from None
        assert torch.equal(_loss(model, 7).detach(), reference["loss"]), fmt
        done.append(fmt)
    return done


@pytest.mark.parametrize(("devices", "layout"), [(2, "fsdp"), (4, "fsdp_tensor_parallel")])
def test_raw_files_load_bit_exact(tmp_path, devices, layout):
    torch.manual_seed(3)
    model = _Model()
    state_dict = model.state_dict()
    with torch.no_grad():
        reference = {"state": state_dict, "loss": _loss(model, 7)}
    torch.save(reference, tmp_path / "reference.pt")
    paths = {fmt: str(write_checkpoint(state_dict, tmp_path / fmt, fmt)) for fmt in FORMATS}
    results = run_distributed(
        _raw_files, paths, str(tmp_path / "reference.pt"), devices, layout, devices=devices, timeout=300
    )
    assert results == [list(paths)] * devices


def _shape_mismatch(path: str) -> str:
    fabric = _fabric(2)
    model, _ = _make(fabric, seed=5)
    before = {name: param.to_local().clone() for name, param in model.named_parameters()}
    with pytest.raises(CheckpointLoadError) as error:
        fabric.load_raw(path, model)
    for name, param in model.named_parameters():
        assert torch.equal(param.to_local(), before[name]), f"{name} was written"
    return str(error.value)


def test_shape_mismatch_is_the_same_error_on_every_rank_and_writes_nothing(tmp_path):
    torch.manual_seed(3)
    state_dict = _Model().state_dict()
    state_dict["narrow.weight"] = torch.zeros(6, 16)
    path = Path(tmp_path / "bad.pth")
    torch.save(state_dict, path)
    messages = run_distributed(_shape_mismatch, str(path), devices=2, timeout=120)
    assert messages[0] == messages[1]
    assert "'narrow.weight': checkpoint (6, 16), model (5, 16)" in messages[0]
