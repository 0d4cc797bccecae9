"""The Trainer's ``FSDPStrategy`` of this package: real ``Trainer.fit`` runs on CPU ranks, as users start them.

A run is ``main()`` of ``scripts/trainer_worker.py`` on its ranks. Most runs start the ranks as ``torchrun`` or SLURM
would: processes that the launcher's variables (``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR``, ...) describe, which
the Trainer joins instead of starting its own (forked from a server that has Lightning imported: a fresh interpreter
per rank spent most of these tests' time importing it). The checkpoint that most tests start from is written by
``python scripts/trainer_worker.py``, whose Trainer starts the second rank itself (its subprocess launcher), and two
"nodes" are two such commands with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. Rank 0 of a run writes what the
strategy holds after the restore in the Trainer's own checkpoint format (the model's and the optimizer's full
states), which the tests compare bit for bit with the checkpoint and with Lightning's own restore.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import FSDPStrategy as UpstreamFSDPStrategy

import lightning_fsdp
from lightning_fsdp.pytorch import FSDPStrategy, LoadWeights, ModelParallelStrategy
from tests.tests_fabric.helpers.checkpoints import _write_hf_sharded
from tests.tests_fabric.helpers.distributed import run_distributed
from tests.tests_fabric.helpers.env import without_launcher_variables
from tests.tests_fabric.helpers.object_store import ObjectStore, object_store  # noqa: F401 (the fixture)
from tests.tests_fabric.helpers.state import assert_identical

_WORKER = Path(__file__).parent / "scripts" / "trainer_worker.py"
_ROOT = Path(__file__).resolve().parents[2]
_TIMEOUT = 240


def _env(**extra: str) -> dict[str, str]:
    env = without_launcher_variables()
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def _run(*args: str, expect_failure: bool = False, launch: bool = False) -> str:
    """Run the worker on its ranks; return their output, failing the test unless they finish as expected.

    With ``launch``, the worker runs as a script whose Trainer starts the other ranks itself; otherwise its ranks are
    started as a launcher starts them (see the module's docstring).

    """
    if launch:
        process = subprocess.run(
            [sys.executable, str(_WORKER), *args],
            env=_env(),
            cwd=_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=_TIMEOUT,
        )
        failed, output = process.returncode != 0, process.stdout
    else:
        devices = int(next((arg.split("=")[1] for arg in args if arg.startswith("--devices=")), 2))
        logs = Path(tempfile.mkdtemp(prefix="trainer-ranks-"))
        try:
            run_distributed(_worker_rank, list(args), str(logs), devices=devices, timeout=_TIMEOUT)
            failed, failure = False, ""
        except AssertionError as error:
            failed, failure = True, str(error)
        output = "\n".join(path.read_text() for path in sorted(logs.glob("rank*.log"))) + failure
        shutil.rmtree(logs, ignore_errors=True)
    if failed != expect_failure:
        tail = "\n".join(output.splitlines()[-40:])
        pytest.fail(f"`trainer_worker.py {' '.join(args)}` {'failed' if failed else 'succeeded'}:\n{tail}")
    return output


def _worker_rank(argv: list[str], logs: str) -> None:
    """One rank of a run: the worker's ``main()`` with ``argv``, its output (fd 1 and 2) in ``rank<N>.log``."""
    rank = os.environ["LOCAL_RANK"]
    log = os.open(os.path.join(logs, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("trainer_worker", _WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    sys.argv = [str(_WORKER), *argv]
    try:
        worker.main()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def _assert_same_model(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=0, msg=name)


def _assert_same_optimizer(actual: dict, expected: dict) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for key, state in expected["state"].items():
        assert actual["state"][key].keys() == state.keys()
        for name, value in state.items():
            torch.testing.assert_close(actual["state"][key][name], value, rtol=0, atol=0, msg=f"{key}.{name}")


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory) -> Path:
    """A full checkpoint that the Trainer wrote after 3 steps on 2 ranks, each Linear in its own FSDP unit."""
    path = tmp_path_factory.mktemp("trainer") / "full.ckpt"
    output = _run("save", f"--ckpt={path}", "--wrap", f"--gathered={path.with_name('gathered.ckpt')}", launch=True)
    assert "without a gather: each of the 2 ranks wrote its own slices" in output
    assert "saved by gathering" not in output
    return path


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_save_in_background(strategy, tmp_path):
    """`save_in_background=True`: `trainer.save_checkpoint` returns before the file is written; the next save waits
    for it; the file is the gathered save's."""
    path = tmp_path / "background.ckpt"
    output = _run(
        "save", f"--strategy={strategy}", f"--ckpt={path}", "--background", f"--gathered={tmp_path / 'g.ckpt'}"
    )
    assert "without a gather, in the background: each of the 2 ranks writes its own slices" in output
    assert_identical(_load(path), _load(tmp_path / "g.ckpt"))
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_resume_full_checkpoint_shard_local_on_other_numbers_of_ranks(trainer_checkpoint, tmp_path):
    """`trainer.fit(ckpt_path=...)` restores the model and the optimizer state (keyed by index, as the Trainer saves
    it) exactly, on 2 ranks as saved and on 3, as Lightning's own restore does on 2."""
    saved = _load(trainer_checkpoint)
    assert all(isinstance(key, int) for key in saved["optimizer_states"][0]["state"])
    reports = {}
    for name, extra in (("ours-2", []), ("ours-3", ["--devices=3"]), ("upstream-2", ["--loader=upstream"])):
        report = tmp_path / f"{name}.pt"
        _run("resume", f"--ckpt={trainer_checkpoint}", "--wrap", "--steps=4", f"--report={report}", *extra)
        reports[name] = _load(report)
    for name, report in reports.items():
        assert report["global_step"] == saved["global_step"] == 3, name
        _assert_same_model(report["state_dict"], saved["state_dict"])
        _assert_same_optimizer(report["optimizer_states"][0], saved["optimizer_states"][0])


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_sharded_save_in_background_resumes(strategy, tmp_path):
    """`save_in_background=True` with a sharded checkpoint: torch's distributed checkpoint writes it in the background
    (the run's teardown waits for it), and it resumes exactly."""
    checkpoint, at_save, at_resume = tmp_path / "sharded", tmp_path / "save.pt", tmp_path / "resume.pt"
    common = [f"--strategy={strategy}", "--state-dict-type=sharded", f"--ckpt={checkpoint}"]
    output = _run("save", *common, "--background", f"--report={at_save}")
    assert output.count("sharded save staged in host memory: True") == 2  # both ranks
    assert (checkpoint / ".metadata").is_file()
    _run("resume", *common, "--steps=4", f"--report={at_resume}")
    saved, resumed = _load(at_save), _load(at_resume)
    assert resumed["global_step"] == saved["global_step"] == 3
    _assert_same_model(resumed["state_dict"], saved["state_dict"])
    _assert_same_optimizer(resumed["optimizer_states"][0], saved["optimizer_states"][0])


def test_resume_sharded_checkpoint(tmp_path):
    """A sharded checkpoint that the Trainer wrote goes through the validated reader, and resumes exactly."""
    checkpoint, at_save, at_resume = tmp_path / "sharded", tmp_path / "save.pt", tmp_path / "resume.pt"
    _run("save", f"--ckpt={checkpoint}", "--state-dict-type=sharded", f"--report={at_save}")
    assert (checkpoint / "meta.pt").is_file()
    _run("resume", f"--ckpt={checkpoint}", "--state-dict-type=sharded", "--steps=4", f"--report={at_resume}")
    saved, resumed = _load(at_save), _load(at_resume)
    assert resumed["global_step"] == saved["global_step"] == 3
    _assert_same_model(resumed["state_dict"], saved["state_dict"])
    _assert_same_optimizer(resumed["optimizer_states"][0], saved["optimizer_states"][0])


@pytest.fixture(scope="module")
def fsdp2_checkpoint(tmp_path_factory) -> Path:
    """A full checkpoint that the Trainer's ``ModelParallelStrategy`` wrote after 3 steps of FSDP2 on 2 ranks."""
    path = tmp_path_factory.mktemp("trainer-fsdp2") / "full.ckpt"
    output = _run(
        "save", "--strategy=model_parallel", f"--ckpt={path}", f"--gathered={path.with_name('gathered.ckpt')}"
    )
    assert "without a gather: each of the 2 ranks wrote its own slices" in output
    assert "saved by gathering" not in output
    return path


@pytest.mark.parametrize("checkpoint", ["trainer_checkpoint", "fsdp2_checkpoint"])
def test_full_save_without_gather_is_upstreams_file(checkpoint, request):
    """`trainer.save_checkpoint` (and so `ModelCheckpoint`) with a full state dict: every rank wrote its own slices,
    and the file holds what the gathered save writes: the same entries in the same order, the same bytes."""
    path = request.getfixturevalue(checkpoint)
    assert_identical(_load(path), _load(path.with_name("gathered.ckpt")))


def test_model_parallel_resume_full_checkpoint_on_other_number_of_ranks(fsdp2_checkpoint, tmp_path):
    """FSDP2: the full checkpoint saved on 2 ranks resumes exactly on 3 (uneven shards), model and optimizer."""
    report = tmp_path / "resume.pt"
    _run(
        "resume",
        "--strategy=model_parallel",
        "--devices=3",
        f"--ckpt={fsdp2_checkpoint}",
        "--steps=4",
        f"--report={report}",
    )
    saved, resumed = _load(fsdp2_checkpoint), _load(report)
    assert resumed["global_step"] == saved["global_step"] == 3
    _assert_same_model(resumed["state_dict"], saved["state_dict"])
    _assert_same_optimizer(resumed["optimizer_states"][0], saved["optimizer_states"][0])


def test_model_parallel_resume_distributed_checkpoint(tmp_path):
    """FSDP2: the distributed checkpoint that the Trainer writes by default resumes through the validated reader."""
    checkpoint, at_save, at_resume = tmp_path / "dcp", tmp_path / "save.pt", tmp_path / "resume.pt"
    common = ["--strategy=model_parallel", "--state-dict-type=sharded", f"--ckpt={checkpoint}"]
    _run("save", *common, f"--report={at_save}")
    _run("resume", *common, "--steps=4", f"--report={at_resume}")
    saved, resumed = _load(at_save), _load(at_resume)
    assert resumed["global_step"] == saved["global_step"] == 3
    _assert_same_model(resumed["state_dict"], saved["state_dict"])
    _assert_same_optimizer(resumed["optimizer_states"][0], saved["optimizer_states"][0])


def test_model_parallel_load_weights(fsdp2_checkpoint, tmp_path):
    """FSDP2: `LoadWeights` loads a safetensors file shard-locally into the `DTensor` parameters."""
    from safetensors.torch import save_file

    weights = _load(fsdp2_checkpoint)["state_dict"]
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, tmp_path / "model.safetensors")
    report = tmp_path / "weights.pt"
    _run(
        "weights",
        "--strategy=model_parallel",
        f"--ckpt={tmp_path / 'model.safetensors'}",
        "--steps=1",
        f"--report={report}",
    )
    _assert_same_model(_load(report)["state_dict"], weights)


def test_load_weights_from_elsewhere(trainer_checkpoint, tmp_path):
    """`LoadWeights` starts training from a raw state dict, a safetensors file or a Trainer checkpoint's weights."""
    from safetensors.torch import save_file

    weights = _load(trainer_checkpoint)["state_dict"]
    torch.save(weights, tmp_path / "raw.pth")
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, tmp_path / "model.safetensors")
    for source in (tmp_path / "raw.pth", tmp_path / "model.safetensors", trainer_checkpoint):
        report = tmp_path / f"{source.name}.report.pt"
        _run("weights", f"--ckpt={source}", "--steps=1", f"--report={report}")
        loaded = _load(report)
        assert loaded["global_step"] == 0
        _assert_same_model(loaded["state_dict"], weights)


def test_load_weights_from_a_hugging_face_checkpoint_in_object_storage(
    trainer_checkpoint,
    object_store: ObjectStore,  # noqa: F811
    tmp_path,
):
    """`LoadWeights` of a Hugging Face checkpoint (an index and two safetensors shards) in S3, whose names a rename
    maps to the model's: every rank reads its slices from the store, and the weights are the file's."""
    weights = _load(trainer_checkpoint)["state_dict"]
    folder = tmp_path / "hf"
    folder.mkdir()
    index = _write_hf_sharded({f"transformer.{name}": tensor for name, tensor in weights.items()}, folder, binary=False)
    url = f"{object_store.upload(folder, 'trainer-hf')}/{index.name}"
    options = {"rename": {"transformer.": ""}, "storage_options": object_store.storage_options()}
    report = tmp_path / "report.pt"
    _run("weights", f"--ckpt={url}", f"--load-options={json.dumps(options)}", "--steps=1", f"--report={report}")
    _assert_same_model(_load(report)["state_dict"], weights)


def test_load_weights_of_a_truncated_file_is_one_error_on_every_rank(trainer_checkpoint, tmp_path):
    """A truncated file: the run stops on every rank with the error that names the file and what is wrong with it."""
    torch.save(_load(trainer_checkpoint)["state_dict"], tmp_path / "raw.pth")
    data = (tmp_path / "raw.pth").read_bytes()
    (tmp_path / "raw.pth").write_bytes(data[: len(data) // 2])
    output = _run("weights", f"--ckpt={tmp_path / 'raw.pth'}", "--steps=1", expect_failure=True)
    assert output.count("CheckpointLoadError") >= 2, output  # rank 0's error, and rank 1's line that names it
    assert "failed on ranks 0-1" in output
    assert "it is truncated" in output
    assert "raw.pth" in output


def test_resume_from_weights_alone_names_the_callback(trainer_checkpoint, tmp_path):
    """A file of weights alone is no checkpoint to resume from: one error, on every rank, says what to use."""
    torch.save(_load(trainer_checkpoint)["state_dict"], tmp_path / "raw.pth")
    output = _run("resume", f"--ckpt={tmp_path / 'raw.pth'}", "--steps=4", expect_failure=True)
    assert "raw module state dict" in output
    assert "lightning_fsdp.pytorch.LoadWeights" in output
    assert re.search(r"(?<!Checkpoint)KeyError", output) is None, output  # not upstream's bare `KeyError: 'model'`
    assert "CheckpointKeyError" in output  # a `KeyError` too, as upstream's error is


def test_resume_on_two_nodes(trainer_checkpoint, tmp_path):
    """Two "nodes" of one rank each, started as a cluster starts them, resume the checkpoint saved on one node."""
    port = str(find_free_network_port())
    report = tmp_path / "nodes.pt"
    args = [sys.executable, str(_WORKER), "resume", f"--ckpt={trainer_checkpoint}", "--wrap", "--steps=4"]
    args += ["--devices=1", "--num-nodes=2", f"--report={report}"]
    processes = []
    for node_rank in range(2):
        env = _env(NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        log = open(tmp_path / f"node{node_rank}.log", "w")  # noqa: SIM115
        processes.append(subprocess.Popen(args, env=env, cwd=_ROOT, stdout=log, stderr=subprocess.STDOUT))
    codes = [process.wait(timeout=_TIMEOUT) for process in processes]
    if any(codes):
        logs = "\n".join((tmp_path / f"node{rank}.log").read_text()[-3000:] for rank in range(2))
        pytest.fail(f"two nodes exited with {codes}:\n{logs}")
    saved, resumed = _load(trainer_checkpoint), _load(report)
    _assert_same_model(resumed["state_dict"], saved["state_dict"])
    _assert_same_optimizer(resumed["optimizer_states"][0], saved["optimizer_states"][0])


@pytest.fixture
def _disable_after():
    yield
    lightning_fsdp.disable()


@pytest.mark.usefixtures("_disable_after")
def test_enable_covers_the_trainer():
    """After `enable()`, `Trainer(strategy="fsdp")` and Lightning's class construct this package's strategy, on CPU."""
    lightning_fsdp.enable()
    trainer = Trainer(accelerator="cpu", devices=2, strategy="fsdp", logger=False)
    assert type(trainer.strategy) is FSDPStrategy
    assert isinstance(trainer.strategy, UpstreamFSDPStrategy)
    strategy = UpstreamFSDPStrategy(state_dict_type="sharded", sharding_strategy="SHARD_GRAD_OP")
    assert type(strategy) is FSDPStrategy
    assert strategy._state_dict_type == "sharded"
    assert Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False).strategy is strategy
    from lightning.pytorch.strategies import ModelParallelStrategy as UpstreamModelParallelStrategy

    assert type(UpstreamModelParallelStrategy(data_parallel_size=2)) is ModelParallelStrategy
    lightning_fsdp.disable()
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        Trainer(accelerator="cpu", devices=2, strategy="fsdp", logger=False)
    assert type(UpstreamFSDPStrategy()) is UpstreamFSDPStrategy
    assert type(UpstreamModelParallelStrategy()) is UpstreamModelParallelStrategy


def test_arguments_are_upstreams():
    """The same parameters as Lightning's class, then this package's two keyword-only ones."""
    import inspect

    upstream = list(inspect.signature(UpstreamFSDPStrategy.__init__).parameters)
    ours = list(inspect.signature(FSDPStrategy.__init__).parameters)
    assert [
        name for name in ours if name not in ("load_concurrency", "load_progress", "save_in_background")
    ] == upstream
    with pytest.raises(ValueError, match="load_concurrency"):
        FSDPStrategy(load_concurrency=0)


def test_load_weights_needs_this_packages_strategy():
    callback = LoadWeights("model.safetensors")
    trainer = Trainer(accelerator="cpu", devices=1, logger=False)
    with pytest.raises(TypeError, match=r"lightning_fsdp\.pytorch\.FSDPStrategy"):
        callback.on_fit_start(trainer, None)


def test_model_parallel_arguments_are_upstreams():
    import inspect

    from lightning.pytorch.strategies import ModelParallelStrategy as UpstreamModelParallelStrategy

    upstream = list(inspect.signature(UpstreamModelParallelStrategy.__init__).parameters)
    ours = list(inspect.signature(ModelParallelStrategy.__init__).parameters)
    assert [
        name for name in ours if name not in ("load_concurrency", "load_progress", "save_in_background")
    ] == upstream
    assert isinstance(ModelParallelStrategy(), UpstreamModelParallelStrategy)


def _unlaunched_strategy(tmp_path, cls=FSDPStrategy):
    """A strategy used directly in this process, as Lightning's unit tests use it: no process group, one rank."""
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.states import TrainerFn

    module = pl.LightningModule()
    module.layer = torch.nn.Linear(3, 2)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    trainer.state.fn = TrainerFn.FITTING
    module.trainer = trainer
    strategy = cls(parallel_devices=[torch.device("cpu")], state_dict_type="full") if cls is FSDPStrategy else cls()
    strategy._lightning_module = module
    strategy.model = module
    return strategy, module


def test_resume_with_another_number_of_optimizers(tmp_path):
    """Upstream's error for a checkpoint of more or fewer optimizers, before anything is written."""
    strategy, module = _unlaunched_strategy(tmp_path)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    saved = {name: torch.full_like(tensor, 7.0) for name, tensor in module.state_dict().items()}
    torch.save({"state_dict": saved, "optimizer_states": [optimizer.state_dict()] * 2}, tmp_path / "two.ckpt")
    before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    strategy.optimizers = [optimizer]
    with pytest.raises(RuntimeError, match="1 optimizers but the checkpoint contains 2 optimizers to load"):
        strategy.load_checkpoint(tmp_path / "two.ckpt")
    _assert_same_model(module.state_dict(), before)
    # outside of fitting, the optimizers' states are not read: the weights and the other entries load
    from lightning.pytorch.trainer.states import TrainerFn

    module.trainer.state.fn = TrainerFn.VALIDATING
    torch.save({"state_dict": saved, "optimizer_states": [], "epoch": 4}, tmp_path / "none.ckpt")
    assert strategy.load_checkpoint(tmp_path / "none.ckpt") == {"epoch": 4}
    _assert_same_model(module.state_dict(), saved)


def test_resume_checks_names_with_the_modules_strict_loading(tmp_path):
    """The LightningModule's `strict_loading` decides, as upstream: an unexpected name fails unless it is `False`."""
    strategy, module = _unlaunched_strategy(tmp_path)
    saved = {name: torch.full_like(tensor, 3.0) for name, tensor in module.state_dict().items()}
    torch.save({"state_dict": {**saved, "extra.weight": torch.zeros(1)}, "global_step": 5}, tmp_path / "extra.ckpt")
    with pytest.raises(RuntimeError, match=r"extra\.weight"):
        strategy.load_checkpoint(tmp_path / "extra.ckpt")
    module.strict_loading = False
    with pytest.warns(UserWarning, match="strict=False"):
        assert strategy.load_checkpoint(tmp_path / "extra.ckpt") == {"global_step": 5}
    _assert_same_model(module.state_dict(), saved)


def test_a_hook_that_changes_the_state_gets_the_gathered_save():
    """The stand-ins that the save fills: a hook that wrote into one (or replaced it) gets upstream's gathered save."""
    from lightning_fsdp.pytorch.saving import Deferred, fill_gathered, gather_free_state

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = {"epoch": 1, "state_dict": Deferred(model), "optimizer_states": [Deferred(optimizer)], "loops": {}}
    state = gather_free_state(checkpoint, model)
    assert list(state) == list(checkpoint)
    assert state["state_dict"] is model
    assert state["optimizer_states"] == [optimizer]

    checkpoint["state_dict"]["extra"] = torch.zeros(1)
    with pytest.warns(UserWarning, match="`on_save_checkpoint` hook changed"):
        assert gather_free_state(checkpoint, model) is None
    fill_gathered(checkpoint, lambda: {"weight": torch.ones(1)}, lambda optimizer: {"state": {}, "param_groups": []})
    assert checkpoint["state_dict"] == {"weight": torch.ones(1), "extra": torch.zeros(1)}  # the hook's entry kept
    assert checkpoint["optimizer_states"] == [{"state": {}, "param_groups": []}]


def test_save_hooks_that_see_the_states_get_the_gathered_save():
    """A callback's or the module's `on_save_checkpoint` may filter the states (LoRA weights alone): then the save
    gathers, as upstream's, and says so once."""
    from lightning.pytorch.callbacks import Callback

    from lightning_fsdp.pytorch.saving import hooks_allow_stand_ins

    class KeepLoRA(Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if "lora" in k}

    assert hooks_allow_stand_ins(Trainer(accelerator="cpu", logger=False))  # ModelCheckpoint, the progress bar
    trainer = Trainer(accelerator="cpu", logger=False, callbacks=[KeepLoRA()])
    with pytest.warns(UserWarning, match=r"`KeepLoRA.on_save_checkpoint` may read or change"):
        assert not hooks_allow_stand_ins(trainer)


def test_resume_unpickles_only_plain_objects_unless_told(tmp_path):
    """`weights_only` of `trainer.fit`: a checkpoint holding another object is refused by default, with the fix."""
    strategy, module = _unlaunched_strategy(tmp_path)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": {"when": _Custom()}}, tmp_path / "c.ckpt")
    with pytest.raises(RuntimeError, match=r"load it with `weights_only=False`.*_Custom"):
        strategy.load_checkpoint(tmp_path / "c.ckpt")
    restored = strategy.load_checkpoint(tmp_path / "c.ckpt", weights_only=False)
    assert isinstance(restored["hyper_parameters"]["when"], _Custom)


class _Custom:
    """An object that a Trainer checkpoint may hold (in `hyper_parameters`): unpickling it runs its class's code."""
