"""``POST /v1/embed``: images (multipart parts named ``image``, or JSON base64) → the engine → JSON or one
``.npy`` array. Parse → engine → serialise; the shared plumbing is in ``plumbing.py``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response

from vitembed.engine.engine import EmbedOptions
from vitembed.server.auth import require_api_key
from vitembed.server.body_parser import is_json, media_type, merge_options, parse_embed_json, parse_multipart
from vitembed.server.deadlines import request_deadline
from vitembed.server.errors import ApiError
from vitembed.server.openapi_bodies import image_request_body
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
    wants_npy,
)
from vitembed.server.quotas import charge_images
from vitembed.server.schemas import EmbedOptionsIn, EmbedQuery, EmbedResponse
from vitembed.server.serialise import NPY_MEDIA_TYPE, embed_json, embed_npy, timed

embed_router = APIRouter(prefix="/v1", tags=["embeddings"], dependencies=[Depends(require_api_key)])


def _embed_body() -> dict[str, Any]:
    """Multipart parts or JSON (the ``EmbedJsonRequest`` component, made exact by ``openapi.py``)."""
    body = image_request_body(EmbedOptionsIn)
    body["content"][JSON_MEDIA_TYPE] = {"schema": {"$ref": "#/components/schemas/EmbedJsonRequest"}}
    return body


@embed_router.post(
    "/embed",
    response_model=EmbedResponse,
    responses={
        200: {"content": {NPY_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}},
        **ERROR_RESPONSES,
    },
    openapi_extra={"requestBody": _embed_body()},
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
    refuse_early(request, engine, settings, query.model, deadline)
    body = await read_body(request)
    content_type = request.headers.get("content-type")
    if media_type(content_type) == "multipart/form-data":
        images, fields = await offload(
            len(body), parse_multipart, body, content_type or "", settings.max_images_per_request
        )
    elif is_json(content_type):
        images, fields = await offload(len(body), parse_embed_json, body, settings.max_images_per_request)
    else:
        raise unsupported_media_type("multipart/form-data or application/json")
    charge_images(request, len(images))  # the caller's quota, before any image is decoded
    options = merge_options(query.model_dump(exclude_none=True), fields)
    model = options.model or next(iter(settings.models))
    engine_options = EmbedOptions(
        pooling=options.pooling,
        layers=options.layers,
        size=options.size,
        policy=options.policy,
        normalize=options.normalize,
        heads=options.heads,
        preset=options.preset,
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
