"""One call that makes unmodified scripts, which construct upstream's ``FSDPStrategy``, use this package's.

Downstream code (litgpt, user scripts) writes ``from lightning.fabric.strategies import FSDPStrategy`` or
``Fabric(strategy="fsdp")``. After :func:`enable`, constructing upstream's class returns an instance of
:class:`lightning_fsdp.FSDPStrategy` (a subclass, so every ``isinstance`` check still holds), whenever the name was
imported. Nothing changes for code that never constructs the class, and :func:`disable` restores upstream exactly.

Upstream destination: none; once the strategy is upstream, this module is no longer needed.
"""

from typing import Any

from lightning.fabric.strategies import FSDPStrategy as _UpstreamFSDPStrategy

from lightning_fsdp.strategy import FSDPStrategy

_state = {"enabled": False}


def enable() -> None:
    """Make every ``lightning.fabric.strategies.FSDPStrategy(...)`` construct a :class:`lightning_fsdp.FSDPStrategy`.

    It covers the class however it was imported (before or after this call) and ``Fabric(strategy="fsdp")``.
    Calling it again does nothing; :func:`disable` undoes it. Call it once, at the top of the script, before the
    strategy is created::

        import lightning_fsdp

        lightning_fsdp.enable()

    """
    if "__new__" not in _UpstreamFSDPStrategy.__dict__:
        # Installed once and left in place: CPython cannot cleanly remove a ``__new__`` assigned after class
        # creation, so ``disable`` switches the hook off instead.
        _UpstreamFSDPStrategy.__new__ = _construct  # type: ignore[method-assign]
    _state["enabled"] = True


def disable() -> None:
    """Undo :func:`enable`: upstream's class constructs upstream's strategy again. Does nothing if not enabled."""
    _state["enabled"] = False


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _state["enabled"]


def _construct(cls: type, *args: Any, **kwargs: Any) -> Any:
    # Python then calls ``__init__`` of the returned instance's class with the same arguments, because it is an
    # instance of ``cls``: upstream's arguments reach this package's ``__init__``, which accepts all of them.
    if cls is _UpstreamFSDPStrategy and _state["enabled"]:
        cls = FSDPStrategy
    return object.__new__(cls)
