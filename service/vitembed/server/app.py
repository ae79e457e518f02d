"""The HTTP adapter: routes, limits and lifecycle around :class:`service.engine.Engine`. No model logic.

``create_app(settings)`` builds one app per call (tests run several in one process); settings are built by
the caller at start, never at import. Middleware, outermost first: request context (request id, metrics by
route template and status, the last-resort 500) → body limit (``Content-Length`` and a counting ``receive``,
before anything reads the body) → Starlette's exception handlers → routes.

Each embedding request: read the whole body → parse (multipart / JSON / data URIs) → engine.embed, with a
watcher that cancels the request's queued work if the client disconnects → check finiteness → serialise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vitembed.engine.engine import (
    DeadlineExceededError,
    EmbedOptions,
    EmbedOutcome,
    Engine,
    NotReadyError,
    RequestTicket,
)
from vitembed.server.auth import require_api_key
from vitembed.server.connection_limits import BodyTimeoutMiddleware, ConcurrencyLimitMiddleware
from vitembed.server.deadlines import budget_s, request_deadline
from vitembed.server.early_refusal import AdmissionGate
from vitembed.server.errors import (
    CLIENT_CLOSED,
    ApiError,
    RequestContextMiddleware,
    error_response,
    install_error_handlers,
)
from vitembed.server.metrics import Metrics
from vitembed.server.openapi import make_contract
from vitembed.server.schemas import (
    EmbedJsonRequest,
    EmbedQuery,
    EmbedResponse,
    ErrorResponse,
    ModelList,
    OpenAIEmbeddingRequest,
    OpenAIEmbeddingResponse,
    StatusOut,
    is_json,
    media_type,
    merge_options,
    parse_embed_json,
    parse_multipart,
    parse_openai,
)
from vitembed.server.serialise import NPY_MEDIA_TYPE, embed_json, embed_npy, openai_json, timed
from vitembed.settings import ServiceSettings

log = logging.getLogger("vitembed.service")

DISCONNECT_POLL_S = 0.05
DEADLINE_GRACE_S = 1.0  # the engine answers 504 itself at the deadline; this is the app's own backstop
JSON_MEDIA_TYPE = "application/json"
T = TypeVar("T")


# ------------------------------------------------------------------------------------------- limits
class BodyLimitMiddleware:
    """Refuse bodies over ``max_body_bytes`` before the framework reads them: a declared Content-Length
    is judged before a byte is read, and a counting ``receive`` stops chunked bodies as they pass it."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> ApiError:
        return ApiError(
            413, "body_too_large", f"the request body is over the limit of {self.max_body_bytes} bytes"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            error = self._too_large()
            await error_response(scope, error.status, error.code, error.message)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()  # answered by the ApiError handler
            return message

        await self.app(scope, counting_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed length; the counting receive still applies
    return None


# ------------------------------------------------------------------------------------------- dependencies
def get_settings(request: Request) -> ServiceSettings:
    settings: ServiceSettings = request.app.state.settings
    return settings


def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


def get_engine(request: Request) -> Engine:
    """The engine, if it can take work now: 503 while models load or when a worker has stopped."""
    engine: Engine | None = getattr(request.app.state, "engine", None)
    if engine is None or not engine.ready:
        raise NotReadyError("the models are not ready (loading, or a model worker stopped)")
    return engine


SettingsDep = Annotated[ServiceSettings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
EngineDep = Annotated[Engine, Depends(get_engine)]

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "bad body: not JSON/multipart, no images, invalid base64, undecodable image",
        401: "missing or wrong bearer token (when the server has an API key)",
        404: "unknown model",
        413: "body over max_body_bytes, too many images, or an image over the byte limit",
        415: "wrong Content-Type or an image format that is not accepted",
        422: "options that cannot be honoured, or an image over the pixel / aspect-ratio limits",
        429: "the queue is full; see Retry-After",
        500: "internal error, or non-finite model output (code non_finite)",
        503: "models not ready",
        504: "request deadline passed",
    }.items()
}

_EMBED_FORM_SCHEMA = {
    "type": "object",
    "required": ["image"],
    "properties": {
        "image": {"type": "array", "items": {"type": "string", "format": "binary"}},
        **{
            name: {"type": "string", "description": str(field.description or "")}
            for name, field in EmbedQuery.model_fields.items()
        },
    },
}

# ------------------------------------------------------------------------------------------- routes
ops = APIRouter(tags=["operations"])
v1 = APIRouter(prefix="/v1", tags=["embeddings"], dependencies=[Depends(require_api_key)])


@ops.get("/health", response_model=StatusOut)
async def health() -> dict[str, str]:
    """The process lives (liveness)."""
    return {"status": "ok"}


@ops.get("/ready", response_model=StatusOut, responses={503: ERROR_RESPONSES[503]})
async def ready(request: Request) -> Response:
    """Every model is loaded, warmed up with a real forward pass, and its worker is running (readiness)."""
    engine: Engine | None = getattr(request.app.state, "engine", None)
    if engine is None or not engine.ready:
        return error_response(request.scope, 503, "not_ready", "the models are not ready")
    return JSONResponse({"status": "ready"})


@ops.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics_text(metrics: MetricsDep) -> Response:
    """Prometheus text format: requests by route and status, queue depth, batch sizes, stage latency."""
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)


