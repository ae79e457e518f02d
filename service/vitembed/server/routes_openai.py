"""``POST /v1/embeddings``, OpenAI-compatible: ``input`` is one or more ``data:image/...;base64,`` URIs.
Parse → engine → serialise; the shared plumbing is in ``plumbing.py``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from vitembed.engine.engine import EmbedOptions
from vitembed.server.auth import require_api_key
from vitembed.server.body_parser import is_json, parse_openai
from vitembed.server.deadlines import request_deadline
from vitembed.server.plumbing import (
    ERROR_RESPONSES,
    JSON_MEDIA_TYPE,
    EngineDep,
    MetricsDep,
    SettingsDep,
    offload,
    read_body,
    refuse_early,
    run_engine,
    unsupported_media_type,
)
from vitembed.server.quotas import charge_images
from vitembed.server.schemas import OpenAIEmbeddingResponse
from vitembed.server.serialise import openai_json, timed

openai_router = APIRouter(prefix="/v1", tags=["embeddings"], dependencies=[Depends(require_api_key)])


@openai_router.post(
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
    ``embeddings.create`` works unchanged (it asks for base64: float32 little-endian). Vectors are unit length
    unless ``normalize`` (an extra field: ``extra_body={"normalize": False}``) is false."""
    deadline = request_deadline(request, settings)
    refuse_early(request, engine, settings, None, deadline)
    body = await read_body(request)
    if not is_json(request.headers.get("content-type")):
        raise unsupported_media_type("application/json")
    parsed, images = await offload(len(body), parse_openai, body, settings.max_images_per_request)
    charge_images(request, len(images))  # the caller's quota, before any image is decoded
    model = parsed.model or next(iter(settings.models))
    options = EmbedOptions(normalize=parsed.normalize)  # unit vectors by default, as OpenAI's are
    outcome = await run_engine(request, engine, model, images, options, deadline)
    data = await timed(
        metrics,
        lambda: openai_json(outcome, encoding_format=parsed.encoding_format),
        values=int(outcome.vectors.size),
    )
    return Response(data, media_type=JSON_MEDIA_TYPE)
