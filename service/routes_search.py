"""``POST /v1/search`` and ``GET /v1/indexes``: similar-item search over LanceDB tables served next to the
models. No search logic here: ``catalog.search`` does it; this module parses requests, embeds query images
through the engine (the same dynamic batcher as ``/v1/embed``) with the table's own options, and runs the
search off the event loop.

An index is served only with a model that can embed its queries: at start-up every ``--index`` is matched
to a served model by revision and preprocessing hash (the table's ``model`` name breaks ties), and a table
that no served model matches stops start-up with what is served and what the table needs.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response

from catalog.meta import CatalogMeta
from catalog.search import MAX_K, SimilarityIndex, checkpoint_fingerprint
from vit_backbone.errors import VitEmbedError

from .app import (
    ERROR_RESPONSES,
    EngineDep,
    SettingsDep,
    _offload,
    read_body,
    run_engine,
    unsupported_media_type,
)
from .auth import require_api_key
from .engine import EmbedOptions, Engine
from .errors import ApiError
from .schemas import (
    check_image_count,
    decode_base64,
    is_json,
    media_type,
    parse_json_body,
    parse_multipart,
    validation_error,
)
from .serve_cmd import SettingsError
from .settings import ServiceSettings, split_index_target

MAX_WHERE_CHARS = 1024
SEARCH_FIELDS = ("index", "k", "where")


@dataclass(frozen=True)
class ServedIndex:
    name: str
    index: SimilarityIndex
    model: str  # the served model that embeds this index's query images
    options: EmbedOptions  # the table's embedding options


# ------------------------------------------------------------------------------------------- start-up
def _open(name: str, target: str) -> SimilarityIndex:
    db, table = split_index_target(target)
    try:
        return SimilarityIndex.open(db, table)
    except VitEmbedError as exc:
        raise SettingsError(f"--index {name}={target}: {exc}") from exc


def match_model(name: str, meta: CatalogMeta, served: dict[str, tuple[str, str]]) -> str:
    """The served model whose (revision, preprocess hash) equals the table's; its own name first."""
    fits = [model for model, print_ in served.items() if print_ == (meta.revision, meta.preprocess_hash)]
    if not fits:
        have = "; ".join(
            f"{model} (revision {rev}, preprocess {pre})" for model, (rev, pre) in served.items()
        )
        raise SettingsError(
            f"index {name!r} was embedded with model {meta.model!r} (revision {meta.revision}, preprocess "
            f"{meta.preprocess_hash}), which is not served; served: {have}. Serve that checkpoint with "
            f"--model, or rebuild the index with a served model"
        )
    return meta.model if meta.model in fits else fits[0]


def preflight_indexes(settings: ServiceSettings) -> None:
    """Before any weights load: every index opens and matches a served model (read from the checkpoints'
    files); raises SettingsError (exit status 2) otherwise."""
    served: dict[str, tuple[str, str]] = {}
    for model, target in settings.models.items():
        try:
            served[model] = checkpoint_fingerprint(target, settings.cache_dir)
        except VitEmbedError:
            continue  # the engine reports an unloadable model itself
    for name, target in settings.indexes.items():
        match_model(name, _open(name, target).meta, served)


def load_indexes(settings: ServiceSettings, engine: Engine) -> dict[str, ServedIndex]:
    """Open every configured index and bind it to the loaded model that embeds its queries."""
    infos = engine.model_infos()
    served = {model: (str(i["revision"]), str(i["preprocess_hash"])) for model, i in infos.items()}
    loaded: dict[str, ServedIndex] = {}
    for name, target in settings.indexes.items():
        index = _open(name, target)
        meta = index.meta
        options = EmbedOptions(
            pooling=meta.pooling,
            layers=None if meta.layers is None else tuple(meta.layers),
            size=None if meta.size is None else (meta.size[0], meta.size[1]),
            policy=meta.policy,
            normalize=meta.normalized,
        )
        loaded[name] = ServedIndex(name, index, match_model(name, meta, served), options)
    return loaded


# ------------------------------------------------------------------------------------------- schemas
class SearchOptionsIn(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: str | None = Field(
        None, min_length=1, max_length=128, description="a served index (default: the only one)"
    )
    k: int = Field(10, ge=1, le=MAX_K, description=f"results per query, 1..{MAX_K}")
    where: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_WHERE_CHARS,
        description="SQL predicate on the index's metadata columns, applied before the search",
    )


class SearchJsonRequest(SearchOptionsIn):
    images: list[dict[str, Any]] | None = Field(None, description='[{"base64": "..."}], one query per image')
    vector: list[float] | None = Field(None, description="one query vector instead of images")


class HitOut(BaseModel):
    id: str
    score: float = Field(description="similarity under the index's metric (cosine or dot): higher is closer")
    metadata: dict[str, str | None]


class QueryResultOut(BaseModel):
    index: int = Field(description="0-based position of the query")
    results: list[HitOut]


