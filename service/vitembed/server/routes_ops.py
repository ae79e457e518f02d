"""Operations routes: ``/health`` (liveness), ``/ready`` (readiness), ``/metrics`` (Prometheus) and
``GET /v1/models`` (what is served, with each model's facts)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse, Response

from vitembed.engine.engine import Engine
from vitembed.server.auth import require_api_key
from vitembed.server.errors import error_response
from vitembed.server.plumbing import ERROR_RESPONSES, EngineDep, MetricsDep, SettingsDep
from vitembed.server.schemas import ModelList, StatusOut

ops_router = APIRouter(tags=["operations"])
models_router = APIRouter(prefix="/v1", tags=["embeddings"], dependencies=[Depends(require_api_key)])


@ops_router.get("/health", response_model=StatusOut)
async def health() -> dict[str, str]:
    """The process lives (liveness)."""
    return {"status": "ok"}


@ops_router.get("/ready", response_model=StatusOut, responses={503: ERROR_RESPONSES[503]})
async def ready(request: Request) -> Response:
    """Every model is loaded, warmed up with a real forward pass, and its worker is running (readiness)."""
    engine: Engine | None = getattr(request.app.state, "engine", None)
    if engine is None or not engine.ready:
        return error_response(request.scope, 503, "not_ready", "the models are not ready")
    return JSONResponse({"status": "ready"})


@ops_router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics_text(metrics: MetricsDep) -> Response:
    """Prometheus text format: requests by route and status, queue depth, batch sizes, stage latency."""
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)


@models_router.get("/models", response_model=ModelList)
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
