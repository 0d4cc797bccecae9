"""One call that makes unmodified scripts, which construct upstream's ``FSDPStrategy``, use this package's.

Downstream code (litgpt, user scripts) writes ``from lightning.fabric.strategies import FSDPStrategy`` or
``Fabric(strategy="fsdp")``. After :func:`enable`, constructing upstream's class returns an instance of
:class:`lightning_fsdp.FSDPStrategy` (a subclass, so every ``isinstance`` check still holds), whenever the name was
imported, and ``Fabric(accelerator="cpu", strategy="fsdp")`` is accepted as it is with this package's class. Nothing
changes for code that never constructs the class, and :func:`disable` restores upstream exactly.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import inspect
from collections.abc import Callable
from typing import Any

from lightning.fabric.accelerators import CPUAccelerator
from lightning.fabric.connector import _Connector
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import FSDPStrategy as _UpstreamFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as _UpstreamModelParallelStrategy
from lightning.fabric.strategies.fsdp import _FSDP_ALIASES

from lightning_fsdp.model_parallel import ModelParallelStrategy
from lightning_fsdp.strategy import FSDPStrategy

#: Each upstream class that :func:`enable` redirects, and this package's class that it then constructs.
_REPLACEMENTS: dict[type, type] = {
    _UpstreamFSDPStrategy: FSDPStrategy,
    _UpstreamModelParallelStrategy: ModelParallelStrategy,
}

_state = {"enabled": False}
#: The Trainer's own check (``_AcceleratorConnector._check_strategy_and_fallback``), restored by :func:`disable`.
_trainer_checks: dict[str, Callable[..., None]] = {}
#: Upstream's own method, restored by :func:`disable`.
_check_strategy_and_fallback = _Connector._check_strategy_and_fallback


def enable() -> None:
    """Make every ``lightning.fabric.strategies.FSDPStrategy(...)`` construct a :class:`lightning_fsdp.FSDPStrategy`.

    Likewise, ``lightning.fabric.strategies.ModelParallelStrategy(...)`` (FSDP2) constructs a
    :class:`lightning_fsdp.ModelParallelStrategy`, and the Trainer's classes in ``lightning.pytorch.strategies`` the
    classes of :mod:`lightning_fsdp.pytorch`.

    It covers the class however it was imported (before or after this call), ``Fabric(strategy="fsdp")`` and
    ``Trainer(strategy="fsdp")``, which are then accepted with ``accelerator="cpu"`` too. Calling it again does
    nothing; :func:`disable` undoes it. Call it once, at the top of the script, before the strategy is created::

        import lightning_fsdp

        lightning_fsdp.enable()

    """
    _add_trainer_replacements()
    for upstream, ours in _REPLACEMENTS.items():
        if "__new__" not in upstream.__dict__:
            # Installed once and left in place: CPython cannot cleanly remove a ``__new__`` assigned after class
            # creation, so ``disable`` switches the hook off instead.
            upstream.__new__ = _constructor(upstream, ours)  # type: ignore[method-assign]
    _Connector._check_strategy_and_fallback = _check_strategy_and_fallback_on_cpu  # type: ignore[method-assign]
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    _AcceleratorConnector._check_strategy_and_fallback = _trainer_check_on_cpu  # type: ignore[method-assign]
    _state["enabled"] = True


def _add_trainer_replacements() -> None:
    """The Trainer's classes, imported here: a Fabric script that never calls :func:`enable` does not import them."""
    from lightning.pytorch.strategies import FSDPStrategy as _UpstreamTrainerFSDPStrategy
    from lightning.pytorch.strategies import ModelParallelStrategy as _UpstreamTrainerModelParallelStrategy
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from lightning_fsdp.pytorch import FSDPStrategy as TrainerFSDPStrategy
    from lightning_fsdp.pytorch import ModelParallelStrategy as TrainerModelParallelStrategy

    _REPLACEMENTS.setdefault(_UpstreamTrainerFSDPStrategy, TrainerFSDPStrategy)
    _REPLACEMENTS.setdefault(_UpstreamTrainerModelParallelStrategy, TrainerModelParallelStrategy)
    _trainer_checks.setdefault("upstream", _AcceleratorConnector._check_strategy_and_fallback)


