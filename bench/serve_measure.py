"""Measurements of ``bench.serve_bench``: references and server scenarios, into dataclasses.

Nothing here writes a report; ``bench.serve_report`` renders the results.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np

from bench.common.forward import ForwardTiming
from bench.common.images import JpegSet
from bench.common.loadgen import LoadGenerator, LoadPlan, multipart_target
from bench.common.machine import CpuWindow, wait_for_idle
from bench.common.report import pct
from bench.common.server import Samples, ServerProcess, add, metrics_delta, subtract
from vit_backbone import Backbone

NOISY_CORES = 0.25  # other processes' CPU use above which a measurement is taken again
RETRIES = 2
T = TypeVar("T")


@dataclass(frozen=True)
class PipelineTiming:
    images_per_s: float
    background_cores: float


@dataclass(frozen=True)
class DecodeTiming:
    images_per_s: float  # one thread, the server's path (draft decode + preprocess)
    median_ms: float


@dataclass
class Scenario:
    """One load on the server: ``clients`` closed-loop clients (1 = sequential requests)."""

    set_label: str
    clients: int
    requests: int
    errors: int
    seconds: float
    images_per_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    client_cpu_cores: float  # the load generator's own CPU time per wall second (its own process)
    server_cpu_cores: float
    bench_cpu_cores: float  # the bench process itself (idle while the load runs)
    background_cores: float  # everything else on the machine (other sessions): noise
    server: dict[str, Any] = field(default_factory=dict)  # from /metrics, this scenario only
    retries: int = 0  # measured again because other processes were busy


@dataclass
class AdjacentReferences:
    """Model-only forwards and the pipeline timed next to one set's scenarios (server idle), so that ratios
    see the same machine speed: bs=1 in blocks interleaved with the sequential requests, the best batch and
    the pipeline before and after the concurrent scenarios (their mean is the reference)."""

    bs1_block_medians_ms: list[float] = field(default_factory=list)
    bs1_background_cores: float = math.nan
    best: dict[str, Any] = field(default_factory=dict)  # batch_size, dtype, images_per_s, before/after
    forward_candidates: dict[str, dict[str, Any]] = field(default_factory=dict)
    pipeline: dict[str, Any] = field(default_factory=dict)  # images_per_s, before/after

    @property
    def bs1_median_ms(self) -> float:
        return statistics.median(self.bs1_block_medians_ms) if self.bs1_block_medians_ms else math.nan


@dataclass
class SetResult:
    label: str
    images: dict[str, Any]
    decode: DecodeTiming
    pipeline: PipelineTiming  # start of run
    references: AdjacentReferences
    scenarios: list[Scenario]


def quiet(measure: Callable[[], T], noise: Callable[[T], float], what: str, retries: int) -> tuple[T, int]:
    """Run ``measure``; while other processes used more than NOISY_CORES meanwhile, wait for a quiet machine
    and measure again (at most ``retries`` times). Returns the last result and the number of retries."""
    result = measure()
    for attempt in range(retries):
        if noise(result) <= NOISY_CORES:
            return result, attempt
        print(f"  ({what}: other processes used {noise(result):.2f} cores; measuring again)", flush=True)
        wait_for_idle(0.3, 120)
        result = measure()
    return result, retries


# ------------------------------------------------------------------------------------------------ references
def time_decode(backbone: Backbone, jpegs: Sequence[bytes], budget_s: float) -> DecodeTiming:
    """Decode + preprocess on one thread, the server's path (draft on)."""
    policy = backbone.defaults.policy
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < 2 * len(jpegs) or time.perf_counter() - started < budget_s:
        t0 = time.perf_counter()
        backbone.prepare(jpegs[len(times) % len(jpegs)], policy=policy, draft=True)
        times.append(time.perf_counter() - t0)
    return DecodeTiming(len(times) / sum(times), statistics.median(times) * 1000)


def make_pipeline(model_dir: Any) -> Any:
    """transformers' ``image-feature-extraction`` pipeline, float32, batch 8: the baseline."""
    from transformers import pipeline

    return pipeline("image-feature-extraction", model=str(model_dir), device="cpu", batch_size=8)


