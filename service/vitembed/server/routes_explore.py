"""The explorer page (``GET /explore``, ``/`` redirects to it) and the ``/v1`` endpoints it calls.

The page is static files inside the package (``static/``: HTML, JavaScript, CSS; no CDN, no build step),
served with a Content-Security-Policy that allows nothing but this origin. Everything it shows comes from
ordinary ``/v1`` endpoints with the same auth, limits and error answers as the rest:

* ``POST /v1/patch-features``: one image → the pixels the model sees under a policy and size (PNG), the
  patch grid, the cost of that size (what ``vitembed inspect`` computes) and the PCA map of one block's
  patch tokens that hold image (``vit_backbone.patch_maps.patch_pca``; pad's letterbox left out);
* ``POST /v1/patch-similarity``: one query image, a patch of it, and an item of a served index → the cosine
  of that patch token with every patch token of the item's image (``patch_similarity``), the item's image
  recomputed through the same engine with the same options;
* ``GET /v1/indexes/{index}/thumbnail?id=``: a JPEG of an index item, read by id from the source the
  catalog was embedded from (recorded at ``index build``), never from a path the client names.

The math lives in the library; these routes parse, call the engine, and serialise.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
from importlib import resources
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response

from vit_backbone.architectures import arch_from_hf_config
from vit_backbone.catalog.item_images import MAX_THUMBNAIL_SIDE, ItemImages, ItemNotFoundError, thumbnail_jpeg
from vit_backbone.costs import cost_report
from vit_backbone.errors import ImageDecodeError
from vit_backbone.patch_maps import model_view, patch_pca, patch_similarity
from vitembed.engine.engine import EmbedOptions, Engine, RequestImageError, RequestTicket
from vitembed.engine.served_indexes import ServedIndex
from vitembed.server.auth import require_api_key
from vitembed.server.body_parser import (
    is_json,
    media_type,
    parse_embed_json,
    parse_multipart,
    validation_error,
)
from vitembed.server.deadlines import budget_s, request_deadline
from vitembed.server.errors import ApiError
from vitembed.server.index_access import (
    pick_index,
    run_search_work,
    served_indexes,
    table_errors,
)
from vitembed.server.openapi_bodies import image_request_body
from vitembed.server.plumbing import (
    ERROR_RESPONSES,
    EngineDep,
    SettingsDep,
    offload,
    race_client,
    read_body,
    run_engine,
    unsupported_media_type,
)
from vitembed.server.quotas import charge_images
from vitembed.server.schemas import NOT_BOOL, not_bool

STATIC = resources.files("vitembed.server") / "static"
FEATURE_FIELDS = ("model", "layer", "policy", "size", "background_threshold")
SIMILARITY_FIELDS = ("model", "layer", "policy", "size", "index", "id", "row", "col")
PAGE_HEADERS = {
    # nothing but this origin: no CDN, no inline script, no remote image; blob:/data: for drawn pictures
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
        "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
ASSET_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


# ------------------------------------------------------------------------------------------- schemas
class PatchOptionsIn(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        None, min_length=1, max_length=128, description="a served model (default: first)"
    )
    layer: Annotated[int | None, NOT_BOOL] = Field(
        None,
        ge=-64,
        le=63,
        description="the block whose patch tokens are used, 0-based or negative from the end (default: the "
        "model's default block)",
    )
    policy: str | None = Field(
        None, min_length=1, max_length=32, description="crop | squash | pad | dynamic (default: the model's)"
    )
    size: tuple[int, int] | None = Field(None, description="(H, W) in pixels: 224,224 (a list in JSON)")

    @field_validator("size", mode="before")
    @classmethod
    def _parse_size(cls, value: Any) -> Any:
        value = not_bool(value)
        if isinstance(value, str):
            parts = value.lower().replace("x", ",").split(",")
            parts = parts * 2 if len(parts) == 1 else parts  # one number: a square
            if len(parts) != 2 or not all(p.strip().isdigit() and len(p.strip()) <= 6 for p in parts):
                raise ValueError("size must be one or two whole numbers: 224 (a square) or H,W, e.g. 224,224")
            return (int(parts[0]), int(parts[1]))
        if isinstance(value, int) and not isinstance(value, bool):
            return (value, value)
        return value

    @field_validator("size")
    @classmethod
    def _positive(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and min(value) < 1:
            raise ValueError("size must be positive whole numbers: 224 (a square) or H,W, e.g. 224,224")
        return value


class FeatureOptionsIn(PatchOptionsIn):
    background_threshold: Annotated[float | None, NOT_BOOL] = Field(
        None,
        ge=0.0,
        le=1.0,
        description="remove the background: keep patches whose scaled first principal component exceeds this",
    )


class SimilarityOptionsIn(PatchOptionsIn):
    index: str | None = Field(
        None, min_length=1, max_length=128, description="a served index (default: the only one)"
    )
    id: str = Field(min_length=1, max_length=1024, description="the index item to compare with")
    row: Annotated[int, NOT_BOOL] = Field(ge=0, le=4096, description="query patch row (0-based)")
    col: Annotated[int, NOT_BOOL] = Field(ge=0, le=4096, description="query patch column (0-based)")


class EncodedImage(BaseModel):
    shape: list[int]
    media_type: str
    base64: str


class CostOut(BaseModel):
    height: int
    width: int
    grid: list[int]
    tokens: int
    seq_len: int
    patch_dim: int
    dim: int
    params: int
    gflops: float
    attn_entries_per_head: int
    attn_mb_per_layer: float
    flops_vs_native: float
    native: bool


class PcaOut(BaseModel):
    rgb: list[list[list[float]]] = Field(
        description="[h][w][3] in [0, 1]: components 1-3 as red, green, blue"
    )
    first: list[list[float]] = Field(
        description="[h][w] first component of the patches that hold image, scaled to [0, 1] (letterbox 0)"
    )
    foreground: list[list[bool]] = Field(
        description="[h][w] the patches in the map: those holding image (above the threshold if one is given)"
    )
    explained: list[float] = Field(description="variance share of each component")
    threshold: float | None


class PatchFeaturesResponse(BaseModel):
    model: str
    layer: int
    policy: str
    size: list[int] = Field(description="(H, W) of the pixels the model is given")
    source_size: list[int]
    grid: list[int]
    patch_size: list[int]
    view: EncodedImage
    pca: PcaOut
    cost: CostOut
    provenance: dict[str, Any]


class PatchSimilarityResponse(BaseModel):
    index: str
    id: str
    model: str
    layer: int
    policy: str
    patch: list[int]
    query_grid: list[int]
    grid: list[int]
    size: list[int]
    similarity: list[list[float]] = Field(description="[h][w] cosine of the query patch with each item patch")
    best: dict[str, Any] = Field(description="row, col and score of the most similar item patch")
    view: EncodedImage


# ------------------------------------------------------------------------------------------- helpers
async def _one_image(
    request: Request, fields: tuple[str, ...], max_images: int
) -> tuple[bytes, dict[str, Any]]:
    body = await read_body(request)
    content_type = request.headers.get("content-type")
    if media_type(content_type) == "multipart/form-data":
        images, raw = await offload(len(body), parse_multipart, body, content_type or "", max_images, fields)
    elif is_json(content_type):
        images, raw = await offload(
            len(body), functools.partial(parse_embed_json, option_names=fields), body, max_images
        )
    else:
        raise unsupported_media_type("multipart/form-data or application/json")
    if len(images) != 1:
        raise ApiError(422, "invalid_request", f"send exactly one image, not {len(images)}")
    return images[0], raw


def _validate(model: type[BaseModel], raw: dict[str, Any]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def _block(engine: Engine, model: str, layer: int | None) -> int:
    backbone = engine.backbone(model)
    if layer is None:
        defaults = backbone.defaults.layers
        layer = defaults[-1] if defaults else -1
    resolved = backbone.resolve_layers([layer])
    assert resolved is not None
    return resolved[0]


def _png(pixels: np.ndarray) -> dict[str, Any]:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG", compress_level=1)
    return {
        "shape": list(pixels.shape),
        "media_type": "image/png",
        "base64": base64.b64encode(buffer.getvalue()).decode("ascii"),
    }


async def _tokens_and_view(
    request: Request, engine: Engine, model: str, image: bytes, options: PatchOptionsIn, deadline: float
) -> tuple[np.ndarray, Any, int, str]:
    """One image's patch tokens of the chosen block [h, w, D] and the prepared pixels it came from."""
    block = _block(engine, model, options.layer)
    ticket = RequestTicket(deadline, budget_s(request))
    prepared = await race_client(
        request,
        ticket,
        engine.prepare(model, image, options.policy, options.size, ticket=ticket, pooling="patch"),
        deadline,
    )
    outcome = await run_engine(
        request,
        engine,
        model,
        [image],
        EmbedOptions(pooling="patch", layers=(block,), size=options.size, policy=options.policy),
        deadline,
    )
    return outcome.vectors[0], prepared, block, outcome.policy  # [h, w, D]


