# Copyright The lightning-fsdp developers.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The change as a numbered series of pull requests: which step carries what, the checks, and the commits.

Every file that the one-shot command writes, and every definition of the Python files among them, belongs to exactly
one step (:data:`STEPS`). Step ``k`` of the series is the one-shot change restricted to steps ``1..k``: each of our
files loses the definitions of later steps (and the imports only they used), and files of later steps are left out.
Where a later step changes lines of definitions that an earlier step carries, it lists how those lines read before it
(:class:`Interim`).
Before anything is written, the series is checked: the manifest covers everything the one-shot command writes, once;
the union of the steps is the one-shot change; and no step uses a name that only a later step provides.
"""

import ast
import difflib
import fnmatch
import re
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lightning_fsdp.upstream._apply import Change, Plan, Restriction, find_root, plan
from lightning_fsdp.upstream._merge import _used_names, drop_unused_imports, upstream_base
from lightning_fsdp.upstream._rewrite import import_from_text
from lightning_fsdp.upstream._source import (
    Edit,
    Source,
    UpstreamError,
    apply_edits,
    bound_names,
    docstring_node,
    indentation,
    is_type_checking_block,
)

_SRC = "src/lightning_fsdp"
_TESTS = "tests/tests_fabric"
_DOCS = "docs/source-fabric"
#: Words that must not appear in a description (the package's names).
_PACKAGE_NAMES = re.compile(r"lightning[_-]fsdp", re.IGNORECASE)


@dataclass(frozen=True)
class Step:
    """One pull request of the series.

    ``carries`` lists what it brings: a path of this project (a glob: the whole file), ``path::Name`` or
    ``path::Class.member`` (one definition of a Python file; the rest of the file stays with the step that carries
    the file), ``CHANGELOG.md::<start of an entry>``, or ``connector`` (the connector's GPU-only check removed).
    ``lightning_edits`` are the edits of Lightning's own tests that this step makes on purpose, with the reason.
    ``interims`` are lines of our files that this step changes in definitions an earlier step carries, as they read
    in the steps before it.

    """

    slug: str
    title: str
    carries: tuple[str, ...]
    issue: str
    motivation: str
    effect: str
    behaviour: str = "None."
    size: str = ""
    lightning_edits: tuple["LightningEdit", ...] = ()
    interims: tuple["Interim", ...] = ()


@dataclass(frozen=True)
class LightningEdit:
    """An edit of one of Lightning's tests that a step makes on purpose: ``old``, lines inside the test, become ``new``.

    Only our replacement text is stored; Lightning's lines are found in the tree and must be there exactly once.

    """

    file: str  # relative to the tree's tests/
    test: str
    old: str
    new: str
    reason: str

    @property
    def node_id(self) -> str:
        return f"{self.file}::{self.test}"


@dataclass(frozen=True)
class Interim:
    """Lines of one of our files as they read before the step that lists them: ``final`` becomes ``interim`` there.

    ``final`` must be in the file exactly once. Imports that only ``final`` used are left out before the step.

    """

    file: str  # relative to this project's checkout
    final: str
    interim: str


_CPU_EDIT = LightningEdit(
    "tests_fabric/test_connector.py",
    "test_fsdp_unsupported_on_cpu",
    old="""def test_fsdp_unsupported_on_cpu(_):
    \"\"\"Test that we raise an error if attempting to run FSDP without GPU.\"\"\"
    with pytest.raises(ValueError, match="You selected the FSDP strategy but FSDP is only available on GPU"):
        _Connector(accelerator="cpu", strategy="fsdp")
""",
    new="""def test_fsdp_on_cpu(_):
    \"\"\"Test that FSDP runs on CPU (with the `gloo` backend).\"\"\"
    connector = _Connector(accelerator="cpu", strategy="fsdp")
    assert isinstance(connector.strategy, FSDPStrategy)
    assert isinstance(connector.accelerator, CPUAccelerator)
""",
    reason="it asserted the check that this step removes; it now asserts that FSDP is set up on CPU (renamed"
    " `test_fsdp_on_cpu`).",
)
_EMPTY_FILE_OLD = """    # A raw nn.Module instead of a dictionary is ok
    model = Mock(spec=nn.Module)
    model.parameters.return_value = [torch.zeros(2, 1)]
    path = tmp_path / "full.ckpt"
    path.touch()
    strategy.load_checkpoint(path=path, state=model)
"""
_EMPTY_FILE_NEW = """    # A raw nn.Module instead of a dictionary is ok, but an empty file is refused by its content
    from lightning.fabric.utilities.checkpoint_loading.errors import CheckpointLoadError

    model = Mock(spec=nn.Module)
    model.parameters.return_value = [torch.zeros(2, 1)]
    path = tmp_path / "full.ckpt"
    path.touch()
    with pytest.raises(CheckpointLoadError, match=r"is empty \\(0 bytes\\)"):
        strategy.load_checkpoint(path=path, state=model)
"""
_EMPTY_FILE_REASON = (
    "its last call loaded an empty file into a `Mock` module through a mocked `torch.load`; the loader reads the file"
    " itself, by its own structure, and refuses an empty one (`is empty (0 bytes). Was the save interrupted?`). The"
    " checks before it are unchanged."
)
_EMPTY_FILE_EDITS = (
    LightningEdit(
        "tests_fabric/strategies/test_fsdp.py",
        "test_load_checkpoint_one_fsdp_module_required",
        _EMPTY_FILE_OLD,
        _EMPTY_FILE_NEW,
        _EMPTY_FILE_REASON,
    ),
)
_REMOTE_EDITS_REASON = (
    "master read a remote full checkpoint whole on every rank through `cloud_io._load` (with `weights_only=False` by"
    " default) and a remote sharded checkpoint through DCP's fsspec reader; these tests mocked `_load`. A remote file"
    " is now read like a local one, by byte ranges, with `weights_only=True` unless `False` is passed, and a remote"
    " sharded directory by the same validated reader as a local one (its `.metadata` through the allow-list, each"
    " entry by a range request), never by DCP's fsspec reader, which would unpickle its metadata unchecked: the tests"
    " check that instead, on fsspec's in-memory file system."
)
_REMOTE_EDITS = (
    LightningEdit(
        "tests_fabric/strategies/test_fsdp.py",
        "test_load_full_checkpoint_remote_allows_non_tensor_objects",
        old="""def test_load_full_checkpoint_remote_allows_non_tensor_objects(monkeypatch):
    \"\"\"Regression: remote full-checkpoints are read with `weights_only=False` so non-tensor metadata
    (which `torch.load` rejects by default since torch 2.6) loads just like the local `_lazy_load` path.\"\"\"
    strategy = FSDPStrategy()
    monkeypatch.setattr(strategy, "broadcast", lambda x: x)
    monkeypatch.setattr("lightning.fabric.strategies.fsdp._has_fsdp_modules", lambda m: True)
    monkeypatch.setattr("lightning.fabric.strategies.fsdp._is_full_checkpoint", lambda p: True)
    monkeypatch.setattr("lightning.fabric.strategies.model_parallel._load_raw_module_state", lambda *a, **k: None)

    captured = {}

    def fake_load(path, weights_only=None):
        captured["weights_only"] = weights_only
        return {"model": {"weight": torch.zeros(2)}}

    monkeypatch.setattr("lightning.fabric.strategies.fsdp._load", fake_load)

    strategy.load_checkpoint("memory:///x/full.ckpt", state={"model": nn.Linear(2, 2)})
    assert captured["weights_only"] is False
""",
        new="""def test_load_full_checkpoint_remote_is_read_by_byte_ranges(monkeypatch):
    \"\"\"Remote full checkpoints are read like local ones, by byte ranges: never whole through `cloud_io._load`, and
    non-tensor metadata (plain values) loads with the default `weights_only`.\"\"\"
    import fsspec

    strategy = FSDPStrategy()
    monkeypatch.setattr(strategy, "broadcast", lambda x: x)
    monkeypatch.setattr("lightning.fabric.strategies.fsdp._has_fsdp_modules", lambda m: True)
    monkeypatch.setattr("lightning.fabric.strategies.fsdp._load", Mock(side_effect=AssertionError), raising=False)
    saved = nn.Linear(2, 2)
    with fsspec.open("memory:///x/full.ckpt", "wb") as file:
        torch.save({"model": saved.state_dict(), "epoch": 3, "note": "text"}, file)

    model = nn.Linear(2, 2)
    remainder = strategy.load_checkpoint("memory:///x/full.ckpt", state={"model": model})
    assert remainder == {"epoch": 3, "note": "text"}
    assert torch.equal(model.weight, saved.weight)
""",
        reason=_REMOTE_EDITS_REASON,
    ),
    LightningEdit(
        "tests_fabric/strategies/test_fsdp.py",
        "test_load_full_checkpoint_remote_honors_explicit_weights_only",
        old="""def test_load_full_checkpoint_remote_honors_explicit_weights_only(monkeypatch):
    \"\"\"An explicit `weights_only=True` from the user must be honored for remote full-checkpoints, not silently
    overridden to `False`.\"\"\"
    strategy = FSDPStrategy()
    monkeypatch.setattr(strategy, "broadcast", lambda x: x)
    monkeypatch.setattr("lightning.fabric.strategies.fsdp._has_fsdp_modules", lambda m: True)
    monkeypatch.setattr("lightning.fabric.strategies.fsdp._is_full_checkpoint", lambda p: True)
    monkeypatch.setattr("lightning.fabric.strategies.model_parallel._load_raw_module_state", lambda *a, **k: None)

    captured = {}

    def fake_load(path, weights_only=None):
        captured["weights_only"] = weights_only
        return {"model": {"weight": torch.zeros(2)}}

    monkeypatch.setattr("lightning.fabric.strategies.fsdp._load", fake_load)

    strategy.load_checkpoint("memory:///x/full.ckpt", state={"model": nn.Linear(2, 2)}, weights_only=True)
    assert captured["weights_only"] is True
""",
        new="""def test_load_full_checkpoint_remote_honors_weights_only(monkeypatch):
    \"\"\"`weights_only` (default `True`) applies to remote files as to local ones; `False` loads any object.\"\"\"
    import argparse

    import fsspec

    from lightning.fabric.utilities.checkpoint_loading.errors import CheckpointLoadError

    strategy = FSDPStrategy()
    monkeypatch.setattr(strategy, "broadcast", lambda x: x)
    monkeypatch.setattr("lightning.fabric.strategies.fsdp._has_fsdp_modules", lambda m: True)
    path = "memory:///x/objects.ckpt"
    with fsspec.open(path, "wb") as file:
        torch.save({"model": nn.Linear(2, 2).state_dict(), "hparams": argparse.Namespace(lr=0.1)}, file)

    for weights_only in (None, True):
        with pytest.raises(CheckpointLoadError, match="weights_only=False"):
            strategy.load_checkpoint(path, state={"model": nn.Linear(2, 2)}, weights_only=weights_only)
    remainder = strategy.load_checkpoint(path, state={"model": nn.Linear(2, 2)}, weights_only=False)
    assert remainder == {"hparams": argparse.Namespace(lr=0.1)}
""",
        reason=_REMOTE_EDITS_REASON,
    ),
    LightningEdit(
        "tests_fabric/strategies/test_fsdp.py",
        "test_load_sharded_checkpoint_metadata_weights_only",
        old="""def test_load_sharded_checkpoint_metadata_weights_only(monkeypatch):
    \"\"\"The sharded-checkpoint metadata load must default to `weights_only=False` (like the full-checkpoint path) so
    non-tensor metadata loads on torch>=2.6, while still honoring an explicit user value.\"\"\"
    strategy = FSDPStrategy()
    monkeypatch.setattr(strategy, "broadcast", lambda x: x)
    monkeypatch.setattr("lightning.fabric.strategies.fsdp._has_fsdp_modules", lambda m: True)
    monkeypatch.setattr("lightning.fabric.strategies.fsdp._is_sharded_checkpoint", lambda p: True)
    monkeypatch.setattr(
        "lightning.fabric.strategies.fsdp._get_sharded_state_dict_context", lambda module: mock.MagicMock()
    )
    monkeypatch.setattr("lightning.fabric.strategies.fsdp._distributed_checkpoint_load", lambda state, path: None)

    captured = {}

    def fake_load(path, weights_only=None):
        captured["weights_only"] = weights_only
        return {}

    monkeypatch.setattr("lightning.fabric.strategies.fsdp._load", fake_load)

    model = nn.Linear(2, 2)
    strategy.load_checkpoint("memory:///x/sharded", state={"model": model})
    assert captured["weights_only"] is False

    strategy.load_checkpoint("memory:///x/sharded", state={"model": model}, weights_only=True)
    assert captured["weights_only"] is True
""",
        new="""def test_load_sharded_checkpoint_remote_is_read_by_byte_ranges(monkeypatch):
    \"\"\"A remote sharded checkpoint is read like a local one, by the validated reader: its `.metadata` through an
    allow-list and `meta.pt` weights-only, each entry by a range request, never through DCP's fsspec reader.\"\"\"
    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _fsspec_filesystem

    strategy = FSDPStrategy()
    monkeypatch.setattr(strategy, "broadcast", lambda x: x)
    monkeypatch.setattr("lightning.fabric.strategies.fsdp._has_fsdp_modules", lambda m: True)
    monkeypatch.setattr(
        "lightning.fabric.strategies.fsdp._get_sharded_state_dict_context", lambda module: mock.MagicMock()
    )
    saved = nn.Linear(2, 2)
    dcp.save({"model": saved.state_dict()}, checkpoint_id="memory:///x/sharded")
    with fsspec.open("memory:///x/sharded/meta.pt", "wb") as file:
        torch.save({"epoch": 3}, file)
    monkeypatch.setattr(_fsspec_filesystem.FsspecReader, "__init__", Mock(side_effect=AssertionError))

    model = nn.Linear(2, 2)
    remainder = strategy.load_checkpoint("memory:///x/sharded", state={"model": model})
    assert remainder == {"epoch": 3}
    assert torch.equal(model.weight, saved.weight)
    assert torch.equal(model.bias, saved.bias)
""",
        reason=_REMOTE_EDITS_REASON,
    ),
)
_LOCAL_ONLY_IMPORT = "from lightning.fabric.utilities.cloud_io import _is_local_file_protocol\n"
#: Before the remote step, a remote path takes the method that `load_checkpoint` replaces (master's branch, which
#: reads it whole through `cloud_io`), kept beside it as `_default_load_checkpoint`.
_REMOTE_DISPATCH = """\
        if not _is_local_file_protocol(path):
            # Remote storage is read as before (whole, through `cloud_io`) until the loader reads it by byte ranges.
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
"""
_REMOTE_DOCSTRING = """\
        A remote path (an fsspec URL such as ``s3://...``) is loaded as before, by ``_default_load_checkpoint``.
"""


def _load_options_without_storage_options(file: str) -> tuple[Interim, Interim]:
    """The strategy's ``load_options`` before the remote step: without ``storage_options``."""
    signature = Interim(
        file,
        final="""    def load_options(
        self, rename: Rename | None = None, storage_options: dict[str, Any] | None = None
    ) -> AbstractContextManager:
""",
        interim="    def load_options(self, rename: Rename | None = None) -> AbstractContextManager:\n",
    )
    call = Interim(
        file,
        final="        return load_options(self, rename, storage_options)\n",
        interim="        return load_options(self, rename)\n",
    )
    return signature, call


_REMOTE_INTERIMS = (
    Interim(
        f"{_SRC}/strategy.py",
        final="from lightning.fabric.strategies.strategy import _apply_filter\n",
        interim="from lightning.fabric.strategies.strategy import _apply_filter\n" + _LOCAL_ONLY_IMPORT,
    ),
    Interim(
        f"{_SRC}/strategy.py",
        final="""\
        A remote file (an fsspec URL such as ``s3://...``, with the ``storage_options`` of :meth:`load_options`) is
        read the same way, each rank fetching only its own byte ranges; a remote sharded directory too, by the same
        validated reader.
""",
        interim=_REMOTE_DOCSTRING,
    ),
    Interim(
        f"{_SRC}/strategy.py",
        final="        state, module_key = _checked_state(state)\n",
        interim=_REMOTE_DISPATCH + "        state, module_key = _checked_state(state)\n",
    ),
    *_load_options_without_storage_options(f"{_SRC}/strategy.py"),
    Interim(
        f"{_SRC}/strategy.py",
        final="""
            storage_options: Options of the fsspec file system that reads a checkpoint URL (``s3://...``), such as
                ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for ``s3fs``. By default fsspec's usual
                configuration applies (environment variables, the provider's config files).
""",
        interim="",
    ),
    Interim(
        f"{_SRC}/strategy.py",
        final="or a callable, or ``storage_options`` not a dict.\n",
        interim="or a callable.\n",
    ),
    Interim(
        f"{_SRC}/model_parallel.py",
        final="from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers\n",
        interim="from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers\n"
        + _LOCAL_ONLY_IMPORT,
    ),
    Interim(
        f"{_SRC}/model_parallel.py",
        final="""\
        A remote file (an fsspec URL such as ``s3://...``) is read the same way, each rank fetching only its own byte
        ranges; a remote sharded directory too, by the same validated reader.

        \"\"\"
""",
        interim=_REMOTE_DOCSTRING + '\n        """\n' + _REMOTE_DISPATCH,
    ),
    *_load_options_without_storage_options(f"{_SRC}/model_parallel.py"),
    Interim(
        f"{_DOCS}/guide/loading_large_checkpoints.rst",
        final="""\
Checkpoints in object storage (``s3://`` and other fsspec URLs) are read the same way, by byte ranges: see
:doc:`object_storage`.
""",
        interim="",
    ),
    Interim(f"{_SRC}/loading_calls.py", final="    _load_storage_options: Mapping[str, Any] | None\n", interim=""),
    Interim(f"{_SRC}/loading_calls.py", final="    strategy._load_storage_options = None\n", interim=""),
    Interim(
        f"{_SRC}/loading_calls.py",
        final="""        return checkpoint_path(strategy, start), new_namespace()
    return checkpoint_path(strategy, start.path), start.namespace
""",
        interim="""        return Path(start), new_namespace()
    return Path(start.path), start.namespace
""",
    ),
    Interim(
        f"{_SRC}/loading_calls.py",
        final="""def load_options(
    strategy: LoadingStrategy, rename: Rename | None, storage_options: Mapping[str, Any] | None = None
) -> Iterator[None]:
    \"\"\"Set the options of the loads inside the block on ``strategy``, and restore the previous ones after it.\"\"\"
    check_rename(rename)
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(
            f"`load_options(storage_options=...)` takes a dict of fsspec options, got {type(storage_options).__name__}."
        )
    previous = strategy._load_rename, strategy._load_storage_options
    strategy._load_rename, strategy._load_storage_options = rename, storage_options
    try:
        yield
    finally:
        strategy._load_rename, strategy._load_storage_options = previous
""",
        interim="""def load_options(strategy: LoadingStrategy, rename: Rename | None) -> Iterator[None]:
    \"\"\"Set the options of the loads inside the block on ``strategy``, and restore the previous ones after it.\"\"\"
    check_rename(rename)
    previous = strategy._load_rename
    strategy._load_rename = rename
    try:
        yield
    finally:
        strategy._load_rename = previous
""",
    ),
)
_MODEL_PARALLEL_EDITS = (
    LightningEdit(
        "tests_fabric/strategies/test_model_parallel.py",
        "test_load_checkpoint_one_dist_module_required",
        _EMPTY_FILE_OLD,
        _EMPTY_FILE_NEW,
        _EMPTY_FILE_REASON,
    ),
    LightningEdit(
        "tests_fabric/strategies/test_model_parallel.py",
        "test_meta_device_materialization",
        old=(
            '    with pytest.warns(UserWarning, match=r"`reset_parameters\\(\\)` method for re-initialization:'
            ' NoResetParameters"):\n'
            "        model = strategy.setup_module(model)\n"
        ),
        new=(
            "    # Modules without `reset_parameters()` are allowed; a load that leaves their tensors unwritten warns\n"
            "    model = strategy.setup_module(model)\n"
        ),
        reason="the warning about modules without `reset_parameters()` moves from `setup_module` to the load that"
        " leaves their tensors unwritten (it names them); the model's own initialisation runs on each rank's shards.",
    ),
)

#: The series, in the order a maintainer would merge it.
STEPS: tuple[Step, ...] = (
    Step(
        slug="fsdp-on-cpu",
        title="Run `FSDPStrategy` on CPU with the `gloo` backend",
        carries=("connector", "CHANGELOG.md::Added support for running `FSDPStrategy` on CPU"),
        issue="Lightning-AI/pytorch-lightning#18008 (the checkpoint problems of multi-node FSDP could only be"
        " reproduced on GPUs); prepares the CPU tests of the following steps.",
        motivation="`master` already passes the CPU device to FSDP (#21774) and skips CPU offload for a CPU model"
        ' (#21805), but `_Connector` still refuses `Fabric(accelerator="cpu", strategy="fsdp")`. Removing the'
        " check lets FSDP run on CPU with `gloo`, so that FSDP's checkpoint loading can be tested in CI without"
        " GPUs (every test of the following steps runs on CPU ranks).",
        effect='No runtime effect on GPU. On CPU, `Fabric(accelerator="cpu", strategy="fsdp", devices=4)` sets up'
        " and trains.",
        behaviour='`Fabric(accelerator="cpu", strategy="fsdp")` no longer raises `You selected the FSDP strategy'
        " but FSDP is only available on GPU`.",
        lightning_edits=(_CPU_EDIT,),
    ),
    Step(
        slug="device-checks",
        title="Refuse launches that put two ranks on one device; `init_module` on the rank's own GPU",
        carries=(
            f"{_SRC}/devices.py",
            f"{_SRC}/strategy.py::FSDPStrategy.setup_environment",
            f"{_SRC}/strategy.py::FSDPStrategy.module_init_context",
            f"{_SRC}/model_parallel.py::ModelParallelStrategy.setup_environment",
            f"{_SRC}/model_parallel.py::ModelParallelStrategy._setup_distributed",
            f"{_SRC}/model_parallel.py::ModelParallelStrategy.module_init_context",
            f"{_TESTS}/__init__.py",
            f"{_TESTS}/conftest.py",
            f"{_TESTS}/helpers/__init__.py",
            f"{_TESTS}/helpers/distributed.py",
            f"{_TESTS}/helpers/env.py",
            f"{_TESTS}/helpers/models.py",
            f"{_TESTS}/helpers/runif.py",
            f"{_TESTS}/test_devices.py",
            "CHANGELOG.md::Fixed `FSDPStrategy` and `ModelParallelStrategy` putting tensors",
        ),
        issue="Lightning-AI/pytorch-lightning#18008 (memory on `cuda:0` during setup on a multi-node FSDP run).",
        motivation="With an inconsistent cluster environment (a launcher's `LOCAL_RANK` missing or contradicting"
        " SLURM's, more ranks per node than devices), every rank of a node can select `cuda:0`, and"
        " `fabric.init_module()` creates tensors on the current device, which is `cuda:0` on every rank unless"
        " something set it. The strategies now check the environment before they select a device, check across"
        " ranks that no two share a node slot or a physical GPU before the device mesh is built, and make the"
        " rank's own GPU current inside `init_module`.",
        effect="No measurable cost: the checks read environment variables and exchange one small object per rank"
        " with the process group that `setup_environment` creates anyway.",
        size="About 450 source lines, 370 of them the launch checks in `strategies/parallel.py`: most are the"
        " messages, which name every value read and the launcher it came from.",
        behaviour="A launch that would put two ranks on one device raises a `RuntimeError` naming the values read"
        " and where they come from, on every rank, instead of running (and running out of memory) on `cuda:0`.",
    ),
    Step(
        slug="checkpoint-readers",
        title="Add validated readers for checkpoint files (unused until the next step)",
        carries=(
            f"{_SRC}/loading/__init__.py",
            f"{_SRC}/loading/errors.py",
            f"{_SRC}/loading/files.py",
            f"{_SRC}/loading/zip_records.py",
            f"{_SRC}/loading/torch_pickle.py",
            f"{_SRC}/loading/legacy.py",
            f"{_SRC}/loading/safetensors_header.py",
            f"{_SRC}/loading/sources.py",
            f"{_SRC}/loading/formats.py",
            f"{_SRC}/loading/validation.py",
            f"{_TESTS}/helpers/checkpoints.py",
            f"{_TESTS}/loading/__init__.py",
            f"{_TESTS}/loading/test_formats.py",
        ),
        issue="Lightning-AI/pytorch-lightning#8043 (CPU memory of loading full checkpoints); the readers that the"
        " shard-local loader of the next step reads byte ranges with.",
        motivation="To copy only each rank's slice of a tensor out of a checkpoint file, the loader must know where"
        " the tensor's bytes are. These private helpers read that from the file's own structure (the zip central"
        " directory and local headers, a weights-only walk of `data.pkl`, the legacy format's pickles, the"
        " safetensors header, a Hugging Face `*.index.json`), by positioned reads (storage other than the local"
        " file system can serve the same reads behind `StoragePath`), check every offset against the tensor it feeds"
        " (dtype x shape = bytes, in bounds, no overlap), and validate a checkpoint's names, shapes and dtypes"
        " against a model before anything is written.",
        effect="None yet (unused until the next step). The readers' tests write every format with `torch.save`,"
        " `safetensors` and the legacy serialisation and read them back, and refuse truncated and malformed files.",
        size="About 2,500 source lines: one reader per format, each proven against the file's structure. They are"
        " private and unused until the next step; a reviewer may ask to split them by format (zip, legacy,"
        " safetensors), which the manifest supports (it assigns single definitions).",
    ),
    Step(
        slug="node-turns",
        title="Add node turns and an agreement between ranks for checkpoint loads (unused until the next step)",
        carries=(
            f"{_SRC}/loading/agreement.py",
            f"{_SRC}/loading/memory.py",
            f"{_SRC}/loading/progress.py",
            f"{_SRC}/loading/turns.py",
            f"{_TESTS}/loading/test_agreement.py",
            f"{_TESTS}/loading/test_memory.py",
            f"{_TESTS}/loading/test_progress.py",
            f"{_TESTS}/loading/test_turns.py",
        ),
        issue="Lightning-AI/pytorch-lightning#18138 (closed: the local ranks of a node load a full checkpoint one"
        " after the other, to avoid CPU OOM), #18008.",
        motivation="A source that must be materialised whole in host memory (a pickle that may hold any object, read"
        " with `weights_only=False`) costs one full copy per rank when every rank of a node reads it at once. These"
        " private helpers let at most `k` ranks of a node hold one at a time (`k` from the caller, or from the"
        " memory the node has free), without a collective inside a turn (FSDP's unshard is one: a waiting rank"
        " would deadlock it) and without tripping the process group's timeout while a rank waits. Between turns"
        " and at the end the ranks agree on success through the store: if any rank failed, every rank raises the"
        " same error, quickly, naming the failing rank; a rank that died is noticed by the others in seconds.",
        effect="None yet (unused until the next step). With it, from benchmarks/README.md (1.07 GB legacy-format"
        " checkpoint read whole with `weights_only=False`, 4 CPU ranks): peak memory +1.08 GB above base with"
        " `k=1` against +4.30 GB with all four ranks at once (upstream: +5.30 GB), in 5.12 s against 2.46 s.",
        size="About 1,260 source lines, most in the agreement (every rank returns or every rank raises, with"
        " heartbeats, for every store type and with bounded waits), which the loader of the next step needs whole.",
    ),
    Step(
        slug="fsdp-shard-local-loading",
        title="Load raw, safetensors and Hugging Face checkpoints shard-locally in `FSDPStrategy.load_checkpoint`",
        carries=(
            f"{_SRC}/loading/*.py",
            f"{_SRC}/loading_calls.py",
            f"{_SRC}/strategy.py",
            f"{_TESTS}/helpers/*",
            f"{_TESTS}/loading/*",
            f"{_TESTS}/test_*.py",
            f"{_TESTS}/loading/test_formats.py::test_shards_are_read_straight_into_the_parameter",
            f"{_TESTS}/loading/test_turns.py::_slow_turns_under_short_timeout",
            f"{_TESTS}/loading/test_turns.py::test_slow_turns_do_not_trip_a_short_process_group_timeout",
            f"{_TESTS}/loading/test_turns.py::test_invalid_concurrency",
            f"{_DOCS}/guide/*",
            f"{_DOCS}/examples/*",
            "CHANGELOG.md::Added support for loading raw module state dicts",
            "CHANGELOG.md::Added the `load_concurrency` and `load_progress` arguments",
        ),
        issue="Lightning-AI/pytorch-lightning#18008 (`KeyError: 'model'` and one full copy per rank when loading a"
        " converted checkpoint into FSDP), #8043 (CPU OOM of full checkpoints).",
        motivation='`fabric.load(path, {"model": model})` on a file that holds only a module\'s state dict (a'
        " converted `lit-llama.pth`, `pytorch_model.bin`) raises `KeyError: 'model'`, and a full checkpoint with"
        " optimizer state is materialised on every rank. `load_checkpoint` now tells the format from the content,"
        " validates names, shapes and dtypes on every rank before writing, and copies each rank's slices of the"
        " parameters and of the optimizer state into its FSDP shards, reading only those bytes. Pickles that must"
        " be read whole (`weights_only=False`) are read by at most `load_concurrency` ranks of a node at a time;"
        " an error on any rank is raised on every rank. A remote path (an fsspec URL) is still loaded by the method"
        " this one replaces, kept as `_default_load_checkpoint`, until the last pull request of this series reads it"
        " by byte ranges too.",
        effect="From benchmarks/README.md (1.07 GB model, 4 CPU ranks, gloo, cold cache): a full checkpoint with"
        " Adam state (3.22 GB) loads in 2.75 s instead of 14.10 s, peak memory of all ranks +2.15 GB above base"
        " instead of +10.27 GB, storage read per node 3.22 GB instead of 12.89 GB; a raw zip file loads in 1.07 s"
        " instead of 4.79 s with +1.8 MB instead of +1.90 GB; safetensors and Hugging Face indexes (not supported"
        " before) load in 0.87 s and 0.96 s with +1.4 MB.",
        behaviour="`fabric.load` and `fabric.load_raw` accept raw state dicts, `.safetensors` files and Hugging Face"
        " indexes. `weights_only=None` means `True` for every file the method reads; `meta.pt` of a sharded"
        ' checkpoint is read with `map_location="cpu"`. An empty or truncated file raises `CheckpointLoadError`'
        " (a `ValueError` where upstream raised one). New arguments `load_concurrency` and `load_progress`. A remote"
        " path is loaded as before.",
        size="About 3,400 source lines, because `load_checkpoint` is one method and the loader it calls (`load`)"
        " reaches every part of it: the FSDP1 and FSDP2 layouts, the optimizer's slices and the sharded branch. A"
        " finer split needs `load` itself cut into versions, which the manifest does not do (it assigns whole"
        " definitions).",
        lightning_edits=_EMPTY_FILE_EDITS,
    ),
    Step(
        slug="fsdp2-shard-local-loading",
        title="Shard-local loading and meta-device materialisation in `ModelParallelStrategy`",
        carries=(
            f"{_SRC}/model_parallel.py",
            f"{_TESTS}/test_fsdp2.py",
            f"{_TESTS}/test_fsdp2_meta_init.py",
            # Test files that also run `ModelParallelStrategy`'s loading come with it.
            f"{_TESTS}/test_load_against_upstream.py",
            f"{_TESTS}/test_load_sharded_hostile.py",
            f"{_TESTS}/test_moe.py",
            f"{_TESTS}/test_peft.py",
            f"{_TESTS}/test_single_gpu.py",
            f"{_TESTS}/test_two_nodes.py",
            f"{_TESTS}/scripts/two_nodes_worker.py",
            f"{_TESTS}/test_devices.py::test_model_parallel_setup_module_checks_placement_around_parallelize_fn",
            f"{_DOCS}/guide/fsdp2.rst",
            f"{_DOCS}/examples/fsdp2_load.py",
            "CHANGELOG.md::Added shard-local loading of full and raw checkpoints to `ModelParallelStrategy",
            "CHANGELOG.md::Fixed `ModelParallelStrategy` leaving tensors",
        ),
        issue="FSDP2 counterpart of the previous step; no upstream issue yet (to be opened with this PR).",
        motivation="`ModelParallelStrategy` loads a full checkpoint with `torch.load` on every rank and one"
        " `set_model_state_dict(broadcast_from_rank0=True)` per parameter. It now goes through the same loader as"
        " `FSDPStrategy`: each rank copies its own ranges of every `DTensor` (FSDP2, HSDP, TP, FSDP x TP) with no"
        " broadcast. A model created on the meta device is materialised as local shards and initialised by its"
        " own initialisation (RMSNorm weights, RoPE's `inv_freq` were left uninitialised).",
        effect="From benchmarks/README.md (FSDP2 rows): a full checkpoint with Adam state loads in 2.29 s instead of"
        " 9.56 s, +2.15 GB above base instead of +5.71 GB; a raw zip file in 0.72 s instead of 3.30 s, +1.5 MB"
        " instead of +1.21 GB.",
        behaviour="`setup_module` initialises a meta model with its own initialisation; tensors that nothing wrote"
        " are NaN and the load that leaves them unwritten warns, naming them.",
        lightning_edits=_MODEL_PARALLEL_EDITS,
    ),
    Step(
        slug="remote-byte-ranges",
        title="Read remote checkpoints by byte ranges, each rank its own",
        carries=(
            f"{_SRC}/loading/remote.py",
            f"{_SRC}/loading_calls.py::checkpoint_path",
            f"{_TESTS}/helpers/object_store.py",
            f"{_TESTS}/loading/test_remote.py",
            f"{_DOCS}/guide/object_storage.rst",
            "CHANGELOG.md::Changed `FSDPStrategy.load_checkpoint` and `ModelParallelStrategy.load_checkpoint` to read",
        ),
        issue="Lightning-AI/pytorch-lightning#21868 (parallel downloads of a remote checkpoint, without a full copy);"
        " the review of #21775.",
        motivation="#21775 and #21821 let both strategies load from remote storage (fsspec URLs): a remote full"
        " checkpoint is read whole into memory on every rank through `cloud_io._load`, with `weights_only=False` by"
        " default; the review of #21775 asked for better, and #21868 asks for parallel downloads without a full"
        " copy. The readers of the previous pull requests ask a path for byte ranges; this one serves them from"
        " object storage through fsspec (`StoragePath`), so a remote file takes the same shard-local loader as a local"
        " one: each rank fetches only the structures that locate its slices (the zip directory and local headers, the"
        " safetensors header, the pickles) and its own slices, by range requests, straight into its shards. A large"
        " range is fetched as 8 MiB chunks by up to 8 concurrent requests per rank, small reads come from cached"
        " 64 KiB blocks, failed requests are retried with bounded backoff, and the size and ETag of each object are"
        " pinned, so an object replaced during the load is an error on every rank. `load_options(storage_options=...)`"
        " passes the file system's options; credentials never appear in a message."
        " A remote sharded directory goes through the same validated reader as a local one (its `.metadata` through"
        " the allow-list, `meta.pt` weights-only), each rank fetching exactly the byte ranges of its own entries, never"
        " through DCP's fsspec reader, which would unpickle its metadata unchecked.",
        effect="From benchmarks/README.md (moto's S3 server on loopback, 2 CPU ranks on one node, FSDP1, the `small`"
        " size): the node's ranks together fetch 33.7 MB for a 33.6 MB safetensors file, 34.7 MB for a 33.6 MB"
        " torch zip file and 0.10 GB for a 0.10 GB full checkpoint with Adam state: one copy per node, each rank its"
        " own slices. Anonymous memory above base is about +59 MB for the two ranks (+0.2 MB for the same load from"
        " a local file), the same for the zip and the safetensors file. The load times there are moto's (it copies"
        " the whole object for every ranged request) and say nothing about a real store; master's `cloud_io._load`"
        " was not measured as a remote row.",
        behaviour="A remote file is read with `weights_only=True` unless `weights_only=False` is passed (master:"
        " `False` by default for remote files), and shard-locally instead of whole on every rank. A remote sharded"
        " directory is read by the validated reader instead of DCP's fsspec reader: a `.metadata` or `meta.pt` that"
        " holds anything but plain data raises `CheckpointLoadError`."
        " `load_options` takes `storage_options`.",
        lightning_edits=_REMOTE_EDITS,
        interims=_REMOTE_INTERIMS,
    ),
)


@dataclass
class _Assignment:
    """Which step carries each file and each definition, as the manifest says."""

    files: dict[str, int] = field(default_factory=dict)
    definitions: dict[tuple[str, str], int] = field(default_factory=dict)
    interims: list[tuple[int, Interim]] = field(default_factory=list)
    """Each interim with the step that lists it."""
    problems: list[str] = field(default_factory=list)

    def step_of(self, path: str, key: str | None = None) -> int:
        if key is not None and (path, key) in self.definitions:
            return self.definitions[(path, key)]
        return self.files[path]


def definition_keys(path: str, text: str) -> Iterator[tuple[str, ast.stmt, ast.ClassDef | None]]:
    """The named definitions of a Python file that the manifest can assign: ``Name`` or ``Class.member``.

    Members are keys only in a class that is merged into upstream's class (its base is upstream's).

    """
    tree = ast.parse(text)
    merged = upstream_base(text, path) if path.startswith(_SRC) else None
    for node in tree.body:
        if node is docstring_node(tree.body) or isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if is_type_checking_block(node):
            continue
        if isinstance(node, ast.ClassDef) and merged is not None and node.name == merged[1]:
            for member in node.body:
                if member is docstring_node(node.body):
                    continue
                names = [member.name] if isinstance(member, ast.FunctionDef) else bound_names(member)
                if names:
                    yield f"{node.name}.{names[0]}", member, node
            continue
        names = bound_names(node)
        if names:
            yield names[0], node, None


def _manifest_items() -> list[tuple[str, str]]:
    """Every (path, text) that the one-shot command considers, as :func:`plan` hands them to its restriction."""
    seen: list[tuple[str, str]] = []

    def record(path: str, text: str) -> str:
        seen.append((path, text))
        return text

    with tempfile.TemporaryDirectory(prefix="series-manifest-") as directory:
        plan(reference_tree(Path(directory)), record)
    return seen


def reference_tree(root: Path) -> Path:
    """A tree for enumerating what the command carries: the installed release's layout, tests and docs included."""
    import lightning

    shutil.copytree(
        Path(lightning.__file__).parent, root / "src" / "lightning", ignore=shutil.ignore_patterns("__pycache__")
    )
    (root / "src" / "version.info").write_text(lightning.__version__)
    for package in ("tests/tests_fabric", "tests/tests_fabric/utilities"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    (root / "docs" / "source-fabric").mkdir(parents=True)
    return root


def assign(items: list[tuple[str, str]], steps: tuple[Step, ...] = STEPS) -> _Assignment:
    """Assign every item to one step; record what is carried twice, not at all, or named but absent."""
    result = _Assignment()
    exact: dict[str, list[int]] = {}
    globs: list[tuple[str, int]] = []
    definitions: dict[tuple[str, str], list[int]] = {}
    for number, step in enumerate(steps, 1):
        for entry in step.carries:
            if "::" in entry:
                path, key = entry.split("::", 1)
                definitions.setdefault((path, key), []).append(number)
            elif any(character in entry for character in "*?["):
                globs.append((entry, number))
            else:
                exact.setdefault(entry, []).append(number)
    used: set[str] = set()
    for path, text in items:
        if path == "CHANGELOG.md":
            matches = [
                (prefix, number)
                for (file, prefix), numbers in definitions.items()
                if file == path
                for number in numbers
                if text.startswith(prefix)
            ]
            used |= {f"{path}::{prefix}" for prefix, _ in matches}
            if len(matches) != 1:
                result.problems.append(f"CHANGELOG entry {text[:60]!r}... is carried by {len(matches)} steps")
            else:
                result.definitions[(path, text)] = matches[0][1]
            continue
        if path in exact:
            numbers = exact[path]
            used.add(path)
        else:
            numbers = [number for pattern, number in globs if fnmatch.fnmatchcase(path, pattern)]
            used |= {pattern for pattern, _ in globs if fnmatch.fnmatchcase(path, pattern)}
        if len(numbers) != 1:
            result.problems.append(f"{path} is carried by {len(numbers)} steps (exactly one must carry the file)")
            continue
        result.files[path] = numbers[0]
        if path.endswith(".py"):
            for key, _, _ in definition_keys(path, text):
                if (path, key) in definitions:
                    used.add(f"{path}::{key}")
                    if len(definitions[(path, key)]) != 1:
                        result.problems.append(f"{path}::{key} is carried by {len(definitions[(path, key)])} steps")
                    result.definitions[(path, key)] = definitions[(path, key)][0]
    named = {entry for step in steps for entry in step.carries}
    for entry in sorted(named - used):
        result.problems.append(f"the manifest names `{entry}`, which the change does not carry")
    texts = dict(items)
    for number, step in enumerate(steps, 1):
        for interim in step.interims:
            found = texts.get(interim.file, "").count(interim.final)
            if found != 1:
                result.problems.append(
                    f"step {number}: the lines of {interim.file} that read otherwise before it were found {found} times"
                    " there (the file changed): update its `Interim`"
                )
            else:
                result.interims.append((number, interim))
    return result


def restriction(assignment: _Assignment, upto: int) -> Restriction:
    """The restriction of :func:`plan` to steps ``1..upto``; it records uses of names that a later step brings."""
    problems: list[str] = []

    def restrict(path: str, text: str) -> str | None:
        if path == "connector":
            return text if assignment.files.get(path, upto + 1) <= upto else None
        if path == "CHANGELOG.md":
            return text if assignment.definitions.get((path, text), upto + 1) <= upto else None
        file_step = assignment.files[path]
        text = _before(path, text, [interim for number, interim in assignment.interims if number > upto])
        if not path.endswith(".py"):
            return text if file_step <= upto else None
        keys = list(definition_keys(path, text))
        later = [(key, node, cls) for key, node, cls in keys if assignment.step_of(path, key) > upto]
        kept_any = any(assignment.step_of(path, key) <= upto for key, _, _ in keys)
        if file_step > upto and not kept_any:
            return None
        if not later:
            return text
        restricted, removed_names = _remove(Source(text, path), later, keys)
        used = _used_names(restricted)
        attributes = {
            node.attr
            for node in ast.walk(ast.parse(restricted))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        }
        for key in sorted(removed_names & used):
            problems.append(f"step {upto}: {path} uses `{key}`, which step {assignment.step_of(path, key)} brings")
        for key, _, cls in later:
            if cls is not None and key.split(".", 1)[1] in attributes:
                problems.append(f"step {upto}: {path} uses `self.{key.split('.', 1)[1]}`, which a later step brings")
        return restricted

    restrict.problems = problems  # type: ignore[attr-defined]
    return restrict


def _before(path: str, text: str, interims: list[Interim]) -> str:
    """``text`` as it reads before the steps of ``interims``, without the imports that only their final lines used."""
    edited = text
    for interim in interims:
        if interim.file == path:
            edited = edited.replace(interim.final, interim.interim, 1)
    if edited == text or not path.endswith(".py"):
        return edited
    return drop_unused_imports(text, edited, path)


def _remove(source: Source, later: list, keys: list) -> tuple[str, set[str]]:
    """Remove the later steps' definitions and the imports that only they used."""
    edits = []
    removed_names: set[str] = set()
    removed_members: dict[int, int] = {}
    classes: dict[int, ast.ClassDef] = {}
    for key, _node, cls in later:
        if cls is not None:
            removed_members[id(cls)] = removed_members.get(id(cls), 0) + 1
            classes[id(cls)] = cls
        else:
            removed_names.add(key)
    members_of = {id(cls): sum(1 for _, _, owner in keys if owner is cls) for cls in classes.values()}
    for _key, node, cls in later:
        if cls is not None and removed_members[id(cls)] == members_of[id(cls)]:
            continue  # the whole class goes below
        edits.append(Edit(*source.block(node), ""))
    for class_id, cls in classes.items():
        if removed_members[class_id] == members_of[class_id]:
            edits.append(Edit(*source.block(cls), ""))
            removed_names.add(cls.name)
    removed_text = "\n".join(textwrap.dedent(source.block_text(node)) for _, node, _ in later)
    text = apply_edits(source.text, edits)
    unused = _used_names(removed_text) - _used_names(text)
    pruned = Source(text, source.name)
    import_edits = []
    for node in pruned.tree.body:
        if is_type_checking_block(node):
            replacements = [_pruned_import(pruned, child, unused) for child in node.body]  # type: ignore[attr-defined]
            if all(replacement == "" for replacement in replacements):
                import_edits.append(Edit(*pruned.block(node), ""))
                continue
            import_edits += [
                Edit(*pruned.block(child), replacement)
                for child, replacement in zip(node.body, replacements, strict=True)  # type: ignore[attr-defined]
                if replacement is not None
            ]
        elif isinstance(node, ast.ImportFrom | ast.Import):
            replacement = _pruned_import(pruned, node, unused)
            if replacement is not None:
                import_edits.append(Edit(*pruned.block(node), replacement))
    text = apply_edits(text, import_edits)
    return re.sub(r"\n{4,}", "\n\n\n", text), removed_names


def _pruned_import(source: Source, node: ast.stmt, unused: set[str]) -> str | None:
    """An import without the names in ``unused`` (``""``: none left), or ``None`` when it keeps every name."""
    if not isinstance(node, ast.ImportFrom | ast.Import):
        return None
    dropped = [alias for alias in node.names if (alias.asname or alias.name).split(".")[0] in unused]
    if not dropped:
        return None
    kept = [alias for alias in node.names if alias not in dropped]
    indent = indentation(source.lines[node.lineno - 1])
    if not kept:
        return ""
    if isinstance(node, ast.ImportFrom) and node.module:
        names = [alias.name if alias.asname is None else f"{alias.name} as {alias.asname}" for alias in kept]
        return import_from_text(node.module, names, indent) + "\n"
    return "".join(
        f"{indent}import {alias.name}" + (f" as {alias.asname}" if alias.asname else "") + "\n" for alias in kept
    )


@dataclass
class Series:
    """The plans of every step (step ``k``: steps ``1..k``), checked, with the one-shot plan they add up to."""

    root: Path
    steps: tuple[Step, ...]
    plans: list[Plan]

    def step_changes(self, number: int) -> list[tuple[str, str | None, str]]:
        """(path, text before the step, text after it) of each file that step ``number`` (1-based) changes."""
        before = {change.path: change.new for change in self.plans[number - 2].changes} if number > 1 else {}
        changes = []
        for change in self.plans[number - 1].changes:
            old = before.get(change.path, change.old)
            if old != change.new:
                changes.append((change.path, old, change.new))
        return changes

    def counts(self, number: int) -> dict[str, tuple[int, int]]:
        """Lines added and removed by step ``number``, by kind: ``src``, ``tests``, ``docs`` (the CHANGELOG too)."""
        totals = {"src": (0, 0), "tests": (0, 0), "docs": (0, 0)}
        for path, old, new in self.step_changes(number):
            kind = "tests" if path.startswith("tests/") else "docs" if path.startswith("docs/") else "src"
            if path.endswith("CHANGELOG.md"):
                kind = "docs"
            added, removed = _diff_counts(old or "", new)
            totals[kind] = (totals[kind][0] + added, totals[kind][1] + removed)
        return totals

    def description(self, number: int) -> str:
        """The pull request's description, in Markdown."""
        step = self.steps[number - 1]
        total = len(self.steps)
        counts = self.counts(number)
        tests = sorted(
            path for path, _, _ in self.step_changes(number) if path.startswith("tests/") and "/test_" in path
        )
        lines = [
            f"# ({number}/{total}) {step.title}",
            "",
            "## Motivation",
            "",
            f"Answers: {step.issue}",
            "",
            step.motivation,
            "",
            "## What changes",
            "",
            *(f"- `{path}` (+{a}/-{r})" for path, a, r in self._file_counts(number)),
            "",
            "Lines changed: " + ", ".join(f"{kind} +{a}/-{r}" for kind, (a, r) in counts.items()) + ".",
            "",
            "## Measured effect",
            "",
            step.effect,
            "",
            "## Tests",
            "",
            *(f"- `{path}`" for path in tests),
            *(["- none of its own beyond Lightning's tests below"] if not tests else []),
            "",
            "Lightning's `tests_fabric` strategy tests pass after this step"
            + (", with these edited on purpose:\n" if step.lightning_edits else "."),
            *(f"- `{edit.node_id}`: {edit.reason}" for edit in step.lightning_edits),
            "",
            "## Behaviour changes",
            "",
            step.behaviour,
        ]
        if step.size:
            lines += ["", "## Size", "", step.size]
        if number > 1:
            lines += ["", f"Depends on ({number - 1}/{total})."]
        text = "\n".join(lines) + "\n"
        if _PACKAGE_NAMES.search(text):
            raise UpstreamError(f"the description of step {number} names the package")
        return text

    def _file_counts(self, number: int) -> list[tuple[str, int, int]]:
        return [(path, *_diff_counts(old or "", new)) for path, old, new in sorted(self.step_changes(number))]

    def commit(self, descriptions: Path | None = None) -> list[str]:
        """Commit every step onto the tree's current branch; write the descriptions; return the commit hashes."""
        check_clean_checkout(self.root)
        hashes = []
        total = len(self.steps)
        for number, step in enumerate(self.steps, 1):
            description = self.description(number)
            for path, _, new in self.step_changes(number):
                target = self.root / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(new)
            _git(self.root, "add", "--", *(path for path, _, _ in self.step_changes(number)))
            body = description.split("\n", 2)[2]  # the title is the commit's subject
            _git(self.root, "commit", "--quiet", "-m", f"({number}/{total}) {step.title}", "-m", body)
            hashes.append(_git(self.root, "rev-parse", "HEAD").strip())
            if descriptions is not None:
                descriptions.mkdir(parents=True, exist_ok=True)
                (descriptions / f"{number:02d}-{step.slug}.md").write_text(description)
        return hashes


def check_clean_checkout(tree: Path) -> None:
    """Refuse a tree that is not a git checkout, or one with uncommitted changes to tracked files."""
    root = find_root(tree)
    _git(root, "rev-parse", "--is-inside-work-tree")
    if _git(root, "status", "--porcelain", "--untracked-files=no").strip():
        raise UpstreamError(f"{root} has uncommitted changes: commit or discard them before `--series`.")


def _diff_counts(old: str, new: str) -> tuple[int, int]:
    added = removed = 0
    for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0):
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed


def _git(root: Path, *args: str) -> str:
    completed = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    if completed.returncode != 0:
        raise UpstreamError(
            f"`git {' '.join(args[:2])}` in {root} failed: {completed.stderr.strip()}. `--series` needs a git checkout"
            " of Lightning (and a git identity to commit with)."
        )
    return completed.stdout


def series(tree: Path, steps: tuple[Step, ...] = STEPS) -> Series:
    """Plan every step of the series on ``tree`` and check it; raise :class:`UpstreamError` before writing."""
    root = find_root(tree)
    assignment = assign(_manifest_items(), steps)
    if assignment.problems:
        raise UpstreamError("the series' manifest does not match the change:\n" + _listed(assignment.problems))
    plans = []
    problems: list[str] = []
    for number in range(1, len(steps) + 1):
        restrict = restriction(assignment, number)
        plans.append(plan(root, restrict))
        problems += restrict.problems  # type: ignore[attr-defined]
    one_shot = plan(root)
    last = {change.path: change.new for change in plans[-1].changes}
    whole = {change.path: change.new for change in one_shot.changes}
    if last != whole:
        differing = sorted(path for path in last.keys() | whole.keys() if last.get(path) != whole.get(path))
        problems.append("the last step is not the one-shot change: " + ", ".join(differing[:10]))
    for number in range(1, len(steps) + 1):
        edits = [edit for step in steps[:number] for edit in step.lightning_edits]
        plans[number - 1].changes += _edited_tests(root, edits, plans[number - 1].notes)
    # What the one-shot change leaves unresolved is a note for a maintainer (``--notes``), not a step's fault.
    known = set(unresolved_imports(root, one_shot))
    for number, step_plan in enumerate(plans, 1):
        problems += [
            f"step {number}: {problem}" for problem in unresolved_imports(root, step_plan) if problem not in known
        ]
    if problems:
        raise UpstreamError("the series is not consistent:\n" + _listed(problems))
    return Series(root, steps, plans)


def _edited_tests(root: Path, edits: list[LightningEdit], notes: list[str]) -> list[Change]:
    """Lightning's test files with ``edits`` made, each edit inside its test and found there exactly once.

    A tree without the test file (an sdist has no tests) gets a note instead.

    """
    by_file: dict[str, list[LightningEdit]] = {}
    for edit in edits:
        by_file.setdefault(edit.file, []).append(edit)
    changes = []
    for file, file_edits in sorted(by_file.items()):
        path = f"tests/{file}"
        if not (root / path).is_file():
            notes.append(f"not edited: {path} ({', '.join(edit.test for edit in file_edits)}), which the tree lacks")
            continue
        original = (root / path).read_text()
        source = Source(original, path)
        text_edits = []
        for edit in file_edits:
            test = next(
                (node for node in source.tree.body if isinstance(node, ast.FunctionDef) and node.name == edit.test),
                None,
            )
            start, end = source.block(test) if test is not None else (0, 0)
            found = original.count(edit.old, start, end)
            if found != 1:
                raise UpstreamError(
                    f"{path}: the lines of `{edit.test}` that the series edits were found {found} times in the test"
                    " (the tree's test changed): update the edit in `lightning_fsdp/upstream/_series.py`."
                )
            offset = original.index(edit.old, start, end)
            text_edits.append(Edit(offset, offset + len(edit.old), edit.new))
        changes.append(Change(path, original, apply_edits(original, text_edits), "Lightning's tests, edited"))
    return changes


def _listed(problems: list[str]) -> str:
    return "\n".join(f"  - {problem}" for problem in problems)


def unresolved_imports(root: Path, step_plan: Plan) -> list[str]:
    """Imports in the files a step writes of modules or names that the tree after the step does not have.

    Only Lightning's modules (``lightning.*``) and its tests (``tests_fabric.*``) are checked; ``literalinclude``
    paths of the guide's pages must exist too.

    """
    written = {change.path: change.new for change in step_plan.changes}

    def module_text(module: str) -> tuple[str | None, bool]:
        base = ("src/" if module.startswith("lightning") else "tests/") + module.replace(".", "/")
        for candidate, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
            if candidate in written:
                return written[candidate], is_package
            if (root / candidate).is_file():
                return (root / candidate).read_text(), is_package
        return None, False

    problems: list[str] = []
    for path, text in sorted(written.items()):
        if path.endswith(".rst"):
            for match in re.finditer(r"^\s*\.\. literalinclude:: (\S+)", text, re.MULTILINE):
                included = (Path(path).parent / match.group(1)).as_posix()
                normalized = Path(*[part for part in Path(included).parts]).as_posix()
                resolved = str(Path("/" + normalized).resolve())[1:]
                if resolved not in written and not (root / resolved).is_file():
                    problems.append(f"{path} includes {match.group(1)}, which the tree does not have")
            continue
        if not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(text)):
            modules: list[tuple[str, list[str]]] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules.append((node.module, [alias.name for alias in node.names]))
            elif isinstance(node, ast.Import):
                modules += [(alias.name, []) for alias in node.names]
            for module, names in modules:
                if not module.startswith(("lightning.", "tests_fabric.")):
                    continue
                found, is_package = module_text(module)
                if found is None:
                    problems.append(f"{path}:{node.lineno} imports `{module}`, which the tree does not have")
                    continue
                defined = _top_level_names(found)
                for name in names:
                    if name == "*" or name in defined:
                        continue
                    if is_package and module_text(f"{module}.{name}")[0] is not None:
                        continue
                    problems.append(f"{path}:{node.lineno} imports `{name}` from `{module}`, which does not define it")
    return list(dict.fromkeys(problems))


def _top_level_names(text: str) -> set[str]:
    names: set[str] = set()
    pending = list(ast.parse(text).body)
    while pending:
        node = pending.pop()
        names.update(bound_names(node))
        if isinstance(node, ast.If | ast.Try):
            pending += node.body + node.orelse
            if isinstance(node, ast.Try):
                pending += [statement for handler in node.handlers for statement in handler.body]
                pending += node.finalbody
    return names
