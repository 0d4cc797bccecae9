"""What the four strategies of this package add alike to Lightning's: options per load, and saves in the background.

Fabric's :class:`lightning_fsdp.FSDPStrategy` and :class:`lightning_fsdp.ModelParallelStrategy`, and the Trainer's
:class:`lightning_fsdp.pytorch.FSDPStrategy` and :class:`lightning_fsdp.pytorch.ModelParallelStrategy`, list
:class:`CheckpointOptions` first among their bases, so that its methods are theirs and its ``teardown`` runs before
Lightning's.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from contextlib import AbstractContextManager
from typing import Any, Literal

from torch.optim import Optimizer

from lightning_fsdp.loading.validation import Rename
from lightning_fsdp.loading_calls import init_loading_options, load_options
from lightning_fsdp.saving.background import BackgroundSaves, wait_for_save


class CheckpointOptions:
    """The loader's options (:meth:`load_options`) and the saves in the background (:meth:`wait_for_save`)."""

    _background_saves: BackgroundSaves | None

    def _init_checkpoint_options(
        self, load_concurrency: int | Literal["auto"], load_progress: bool, save_in_background: bool
    ) -> None:
        """Check and set the package's own arguments of the strategy (see :class:`lightning_fsdp.FSDPStrategy`)."""
        init_loading_options(self, load_concurrency, load_progress)  # type: ignore[arg-type]
        self._background_saves = BackgroundSaves() if save_in_background else None

    def load_options(
        self,
        rename: Rename | None = None,
        storage_options: dict[str, Any] | None = None,
        request_timeout: float | None = None,
        stall_timeout: float | None = None,
    ) -> AbstractContextManager:
        """Options for the loads inside the ``with`` block: ``fabric.load`` and ``fabric.load_raw`` take none.

        Example::

            with fabric.strategy.load_options(rename={"model.": "", "lm_head.": None}):
                fabric.load_raw("LlamaForCausalLM/model.safetensors.index.json", base_model)

        With the Trainer, the :class:`~lightning_fsdp.pytorch.LoadWeights` callback takes the same options.

        Args:
            rename: Maps the checkpoint's names to the model's, without a copy of the file: a mapping of prefixes
                (``{"model.": ""}`` removes one, ``{"": "model."}`` adds one, ``{"lm_head.": None}`` leaves those
                tensors out; the longest matching prefix wins, other names are kept) or a callable (checkpoint name
                -> model name, or ``None`` to leave the tensor out). ``{}`` keeps every name as it is. By default
                (``None``), a single prefix that makes every model tensor match is removed or added automatically,
                and rank 0 says so. Checkpoint files only: a sharded checkpoint is refused with a rename.

            storage_options: Options of the fsspec file system that reads a checkpoint URL (``s3://...``), such as
                ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for ``s3fs``. By default fsspec's usual
                configuration applies (environment variables, the provider's config files).

            request_timeout: Object storage only: seconds after which a request that has received nothing (no
                answer, or no byte of its body) is abandoned: a read of a range is tried again (5 attempts at most),
                a request for an object's size or a listing ends the load. Default: 30.

            stall_timeout: Object storage only: seconds after which a rank whose requests have received no byte,
                retries included, ends the load with a :class:`~lightning_fsdp.CheckpointLoadError` on every rank
                naming the object and the range. Default: 60. Both hold for the file systems that fsspec runs
                asynchronously (``s3://``, ``gs://``, ``az://``).

        Raises:
            TypeError: If ``rename`` is neither a mapping of prefixes nor a callable, or ``storage_options`` not a dict.
            ValueError: If a timeout is not a number of seconds greater than 0.

        """
        return load_options(self, rename, storage_options, request_timeout, stall_timeout)  # type: ignore[arg-type]

    def wait_for_save(self) -> None:
        """Wait for the checkpoint being saved in the background, if any (``save_in_background=True``).

        Raises:
            CheckpointSaveError: On every rank, if that save failed: no file replaced the one at its path.

        """
        wait_for_save(self)

    def optimizer_step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Lightning's optimizer step; then, with ``save_in_background=True``, the saves' host memory is made ready.

        After an optimizer's first step, a thread allocates the memory that a save in the background copies the rank's
        slices into (:meth:`~lightning_fsdp.saving.background.HostBuffers.reserve_for`), so that the first save does
        not wait for it.

        """
        output = super().optimizer_step(optimizer, *args, **kwargs)  # type: ignore[misc]
        if self._background_saves is not None:
            self._background_saves.buffers.reserve_for(optimizer)
        return output

    def teardown(self) -> None:
        """Wait for a save in the background (and raise its error), then Lightning's teardown."""
        try:
            self.wait_for_save()
        finally:
            super().teardown()  # type: ignore[misc]
