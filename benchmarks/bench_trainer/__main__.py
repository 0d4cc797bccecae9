"""``python -m benchmarks.bench_trainer``: see ``benchmarks/README.md`` (``bench_trainer``)."""

import sys

from benchmarks.bench_trainer.run import main

if __name__ == "__main__":
    sys.exit(main())