def time_pipeline(pipe: Any, jpegs: JpegSet, count: int, tag: str = "") -> PipelineTiming:
    """The pipeline on the JPEG files (decode included), ``count`` images after a warm-up batch."""
    inputs = [str(jpegs.paths[i % len(jpegs.paths)]) for i in range(count)]
    pipe(inputs[: min(8, count)])  # warm-up (first-call costs)
    window = CpuWindow()
    started = time.perf_counter()
    results = pipe(inputs)
    elapsed = time.perf_counter() - started
    background = window.cores()["background"]
    if len(results) != count:
        raise RuntimeError(f"pipeline returned {len(results)} results for {count} images")
    print(
        f"  {tag}pipeline {jpegs.label}: {count / elapsed:7.1f} img/s (background {background:.2f})",
        flush=True,
    )
    return PipelineTiming(count / elapsed, background)


# -------------------------------------------------------------------------------------------- load windows
@dataclass
class Window:
    """One load window: latencies of the 200s, errors, wall time, CPU and the /metrics delta."""

    latencies_s: list[float]
    errors: int
    wall_s: float
    client_cpu_s: float
    cores: dict[str, float]  # server, own (the bench), background: per wall second
    metrics: Samples


def load_window(
    server: ServerProcess, load: LoadGenerator, bodies: Sequence[bytes], plan: LoadPlan
) -> Window:
    before = server.metrics()
    window = CpuWindow({"server": server.pid, "client": load.pid})
    run = load.run(multipart_target(f"{server.base}/v1/embed", bodies), plan)
    cores = window.cores()
    delta = subtract(server.metrics(), before)
    return Window(run.ok_latencies_s, run.errors, run.wall_s, run.cpu_s, cores, delta)


def merge(windows: Sequence[Window]) -> Window:
    wall = sum(w.wall_s for w in windows)
    names = windows[0].cores
    cores = {k: sum(w.cores[k] * w.wall_s for w in windows) / wall for k in names} if wall else {}
    metrics: Samples = {}
    for w in windows:
        metrics = add(metrics, w.metrics)
    latencies = [x for w in windows for x in w.latencies_s]
    client = sum(w.client_cpu_s for w in windows)
    return Window(latencies, sum(w.errors for w in windows), wall, client, cores, metrics)


def scenario(label: str, clients: int, w: Window, retries: int) -> Scenario:
    result = Scenario(
        set_label=label,
        clients=clients,
        requests=len(w.latencies_s),
        errors=w.errors,
        seconds=w.wall_s,
        images_per_s=len(w.latencies_s) / w.wall_s if w.wall_s else math.nan,
        p50_ms=pct(w.latencies_s, 50) * 1000,
        p99_ms=pct(w.latencies_s, 99) * 1000,
        mean_ms=float(np.mean(w.latencies_s)) * 1000 if w.latencies_s else math.nan,
        client_cpu_cores=w.client_cpu_s / w.wall_s if w.wall_s else math.nan,
        server_cpu_cores=w.cores.get("server", math.nan),
        bench_cpu_cores=w.cores.get("own", math.nan),
        background_cores=w.cores.get("background", math.nan),
        server=metrics_delta(w.metrics, w.wall_s),
        retries=retries,
    )
    s = result.server
    print(
        f"  serve {label} c={clients:<3d} {result.images_per_s:7.1f} img/s  p50 {result.p50_ms:7.1f} ms  "
        f"p99 {result.p99_ms:7.1f} ms  err {w.errors}  batch {s['mean_batch_size']:.1f}  "
        f"cpu client {result.client_cpu_cores:.2f} server {result.server_cpu_cores:.2f} "
        f"other {result.background_cores:.2f}",
        flush=True,
    )
    return result


def _window_noise(w: Window) -> float:
    return w.cores.get("background", 0.0)


def _timing_noise(t: ForwardTiming | PipelineTiming) -> float:
    return t.background_cores


# ------------------------------------------------------------------------------------------------ one set
@dataclass(frozen=True)
class SetPlan:
    """How one JPEG set is measured against the running server."""

    concurrency: Sequence[int]
    duration_s: float
    sequential: int  # sequential requests, in ``blocks`` blocks interleaved with bs=1 forwards
    blocks: int
    budget_s: float  # per forward reference
    best_batches: Sequence[int]
    best_dtype: str
    served_dtype: str
    retries: int


