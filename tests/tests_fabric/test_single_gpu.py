"""The CUDA paths on one GPU: a rank of world size 1 on ``cuda:0``, with FSDP1 and FSDP2.

Every other CUDA test of the suite needs two GPUs; these need one, so that a machine with a single GPU proves the
copy from host memory to the rank's device, placement, precision, CPU offload and a full round trip with Adam. FSDP1 is
``lightning_fsdp.FSDPStrategy``, FSDP2 ``lightning_fsdp.ModelParallelStrategy`` whose ``parallelize_fn`` applies
``fully_shard`` to each block and to the root. Each test runs one rank in a fresh process (``spawn``: CUDA cannot be
forked). On a machine without a GPU they are skipped.

What one rank cannot show, that a rank never touches another rank's GPU, is the standalone test at the end (two GPUs).
"""

import threading
from pathlib import Path
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import FSDPStrategy, ModelParallelStrategy
from lightning_fsdp.loading import loader
from lightning_fsdp.saving.background import BackgroundSaves
from tests.tests_fabric.helpers.checkpoints import FORMATS, retag_storages, write_checkpoint
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.models import Block, TinyTransformer, make_batch
from tests.tests_fabric.helpers.runif import RunIf
from tests.tests_fabric.helpers.state import assert_identical, assert_same_state, gather_full_state

_STRATEGIES = ["fsdp1", "fsdp2"]
# cuBLAS picks its algorithms deterministically only with a fixed workspace: the resumed run must repeat the losses.
_DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _run(fn, *args, devices: int = 1) -> list:
    return run_distributed(fn, *args, devices=devices, start_method="spawn", timeout=180, env=_DETERMINISTIC)


def _fabric(
    strategy: str,
    devices: int = 1,
    precision: str = "32-true",
    cpu_offload: bool = False,
    save_in_background: bool = False,
) -> Fabric:
    if strategy == "fsdp1":
        chosen = FSDPStrategy(
            auto_wrap_policy={Block},
            state_dict_type="full",
            cpu_offload=cpu_offload,
            save_in_background=save_in_background,
        )
    else:
        chosen = ModelParallelStrategy(
            _parallelize_with_offload if cpu_offload else _parallelize,
            data_parallel_size=devices,
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
            save_in_background=save_in_background,
        )
    fabric = Fabric(accelerator="cuda", devices=devices, strategy=chosen, precision=precision)
    fabric.launch()
    torch.use_deterministic_algorithms(True, warn_only=True)
    return fabric


def _parallelize(model: nn.Module, device_mesh, **options) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["data_parallel"], **options)
    fully_shard(model, mesh=device_mesh["data_parallel"], **options)
    return model


def _parallelize_with_offload(model: nn.Module, device_mesh) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return _parallelize(model, device_mesh, offload_policy=CPUOffloadPolicy())  # pinned host memory, the default


def _make(fabric: Fabric, seed: int, empty_init: bool = True) -> nn.Module:
    fabric.seed_everything(seed)
    with fabric.init_module(empty_init=empty_init):
        model = TinyTransformer()
    return fabric.setup_module(model)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _assert_on(model: nn.Module, device: torch.device, what: str = "parameters and buffers") -> None:
    tensors = dict(model.named_parameters())
    if what == "parameters and buffers":
        tensors.update(model.named_buffers())
    elsewhere = {name: str(_local(t).device) for name, t in tensors.items() if _local(t).device != device}
    assert not elsewhere, f"{what} not on {device}: {elsewhere}"


def _assert_no_other_gpu_touched(own: torch.device) -> None:
    """This process never allocated memory on a GPU other than its own (the allocator's peak since it started)."""
    indices = [index for index in range(torch.cuda.device_count()) if index != own.index]
    others = {index: torch.cuda.max_memory_allocated(index) for index in indices}
    assert not any(others.values()), f"bytes allocated on other GPUs: {others}"