@v1.get("/models", response_model=ModelList)
async def models(request: Request, engine: EngineDep, settings: SettingsDep) -> dict[str, Any]:
    """Every served model with its ``Backbone.info()`` (OpenAI's list shape; ``info`` holds the facts)."""
    default = next(iter(settings.models))
    created = int(request.app.state.started_at)
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vitembed",
                "default": name == default,
                "info": info,
            }
            for name, info in engine.model_infos().items()
        ],
    }


@v1.post(
    "/embed",
    response_model=EmbedResponse,
    responses={
        200: {"content": {NPY_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}},
        **ERROR_RESPONSES,
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {"schema": _EMBED_FORM_SCHEMA},
                JSON_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/EmbedJsonRequest"}},
            },
        }
    },
)
async def embed(
    request: Request,
    query: Annotated[EmbedQuery, Query()],
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Response:
    """Embed images sent as multipart parts named ``image`` or as JSON base64; options as form fields, JSON
    fields or query parameters. ``Accept: application/x-npy`` returns one ``.npy`` array, provenance in
    ``X-Vitembed-*`` headers."""
    deadline = request_deadline(request, settings)
    refuse_early(engine, settings, query.model, deadline)
    body = await read_body(request)
    content_type = request.headers.get("content-type")
    if media_type(content_type) == "multipart/form-data":
        images, fields = await _offload(
            len(body), parse_multipart, body, content_type or "", settings.max_images_per_request
        )
    elif is_json(content_type):
        images, fields = await _offload(len(body), parse_embed_json, body, settings.max_images_per_request)
    else:
        raise unsupported_media_type("multipart/form-data or application/json")
    options = merge_options(query.model_dump(exclude_none=True), fields)
    model = options.model or next(iter(settings.models))
    engine_options = EmbedOptions(
        pooling=options.pooling,
        layers=options.layers,
        size=options.size,
        policy=options.policy,
        normalize=options.normalize,
        heads=options.heads,
    )
    if options.heads and wants_npy(request.headers.get("accept")):
        raise ApiError(
            422, "heads_need_json", "head outputs are returned in JSON: drop Accept: application/x-npy"
        )
    outcome = await run_engine(request, engine, model, images, engine_options, deadline)
    values = int(outcome.vectors.size)
    if wants_npy(request.headers.get("accept")):
        data, headers = await timed(metrics, lambda: embed_npy(outcome, dtype=options.dtype), values=values)
        return Response(data, media_type=NPY_MEDIA_TYPE, headers=headers)
    data = await timed(
        metrics,
        lambda: embed_json(
            outcome, dtype=options.dtype, encoding=options.encoding, return_grid=options.return_grid
        ),
        values=values,
    )
    return Response(data, media_type=JSON_MEDIA_TYPE)


@v1.post(
    "/embeddings",
    response_model=OpenAIEmbeddingResponse,
    responses=ERROR_RESPONSES,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {JSON_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/OpenAIEmbeddingRequest"}}},
        }
    },
)
async def embeddings(
    request: Request, engine: EngineDep, settings: SettingsDep, metrics: MetricsDep
) -> Response:
    """OpenAI-compatible: ``input`` is one or more ``data:image/...;base64,`` URIs; the official client's
    ``embeddings.create`` works unchanged (it asks for base64: float32 little-endian)."""
    deadline = request_deadline(request, settings)
    refuse_early(engine, settings, None, deadline)
    body = await read_body(request)
    if not is_json(request.headers.get("content-type")):
        raise unsupported_media_type("application/json")
    parsed, images = await _offload(len(body), parse_openai, body, settings.max_images_per_request)
    model = parsed.model or next(iter(settings.models))
    outcome = await run_engine(request, engine, model, images, EmbedOptions(), deadline)
    data = await timed(
        metrics,
        lambda: openai_json(outcome, encoding_format=parsed.encoding_format),
        values=int(outcome.vectors.size),
    )
    return Response(data, media_type=JSON_MEDIA_TYPE)


