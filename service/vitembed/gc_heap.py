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

Under overload the requests' own live set is large too: hundreds of requests in flight and connections
held, each with its scope, task, parser and timers. At Python's default thresholds (a young collection
every 700 net allocations, an older one every 10 of those) every tenth collection walks that set, and the
serving process spent 3.4 % of its time in GC pauses in an open-loop overload. A young threshold of
``gc_young_threshold`` (10,000 by default) makes every collection rarer; most request objects die by
reference counting long before one runs.

The freeze, the thresholds and the GC callbacks are all process-wide, while tests run several apps in
one process (some sharing one engine and its metrics): the freeze and the raised threshold are counted
(given back when the last app that took them stops) and a timer is installed once however many apps use
it.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any

from prometheus_client import Histogram

_freezers = 0  # apps that froze the heap and have not stopped yet
_raisers = 0  # apps that raised the young threshold and have not stopped yet
_thresholds_before: tuple[int, int, int] | None = None  # what the first of them found


def freeze_startup_heap() -> int:
    """Collect start-up garbage, then freeze what is left; returns how many objects this process holds
    frozen. Pair every call with :func:`release_heap`."""
    global _freezers
    _freezers += 1
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_heap() -> None:
    """One freezer is done; the last one gives the frozen objects back to the collector."""
    global _freezers
    _freezers = max(0, _freezers - 1)
    if _freezers == 0:
        gc.unfreeze()


def raise_young_threshold(young: int) -> None:
    """Collect the youngest generation only every ``young`` net allocations (never lowered below what is
    set); pair every call with :func:`restore_thresholds`."""
    global _raisers, _thresholds_before
    current = gc.get_threshold()
    if _raisers == 0:
        _thresholds_before = current
    _raisers += 1
    gc.set_threshold(max(current[0], young), *current[1:])


def restore_thresholds() -> None:
    """One app is done with its raised threshold; the last one puts back what the first found."""
    global _raisers, _thresholds_before
    _raisers = max(0, _raisers - 1)
    if _raisers == 0 and _thresholds_before is not None:
        gc.set_threshold(*_thresholds_before)
        _thresholds_before = None


class GcPauseTimer:
    """Times every collection of the cyclic GC into ``histogram`` (label: generation) while installed.

    The callback runs inside a collection, which can start in any allocation, including one made while
    the same thread holds a lock of prometheus_client (rendering ``/metrics`` copies a metric's children
    under its lock): taking that lock again from the callback would deadlock. So the callback only appends
    to a deque, and :meth:`flush` (called before every render) moves the pauses into the histogram."""

    def __init__(self, histogram: Histogram, capacity: int = 4096) -> None:
        self._histogram = histogram
        # (generation, seconds) since the last scrape; past ``capacity`` (a server nobody scrapes, ~4,000
        # collections: minutes under load) the oldest are dropped rather than grow without bound
        self._pending: deque[tuple[str, float]] = deque(maxlen=capacity)
        self._started: float | None = None
        self._users = 0

    def install(self) -> None:
        self._users += 1
        if self._users == 1:
            gc.callbacks.append(self._on_gc)

    def remove(self) -> None:
        self._users = max(0, self._users - 1)
        if self._users == 0 and self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def flush(self) -> None:
        while True:
            try:
                generation, seconds = self._pending.popleft()
            except IndexError:
                return
            self._histogram.labels(generation).observe(seconds)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # collections run one at a time under the GIL: a start is always followed by its own stop
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._pending.append((str(info["generation"]), time.perf_counter() - self._started))
            self._started = None
