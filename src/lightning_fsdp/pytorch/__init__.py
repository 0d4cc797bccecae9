"""The Trainer's strategies (``lightning.pytorch``), built on the same loading as Fabric's.

``Trainer(strategy=lightning_fsdp.pytorch.FSDPStrategy())`` runs on CPU ranks too, resumes from full checkpoints
shard-locally, and starts from weights that Lightning did not write with the :class:`LoadWeights` callback.
"""

from lightning_fsdp.pytorch.callbacks import LoadWeights
from lightning_fsdp.pytorch.fsdp import FSDPStrategy
from lightning_fsdp.pytorch.model_parallel import ModelParallelStrategy

__all__ = ["FSDPStrategy", "LoadWeights", "ModelParallelStrategy"]
