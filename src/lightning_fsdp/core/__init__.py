"""The core: what goes to Lightning as a series of pull requests, one module per destination.

``load.py`` goes to ``lightning/fabric/utilities/load.py``, ``fsdp.py`` to ``lightning/fabric/strategies/fsdp.py`` and
``model_parallel.py`` to ``lightning/fabric/strategies/model_parallel.py``. The core imports nothing from the rest of
the package; the package's strategies add their extensions on top of it.
"""
