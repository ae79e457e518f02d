"""Read + decode + preprocess on worker threads, ahead of the forward pass, results in source order.

Threads rather than processes: Pillow's decoders and resizes and numpy release the GIL, a
``Prepared`` tensor needs no pickling, and the preprocessing path is numpy/PIL-only (no torch op runs on
these threads, which would start an OpenMP team that slows the concurrent forward pass). At most
``depth`` items are in flight, so memory stays bounded however long the source is. The threads are
daemons: a worker stuck on a dead network mount cannot keep a stopped job from exiting.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")

_POLL_S = 0.1  # how often a waiting consumer checks its stop event


class Stopped(Exception):
    """The consumer's stop event was set while it waited for the next item."""


class OrderedPrefetcher(Generic[In, Out]):
    """``for item, result in OrderedPrefetcher(fn, items, workers=2, depth=32)`` — ``result`` is fn's
    return value or the exception it raised (never raised here: the caller records it and moves on)."""

    def __init__(
        self,
        fn: Callable[[In], Out],
        items: Sequence[In],
        *,
        workers: int,
        depth: int,
        stop: threading.Event | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self._fn = fn
        self._items = items
        self._depth = max(depth, workers)
        self._stop = stop or threading.Event()
        self._tasks: queue.SimpleQueue[tuple[In, Future[Out]] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"catalog-decode-{n}", daemon=True)
            for n in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            item, future = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._fn(item))
            except BaseException as exc:  # recorded per item by the consumer
                future.set_exception(exc)

    def _submit(self, item: In) -> Future[Out]:
        future: Future[Out] = Future()
        self._tasks.put((item, future))
        return future

    def __iter__(self) -> Iterator[tuple[In, Out | BaseException]]:
        pending: list[tuple[In, Future[Out]]] = []
        upcoming = iter(self._items)
        end = object()
        try:
            for item in upcoming:
                pending.append((item, self._submit(item)))
                if len(pending) >= self._depth:
                    break
            while pending:
                item, future = pending.pop(0)
                result = self._wait(future)
                nxt = next(upcoming, end)
                if nxt is not end:
                    pending.append((nxt, self._submit(nxt)))  # type: ignore[arg-type]
                yield item, result
        finally:
            for _, future in pending:
                future.cancel()
            self.close()

    def _wait(self, future: Future[Out]) -> Out | BaseException:
        while not future.done():
            if self._stop.is_set():
                raise Stopped
            wait([future], timeout=_POLL_S)
        if self._stop.is_set():
            raise Stopped
        error = future.exception()
        return error if error is not None else future.result()

    def close(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
