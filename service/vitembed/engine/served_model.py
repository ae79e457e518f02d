"""One served model: its backbone, preprocessor, batcher, precision and admission state, and how it is
started (load the weights, choose the precision on the probe images, time one full batch so that admission
predicts waits from the first request on, start the batcher's forward thread)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from vit_backbone import load_backbone
from vit_backbone.backbone import Backbone
from vit_backbone.cpu_quota import available_cpus
from vit_backbone.decode import DecodeLimits
from vit_backbone.embedded import default_cache_dir
from vit_backbone.mirror import forward_passes
from vit_backbone.precision import MIN_COSINE, PrecisionChoice, choose_autocast, probe_images, to_device
from vit_backbone.preprocess import Preprocessor, check_token_budget, stack, stack_valid
from vitembed.engine.admission import AdmissionControl, ModelLoad
from vitembed.engine.batcher import DynamicBatcher, WorkItem, images_per_batch
from vitembed.engine.precision_cache import decision_key, load_decision, store_decision
from vitembed.metrics import Metrics
from vitembed.settings import ServiceSettings

log = logging.getLogger(__name__)

Forward = Callable[[Backbone, Sequence[WorkItem]], Sequence[Any]]


@dataclass
class ServedModel:
    name: str
    backbone: Backbone
    preprocessor: Preprocessor
    batcher: DynamicBatcher
    precision: PrecisionChoice
    load: ModelLoad

    def expected_tokens(self, policy: str, size: tuple[int, int] | None) -> int:
        """Tokens per image before decoding: the policy's output for a source of the model's own size
        (exact for crop, squash and pad; the budget for dynamic)."""
        bb = self.backbone
        (ph, pw), (gh, gw) = bb.patch_size, bb.processing_grid
        height, width = self.preprocessor.target_size(policy, size, (gh * ph, gw * pw))  # type: ignore[arg-type]
        return (height // ph) * (width // pw) + bb.prefix_tokens

    def check_size(self, policy: str, size: tuple[int, int], max_tokens: int) -> None:
        """A size that no image can satisfy is the request's fault, not one image's: refuse it before
        decoding anything (the preprocessor's own check names the nearest valid sizes)."""
        self.preprocessor.target_size(policy, size, size)  # type: ignore[arg-type]
        (ph, pw) = self.backbone.patch_size
        grid = (size[0] // ph, size[1] // pw)
        check_token_budget(grid, max_tokens, f"size {size[0]}x{size[1]}")


def start_model(
    name: str,
    target: str,
    *,
    settings: ServiceSettings,
    device: torch.device,
    limits: DecodeLimits,
    admission: AdmissionControl,
    metrics: Metrics,
    forward: Forward,
    on_drop: Callable[[str], None],
    workers: int = 1,
) -> ServedModel:
    """Load ``target``, choose its precision, seed its throughput estimate and start its batcher."""
    started = time.monotonic()
    backbone = load_backbone(target, device=device, cache_dir=settings.cache_dir)
    loaded = time.monotonic()
    precision = choose_precision(name, backbone, settings.precision, settings.cache_dir)
    # after the precision probe (its timings compare eager passes); the CPU only: graphs are measured there
    if settings.forward_graphs and device.type == "cpu":
        backbone.use_graphs()
    chosen = time.monotonic()
    preprocessor = Preprocessor(
        backbone.preprocess_config, backbone.patch_size, backbone.processing_grid, limits=limits
    )
    load = admission.model(
        name,
        batch_wait_s=settings.max_wait_ms / 1000,
        batch_images=partial(images_per_batch, settings.max_batch_size, settings.max_batch_tokens),
        ingest_share=ingest_share(backbone, settings, workers),
        workers=workers,
    )
    seed_estimate(backbone, preprocessor, load, settings)

    def on_batch(size: int, queue_wait: float, forward_s: float) -> None:
        metrics.batch_size.labels(name).observe(size)
        metrics.forward_passes.labels(name).inc()
        metrics.stage_seconds.labels("queue").observe(queue_wait)
        metrics.stage_seconds.labels("forward").observe(forward_s)

    batcher = DynamicBatcher(
        name,
        lambda items: forward(backbone, items),
        load=load,
        max_batch_size=settings.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens,
        max_wait_s=settings.max_wait_ms / 1000,
        on_batch=on_batch,
        on_depth=metrics.queue_depth.labels(name).set,
        on_drop=on_drop,
        workers=workers,
        nice=settings.forward_nice,
    )
    ready = time.monotonic()
    log.info(
        "model %s ready in %.2f s (load %.2f s, precision %.2f s, warm-up %.2f s; %s)",
        name, ready - started, loaded - started, chosen - loaded, ready - chosen, precision.describe(),
    )  # fmt: skip
    return ServedModel(name, backbone, preprocessor, batcher, precision, load)


def choose_precision(
    name: str, backbone: Backbone, setting: str, cache_dir: Path | None = None
) -> PrecisionChoice:
    """The one precision rule of vitembed (``choose_autocast``, shared with the catalog job) on the warm-up
    images with the model's default options; the choice is applied to the backbone. An ``auto`` decision
    that needed measuring is cached under the cache directory, keyed by the CPU flags (or GPU), torch,
    the model's revision and preprocessing (precision_cache): the next start on such a machine skips it."""
    key = None
    if setting == "auto":
        key = decision_key(backbone.device, *backbone.facts, setting)
        cached = load_decision(cache_dir or default_cache_dir(), key)
        if cached is not None:
            backbone.autocast = cached.dtype
            log.info("model %s: precision %s from the cached decision", name, cached.label)
            return cached
    try:
        choice = choose_autocast(backbone, setting, probe_images() * 2, batch_size=8)
    except ValueError as exc:
        raise ValueError(f"model {name}: {exc}") from exc
    if key is not None and choice.seconds is not None:  # measured: worth remembering
        store_decision(cache_dir or default_cache_dir(), key, choice)
    if setting == "auto" and choice.dtype is None and choice.seconds is not None:
        log.warning(
            "model %s: bfloat16 autocast not used (min cosine %.5f, %.3f s vs %.3f s float32)",
            name,
            choice.min_cosine,
            choice.seconds[1],
            choice.seconds[0],
        )
    elif choice.min_cosine is not None and choice.min_cosine < MIN_COSINE:
        log.warning("model %s: %s as asked, although it drifts from float32", name, choice.describe())
    backbone.autocast = choice.dtype
    return choice


def ingest_share(backbone: Backbone, settings: ServiceSettings, forward_workers: int = 1) -> float:
    """How much of an image's decode CPU time delays this model's forward pass (admission's
    ``ingest_share``): the fraction of the decode workers that find no core the forward pass leaves free.
    All of it on the CPU when the forward threads' torch threads cover every core this process may use (the
    default); half with 2 cores, one forward thread of 1 torch thread and 2 decode workers; none on an
    accelerator."""
    if not settings.admission_counts_decode or backbone.device.type != "cpu":
        return 0.0
    free_cores = max(0, available_cpus() - forward_workers * torch.get_num_threads())
    workers = settings.decode_workers
    return max(0, workers - free_cores) / workers


def seed_estimate(
    backbone: Backbone, preprocessor: Preprocessor, load: ModelLoad, settings: ServiceSettings
) -> None:
    """Time one full batch at the default options, so that admission predicts waits from the first request
    on (later forward passes keep the estimate current). A full batch, not a smaller one: per-image cost
    falls with the batch size, and a small batch's would make admission refuse work the server can do
    (measured: 32 concurrent single images refused with a 2-image seed). With graphs, the default options'
    graph is built first and the timed pass is the graph's."""
    cpu_started = time.thread_time()
    prepared = preprocessor(
        probe_images()[0], policy=backbone.check_policy(None), size=backbone.choose_size(None)
    )
    load.observe_ingest(time.thread_time() - cpu_started)
    pooling, layers = backbone.choose(None, None)
    # an image's cost in the batcher's units: its tokens, twice for a mirrored pooling (vit_backbone.mirror)
    tokens = (prepared.grid[0] * prepared.grid[1] + backbone.prefix_tokens) * forward_passes([pooling])
    count = images_per_batch(settings.max_batch_size, settings.max_batch_tokens, tokens)
    pixel_values, _ = stack([prepared] * count)  # [count, 3, H, W]
    valid = stack_valid([prepared] * count)  # [count, h, w] or None
    pixel_values = to_device(pixel_values, backbone.device)
    graphs = backbone.graphs
    if graphs is not None:  # the default size's graph is traced here, not on the first requests
        for _ in range(graphs.trace_after):
            backbone.pooled(pixel_values, pooling, layers, valid=valid)
    started = time.perf_counter()
    backbone.pooled(pixel_values, pooling, layers, valid=valid)
    load.observe(tokens, count, time.perf_counter() - started)
