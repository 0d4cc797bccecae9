"""How fast this machine gives a process memory it has not touched yet: the probe behind ``bench_save``'s noise.

``python -m benchmarks.bench_save.first_touch`` (from the repository root) measures two things:

- *anonymous memory*: ``--gib`` GiB allocated and filled, one GiB after the other (each GiB's first touch), then
  freed and allocated again at once (the same pages, just freed);
- *page cache*: a new file of ``--file-mib`` MiB (one GiB by default) written by ``os.pwrite`` (blocks reserved
  first, then ``fsync``), three files kept side by side (each needs page-cache pages it did not have), then, after the
  three are deleted, two more (pages that the deletion just freed).

On a virtual machine whose balloon driver reports free memory back to the hypervisor (``virtio_balloon`` with free
page reporting), memory that has been free for a few seconds is given back, and touching it again costs a fault on
the host: there a GiB of it is filled, or written into the page cache, an order of magnitude slower than memory that
was freed a moment ago. A save writes its whole file into the page cache, so its time depends on which memory it
gets: that, not the disk, is most of what ``bench_save`` saw vary from one run to the next on the development machine.
The first GiBs of a run may come from memory that another process freed a moment before, and be fast.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

_GIB = 2**30
#: Linux's count of the free memory it has reported to the hypervisor (the free page reporting of virtio_balloon).
_REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def _reported_kib() -> int | None:
    try:
        return int(_REPORTED.read_text())
    except (OSError, ValueError):
        return None


def _fill_rate() -> float:
    start = time.perf_counter()
    tensor = torch.empty(_GIB, dtype=torch.uint8)
    tensor.fill_(1)
    seconds = time.perf_counter() - start
    del tensor
    return _GIB / seconds / 1e9


def _write_rate(path: Path, data: memoryview) -> tuple[float, float]:
    """Write ``data`` as a new file at ``path``: GB/s of the positioned writes, and the seconds of ``fsync``."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.posix_fallocate(descriptor, 0, data.nbytes)
        start = time.perf_counter()
        offset = 0
        while offset < data.nbytes:
            offset += os.pwrite(descriptor, data[offset : offset + 64 * 2**20], offset)
        writes = time.perf_counter() - start
        start = time.perf_counter()
        os.fsync(descriptor)
        return data.nbytes / writes / 1e9, time.perf_counter() - start
    finally:
        os.close(descriptor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="first_touch", description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=6, help="GiB of anonymous memory to allocate and fill")
    parser.add_argument("--file-mib", type=int, default=1024, help="MiB of each file written into the page cache")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args(argv)

    reported = _reported_kib()
    held = []
    for index in range(args.gib):
        start = time.perf_counter()
        tensor = torch.empty(_GIB, dtype=torch.uint8)
        tensor.fill_(1)
        held.append(tensor)
        print(f"anonymous memory, GiB {index + 1}, first touch: {_GIB / (time.perf_counter() - start) / 1e9:.2f} GB/s")
    del held, tensor
    rates = [_fill_rate() for _ in range(min(args.gib, 3))]
    print(f"anonymous memory, just freed, again: {', '.join(f'{rate:.2f}' for rate in rates)} GB/s")

    data = memoryview(bytearray(os.urandom(1024) * (args.file_mib * 1024)))
    paths = [args.workdir / f"first_touch.{os.getpid()}.{index}" for index in range(5)]
    try:
        for path in paths[:3]:
            rate, flush = _write_rate(path, data)
            print(f"page cache, a new file beside the earlier ones: writes {rate:.2f} GB/s, fsync {flush:.2f} s")
        for path in paths[:3]:
            path.unlink()
        os.sync()
        for path in paths[3:]:
            rate, flush = _write_rate(path, data)
            print(f"page cache, a new file after deleting three: writes {rate:.2f} GB/s, fsync {flush:.2f} s")
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    now = _reported_kib()
    if reported is None or now is None:
        print("free memory reported to the hypervisor: not known (no free page reporting on this kernel)")
    else:
        gib = (now - reported) / 2**20
        print(f"free memory reported to the hypervisor during the probe: {gib:.2f} GiB ({_REPORTED})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
