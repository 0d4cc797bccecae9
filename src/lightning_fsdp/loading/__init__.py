"""Reading checkpoints: formats, byte ranges, validation, object storage, sharded directories, the turns of a node.

Each rank copies only its own slices (:mod:`lightning_fsdp.layouts`) into the model. This package knows torch and
FSDP, but not Fabric: the strategy calls it. Layer: an extension of the package (docs/source-fabric/upstream.rst),
built on the core's layouts (``lightning_fsdp.core``), not part of the core.
"""
