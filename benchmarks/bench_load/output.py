"""Progress lines and the units that every part of the benchmark prints."""

import sys


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB" if value >= 0.995e8 or value == 0 else f"{value / 1e6:.1f} MB"
