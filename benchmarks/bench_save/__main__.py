"""``python -m benchmarks.bench_save``: see ``benchmarks/README.md`` (``bench_save``)."""

import sys

from benchmarks.bench_save.run import main

if __name__ == "__main__":
    sys.exit(main())
