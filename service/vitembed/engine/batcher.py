"""Dynamic batching: concurrent requests share forward passes.

One batcher per model, with one forward thread, or several side by side where the passes run as graphs
without the GIL (``workers``). Items wait in per-key queues, the key being everything
that must be equal inside one forward pass: the patch grid and the output options. A batch closes when it
holds ``max_batch_size`` items, when the next item would pass the patch-token budget, or when its oldest
item has waited ``max_wait_s``. Admission happens before the batcher, in ``admission.py`` (before any
image is decoded); the batcher tells the model's ``ModelLoad`` when a batch starts and ends, and when a
queued item is dropped, so that the predicted wait and the hard cap stay exact. Every item's future is
completed on every path — result, exception, cancellation — so a failing batch can never strand a request.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vit_backbone.preprocess import Prepared
from vitembed.engine.admission import ModelLoad, QueueFullError, Reservation

__all__ = [
    "BatchKey",
    "CancelledWorkError",
    "DeadlineExceededError",
    "DynamicBatcher",
    "QueueFullError",
    "RequestTicket",
    "WorkItem",
]

log = logging.getLogger(__name__)

# grid, pooling, layers, normalize, heads computed from the same forward pass
BatchKey = tuple[tuple[int, int], str, tuple[int, ...] | None, bool, tuple[str, ...]]


class DeadlineExceededError(Exception):
    pass


class CancelledWorkError(Exception):
    """The request was abandoned (client gone) before its items reached a forward pass."""


class RequestTicket:
    """Shared by all items of one request: cancelling it drops the items still queued. ``budget_s`` is
    the request's whole allowance (the server's timeout, or the client's shorter one), for messages."""

    def __init__(self, deadline: float, budget_s: float | None = None) -> None:
        self.deadline = deadline
        self.budget_s = budget_s
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass(eq=False)
class WorkItem:
    prepared: Prepared
    key: BatchKey
    tokens: int  # cost of this item: sequence length (patches + prefix), times 2 for a mirrored pooling
    ticket: RequestTicket
    reservation: Reservation | None = None  # its request's admission (None only in tests of the batcher)
    future: Future[Any] = field(default_factory=Future)  # one row of what RunBatch returns
    enqueued: float = field(default_factory=time.monotonic)  # stamped again by the batcher's clock on submit


RunBatch = Callable[[Sequence[WorkItem]], Sequence[Any]]  # -> b rows in item order (arrays, or tuples)


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux keeps one per thread); best effort."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed
        log.warning("forward thread priority not lowered: %s", exc)