# ------------------------------------------------------------------------------------------- helpers
async def _on_own_thread(func: Any) -> None:
    """Run ``func`` on a thread that ends with it. Model loading and warm-up run torch ops; on a thread that
    stays alive (asyncio's default pool) they leave an OpenMP team behind, and with more OpenMP threads
    than cores every parallel step of the forward thread then waits on a wake-up (measured 1.3-1.9x slower
    single-image forwards)."""
    with ThreadPoolExecutor(1, thread_name_prefix="engine-start") as pool:
        await asyncio.get_running_loop().run_in_executor(pool, func)


OFFLOAD_BODY_BYTES = 1 << 20  # parse and base64-decode bigger bodies in a thread


async def _offload(size: int, func: Any, *args: Any) -> Any:
    return await asyncio.to_thread(func, *args) if size > OFFLOAD_BODY_BYTES else func(*args)


def unsupported_media_type(accepted: str) -> ApiError:
    return ApiError(415, "unsupported_media_type", f"send the request as {accepted}")


async def read_body(request: Request) -> bytes:
    """The whole body, before anything else touches ``receive`` (an early disconnect check can swallow
    body bytes); the body limit is enforced underneath by BodyLimitMiddleware."""
    try:
        body = await request.body()
    except ClientDisconnect as exc:
        raise ApiError(CLIENT_CLOSED, "client_closed_request", "the client went away") from exc
    if not body:
        raise ApiError(400, "empty_body", "the request body is empty")
    return body


def refuse_early(engine: Engine, settings: ServiceSettings, model: str | None, deadline: float) -> None:
    """429 before the body is read when not even one image could be admitted now: the model named in the
    query, or the only one served (a model named in the body is checked after the parse)."""
    if model is None and len(settings.models) == 1:
        model = next(iter(settings.models))
    if model is not None and model in engine.model_names:
        engine.refuse_early(model, deadline)


def wants_npy(accept: str | None) -> bool:
    """``Accept`` lists application/x-npy with a non-zero quality."""
    for entry in (accept or "").split(","):
        kind, *params = (part.strip().lower() for part in entry.split(";"))
        if kind == NPY_MEDIA_TYPE:
            for param in params:
                name, _, value = param.partition("=")
                if name.strip() == "q":
                    try:
                        return float(value) > 0
                    except ValueError:
                        return False
            return True
    return False


async def _watch_disconnect(request: Request) -> None:
    """Returns when the client has gone; only started once the body is fully read."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so an abandoned task's error is not logged as "never retrieved"


async def run_engine(
    request: Request,
    engine: Engine,
    model: str,
    images: Sequence[bytes],
    options: EmbedOptions,
    deadline: float,
) -> EmbedOutcome:
    """``engine.embed`` raced against the client's disconnect and the deadline (``race_client``)."""
    ticket = RequestTicket(deadline, budget_s(request))
    return await race_client(
        request, ticket, engine.embed(model, images, options, ticket=ticket, deadline=deadline), deadline
    )


