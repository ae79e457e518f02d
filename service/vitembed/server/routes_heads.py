"""``POST /v1/classify``: a served frozen head's answer for each image.

Images arrive as for ``/v1/embed`` (multipart parts named ``image``, or JSON ``{"images": [{"base64"}]}``);
options ``head`` (default: the only served head), ``k`` (classifiers; alias ``top_k``) and ``upsample`` /
``upsample_mode`` (patch heads) come as form fields, JSON fields or query parameters, each from one place.
Images are prepared the way the head was trained (its card's policy and size) and go through the same
batcher as embeddings. ``Accept: application/x-npy`` returns one array: probabilities [n, C] (class order
in ``X-Vitembed-Classes``) or class ids [n, h, w] / [n, H, W]. In JSON an upsampled mask is
``{"shape": [H, W], "dtype": "uint8"|"uint16", "base64"}`` (row-major bytes), and a request whose masks
would exceed ``max_upsample_pixels`` in total is refused (422 ``upsample_too_large``).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
import torch
from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from vit_backbone.errors import InvalidOptionError
from vit_backbone.heads.patch import patch_ids
from vitembed.engine.engine import ClassifyOutcome, Engine, RequestTicket
from vitembed.engine.served_heads import labels_json
from vitembed.server.auth import require_api_key
from vitembed.server.body_parser import is_json, media_type, merge_into, parse_embed_json, parse_multipart
from vitembed.server.deadlines import budget_s, request_deadline
from vitembed.server.errors import ApiError
from vitembed.server.openapi_bodies import image_request_body
from vitembed.server.plumbing import (
    JSON_MEDIA_TYPE,
    EngineDep,
    MetricsDep,
    SettingsDep,
    offload,
    race_client,
    read_body,
    unsupported_media_type,
    wants_npy,
)
from vitembed.server.quotas import charge_images
from vitembed.server.schemas import FLAG, NOT_BOOL
from vitembed.server.serialise import NPY_MEDIA_TYPE, b64, dumps, timed
from vitembed.settings import HEAD_NAME_MAX

CLASSIFY_OPTIONS = ("head", "k", "upsample", "upsample_mode")

heads_router = APIRouter(prefix="/v1", tags=["heads"], dependencies=[Depends(require_api_key)])


class ClassifyOptionsIn(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    head: str | None = Field(
        None, min_length=1, max_length=HEAD_NAME_MAX, description="a served head (default: the only one)"
    )
    k: Annotated[int, NOT_BOOL] = Field(
        5, ge=1, le=1000, description="classifier heads: how many labels per image (alias: top_k)"
    )
    upsample: Annotated[bool, FLAG] = Field(
        False, description="patch heads: class ids at each input image's size too"
    )
    upsample_mode: Literal["bilinear", "nearest"] = Field(
        "bilinear", description="bilinear on the logits, or nearest on the class ids"
    )


class ClassifyQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    head: str | None = Field(None, description="a served head")
    k: str | None = Field(None, description="labels per image (default 5)")
    top_k: str | None = Field(None, description="alias of k")
    upsample: str | None = Field(None, description="true | false (patch heads)")
    upsample_mode: str | None = Field(None, description="bilinear | nearest")


def parse_classify_json(body: bytes, max_images: int) -> tuple[list[bytes], dict[str, Any]]:
    return parse_embed_json(body, max_images, option_names=CLASSIFY_OPTIONS)


def _head_name(engine: Engine, asked: str | None) -> str:
    if asked is not None:
        return asked
    names = engine.head_names
    if len(names) == 1:
        return names[0]
    if not names:
        raise ApiError(404, "head_not_found", "no heads are served; start the server with --head NAME=PATH")
    raise ApiError(422, "head_required", f"several heads are served; name one with head=: {', '.join(names)}")


@heads_router.post(
    "/classify",
    responses={200: {"content": {NPY_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
    openapi_extra={"requestBody": image_request_body(ClassifyOptionsIn)},
)
async def classify(
    request: Request,
    query: Annotated[ClassifyQuery, Query()],
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Response:
    """Top-k labels with probabilities per image (classifier heads), or class-id grids (patch heads)."""
    deadline = request_deadline(request, settings)
    body = await read_body(request)
    content_type = request.headers.get("content-type")
    limit = settings.max_images_per_request
    if media_type(content_type) == "multipart/form-data":
        images, fields = await offload(
            len(body), parse_multipart, body, content_type or "", limit, CLASSIFY_OPTIONS
        )
    elif is_json(content_type):
        images, fields = await offload(len(body), parse_classify_json, body, limit)
    else:
        raise unsupported_media_type("multipart/form-data or application/json")
    charge_images(request, len(images))  # the caller's quota, before any image is decoded
    options = merge_into(ClassifyOptionsIn, query.model_dump(exclude_none=True), fields)
    name = _head_name(engine, options.head)
    bound = engine.bound_head(name)
    patch = bound.card.kind == "patch"
    if options.upsample and not patch:
        raise InvalidOptionError(f"upsample applies to patch heads; {name!r} is a {bound.card.kind} head")
    ticket = RequestTicket(deadline, budget_s(request))
    outcome = await race_client(
        request, ticket, engine.classify(name, images, ticket=ticket, deadline=deadline), deadline
    )
    npy = wants_npy(request.headers.get("accept"))
    if patch:
        values = sum(int(np.prod(size)) for size in outcome.source_sizes) if options.upsample else 0
        if values > settings.max_upsample_pixels:
            raise ApiError(
                422,
                "upsample_too_large",
                f"upsample=true would return {values} mask pixels for these {len(images)} image(s), over "
                f"the server's limit of {settings.max_upsample_pixels}: send fewer or smaller images, or "
                "drop upsample and scale the patch grid yourself",
            )
        # torch ops (the upsampling, the argmax): always on a worker thread. On the event loop a parallel op
        # would start torch's OpenMP team from it, with its raised priority (vitembed.engine.priority)
        result = await timed(metrics, lambda: _patch_body(outcome, options, npy), values=values, offload=True)
    else:
        result = await timed(metrics, lambda: _labels_body(outcome, options.k, npy), values=0)
    data, headers = result
    return Response(data, media_type=NPY_MEDIA_TYPE if npy else JSON_MEDIA_TYPE, headers=headers)


def _check_finite(outputs: Sequence[np.ndarray]) -> None:
    for index, values in enumerate(outputs):
        if not np.isfinite(values).all():
            raise ApiError(
                500, "non_finite", "the head produced non-finite values for this image", index=index
            )


def _facts(outcome: ClassifyOutcome) -> dict[str, Any]:
    return {"head": outcome.head.name, "model": outcome.head.model, "kind": outcome.head.card.kind}


def _provenance(outcome: ClassifyOutcome) -> dict[str, Any]:
    """Where the numbers come from: the head's features and the precision they were computed in here
    (``precision``) and at training time (``head_precision``; null on cards that did not record it)."""
    card = outcome.head.card
    return {
        "revision": card.revision,
        "preprocess_hash": card.preprocess_hash,
        "pooling": card.pooling,
        "layers": None if card.layers is None else list(card.layers),
        "policy": outcome.head.inputs.policy,
        "precision": outcome.precision,
        "precision_cosine": outcome.precision_cosine,
        "head_precision": card.precision,
        "preset": card.preset,
    }


def mask_json(mask: np.ndarray, num_classes: int) -> dict[str, Any]:
    """A class-id mask [H, W] as base64 of its row-major bytes: uint8 up to 256 classes, else uint16
    (little-endian). Nested JSON lists would cost ~4 bytes per pixel and much more time to encode."""
    dtype = "uint8" if num_classes <= 256 else "uint16"
    data = np.ascontiguousarray(mask, dtype="<u2" if dtype == "uint16" else "u1")
    return {"shape": list(mask.shape), "dtype": dtype, "base64": b64(data)}


def _npy(array: np.ndarray, outcome: ClassifyOutcome) -> tuple[bytes, dict[str, str]]:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    headers = {f"X-Vitembed-{key.title()}": str(value) for key, value in _facts(outcome).items()}
    headers["X-Vitembed-Classes"] = json.dumps(list(outcome.head.card.classes), separators=(",", ":"))
    return buffer.getvalue(), headers


def _labels_body(outcome: ClassifyOutcome, top_k: int, npy: bool) -> tuple[bytes, dict[str, str]]:
    _check_finite(outcome.outputs)
    if npy:
        return _npy(np.stack(outcome.outputs).astype("<f4"), outcome)  # [n, C]
    classes = outcome.head.card.classes
    data = [
        {"index": index, "labels": labels_json(classes, row, top_k)}
        for index, row in enumerate(outcome.outputs)
    ]
    return dumps({**_facts(outcome), "data": data, "provenance": _provenance(outcome)}), {}


def _patch_body(
    outcome: ClassifyOutcome, options: ClassifyOptionsIn, npy: bool
) -> tuple[bytes, dict[str, str]]:
    _check_finite(outcome.outputs)
    boxes = outcome.image_boxes or [None] * len(outcome.outputs)
    logits = [torch.from_numpy(x) for x in outcome.outputs]  # [h, w, C] each
    # [h, w] each: IGNORE (255) on pad's letterbox
    grids = [patch_ids(x, patch=outcome.patch, box=box).numpy() for x, box in zip(logits, boxes, strict=True)]
    masks = []
    if options.upsample:
        masks = [
            patch_ids(
                x, patch=outcome.patch, box=box, upsample_to=size, mode=options.upsample_mode
            ).numpy()  # [H, W]
            for x, box, size in zip(logits, boxes, outcome.source_sizes, strict=True)
        ]
    if npy:
        arrays = masks if options.upsample else grids
        shapes = sorted({a.shape for a in arrays})
        if len(shapes) > 1:
            raise ApiError(
                422,
                "mixed_sizes",
                f"one .npy array needs equal sizes, and these are {shapes[:4]}: ask for JSON, or send images "
                "of one size",
            )
        return _npy(np.stack(arrays).astype("<i4"), outcome)  # [n, h, w] or [n, H, W]
    data: list[dict[str, Any]] = []
    for index, grid in enumerate(grids):
        item: dict[str, Any] = {"index": index, "grid": grid.tolist()}
        if options.upsample:
            item["size"] = list(outcome.source_sizes[index])
            item["mask"] = mask_json(masks[index], outcome.head.card.num_classes)
        data.append(item)
    body = {**_facts(outcome), "classes": list(outcome.head.card.classes), "data": data}
    return dumps({**body, "provenance": _provenance(outcome)}), {}