# ------------------------------------------------------------------------------------------- routes
page_router = APIRouter(include_in_schema=False)
explore_router = APIRouter(prefix="/v1", tags=["explore"], dependencies=[Depends(require_api_key)])


@page_router.get("/")
async def root() -> Response:
    return RedirectResponse("/explore", status_code=307)


@page_router.get("/explore")
async def page() -> Response:
    return FileResponse(str(STATIC / "explore.html"), media_type="text/html", headers=PAGE_HEADERS)


@page_router.get("/explore/assets/{name}")
async def asset(name: str) -> Response:
    """The page's own files, by exact name from the package's static folder (no paths)."""
    suffix = "." + name.rpartition(".")[2]
    candidate = STATIC / name
    if "/" in name or name.startswith(".") or suffix not in ASSET_TYPES or not candidate.is_file():
        raise ApiError(404, "not_found", "not found")
    return FileResponse(str(candidate), media_type=ASSET_TYPES[suffix], headers=PAGE_HEADERS)


@explore_router.post(
    "/patch-features",
    response_model=PatchFeaturesResponse,
    responses=ERROR_RESPONSES,
    openapi_extra={"requestBody": image_request_body(FeatureOptionsIn, one=True)},
)
async def patch_features(request: Request, engine: EngineDep, settings: SettingsDep) -> Response:
    """One image (multipart part ``image`` or JSON ``{"images": [{"base64"}]}``) → what the model sees under
    ``policy`` and ``size`` (a PNG of the prepared pixels), its patch grid, the cost of that size, and the
    PCA map of block ``layer``'s patch tokens (optionally without the background)."""
    deadline = request_deadline(request, settings)
    image, raw = await _one_image(request, FEATURE_FIELDS, settings.max_images_per_request)
    options: FeatureOptionsIn = _validate(FeatureOptionsIn, raw)
    charge_images(request, 1)  # the caller's quota, before the image is decoded
    model = options.model or next(iter(settings.models))
    tokens, prepared, block, policy = await _tokens_and_view(request, engine, model, image, options, deadline)
    backbone = engine.backbone(model)

    def compute() -> dict[str, Any]:
        pca = patch_pca(tokens, background_threshold=options.background_threshold, valid=prepared.valid)
        view = model_view(prepared.pixel_values.numpy(), backbone.preprocess_config)  # [H, W, 3]
        height, width = view.shape[:2]
        cost = cost_report(arch_from_hf_config(backbone.config), height, width, params=backbone.info().params)
        return {
            "model": model,
            "layer": block,
            "policy": policy,
            "size": [height, width],
            "source_size": list(prepared.source_size),
            "grid": list(prepared.grid),
            "patch_size": list(backbone.patch_size),
            "view": _png(view),
            "pca": {
                "rgb": np.round(pca.rgb, 6).tolist(),
                "first": np.round(pca.first, 6).tolist(),
                "foreground": pca.foreground.tolist(),
                "explained": list(pca.explained),
                "threshold": pca.threshold,
            },
            "cost": cost.to_dict(),
            "provenance": {
                "revision": backbone.checkpoint.revision,
                "preprocess_hash": backbone.preprocess_config.hash(),
                "interpolation": backbone.info_interpolation,
                "tokens": "patch tokens of the block, through the final norm",
            },
        }

    return JSONResponse(await asyncio.to_thread(compute))


