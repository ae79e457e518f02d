"""The serving process keeps the cyclic GC off its start-up heap (``gc_freeze``) and times every GC pause
into ``vitembed_gc_pause_seconds``."""

from __future__ import annotations

import gc

import pytest
from conftest import OpenServer
from promtext import sum_samples
from vitembed.metrics import Metrics
from vitembed.server.gc_heap import GcPauseTimer, freeze_startup_heap, unfreeze_heap

pytestmark = pytest.mark.anyio


def test_pause_timer_records_each_collection_by_generation_while_installed() -> None:
    metrics = Metrics()
    timer = GcPauseTimer(metrics.gc_pause)
    timer.install()
    timer.install()  # once only
    gc.disable()  # no automatic collection in between: exactly the two below are counted
    try:
        gc.collect(2)
        gc.collect(0)
        timer.remove()
        gc.collect(2)  # after removal: not recorded
    finally:
        timer.remove()
        gc.enable()
    text = metrics.render()[0].decode()
    assert sum_samples(text, "vitembed_gc_pause_seconds_count", generation="2") == 1
    assert sum_samples(text, "vitembed_gc_pause_seconds_count", generation="0") == 1
    assert sum_samples(text, "vitembed_gc_pause_seconds_sum", generation="2") > 0
    assert timer._on_gc not in gc.callbacks


def test_freezing_takes_the_live_heap_out_of_full_collections() -> None:
    unfreeze_heap()
    kept = [[i] for i in range(50_000)]  # live objects the collector tracks
    try:
        frozen = freeze_startup_heap()
        assert frozen >= len(kept) and gc.get_freeze_count() == frozen
        # a full collection now walks the oldest generation only, which the freeze emptied of them
        assert not any(obj is kept[0] for obj in gc.get_objects(generation=2))
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0
    assert any(obj is kept[0] for obj in gc.get_objects(generation=2))  # given back


async def test_app_freezes_its_heap_when_ready_times_pauses_and_unfreezes_at_stop(serve: OpenServer) -> None:
    unfreeze_heap()
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
