"""A pytest plugin (``-p pytest_enable_lightning_fsdp``): Lightning's own tests run with ``lightning_fsdp.enable()``.

Every ``FSDPStrategy(...)`` and ``ModelParallelStrategy(...)`` that Lightning's tests construct, Fabric's and the
Trainer's, and every ``Trainer(strategy="fsdp")``, is then this package's class (tools/test_trainer_drop_in.sh,
tools/test_fabric_drop_in.sh).
"""

import lightning_fsdp

lightning_fsdp.enable()


def pytest_configure(config: object) -> None:
    """Refuse to run if the tests would not reach this package's classes (a run that proves nothing)."""
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    import lightning_fsdp.pytorch

    assert type(FSDPStrategy()) is lightning_fsdp.pytorch.FSDPStrategy
    assert type(ModelParallelStrategy()) is lightning_fsdp.pytorch.ModelParallelStrategy
    assert type(FabricFSDPStrategy()) is lightning_fsdp.FSDPStrategy
    assert type(FabricModelParallelStrategy(lambda model, _: model)) is lightning_fsdp.ModelParallelStrategy