class SearchProvenance(BaseModel):
    index: str
    model: str
    revision: str
    preprocess_hash: str
    pooling: str
    layers: list[int] | None
    size: list[int] | None
    policy: str
    normalized: bool
    metric: str
    ann: bool
    precision: str | None = Field(description="of the query embedding; null for vector queries")


class SearchResponse(BaseModel):
    index: str
    k: int
    data: list[QueryResultOut]
    provenance: SearchProvenance


class IndexCard(BaseModel):
    name: str
    model: str
    db: str
    table: str
    rows: int
    metric: str
    ann: bool
    ann_threshold: int
    metadata_columns: list[str]
    meta: dict[str, Any]


class IndexList(BaseModel):
    object: str = "list"
    data: list[IndexCard]


_OPTION_PROPERTIES = SearchOptionsIn.model_json_schema()["properties"]
_IMAGES_SCHEMA = {
    "type": "array",
    "items": {"type": "object", "required": ["base64"], "properties": {"base64": {"type": "string"}}},
}
_SEARCH_BODY = {
    "multipart/form-data": {
        "schema": {
            "type": "object",
            "required": ["image"],
            "properties": {
                "image": {"type": "array", "items": {"type": "string", "format": "binary"}},
                **{
                    name: {"type": "string", "description": p.get("description", "")}
                    for name, p in _OPTION_PROPERTIES.items()
                },
            },
        }
    },
    "application/json": {
        "schema": {
            "type": "object",
            "properties": {
                "images": _IMAGES_SCHEMA,
                "vector": {"type": "array", "items": {"type": "number"}},
                **_OPTION_PROPERTIES,
            },
        }
    },
}

# ------------------------------------------------------------------------------------------- routes
search_router = APIRouter(prefix="/v1", tags=["search"], dependencies=[Depends(require_api_key)])


def served_indexes(request: Request) -> dict[str, ServedIndex]:
    indexes: dict[str, ServedIndex] = getattr(request.app.state, "indexes", None) or {}
    return indexes


def pick_index(indexes: dict[str, ServedIndex], name: str | None) -> ServedIndex:
    if not indexes:
        raise ApiError(
            404, "index_not_found", "no index is served: start the server with --index NAME=DB_PATH:TABLE"
        )
    if name is None:
        if len(indexes) > 1:
            raise ApiError(
                422,
                "index_required",
                f"several indexes are served; name one with 'index': {', '.join(indexes)}",
            )
        return next(iter(indexes.values()))
    served = indexes.get(name)
    if served is None:
        raise ApiError(
            404, "index_not_found", f"index {name[:64]!r} is not served; served: {', '.join(indexes)}"
        )
    return served


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
            images.append(decode_base64(text, position))
    options = SearchOptionsIn.model_validate(request.model_dump(include=set(SEARCH_FIELDS)))
    return images, request.vector, options


@search_router.post(
    "/search",
    response_model=SearchResponse,
    responses=ERROR_RESPONSES,
    openapi_extra={"requestBody": {"required": True, "content": _SEARCH_BODY}},
)
async def search(request: Request, engine: EngineDep, settings: SettingsDep) -> Response:
    """Top-k similar items of an index for query images (multipart parts named ``image``, or JSON
    ``{"images": [{"base64"}]}``) or a query vector (JSON ``{"vector": [...]}``); ``index``, ``k`` and
    ``where`` as form or JSON fields. Images are embedded with the options the index was built with."""
    deadline = time.monotonic() + settings.request_timeout_s
    body = await read_body(request)
    content_type = request.headers.get("content-type")
    vector: list[float] | None = None
    if media_type(content_type) == "multipart/form-data":
        images, fields = await _offload(
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
        images, vector, options = await _offload(
            len(body), _parse_json, body, settings.max_images_per_request
        )
    else:
        raise unsupported_media_type("multipart/form-data or application/json")
    served = pick_index(served_indexes(request), options.index)
    precision: str | None = None
    if vector is not None:
        queries: list[Any] = [vector]
    else:
        outcome = await run_engine(request, engine, served.model, images, served.options, deadline)
        queries, precision = list(outcome.vectors), outcome.precision  # [Q] x [D]
    results = await asyncio.to_thread(served.index.search_many, queries, options.k, options.where)
    meta = served.index.meta
    payload = {
        "index": served.name,
        "k": options.k,
        "data": [
            {"index": position, "results": [hit.to_dict() for hit in hits]}
            for position, hits in enumerate(results)
        ],
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
            "ann": await asyncio.to_thread(served.index.has_ann),
            "precision": precision,
        },
    }
    return JSONResponse(payload)


@search_router.get("/indexes", response_model=IndexList)
async def indexes(request: Request) -> dict[str, Any]:
    """Every served index: its table, row count, metric, ANN state and the CatalogMeta of its vectors."""

    def cards() -> list[dict[str, Any]]:
        out = []
        for name, served in served_indexes(request).items():
            facts = served.index.describe()
            out.append(
                {
                    "name": name,
                    "model": served.model,
                    **{k: facts[k] for k in IndexCard.model_fields if k in facts},
                }
            )
        return out

    return {"object": "list", "data": await asyncio.to_thread(cards)}
