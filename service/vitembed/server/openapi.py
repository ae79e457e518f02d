"""The OpenAPI document as the contract: what FastAPI generates, made exact for this server.

- Security appears only when the server has API keys (``VITEMBED_API_KEY`` or an API keys file; then
  ``401`` is listed on every ``/v1`` route). With per-caller quotas, the ``429`` of the routes that take
  images names ``quota_exceeded`` too.
- Every status a route can return is listed with the shared error schema: the middleware's (``408`` for a
  body or head that does not arrive, ``413`` for a declared body over the limit, ``503`` ``server_busy``
  or ``not_ready``, ``500``) as well as the route's own; ``429`` declares its ``Retry-After``.
  Each operation lists exactly the statuses it can answer (``_ROUTE_STATUSES``); a GET takes no body, so
  it lists no body statuses.
- Request bodies say what is required: ``/v1/embeddings`` takes one data URI or a non-empty list of at
  most ``max_images_per_request`` (format ``image-data-uri``), ``"modality": "image"`` and no
  ``dimensions``; the image routes take at least one (the explorer's: exactly one) image part
  (``image/*``) or JSON image, with their options typed (``openapi_bodies.py``); ``maxItems`` is the
  server's ``max_images_per_request``.
- Every route that takes the client's shorter deadline declares the ``X-Request-Timeout`` header (a
  positive number of seconds); ``/v1/embed``'s 200 declares the ``X-Vitembed-*`` headers of its ``.npy``
  form.

Custom string formats (``image-data-uri``, ``image-base64``) name what a generator must produce; a schema
validator that does not know them ignores them, and the ``pattern`` beside them states the shape.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from vitembed.server.deadlines import TIMEOUT_HEADER
from vitembed.server.openapi_bodies import json_images, json_properties, typed_parameters
from vitembed.server.routes_heads import ClassifyOptionsIn
from vitembed.server.schemas import EmbedOptionsIn
from vitembed.server.serialise import HEADER_PREFIX, NPY_HEADERS
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

_DESCRIPTIONS = {
    400: "bad body: not JSON/multipart, no images, invalid base64, undecodable image",
    401: "missing or wrong bearer token",
    404: "unknown model, head, index or index item",
    409: "the index was rebuilt in a way the served models cannot query (index_changed)",
    408: "the body (body_timeout_s) did not arrive in time; the connection is closed",
    413: "body over max_body_bytes, too many images, or an image over the byte limit",
    415: "wrong Content-Type or an image format that is not accepted",
    422: "options that cannot be honoured, an image over the pixel / aspect-ratio limits, a bad header",
    429: "refused at admission before decoding (overloaded, deadline_too_short, queue_full); see Retry-After",
    500: "internal error, or non-finite model output (code non_finite)",
    503: "models not ready, max_concurrent_requests in flight (server_busy, with Retry-After), or the "
    "index's table was dropped (index_dropped)",
    504: "the request deadline (request_timeout_s or X-Request-Timeout) passed",
}
_QUOTA_429 = (
    "refused at admission before decoding (overloaded, deadline_too_short, queue_full), or over the "
    "caller's quota (quota_exceeded; error.limit: max_images_in_flight or images_per_second); see Retry-After"
)
_RETRY_AFTER = {
    "description": "whole seconds after which the request would fit",
    "schema": {"type": "string", "pattern": "^[0-9]+$"},
}
# what every operation can answer, whatever its route: the last-resort 500; every /v1 route also 503
# (server_busy) and, with a key, 401; a route reading a body 400, 408, 413, 415, 422 and 504
_ANY_ROUTE = (500,)
_V1_ROUTE = (500, 503)
_WITH_BODY = (400, 408, 413, 415, 422, 504)
# what each route adds: 404 (unknown model / head / index / item), 409 (index_changed), 429 (admission),
# 422 (query parameters, X-Request-Timeout), 504 (search pool past the deadline)
_ROUTE_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("get", "/ready"): (503,),
    ("post", "/v1/embed"): (404, 429),
    ("post", "/v1/embeddings"): (404, 429),
    ("post", "/v1/search"): (404, 409, 429),
    ("get", "/v1/indexes"): (409, 504),
    ("post", "/v1/classify"): (404, 429),
    ("post", "/v1/patch-features"): (404, 429),
    ("post", "/v1/patch-similarity"): (404, 409, 429),
    ("get", "/v1/indexes/{index}/thumbnail"): (404, 409, 422, 504),
}
# routes that take the client's shorter deadline (deadlines.request_deadline): X-Request-Timeout
_DEADLINE_ROUTES = {
    ("post", "/v1/embed"),
    ("post", "/v1/embeddings"),
    ("post", "/v1/search"),
    ("post", "/v1/classify"),
    ("post", "/v1/patch-features"),
    ("post", "/v1/patch-similarity"),
    ("get", "/v1/indexes/{index}/thumbnail"),
}
DEADLINE_PARAMETER = {
    "name": TIMEOUT_HEADER,
    "in": "header",
    "required": False,
    "description": "this request's deadline in seconds, when shorter than the server's request_timeout_s: "
    "an answer not ready by then is a 504 and work still queued at the deadline is dropped; where images "
    "are admitted, a request that cannot be served in time behind the queued work is refused at once (429 "
    "deadline_too_short); anything but a positive number is a 422",
    "schema": {"type": "number", "exclusiveMinimum": 0, "examples": [2.5]},
}
# routes whose query parameters are their options as text
_QUERY_OPTIONS: dict[str, type[BaseModel]] = {"/v1/embed": EmbedOptionsIn, "/v1/classify": ClassifyOptionsIn}


def error_response(status: int, *, quotas: bool = False) -> dict[str, Any]:
    description = _QUOTA_429 if quotas and status == 429 else _DESCRIPTIONS.get(status, "error")
    response: dict[str, Any] = {
        "description": description,
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
    keyed = settings.callers.keyed
    quotas = settings.callers.limited
    if not keyed:
        components.pop("securitySchemes", None)
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            if not isinstance(operation, dict):
                continue
            if not keyed:
                operation.pop("security", None)
            _list_statuses(path, method, operation, keyed, quotas)
            if (method, path) in _DEADLINE_ROUTES:
                operation.setdefault("parameters", []).append(copy.deepcopy(DEADLINE_PARAMETER))
            _limit_images(operation, settings.max_images_per_request)
            if path in _QUERY_OPTIONS:
                typed_parameters(operation.get("parameters", []), _QUERY_OPTIONS[path])
    _openai_body(components.get("schemas", {}), settings)
    _embed_bodies(schema, settings)
    _npy_headers(schema)
    return schema


def _statuses(path: str, method: str, operation: dict[str, Any], keyed: bool) -> set[int]:
    statuses: set[int] = set(_ANY_ROUTE)
    if path.startswith("/v1/"):
        statuses |= set(_V1_ROUTE)
        if keyed:
            statuses.add(401)
        if method in ("post", "put", "patch"):
            statuses |= set(_WITH_BODY)
    own = _ROUTE_STATUSES.get((method, path))
    if own is not None:
        return statuses | set(own)
    # a route not in the table (yet): the general rule
    if path.startswith("/v1/") and method == "post":
        statuses |= {404, 429}
    if any(part.startswith("{") for part in path.split("/")):
        statuses.add(404)
    if operation.get("parameters"):
        statuses.add(422)
    return statuses


def _list_statuses(path: str, method: str, operation: dict[str, Any], keyed: bool, quotas: bool) -> None:
    """Exactly the error statuses of ``_statuses``, each with the shared schema (and its headers)."""
    responses: dict[str, Any] = operation.setdefault("responses", {})
    statuses = _statuses(path, method, operation, keyed)
    for code in [code for code in responses if code.isdigit() and int(code) >= 400]:
        if int(code) not in statuses:
            del responses[code]
    for status in sorted(statuses):
        responses[str(status)] = error_response(status, quotas=quotas)


def _limit_images(operation: dict[str, Any], max_images: int) -> None:
    """``maxItems`` of the image lists of the request body (unless the route takes exactly one)."""
    for content in operation.get("requestBody", {}).get("content", {}).values():
        properties = content.get("schema", {}).get("properties", {})
        candidates = [properties.get("image"), properties.get("images")]
        candidates += (properties.get("images") or {}).get("anyOf", [])
        for images in candidates:
            if isinstance(images, dict) and images.get("type") == "array" and "maxItems" not in images:
                images["maxItems"] = max_images


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
    """The JSON body of ``/v1/embed`` (component ``EmbedJsonRequest``) with the typed options and the image
    limits; ``ImageIn.base64`` is an encoded image (format ``image-base64``)."""
    schemas = schema.get("components", {}).get("schemas", {})
    body = schemas.get("EmbedJsonRequest")
    if body is not None:
        images = dict(json_images(), maxItems=settings.max_images_per_request)
        body["properties"] = {**json_properties(EmbedOptionsIn), "images": images}
    image_in = schemas.get("ImageIn", {})
    encoded = image_in.get("properties", {}).get("base64")
    if encoded is not None:
        encoded.update(format="image-base64", minLength=1, examples=[EXAMPLE_PNG_BASE64])


def _npy_headers(schema: dict[str, Any]) -> None:
    """The ``X-Vitembed-*`` headers of ``/v1/embed``'s ``.npy`` answer (``Accept: application/x-npy``) on
    its 200; not required, since the JSON answer carries the same facts in its body."""
    ok = schema.get("paths", {}).get("/v1/embed", {}).get("post", {}).get("responses", {}).get("200")
    if ok is None:
        return
    ok["headers"] = {
        f"{HEADER_PREFIX}{name}": {
            "description": f"with the .npy form only: {description}",
            "required": False,
            "schema": {"type": "string"},
        }
        for name, description in NPY_HEADERS.items()
    }
