"""The Trainer's full checkpoints without a gather: each rank writes its own slices into the one file.

The Trainer builds a checkpoint in two steps: ``dump_checkpoint`` asks the strategy for the model's and each
optimizer's state (where upstream gathers everything on rank 0), calls the ``on_save_checkpoint`` hooks, and hands the
dict to ``strategy.save_checkpoint``. This package's Trainer strategies answer the first step with empty stand-ins
(:class:`Deferred`) and, in the second, write the file with :func:`lightning_fsdp.saving.save_full_checkpoint` from the
model and optimizers themselves: the same bytes as upstream's file (the optimizer states keyed by parameter index, as
upstream writes them), no gather. Where a hook changed a stand-in, or the writer cannot serve the state, the states
are gathered as upstream gathers them, with one warning.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp.layouts.targets import clean_name
from lightning_fsdp.loading.errors import load_errors_printed_once_per_node
from lightning_fsdp.saving import save_full_checkpoint

_MODEL_KEY = "state_dict"
_OPTIMIZERS_KEY = "optimizer_states"


class Deferred(dict):
    """An empty stand-in for a state that the save writes without a gather (``source``: the model or an optimizer).

    It is a ``dict``, empty, as upstream's state is on every rank but rank 0, so that code reading it between the two
    steps sees a dict.

    """

    def __init__(self, source: Module | Optimizer) -> None:
        super().__init__()
        self.source = source


_warned: set[str] = set()


def hooks_allow_stand_ins(trainer: Any) -> bool:
    """Whether no ``on_save_checkpoint`` hook that could read or change the states runs (else, one warning).

    The LightningModule's, the datamodule's and every callback's hook get the checkpoint with the states in it, and
    may filter them (Lightning's ``ModelPruning`` and ``WeightAveraging`` do): such a save gathers, as upstream's.

    """
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if trainer is None:
        return True
    owners = [
        type(callback).__name__
        for callback in trainer.callbacks
        if is_overridden("on_save_checkpoint", callback, pl.Callback)
    ]
    if is_overridden("on_save_checkpoint", trainer.lightning_module, pl.LightningModule):
        owners.append(type(trainer.lightning_module).__name__)
    datamodule = trainer.datamodule
    if datamodule is not None and is_overridden("on_save_checkpoint", datamodule, pl.LightningDataModule):
        owners.append(type(datamodule).__name__)
    if not owners:
        return True
    reason = ", ".join(f"`{owner}.on_save_checkpoint`" for owner in owners)
    if reason not in _warned:
        _warned.add(reason)
        rank_zero_warn(
            "The full checkpoint is saved by gathering it on rank 0 (Lightning's way), not by every rank writing its"
            f" own slices, because {reason} may read or change the model's and optimizers' states in the checkpoint."
        )
    return False


def gather_free_state(checkpoint: dict[str, Any], model: Module) -> dict[str, Any] | None:
    """The checkpoint with the model and optimizers in the place of their stand-ins; ``None`` if a hook changed one."""
    optimizers = checkpoint.get(_OPTIMIZERS_KEY, [])
    stand_ins = [checkpoint.get(_MODEL_KEY), *optimizers]
    if not all(isinstance(stand_in, Deferred) and not stand_in for stand_in in stand_ins):
        if any(isinstance(stand_in, Deferred) for stand_in in stand_ins):  # e.g. a hook of a datamodule given later
            rank_zero_warn(
                "The full checkpoint is saved by gathering it on rank 0 (Lightning's way), not by every rank writing"
                " its own slices, because an `on_save_checkpoint` hook changed the model's or an optimizer's state"
                " in the checkpoint."
            )
        return None
    state = dict(checkpoint)
    state[_MODEL_KEY] = model
    if _OPTIMIZERS_KEY in state:
        state[_OPTIMIZERS_KEY] = [stand_in.source for stand_in in optimizers]
    return state


def fill_gathered(
    checkpoint: dict[str, Any],
    gather_model: Callable[[], dict[str, Any]],
    gather_optimizer: Callable[[Optimizer], dict[str, Any]],
) -> None:
    """Replace the stand-ins of ``checkpoint`` by the states that upstream gathers, for upstream's save.

    What a hook wrote into a stand-in is written over the gathered state (a hook that filtered it could not: such
    hooks make :func:`hooks_allow_stand_ins` refuse the stand-ins in the first place).

    """
    if not isinstance(checkpoint, dict):
        return  # upstream's save raises its own error for it
    stand_in = checkpoint.get(_MODEL_KEY)
    if isinstance(stand_in, Deferred):
        checkpoint[_MODEL_KEY] = {**gather_model(), **stand_in}
    if _OPTIMIZERS_KEY in checkpoint:
        checkpoint[_OPTIMIZERS_KEY] = [
            {**gather_optimizer(state.source), **state} if isinstance(state, Deferred) else state
            for state in checkpoint[_OPTIMIZERS_KEY]
        ]


def save_without_gather(strategy: Any, checkpoint: dict[str, Any], filepath: Any, fsdp2: bool) -> bool:
    """Write the Trainer's full ``checkpoint`` from the model and optimizers behind its stand-ins, without a gather.

    The folder is created as the Trainer's checkpoint IO creates it. Returns ``False`` where the caller must gather
    (a hook changed a stand-in, or the writer cannot serve the state: it warned why), having written nothing.

    """
    state = gather_free_state(checkpoint, strategy.model)
    if state is None:
        return False
    path = Path(strategy.broadcast(filepath))
    if strategy.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
    names = parameter_names(strategy.model)
    with load_errors_printed_once_per_node(strategy.global_rank, strategy.local_rank):
        return save_full_checkpoint(
            strategy,
            path,
            state,
            None,
            strategy.model,
            fsdp2,
            _OPTIMIZERS_KEY,
            names,
            modules_first=False,
            background=strategy._background_saves,
        )


def parameter_names(model: Module) -> list[str]:
    """The names that index the Trainer's optimizer states: ``model.parameters()``'s order, wrappers' names removed."""
    return [clean_name(name) for name, _ in model.named_parameters()]
