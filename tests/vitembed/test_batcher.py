"""The dynamic batcher on its own: batch formation, the admission state it keeps exact (reserved, running,
dropped images), cancellation, failure isolation.

Event-ordered, never sleep-ordered: the forward pass is a ``Recorder`` that says when it has been entered
and waits at a gate the test opens; time is a ``FakeClock`` the batcher is given, which the test (or the
recorder, for the length of a pass) moves, so queue waits, deadlines and pass timings are what the test
says, however slow the machine."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from vitembed.engine.admission import AdmissionControl, ModelLoad, Reservation
from vitembed.engine.batcher import (
    CancelledWorkError,
    DeadlineExceededError,
    DynamicBatcher,
    RequestTicket,
    WorkItem,
)

from vit_backbone.preprocess import Prepared


def item(
    value: float,
    ticket: RequestTicket,
    *,
    grid: tuple[int, int] = (2, 2),
    pooling: str = "cls",
    reservation: Reservation | None = None,
) -> WorkItem:
    prepared = Prepared(torch.full((3, 28, 28), value), grid, (28, 28), "squash")
    key = (grid, pooling, None, False, ())
    return WorkItem(prepared, key, tokens=grid[0] * grid[1] + 1, ticket=ticket, reservation=reservation)


class FakeClock:
    """The batcher's clock: it moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    """Returns each item's pixel value as its row, and records the batches it saw. ``entered`` is set when
    a pass begins, before it waits at ``gate``; a pass lasts ``delay`` on ``clock`` (real time without)."""

    def __init__(
        self, delay: float = 0.0, fail_on: float | None = None, clock: FakeClock | None = None
    ) -> None:
        self.batches: list[list[float]] = []
        self.delay = delay
        self.fail_on = fail_on
        self.clock = clock
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, items: Sequence[WorkItem]) -> np.ndarray:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        values = [float(i.prepared.pixel_values[0, 0, 0]) for i in items]
        self.batches.append(values)
        if self.clock is not None:
            self.clock.advance(self.delay)
        else:
            time.sleep(self.delay)
        if self.fail_on is not None and self.fail_on in values:
            raise RuntimeError("boom")
        return np.array(values, dtype=np.float32)[:, None]


def make(
    run: Recorder, load: ModelLoad | None = None, clock: FakeClock | None = None, **kwargs: float
) -> DynamicBatcher:
    options = {"max_batch_size": 4, "max_batch_tokens": 10_000, "max_wait_s": 0.05, **kwargs}
    return DynamicBatcher(
        "t",
        run,
        load=load or AdmissionControl(64, 10.0).model("t"),
        max_batch_size=int(options["max_batch_size"]),
        max_batch_tokens=int(options["max_batch_tokens"]),
        max_wait_s=float(options["max_wait_s"]),
        clock=clock or time.monotonic,
    )


def test_concurrent_items_share_batches_up_to_the_size_limit() -> None:
    clock = FakeClock()  # stands still: no batch closes on its timer until the clock is moved
    run = Recorder()
    run.gate.clear()
    batcher = make(run, clock=clock)
    ticket = RequestTicket(clock.now + 10)
    items = [item(float(i), ticket) for i in range(10)]
    for it in items:  # one request after another
        batcher.submit([it])
    assert run.entered.wait(5)  # the first four filled a batch; the other six wait behind it
    clock.advance(1.0)  # past max_wait_s: the last two close a batch of their own
    run.gate.set()
    results = [float(it.future.result(5)[0]) for it in items]
    batcher.stop()
    assert results == [float(i) for i in range(10)]
    assert run.batches == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]


def test_token_budget_and_keys_split_batches() -> None:
    run = Recorder()
    run.gate.clear()
    batcher = make(run, max_batch_size=8, max_batch_tokens=12)  # 5 tokens per 2x2 item → 2 per batch
    ticket = RequestTicket(time.monotonic() + 10)
    same = [item(float(i), ticket) for i in range(4)]
    other = [item(100.0 + i, ticket, grid=(3, 3)) for i in range(2)]  # 10 tokens → 1 per batch
    batcher.submit(same + other)
    run.gate.set()
    for it in same + other:
        it.future.result(5)
    batcher.stop()
    assert all(len(b) <= 2 for b in run.batches)
    for batch in run.batches:  # grids never mix within a forward pass
        assert all(v >= 100 for v in batch) or all(v < 100 for v in batch)
    assert (
        sum(len(b) for b in run.batches if b[0] >= 100) == 2
        and max(len(b) for b in run.batches if b[0] >= 100) == 1
    )


def test_the_batcher_keeps_the_admission_state_exact() -> None:
    """Admitted images count against the hard cap until their forward pass ends (or they are dropped);
    they leave the reserved work when their pass starts, and the pass feeds the throughput estimate."""
    control = AdmissionControl(capacity=4, target_s=10.0)
    load = control.model("t")
    clock = FakeClock()
    run = Recorder(delay=0.05, clock=clock)  # each pass takes 0.05 s on the batcher's clock
    run.gate.clear()
    batcher = make(run, load, clock, max_batch_size=2, max_wait_s=0.0)
    ticket = RequestTicket(clock.now + 10)
    gone = RequestTicket(clock.now + 10)
    kept = load.admit(3, 5, deadline_left_s=10.0)
    dropped = load.admit(1, 5, deadline_left_s=10.0)
    assert (control.held, load.reserved_images) == (4, 4)
    items = [item(float(i), ticket, reservation=kept) for i in range(3)]
    batcher.submit(items)
    assert run.entered.wait(5)  # the first batch of two has begun ...
    assert (control.held, load.reserved_images) == (4, 2)  # ... and waits at the gate
    batcher.submit([item(9.0, gone, reservation=dropped)])
    gone.cancel()
    run.gate.set()
    assert [float(it.future.result(5)[0]) for it in items] == [0.0, 1.0, 2.0]
    batcher.stop()
    assert (control.held, load.reserved_images, kept.remaining, dropped.remaining) == (0, 0, 0, 0)
    assert [v for b in run.batches for v in b] == [0.0, 1.0, 2.0]
    assert load.estimate.per_image_s(5) == pytest.approx(0.1 / 3)  # two passes of 0.05 s for 3 images


def test_cancelled_and_expired_items_never_reach_a_forward_pass() -> None:
    clock = FakeClock()
    run = Recorder()
    run.gate.clear()
    batcher = make(run, clock=clock, max_batch_size=1)
    blocker = item(0.0, RequestTicket(clock.now + 100))
    batcher.submit([blocker])
    assert run.entered.wait(5)  # the forward thread now holds the blocker
    gone = RequestTicket(clock.now + 100)
    late = RequestTicket(clock.now + 5)
    dropped = [item(1.0, gone), item(2.0, late)]
    kept = item(3.0, RequestTicket(clock.now + 100))
    batcher.submit(dropped)
    batcher.submit([kept])
    gone.cancel()  # the client went away ...
    clock.advance(10)  # ... and the late request's deadline passed, both while their items were queued
    run.gate.set()
    assert float(kept.future.result(5)[0]) == 3.0
    with pytest.raises(CancelledWorkError):
        dropped[0].future.result(5)
    with pytest.raises(DeadlineExceededError):
        dropped[1].future.result(5)
    batcher.stop()
    assert [v for b in run.batches for v in b] == [0.0, 3.0]


def test_a_failing_batch_fails_only_its_own_items() -> None:
    run = Recorder(fail_on=1.0)
    batcher = make(run, max_batch_size=1)
    ticket = RequestTicket(time.monotonic() + 10)
    bad, good = item(1.0, ticket), item(2.0, ticket)
    batcher.submit([bad])
    batcher.submit([good])
    with pytest.raises(RuntimeError, match="boom"):
        bad.future.result(5)
    assert float(good.future.result(5)[0]) == 2.0
    assert batcher.alive
    batcher.stop()
    assert not batcher.alive


def test_stop_finishes_queued_work() -> None:
    run = Recorder(delay=0.01)
    batcher = make(run, max_batch_size=2, max_wait_s=5.0)  # would wait long for a full batch
    ticket = RequestTicket(time.monotonic() + 10)
    items = [item(float(i), ticket) for i in range(3)]
    batcher.submit(items)
    batcher.stop()
    assert [float(it.future.result(1)[0]) for it in items] == [0.0, 1.0, 2.0]


def test_forward_threads_run_batches_side_by_side_and_keep_the_admission_state_exact() -> None:
    """With two forward threads, two batches are in their passes at once (each waits at a barrier that
    only both together pass: one thread would time out), every item gets its own row, and the hard cap and
    the reserved work come back to zero; the estimate is the model's time per image (pass time / threads)."""
    control = AdmissionControl(capacity=8, target_s=10.0)
    load = control.model("t", workers=2)
    both = threading.Barrier(2, timeout=10)
    seen: list[list[float]] = []

    def run(items: Sequence[WorkItem]) -> np.ndarray:
        values = [float(i.prepared.pixel_values[0, 0, 0]) for i in items]
        both.wait()  # raises BrokenBarrierError after 10 s if the other pass never starts
        seen.append(values)
        return np.array(values, dtype=np.float32)[:, None]

    batcher = DynamicBatcher(
        "t", run, load=load, max_batch_size=2, max_batch_tokens=10_000, max_wait_s=0.0, workers=2
    )
    ticket = RequestTicket(time.monotonic() + 30)
    reservation = load.admit(4, 5, deadline_left_s=30.0)
    items = [item(float(i), ticket, reservation=reservation) for i in range(4)]
    batcher.submit(items)
    assert [float(it.future.result(15)[0]) for it in items] == [0.0, 1.0, 2.0, 3.0]
    assert batcher.alive
    batcher.stop()
    assert not batcher.alive
    assert sorted(len(b) for b in seen) == [2, 2]
    assert (control.held, load.reserved_images, reservation.remaining) == (0, 0, 0)
    with pytest.raises(ValueError, match="workers"):
        DynamicBatcher("t", run, load=load, max_batch_size=2, max_batch_tokens=10, max_wait_s=0.0, workers=0)


def test_forward_threads_can_run_at_a_lower_priority() -> None:
    """``nice``: each forward thread raises its own nice value (Linux keeps one per thread), so that the
    event loop and the decode workers preempt it; the process's other threads keep theirs."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen: list[int] = []

    def run(items: Sequence[WorkItem]) -> np.ndarray:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return np.zeros((len(items), 1), dtype=np.float32)

    batcher = DynamicBatcher(
        "t", run, load=AdmissionControl(8, 10.0).model("t"), max_batch_size=1, max_batch_tokens=100,
        max_wait_s=0.0, workers=2, nice=3,
    )  # fmt: skip
    ticket = RequestTicket(time.monotonic() + 30)
    items = [item(float(i), ticket) for i in range(4)]
    batcher.submit(items)
    for it in items:
        it.future.result(15)
    batcher.stop()
    assert seen == [min(base + 3, 19)] * 4
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
