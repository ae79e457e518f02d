"""The serving process keeps the cyclic GC off its start-up heap (``gc_freeze``), collects its youngest
generation less often (``gc_young_threshold``) and times every GC pause into ``vitembed_gc_pause_seconds``."""

from __future__ import annotations

import gc
import threading

import pytest
from conftest import OpenServer
from promtext import sum_samples
from vitembed.gc_heap import freeze_startup_heap, raise_young_threshold, release_heap, restore_thresholds
from vitembed.metrics import Metrics

pytestmark = pytest.mark.anyio


def test_pause_timer_counts_each_collection_by_generation_once_installed() -> None:
    metrics = Metrics()
    timer = metrics.gc_timer
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection in between: exactly the ones below are counted
    try:
        timer.install()
        timer.install()  # a second user (two apps on one engine's metrics): one callback, not two
        gc.collect(2)
        gc.collect(0)
        timer.remove()
        gc.collect(1)  # still installed for the other user
        timer.remove()
        gc.collect(2)  # removed: not counted
    finally:
        timer.remove()
        if was_enabled:
            gc.enable()
    assert timer._on_gc not in gc.callbacks
    text = metrics.render()[0].decode()  # rendering moves the recorded pauses into the histogram
    counts = [sum_samples(text, "vitembed_gc_pause_seconds_count", generation=g) for g in "012"]
    assert counts == [1, 1, 1]
    assert sum_samples(text, "vitembed_gc_pause_seconds_sum", generation="2") > 0


def test_a_collection_while_metrics_render_records_its_pause_without_deadlock() -> None:
    """The callback runs inside whatever allocation starts a collection, also while the rendering thread
    holds a metric's lock; it must not take that lock again (a daemon thread, so a regression fails the
    test instead of hanging it)."""
    metrics = Metrics()
    metrics.gc_timer.install()
    done = threading.Event()

    def collect_holding_the_lock() -> None:
        with metrics.gc_pause._lock:  # what rendering holds while it copies the histogram's children
            gc.collect(0)
        done.set()

    try:
        threading.Thread(target=collect_holding_the_lock, daemon=True).start()
        assert done.wait(10), "a GC pause recorded under the metric's lock deadlocked"
        text = metrics.render()[0].decode()
    finally:
        metrics.gc_timer.remove()
    assert sum_samples(text, "vitembed_gc_pause_seconds_count", generation="0") >= 1


def test_freezing_takes_the_live_heap_out_of_full_collections_until_the_last_release() -> None:
    assert gc.get_freeze_count() == 0  # nothing leaked frozen by another test
    kept = [[i] for i in range(50_000)]  # live objects the collector tracks
    try:
        frozen = freeze_startup_heap()
        # a frozen object leaves the count only by dying, which another thread's may do at any moment (a CI
        # run saw 2 fewer right after the freeze): the count may drop, never rise, and keeps what is live
        assert len(kept) <= gc.get_freeze_count() <= frozen
        # a full collection walks the oldest generation only, which the freeze emptied of them
        assert not any(obj is kept[0] for obj in gc.get_objects(generation=2))
        freeze_startup_heap()  # a second app in the same process
        release_heap()
        assert gc.get_freeze_count() > 0  # one app still serving: still frozen
    finally:
        release_heap()
    assert gc.get_freeze_count() == 0
    assert any(obj is kept[0] for obj in gc.get_objects(generation=2))  # given back


async def test_app_freezes_its_heap_when_ready_times_pauses_and_releases_at_stop(serve: OpenServer) -> None:
    assert gc.get_freeze_count() == 0
    async with serve() as server:  # default settings: gc_freeze on
        assert server.settings.gc_freeze
        frozen = await server.metric("vitembed_gc_frozen_objects")
        assert frozen > 10_000 and gc.get_freeze_count() > 10_000  # the loaded model, torch, the app
        before = await server.metric("vitembed_gc_pause_seconds_count", generation="2")
        gc.collect(2)
        assert await server.metric("vitembed_gc_pause_seconds_count", generation="2") >= before + 1
    assert gc.get_freeze_count() == 0  # stopped: nothing left frozen
    async with serve(gc_freeze=False) as server:
        assert await server.metric("vitembed_gc_frozen_objects") == 0 == gc.get_freeze_count()


def test_the_young_threshold_is_raised_never_lowered_and_restored_by_the_last_app() -> None:
    before = gc.get_threshold()
    try:
        raise_young_threshold(12_345)
        assert gc.get_threshold() == (12_345, *before[1:])  # the older generations' ratios stay Python's
        raise_young_threshold(5_000)  # a second app asking for less: not lowered under the first
        assert gc.get_threshold()[0] == 12_345
        restore_thresholds()
        assert gc.get_threshold()[0] == 12_345  # one app still serving
    finally:
        restore_thresholds()
    assert gc.get_threshold() == before


async def test_app_raises_the_young_threshold_when_ready_and_restores_it_at_stop(serve: OpenServer) -> None:
    before = gc.get_threshold()
    assert before[0] < 10_000  # Python's default (700), not left raised by another test
    async with serve() as server:  # default settings
        assert server.settings.gc_young_threshold == 10_000
        assert gc.get_threshold() == (10_000, *before[1:])
    assert gc.get_threshold() == before
    async with serve(gc_young_threshold=0):
        assert gc.get_threshold() == before
