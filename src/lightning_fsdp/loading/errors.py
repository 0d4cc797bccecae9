"""The one error type that every checkpoint-loading failure raises, on every rank."""


class CheckpointLoadError(RuntimeError):
    """A checkpoint could not be loaded. The message names what is wrong and how to fix it.

    Args:
        message: What went wrong, and the fix.
        failed_ranks: The global ranks on which the failure happened (empty when it was detected on every rank alike).

    """

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.failed_ranks = tuple(failed_ranks)
