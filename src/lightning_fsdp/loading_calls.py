"""What both strategies do around the loader: the request from Fabric's ``state``, per-load options, the rank info.

:class:`lightning_fsdp.FSDPStrategy` (FSDP1) and :class:`lightning_fsdp.ModelParallelStrategy` (FSDP2) check their
arguments as their upstream classes do, then both call :func:`load_into_state`.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.load import _move_state_into
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.distributed.agreement import new_namespace
from lightning_fsdp.loading.errors import CheckpointLoadError, CheckpointPathError, unexpected_cause
from lightning_fsdp.loading.files import CheckpointPath, StoragePath
from lightning_fsdp.loading.formats import detect_checkpoint
from lightning_fsdp.loading.loader import LoadOptions, LoadRequest, LoadResult, RankInfo, load
from lightning_fsdp.loading.remote import is_remote, remote_path
from lightning_fsdp.loading.remote_requests import RemoteTimeouts
from lightning_fsdp.loading.turns import validate_concurrency
from lightning_fsdp.loading.validation import Rename, check_rename


class LoadingStrategy(Protocol):
    """The attributes of a strategy that loading reads (both strategies of this package have them)."""

    load_concurrency: int | Literal["auto"]
    load_progress: bool
    _load_rename: Rename | None
    _load_storage_options: Mapping[str, Any] | None
    _load_remote_timeouts: RemoteTimeouts

    @property
    def world_size(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


class _LoadStart(NamedTuple):
    """What rank 0 sends every rank when a load starts."""

    path: _PATH
    namespace: str


def init_loading_options(strategy: LoadingStrategy, concurrency: Any, progress: bool) -> None:
    """Check and set the loading arguments that both strategies take, and clear the per-load options."""
    strategy.load_concurrency = validate_concurrency(concurrency)
    strategy.load_progress = progress
    strategy._load_rename = None
    strategy._load_storage_options = None
    strategy._load_remote_timeouts = RemoteTimeouts()


def checkpoint_path(strategy: LoadingStrategy, path: Any) -> CheckpointPath:
    """The broadcast ``path`` as the loader reads it: a local ``Path``, or a URL in object storage (``s3://...``).

    A URL is kept as a string (``Path`` would collapse its ``//``) and opened through fsspec with the
    ``storage_options`` of :func:`load_options`.

    """
    if is_remote(path):
        return remote_path(str(path), strategy._load_storage_options, strategy._load_remote_timeouts)
    return Path(path)


def load_request(
    state: Module | dict[str, Any], module_key: str | None, strict: bool, weights_only: bool, rename: Rename | None
) -> LoadRequest:
    """What to load: a module alone (``load_raw``), or the module under ``module_key``, its optimizers and the rest."""
    if isinstance(state, Module):
        return LoadRequest(state, None, strict=strict, weights_only=weights_only, rename=rename)
    assert module_key is not None
    optimizers = {key: obj for key, obj in state.items() if isinstance(obj, Optimizer)}
    metadata_keys = frozenset(state) - {module_key} - set(optimizers)
    return LoadRequest(state[module_key], module_key, optimizers, metadata_keys, strict, weights_only, rename=rename)


def broadcast_load_path(strategy: LoadingStrategy, path: _PATH) -> tuple[CheckpointPath, str]:
    """Rank 0's ``path``, and a namespace new to this load for its agreements: the path broadcast carries both.

    Every rank runs this collective before the load, so every rank meets the others under the same namespace, whatever
    it did or failed to do in an earlier load (see :class:`~lightning_fsdp.distributed.agreement.Agreement`).

    """
    start = strategy.broadcast(_LoadStart(path, new_namespace()))
    if not isinstance(start, _LoadStart):
        # A broadcast patched to answer with the path alone (as a test of upstream's behaviour does): one process.
        return checkpoint_path(strategy, start), new_namespace()
    return checkpoint_path(strategy, start.path), start.namespace


def load_into_state(
    strategy: LoadingStrategy,
    path: CheckpointPath,
    state: Module | dict[str, Any],
    request: LoadRequest,
    namespace: str,
) -> Any:
    """Run the load, warn about what ``strict=False`` skipped, move the metadata into ``state``; return the rest.

    ``namespace`` comes from :func:`broadcast_load_path`.

    """
    options = LoadOptions(
        strategy.load_concurrency, progress=None if strategy.load_progress else False, namespace=namespace
    )
    try:
        result: LoadResult = load(path, request, rank_info(strategy), options)
    except CheckpointLoadError as error:
        if error.cause is None and not error.failed_ranks:
            raise  # raised where it happened (a single process): its frames say where
        # A report of a failure (this rank's keeps its own traceback, as `error.cause`): the frames of the machinery
        # that raised the report on every rank would only push the cause and the fix apart on the user's screen.
        raise error.with_traceback(None) from error.__cause__
    if result.skipped:
        rank_zero_warn(f"Loaded {str(path)!r} with `strict=False`: {result.skipped}.")
    if isinstance(state, Module):
        return {}
    _move_state_into(source=result.metadata, destination=state, keys=request.metadata_keys)
    return result.remainder


def rank_info(strategy: LoadingStrategy) -> RankInfo:
    """Where this process sits; a single process when the strategy was not launched (no process group)."""
    if not _distributed_is_initialized():
        # Not launched (a strategy used directly, as in unit tests): a single process, as upstream assumes.
        return RankInfo()
    return RankInfo(
        world_size=strategy.world_size,
        node_rank=strategy.node_rank,
        local_rank=strategy.local_rank,
        local_world_size=strategy.num_processes,
    )


@contextmanager
def load_options(
    strategy: LoadingStrategy,
    rename: Rename | None,
    storage_options: Mapping[str, Any] | None = None,
    request_timeout: float | None = None,
    stall_timeout: float | None = None,
) -> Iterator[None]:
    """Set the options of the loads inside the block on ``strategy``, and restore the previous ones after it."""
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


def raise_if_path_refused(path: CheckpointPath, error: Exception, raw: bool, strategy: str, shards: str) -> None:
    """Raise a :class:`CheckpointPathError` (a ``ValueError``, as upstream's) instead of ``error`` where it applies.

    Upstream refuses, for ``fabric.load_raw``, anything but a file, and for ``fabric.load``, anything but a file or a
    directory with a distributed checkpoint's ``.metadata``. This package reads more (Hugging Face directories, a
    sharded checkpoint for ``load_raw``), so it only answers with upstream's type where the path holds nothing it reads
    either: the format detection fails here too. The load already ran on every rank, so deciding here after the fact
    keeps the ranks together. The message says first what is wrong, as the load found it; for a path that exists,
    the text of upstream's ``strategy`` follows (``shards`` names the sharded format in it), for code that matches it.

    """
    try:
        if path.is_file() or (not raw and not isinstance(path, StoragePath) and _is_sharded_checkpoint(path)):
            return
        try:
            detect_checkpoint(path)
        except CheckpointLoadError as detection_error:
            reported = error if isinstance(error, CheckpointLoadError) else detection_error
        else:
            return
        exists = path.exists()
    except CheckpointLoadError:  # the store cannot be asked (it denies access, it stopped answering): the error stands
        return
    message = str(reported)
    if exists:
        if raw:
            upstream_message = (
                "Failed to load checkpoint directly into the model. The given path must be a single file containing"
                f" the full state dict: {path}"
            )
        else:
            upstream_message = (
                f"The path {str(path)!r} does not point to a valid checkpoint. Make sure the path points to either a"
                f" directory with {shards}, or a single file with a full checkpoint."
            )
        message += f"\n(Lightning's own `{strategy}` refuses it too: {upstream_message})"
    refused = CheckpointPathError(message, reported.failed_ranks, cause=reported)
    raise refused from unexpected_cause(reported)