def disable() -> None:
    """Undo :func:`enable`: upstream's class constructs upstream's strategy again. Does nothing if not enabled."""
    if _Connector.__dict__.get("_check_strategy_and_fallback") is _check_strategy_and_fallback_on_cpu:
        _Connector._check_strategy_and_fallback = _check_strategy_and_fallback  # type: ignore[method-assign]
    if "upstream" in _trainer_checks:
        from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

        _AcceleratorConnector._check_strategy_and_fallback = _trainer_checks["upstream"]  # type: ignore[method-assign]
    _state["enabled"] = False


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _state["enabled"]


def _constructor(upstream: type, ours: type) -> Callable[..., Any]:
    """The ``__new__`` hook of ``upstream``: it constructs ``ours`` while enabled."""

    def construct(cls: type, *args: Any, **kwargs: Any) -> Any:
        # Python then calls ``__init__`` of the returned instance's class with the same arguments, because it is an
        # instance of ``cls``: upstream's arguments reach this package's ``__init__``, which accepts all of them.
        if cls is upstream and _state["enabled"]:
            cls = ours
        return object.__new__(cls)

    # `inspect.signature(upstream class)` reads a class's `__new__` before its `__init__`: keep showing upstream's
    # parameters (tools such as jsonargparse build their arguments from them), also after `disable`.
    construct.__signature__ = inspect.signature(upstream.__init__)  # type: ignore[attr-defined]
    return construct


def _check_strategy_and_fallback_on_cpu(connector: _Connector) -> None:
    """Upstream's check, except that ``strategy="fsdp"`` with ``accelerator="cpu"`` is accepted.

    Upstream refuses the name on CPU but accepts a strategy instance whose class is not exactly its own: the name is
    resolved to this package's strategy first (upstream's registry entry, constructed through the hook above).

    """
    strategy, accelerator = connector._strategy_flag, connector._accelerator_flag
    on_cpu = accelerator == "cpu" or isinstance(accelerator, CPUAccelerator)
    if not (_state["enabled"] and on_cpu and isinstance(strategy, str) and strategy in _FSDP_ALIASES):
        return _check_strategy_and_fallback(connector)
    if strategy == "fsdp":
        connector._strategy_flag = STRATEGY_REGISTRY.get(strategy)
        return _check_strategy_and_fallback(connector)
    try:
        return _check_strategy_and_fallback(connector)
    except ValueError as error:
        # Offloading parameters to the CPU means nothing when the model already computes there, and FSDP pins the
        # offloaded memory, which needs an accelerator: keep upstream's refusal and say what does run on CPU.
        raise ValueError(
            f"{error} With `lightning_fsdp.enable()`, `Fabric(accelerator='cpu', strategy='fsdp')` runs on CPU, but"
            f" {strategy!r} (CPU offloading) needs an accelerator: use `strategy='fsdp'` on CPU."
        ) from None


def _trainer_check_on_cpu(connector: Any) -> None:
    """The Trainer's check, except that ``strategy="fsdp"`` with ``accelerator="cpu"`` is accepted.

    As for Fabric, the name is resolved first to the registry's strategy, which the hook above constructs as this
    package's class; the Trainer refuses only a strategy whose class is exactly its own.

    """
    from lightning.pytorch.accelerators import CPUAccelerator as TrainerCPUAccelerator
    from lightning.pytorch.strategies import StrategyRegistry

    upstream_check = _trainer_checks["upstream"]
    strategy, accelerator = connector._strategy_flag, connector._accelerator_flag
    on_cpu = accelerator == "cpu" or isinstance(accelerator, TrainerCPUAccelerator)
    if _state["enabled"] and on_cpu and strategy == "fsdp":
        connector._strategy_flag = StrategyRegistry.get(strategy)
    return upstream_check(connector)