def _item_images(request: Request, served: ServedIndex) -> ItemImages:
    cache: dict[str, ItemImages] = request.app.state.__dict__.setdefault("explore_item_images", {})
    found = cache.get(served.name)
    if found is None:
        with table_errors(served):
            source = served.index.image_source()
        found = cache[served.name] = ItemImages(source, request.app.state.engine.limits)
    return found


async def _item_bytes(
    request: Request, served: ServedIndex, item_id: str, deadline: float
) -> tuple[bytes, ItemImages]:
    def known() -> bool:
        with table_errors(served):
            return served.index.has_id(item_id)

    if not await run_search_work(request, known, deadline):
        raise ApiError(404, "item_not_found", f"index {served.name!r} has no item {item_id[:128]!r}")
    images = _item_images(request, served)
    try:
        return await asyncio.to_thread(images.read, item_id), images
    except ItemNotFoundError as exc:
        raise ApiError(404, "item_not_found", str(exc)) from exc


@explore_router.post(
    "/patch-similarity",
    response_model=PatchSimilarityResponse,
    responses=ERROR_RESPONSES,
    openapi_extra={"requestBody": image_request_body(SimilarityOptionsIn, one=True)},
)
async def patch_similarity_route(request: Request, engine: EngineDep, settings: SettingsDep) -> Response:
    """Where they match: the query image's patch (``row``, ``col``) of block ``layer`` against every patch of
    index item ``id``, whose image is read from the index's catalog and prepared with the same ``policy`` and
    ``size``; the cosine of each pair as an [h][w] map over the item's pixels (also returned, as a PNG)."""
    deadline = request_deadline(request, settings)
    image, raw = await _one_image(request, SIMILARITY_FIELDS, settings.max_images_per_request)
    options: SimilarityOptionsIn = _validate(SimilarityOptionsIn, raw)
    charge_images(request, 2)  # the caller's quota: the query image and the item's
    served = pick_index(served_indexes(request), options.index)
    model = options.model or served.model
    item, _ = await _item_bytes(request, served, options.id, deadline)
    query, _, block, policy = await _tokens_and_view(request, engine, model, image, options, deadline)
    try:
        tokens, prepared, _, _ = await _tokens_and_view(request, engine, model, item, options, deadline)
    except RequestImageError as exc:  # the catalog's file, not the client's image
        raise ApiError(
            404, "item_not_found", f"the image of item {options.id[:128]!r} cannot be used: {exc.error}"
        ) from exc
    backbone = engine.backbone(model)

    def compute() -> dict[str, Any]:
        similarity = patch_similarity(query, options.row, options.col, tokens)  # [h, w]
        best = np.unravel_index(int(np.argmax(similarity)), similarity.shape)
        view = model_view(prepared.pixel_values.numpy(), backbone.preprocess_config)
        return {
            "index": served.name,
            "id": options.id,
            "model": model,
            "layer": block,
            "policy": policy,
            "patch": [options.row, options.col],
            "query_grid": list(query.shape[:2]),
            "grid": list(prepared.grid),
            "size": list(view.shape[:2]),
            "similarity": np.round(similarity, 6).tolist(),
            "best": {"row": int(best[0]), "col": int(best[1]), "score": float(similarity[best])},
            "view": _png(view),
        }

    return JSONResponse(await asyncio.to_thread(compute))


@explore_router.get(
    "/indexes/{index}/thumbnail",
    responses={200: {"content": {"image/jpeg": {}}}, **ERROR_RESPONSES},
)
async def thumbnail(
    request: Request,
    index: str,
    settings: SettingsDep,
    item_id: Annotated[
        str, Query(alias="id", min_length=1, max_length=1024, description="an item of the index")
    ],
    max_side: Annotated[int, Query(ge=16, le=MAX_THUMBNAIL_SIDE, description="longer side in pixels")] = 160,
) -> Response:
    """A JPEG of index item ``id``, from the source its catalog was embedded from (never another path)."""
    deadline = request_deadline(request, settings)
    served = pick_index(served_indexes(request), index)
    data, images = await _item_bytes(request, served, item_id, deadline)
    try:
        jpeg = await asyncio.to_thread(thumbnail_jpeg, data, max_side, images.limits)
    except ImageDecodeError as exc:
        raise ApiError(
            404, "item_not_found", f"the image of item {item_id[:128]!r} cannot be used: {exc}"
        ) from exc
    return Response(jpeg, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=300"})