async def race_client(
    request: Request, ticket: RequestTicket, coroutine: Coroutine[Any, Any, T], deadline: float
) -> T:
    """Engine work raced against the client's disconnect and the deadline; whichever loses is cancelled,
    and a cancelled ticket drops the request's items still queued."""
    work = asyncio.ensure_future(coroutine)
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    try:
        timeout = max(0.0, deadline - time.monotonic()) + DEADLINE_GRACE_S
        done, _ = await asyncio.wait({work, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        if watcher in done:
            raise ApiError(CLIENT_CLOSED, "client_closed_request", "the client went away")
        raise DeadlineExceededError(f"no result within {budget_s(request):g} s")
    finally:
        watcher.cancel()
        watcher.add_done_callback(_consume)
        if not work.done():
            ticket.cancel()
            work.cancel()
        work.add_done_callback(_consume)


# ------------------------------------------------------------------------------------------- the app
def _openapi_with_body_schemas(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the body models that the hand-parsed endpoints reference."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    _, extra = models_json_schema(
        [(EmbedJsonRequest, "validation"), (OpenAIEmbeddingRequest, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    schema.setdefault("components", {}).setdefault("schemas", {}).update(extra.get("$defs", {}))
    schema = make_contract(schema, app.state.settings)
    app.openapi_schema = schema
    return schema


def create_app(settings: ServiceSettings, *, engine: Engine | None = None) -> FastAPI:
    """One app serving ``settings.models``. Without ``engine`` the lifespan creates one, loads and warms every
    model (in a thread) before the server accepts requests, and stops it at shutdown; an ``engine`` passed
    in belongs to the caller, who starts and stops it."""
    from vitembed.server.routes_explore import explore_router, page_router  # imported here: it imports this
    from vitembed.server.routes_heads import heads_router  # imported here: it imports this module
    from vitembed.server.routes_search import (  # imported here: it imports this module
        load_indexes,
        search_router,
    )

    metrics = engine.metrics if engine is not None else Metrics()
    gate = AdmissionGate(settings, metrics)  # refusals on the request head (vitembed serve's protocol)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            app.state.engine = engine
            gate.engine = engine
            app.state.indexes = await asyncio.to_thread(load_indexes, settings, engine)
            try:
                yield
            finally:
                app.state.indexes.close()
            return
        owned = Engine(settings, metrics)
        try:
            await _on_own_thread(owned.start)
        except BaseException:
            owned.stop()
            raise
        app.state.engine = owned
        gate.engine = owned
        try:
            app.state.indexes = await asyncio.to_thread(load_indexes, settings, owned)
            try:
                yield
            finally:
                app.state.indexes.close()
        finally:
            app.state.engine = None
            gate.engine = None
            await asyncio.to_thread(owned.stop)

    app = FastAPI(
        title="vitembed",
        version="0.1.0",
        description="Pretrained ViT-family backbone features over HTTP: batched, bounded, safe.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.admission_gate = gate
    app.state.engine = None
    app.state.started_at = time.time()
    install_error_handlers(app)
    app.include_router(ops)
    app.include_router(v1)
    app.include_router(search_router)
    app.include_router(heads_router)
    app.include_router(explore_router)
    app.include_router(page_router)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=settings.body_timeout_s)
    app.add_middleware(
        ConcurrencyLimitMiddleware, max_requests=settings.max_concurrent_requests, metrics=metrics
    )
    known_paths = frozenset(
        str(getattr(route, "path", ""))
        for route in (
            *ops.routes,
            *v1.routes,
            *search_router.routes,
            *heads_router.routes,
            *explore_router.routes,
        )
    )
    app.add_middleware(RequestContextMiddleware, metrics=metrics, known_paths=known_paths)  # last = outermost
    app.openapi = lambda: _openapi_with_body_schemas(app)  # type: ignore[method-assign]
    return app
