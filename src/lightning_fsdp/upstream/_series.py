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
Lines of ours may read otherwise in the steps before the one that completes them (:class:`EarlierForm`): a definition
that an earlier step needs comes in an earlier form, and lines that a later step changes read as they did before it.
Before anything is written, the series is checked: the manifest covers everything the one-shot command
writes, once; the union of the steps is the one-shot change; and no step uses a name that only a later step provides.
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

from lightning_fsdp.upstream._apply import Change, Plan, Restriction, destinations, find_root, plan
from lightning_fsdp.upstream._merge import _used_names, drop_unused_imports, upstream_base
from lightning_fsdp.upstream._rewrite import PACKAGE_NAME, import_from_text
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


@dataclass(frozen=True)
class Step:
    """One pull request of the series.

    ``carries`` lists what it brings: a path of this project (a glob: the whole file), ``path::Name`` or
    ``path::Class.member`` (one definition of a Python file; the rest of the file stays with the step that carries
    the file), ``CHANGELOG.md::<start of an entry>``, or ``connector`` (the connector's GPU-only check removed).
    ``lightning_edits`` are the edits of Lightning's own tests that this step makes on purpose, with the reason;
    ``earlier_forms`` are lines of ours as they read from this step until the step that completes them.

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
    earlier_forms: tuple["EarlierForm", ...] = ()


@dataclass(frozen=True)
class EarlierForm:
    """Lines of ours as they read before the step that completes them: ``old`` reads ``new`` there.

    ``where`` is a definition (``path::Name`` or ``path::Class.member``, as in ``Step.carries``: ``old`` is inside it)
    or a file (``path``: ``old`` is anywhere in it, an import or a guide page's paragraph). The form holds from the
    step that gives it until the step that carries ``until`` (a manifest entry; by default ``where``), which completes
    it; a definition that a later step carries is brought by a form of it. Forms that end at the same step apply
    together, and a later step's replace an earlier step's; forms that end later apply first, so ``old`` is written
    against the lines as they read until then. Only our replacement text is stored: ``old`` must be found exactly
    once, so a change of ours that moves or edits those lines stops the series. Imports that only ``old`` used are
    left out where the form holds.

    """

    where: str
    old: str
    new: str
    reason: str
    until: str = ""

    @property
    def path(self) -> str:
        return self.where.split("::", 1)[0]

    @property
    def name(self) -> str:
        """The definition's name, or the file's path for a form of lines anywhere in the file."""
        return self.where.split("::", 1)[-1]

    @property
    def completed_by(self) -> str:
        return self.until or self.where


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
_LOADER = f"{_SRC}/loading/loader.py"
_STRATEGY = f"{_SRC}/strategy.py"
_MODEL_PARALLEL = f"{_SRC}/model_parallel.py"
_REMOTE = f"{_SRC}/loading/remote.py"
_REMOTE_REASON = (
    "a remote path (an fsspec URL) is loaded as before, by the method that `load_checkpoint` replaces (kept as"
    " `_default_load_checkpoint`), until the step that reads it by byte ranges."
)


def _until_remote(where: str, old: str, new: str) -> EarlierForm:
    """Lines of ours as they read before the remote reader: remote paths take master's branch."""
    return EarlierForm(where, old, new, _REMOTE_REASON, until=_REMOTE)


_LOCAL_ONLY_IMPORT = "from lightning.fabric.utilities.cloud_io import _is_local_file_protocol\n"
_REMOTE_DISPATCH = """\
        if not _is_local_file_protocol(path):
            # Remote storage is read as before (whole, through `cloud_io`) until the loader reads it by byte ranges.
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
"""
_REMOTE_DOCSTRING = """\
        A remote path (an fsspec URL such as ``s3://...``) is loaded as before, by ``_default_load_checkpoint``.
"""


def _load_options_without_storage_options(definition: str) -> tuple[EarlierForm, ...]:
    """A strategy's ``load_options`` before the remote step: without ``storage_options``."""
    return (
        _until_remote(
            definition,
            """    def load_options(
        self,
        rename: Rename | None = None,
        storage_options: dict[str, Any] | None = None,
        request_timeout: float | None = None,
        stall_timeout: float | None = None,
    ) -> AbstractContextManager:
""",
            "    def load_options(self, rename: Rename | None = None) -> AbstractContextManager:\n",
        ),
        _until_remote(
            definition,
            "        return load_options(self, rename, storage_options, request_timeout, stall_timeout)\n",
            "        return load_options(self, rename)\n",
        ),
    )


#: Where each strategy's ``load_checkpoint`` first comes (in an earlier form), and the file's imports with it.
_FSDP_REMOTE_FORMS = (
    _until_remote(
        _STRATEGY,
        "from lightning.fabric.strategies.strategy import _apply_filter\n",
        "from lightning.fabric.strategies.strategy import _apply_filter\n" + _LOCAL_ONLY_IMPORT,
    ),
    _until_remote(
        f"{_STRATEGY}::FSDPStrategy.load_checkpoint",
        """\
        A remote file (an fsspec URL such as ``s3://...``, with the ``storage_options`` of :meth:`load_options`) is
        read the same way, each rank fetching only its own byte ranges; a remote sharded directory too, by the same
        validated reader.
""",
        _REMOTE_DOCSTRING,
    ),
    _until_remote(
        f"{_STRATEGY}::FSDPStrategy.load_checkpoint",
        "        state, module_key = _checked_state(state)\n",
        _REMOTE_DISPATCH + "        state, module_key = _checked_state(state)\n",
    ),
)
_FSDP_LOAD_OPTIONS_REMOTE_FORMS = (
    *_load_options_without_storage_options(f"{_STRATEGY}::FSDPStrategy.load_options"),
    _until_remote(
        f"{_STRATEGY}::FSDPStrategy.load_options",
        """
            storage_options: Options of the fsspec file system that reads a checkpoint URL (``s3://...``), such as
                ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for ``s3fs``. By default fsspec's usual
                configuration applies (environment variables, the provider's config files).

            request_timeout: Object storage only: seconds after which a request that has received nothing (no
                answer, or no byte of its body) is abandoned and retried. Default: 30.

            stall_timeout: Object storage only: seconds after which a rank whose requests have received no byte,
                retries included, ends the load with a :class:`~lightning_fsdp.CheckpointLoadError` on every rank
                naming the object and the range. Default: 60.
""",
        "",
    ),
    _until_remote(
        f"{_STRATEGY}::FSDPStrategy.load_options",
        """or a callable, or ``storage_options`` not a dict.
            ValueError: If a timeout is not a number of seconds greater than 0.
""",
        "or a callable.\n",
    ),
)
_MODEL_PARALLEL_REMOTE_FORMS = (
    _until_remote(
        _MODEL_PARALLEL,
        "from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers\n",
        "from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers\n" + _LOCAL_ONLY_IMPORT,
    ),
    _until_remote(
        f"{_MODEL_PARALLEL}::ModelParallelStrategy.load_checkpoint",
        """\
        A remote file (an fsspec URL such as ``s3://...``) is read the same way, each rank fetching only its own byte
        ranges; a remote sharded directory too, by the same validated reader.

        \"\"\"
""",
        _REMOTE_DOCSTRING + '\n        """\n' + _REMOTE_DISPATCH,
    ),
    *_load_options_without_storage_options(f"{_MODEL_PARALLEL}::ModelParallelStrategy.load_options"),
)
_GUIDE_REMOTE_FORM = _until_remote(
    f"{_DOCS}/guide/loading_large_checkpoints.rst",
    """\
Checkpoints in object storage (``s3://`` and other fsspec URLs) are read the same way, by byte ranges: see
:doc:`object_storage`.
""",
    "",
)
_CALLS = f"{_SRC}/loading_calls.py"
#: `loading_calls.py` without the storage options, and with a local path for every path.
_CALLS_REMOTE_FORMS = (
    _until_remote(
        f"{_CALLS}::LoadingStrategy",
        "    _load_storage_options: Mapping[str, Any] | None\n    _load_remote_timeouts: RemoteTimeouts\n",
        "",
    ),
    _until_remote(
        f"{_CALLS}::init_loading_options",
        "    strategy._load_storage_options = None\n    strategy._load_remote_timeouts = RemoteTimeouts()\n",
        "",
    ),
    _until_remote(
        f"{_CALLS}::broadcast_load_path",
        """        return checkpoint_path(strategy, start), new_namespace()
    return checkpoint_path(strategy, start.path), start.namespace
""",
        """        return Path(start), new_namespace()
    return Path(start.path), start.namespace
""",
    ),
    _until_remote(
        f"{_CALLS}::load_options",
        """def load_options(
    strategy: LoadingStrategy,
    rename: Rename | None,
    storage_options: Mapping[str, Any] | None = None,
    request_timeout: float | None = None,
    stall_timeout: float | None = None,
) -> Iterator[None]:
    \"\"\"Set the options of the loads inside the block on ``strategy``, and restore the previous ones after it.\"\"\"
    check_rename(rename)
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(
            f"`load_options(storage_options=...)` takes a dict of fsspec options, got {type(storage_options).__name__}."
        )
    for name, value in (("request_timeout", request_timeout), ("stall_timeout", stall_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"`load_options({name}=...)` takes a number of seconds greater than 0, got {value!r}.")
    defaults = RemoteTimeouts()
    timeouts = RemoteTimeouts(float(request_timeout or defaults.request), float(stall_timeout or defaults.stall))
    previous = strategy._load_rename, strategy._load_storage_options, strategy._load_remote_timeouts
    strategy._load_rename, strategy._load_storage_options, strategy._load_remote_timeouts = (
        rename,
        storage_options,
        timeouts,
    )
    try:
        yield
    finally:
        strategy._load_rename, strategy._load_storage_options, strategy._load_remote_timeouts = previous
""",
        """def load_options(strategy: LoadingStrategy, rename: Rename | None) -> Iterator[None]:
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

_SHARDED_UPSTREAM = "it is read as before, by the distributed checkpoint reader, until the step that validates it."
_SHARDED_DOCSTRING = "        A sharded directory is read as before, by the distributed checkpoint reader.\n"
#: Until the sharded reader lands, `load_checkpoint` hands a sharded checkpoint to upstream's own method.
_SHARDED_TO_UPSTREAM = """\
        path, namespace = broadcast_load_path(self, path)
        if not isinstance(state, Module) and _upstream._is_sharded_checkpoint(str(path)):
            # A sharded checkpoint is read as before, by the distributed checkpoint reader.
            return super().load_checkpoint(str(path), state, strict=strict, weights_only=weights_only)
"""
_LOAD_WITHOUT_SHARDED = EarlierForm(
    f"{_LOADER}::load",
    old="""\
        if detected.format is CheckpointFormat.FABRIC_SHARDED:
            result = _load_sharded(path, request, stagger)
        elif collected""",
    new="""\
        if detected.format is CheckpointFormat.FABRIC_SHARDED:
            raise CheckpointLoadError(
                f"{str(path)!r} is a sharded checkpoint, which the distributed checkpoint reader reads: load it with"
                " `fabric.load(path, {'model': model})`."
            )
        if collected""",
    reason="without the sharded branch: the strategies hand a sharded checkpoint to their upstream method until then.",
)
_LOAD_WITHOUT_UNINITIALIZED = EarlierForm(
    f"{_LOADER}::load",
    old="""\
    _warn_uninitialized(path, request.module, result.written)
""",
    new="",
    reason="without the warning about tensors that the meta-device materialisation left uninitialised.",
)
_PREPARE_WITHOUT_CONVERSIONS = EarlierForm(
    f"{_LOADER}::_prepare",
    old="""\
    source = with_declared_conversions(request.module, opened.source, targets)
""",
    new="""\
    source = opened.source
""",
    reason="without the model's declared conversions.",
)
_PREPARED_WITHOUT_CONVERSIONS = EarlierForm(
    f"{_LOADER}::_Prepared",
    old='''\
    """The checkpoint's tensors, with the model's declared conversions applied (see :mod:`.conversions`)."""
''',
    new='''\
    """The checkpoint's tensors."""
''',
    reason="without the model's declared conversions.",
)
_FSDP1_ONLY = "without the FSDP2 (`DTensor`) branch, which the step that loads into `ModelParallelStrategy` adds."
_FSDP_SHARDED_TO_UPSTREAM = (
    EarlierForm(
        f"{_STRATEGY}::FSDPStrategy.load_checkpoint",
        old="        path, namespace = broadcast_load_path(self, path)\n",
        new=_SHARDED_TO_UPSTREAM,
        reason=f"a sharded checkpoint goes to upstream's method: {_SHARDED_UPSTREAM}",
    ),
    EarlierForm(
        f"{_STRATEGY}::FSDPStrategy.load_checkpoint",
        old=_REMOTE_DOCSTRING,
        new=_SHARDED_DOCSTRING + _REMOTE_DOCSTRING,
        reason=f"a sharded checkpoint goes to upstream's method: {_SHARDED_UPSTREAM}",
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
            f"{_STRATEGY}::FSDPStrategy.setup_environment",
            f"{_STRATEGY}::FSDPStrategy.module_init_context",
            f"{_MODEL_PARALLEL}::ModelParallelStrategy.setup_environment",
            f"{_MODEL_PARALLEL}::ModelParallelStrategy._setup_distributed",
            f"{_MODEL_PARALLEL}::ModelParallelStrategy.module_init_context",
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
        slug="cpu-setup-and-save",
        title="`FSDPStrategy.setup_module` checks where the tensors are; a CPU model is wrapped and saved as on GPU",
        carries=(
            f"{_SRC}/loading/quiet.py",
            *(
                f"{_STRATEGY}::{name}"
                for name in (
                    "FSDPStrategy.module_sharded_context",
                    "FSDPStrategy.save_checkpoint",
                    "_FULL_CHECKPOINT_WRITERS",
                    "FSDPStrategy._set_up_on_cpu",
                    "FSDPStrategy._setup_module_on_cpu",
                    "FSDPStrategy._fsdp_wrapper_kwargs",
                    "_single_fsdp_module",
                    "_full_state",
                    "_full_state_dict_type",
                )
            ),
            f"{_TESTS}/test_strategy.py::test_fabric_accepts_our_class_on_cpu",
            f"{_TESTS}/test_strategy.py::_upstream_wrap_on_cpu",
            f"{_TESTS}/test_strategy.py::test_cpu_wrapping_works_where_upstream_arguments_fail",
            f"{_TESTS}/test_quiet.py::test_the_same_warnings_from_user_code_still_show",
        ),
        issue="Lightning-AI/pytorch-lightning#18008 (tensors of other ranks on `cuda:0`); the CPU runs of the first"
        " step.",
        motivation="`setup_module` now checks, before and after wrapping, that no parameter or buffer lives on a"
        " CUDA device other than the rank's own, and names the tensors that do. On CPU it wraps with"
        " `device_id=self.root_device` (the device's index is `None`, which FSDP refuses), and a full checkpoint of a"
        " CPU model is assembled without FSDP's CPU offload, which returns views of storage it frees right after."
        " `master` does the CPU part already (#21774, #21805): there these branches repeat it, and a maintainer may"
        " drop them; the release branch needs them.",
        effect="No runtime effect on GPU beyond the placement checks, which read each tensor's device once.",
        behaviour="`setup_module` raises a `RuntimeError` naming the tensors on another rank's GPU, instead of"
        " training with them there.",
        earlier_forms=(
            EarlierForm(
                f"{_STRATEGY}::FSDPStrategy.setup_module",
                old="""\
        record = InitRecord(ties=shared_tensor_names(module))
        materializer = None
        if (
            not wrapped
            and self._fsdp_kwargs.get("param_init_fn") is None
            and _upstream._has_meta_device_parameters_or_buffers(module)
        ):
            materializer = MetaMaterializer(module, self.root_device)
        with _fsdp_kwargs_added(self._fsdp_kwargs, param_init_fn=materializer):
            if self.root_device.type != "cpu":
                module = super().setup_module(module)
            else:
                module = self._setup_module_on_cpu(module)
        if materializer is not None:
            record.uninitialized = materializer.uninitialized()
        attach_init_record(module, record)
""",
                new="""\
        if self.root_device.type != "cpu":
            module = super().setup_module(module)
        else:
            module = self._setup_module_on_cpu(module)
""",
                reason="without the meta-device materialisation: FSDP materialises a meta model as before.",
            ),
            EarlierForm(
                f"{_STRATEGY}::FSDPStrategy.setup_module",
                old="""\
        wrapped here with ``device_id=self.root_device``, as upstream does it otherwise.

        A model created on the meta device (``fabric.init_module(empty_init=True)``) is materialised unit by unit on
        the rank's device, as FSDP does, unless a ``param_init_fn`` was given: tensors that two modules share stay
        one tensor, and each module is initialised by the model's own initialisation (``_init_weights`` of a Hugging
        Face model, which also computes buffers such as RoPE's ``inv_freq``) and by ``reset_parameters()`` where that
        leaves a tensor unwritten; a module without either is allowed. Floating-point tensors that nothing wrote are
        filled with NaN, and a load that leaves any of them unwritten warns, naming them.
""",
                new="""\
        wrapped here with ``device_id=self.root_device``, as upstream does it otherwise.
""",
                reason="without the meta-device materialisation: FSDP materialises a meta model as before.",
            ),
        ),
    ),
    Step(
        slug="byte-range-sources",
        title="Add tensor sources that read checkpoint files by validated byte ranges (unused until the loader)",
        carries=(
            f"{_SRC}/loading/__init__.py",
            f"{_SRC}/loading/errors.py",
            f"{_SRC}/loading/files.py",
            f"{_SRC}/loading/sources.py",
            f"{_TESTS}/loading/__init__.py",
            f"{_TESTS}/loading/test_sources.py",
        ),
        issue="Lightning-AI/pytorch-lightning#8043 (CPU memory of loading full checkpoints); the first of the private"
        " helpers that the shard-local loader reads with.",
        motivation="To copy only each rank's slice of a tensor out of a checkpoint file, the loader must read exactly"
        " those bytes. A `TensorLocation` says where a tensor's storage is in a file and how the tensor sits in it;"
        " it is checked against the file (in bounds, strides that fit the storage) before anything is read. A"
        " `ByteRangeSource` reads a range of a tensor's flattened elements with positioned reads into fresh memory"
        " (or straight into the destination): no mapping, so a file that shrinks during a load gives an error"
        " instead of a `SIGBUS`, and it notices a file replaced during the load. Files are opened only if they are"
        " regular files (a FIFO would block every rank); storage other than the local file system can serve the same"
        " reads behind `StoragePath` (the last step of this series does, for object storage). The walks over"
        " unpickled objects visit each object once (shared references would make a naive walk exponential) and"
        " refuse absurd nesting.",
        effect="None yet (unused until the loader). Its tests read located tensors (views, strided, cast) from a file"
        " written byte by byte, and refuse locations outside their storage or file.",
        size="800 source lines: `sources.py` 448, `files.py` 245 (the regular-file checks, the check that a file is"
        " unchanged, and the `StoragePath` seam that the remote reader of the last step implements), `errors.py` 102.",
    ),
    Step(
        slug="torch-file-structure",
        title="Read the structure of `torch.save` files, zip and legacy, with a weights-only walk of their pickles",
        carries=(
            f"{_SRC}/loading/zip_records.py",
            f"{_SRC}/loading/torch_pickle.py",
            f"{_SRC}/loading/legacy.py",
            f"{_TESTS}/helpers/checkpoints.py",
            f"{_TESTS}/loading/test_torch_files.py",
        ),
        issue="Lightning-AI/pytorch-lightning#8043; the reader of the two `torch.save` formats for the shard-local"
        " loader.",
        motivation="A `torch.save` file says where each storage is in its own structure: in the zip format, the"
        " central directory and the local headers (checked against each other, every byte accounted for, records"
        " stored uncompressed), in the legacy format the pickles that precede the data. `data.pkl` is unpickled with"
        " torch's weights-only unpickler (or the plain one for a trusted file), with every storage on the meta"
        " device, so the file's object is known without reading its data; `locate` turns its tensors into"
        " `TensorLocation`s for the sources of the previous step. A payload in the pickle is refused before it runs.",
        effect="None yet (unused until the loader). The tests read every tensor of zip and legacy files, views and"
        " shared storages included, by byte ranges, and refuse payloads, truncated files, compressed records and"
        " storages whose checksum does not match.",
        size="448 source lines: the zip directory (149), the weights-only walk of `data.pkl` (176) and the legacy"
        " format (112), which returns the same structure as the zip reader and reuses its unpickling.",
    ),
    Step(
        slug="safetensors-header",
        title="Read the safetensors header, checked against the file",
        carries=(
            f"{_SRC}/loading/safetensors_header.py",
            f"{_TESTS}/loading/test_safetensors_header.py",
            f"{_TESTS}/loading/test_bounded_parsing.py::_safetensors_of_empty_tensors",
            f"{_TESTS}/loading/test_bounded_parsing.py::"
            "test_a_safetensors_header_with_more_tensors_than_the_limit_is_refused_before_it_is_parsed",
            f"{_TESTS}/loading/test_bounded_parsing.py::"
            "test_a_safetensors_header_larger_than_the_library_allows_is_refused_unread",
            f"{_TESTS}/loading/test_bounded_parsing.py::test_a_repeated_name_in_a_safetensors_header_is_still_refused",
        ),
        issue="Lightning-AI/pytorch-lightning#8043; safetensors files (`model.safetensors`) for the shard-local"
        " loader.",
        motivation="A safetensors file is an 8-byte header size, a JSON header and the tensors' bytes. The header is"
        " read with the library's own limits (size, entries, repeated names) and every entry checked as the library"
        " checks it (dtype, shape, offsets that tile the data exactly), so each tensor's `TensorLocation` is proven"
        " before anything is read; nothing is unpickled.",
        effect="None yet (unused until the loader). A header with more tensors than the limit is refused before it is"
        " parsed.",
    ),
    Step(
        slug="checkpoint-formats",
        title="Tell checkpoint formats apart by their content, and open any of them as one tensor source",
        carries=(
            f"{_SRC}/loading/formats.py",
            f"{_TESTS}/loading/test_formats.py",
            f"{_TESTS}/loading/test_bounded_parsing.py",
            f"{_TESTS}/loading/test_hostile_files.py",
            f"{_TESTS}/test_names.py::state_dict",
            f"{_TESTS}/test_names.py::test_fabric_load_without_the_model_entry_names_the_calls_that_work",
            f"{_TESTS}/test_names.py::test_load_raw_refuses_an_ambiguous_checkpoint",
        ),
        issue="Lightning-AI/pytorch-lightning#18008 (`KeyError: 'model'` for a converted checkpoint), #8043.",
        motivation="A path is a sharded directory, a Fabric full checkpoint, a raw module state dict (zip or legacy),"
        " a safetensors file or a Hugging Face index (an `*.index.json`, or the directory holding it): the format"
        " is told from the content, not the name. `open_checkpoint` opens any file as one tensor source, tells a raw"
        " state dict from a Fabric checkpoint by its content (with an error that names the calls that load a file"
        " whose module state is under another key), and keeps the other entries of a checkpoint as references that"
        " a rank reads only where it needs them. A Hugging Face index is read once, bounded in size, and may only"
        " name shards next to it. A trusted pickle (`weights_only=False`) is read whole.",
        effect="None yet (unused until the loader). The tests detect and read every format, refuse each kind of bad"
        " input with one message that says what was found, and refuse crafted indexes before they are parsed.",
        size="484 source lines: detection, opening and the Hugging Face index are one module whose functions each"
        " dispatch over every format, with the messages that say what a file holds and which call loads it.",
    ),
    Step(
        slug="checkpoint-validation",
        title="Check a checkpoint's names, shapes and dtypes against a model before anything is written",
        carries=(
            f"{_SRC}/loading/validation.py",
            *(
                f"{_TESTS}/loading/test_layouts.py::{name}"
                for name in (
                    "test_plan_maps_tied_aliases_and_casts",
                    "test_plan_reports_every_problem_at_once",
                    "test_plan_refuses_integer_to_float_casts",
                )
            ),
            *(
                f"{_TESTS}/test_names.py::{name}"
                for name in (
                    "_INFO",
                    "_targets",
                    "_specs",
                    "_prefixed",
                    "_causal_lm_state",
                    "test_one_prefix_is_aligned_automatically",
                    "test_names_that_match_are_left_alone",
                    "test_causal_lm_checkpoint_into_the_base_model",
                    "test_several_fitting_prefixes_are_not_guessed",
                    "test_a_prefix_that_leaves_model_tensors_missing_is_advised_not_applied",
                    "test_nothing_in_common_gives_no_advice_that_fails",
                    "_with_exact_embedding",
                    "test_an_exact_name_wins_over_the_alignment",
                    "test_explicit_rename",
                    "test_bad_renames_are_refused",
                )
            ),
            *(
                f"{_TESTS}/test_peft.py::{name}"
                for name in (
                    "_ADVISED",
                    "_specs",
                    "_targets",
                    "test_a_substituted_component_is_advised",
                    "test_the_insertion_advised_keeps_shapes",
                    "test_what_the_advised_rename_does_not_load_is_named",
                )
            ),
        ),
        issue="Lightning-AI/pytorch-lightning#18008; the validation that makes a failed load leave the model as it"
        " was.",
        motivation="`load_state_dict` checks a state dict while it writes it, and an FSDP load that fails halfway"
        " leaves some units written. `plan_load` compares the checkpoint's names, shapes and dtypes with the model's"
        " before anything is read, and raises one error that lists every problem, with the fix: tied weights count"
        " once, floating-point tensors are cast, other dtype changes and shape mismatches are errors even with"
        " `strict=False`. Names that differ by a prefix that a wrapper added (`module.`, `_orig_mod.`) or by the"
        " model class (`model.*` of a `LlamaForCausalLM` for a `LlamaModel`) are aligned when exactly one prefix"
        " fits; otherwise the error names the `rename` that fits the file.",
        effect="None yet (unused until the loader).",
        size="648 source lines, 310 of them (from `_alignment` on) the automatic prefix alignment and the advice in"
        " the errors (the `rename` that fits the file), which `plan_load` decides in the same pass as the matching:"
        " a cut would need an earlier form of `plan_load` and of the strategies' `load_options`.",
    ),
    Step(
        slug="fsdp1-shard-layout",
        title="Add FSDP1's shard layout: each rank's ranges of every tensor, and the copy into them",
        carries=(
            f"{_SRC}/loading/shard_local.py",
            f"{_TESTS}/loading/test_layouts.py",
            f"{_TESTS}/loading/test_formats.py::test_shards_are_read_straight_into_the_parameter",
        ),
        issue="Lightning-AI/pytorch-lightning#8043; the shard-local copy of the loader.",
        motivation="With FSDP1, every wrapped unit has a `FlatParameter` whose shard infos say which slice of each"
        " original parameter this rank holds. `collect_targets` turns them into targets: for each checkpoint tensor,"
        " the runs of its flattened elements that this rank holds and where they go in its shard (tied aliases and"
        " buffers included); `copy_into_module` reads exactly those runs from a tensor source, casting where the plan"
        " says, straight into the shard's memory. A layout the copy does not know (a unit unsharded right now, a"
        " `FlatParameter` without shard infos) says so, for the loader to fall back.",
        effect="None yet (unused until the loader). The tests copy a faked two-rank layout from a checkpoint, through"
        " tied aliases and casts, and read a slice of a file straight into a parameter, with no buffer between.",
    ),
    Step(
        slug="load-agreement",
        title="Add an agreement between ranks for checkpoint loads: every rank returns or every rank raises",
        carries=(
            f"{_SRC}/loading/agreement.py",
            f"{_TESTS}/loading/test_agreement.py",
        ),
        issue="Lightning-AI/pytorch-lightning#18008 (a load that fails on one rank hangs the others until the process"
        " group times out).",
        motivation="A load fails on one rank (a missing tensor in its shard, an I/O error) while the others wait for"
        " it in the next collective, until the process group times out. The agreement runs on the process group's"
        " store, never in a collective: at each point where ranks must agree, each says whether it failed; if any"
        " did, every rank raises the same error, quickly, naming the failing ranks. Heartbeats let a waiting rank"
        " tell a slow rank from a dead one in seconds, for every store type, and every wait is bounded. Each load"
        " agrees under a namespace of its own, so a load that failed on one rank cannot shift the next one.",
        effect="None yet (unused until the loader).",
        size="577 source lines: the protocol (flags, heartbeats, the failure report) is one class, and the waiting"
        " rank's checks for a dead rank or an unreachable store are part of every wait.",
    ),
    Step(
        slug="load-progress",
        title="Add a progress bar for checkpoint loads, one per node",
        carries=(
            f"{_SRC}/loading/progress.py",
            f"{_TESTS}/loading/test_progress.py",
        ),
        issue="Lightning-AI/pytorch-lightning#18138 (a multi-minute load of a large checkpoint shows nothing).",
        motivation="Loading a large checkpoint can take minutes, with ranks waiting for their turn. `LoadProgress`"
        " shows one bar per node (through `tqdm`, on local rank 0 only, and only on a terminal), with the node's"
        " bytes and tensors, the rate and the turn; an environment variable turns it off.",
        effect="None yet (unused until the loader).",
    ),
    Step(
        slug="node-turns",
        title="Add node turns for sources that must be read whole (unused until the loader)",
        carries=(
            f"{_SRC}/loading/memory.py",
            f"{_SRC}/loading/turns.py",
            f"{_TESTS}/loading/test_memory.py",
            f"{_TESTS}/loading/test_turns.py",
            *(
                f"{_TESTS}/loading/test_agreement.py::{name}"
                for name in (
                    "_launch",
                    "_entry",
                    "_die",
                    "_one_rank_dies",
                    "_assert_survivors_name",
                    "test_a_killed_rank_is_named_on_every_other_rank",
                    "test_a_killed_rank_is_named_with_a_file_store",
                    "test_the_store_host_killed_is_a_clean_error_at_once",
                    "_turns_and_a_failure",
                    "test_turns_and_failures_on_every_store_type",
                    "_keys_after_blocks",
                    "test_the_keys_of_finished_loads_are_deleted",
                    "_quiet_wait",
                    "test_waiting_for_a_turn_prints_nothing",
                )
            ),
            f"{_TESTS}/loading/test_progress.py::_node_progress",
            f"{_TESTS}/loading/test_progress.py::test_one_bar_per_node_with_the_node_totals",
        ),
        issue="Lightning-AI/pytorch-lightning#18138 (closed: the local ranks of a node load a full checkpoint one"
        " after the other, to avoid CPU OOM), #18008.",
        motivation="A source that must be materialised whole in host memory (a pickle that may hold any object, read"
        " with `weights_only=False`) costs one full copy per rank when every rank of a node reads it at once."
        " `StaggeredLoad` lets at most `k` ranks of a node hold one at a time (`k` from the caller, or from the"
        " memory the node has free, bounded by its cgroup), in local-rank order, each handing the memory back to the"
        " system before the next starts; nodes proceed in parallel. Turns run on the agreement of the previous"
        " steps, never in a collective: a collective inside a turn (FSDP's unshard) would deadlock the waiting"
        " ranks, and waiting never trips the process group's timeout.",
        effect="None yet (unused until the loader). With it, from benchmarks/README.md (1.07 GB legacy-format"
        " checkpoint read whole with `weights_only=False`, 4 CPU ranks): peak memory +1.08 GB above base with"
        " `k=1` against +4.30 GB with all four ranks at once (upstream: +5.30 GB), in 5.12 s against 2.46 s.",
        size="468 source lines: the turn schedule (351) and the memory a node has free, cgroup v1 and v2 (117).",
    ),
    Step(
        slug="fsdp-shard-local-loading",
        title="Load raw, safetensors and Hugging Face checkpoints shard-locally in `FSDPStrategy.load_checkpoint`",
        carries=(
            f"{_SRC}/loading/*.py",
            f"{_SRC}/loading_calls.py",
            f"{_STRATEGY}",
            f"{_TESTS}/helpers/*",
            f"{_TESTS}/test_*.py",
            f"{_TESTS}/loading/test_turns.py::_slow_turns_under_short_timeout",
            f"{_TESTS}/loading/test_turns.py::test_slow_turns_do_not_trip_a_short_process_group_timeout",
            f"{_TESTS}/loading/test_turns.py::test_invalid_concurrency",
            "CHANGELOG.md::Added support for loading raw module state dicts",
            "CHANGELOG.md::Added the `load_concurrency` and `load_progress` arguments",
        ),
        issue="Lightning-AI/pytorch-lightning#18008 (`KeyError: 'model'` and one full copy per rank when loading a"
        " converted checkpoint into FSDP), #8043 (CPU OOM of full checkpoints).",
        motivation='`fabric.load(path, {"model": model})` on a file that holds only a module\'s state dict (a'
        " converted `lit-llama.pth`, `pytorch_model.bin`) raises `KeyError: 'model'`, and every rank reads a full"
        " checkpoint whole. `load_checkpoint` now detects the format and opens the file with the readers of the"
        " previous steps, validates names, shapes and dtypes on every rank before writing, and copies each rank's"
        " slices of the parameters into its FSDP shards (the `FlatParameter`'s shard infos), reading only those"
        " bytes. Pickles that must be read whole (`weights_only=False`) are read in node turns; an error on any rank"
        " is raised on every rank. A remote path (an fsspec URL) is still loaded by the method this one replaces,"
        " kept as `_default_load_checkpoint`, until the last pull request of this series reads it by byte ranges"
        " too. An FSDP configuration that the"
        " shard-local path does not know falls back to FSDP's full state-dict loading, with one warning. Optimizer"
        " states, sharded directories and the meta-device materialisation keep upstream's path until their steps.",
        effect="From benchmarks/README.md (1.07 GB model, 4 CPU ranks, gloo, cold cache): a raw zip file loads in"
        " 1.07 s instead of 4.79 s, with +1.8 MB above base instead of +1.90 GB; safetensors and Hugging Face"
        " indexes (not supported before) load in 0.87 s and 0.96 s with +1.4 MB.",
        behaviour="`fabric.load` and `fabric.load_raw` accept raw state dicts, `.safetensors` files and Hugging Face"
        " indexes. `weights_only=None` means `True` for every file the method reads. An empty or truncated file"
        " raises `CheckpointLoadError` (a `ValueError` where upstream raised one). New arguments `load_concurrency`"
        " and `load_progress`. A remote path is loaded as before.",
        size="653 source lines: the loader (357: detect, open, validate, agree, copy, fall back) and what the"
        " strategy does around it (296 in `strategies/fsdp.py`: the request from `state`, the path broadcast, the"
        " per-load options, upstream's error types for refused paths, and `load_checkpoint`). The readers, the"
        " validation, the layout, the agreement and the turns came in the steps before; the loader calls each of them"
        " once.",
        lightning_edits=_EMPTY_FILE_EDITS,
        earlier_forms=(
            *_FSDP_REMOTE_FORMS,
            *_FSDP_LOAD_OPTIONS_REMOTE_FORMS,
            *_CALLS_REMOTE_FORMS,
            *_FSDP_SHARDED_TO_UPSTREAM,
            EarlierForm(
                f"{_STRATEGY}::FSDPStrategy.load_checkpoint",
                old="""\
        Full files are loaded shard-locally: each rank copies only its own slice of every parameter and optimizer
        state into its shard, reading only those bytes,""",
                new="""\
        Full files are loaded shard-locally: each rank copies only its own slice of every parameter into its shard
        (optimizer states take FSDP's own path), reading only those bytes,""",
                reason="optimizer states are loaded by FSDP's own path until the step that slices them.",
            ),
            EarlierForm(
                f"{_STRATEGY}::FSDPStrategy.load_checkpoint",
                old="Names, shapes and dtypes (of the optimizer state too) are checked",
                new="Names, shapes and dtypes are checked",
                reason="optimizer states are loaded by FSDP's own path until the step that slices them.",
            ),
            _LOAD_WITHOUT_SHARDED,
            _LOAD_WITHOUT_UNINITIALIZED,
            EarlierForm(
                f"{_LOADER}::_prepare",
                old="""\
        if collected is not None:
            try:
                optimizer_states[key] = local_optimizer_state(optimizer, collected, saved)
                continue
            except ShardLocalUnsupported as reason:
                _warn_fallback(f"optimizer {key!r}: {reason}")
""",
                new="",
                reason="optimizer states are loaded by FSDP's own path until the step that slices them.",
            ),
            _PREPARE_WITHOUT_CONVERSIONS,
            _PREPARED_WITHOUT_CONVERSIONS,
            EarlierForm(
                f"{_LOADER}::_module_targets",
                old="""\
    collect = collect_dtensor_targets if has_dtensor_params(module) else collect_targets
    try:
        return collect(module)
""",
                new="""\
    try:
        return collect_targets(module)
""",
                reason=_FSDP1_ONLY,
            ),
            EarlierForm(
                f"{_LOADER}::_load_optimizer_with_fsdp",
                old="""\
    if has_dtensor_params(module):
        _load_optimizer_with_dtensors(module, optimizer, state)
        return
""",
                new="",
                reason=_FSDP1_ONLY,
            ),
            EarlierForm(
                f"{_LOADER}::_ties",
                old='''\
    """Model name -> the names it is tied to, as the model was before wrapping or as a Hugging Face model declares.

    ``setup_module`` records the tensors that the model held twice; a Hugging Face model's ``all_tied_weights_keys``
    holds the ties that its config asks for.

    """
    record = init_record(module)
    ties: dict[str, set[str]] = {name: set(others) for name, others in (record.ties if record else {}).items()}
''',
                new='''\
    """Model name -> the names it is tied to, as a Hugging Face model declares (``all_tied_weights_keys``)."""
    ties: dict[str, set[str]] = {}
''',
                reason="without the ties that `setup_module` records, which the meta-device materialisation adds.",
            ),
            EarlierForm(
                f"{_TESTS}/helpers/state.py::gather_full_state",
                old="""\
    if has_dtensor_params(module):
        return _gather_dtensor_state(module, optimizer)
""",
                new="",
                reason=_FSDP1_ONLY,
            ),
        ),
    ),
    Step(
        slug="fsdp-shard-local-optimizer",
        title="Load the optimizer states of a full checkpoint shard-locally in `FSDPStrategy.load_checkpoint`",
        carries=(
            f"{_SRC}/loading/optimizer.py",
            f"{_TESTS}/test_full_checkpoint_configs.py",
            f"{_TESTS}/test_load_hostile.py",
            f"{_TESTS}/test_load_synchronisations.py",
            *(
                f"{_TESTS}/loading/test_layouts.py::{name}"
                for name in (
                    "_full_optimizer_state",
                    "test_optimizer_state_is_sliced_like_the_parameter",
                    "test_optimizer_state_of_whole_parameter_keeps_its_shape",
                    "test_optimizer_state_of_wrong_shape_is_refused_before_anything_is_written",
                    "test_optimizer_state_incomplete_or_inconsistent_unit",
                )
            ),
            "CHANGELOG.md::Added shard-local loading of the optimizer states",
        ),
        issue="Lightning-AI/pytorch-lightning#8043 (CPU OOM of full checkpoints with optimizer state).",
        motivation="A full checkpoint with Adam state is three times the model, and FSDP's"
        " `optim_state_dict_to_load` needs the whole optimizer state on every rank. Each rank now copies only its"
        " slices of every per-parameter state (`exp_avg`, `momentum_buffer`, ...) into the flat parameter's state,"
        " the same slices as the parameter's, read by byte ranges from the file; the states are checked (shapes,"
        " groups, hyperparameters) before anything is written. A state that the slicing does not know falls back to"
        " FSDP's path, with one warning.",
        effect="From benchmarks/README.md (1.07 GB model, 4 CPU ranks, gloo, cold cache): a full checkpoint with"
        " Adam state (3.22 GB) loads in 2.75 s instead of 14.10 s, peak memory of all ranks +2.15 GB above base"
        " instead of +10.27 GB, storage read per node 3.22 GB instead of 12.89 GB.",
        behaviour="An optimizer state of the wrong shape is refused before anything is written, on every rank.",
        earlier_forms=(*_FSDP_SHARDED_TO_UPSTREAM, _PREPARE_WITHOUT_CONVERSIONS),
    ),
    Step(
        slug="fsdp2-shard-local-loading",
        title="Shard-local loading in `ModelParallelStrategy.load_checkpoint` (FSDP2 and tensor parallelism)",
        carries=(
            f"{_SRC}/loading/fsdp2_layout.py",
            f"{_MODEL_PARALLEL}",
            f"{_LOADER}::_module_targets",
            f"{_LOADER}::_load_optimizer_with_fsdp",
            f"{_LOADER}::_load_optimizer_with_dtensors",
            f"{_TESTS}/helpers/state.py::gather_full_state",
            f"{_TESTS}/helpers/state.py::_gather_dtensor_state",
            f"{_TESTS}/test_fsdp2.py",
            f"{_TESTS}/test_load_against_upstream.py",
            *(
                f"{_TESTS}/loading/test_layouts.py::{name}"
                for name in (
                    "_placements",
                    "_fake_rank",
                    "_torch_local",
                    "_from_runs",
                    "test_dtensor_indices_and_runs_match_distribute_tensor",
                    "_chunk_or_empty",
                    "test_strided_indices_are_what_fully_shard_holds_or_refused",
                    "test_strided_layout_that_torch_reads_two_ways_is_refused",
                    "test_dtensor_indices_runs_of_a_strided_weight",
                    "test_dtensor_indices_refuse_unknown_placements",
                    "_fully_shard_like_parameter",
                    "test_collect_dtensor_targets_copies_strided_rows_or_refuses_on_every_rank",
                )
            ),
            "CHANGELOG.md::Added shard-local loading of full and raw checkpoints to `ModelParallelStrategy",
        ),
        issue="FSDP2 counterpart of the FSDP1 steps; no upstream issue yet (to be opened with this PR).",
        motivation="`ModelParallelStrategy` loads a full checkpoint with `torch.load` on every rank and one"
        " `set_model_state_dict(broadcast_from_rank0=True)` per parameter. It now goes through the same loader as"
        " `FSDPStrategy`: each rank copies its own ranges of every `DTensor` (FSDP2, HSDP, TP, FSDP x TP) with no"
        " broadcast, and the optimizer states are built on each rank from their local parts. Placements that the"
        " layout does not know fall back to upstream's path with one warning.",
        effect="From benchmarks/README.md (FSDP2 rows): a full checkpoint with Adam state loads in 2.29 s instead of"
        " 9.56 s, +2.15 GB above base instead of +5.71 GB; a raw zip file in 0.72 s instead of 3.30 s, +1.5 MB"
        " instead of +1.21 GB.",
        behaviour="`ModelParallelStrategy` accepts `load_concurrency` and `load_progress`, and reads the formats of"
        " `FSDPStrategy`.",
        lightning_edits=_MODEL_PARALLEL_EDITS[:1],
        earlier_forms=(
            *_MODEL_PARALLEL_REMOTE_FORMS,
            EarlierForm(
                f"{_MODEL_PARALLEL}::ModelParallelStrategy.load_checkpoint",
                old="""\
        parameter and optimizer state into its local ``DTensor`` shards, reading only those bytes. A sharded directory
        is read by the same validated reader as with :class:`lightning_fsdp.FSDPStrategy` (its metadata through an
        allow-list, every entry checked against the model first), each rank reading its own shards; ``load_raw``
        reads its model entry. See""",
                new="""\
        parameter and optimizer state into its local ``DTensor`` shards, reading only those bytes. A sharded directory
        is read as before, by the distributed checkpoint reader. See""",
                reason=f"a sharded checkpoint goes to upstream's method: {_SHARDED_UPSTREAM}",
            ),
            EarlierForm(
                f"{_MODEL_PARALLEL}::ModelParallelStrategy.load_checkpoint",
                old="""\
        path, namespace = broadcast_load_path(self, path)
""",
                new=_SHARDED_TO_UPSTREAM,
                reason=f"a sharded checkpoint goes to upstream's method: {_SHARDED_UPSTREAM}",
            ),
            EarlierForm(
                f"{_MODEL_PARALLEL}::ModelParallelStrategy.setup_module",
                old="""\
        record = InitRecord()
        with _materializing_after_parallelize(self, record):
            module = super().setup_module(module)
        attach_init_record(module, record)
""",
                new="""\
        module = super().setup_module(module)
""",
                reason="without the meta-device materialisation: upstream's `to_empty` and `reset_parameters()`.",
            ),
            EarlierForm(
                f"{_MODEL_PARALLEL}::ModelParallelStrategy.setup_module",
                old='''\
        """Applies ``parallelize_fn`` to the model, and materialises a model created on the meta device.

        Upstream's method, except for a model created on the meta device (``fabric.init_module(empty_init=True)``)
        that ``parallelize_fn`` left there: instead of upstream's ``to_empty()`` and ``reset_parameters()``, each
        ``DTensor`` parameter is allocated as its local shard on the rank's device, tensors that two modules share
        stay one tensor, and each module is initialised by the model's own initialisation (``_init_weights`` of a
        Hugging Face model, which also computes buffers such as RoPE's ``inv_freq``) and by ``reset_parameters()``
        where that leaves a tensor unwritten; a module without either is allowed. Tensors that ``parallelize_fn``
        materialised keep their values. Floating-point tensors that nothing wrote are filled with NaN, and a load
        that leaves any of them unwritten warns, naming them.

        Before ``parallelize_fn`` and after the module is set up, no parameter or buffer may live on a CUDA device other
        than the rank's own; a ``DTensor`` is checked by its local shard. CPU and meta tensors are allowed.

        """
''',
                new='''\
        """Applies ``parallelize_fn`` to the model, as upstream's method does.

        After the module is set up, no parameter or buffer may live on a CUDA device other than the rank's own; a
        ``DTensor`` is checked by its local shard. CPU and meta tensors are allowed.

        """
''',
                reason="without the meta-device materialisation: upstream's `to_empty` and `reset_parameters()`.",
            ),
        ),
    ),
    Step(
        slug="validated-sharded-reader",
        title="Read sharded checkpoints through a validated reader: metadata weights-only, checked before reading",
        carries=(
            f"{_SRC}/loading/sharded.py",
            f"{_LOADER}::_load_sharded",
            f"{_STRATEGY}::FSDPStrategy.load_checkpoint",
            f"{_MODEL_PARALLEL}::ModelParallelStrategy.load_checkpoint",
            f"{_TESTS}/helpers/hostile_dcp.py",
            f"{_TESTS}/loading/test_sharded.py",
            f"{_TESTS}/test_load_sharded_hostile.py",
            f"{_TESTS}/test_fsdp_roundtrip.py",
            f"{_TESTS}/test_quiet.py",
            f"{_TESTS}/test_fsdp2.py::test_sharded_checkpoint_with_adam_loads_bit_exact_and_resumes",
            f"{_TESTS}/test_fsdp2.py::test_2d_meshes_full_and_sharded_checkpoints_load_bit_exact_and_resume",
            f"{_TESTS}/test_names.py::_prefixes",
            f"{_TESTS}/test_names.py::test_names_that_differ",
            f"{_TESTS}/loading/test_bounded_parsing.py::"
            "test_a_global_name_with_terminal_escapes_in_sharded_metadata_is_quoted_escaped",
            "CHANGELOG.md::Fixed `FSDPStrategy.load_checkpoint` and `ModelParallelStrategy.load_checkpoint` running",
        ),
        issue="Lightning-AI/pytorch-lightning#18008; no upstream issue for the unpickling yet (to be opened with this"
        " PR).",
        motivation="A sharded checkpoint is read by torch's distributed checkpoint reader, which unpickles `.metadata`"
        " with plain `pickle` and the non-tensor entries with `weights_only=False`, whatever `weights_only` says;"
        " a FIFO or a truncated shard hangs or half-loads the model. The reader now unpickles `.metadata` through an"
        " allow-list of torch's metadata types and the other entries weights-only, checks that every file is a"
        " regular file holding every byte the metadata places in it, compares the checkpoint's entries with the"
        " model's sharded state dict and the optimizers' before anything is read, reads everything before"
        " anything is written, and checks after reading each file that it was not rewritten or replaced meanwhile"
        " (a save into the same directory); a failure inside the reader is one short `CheckpointLoadError`. Both"
        " strategies use it, each rank reading its own shards; `load_raw` reads a sharded checkpoint's model entry.",
        effect="No cost measured beyond the reader's own: the checks read the metadata once and stat the files.",
        behaviour="With `weights_only=True` (the default) a sharded checkpoint whose metadata or entries hold other"
        " objects is refused before any of its code runs; `meta.pt` is read with `weights_only=True` and"
        ' `map_location="cpu"`. `fabric.load_raw` reads a sharded checkpoint. A remote sharded directory is'
        " loaded as before until the last step of this series.",
        size="890 source lines added, 857 of them `sharded.py`: the allow-list unpickler, the checks of the metadata"
        " against the files and against the model (FSDP1 and FSDP2 state dicts), and the reader of both strategies'"
        " optimizer states. Upstream's `load_checkpoint` of both strategies stays, as `_default_load_checkpoint`, for"
        " remote paths until the last step.",
        earlier_forms=(_LOAD_WITHOUT_UNINITIALIZED,),
    ),
    Step(
        slug="meta-device-materialisation",
        title="Materialise meta-device models with their own initialisation in both strategies",
        carries=(
            f"{_SRC}/loading/materialize.py",
            f"{_LOADER}::load",
            f"{_LOADER}::_ties",
            f"{_LOADER}::_warn_uninitialized",
            f"{_LOADER}::_non_persistent_buffer_names",
            f"{_STRATEGY}::FSDPStrategy.setup_module",
            f"{_STRATEGY}::_fsdp_kwargs_added",
            f"{_MODEL_PARALLEL}::ModelParallelStrategy.setup_module",
            f"{_MODEL_PARALLEL}::_materializing_after_parallelize",
            f"{_TESTS}/test_devices.py::test_model_parallel_setup_module_checks_placement_around_parallelize_fn",
            f"{_TESTS}/test_fsdp2_meta_init.py",
            f"{_TESTS}/test_transformers.py",
            f"{_TESTS}/test_two_nodes.py",
            f"{_TESTS}/scripts/two_nodes_worker.py",
            f"{_TESTS}/test_single_gpu.py",
            "CHANGELOG.md::Fixed `ModelParallelStrategy` leaving tensors",
            "CHANGELOG.md::Fixed `FSDPStrategy` failing to set up a model",
        ),
        issue="No upstream issue yet (to be opened with this PR): RMSNorm weights and RoPE's `inv_freq` stay"
        " uninitialised after `fabric.init_module(empty_init=True)`.",
        motivation="With `empty_init=True`, FSDP1 materialises each unit with `to_empty()` and `reset_parameters()`,"
        " and `ModelParallelStrategy` the whole model after `parallelize_fn`: a module without `reset_parameters()`"
        " (an RMSNorm, a rotary embedding's `inv_freq`) keeps uninitialised memory, and a Hugging Face model's own"
        " `_init_weights` never runs. Each unit (FSDP1) or `DTensor` shard (FSDP2) is now allocated on the rank's"
        " device and initialised by the model's own initialisation, and by `reset_parameters()` where that leaves a"
        " tensor unwritten; tensors that two modules share stay one tensor; floating-point tensors that nothing"
        " wrote are NaN, and a load that leaves any of them unwritten warns, naming them. A new peft LoRA adapter is"
        " initialised as peft initialises it (`lora_B` zero by default), not by the model's `_init_weights`, so that it"
        " changes nothing until trained (its tests come with `test_peft.py` in the conversions step).",
        effect="No measured cost: the same allocation as FSDP's, once per unit.",
        behaviour="`setup_module` initialises a meta model with its own initialisation; tensors that nothing wrote"
        " are NaN and the load that leaves them unwritten warns, naming them. The warning about modules without"
        " `reset_parameters()` moves from `setup_module` to that load.",
        size="553 source lines, 407 of them `materialize.py`: each unit's (FSDP1) or local shard's (FSDP2) tensors"
        " allocated on the rank's device, what the model's own initialisation writes recorded, shared tensors kept"
        " shared, peft adapters initialised as peft does; the rest in both strategies' `setup_module` and the"
        " loader's warning. Above the guideline of about 400 because the materialiser and the two `setup_module`"
        " calls that replace FSDP's own materialisation cannot work apart.",
        lightning_edits=_MODEL_PARALLEL_EDITS[1:],
    ),
    Step(
        slug="declared-conversions",
        title="Load checkpoints into models that declare weight conversions (fused Mixture-of-Experts weights)",
        carries=(
            f"{_SRC}/loading/conversions.py",
            f"{_LOADER}::_prepare",
            f"{_LOADER}::_Prepared",
            f"{_TESTS}/test_moe.py",
            f"{_TESTS}/test_peft.py",
            "CHANGELOG.md::Added support for loading checkpoints into `transformers` models that declare",
        ),
        issue="No upstream issue yet (to be opened with this PR): a transformers 5 Mixture-of-Experts checkpoint loads"
        " only with `strict=False`, which leaves the router and every expert at their initial values.",
        motivation="A transformers 5 Mixture-of-Experts model holds its experts fused (`mlp.experts.gate_up_proj`)"
        " while the Hub holds one tensor per expert; `from_pretrained` converts them with the conversions the model"
        " declares. The loader reads the same declarations, evaluates them on shapes only, and reads each target as"
        " pieces of the checkpoint's tensors: a rank reads only the parts of the experts that fall in its slice. A"
        " conversion that cannot be read shard-locally is refused, naming it.",
        effect="Mixtral and Qwen2-MoE load bit-exact against `from_pretrained`, FSDP1 and FSDP2, each rank reading"
        " only its pieces.",
        behaviour="Models that declare conversions load checkpoints in the Hub's layout.",
    ),
    Step(
        slug="convert-checkpoint",
        title="Add `convert_checkpoint`: any readable checkpoint rewritten as a sharded checkpoint",
        carries=(
            f"{_SRC}/loading/convert.py",
            f"{_TESTS}/helpers/fuzz.py",
            f"{_TESTS}/loading/test_fuzz.py",
            f"{_TESTS}/test_load_strict.py",
            *(
                f"{_TESTS}/loading/test_hostile_files.py::{name}"
                for name in (
                    "_assert_refused_everywhere",
                    "test_zip_record_shorter_than_its_storage_is_refused",
                    "test_index_names_stay_inside_the_checkpoint",
                    "test_zip_length_field_changed_is_refused",
                    "test_repacked_zip_files_load_exactly_and_convert_exactly",
                    "_open_converted",
                    "test_convert_checks_each_zip_records_crc",
                    "test_invalid_safetensors_header_is_refused_everywhere",
                )
            ),
            f"{_TESTS}/loading/test_bounded_parsing.py::_shared_levels",
            f"{_TESTS}/loading/test_bounded_parsing.py::test_every_walk_over_shared_references_is_linear",
        ),
        issue="Lightning-AI/pytorch-lightning#8043: a checkpoint that must be read whole every time (a trusted"
        " pickle) is converted once into a format that every later load reads by byte ranges.",
        motivation="`convert_checkpoint` writes the module state of any checkpoint the loader reads as a sharded"
        " checkpoint (each tensor streamed, a few MiB at a time, through the same validated readers, every zip"
        " record checked against its CRC), and `describe_checkpoint` says what a checkpoint holds without loading"
        " it. A `fabric` CLI command would call them, next to `fabric consolidate`; that command is left to a"
        " maintainer.",
        effect="None on loading. A fuzzing harness mutates the structure of every format and checks that `fabric.load`"
        " and `convert` load exactly or raise `CheckpointLoadError`.",
    ),
    Step(
        slug="loading-guide",
        title="Document loading large checkpoints: the guide, FSDP2, host memory and multi-node pages",
        carries=(
            f"{_DOCS}/guide/*",
            f"{_DOCS}/examples/*",
        ),
        issue="The documentation of the previous steps.",
        motivation="The guide explains what the previous steps changed, with examples that the test suite runs:"
        " loading raw, safetensors and Hugging Face checkpoints, names that differ, Mixture-of-Experts models,"
        " meta-device initialisation, FSDP2, host memory and turns, and launching on several nodes.",
        effect="None.",
        earlier_forms=(_GUIDE_REMOTE_FORM,),
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
        " range is fetched as chunks by up to 8 concurrent requests per rank: from S3, 16 MiB chunks streamed into"
        " their destination once their `Content-Range` is checked; from other file systems, whose bodies arrive"
        " whole, 4 MiB chunks with at most 16 MiB of them in flight per process. Small reads come from cached"
        " 64 KiB blocks, failed requests are retried with bounded backoff, and the size and ETag of each object are"
        " pinned, so an object replaced during the load is an error on every rank. `load_options(storage_options=...)`"
        " passes the file system's options; credentials never appear in a message."
        " A remote sharded directory goes through the same validated reader as a local one (its `.metadata` through"
        " the allow-list, `meta.pt` weights-only), each rank fetching exactly the byte ranges of its own entries, never"
        " through DCP's fsspec reader, which would unpickle its metadata unchecked.",
        effect="From benchmarks/README.md (a 1.07 GB model, 4 CPU ranks on one node, gloo, moto's S3 server on"
        " loopback with ranges served by seek, FSDP1): the node fetches 1.005x the file for a torch zip file or a full"
        " checkpoint with Adam state and 1.000x for a safetensors file, each rank its own slices; on two nodes each"
        " node fetches its own half. The load takes 1.2-2.0x the same load from a local file (master's `cloud_io._load`"
        " of the zip file: 17.4x, fetching 4.4x the file, with +5.7 GB of memory). With the S3 client created"
        " beforehand, anonymous memory above base is +1.5 MB (safetensors) to +4.8 MB (full) over the local load's;"
        " creating the client (s3fs, aiobotocore, botocore) costs about 25 MB per rank.",
        behaviour="A remote file is read with `weights_only=True` unless `weights_only=False` is passed (master:"
        " `False` by default for remote files), and shard-locally instead of whole on every rank. A remote sharded"
        " directory is read by the validated reader instead of DCP's fsspec reader: a `.metadata` or `meta.pt` that"
        " holds anything but plain data raises `CheckpointLoadError`."
        " `load_options` takes `storage_options`.",
        size="574 source lines added, 526 of them `remote.py` (fsspec's object storage behind `StoragePath`: range"
        " requests, chunking and streaming, retries, the pinned size and ETag); 193 removed: master's"
        " `load_checkpoint` of both strategies (`_default_load_checkpoint`), which the steps before kept for remote"
        " paths.",
        lightning_edits=_REMOTE_EDITS,
    ),
)


@dataclass
class _Assignment:
    """Which step carries each file and each definition, as the manifest says."""

    files: dict[str, int] = field(default_factory=dict)
    definitions: dict[tuple[str, str], int] = field(default_factory=dict)
    forms: dict[tuple[str, str], list[tuple[int, int, EarlierForm]]] = field(default_factory=dict)
    """The earlier forms of each definition (``(path, "")``: of lines anywhere in the file), each with the step that
    gives it and the step that completes it."""
    problems: list[str] = field(default_factory=list)

    def step_of(self, path: str, key: str | None = None) -> int:
        if key is not None and (path, key) in self.definitions:
            return self.definitions[(path, key)]
        return self.files[path]

    def form_at(self, path: str, key: str, upto: int) -> list[EarlierForm]:
        """The forms that step ``upto`` holds of a definition (``""``: of the file), the latest-completed first."""
        held = [(given, end, form) for given, end, form in self.forms.get((path, key), []) if given <= upto < end]
        latest = {end: max(given for given, other, _ in held if other == end) for _, end, _ in held}
        ordered = sorted(((end, form) for given, end, form in held if given == latest[end]), key=lambda pair: -pair[0])
        return [form for _, form in ordered]


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
    keys = {(path, key) for path, text in items if path.endswith(".py") for key, _, _ in definition_keys(path, text)}
    for number, step in enumerate(steps, 1):
        for form in step.earlier_forms:
            end = _step_of_entry(result, form.completed_by, keys)
            if end is None or (form.path, form.name) not in keys | {(path, path) for path in result.files}:
                absent = form.where if end is not None else form.completed_by
                result.problems.append(
                    f"step {number}: an earlier form names `{absent}`, which the change does not carry"
                )
            elif number >= end:
                result.problems.append(
                    f"step {number} gives an earlier form of `{form.where}`, which step {end} completes: only a step"
                    " before it can"
                )
            else:
                key = "" if form.where == form.path else form.name
                result.forms.setdefault((form.path, key), []).append((number, end, form))
    return result


def _step_of_entry(assignment: _Assignment, entry: str, keys: set[tuple[str, str]]) -> int | None:
    """The step that carries a manifest entry (a file or a definition), or ``None`` when the change has none."""
    path, _, key = entry.partition("::")
    if path not in assignment.files or (key and (path, key) not in keys):
        return None
    return assignment.step_of(path, key or None)


def restriction(assignment: _Assignment, upto: int) -> Restriction:
    """The restriction of :func:`plan` to steps ``1..upto``; it records uses of names that a later step brings."""
    problems: list[str] = []

    def restrict(path: str, text: str) -> str | None:
        if path == "connector":
            return text if assignment.files.get(path, upto + 1) <= upto else None
        if path == "CHANGELOG.md":
            return text if assignment.definitions.get((path, text), upto + 1) <= upto else None
        file_step = assignment.files[path]
        file_forms = assignment.form_at(path, "", upto)
        if file_forms:
            edited = _earlier_form(text, file_forms, f"step {upto}: {path}", problems)
            text = drop_unused_imports(text, edited, path) if path.endswith(".py") and edited != text else edited
        if not path.endswith(".py"):
            return text if file_step <= upto else None
        keys = list(definition_keys(path, text))
        source = Source(text, path)
        formed = {}
        for key, node, _ in keys:
            forms = assignment.form_at(path, key, upto)
            if forms:
                where = f"step {upto}: {path}::{key}"
                formed[id(node)] = _earlier_form(source.block_text(node), forms, where, problems)
        later = [(key, node, cls) for key, node, cls in keys if assignment.step_of(path, key) > upto]
        kept_any = bool(formed) or any(assignment.step_of(path, key) <= upto for key, _, _ in keys)
        if file_step > upto and not kept_any:
            return None
        changed = [(key, node, cls) for key, node, cls in keys if id(node) in formed or (key, node, cls) in later]
        if not changed:
            return text
        restricted, removed_names = _remove(source, changed, keys, formed)
        used = _used_names(restricted)
        attributes = {
            node.attr
            for node in ast.walk(ast.parse(restricted))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        }
        for key in sorted(removed_names & used):
            problems.append(f"step {upto}: {path} uses `{key}`, which step {assignment.step_of(path, key)} brings")
        for key, node, cls in later:
            if cls is not None and id(node) not in formed and key.split(".", 1)[1] in attributes:
                problems.append(f"step {upto}: {path} uses `self.{key.split('.', 1)[1]}`, which a later step brings")
        return restricted

    restrict.problems = problems  # type: ignore[attr-defined]
    return restrict


def _earlier_form(block: str, forms: list[EarlierForm], where: str, problems: list[str]) -> str:
    """``block`` (our definition, or our file) with ``forms`` applied in turn; each ``old`` must be found exactly once.

    ``where`` names the definition or the file in the problems it records (``step k: path::Name``).

    """
    for form in forms:
        found = block.count(form.old)
        if found != 1:
            problems.append(
                f"{where}: the lines of its earlier form were found {found} times in ours (ours changed): update the"
                " form in `lightning_fsdp/upstream/_series.py`"
            )
            continue
        block = block.replace(form.old, form.new, 1)
    return block


def _remove(source: Source, later: list, keys: list, formed: dict[int, str] | None = None) -> tuple[str, set[str]]:
    """Remove the later steps' definitions and the imports that only they used.

    ``formed`` (a node's id: its earlier form) replaces definitions instead, whichever step carries them.

    """
    formed = formed or {}
    edits = []
    removed_names: set[str] = set()
    removed_members: dict[int, int] = {}
    classes: dict[int, ast.ClassDef] = {}
    for key, node, cls in later:
        if id(node) in formed:
            continue
        if cls is not None:
            removed_members[id(cls)] = removed_members.get(id(cls), 0) + 1
            classes[id(cls)] = cls
        else:
            removed_names.add(key)
    members_of = {id(cls): sum(1 for _, _, owner in keys if owner is cls) for cls in classes.values()}
    for _key, node, cls in later:
        if id(node) in formed:
            edits.append(Edit(*source.block(node), formed[id(node)]))
            continue
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
    assignment: _Assignment | None = None

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
            *self._forms(number),
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
        if PACKAGE_NAME.search(text):
            raise UpstreamError(f"the description of step {number} names the package")
        return text

    def _forms(self, number: int) -> list[str]:
        """The lines that say which definitions this step brings in an earlier form, changes, or completes."""
        if self.assignment is None:
            return []
        total = len(self.steps)
        lines = []
        for (path, key), forms in sorted(self.assignment.forms.items()):
            name = key or _upstream_path(path)
            for end in sorted({end for _, end, _ in forms}):
                ending = [(given_by, form) for given_by, other, form in forms if other == end]
                here = [form for given_by, form in ending if given_by == number]
                earlier = [given_by for given_by, _ in ending if given_by < number]
                previous = [form for given_by, form in ending if earlier and given_by == max(earlier)]
                until = f"completed in ({end}/{total})"
                if here and not previous:
                    lines.append(f"- `{name}` comes in an earlier form, {until}: {_reasons(here)}")
                elif here and here != previous:
                    lines.append(f"- `{name}` keeps an earlier form, {until}: {_reasons(here)}")
                elif number == end:
                    lines.append(f"- `{name}` replaces its earlier form of ({max(earlier)}/{total}).")
        return ["", *lines] if lines else []

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


def _upstream_path(path: str) -> str:
    """Where the command writes one of our files (descriptions name upstream's paths, never ours)."""
    for ours, theirs in destinations().items():
        if path == ours or (ours.endswith("/") and path.startswith(ours)):
            return theirs + path[len(ours) :] if ours.endswith("/") else theirs
    raise UpstreamError(f"{path} has no destination upstream")


def _reasons(forms: list[EarlierForm]) -> str:
    return "; ".join(dict.fromkeys(form.reason.rstrip(".") for form in forms)) + "."


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
    return Series(root, steps, plans, assignment)


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
