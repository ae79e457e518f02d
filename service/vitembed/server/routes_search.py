"""``POST /v1/search`` and ``GET /v1/indexes``: similar-item search over LanceDB tables served next to the
models. No search logic here: ``catalog.search`` does it; this module parses requests, embeds query images
through the engine (the same dynamic batcher as ``/v1/embed``) with the table's own options, and runs the
search on a small thread pool of its own (``SEARCH_THREADS``: a burst of searches cannot take every thread
the server has), within the request's deadline (504 past it).

A table changed under the running server is never searched with stale options: a rebuilt table is reopened
and bound again before the next request uses it (``SearchState.current``: hot swap, no restart), with the new
table's embedding options; one that no served model can query answers 409 ``index_changed``, a dropped one
503 ``index_dropped``, until a servable table is back.

An index is served only with a model that can embed its queries: at start-up every ``--index`` is matched
to a served model by revision and preprocessing hash (the table's ``model`` name breaks ties), and a table
that no served model matches stops start-up with what is served and what the table needs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response

from vit_backbone.catalog.index_search import (
    MAX_K,
    MAX_NPROBES,
    Hit,
    IndexChangedError,
    IndexDroppedError,
    SimilarityIndex,
)
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.checkpoint import CheckpointFacts, checkpoint_facts, models_matching
from vit_backbone.errors import SizeError, VitEmbedError
from vit_backbone.preprocess import check_token_budget
from vitembed.engine.engine import DeadlineExceededError, EmbedOptions, Engine
from vitembed.server.app import (
    ERROR_RESPONSES,
    OFFLOAD_BODY_BYTES,
    EngineDep,
    SettingsDep,
    read_body,
    run_engine,
    unsupported_media_type,
)
from vitembed.server.auth import require_api_key
from vitembed.server.deadlines import budget_s, request_deadline
from vitembed.server.errors import ApiError
from vitembed.server.schemas import (
    check_image_count,
    decode_base64,
    is_json,
    media_type,
    parse_json_body,
    parse_multipart,
    strip_data_prefix,
    validation_error,
)
from vitembed.settings import ServiceSettings, split_index_target
from vitembed.settings_error import SettingsError

log = logging.getLogger("vitembed.search")
T = TypeVar("T")
MAX_WHERE_CHARS = 1024
SEARCH_FIELDS = ("index", "k", "where", "nprobes", "threshold")
SEARCH_THREADS = 2  # LanceDB queries at once; more wait their turn (within the request deadline)


@dataclass(frozen=True)
class ServedIndex:
    name: str
    index: SimilarityIndex
    model: str  # the served model that embeds this index's query images
    options: EmbedOptions  # the table's embedding options
    model_precision: str | None = None  # the served model's compute precision


@dataclass
class SearchState:
    """The served indexes and the bounded pool their searches run on; closed with the app."""

    indexes: dict[str, ServedIndex] = field(default_factory=dict)
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(SEARCH_THREADS, thread_name_prefix="search")
    )
    rebind: Callable[[str], ServedIndex] | None = None  # reopens and binds one index again (hot swap)
    _swap_lock: threading.Lock = field(default_factory=threading.Lock)
    _unservable: dict[str, str] = field(default_factory=dict)  # the last reason logged, per index

    def current(self, name: str) -> ServedIndex:
        """The served index ``name``, reopened and bound again if its table was rebuilt or recreated since
        it was opened; unchanged (the search then answers 409/503) while the table cannot be served. One
        schema read when nothing changed; blocking I/O (call it on the search pool)."""
        served = self.indexes[name]
        try:
            served.index.check_current()
            return served
        except (IndexChangedError, IndexDroppedError):
            if self.rebind is None:
                return served
        with self._swap_lock:
            if self.indexes[name] is not served:  # another request swapped it meanwhile
                return self.indexes[name]
            try:
                fresh = self.rebind(name)
            except (VitEmbedError, ValueError, OSError, RuntimeError) as exc:
                if self._unservable.get(name) != str(exc):
                    self._unservable[name] = str(exc)
                    log.warning("index %s changed and cannot be served as it is now: %s", name, exc)
                return served
            self.indexes[name] = fresh
            self._unservable.pop(name, None)
        log.info("index %s: its table was rebuilt; serving the new version (model %s)", name, fresh.model)
        return fresh

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------------- start-up
def _open(name: str, target: str) -> SimilarityIndex:
    db, table = split_index_target(target)
    try:
        return SimilarityIndex.open(db, table)
    except VitEmbedError as exc:
        raise SettingsError(f"--index {name}={target}: {exc}") from exc


def match_model(name: str, meta: CatalogMeta, served: dict[str, CheckpointFacts]) -> str:
    """The served model whose (revision, preprocess hash) equals the table's; its own name first."""
    fits = models_matching(served, meta.revision, meta.preprocess_hash)
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
    served: dict[str, CheckpointFacts] = {}
    for model, target in settings.models.items():
        try:
            served[model] = checkpoint_facts(target, settings.cache_dir)
        except VitEmbedError:
            continue  # the engine reports an unloadable model itself
    for name, target in settings.indexes.items():
        match_model(name, _open(name, target).meta, served)


def load_indexes(settings: ServiceSettings, engine: Engine) -> SearchState:
    """Open every configured index and bind it to the loaded model that embeds its queries; an index whose
    size would exceed the server's token limit stops start-up, and one whose vectors were made in another
    precision than the served model's is logged (bfloat16 and float32 vectors stay within cosine 0.999, so
    it is served, but scores of an image's own row fall slightly below 1). The state binds an index again
    the same way when its table is rebuilt (hot swap)."""
    loaded = {name: _bind(settings, engine, name, target) for name, target in settings.indexes.items()}
    return SearchState(loaded, rebind=lambda name: _bind(settings, engine, name, settings.indexes[name]))


