"""What the Trainer's strategies do around the loader: resume from a checkpoint, and load weights from elsewhere.

The Trainer asks its strategy for one thing, ``load_checkpoint(path)``: restore the model (and, when fitting, the
optimizers) in place and return the rest of the checkpoint, which Lightning restores as usual (loops, callbacks,
learning-rate schedulers). Both of this package's Trainer strategies (FSDP1 and FSDP2) answer it here, with the same
loader as Fabric's (:func:`lightning_fsdp.loading.loader.load`) and its glue (:mod:`lightning_fsdp.loading_calls`).

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.loading.errors import CheckpointLoadError, load_errors_printed_once_per_node
from lightning_fsdp.loading.files import CheckpointPath
from lightning_fsdp.loading.formats import CheckpointFormat, detect_checkpoint
from lightning_fsdp.loading.loader import LoadRequest
from lightning_fsdp.loading_calls import LoadingStrategy, broadcast_load_path, load_into_state, raise_if_path_refused

#: The entry of the module's state in the checkpoint file that the Trainer writes (and in the sharded directory of
#: its ``ModelParallelStrategy``; its ``FSDPStrategy`` writes ``"model"`` there).
_FILE_MODULE_KEY = "state_dict"
#: Where a file holds the optimizers' states (a list), and the keys of a sharded directory (``optimizer_0``, ...).
_FILE_OPTIMIZERS_KEY = "optimizer_states"
#: What the loader's errors suggest for loading a file's weights alone.
_WEIGHTS_ALONE = "`Trainer(callbacks=[lightning_fsdp.pytorch.LoadWeights(path)])`"


def resume(
    strategy: LoadingStrategy,
    checkpoint_path: _PATH,
    module: Module,
    optimizers: list[Optimizer],
    fitting: bool,
    strict: bool,
    weights_only: bool | None,
    name: str,
    sharded_module_key: str,
) -> dict[str, Any]:
    """Restore ``module`` and, when ``fitting``, the ``optimizers`` from a checkpoint; return its other entries.

    A file is read shard-locally: each rank reads and keeps only its slices of the model and of the optimizer state
    (``optimizer_states``, keyed by parameter names or, as the Trainer writes a full checkpoint, by index). Its other
    entries come back as they are stored. A sharded directory goes through the same validated reader as with Fabric.
    Outside of fitting (``trainer.validate(ckpt_path=...)``), the optimizers' states are left out, as upstream does.

    Args:
        strategy: The Trainer's strategy (this package's).
        checkpoint_path: The path passed to the Trainer (``"last"`` and ``"best"`` are resolved by then).
        module: The strategy's (wrapped) model.
        optimizers: The strategy's optimizers, in the order of the checkpoint's list.
        fitting: Whether the Trainer is fitting; only then are the optimizers restored.
        strict: Whether the names must match exactly (the LightningModule's ``strict_loading``).
        weights_only: Unpickle only tensors and plain containers, unless ``False``.
        name: The strategy's class name, for the errors that say what upstream refuses too.
        sharded_module_key: The entry of the module's state in a sharded directory that the strategy writes.

    """
    path, namespace = broadcast_load_path(strategy, checkpoint_path)
    sharded = _is_sharded(path)
    keyed = {f"optimizer_{index}": optimizer for index, optimizer in enumerate(optimizers)} if fitting else {}
    request = LoadRequest(
        module,
        sharded_module_key if sharded else _FILE_MODULE_KEY,
        keyed,
        strict=strict,
        weights_only=weights_only is not False,
        rename=strategy._load_rename,
        optimizer_list=None if sharded else _FILE_OPTIMIZERS_KEY,
        weights_alone=_WEIGHTS_ALONE,
    )
    return _load(strategy, path, request, namespace, name)


def load_weights(
    strategy: LoadingStrategy,
    path: _PATH,
    module: Module,
    strict: bool,
    weights_only: bool,
    name: str,
    sharded_module_key: str,
) -> dict[str, Any]:
    """Load only the model's weights from ``path``: a checkpoint that the Trainer wrote, or one it did not.

    A raw state dict (``torch.save(model.state_dict())``), a ``.safetensors`` file, a Hugging Face checkpoint (its
    index or folder), a sharded directory, or the ``state_dict`` of a Trainer checkpoint (its other entries are not
    restored). Returns the entries of the checkpoint that were not loaded.

    """
    path, namespace = broadcast_load_path(strategy, path)
    key = sharded_module_key if _is_sharded(path) else _FILE_MODULE_KEY
    request = LoadRequest(
        module,
        key,
        strict=strict,
        weights_only=weights_only,
        rename=strategy._load_rename,
        weights_alone=_WEIGHTS_ALONE,
    )
    return _load(strategy, path, request, namespace, name)


def is_fitting(trainer: Any) -> bool:
    """Whether ``trainer`` (``None`` for a module outside of one) is fitting: only then are optimizers restored."""
    return trainer is not None and trainer.state.fn == TrainerFn.FITTING


def _load(strategy: Any, path: CheckpointPath, request: LoadRequest, namespace: str, name: str) -> dict[str, Any]:
    with load_errors_printed_once_per_node(strategy.global_rank, strategy.local_rank):
        try:
            # `state` holds no metadata keys: every entry that was not loaded comes back
            return load_into_state(strategy, path, {}, request, namespace)
        except Exception as error:
            raise_if_path_refused(path, error, raw=False, strategy=name, shards="FSDP checkpoint shards")
            raise


def _is_sharded(path: CheckpointPath) -> bool:
    """Whether ``path`` is a sharded directory; a path that cannot be read is left to the load, which says why."""
    try:
        detected = detect_checkpoint(path)
    except CheckpointLoadError:
        return False
    return detected.format in (CheckpointFormat.FABRIC_SHARDED, CheckpointFormat.SAFETENSORS_SHARDS)
