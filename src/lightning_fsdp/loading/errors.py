"""The one error type that every checkpoint-loading failure raises, on every rank, and how file text reaches it.

Any text that comes from a file (tensor names, keys, shard file names, the global names that torch's unpickler quotes
in its errors) may hold control characters: an escape sequence that retitles or clears a terminal, a newline that
forges a log line. Such text reaches a message only through :func:`printable`, :func:`first_line` (an exception's
text) or :func:`quoted_names` (names), or as ``repr`` quotes it (``{name!r}``).
"""

import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

#: Names listed in one message, before ``... (N more)``.
SHOWN_NAMES = 5


class CheckpointLoadError(RuntimeError):
    """A checkpoint could not be loaded. The message names what is wrong and how to fix it.

    Args:
        message: What went wrong, and the fix.
        failed_ranks: The global ranks on which the failure happened (empty when it was detected on every rank alike).
        cause: The exception on this rank that the message reports, kept as :attr:`cause`.

    Attributes:
        cause: The exception on this rank that the message reports, with its own traceback, for debugging: ``None``
            where the error was raised where it happened, and on a rank that reports another rank's failure. The error
            is raised ``from unexpected_cause(cause)``, so that a traceback prints the cause only when it is unexpected
            (an I/O error, a bug): a ``CheckpointLoadError``'s text is in this message already, and the user reads the
            cause once and the fix once.

    """

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = (), cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.failed_ranks = tuple(failed_ranks)
        self.cause = cause


class CheckpointKeyError(CheckpointLoadError, KeyError):
    """The checkpoint has no entry that the state asks for (the model's key, an optimizer's, ``"step"``).

    It is also a ``KeyError``, the type that Lightning's own strategies raise there, so that code written against
    upstream (``except KeyError``) and code written against this package (``except CheckpointLoadError``) both catch it.

    """

    def __str__(self) -> str:
        # a `KeyError` shows the repr of its key; this one's argument is a message
        return BaseException.__str__(self)


class CheckpointValueError(CheckpointLoadError, ValueError):
    """A value that the load was given or found is invalid (an optimizer state that does not fit the optimizer).

    It is also a ``ValueError``, the type that Lightning's own strategies and the core raise there (see
    :class:`CheckpointKeyError`).

    """


class CheckpointPathError(CheckpointValueError):
    """The path holds no checkpoint: it does not exist, or it holds nothing that loads.

    It is also a ``ValueError``, the type that Lightning's own ``FSDPStrategy`` raises for a path it refuses, so that
    code written against upstream (``except ValueError``) and code written against this package
    (``except CheckpointLoadError``) both catch it.

    """


#: The types that upstream raises where this package raises a :class:`CheckpointLoadError` that is also one of them.
_UPSTREAM_TYPES: dict[str, tuple[type[Exception], type[CheckpointLoadError]]] = {
    "KeyError": (KeyError, CheckpointKeyError),
    "ValueError": (ValueError, CheckpointValueError),
}


def upstream_kind(error: BaseException) -> str | None:
    """The upstream type (``"KeyError"``, ``"ValueError"``) of a :class:`CheckpointLoadError` that is also one of them.

    Only the checks that stand for upstream's errors raise those; any other exception (a bug, an I/O error) has no
    kind, so that every rank reports it as a plain ``CheckpointLoadError``.

    """
    if not isinstance(error, CheckpointLoadError):
        return None
    return next((kind for kind, (base, _) in _UPSTREAM_TYPES.items() if isinstance(error, base)), None)


def error_class(kind: str | None) -> type[CheckpointLoadError]:
    """The :class:`CheckpointLoadError` that is also the upstream type named ``kind`` (see :func:`upstream_kind`)."""
    return _UPSTREAM_TYPES[kind][1] if kind in _UPSTREAM_TYPES else CheckpointLoadError


def unexpected_cause(cause: BaseException | None) -> BaseException | None:
    """The exception that a traceback should print under the ``CheckpointLoadError`` that reports ``cause``.

    Use it as ``raise CheckpointLoadError(message, cause=cause) from unexpected_cause(cause)``. It is the first
    exception in ``cause``'s chain that is not a ``CheckpointLoadError`` (an I/O error, a bug: its traceback says where
    it happened), or ``None``: a ``CheckpointLoadError``'s text is in the message that reports it already, and
    printing it again would show the user the same error twice.

    """
    while isinstance(cause, CheckpointLoadError):
        cause = cause.__cause__
    return cause


