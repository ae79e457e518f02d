"""A one-line progress bar on stderr for ``embed_many`` (no dependency): images done, of how many when the
input has a length, and the rate; redrawn at most ten times a second, finished with a newline."""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_S = 0.1
WIDTH = 30


class Progress:
    def __init__(self, total: int | None, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.started = time.monotonic()
        self._drawn_at = 0.0

    def update(self, count: int) -> None:
        self.done += count
        now = time.monotonic()
        if self.enabled and now - self._drawn_at >= REDRAW_S:
            self._draw(now)

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def line(self, now: float) -> str:
        rate = self.done / max(now - self.started, 1e-9)
        if self.total:
            filled = int(WIDTH * min(self.done, self.total) / self.total)
            bar = "#" * filled + "." * (WIDTH - filled)
            return f"embed [{bar}] {self.done}/{self.total} images, {rate:.1f}/s"
        return f"embed {self.done} images, {rate:.1f}/s"

    def _draw(self, now: float) -> None:
        self._drawn_at = now
        self.stream.write("\r" + self.line(now))
        self.stream.flush()