def _bind(settings: ServiceSettings, engine: Engine, name: str, target: str) -> ServedIndex:
    infos = engine.model_infos()
    served = {model: engine.backbone(model).facts for model in infos}
    index = _open(name, target)
    meta = index.meta
    model = match_model(name, meta, served)
    if meta.size is not None:
        patch_h, patch_w = infos[model]["patch_size"]
        try:
            check_token_budget(
                (meta.size[0] // patch_h, meta.size[1] // patch_w),
                settings.max_tokens_per_image,
                f"index {name!r} was embedded at size {meta.size[0]}x{meta.size[1]}, which",
                "raise the limit (VITEMBED_MAX_TOKENS_PER_IMAGE) or rebuild the index at a smaller size",
            )
        except SizeError as exc:
            raise SettingsError(str(exc)) from exc
    choice = engine.precision(model)
    precision, described = choice.label, choice.describe()
    if meta.precision is not None and meta.precision != precision:
        log.warning(
            "index %s holds vectors made in %s but model %s runs in %s: its queries are embedded in %s "
            "(scores of identical images may fall slightly below 1)",
            name, meta.precision, model, described, precision,
        )  # fmt: skip
    options = EmbedOptions(
        pooling=meta.pooling,
        layers=None if meta.layers is None else tuple(meta.layers),
        size=None if meta.size is None else (meta.size[0], meta.size[1]),
        policy=meta.policy,
        normalize=meta.normalized,
    )
    return ServedIndex(name, index, model, options, precision)


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
    nprobes: int | None = Field(
        None,
        ge=1,
        le=MAX_NPROBES,
        description="IVF partitions an ANN search visits (default: 10% of them, at least 20)",
    )
    threshold: float | None = Field(
        None,
        ge=-1e30,
        le=1e30,
        description="keep only hits scoring at least this (near-duplicate check: `vitembed dedup`'s "
        "calibrated cosine); each query then says whether any hit is left (`near_duplicate`)",
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
    near_duplicate: bool | None = Field(None, description="with threshold: any hit scores at least it")


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
    model_precision: str | None = Field(
        description="the served model's compute precision (float32, bfloat16 or float16)"
    )
    index_precision: str | None = Field(
        description="the precision the index's vectors were made in; null when the catalog did not record it"
    )


class SearchResponse(BaseModel):
    index: str
    k: int
    threshold: float | None = None
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


def search_state(request: Request) -> SearchState:
    state = getattr(request.app.state, "indexes", None)
    return state if isinstance(state, SearchState) else SearchState({})


def served_indexes(request: Request) -> dict[str, ServedIndex]:
    return search_state(request).indexes


@contextmanager
def table_errors(served: ServedIndex) -> Iterator[None]:
    """A table overwritten or dropped under the server: a clear status, never a 500 or stale options."""
    try:
        yield
    except IndexChangedError as exc:
        raise ApiError(
            409,
            "index_changed",
            f"index {served.name!r} was rebuilt in a way the served models cannot query; rebuild it with a "
            f"served model, or serve its model ({exc})",
        ) from exc
    except IndexDroppedError as exc:
        raise ApiError(
            503,
            "index_dropped",
            f"index {served.name!r} ({served.index.db}:{served.index.name}) was dropped or moved; it is "
            "served again once the table is rebuilt there",
        ) from exc


async def run_search_work(request: Request, func: Callable[[], T], deadline: float) -> T:
    """``func`` on the search pool, raced against the request deadline (504 past it). A query already
    running finishes on its thread; one still queued is dropped."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(search_state(request).executor, func)
    try:
        return await asyncio.wait_for(future, timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError as exc:
        timeout = budget_s(request)
        raise DeadlineExceededError(f"no result within {timeout:g} s") from exc


async def _parse(size: int, func: Callable[..., T], *args: Any) -> T:
    """Parse and base64-decode a large body off the event loop (as ``/v1/embed`` does)."""
    return await asyncio.to_thread(func, *args) if size > OFFLOAD_BODY_BYTES else func(*args)


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
            images.append(decode_base64(strip_data_prefix(text), position))
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
    ``{"images": [{"base64"}]}``, a ``data:`` URI prefix tolerated) or a query vector (JSON
    ``{"vector": [...]}``, L2-normalised for a cosine or normalized index); ``index``, ``k``, ``where`` and
    ``nprobes`` as form or JSON fields. Images are embedded with the options the index was built with."""
    deadline = request_deadline(request, settings)
    body = await read_body(request)
    content_type = request.headers.get("content-type")
    vector: list[float] | None = None
    if media_type(content_type) == "multipart/form-data":
        images, fields = await _parse(
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
        images, vector, options = await _parse(len(body), _parse_json, body, settings.max_images_per_request)
    else:
        raise unsupported_media_type("multipart/form-data or application/json")
    name = pick_index(served_indexes(request), options.index).name
    state = search_state(request)
    for last_try in (False, True):  # a table rebuilt between the check and the query: once more, on the new
        # version, embedding the query images again (the new table may have other options)
        served = await run_search_work(request, functools.partial(state.current, name), deadline)
        precision: str | None = None
        if vector is not None:
            queries: list[Any] = [vector]
        else:
            outcome = await run_engine(request, engine, served.model, images, served.options, deadline)
            queries, precision = list(outcome.vectors), outcome.precision  # [Q] x [D]
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
            "model_precision": served.model_precision,
            "index_precision": meta.precision,
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