def images_per_batch(max_batch_size: int, max_batch_tokens: int, tokens_per_item: int) -> int:
    """How many images of ``tokens_per_item`` tokens one forward pass takes (at least one)."""
    return max(1, min(max_batch_size, max_batch_tokens // max(1, tokens_per_item)))


class DynamicBatcher:
    def __init__(
        self,
        name: str,
        run_batch: RunBatch,
        *,
        load: ModelLoad,
        max_batch_size: int,
        max_batch_tokens: int,
        max_wait_s: float,
        on_batch: Callable[[int, float, float], None] | None = None,  # (size, queue_wait_s, forward_s)
        on_depth: Callable[[int], None] | None = None,
        on_drop: Callable[[str], None] | None = None,
        clock: Callable[
            [], float
        ] = time.monotonic,  # queue waits, deadlines, pass timings (tests inject one)
        workers: int = 1,  # forward threads taking batches side by side (graphs: no GIL between them)
        nice: int = 0,  # the forward threads' nice value above the process's (Linux; 0: unchanged)
    ) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1 or max_wait_s < 0 or workers < 1:
            raise ValueError("max_batch_size, max_batch_tokens and workers must be ≥ 1 and max_wait_s ≥ 0")
        self.name = name
        self._run_batch = run_batch
        self._load = load
        self._max_batch_size = max_batch_size
        self._max_batch_tokens = max_batch_tokens
        self._max_wait_s = max_wait_s
        self._on_batch = on_batch
        self._on_depth = on_depth
        self._on_drop = on_drop
        self._clock = clock
        self._nice = nice
        self._queues: dict[BatchKey, deque[WorkItem]] = {}
        self._depth = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._loop, name=f"forward-{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    # ----------------------------------------------------------------- producer side
    def submit(self, items: Sequence[WorkItem]) -> None:
        """Queue all items of one (admitted) request, or none of them once stopping."""
        if not items:
            return
        with self._cond:
            if self._stopping:
                raise QueueFullError(retry_after_s=1.0)
            now = self._clock()
            for item in items:
                item.enqueued = now
                self._queues.setdefault(item.key, deque()).append(item)
            self._depth += len(items)
            self._report_depth()
            self._cond.notify()

    @property
    def depth(self) -> int:
        return self._depth

    # ----------------------------------------------------------------- consumer side
    def _loop(self) -> None:
        if self._nice:
            lower_priority(self._nice)
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

    def _next_batch(self) -> list[WorkItem] | None:
        with self._cond:
            while True:
                self._drop_dead_items()
                if self._stopping and self._depth == 0:
                    return None
                key = self._oldest_key()
                if key is None:
                    self._cond.wait()
                    continue
                queue = self._queues[key]
                limit = self._batch_limit(queue[0].tokens)
                waited = self._clock() - queue[0].enqueued
                if len(queue) >= limit or waited >= self._max_wait_s or self._stopping:
                    batch = [queue.popleft() for _ in range(min(limit, len(queue)))]
                    if not queue:
                        del self._queues[key]
                    self._depth -= len(batch)
                    self._report_depth()
                    if self._depth:  # work left: another forward thread may take it (submit woke one)
                        self._cond.notify()
                    return batch
                self._cond.wait(timeout=self._max_wait_s - waited)

    def _batch_limit(self, tokens_per_item: int) -> int:
        return images_per_batch(self._max_batch_size, self._max_batch_tokens, tokens_per_item)

    def _oldest_key(self) -> BatchKey | None:
        heads = [(queue[0].enqueued, key) for key, queue in self._queues.items() if queue]
        return min(heads, key=lambda pair: pair[0])[1] if heads else None

    def _drop_dead_items(self) -> None:
        """Cancelled or expired items never reach a forward pass."""
        now = self._clock()
        for key in list(self._queues):
            queue = self._queues[key]
            alive: deque[WorkItem] = deque()
            for item in queue:
                if item.ticket.cancelled:
                    self._finish_dropped(item, CancelledWorkError("the client went away"), "cancelled")
                elif now > item.ticket.deadline:
                    self._finish_dropped(
                        item, DeadlineExceededError("the request deadline passed"), "deadline"
                    )
                else:
                    alive.append(item)
            dropped = len(queue) - len(alive)
            if dropped:
                self._depth -= dropped
                self._report_depth()
            if alive:
                self._queues[key] = alive
            else:
                del self._queues[key]

    def _finish_dropped(self, item: WorkItem, error: Exception, reason: str) -> None:
        if item.reservation is not None:
            item.reservation.release(1)
        if not item.future.done():
            item.future.set_exception(error)
        if self._on_drop is not None:
            self._on_drop(reason)

    def _run(self, batch: list[WorkItem]) -> None:
        started = self._clock()
        queue_wait = started - min(item.enqueued for item in batch)
        tokens = batch[0].tokens  # one key per batch: every item has the same grid
        running = self._load.begin(
            (item.reservation for item in batch if item.reservation is not None), tokens
        )
        rows: Sequence[Any] | None = None
        failure: Exception | None = None
        try:
            rows = self._run_batch(batch)
        except Exception as exc:  # one bad batch fails only its own requests
            log.exception("forward pass of %d item(s) on %s failed", len(batch), self.name)
            failure = exc
        elapsed = self._clock() - started
        # the images leave the admission state before their requests learn the outcome
        self._load.end(running, tokens, len(batch), elapsed if rows is not None else None)
        # and the pass is counted before then too: a caller that reads /metrics after its answer sees it
        if self._on_batch is not None:
            self._on_batch(len(batch), queue_wait, elapsed)
        if rows is not None:
            for row, item in zip(rows, batch, strict=True):
                if not item.future.done():
                    item.future.set_result(row)
        else:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(failure or RuntimeError("the forward pass failed"))

    def _report_depth(self) -> None:
        if self._on_depth is not None:
            self._on_depth(self._depth)

    # ----------------------------------------------------------------- lifecycle
    def stop(self, timeout: float | None = 30.0) -> None:
        """Finish what is queued, then end the forward threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        ends = time.monotonic() + (timeout if timeout is not None else 0.0)
        for thread in self._threads:
            thread.join(None if timeout is None else max(0.0, ends - time.monotonic()))

    @property
    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)
