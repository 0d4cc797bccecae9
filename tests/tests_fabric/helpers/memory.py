"""Peak resident-memory growth of a piece of work, measured in a fresh interpreter (see :data:`PEAK_GROWTH`)."""

#: Python source that defines ``peak_growth(work) -> (KiB, result)``: the largest resident set size while ``work()``
#: runs (sampled every millisecond), above the size before it. Prepend it to a script run with ``python -c``.
PEAK_GROWTH = """
import threading, time
from pathlib import Path

def resident_kib():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 // 1024

def peak_growth(work):
    before, peak, done = resident_kib(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident_kib())
            time.sleep(0.001)
    sampler = threading.Thread(target=sample)
    sampler.start()
    result = work()
    done.set()
    sampler.join()
    return max(peak[0], resident_kib()) - before, result
"""