def printable(text: str) -> str:
    r"""``text`` with each character that a terminal would act on escaped as ``repr`` escapes it, the rest unchanged.

    Controls, escape sequences' ``ESC``, line breaks and invisible format characters become ``\x1b``, ``\n``,
    ``\u202e``: they are shown, never acted on.

    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def first_line(error: BaseException) -> str:
    """The first line of an error's message (or its type's name), escaped, for one-line error messages.

    Exceptions raised while reading a file (torch's unpickler, JSON) quote the file's text; it stays quoted, never raw.

    """
    text = str(error).strip()
    return printable(text.split("\n", 1)[0][:500]) if text else type(error).__name__


def described(error: BaseException) -> str:
    """``error`` for a message: its type and text, escaped, or a ``CheckpointLoadError``'s text as it is.

    A library's error may quote the file's text; a ``CheckpointLoadError`` has its file text escaped already.

    """
    return str(error) if isinstance(error, CheckpointLoadError) else printable(f"{type(error).__name__}: {error}")


def quoted_names(names: Iterable[Any]) -> str:
    """The first :data:`SHOWN_NAMES` of ``names``, each quoted by ``repr``, and how many more there are."""
    return shown_items([repr(name) for name in names])


def shown_items(items: Sequence[str]) -> str:
    """The first :data:`SHOWN_NAMES` of ``items`` (formatted, file text escaped), and how many more there are."""
    shown = ", ".join(items[:SHOWN_NAMES])
    return shown + (f", ... ({len(items) - SHOWN_NAMES} more)" if len(items) > SHOWN_NAMES else "")


#: Set to ``1`` to have every rank print a failed load's traceback, not only local rank 0 of each node.
ERRORS_ON_EVERY_RANK_ENV = "LIGHTNING_FSDP_ERRORS_ON_EVERY_RANK"
#: The attribute that marks an error that local rank 0 of this node prints: the same text, agreed by every rank.
_PRINTED_BY_LOCAL_RANK_ZERO = "_checkpoint_load_error_printed_by_local_rank_zero"


@contextmanager
def load_errors_printed_once_per_node(global_rank: int, local_rank: int) -> Iterator[None]:
    """Let an agreed load (or save) error that leaves the script be printed in full by local rank 0 of each node only.

    Every rank still raises the same :class:`~lightning_fsdp.CheckpointLoadError` (code that catches it sees it on
    every rank, and an uncaught one still ends every process with a non-zero exit code); only the interpreter's
    printing of an uncaught one, ``sys.excepthook``, is shortened on the other ranks, to one line that says where the
    error is. It applies to an error that the ranks agreed on (it names the failed ranks) and that chains no other
    exception: an I/O error or a bug behind it (``__cause__``) is this rank's own, and is printed in full where it
    happened. The cause stays on the exception (``error.cause``), and :data:`ERRORS_ON_EVERY_RANK_ENV` set to ``1``
    prints every rank's traceback.

    """
    try:
        yield
    except Exception as error:
        # a load's `CheckpointLoadError`, or a save's `CheckpointSaveError`: both name the ranks that failed
        every_rank = os.environ.get(ERRORS_ON_EVERY_RANK_ENV, "0") not in ("", "0")
        failed_ranks = getattr(error, "failed_ranks", None)
        if local_rank != 0 and failed_ranks and error.__cause__ is None and not every_rank:
            setattr(error, _PRINTED_BY_LOCAL_RANK_ZERO, global_rank)
            _install_excepthook()
        raise


def _install_excepthook() -> None:
    """Chain :func:`_print_once_per_node` in front of the current ``sys.excepthook`` (torch's, after ``init``)."""
    if getattr(sys.excepthook, "_prints_checkpoint_load_errors_once", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
        rank = getattr(error, _PRINTED_BY_LOCAL_RANK_ZERO, None)
        if rank is None:
            previous(kind, error, traceback)
            return
        # One write with its newline: with unbuffered output (`PYTHONUNBUFFERED`, `python -u`) `print` writes the
        # text and the newline apart, and another rank's output to the same terminal can land between them.
        sys.stderr.write(
            f"[rank{rank}]: {kind.__name__}: the same error as local rank 0 prints (set {ERRORS_ON_EVERY_RANK_ENV}=1"
            " to print it on every rank)\n"
        )
        sys.stderr.flush()

    hook._prints_checkpoint_load_errors_once = True  # type: ignore[attr-defined]
    sys.excepthook = hook
