"""Run the benchmark: ``python benchmarks/bench_load ...``, or ``python -m benchmarks.bench_load ...`` from the root.

The rank processes run this too, as ``python benchmarks/bench_load --_worker CONFIG``, and the S3 server of the remote
implementations as ``python benchmarks/bench_load --_object_store PORT_FILE:SERVER``.
"""

import os
import sys
from pathlib import Path

if not __package__:
    # Run as a directory: Python put the package's own folder first on the path; put its parent there instead, so that
    # the package imports by its name and its modules never shadow top-level ones.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    __package__ = "bench_load"  # lets the relative imports below work

if len(sys.argv) == 3 and sys.argv[1] == "--_worker":
    from .worker import run_worker

    code = run_worker(sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the result is written: skip the seconds that tearing down torch and gloo take

if len(sys.argv) == 3 and sys.argv[1] == "--_object_store":
    from .object_store import main_server

    main_server()

from .cli import main

sys.exit(main())
