# lightning-fsdp: package-only (it redirects upstream's classes to this package's)
"""A pytest plugin that makes Lightning's own tests run against this package's strategies.

Loaded with ``-p redirect_strategies`` (its folder on ``PYTHONPATH``) before Lightning's test modules are imported:
``lightning.fabric.strategies.FSDPStrategy`` and ``ModelParallelStrategy`` (and the names in their modules, which
upstream's tests patch as ``lightning.fabric.strategies.fsdp.FSDPStrategy.broadcast``), and the registry entries that
``Fabric(strategy="fsdp")`` resolves, become this package's subclasses. Patches of upstream's module-level helpers
(``lightning.fabric.strategies.model_parallel._has_dtensor_modules``) reach the subclasses because they call those
helpers through their upstream module.
"""

import lightning.fabric.strategies as strategies
import lightning.fabric.strategies.fsdp as fsdp
import lightning.fabric.strategies.model_parallel as model_parallel

import lightning_fsdp

_UPSTREAM = {strategies.FSDPStrategy: lightning_fsdp.FSDPStrategy}
_UPSTREAM[strategies.ModelParallelStrategy] = lightning_fsdp.ModelParallelStrategy

for module in (strategies, fsdp, model_parallel):
    for name, upstream in vars(module).copy().items():
        if isinstance(upstream, type) and upstream in _UPSTREAM:
            setattr(module, name, _UPSTREAM[upstream])
for entry in strategies.STRATEGY_REGISTRY.values():
    if entry["strategy"] in _UPSTREAM:
        entry["strategy"] = _UPSTREAM[entry["strategy"]]
