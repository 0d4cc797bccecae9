"""Checkpoint layouts and formats, shard-local copy into FSDP units, and the rank-staggered turn schedule.

This package knows torch and FSDP, but not Fabric: the strategy calls it. Layer: an extension of the package
(docs/source-fabric/upstream.rst), built on the core's layouts (``lightning_fsdp.core``), not part of the core.
"""
