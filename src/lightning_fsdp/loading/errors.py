"""The one error type that every checkpoint-loading failure raises, on every rank."""


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


class CheckpointPathError(CheckpointLoadError, ValueError):
    """The path holds no checkpoint: it does not exist, or it holds nothing that loads.

    It is also a ``ValueError``, the type that Lightning's own ``FSDPStrategy`` raises for a path it refuses, so that
    code written against upstream (``except ValueError``) and code written against this package
    (``except CheckpointLoadError``) both catch it.

    """


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
