"""Prometheus metrics, one registry per app (tests run several apps in one process)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from vitembed.gc_heap import GcPauseTimer

STAGES = ("decode", "preprocess", "queue", "forward", "serialise")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "vitembed_requests_total",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "vitembed_queue_depth", "images waiting for a forward pass", ["model"], registry=self.registry
        )
        self.batch_size = Histogram(
            "vitembed_batch_size",
            "images per forward pass",
            ["model"],
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=self.registry,
        )
        self.forward_passes = Counter(
            "vitembed_forward_passes_total", "forward passes run", ["model"], registry=self.registry
        )
        self.images = Counter("vitembed_images_total", "images embedded", ["model"], registry=self.registry)
        self.stage_seconds = Histogram(
            "vitembed_stage_seconds",
            "latency per stage: decode, preprocess (per image); queue, forward (per batch); serialise",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.rejected = Counter(
            "vitembed_rejected_total",
            "work refused or dropped, by reason and where: connection (the connection limit), head "
            "(admission on the request head, body unread), body (admission after the body was read), "
            "queued (dropped after admission)",
            ["reason", "stage"],
            registry=self.registry,
        )

        self.admission = Counter(
            "vitembed_admission_total",
            "requests at admission, by model and outcome: admitted, queue_full, queue_delay, deadline",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.admission_wait = Histogram(
            "vitembed_admission_wait_seconds",
            "admitted requests: the wait predicted at admission and the actual one (admission to last row), "
            "by model",
            ["model", "kind"],
            buckets=(*_LATENCY_BUCKETS, 20.0, 30.0, 60.0),
            registry=self.registry,
        )
        self.admission_calibration = Gauge(
            "vitembed_admission_calibration",
            "90th percentile of actual / predicted wait of recent admitted requests, which scales the "
            "predictions (1 = exact)",
            ["model"],
            registry=self.registry,
        )

        # per caller (the API keys file's names, never keys): requests admitted or refused by quota limit
        self.caller_requests = Counter(
            "vitembed_caller_requests_total",
            "requests of callers with quotas, by outcome: admitted, max_images_in_flight, images_per_second",
            ["caller", "outcome"],
            registry=self.registry,
        )
        self.caller_images = Counter(
            "vitembed_caller_images_total",
            "images admitted under a caller's quota",
            ["caller"],
            registry=self.registry,
        )
        self.caller_in_flight = Gauge(
            "vitembed_caller_images_in_flight",
            "a caller's images admitted and not yet answered",
            ["caller"],
            registry=self.registry,
        )

        # the cyclic GC (gc_heap.py): its pauses stop every thread, the event loop included
        self.gc_pause = Histogram(
            "vitembed_gc_pause_seconds",
            "pauses of Python's cyclic garbage collector, by generation (every thread waits for one)",
            ["generation"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=self.registry,
        )
        self.gc_frozen = Gauge(
            "vitembed_gc_frozen_objects",
            "objects this process held frozen out of the GC's reach when the app became ready "
            "(0: gc_freeze off)",
            registry=self.registry,
        )
        self.gc_timer = GcPauseTimer(self.gc_pause)  # installed by the app while it serves

    def render(self) -> tuple[bytes, str]:
        self.gc_timer.flush()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
