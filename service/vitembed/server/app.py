"""The app factory: ``create_app(settings)`` wires the routers, the middleware and the lifecycle around
:class:`vitembed.engine.engine.Engine`. No routes and no model logic here.

Where a request goes: middleware → ``routes_*.py`` (parse the request → the engine → serialise the answer,
with the shared HTTP plumbing of ``plumbing.py``) → ``vitembed.engine`` (admission, decode pool, dynamic
batcher) → ``vit_backbone``. ``create_app`` builds one app per call (tests run several in one process);
settings are built by the caller at start, never at import. Middleware, outermost first: request context
(request id, metrics by route template and status, the last-resort 500) → concurrency limit → body timeout
→ body limit (``Content-Length`` and a counting ``receive``, before anything reads the body) → Starlette's
exception handlers → routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from vitembed.engine.engine import Engine
from vitembed.engine.served_indexes import load_indexes
from vitembed.gc_heap import freeze_startup_heap, raise_young_threshold, release_heap, restore_thresholds
from vitembed.metrics import Metrics
from vitembed.server.connection_limits import (
    BodyLimitMiddleware,
    BodyTimeoutMiddleware,
    ConcurrencyLimitMiddleware,
)
from vitembed.server.early_refusal import AdmissionGate
from vitembed.server.errors import RequestContextMiddleware, install_error_handlers
from vitembed.server.openapi import make_contract
from vitembed.server.quotas import QuotaBook, QuotaExceededError, QuotaMiddleware, quota_exceeded
from vitembed.server.routes_embed import embed_router
from vitembed.server.routes_explore import explore_router, page_router
from vitembed.server.routes_heads import heads_router
from vitembed.server.routes_openai import openai_router
from vitembed.server.routes_ops import models_router, ops_router
from vitembed.server.routes_search import search_router
from vitembed.server.schemas import EmbedJsonRequest, OpenAIEmbeddingRequest
from vitembed.settings import ServiceSettings

# in this order: it is the order of the OpenAPI paths (and the paths the request metrics name); the
# explorer page (page_router: no OpenAPI entry) is included after them
ROUTERS = (
    ops_router,
    models_router,
    embed_router,
    openai_router,
    search_router,
    heads_router,
    explore_router,
)


async def _on_own_thread(func: Any) -> None:
    """Run ``func`` on a thread that ends with it. Model loading and warm-up run torch ops; on a thread that
    stays alive (asyncio's default pool) they leave an OpenMP team behind, and with more OpenMP threads
    than cores every parallel step of the forward thread then waits on a wake-up (measured 1.3-1.9x slower
    single-image forwards)."""
    with ThreadPoolExecutor(1, thread_name_prefix="engine-start") as pool:
        await asyncio.get_running_loop().run_in_executor(pool, func)


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
    metrics = engine.metrics if engine is not None else Metrics()
    quotas = QuotaBook(metrics) if settings.callers.limited else None  # per-caller quotas (API keys file)
    gate = AdmissionGate(settings, metrics, quotas)  # refusals on the request head (serve's protocol)

    @contextlib.asynccontextmanager
    async def ready() -> AsyncIterator[None]:
        """Everything is loaded: freeze the start-up heap (settings.gc_freeze), raise the young GC
        threshold (settings.gc_young_threshold) and time GC pauses; at shutdown release the heap and the
        threshold (the last app to stop gives them back, so a process that goes on, as in tests, keeps no
        uncollectable cycles and Python's own thresholds)."""
        if settings.gc_freeze:
            metrics.gc_frozen.set(freeze_startup_heap())
        if settings.gc_young_threshold:
            raise_young_threshold(settings.gc_young_threshold)
        metrics.gc_timer.install()
        try:
            yield
        finally:
            metrics.gc_timer.remove()
            if settings.gc_young_threshold:
                restore_thresholds()
            if settings.gc_freeze:
                release_heap()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            app.state.engine = engine
            gate.engine = engine
            app.state.indexes = await asyncio.to_thread(load_indexes, settings, engine)
            try:
                async with ready():
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
                async with ready():
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
    app.state.quotas = quotas
    app.state.engine = None
    app.state.started_at = time.time()
    install_error_handlers(app)
    app.add_exception_handler(QuotaExceededError, quota_exceeded)
    for router in (*ROUTERS, page_router):
        app.include_router(router)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=settings.body_timeout_s)
    app.add_middleware(
        ConcurrencyLimitMiddleware, max_requests=settings.max_concurrent_requests, metrics=metrics
    )
    if quotas is not None:
        app.add_middleware(QuotaMiddleware)  # releases a request's quota hold once it is answered
    known_paths = frozenset(str(getattr(route, "path", "")) for router in ROUTERS for route in router.routes)
    app.add_middleware(RequestContextMiddleware, metrics=metrics, known_paths=known_paths)  # last = outermost
    app.openapi = lambda: _openapi_with_body_schemas(app)  # type: ignore[method-assign]
    return app
