"""The serving engine: served backbones, the decode pool and one dynamic batcher per model.

Data flow of a request: admission (predicted wait, before any decoding: ``admission.py``) → bytes → decode +
preprocess (worker pool, in parallel with forward passes) → batcher queue → forward thread (features +
pooling) → rows back in input order. Work whose deadline passes or whose client leaves is dropped before
it is decoded or forwarded. The engine holds no HTTP
knowledge; the app maps its exceptions to statuses.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vit_backbone import load_backbone
from vit_backbone.backbone import Backbone
from vit_backbone.cpu_quota import available_cpus
from vit_backbone.decode import DecodeLimits
from vit_backbone.errors import ModelNotFoundError, VitEmbedError
from vit_backbone.pooling import check_pooling, pooled_array
from vit_backbone.precision import (
    MIN_COSINE,
    PrecisionChoice,
    choose_autocast,
    pick_device,
    probe_images,
    to_device,
)
from vit_backbone.preprocess import Prepared, Preprocessor, check_token_budget, stack, stack_valid
from vitembed.engine.admission import AdmissionControl, ModelLoad, Reservation
from vitembed.engine.batcher import (
    CancelledWorkError,
    DeadlineExceededError,
    DynamicBatcher,
    QueueFullError,
    RequestTicket,
    WorkItem,
)
from vitembed.engine.served_heads import (
    BoundHead,
    bind_heads,
    card_json,
    get_head,
    head_outputs,
    pool_requests,
    select_heads,
)
from vitembed.server.metrics import Metrics
from vitembed.settings import ServiceSettings

log = logging.getLogger(__name__)

__all__ = [
    "CancelledWorkError",
    "ClassifyOutcome",
    "DeadlineExceededError",
    "EmbedOptions",
    "EmbedOutcome",
    "Engine",
    "ItemError",
    "NotReadyError",
    "QueueFullError",
    "RequestTicket",
]


class ItemError(Exception):
    """One image of a request is unusable; ``index`` is its 0-based position."""

    def __init__(self, index: int, error: VitEmbedError) -> None:
        super().__init__(f"image {index}: {error}")
        self.index = index
        self.error = error


class NotReadyError(Exception):
    pass


@dataclass(frozen=True)
class EmbedOptions:
    pooling: str | None = None
    layers: tuple[int, ...] | None = None
    size: tuple[int, int] | None = None
    policy: str | None = None
    normalize: bool = False
    heads: tuple[str, ...] = ()  # heads computed from the same forward pass


@dataclass(frozen=True)
class EmbedOutcome:
    vectors: np.ndarray  # [n, F] or [n, h, w, F] float32, input order
    grids: list[tuple[int, int]]
    model: str
    revision: str
    preprocess_hash: str
    pooling: str
    layers: list[int] | None
    policy: str
    normalized: bool
    interpolation: str
    precision: str
    heads: tuple[BoundHead, ...] = ()
    head_outputs: list[dict[str, np.ndarray]] = field(default_factory=list)  # per image: see head_outputs
    valid: list[np.ndarray] = field(default_factory=list)  # per image [h, w]: image fraction of each patch


@dataclass(frozen=True)
class ClassifyOutcome:
    head: BoundHead
    outputs: list[np.ndarray]  # per image: probabilities [C], or logits [h, w, C] for a patch head
    source_sizes: list[tuple[int, int]]  # (H, W) of each input image
    precision: str


@dataclass
class _Served:
    name: str
    backbone: Backbone
    preprocessor: Preprocessor
    batcher: DynamicBatcher
    precision: PrecisionChoice
    load: ModelLoad


class Engine:
    def __init__(self, settings: ServiceSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.limits = DecodeLimits(
            max_bytes=settings.max_body_bytes,
            max_pixels=settings.max_image_pixels,
            max_aspect_ratio=settings.max_aspect_ratio,
        )
        self.admission = AdmissionControl(settings.queue_size, settings.queue_delay_target_s)
        self._pool = ThreadPoolExecutor(settings.decode_workers, thread_name_prefix="decode")
        self._served: dict[str, _Served] = {}
        self._heads: dict[str, BoundHead] = {}
        self._ready = False

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Load every model, choose its precision, and run a real forward pass before reporting ready."""
        # an explicit setting wins; otherwise the CPUs this process may use (affinity, cgroup quota), not the
        # host's core count torch sees by default (`--cpus 1` in a container -> 1 thread)
        threads = self.settings.torch_threads or available_cpus()
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        log.info("torch threads: %d", threads)
        device = pick_device(self.settings.device)
        for name, target in self.settings.models.items():
            started = time.monotonic()
            backbone = load_backbone(target, device=device, cache_dir=self.settings.cache_dir)
            precision = self._choose_precision(name, backbone)
            preprocessor = Preprocessor(
                backbone.preprocess_config, backbone.patch_size, backbone.processing_grid, limits=self.limits
            )
            load = self.admission.model(name, batch_wait_s=self.settings.max_wait_ms / 1000)
            self._seed_estimate(backbone, preprocessor, load)
            batcher = DynamicBatcher(
                name,
                functools.partial(self._forward, backbone),
                load=load,
                max_batch_size=self.settings.max_batch_size,
                max_batch_tokens=self.settings.max_batch_tokens,
                max_wait_s=self.settings.max_wait_ms / 1000,
                on_batch=functools.partial(self._record_batch, name),
                on_depth=self.metrics.queue_depth.labels(name).set,
                on_drop=self._record_drop,
            )
            self._served[name] = _Served(name, backbone, preprocessor, batcher, precision, load)
            log.info("model %s ready in %.1f s (%s)", name, time.monotonic() - started, precision.describe())
        self._heads = bind_heads(self.settings.heads, {n: s.backbone for n, s in self._served.items()})
        self._ready = True

    def _choose_precision(self, name: str, backbone: Backbone) -> PrecisionChoice:
        """The one precision rule of vitembed (``choose_autocast``, shared with the catalog job) on the
        warm-up images with the model's default options; the choice is applied to the backbone."""
        try:
            choice = choose_autocast(backbone, self.settings.precision, probe_images() * 2, batch_size=8)
        except ValueError as exc:
            raise ValueError(f"model {name}: {exc}") from exc
        if self.settings.precision == "auto" and choice.dtype is None and choice.seconds is not None:
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

    def _seed_estimate(self, backbone: Backbone, preprocessor: Preprocessor, load: ModelLoad) -> None:
        """Time one full batch at the default options, so that admission predicts waits from the first
        request on (later forward passes keep the estimate current)."""
        prepared = preprocessor(probe_images()[0], policy=backbone.check_policy(None))
        tokens = prepared.grid[0] * prepared.grid[1] + backbone.prefix_tokens
        count = max(1, min(self.settings.max_batch_size, self.settings.max_batch_tokens // tokens))
        pixel_values, _ = stack([prepared] * count)  # [count, 3, H, W]
        valid = stack_valid([prepared] * count)  # [count, h, w] or None
        pixel_values = to_device(pixel_values, backbone.device)
        pooling, layers = backbone.choose(None, None)
        started = time.perf_counter()
        backbone.pooled(pixel_values, pooling, layers, valid=valid)
        load.observe(tokens, count, time.perf_counter() - started)

    def stop(self) -> None:
        self._ready = False
        for served in self._served.values():
            served.batcher.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        return self._ready and all(s.batcher.alive for s in self._served.values())

    # ----------------------------------------------------------------- facts
    @property
    def model_names(self) -> list[str]:
        return list(self._served) or list(self.settings.models)

    def precision(self, model: str) -> PrecisionChoice:
        """What the served model's precision setting resolved to (``label`` is float32/bfloat16/float16)."""
        return self._get(model).precision

    def model_infos(self) -> dict[str, dict[str, Any]]:
        """Each model's facts and precision, plus ``heads`` (name -> card) for a model that has heads."""
        infos: dict[str, dict[str, Any]] = {}
        for name, served in self._served.items():
            infos[name] = {**served.backbone.info().to_dict(), "precision": served.precision.describe()}
            heads = {h.name: card_json(h.card) for h in self._heads.values() if h.model == name}
            if heads:
                infos[name]["heads"] = heads
        return infos

    @property
    def head_names(self) -> list[str]:
        return list(self._heads)

    def bound_head(self, name: str) -> BoundHead:
        """The served head ``name`` (404 ``head_not_found`` otherwise)."""
        return get_head(self._heads, name)

    def backbone(self, model: str) -> Backbone:
        """The served backbone (facts and preprocessing config; forward passes go through the batcher)."""
        return self._get(model).backbone

    async def prepare(
        self,
        model: str,
        data: bytes,
        policy: str | None,
        size: tuple[int, int] | None,
        *,
        ticket: RequestTicket,
    ) -> Prepared:
        """One image as the model is given it (decode + preprocess on the decode pool), to show it."""
        served = self._get(model)
        chosen = served.backbone.check_policy(policy)
        if size is not None:
            self._check_size(served, chosen, size)
        return (await self._prepare_all(served, [data], chosen, size, ticket))[0]

    def _get(self, model: str) -> _Served:
        if not self._ready:
            raise NotReadyError("models are still loading")
        served = self._served.get(model)
        if served is None:
            raise ModelNotFoundError(f"model {model!r} is not served; served: {', '.join(self._served)}")
        return served

    def load(self, model: str) -> ModelLoad:
        """The admission state of ``model``: reserved images, the throughput estimate."""
        return self._get(model).load

    def output_dim(self, model: str, options: EmbedOptions) -> int:
        served = self._get(model)
        bb = served.backbone
        pooling, layers = bb.choose(options.pooling, options.layers)
        return bb.output_dim(pooling, layers)

    # ----------------------------------------------------------------- the request path
    async def embed(
        self,
        model: str,
        images: Sequence[bytes],
        options: EmbedOptions,
        *,
        ticket: RequestTicket,
        deadline: float,
    ) -> EmbedOutcome:
        served = self._get(model)
        bb = served.backbone
        # validate every option before spending any work on the images
        pooling, layers = bb.choose(options.pooling, options.layers)
        policy = bb.check_policy(options.policy)
        heads = select_heads(self._heads, options.heads, model, policy, options.size, served.preprocessor)
        if options.size is not None:
            self._check_size(served, policy, options.size)
        head_key = tuple(sorted(h.name for h in heads))  # one batch key per set of heads, whatever the order
        key_tail = (pooling, None if layers is None else tuple(layers), options.normalize, head_key)
        reservation = self._admit(served, len(images), policy, options.size, deadline)
        try:
            prepared = await self._prepare_all(served, images, policy, options.size, ticket)
            rows = await self._run(served, prepared, key_tail, ticket, deadline, reservation)
        finally:
            reservation.release()  # whatever never reached the queue (an error, a cancellation)
        outputs = [row[1] for row in rows] if heads else []
        vectors = [row[0] for row in rows] if heads else rows
        return EmbedOutcome(
            vectors=np.stack(vectors) if rows else np.zeros((0, bb.output_dim(pooling, layers)), np.float32),
            grids=[p.grid for p in prepared],
            model=model,
            revision=bb.checkpoint.revision,
            preprocess_hash=bb.preprocess_config.hash(),
            pooling=pooling,
            layers=layers,
            policy=policy,
            normalized=options.normalize,
            interpolation=bb.info_interpolation,
            precision=served.precision.describe(),
            heads=heads,
            head_outputs=outputs,
            valid=[p.validity() for p in prepared],
        )

    async def classify(
        self, head: str, images: Sequence[bytes], *, ticket: RequestTicket, deadline: float
    ) -> ClassifyOutcome:
        """One head's outputs: images prepared as the head was trained, its features, its probabilities."""
        if not self._ready:
            raise NotReadyError("models are still loading")
        bound = get_head(self._heads, head)
        served = self._get(bound.model)
        inputs = bound.inputs
        if inputs.size is not None:
            self._check_size(served, inputs.policy, inputs.size)
        layers = None if inputs.layers is None else tuple(inputs.layers)
        reservation = self._admit(served, len(images), inputs.policy, inputs.size, deadline)
        try:
            prepared = await self._prepare_all(served, images, inputs.policy, inputs.size, ticket)
            key_tail = (inputs.pooling, layers, False, (head,))
            rows = await self._run(served, prepared, key_tail, ticket, deadline, reservation)
        finally:
            reservation.release()
        return ClassifyOutcome(
            head=bound,
            outputs=[row[1][head] for row in rows],
            source_sizes=[p.source_size for p in prepared],
            precision=served.precision.describe(),
        )

    async def _run(
        self,
        served: _Served,
        prepared: Sequence[Prepared],
        key_tail: tuple[str, tuple[int, ...] | None, bool, tuple[str, ...]],
        ticket: RequestTicket,
        deadline: float,
        reservation: Reservation,
    ) -> list[Any]:
        """Queue one request's images for the forward thread and wait for their rows, in input order."""
        prefix = served.backbone.prefix_tokens
        items = [
            WorkItem(
                prepared=p,
                key=(p.grid, *key_tail),
                tokens=p.grid[0] * p.grid[1] + prefix,
                ticket=ticket,
                reservation=reservation,
            )
            for p in prepared
        ]
        served.batcher.submit(items)
        results = asyncio.gather(*(asyncio.wrap_future(item.future) for item in items))
        try:
            rows = await asyncio.wait_for(results, timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            ticket.cancel()
            raise DeadlineExceededError(f"no result within {self._budget(ticket):g} s") from exc
        except BaseException:
            ticket.cancel()  # client gone or the task cancelled: drop what is still queued
            results.add_done_callback(_consume)  # nobody awaits it any more; don't log it as lost
            raise
        self.metrics.images.labels(served.name).inc(len(items))
        self.metrics.admission_wait.labels("actual").observe(time.monotonic() - reservation.admitted_at)
        return list(rows)

    def refuse_early(self, model: str, deadline: float) -> None:
        """Before a body is read: refuse at once (``QueueFullError``) if not even one image of ``model`` at
        its default options could be admitted now. Nothing is reserved; the full check follows the parse."""
        served = self._get(model)
        tokens = self._expected_tokens(served, served.backbone.check_policy(None), None)
        try:
            served.load.admit(1, tokens, deadline - time.monotonic(), reserve=False)
        except QueueFullError as refused:
            self._count_refusal(served, refused)
            raise

    def _count_refusal(self, served: _Served, refused: QueueFullError) -> None:
        self.metrics.rejected.labels(refused.reason).inc()
        self.metrics.admission.labels(served.name, refused.reason).inc()

    def _admit(
        self, served: _Served, count: int, policy: str, size: tuple[int, int] | None, deadline: float
    ) -> Reservation:
        """Reserve room for ``count`` images before any is decoded, or refuse (``QueueFullError``, 429)."""
        tokens = self._expected_tokens(served, policy, size)
        try:
            reservation = served.load.admit(count, tokens, deadline - time.monotonic())
        except QueueFullError as refused:
            self._count_refusal(served, refused)
            raise
        self.metrics.admission.labels(served.name, "admitted").inc()
        self.metrics.admission_wait.labels("predicted").observe(reservation.predicted_wait_s)
        return reservation

    @staticmethod
    def _expected_tokens(served: _Served, policy: str, size: tuple[int, int] | None) -> int:
        """Tokens per image before decoding: the policy's output for a source of the model's own size
        (exact for crop, squash and pad; the budget for dynamic)."""
        bb = served.backbone
        (ph, pw), (gh, gw) = bb.patch_size, bb.processing_grid
        height, width = served.preprocessor.target_size(policy, size, (gh * ph, gw * pw))  # type: ignore[arg-type]
        return (height // ph) * (width // pw) + bb.prefix_tokens

    def _budget(self, ticket: RequestTicket) -> float:
        return ticket.budget_s if ticket.budget_s is not None else self.settings.request_timeout_s

    def _check_size(self, served: _Served, policy: str, size: tuple[int, int]) -> None:
        """A size that no image can satisfy is the request's fault, not one image's: refuse it before
        decoding anything (the preprocessor's own check names the nearest valid sizes)."""
        served.preprocessor.target_size(policy, size, size)  # type: ignore[arg-type]
        (ph, pw) = served.backbone.patch_size
        grid = (size[0] // ph, size[1] // pw)
        check_token_budget(grid, self.settings.max_tokens_per_image, f"size {size[0]}x{size[1]}")

    async def _prepare_all(
        self,
        served: _Served,
        images: Sequence[bytes],
        policy: str,
        size: tuple[int, int] | None,
        ticket: RequestTicket,
    ) -> list[Prepared]:
        loop = asyncio.get_running_loop()
        jobs = [
            loop.run_in_executor(self._pool, self._prepare_one, served, data, policy, size, ticket)
            for data in images
        ]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for index, result in enumerate(results):
            if isinstance(result, VitEmbedError):
                raise ItemError(index, result)
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if isinstance(r, Prepared)]

    def _prepare_one(
        self,
        served: _Served,
        data: bytes,
        policy: str,
        size: tuple[int, int] | None,
        ticket: RequestTicket,
    ) -> Prepared:
        if ticket.cancelled:  # waited in the decode pool's queue: nothing is decoded for a lost request
            self._record_drop("cancelled")
            raise CancelledWorkError("the client went away")
        if time.monotonic() > ticket.deadline:
            self._record_drop("deadline")
            raise DeadlineExceededError(f"no result within {self._budget(ticket):g} s")
        started = time.perf_counter()
        prepared = served.preprocessor(data, policy=policy, size=size, draft=True)  # type: ignore[arg-type]
        grid = prepared.grid
        check_token_budget(
            grid, self.settings.max_tokens_per_image, f"this size ({grid[0]}x{grid[1]} patches)"
        )
        self.metrics.stage_seconds.labels("decode").observe(prepared.decode_s)
        self.metrics.stage_seconds.labels("preprocess").observe(
            time.perf_counter() - started - prepared.decode_s
        )
        return prepared

    # ----------------------------------------------------------------- the forward thread
    def _forward(self, backbone: Backbone, items: Sequence[WorkItem]) -> Sequence[Any]:
        """Rows [F] (or [h, w, F]); with heads, (row, {head: output}) pairs from the same forward pass."""
        _, pooling, layers, normalize, head_names = items[0].key
        pixel_values, _ = stack([item.prepared for item in items])  # [b, 3, H, W]
        valid = stack_valid([item.prepared for item in items])  # [b, h, w]; None when nothing is letterboxed
        pixel_values = to_device(pixel_values, backbone.device)  # pinned + non-blocking on CUDA
        chosen_layers = None if layers is None else list(layers)
        heads = [self._heads[name] for name in head_names]
        if heads:
            requests, where = pool_requests(check_pooling(pooling), chosen_layers, heads)
            features = backbone.pooled_many(pixel_values, requests, valid=valid)  # one forward pass for all
            pooled = features[0]
        else:
            pooled = backbone.pooled(pixel_values, check_pooling(pooling), chosen_layers, valid=valid)
        vectors = pooled_array(pooled, normalize)  # [b, F] or [b, h, w, F]
        if not heads:
            return list(vectors)
        return list(zip(vectors, head_outputs(heads, features, where), strict=True))

    def _record_drop(self, reason: str) -> None:
        self.metrics.rejected.labels(reason).inc()

    def _record_batch(self, model: str, size: int, queue_wait: float, forward_s: float) -> None:
        self.metrics.batch_size.labels(model).observe(size)
        self.metrics.forward_passes.labels(model).inc()
        self.metrics.stage_seconds.labels("queue").observe(queue_wait)
        self.metrics.stage_seconds.labels("forward").observe(forward_s)


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
