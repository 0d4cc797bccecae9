"""Keep what a load prints short: torch's internal deprecation warnings silenced, a failed load printed once per node.

torch 2.13 warns, on every sharded save or load, that ``ShardedTensor``, ``FSDP.state_dict_type()``,
``_get_pg_default_device`` and DCP's ``load_state_dict`` are deprecated: about 80 lines a load, all about torch's
internals, none that a user can act on. They are filtered by category and message, only while one of our calls runs;
the same warnings from the user's own code still show. A load error that every rank raises is printed in full by
local rank 0 of each node, and in one line by the other ranks (:func:`load_errors_printed_once_per_node`).

Upstream destination: ``src/lightning/fabric/utilities/load.py``.
"""

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

#: (category, message pattern) of each warning that torch emits from inside our own calls.
_TORCH_INTERNAL_WARNINGS = (
    (FutureWarning, r".*we are deprecating ShardedTensor"),
    (FutureWarning, r"FSDP\.state_dict_type\(\) and FSDP\.set_state_dict_type\(\) are being deprecated"),
    (UserWarning, r"`_get_pg_default_device` will be deprecated"),
    (UserWarning, r"Multiple backends are registered with this ProcessGroup"),
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed in future versions"),
)


@contextmanager
def torch_internal_warnings_silenced() -> Iterator[None]:
    """Run the block with torch's warnings about its own deprecated internals filtered out."""
    with warnings.catch_warnings():
        for category, message in _TORCH_INTERNAL_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


#: Set to ``1`` to have every rank print a failed load's traceback, not only local rank 0 of each node.
ERRORS_ON_EVERY_RANK_ENV = "LIGHTNING_FSDP_ERRORS_ON_EVERY_RANK"
#: The attribute that marks an error that local rank 0 of this node prints: the same text, agreed by every rank.
_PRINTED_BY_LOCAL_RANK_ZERO = "_lightning_fsdp_printed_by_local_rank_zero"


@contextmanager
def load_errors_printed_once_per_node(global_rank: int, local_rank: int) -> Iterator[None]:
    """Let an agreed load error that leaves the script be printed in full by local rank 0 of each node only.

    Every rank still raises the same :class:`~lightning_fsdp.CheckpointLoadError` (code that catches it sees it on
    every rank, and an uncaught one still ends every process with a non-zero exit code); only the interpreter's
    printing of an uncaught one, ``sys.excepthook``, is shortened on the other ranks, to one line that says where the
    error is. It applies to an error that the ranks agreed on (it names the failed ranks) and that chains no other
    exception: an I/O error or a bug behind it (``__cause__``) is this rank's own, and is printed in full where it
    happened. The cause stays on the exception (``error.cause``), and :data:`ERRORS_ON_EVERY_RANK_ENV` set to ``1``
    prints every rank's traceback.

    """
    from lightning_fsdp.loading.errors import CheckpointLoadError

    try:
        yield
    except CheckpointLoadError as error:
        every_rank = os.environ.get(ERRORS_ON_EVERY_RANK_ENV, "0") not in ("", "0")
        if local_rank != 0 and error.failed_ranks and error.__cause__ is None and not every_rank:
            setattr(error, _PRINTED_BY_LOCAL_RANK_ZERO, global_rank)
            _install_excepthook()
        raise


def _install_excepthook() -> None:
    """Chain :func:`_print_once_per_node` in front of the current ``sys.excepthook`` (torch's, after ``init``)."""
    if getattr(sys.excepthook, "_lightning_fsdp", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
        rank = getattr(error, _PRINTED_BY_LOCAL_RANK_ZERO, None)
        if rank is None:
            previous(kind, error, traceback)
            return
        print(
            f"[rank{rank}]: {kind.__name__}: the same error as local rank 0 prints (set {ERRORS_ON_EVERY_RANK_ENV}=1"
            " to print it on every rank)",
            file=sys.stderr,
        )

    hook._lightning_fsdp = True  # type: ignore[attr-defined]
    sys.excepthook = hook
