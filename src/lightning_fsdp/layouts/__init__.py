"""Which slice of every tensor each rank holds in a sharded model, and the optimizer state sliced the same way.

``targets``: the model of what a layout answers (targets, runs, optimizer parameters); ``fsdp1``: the
``FullyShardedDataParallel`` layout; ``fsdp2``: the ``fully_shard`` / ``DTensor`` layout (and tensor parallelism);
``optimizer``: a rank's slices of a full optimizer state, on the core's function. Loading copies into these slices,
the gather-free save reads from them. Layer: shared infrastructure of the package's extensions, built on the core's
layouts (``lightning_fsdp.core``), not part of the core.
"""
