"""The OpenAPI document as the contract: what FastAPI generates, made exact for this server.

- Security appears only when the server has an API key (then ``401`` is listed on every ``/v1`` route).
- Every status a route can return is listed with the shared error schema: the middleware's (``408`` for a
  body or head that does not arrive, ``413`` for a declared body over the limit, ``503`` ``server_busy``
  or ``not_ready``, ``500``) as well as the route's own; ``429`` declares its ``Retry-After``.
- Request bodies say what is required: ``/v1/embeddings`` takes one data URI or a non-empty list of at
  most ``max_images_per_request`` (format ``image-data-uri``), ``"modality": "image"`` and no
  ``dimensions``; ``/v1/embed`` takes at least one image part (``image/*``) or JSON image.

Custom string formats (``image-data-uri``, ``image-base64``) name what a generator must produce; a schema
validator that does not know them ignores them, and the ``pattern`` beside them states the shape.
"""

from __future__ import annotations

import copy
from typing import Any

from vitembed.settings import ServiceSettings

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
DATA_URI_PATTERN = (
    r"^data:image/[A-Za-z0-9.+-]+(;[A-Za-z0-9_.+-]+=[A-Za-z0-9_.+-]+)*;base64,[A-Za-z0-9+/_-]+=*$"
)
# a real 16x16 PNG: the schema's example of an image
EXAMPLE_PNG_BASE64 = (
    "iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAIAAACQkWg2AAAAGUlEQVR4nGM8UaHBQApgIkn1qIZRDUNKAwCAnAGIOXIt/QAAAABJRU5E"
    "rkJggg=="
)
IMAGE_MEDIA_TYPES = "image/jpeg, image/png, image/webp, image/gif, image/bmp, image/tiff"

_DESCRIPTIONS = {
    400: "bad body: not JSON/multipart, no images, invalid base64, undecodable image",
    401: "missing or wrong bearer token",
    404: "unknown model, head or index",
    408: "the body (body_timeout_s) did not arrive in time; the connection is closed",
    413: "body over max_body_bytes, too many images, or an image over the byte limit",
    415: "wrong Content-Type or an image format that is not accepted",
    422: "options that cannot be honoured, an image over the pixel / aspect-ratio limits, a bad header",
    429: "refused at admission before decoding (overloaded, deadline_too_short, queue_full); see Retry-After",
    500: "internal error, or non-finite model output (code non_finite)",
    503: "models not ready, or max_concurrent_requests in flight (server_busy, with Retry-After)",
    504: "the request deadline (request_timeout_s or X-Request-Timeout) passed",
}
_RETRY_AFTER = {
    "description": "whole seconds after which the request would fit",
    "schema": {"type": "string", "pattern": "^[0-9]+$"},
}
# what every operation can answer, whatever its route: the middleware's and the last-resort answers
_ANY_ROUTE = (500,)
_V1_ROUTE = (500, 503)
_WITH_BODY = (400, 408, 413, 415, 422, 429, 504)


def error_response(status: int, *, required_retry_after: bool = False) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _DESCRIPTIONS.get(status, "error"),
        "content": {"application/json": {"schema": ERROR_REF}},
    }
    if status == 429:
        response["headers"] = {"Retry-After": {**_RETRY_AFTER, "required": True}}
    elif status == 503:
        response["headers"] = {"Retry-After": {**_RETRY_AFTER, "required": False}}
    elif status == 401:
        response["headers"] = {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}}
    return response


def make_contract(schema: dict[str, Any], settings: ServiceSettings) -> dict[str, Any]:
    """A copy of ``schema`` made exact for ``settings`` (see the module docstring)."""
    schema = copy.deepcopy(schema)
    components = schema.setdefault("components", {})
    keyed = settings.api_key is not None
    if not keyed:
        components.pop("securitySchemes", None)
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            if not isinstance(operation, dict):
                continue
            if not keyed:
                operation.pop("security", None)
            _list_statuses(path, method, operation, keyed)
    _openai_body(components.get("schemas", {}), settings)
    _embed_bodies(schema, settings)
    return schema


def _list_statuses(path: str, method: str, operation: dict[str, Any], keyed: bool) -> None:
    responses: dict[str, Any] = operation.setdefault("responses", {})
    statuses: set[int] = set(_ANY_ROUTE)
    if path.startswith("/v1/"):
        statuses |= set(_V1_ROUTE)
        if keyed:
            statuses.add(401)
        if method in ("post", "put", "patch"):
            statuses |= set(_WITH_BODY)
        if any(part.startswith("{") for part in path.split("/")) or method == "post":
            statuses.add(404)
        if operation.get("parameters"):
            statuses.add(422)
    elif path == "/ready":
        statuses.add(503)
    for status in sorted(statuses):
        existing = responses.get(str(status))
        fresh = error_response(status)
        if existing is None:
            responses[str(status)] = fresh
        else:  # keep a route's own description, with the shared schema and headers
            existing.setdefault("content", fresh["content"])
            if "headers" in fresh:
                existing.setdefault("headers", fresh["headers"])
    if not keyed:
        responses.pop("401", None)


def data_uri_schema() -> dict[str, Any]:
    return {
        "type": "string",
        "format": "image-data-uri",
        "pattern": DATA_URI_PATTERN,
        "description": "an image file as a data:image/<type>;base64,<data> URI",
        "examples": [f"data:image/png;base64,{EXAMPLE_PNG_BASE64}"],
    }


def _openai_body(schemas: dict[str, Any], settings: ServiceSettings) -> None:
    body = schemas.get("OpenAIEmbeddingRequest")
    if body is None:
        return
    properties = body.setdefault("properties", {})
    properties["input"] = {
        "description": "one image, or a non-empty list of images, as data URIs",
        "anyOf": [
            data_uri_schema(),
            {
                "type": "array",
                "items": data_uri_schema(),
                "minItems": 1,
                "maxItems": settings.max_images_per_request,
            },
        ],
    }
    properties["dimensions"] = {
        "type": "null",
        "description": "not supported: a backbone's embedding width is fixed (any number is refused, 422)",
    }
    properties["modality"] = {
        "anyOf": [{"type": "string", "enum": ["image"]}, {"type": "null"}],
        "description": "image (infinity's field); these models embed images only: text is refused (422)",
    }


def _embed_bodies(schema: dict[str, Any], settings: ServiceSettings) -> None:
    operation = schema.get("paths", {}).get("/v1/embed", {}).get("post")
    if operation is None:
        return
    content = operation.get("requestBody", {}).get("content", {})
    form = content.get("multipart/form-data")
    if form is not None:
        image = form["schema"]["properties"]["image"]
        image.update(minItems=1, maxItems=settings.max_images_per_request)
        form["encoding"] = {"image": {"contentType": IMAGE_MEDIA_TYPES}}
    images = schema.get("components", {}).get("schemas", {}).get("EmbedJsonRequest", {})
    listed = images.get("properties", {}).get("images")
    if listed is not None:
        listed.update(minItems=1, maxItems=settings.max_images_per_request)
    image_in = schema.get("components", {}).get("schemas", {}).get("ImageIn", {})
    encoded = image_in.get("properties", {}).get("base64")
    if encoded is not None:
        encoded.update(format="image-base64", minLength=1, examples=[EXAMPLE_PNG_BASE64])
