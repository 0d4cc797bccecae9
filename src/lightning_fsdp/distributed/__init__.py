"""Rank coordination and host memory that loading and saving share.

``agreement``: every rank returns, or every rank raises the same error, agreed on the process group's key-value store
with a heartbeat (no collective); ``memory``: how much host memory a node can still give, and handing freed memory
back. Layer: shared infrastructure of the package's extensions (docs/source-fabric/upstream.rst), not part of the core.
"""