def _source_state(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyTransformer()
    with torch.no_grad():
        model.scale.uniform_()  # a buffer whose value differs from what `reset_parameters` gives
    return {name: tensor.to(dtype) for name, tensor in model.state_dict().items()}


def _load_every_format(strategy: str, paths: dict[str, str], expected_path: str) -> list[str]:
    expected = torch.load(expected_path, weights_only=True)
    fabric = _fabric(strategy)
    done = []
    for fmt, path in paths.items():
        model = _make(fabric, seed=7)
        assert fabric.load(path, {"model": model}) == {}, fmt
        assert not loader._warned_fallbacks, f"{fmt}: fell back: {loader._warned_fallbacks}"
        _assert_on(model, fabric.device)
        try:
            assert_same_state(gather_full_state(model)["model"], expected)
        except AssertionError as error:
            raise AssertionError(f"{fmt}: {error}") from None
        done.append(fmt)
    _assert_no_other_gpu_touched(fabric.device)
    return done


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_every_format_loads_bit_exact_onto_the_gpu(tmp_path, strategy):
    """Each format, and a Fabric checkpoint ``{"model": ...}``, is copied from host memory into the CUDA shards."""
    state = _source_state()
    torch.save(state, tmp_path / "expected.pt")
    paths = {fmt: str(write_checkpoint(state, tmp_path / fmt, fmt)) for fmt in FORMATS}
    paths["fabric-checkpoint"] = str(tmp_path / "fabric.ckpt")
    torch.save({"model": state}, paths["fabric-checkpoint"])
    assert _run(_load_every_format, strategy, paths, str(tmp_path / "expected.pt")) == [list(paths)]


def _load_cuda_tagged(strategy: str, paths: dict[str, str], expected_path: str, devices: int) -> list[str]:
    expected = torch.load(expected_path, weights_only=True)
    fabric = _fabric(strategy, devices=devices)
    done = []
    for tag, path in paths.items():
        model = _make(fabric, seed=7)
        torch.cuda.synchronize(fabric.device)
        before = torch.cuda.memory_allocated(fabric.device)
        torch.cuda.reset_peak_memory_stats(fabric.device)
        fabric.load(path, {"model": model})
        # The load writes into the shards that exist: at most one tensor in flight on the GPU, never a second model.
        model_bytes = sum(_local(t).numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        assert torch.cuda.max_memory_allocated(fabric.device) - before <= model_bytes, tag
        _assert_on(model, fabric.device)
        assert_same_state(gather_full_state(model)["model"], expected)
        done.append(tag)
    _assert_no_other_gpu_touched(fabric.device)
    return done


def _write_cuda_tagged(tmp_path: Path) -> tuple[dict[str, str], str]:
    """The state dict as ``torch.save`` writes it from ``cuda:0`` and from ``cuda:3``.

    Only one GPU may exist, so the files are written from CPU tensors and their storages' location tags rewritten:
    the bytes are what ``torch.save`` writes for tensors on those devices. A plain ``torch.load`` of the ``cuda:3`` file
    fails on a machine with fewer than four GPUs.
    """
    state = _source_state()
    torch.save(state, tmp_path / "expected.pt")
    paths = {}
    for tag in ("cuda:0", "cuda:3"):
        path = tmp_path / f"saved-on-{tag.replace(':', '')}.pth"
        torch.save(state, path)
        retag_storages(path, "cpu", tag)
        paths[tag] = str(path)
    return paths, str(tmp_path / "expected.pt")


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_cuda_tagged_file_lands_on_own_gpu(tmp_path, strategy):
    """A file saved from ``cuda:0`` or ``cuda:3`` loads onto the rank's own GPU, not the device that it records."""
    paths, expected_path = _write_cuda_tagged(tmp_path)
    assert _run(_load_cuda_tagged, strategy, paths, expected_path, 1) == [list(paths)]


@RunIf(min_cuda_gpus=2, standalone=True)
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_cuda_tagged_file_never_touches_another_rank_gpu(tmp_path, strategy):
    """Needs two ranks to mean anything: rank 1 loads a file saved from ``cuda:0`` and allocates nothing there."""
    paths, expected_path = _write_cuda_tagged(tmp_path)
    assert _run(_load_cuda_tagged, strategy, paths, expected_path, 2, devices=2) == [list(paths)] * 2


def _init_on_own_device(strategy: str) -> list[bool]:
    fabric = _fabric(strategy)
    done = []
    for empty_init in (False, True):
        with fabric.init_module(empty_init=empty_init):
            model = TinyTransformer()
            created = torch.empty(2, device="cuda")  # "cuda" means the rank's own GPU inside `init_module`
        assert created.device == fabric.device
        if empty_init:
            _assert_on(model, torch.device("meta"))
        model = fabric.setup_module(model)
        _assert_on(model, fabric.device)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            assert torch.isfinite(_local(tensor)).all(), f"empty_init={empty_init}: {name} was not initialised"
        done.append(empty_init)
    _assert_no_other_gpu_touched(fabric.device)
    return done


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_init_module_materialises_on_own_gpu(strategy):
    """``init_module()`` and ``init_module(empty_init=True)``: after ``setup_module`` every tensor is on the GPU."""
    assert _run(_init_on_own_device, strategy) == [[False, True]]


def _load_with_precision(strategy: str, cases: list[tuple[str, str, str]]) -> list[str]:
    done = []
    for precision, path, expected_path in cases:
        fabric = _fabric(strategy, precision=precision)
        model = _make(fabric, seed=7)
        fabric.load(path, {"model": model})
        _assert_on(model, fabric.device)
        actual = gather_full_state(model)["model"]
        if precision == "bf16-true":
            assert {t.dtype for t in actual.values()} == {torch.bfloat16}, {k: t.dtype for k, t in actual.items()}
        expected = torch.load(expected_path, weights_only=True)
        try:
            # The values of the file, cast to the model's dtype: exact when the file is bf16 or the model fp32.
            assert_same_state(actual, {name: value.to(actual[name].dtype) for name, value in expected.items()})
        except AssertionError as error:
            raise AssertionError(f"{precision}, {Path(path).name}: {error}") from None
        done.append(f"{precision}:{Path(path).name}")
    return done


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_bf16_files_and_bf16_true_models(tmp_path, strategy):
    """A bf16 file into a ``precision="bf16-true"`` model and into an fp32 one; an fp32 file into a bf16-true one."""
    bf16, fp32 = _source_state(torch.bfloat16), _source_state()
    torch.save(bf16, tmp_path / "bf16.pth")
    torch.save(fp32, tmp_path / "fp32.pt")
    safetensors_path = str(write_checkpoint(fp32, tmp_path / "fp32", "safetensors"))
    cases = [  # precision, file, its values
        ("bf16-true", str(tmp_path / "bf16.pth"), str(tmp_path / "bf16.pth")),
        ("bf16-true", safetensors_path, str(tmp_path / "fp32.pt")),
        ("32-true", str(tmp_path / "bf16.pth"), str(tmp_path / "bf16.pth")),
    ]
    expected = ["bf16-true:bf16.pth", "bf16-true:model.safetensors", "32-true:bf16.pth"]
    assert _run(_load_with_precision, strategy, cases) == [expected]


def _load_offloaded(strategy: str, path: str) -> bool:
    expected = torch.load(path, weights_only=True)
    fabric = _fabric(strategy, cpu_offload=True)
    model = _make(fabric, seed=7)
    _assert_on(model, torch.device("cpu"), what="parameters")
    # `fabric.load` ends with a barrier, and NCCL's first barrier keeps a 512-byte tensor on the GPU (measured with
    # FSDP1 on an H200 with torch 2.11: the load itself added 0 bytes, as upstream's did). Count from after a barrier.
    fabric.barrier()
    torch.cuda.synchronize(fabric.device)
    before = torch.cuda.memory_allocated(fabric.device)
    fabric.load(path, {"model": model})
    assert not loader._warned_fallbacks, loader._warned_fallbacks
    # The shards stay in host memory: the load copies into them there and leaves nothing on the GPU.
    _assert_on(model, torch.device("cpu"), what="parameters")
    assert torch.cuda.memory_allocated(fabric.device) == before
    if strategy == "fsdp2":  # `CPUOffloadPolicy()` pins the shards; the load must keep those tensors
        assert all(_local(param).is_pinned() for param in model.parameters())
    assert_same_state(gather_full_state(model)["model"], expected)
    with torch.no_grad():
        assert torch.isfinite(model(make_batch(0)[0].to(fabric.device))).all()
    return True


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_cpu_offload_loads_into_host_shards(tmp_path, strategy):
    """``FSDPStrategy(cpu_offload=True)`` (FSDP1) and ``CPUOffloadPolicy`` (FSDP2): shards in host memory, bit-exact."""
    torch.save(_source_state(), tmp_path / "model.pth")
    assert _run(_load_offloaded, strategy, str(tmp_path / "model.pth")) == [True]


def _train(fabric: Fabric, model: nn.Module, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        inputs, targets = make_batch(step)
        logits = model(inputs.to(fabric.device))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.to(fabric.device).flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _round_trip_with_adam(strategy: str, path: str) -> list[float]:
    fabric = _fabric(strategy)

    def make(seed: int):
        model = _make(fabric, seed)
        return model, fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))

    model, optimizer = make(seed=1)
    _train(fabric, model, optimizer, range(2))
    saved = gather_full_state(model, optimizer)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    expected_losses = _train(fabric, model, optimizer, range(2, 4))

    fresh_model, fresh_optimizer = make(seed=2)
    state = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
    assert fabric.load(path, state) == {}
    assert state["step"] == 2
    assert not loader._warned_fallbacks, loader._warned_fallbacks
    _assert_on(fresh_model, fabric.device)
    for param_state in fresh_optimizer.optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert _local(param_state[key]).device == fabric.device, key
    assert_same_state(gather_full_state(fresh_model, fresh_optimizer), saved)
    resumed_losses = _train(fabric, fresh_model, fresh_optimizer, range(2, 4))
    assert resumed_losses == expected_losses, f"{resumed_losses} != {expected_losses}"
    _assert_no_other_gpu_touched(fabric.device)
    return resumed_losses


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_full_checkpoint_with_adam_round_trips_and_resumes(tmp_path, strategy):
    """Saved after two steps, loaded into a fresh model and Adam: the same state, and the next losses repeat."""
    (losses,) = _run(_round_trip_with_adam, strategy, str(tmp_path / "full.ckpt"))
    assert len(losses) == 2


def _background_save_while_training(strategy: str, folder: str) -> tuple[bool, bool]:
    fabric = _fabric(strategy, save_in_background=True)
    model = _make(fabric, seed=1)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    _train(fabric, model, optimizer, range(2))
    state = {"model": model, "optimizer": optimizer, "step": 2}
    background = fabric.strategy._background_saves
    fabric.strategy._background_saves = None  # the reference: the synchronous save of the same state
    fabric.save(f"{folder}/reference.ckpt", state)
    fabric.strategy._background_saves = background

    release = threading.Event()
    real_run = BackgroundSaves._run

    def held_back_run(self, rest):  # the write starts only once training has stepped on the GPU
        release.wait(timeout=60)
        real_run(self, rest)

    with mock.patch.object(BackgroundSaves, "_run", held_back_run):
        fabric.save(f"{folder}/background.ckpt", state)
        # the slices were copied from the GPU into pinned host memory, reserved at the first optimizer step
        pinned = background.buffers.arena is not None and background.buffers.arena.is_pinned()
        _train(fabric, model, optimizer, range(2, 5))
        release.set()
        fabric.strategy.wait_for_save()
    _assert_no_other_gpu_touched(fabric.device)
    return pinned, not Path(f"{folder}/background.ckpt.tmp").exists()


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_background_save_from_the_gpu_holds_the_state_at_the_call(tmp_path, strategy):
    """``save_in_background=True`` on the GPU: the rank's slices and Adam's state go to pinned host memory, and the
    file, written while three more steps run on the GPU, is bit for bit the synchronous save of the state at the call.
    """
    ((pinned, no_temporary),) = _run(_background_save_while_training, strategy, str(tmp_path))
    assert pinned
    assert no_temporary
    background, reference = (
        torch.load(tmp_path / f"{name}.ckpt", weights_only=True) for name in ("background", "reference")
    )
    assert_identical(background, reference)
