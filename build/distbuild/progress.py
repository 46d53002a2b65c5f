"""A dependency-free progress bar for long downloads (stderr, TTY-aware)."""
from __future__ import annotations

import sys
import time
from typing import TextIO


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


class ProgressBar:
    """Redraws in place on a terminal; prints a line every 10% otherwise (CI logs)."""

    def __init__(self, label: str, total: int | None, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.tty:
            if now - self._last_draw >= 0.1:
                self._last_draw = now
                self._draw(end="\r")
        elif self.total:
            decile = int(10 * self.done / self.total)
            if decile != self._last_decile:
                self._last_decile = decile
                self._draw(end="\n")

    def close(self) -> None:
        if self.tty or self._last_decile != 10:
            self._draw(end="\n")

    def _draw(self, end: str) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = _human(self.done / elapsed) + "/s"
        if self.total:
            frac = min(self.done / self.total, 1.0)
            filled = int(frac * 30)
            bar = "#" * filled + "-" * (30 - filled)
            text = f"{self.label} [{bar}] {frac:6.1%} {_human(self.done)}/{_human(self.total)} {rate}"
        else:
            text = f"{self.label} {_human(self.done)} {rate}"
        self.stream.write(text + end)
        self.stream.flush()
