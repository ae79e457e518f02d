"""The serving engine: served backbones, the decode pool and one dynamic batcher per model.

Data flow of a request: admission (predicted wait, before any decoding: ``admission.py``) → bytes → decode +
preprocess (worker pool, in parallel with forward passes) → batcher queue → forward thread (features +
pooling) → rows back in input order. Work whose deadline passes or whose client leaves is dropped before
it is decoded or forwarded. The engine holds no HTTP
knowledge; the app maps its exceptions to statuses.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from vit_backbone.backbone import Backbone
from vit_backbone.decode import DecodeLimits
from vit_backbone.errors import ModelNotFoundError, VitEmbedError
from vit_backbone.mirror import forward_passes
from vit_backbone.pooling import check_pooling, pooled_array
from vit_backbone.precision import PrecisionChoice, pick_device, to_device
from vit_backbone.preprocess import Prepared, check_token_budget, stack, stack_valid
from vitembed.engine.admission import AdmissionControl, ModelLoad, Reservation
from vitembed.engine.batcher import (
    CancelledWorkError,
    DeadlineExceededError,
    QueueFullError,
    RequestTicket,
    WorkItem,
)
from vitembed.engine.request_types import (
    ClassifyOutcome,
    EmbedOptions,
    EmbedOutcome,
    NotReadyError,
    RequestImageError,
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
from vitembed.engine.served_model import ServedModel, start_model
from vitembed.engine.threads import configure_threads
from vitembed.metrics import Metrics
from vitembed.settings import ServiceSettings

log = logging.getLogger(__name__)
# the place a request's early check holds while its body is read (Engine.refuse_early), per request task:
# (model, lease id), traded by that request's full admission check (the gate's, taken on the request head,
# reaches the task through the request's scope and refuse_early(held=...))
_LEASE: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "vitembed_lease", default=None
)

__all__ = [  # the engine's public face: the request types and the errors of the request path
    "CancelledWorkError",
    "ClassifyOutcome",
    "DeadlineExceededError",
    "EmbedOptions",
    "EmbedOutcome",
    "Engine",
    "NotReadyError",
    "QueueFullError",
    "RequestImageError",
    "RequestTicket",
]


class Engine:
    def __init__(self, settings: ServiceSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.limits = DecodeLimits(
            max_bytes=settings.max_body_bytes,
            max_pixels=settings.max_image_pixels,
            max_aspect_ratio=settings.max_aspect_ratio,
        )
        self.admission = AdmissionControl(
            settings.queue_size, settings.queue_delay_target_s, spread_retries=settings.spread_retry_after
        )
        self._pool = ThreadPoolExecutor(settings.decode_workers, thread_name_prefix="decode")
        self._served: dict[str, ServedModel] = {}
        self._heads: dict[str, BoundHead] = {}
        self._ready = False

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Load every model, choose its precision, and run a real forward pass before reporting ready."""
        device = pick_device(self.settings.device)
        workers = configure_threads(self.settings, device)
        for name, target in self.settings.models.items():
            self._served[name] = start_model(
                name,
                target,
                settings=self.settings,
                device=device,
                limits=self.limits,
                admission=self.admission,
                metrics=self.metrics,
                forward=self._forward,
                on_drop=self._record_drop,
                workers=workers,
            )
        self._heads = bind_heads(self.settings.heads, {n: s.backbone for n, s in self._served.items()})
        self._ready = True

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
        """Each model's facts and precision, and ``heads``: the served heads on it (name -> card, ``{}`` when
        none). ``Backbone.info()``'s own ``heads`` (the attention heads per block) is ``attention_heads``
        here, so that one field never means two things."""
        infos: dict[str, dict[str, Any]] = {}
        for name, served in self._served.items():
            facts = served.backbone.info().to_dict()
            infos[name] = {
                **facts,
                "attention_heads": facts.pop("heads"),
                "location": served.backbone.checkpoint.location,  # what a catalog records (--server)
                "precision": served.precision.label,
                "precision_cosine": served.precision.min_cosine,
                "heads": {h.name: card_json(h.card) for h in self._heads.values() if h.model == name},
            }
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
        pooling: str | None = None,
    ) -> Prepared:
        """One image as the model is given it (decode + preprocess on the decode pool), to show it; the
        box is the one an embed request with ``pooling`` gets when ``size`` is None (the preset's, or the
        native box for ``patch``)."""
        served = self._get(model)
        chosen = served.backbone.check_policy(policy)
        size = served.backbone.choose_size(size, None, pooling)
        if size is not None:
            served.check_size(chosen, size, self.settings.max_tokens_per_image)
        return (await self._prepare_all(served, [data], chosen, size, ticket))[0]

    def _get(self, model: str) -> ServedModel:
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
        pooling, layers = bb.choose(options.pooling, options.layers, options.preset)
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
        pooling, layers = bb.choose(options.pooling, options.layers, options.preset)
        policy = bb.check_policy(options.policy, options.preset)
        size = bb.choose_size(options.size, options.preset, pooling)  # None: the model's native size
        heads = select_heads(self._heads, options.heads, model, policy, size, served.preprocessor)
        if size is not None:
            served.check_size(policy, size, self.settings.max_tokens_per_image)
        head_key = tuple(sorted(h.name for h in heads))  # one batch key per set of heads, whatever the order
        key_tail = (pooling, None if layers is None else tuple(layers), options.normalize, head_key)
        passes = forward_passes([pooling, *(h.inputs.pooling for h in heads)])  # 2: a mirrored pooling
        reservation = self._admit(served, len(images), policy, size, ticket, passes)
        try:
            prepared = await self._prepare_all(served, images, policy, size, ticket, reservation)
            rows = await self._run(served, prepared, key_tail, ticket, deadline, reservation, passes)
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
            precision=served.precision.label,
            precision_cosine=served.precision.min_cosine,
            heads=heads,
            head_outputs=outputs,
            valid=[p.validity() for p in prepared],
            preset=bb.preset_defaults(options.preset).preset,
            size=size,
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
            served.check_size(inputs.policy, inputs.size, self.settings.max_tokens_per_image)
        layers = None if inputs.layers is None else tuple(inputs.layers)
        passes = forward_passes([inputs.pooling])
        reservation = self._admit(served, len(images), inputs.policy, inputs.size, ticket, passes)
        try:
            prepared = await self._prepare_all(
                served, images, inputs.policy, inputs.size, ticket, reservation
            )
            key_tail = (inputs.pooling, layers, False, (head,))
            rows = await self._run(served, prepared, key_tail, ticket, deadline, reservation, passes)
        finally:
            reservation.release()
        return ClassifyOutcome(
            head=bound,
            outputs=[row[1][head] for row in rows],
            source_sizes=[p.source_size for p in prepared],
            precision=served.precision.label,
            precision_cosine=served.precision.min_cosine,
            image_boxes=[p.image_box for p in prepared],
            patch=served.backbone.patch_size,
        )

    async def _run(
        self,
        served: ServedModel,
        prepared: Sequence[Prepared],
        key_tail: tuple[str, tuple[int, ...] | None, bool, tuple[str, ...]],
        ticket: RequestTicket,
        deadline: float,
        reservation: Reservation,
        passes: int = 1,
    ) -> list[Any]:
        """Queue one request's images for the forward thread and wait for their rows, in input order."""
        prefix = served.backbone.prefix_tokens
        items = [
            WorkItem(
                prepared=p,
                key=(p.grid, *key_tail),
                tokens=(p.grid[0] * p.grid[1] + prefix) * passes,
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
        waited = time.monotonic() - reservation.admitted_at
        self.metrics.admission_wait.labels(served.name, "actual").observe(waited)
        served.load.settle(reservation, waited)
        self.metrics.admission_calibration.labels(served.name).set(served.load.calibration.factor)
        return list(rows)

    def refuse_early(
        self, model: str, deadline: float, *, lease: bool = False, held: int | None = None
    ) -> None:
        """Before a body is read: refuse at once (``QueueFullError``) if not even one image of ``model`` at
        its default options could be admitted now. Nothing is reserved; the full check follows the parse.
        With ``lease`` (called in the request's own task) a request that passes holds a place until that
        check, for at most ``admission.LEASE_S``. ``held``: the place the request-head gate already leased
        for this request (``lease_on_head``); while it is live the request takes it over instead of being
        checked again, so one request never holds two places."""
        served = self._get(model)
        if held is not None and served.load.holds_lease(held):
            _LEASE.set((served.name, held))
            return
        taken = self._check_early(served, deadline, lease)
        if taken is not None:
            _LEASE.set((served.name, taken))

    def lease_on_head(self, model: str, deadline: float) -> int | None:
        """``refuse_early`` for the request-head gate, which runs in the connection's protocol, outside any
        request's task: a request that passes holds a place, whose id the gate hands to the request (its
        scope) for ``refuse_early(held=...)``, or gives back with ``drop_lease`` if it ends without one."""
        return self._check_early(self._get(model), deadline, lease=True)

    def drop_lease(self, model: str, lease: int) -> None:
        """Give back a place the gate leased, unless the request's admission already traded it."""
        self._get(model).load.drop_lease(lease)

    def _check_early(self, served: ServedModel, deadline: float, lease: bool) -> int | None:
        bb = served.backbone
        tokens = served.expected_tokens(bb.check_policy(None), bb.choose_size(None))
        tokens *= forward_passes([bb.defaults.pooling])  # a default request's cost (2: mirrored)
        try:
            checked = served.load.admit(1, tokens, deadline - time.monotonic(), reserve=False, lease=lease)
        except QueueFullError as refused:
            self._count_refusal(served, refused, "head")
            raise
        return checked.lease

    def _count_refusal(self, served: ServedModel, refused: QueueFullError, stage: str) -> None:
        self.metrics.rejected.labels(refused.reason, stage).inc()
        self.metrics.admission.labels(served.name, refused.reason).inc()

    def _admit(
        self,
        served: ServedModel,
        count: int,
        policy: str,
        size: tuple[int, int] | None,
        ticket: RequestTicket,
        passes: int = 1,
    ) -> Reservation:
        """Reserve room for ``count`` images before any is decoded, or refuse (``QueueFullError``, 429)."""
        tokens = served.expected_tokens(policy, size) * passes
        held = _LEASE.get()
        own_lease = held[1] if held is not None and held[0] == served.name else None
        if held is not None:
            _LEASE.set(None)
        try:
            reservation = served.load.admit(
                count, tokens, ticket.deadline - time.monotonic(), own_lease=own_lease
            )
        except QueueFullError as refused:
            self._count_refusal(served, refused, "body")
            raise
        self.metrics.admission.labels(served.name, "admitted").inc()
        self.metrics.admission_wait.labels(served.name, "predicted").observe(reservation.predicted_wait_s)
        return reservation

    def _budget(self, ticket: RequestTicket) -> float:
        return ticket.budget_s if ticket.budget_s is not None else self.settings.request_timeout_s

    async def _prepare_all(
        self,
        served: ServedModel,
        images: Sequence[bytes],
        policy: str,
        size: tuple[int, int] | None,
        ticket: RequestTicket,
        reservation: Reservation | None = None,
    ) -> list[Prepared]:
        loop = asyncio.get_running_loop()
        jobs = [
            loop.run_in_executor(
                self._pool, self._prepare_one, served, data, policy, size, ticket, reservation
            )
            for data in images
        ]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for index, result in enumerate(results):
            if isinstance(result, VitEmbedError):
                raise RequestImageError(index, result)
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if isinstance(r, Prepared)]

    def _prepare_one(
        self,
        served: ServedModel,
        data: bytes,
        policy: str,
        size: tuple[int, int] | None,
        ticket: RequestTicket,
        reservation: Reservation | None,
    ) -> Prepared:
        if ticket.cancelled:  # waited in the decode pool's queue: nothing is decoded for a lost request
            self._record_drop("cancelled")
            raise CancelledWorkError("the client went away")
        if time.monotonic() > ticket.deadline:
            self._record_drop("deadline")
            raise DeadlineExceededError(f"no result within {self._budget(ticket):g} s")
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            prepared = served.preprocessor(data, policy=policy, size=size, draft=True)  # type: ignore[arg-type]
        finally:  # a refused image cost its CPU time too
            served.load.observe_ingest(time.thread_time() - cpu_started)
        if reservation is not None:  # None: a preview, which admission does not count
            reservation.decoded()
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
        self.metrics.rejected.labels(reason, "queued").inc()


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