def measure_set(
    server: ServerProcess,
    load: LoadGenerator,
    jpegs: JpegSet,
    plan: SetPlan,
    forward_ref: Callable[[str, int, float], ForwardTiming],
    pipeline_ref: Callable[[JpegSet], PipelineTiming],
) -> tuple[AdjacentReferences, list[Scenario]]:
    """Per set: pipeline and best-batch forwards (server idle), the sequential client interleaved with bs=1
    forwards, the concurrent scenarios, then the best-batch forwards and the pipeline again."""
    bodies = jpegs.bodies()
    load.run(  # warm-up
        multipart_target(f"{server.base}/v1/embed", bodies),
        LoadPlan(clients=max(plan.concurrency), duration_s=min(1.5, plan.duration_s)),
    )
    refs = AdjacentReferences()
    pipe_before, _ = quiet(lambda: pipeline_ref(jpegs), _timing_noise, "pipeline", plan.retries)

    def best_batch(batch: int) -> ForwardTiming:
        return quiet(
            partial(forward_ref, plan.best_dtype, batch, plan.budget_s),
            _timing_noise,
            "forward",
            plan.retries,
        )[0]

    before = {batch: best_batch(batch) for batch in plan.best_batches}
    scenarios = [_sequential(server, load, jpegs.label, bodies, plan, forward_ref, refs)]
    for clients in plan.concurrency:
        window, tries = quiet(
            partial(load_window, server, load, bodies, LoadPlan(clients=clients, duration_s=plan.duration_s)),
            _window_noise,
            f"{clients} clients",
            plan.retries,
        )
        scenarios.append(scenario(jpegs.label, clients, window, tries))
    for batch, first in before.items():
        around = _around(first, best_batch(batch))
        refs.forward_candidates[str(batch)] = around | {"batch_size": batch, "dtype": plan.best_dtype}
    refs.best = max(refs.forward_candidates.values(), key=lambda c: float(c["images_per_s"]))
    pipe_after, _ = quiet(lambda: pipeline_ref(jpegs), _timing_noise, "pipeline", plan.retries)
    refs.pipeline = _around(pipe_before, pipe_after)
    return refs, scenarios


def _around(before: ForwardTiming | PipelineTiming, after: ForwardTiming | PipelineTiming) -> dict[str, Any]:
    rates = [before.images_per_s, after.images_per_s]
    return {
        "images_per_s": statistics.fmean(rates),
        "before_after_images_per_s": rates,
        "background_cores": max(before.background_cores, after.background_cores),
    }


def _sequential(
    server: ServerProcess,
    load: LoadGenerator,
    label: str,
    bodies: Sequence[bytes],
    plan: SetPlan,
    forward_ref: Callable[[str, int, float], ForwardTiming],
    refs: AdjacentReferences,
) -> Scenario:
    """One client, sequential requests, in blocks interleaved with bs=1 forwards at the server's precision
    (so the single-image latency and its reference see the same machine speed)."""
    windows: list[Window] = []
    backgrounds: list[float] = []
    sequential = LoadPlan(clients=1, count=max(1, plan.sequential // plan.blocks))
    retries = 0
    for _ in range(plan.blocks):
        ref, _ = quiet(
            lambda: forward_ref(plan.served_dtype, 1, plan.budget_s / 2),
            _timing_noise,
            "forward",
            plan.retries,
        )
        refs.bs1_block_medians_ms.append(ref.median_ms)
        backgrounds.append(ref.background_cores)
        window, tries = quiet(
            lambda: load_window(server, load, bodies, sequential),
            _window_noise,
            "sequential client",
            plan.retries,
        )
        windows.append(window)
        retries += tries
    refs.bs1_background_cores = max(backgrounds)
    return scenario(label, 1, merge(windows), retries)


# ------------------------------------------------------------------------------------------------ the run
@dataclass
class ServeResults:
    """Everything one run of ``bench.serve_bench`` measured (``bench.serve_report`` renders it)."""

    machine: dict[str, Any]
    quick: bool
    defaults: str  # the model's defaults, as the server applies them with no options
    server: dict[str, Any]  # precision, served_dtype, ready_s, args, env, command
    client_note: str
    model_only: list[ForwardTiming]
    sets: list[SetResult]
    busy_cores_at_start: float
    wall_s: float = 0.0
