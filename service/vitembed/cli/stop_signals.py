"""Stopping ``embed-catalog`` cleanly on SIGINT (Ctrl-C) or SIGTERM (``kill``, a scheduler's stop).

The first signal only asks the job to stop: it commits the rows already embedded and the command exits
with 128 + the signal's number (130 or 143), the status shells report for a process stopped by it. A
second signal raises ``KeyboardInterrupt``, which the command turns into a one-line abort (committed
shards and errors.jsonl are kept either way, so a rerun resumes).
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal's number, as shells report it


class StopOnSignals:
    """First SIGINT or SIGTERM: set ``stop`` (the job commits and returns). A second one raises
    ``KeyboardInterrupt``, which ``run_embed_catalog`` turns into a one-line abort."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in EXIT_CODES:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        again = "Ctrl-C" if signum == signal.SIGINT else "the signal"
        print(
            f"\nstopping: committing the rows embedded so far ({again} again to abort now)",
            file=sys.stderr,
            flush=True,
        )
        self.stop.set()

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self.previous.items():
            # once stopping, the command is about to exit with what it committed: a late second signal
            # has nothing left to abort, and must not end the process with a traceback
            signal.signal(signum, signal.SIG_IGN if self.received is not None else previous)
