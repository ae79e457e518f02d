"""``POST /v1/search`` and ``GET /v1/indexes``: similar-item search over LanceDB tables served next to the
models. Parse → engine → search → serialise: query images are embedded through the engine (the same
dynamic batcher as ``/v1/embed``) with the table's own options, and the search runs on a small thread pool
of its own within the request's deadline (``index_access.py``). No search logic here
(``vit_backbone.catalog.index_search`` does it), and no index binding (``engine/served_indexes.py``: start-up
and hot swap).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from vit_backbone.catalog.index_search import Hit, IndexChangedError, IndexDroppedError, SimilarityIndex
from vitembed.server.auth import require_api_key
from vitembed.server.body_parser import (
    check_image_count,
    decode_base64,
    is_json,
    media_type,
    parse_json_body,
    parse_multipart,
    strip_data_prefix,
    validation_error,
)
from vitembed.server.deadlines import request_deadline
from vitembed.server.errors import ApiError
from vitembed.server.index_access import (
    pick_index,
    run_search_work,
    search_state,
    served_indexes,
    table_errors,
)
from vitembed.server.plumbing import (
    ERROR_RESPONSES,
    EngineDep,
    SettingsDep,
    offload,
    read_body,
    run_engine,
    unsupported_media_type,
)
from vitembed.server.quotas import charge_images
from vitembed.server.search_schemas import (
    SEARCH_BODY,
    SEARCH_FIELDS,
    IndexCard,
    IndexList,
    SearchJsonRequest,
    SearchOptionsIn,
    SearchResponse,
)

search_router = APIRouter(prefix="/v1", tags=["search"], dependencies=[Depends(require_api_key)])


def _parse_json(body: bytes, max_images: int) -> tuple[list[bytes], list[float] | None, SearchOptionsIn]:
    try:
        request = SearchJsonRequest.model_validate(parse_json_body(body))
    except ValidationError as exc:
        raise validation_error(exc) from exc
    if (request.images is None) == (request.vector is None):
        raise ApiError(422, "invalid_request", "send either 'images' or 'vector' (one of them)")
    images: list[bytes] = []
    if request.images is not None:
        check_image_count(len(request.images), max_images)
        for position, item in enumerate(request.images):
            text = item.get("base64") if isinstance(item, dict) else None
            if not isinstance(text, str) or set(item) != {"base64"}:
                raise ApiError(422, "invalid_request", 'each image must be {"base64": "..."}', index=position)
            images.append(decode_base64(strip_data_prefix(text), position))
    options = SearchOptionsIn.model_validate(request.model_dump(include=set(SEARCH_FIELDS)))
    return images, request.vector, options


@search_router.post(
    "/search",
    response_model=SearchResponse,
    responses=ERROR_RESPONSES,
    openapi_extra={"requestBody": SEARCH_BODY},
)
async def search(request: Request, engine: EngineDep, settings: SettingsDep) -> Response:
    """Top-k similar items of an index for query images (multipart parts named ``image``, or JSON
    ``{"images": [{"base64"}]}``, a ``data:`` URI prefix tolerated) or a query vector (JSON
    ``{"vector": [...]}``, L2-normalised for a cosine or normalized index); ``index``, ``k``, ``where`` and
    ``nprobes`` as form or JSON fields. Images are embedded with the options the index was built with."""
    deadline = request_deadline(request, settings)
    body = await read_body(request)
    content_type = request.headers.get("content-type")
    vector: list[float] | None = None
    if media_type(content_type) == "multipart/form-data":
        images, fields = await offload(
            len(body),
            parse_multipart,
            body,
            content_type or "",
            settings.max_images_per_request,
            SEARCH_FIELDS,
        )
        try:
            options = SearchOptionsIn.model_validate(fields)
        except ValidationError as exc:
            raise validation_error(exc) from exc
    elif is_json(content_type):
        images, vector, options = await offload(len(body), _parse_json, body, settings.max_images_per_request)
    else:
        raise unsupported_media_type("multipart/form-data or application/json")
    charge_images(request, 0 if vector is not None else len(images))  # the caller's quota, before decoding
    name = pick_index(served_indexes(request), options.index).name
    state = search_state(request)
    for last_try in (False, True):  # a table rebuilt between the check and the query: once more, on the new
        # version, embedding the query images again (the new table may have other options)
        served = await run_search_work(request, functools.partial(state.current, name), deadline)
        precision: str | None = None
        precision_cosine: float | None = None
        if vector is not None:
            queries: list[Any] = [vector]
        else:
            outcome = await run_engine(request, engine, served.model, images, served.options, deadline)
            queries, precision = list(outcome.vectors), outcome.precision  # [Q] x [D]
            precision_cosine = outcome.precision_cosine
        index = served.index

        def work(
            index: SimilarityIndex = index, queries: list[Any] = queries
        ) -> tuple[list[list[Hit]], bool]:
            results = index.search_many(queries, options.k, options.where, nprobes=options.nprobes)
            return results, index.has_ann()

        try:
            results, ann = await run_search_work(request, work, deadline)
            break
        except (IndexChangedError, IndexDroppedError):
            if last_try:
                with table_errors(served):
                    raise
    meta = index.meta
    data: list[dict[str, Any]] = []
    for position, hits in enumerate(results):
        if options.threshold is not None:
            kept = [hit for hit in hits if hit.score >= options.threshold]
            data.append(
                {"index": position, "results": [h.to_dict() for h in kept], "near_duplicate": bool(kept)}
            )
        else:
            data.append({"index": position, "results": [hit.to_dict() for hit in hits]})
    payload = {
        "index": served.name,
        "k": options.k,
        **({"threshold": options.threshold} if options.threshold is not None else {}),
        "data": data,
        "provenance": {
            "index": served.name,
            "model": served.model,
            "revision": meta.revision,
            "preprocess_hash": meta.preprocess_hash,
            "pooling": meta.pooling,
            "layers": meta.layers,
            "size": meta.size,
            "policy": meta.policy,
            "normalized": meta.normalized,
            "metric": served.index.metric,
            "ann": ann,
            "precision": precision,
            "precision_cosine": precision_cosine,
            "model_precision": served.model_precision,
            "index_precision": meta.precision,
            "preset": meta.preset,
        },
    }
    return JSONResponse(payload)


@search_router.get("/indexes", response_model=IndexList)
async def indexes(request: Request) -> dict[str, Any]:
    """Every served index: its table, row count, metric, ANN state and the CatalogMeta of its vectors."""

    def cards() -> list[dict[str, Any]]:
        out = []
        state = search_state(request)
        for name in list(state.indexes):
            served = state.current(name)  # a rebuilt table: its new version
            with table_errors(served):
                facts = served.index.describe()
            out.append(
                {
                    "name": name,
                    "model": served.model,
                    **{k: facts[k] for k in IndexCard.model_fields if k in facts},
                }
            )
        return out

    deadline = time.monotonic() + request.app.state.settings.request_timeout_s
    return {"object": "list", "data": await run_search_work(request, cards, deadline)}
