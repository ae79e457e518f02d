"""Python's cyclic garbage collector in a serving process: keep its pauses short, and visible.

Once the models are loaded the process holds a couple of hundred thousand long-lived objects (torch,
transformers, the model's modules, the app's routes). A full (generation 2) collection walks every one
of them while holding the GIL, about 0.1 s on a 2-core VM, and every thread waits for it: the event loop
answering refusals and the forward thread between two torch ops. Request handling leaves enough cyclic
garbage to trigger such a collection now and then under load, and each one lands in the tail of the
429 latencies. ``gc.freeze()`` once the app is ready moves that start-up heap into the permanent
generation, which no collection walks again: later collections walk only what requests created.
Reference counting still frees frozen objects that die; only cycles among them are never collected,
and start-up builds none that matter (it runs a full collection just before freezing).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Histogram


def freeze_startup_heap() -> int:
    """Collect start-up garbage, then freeze what is left; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_heap() -> None:
    """Give frozen objects back to the collector (the oldest generation)."""
    gc.unfreeze()


class GcPauseTimer:
    """Times every collection of the cyclic GC into ``histogram`` (label: generation) while installed.

    The callback is process-wide (``gc.callbacks``); each app installs its own at start-up and removes it
    at shutdown, so tests that run several apps in one process do not leave timers behind."""

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._started: float | None = None

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def remove(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # collections run one at a time under the GIL: a start is always followed by its own stop
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._histogram.labels(str(info["generation"])).observe(time.perf_counter() - self._started)
            self._started = None
