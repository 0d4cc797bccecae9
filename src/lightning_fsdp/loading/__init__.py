"""Checkpoint layouts and formats, shard-local copy into FSDP units, and the rank-staggered turn schedule.

This package knows torch and FSDP, but not Fabric: the strategy calls it. Upstream destination:
``src/lightning/fabric/utilities/load.py`` and the FSDP-specific parts of ``src/lightning/fabric/strategies/fsdp.py``.
"""
