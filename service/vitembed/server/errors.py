"""The one error boundary of the HTTP service.

Every error leaves as ``{"error": {"code", "message", "index"?, "request_id"}}`` with the status below and an
``X-Request-ID`` header; nothing the client sent is echoed back (messages are fixed text or the library's own,
whose echoed option values the schemas bound to a few dozen characters). Anything unexpected becomes a generic
500 whose traceback goes to the log under the same request id.

Status mapping:

=============================================================  ======
bad request body: empty, not JSON / multipart, no images,         400
invalid base64 or data URI, image bytes ``empty``,
``not_an_image``, ``truncated``, ``zero_size``
missing or wrong bearer token                                     401
unknown model, unknown route                                      404
method not allowed                                                405
the body (``body_timeout``) or the request head (``header_timeout``) 408
did not arrive in time; the connection is closed
body over ``max_body_bytes``, too many images, image ``too_large``  413
wrong Content-Type, image ``unsupported_format``                  415
options that cannot be honoured (pooling, layers, size, policy,   422
dtype...), image ``too_many_pixels`` or ``aspect_ratio`` (a
well-formed image that exceeds a limit), request validation
refused at admission, before decoding (``Retry-After``: whole    429
seconds, ≥ 1): ``queue_full`` (the hard cap in images),
``overloaded`` (predicted wait over the queue-delay target),
``deadline_too_short`` (predicted wait over the request's own
deadline, e.g. a short ``X-Request-Timeout``)
client closed the connection before the answer (never seen by     499
the client; counted in the metrics)
internal error, model output not finite (``non_finite``)          500
models loading or a model worker stopped; ``server_busy``:        503
``max_concurrent_requests`` in flight (``Retry-After: 1``)
request deadline (``request_timeout_s`` or ``X-Request-Timeout``) 504
passed
=============================================================  ======
"""

from __future__ import annotations

import http
import logging
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vit_backbone.errors import ImageDecodeError, InvalidOptionError, ModelNotFoundError, VitEmbedError
from vitembed.engine.admission import DEADLINE, QUEUE_DELAY, QUEUE_FULL
from vitembed.engine.engine import (
    CancelledWorkError,
    DeadlineExceededError,
    NotReadyError,
    QueueFullError,
    RequestImageError,
)
from vitembed.metrics import Metrics

log = logging.getLogger("vitembed.service")

REQUEST_ID_HEADER = "X-Request-ID"
_REQUEST_ID_KEY = "vitembed.request_id"  # where the id lives in the ASGI scope
_REQUEST_ID_MAX = 64
_REQUEST_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")
CLIENT_CLOSED = 499  # nginx's "client closed request": the answer had no one to go to

# ImageDecodeError.code -> status. Malformed bytes are the client's bad request (400); a format we refuse
# is 415 like a wrong Content-Type; too many bytes is 413 like a too-large body; a well-formed image that
# breaks a geometric limit (pixel budget, aspect ratio) cannot be processed as sent: 422.
DECODE_STATUS: Mapping[str, int] = {
    "empty": 400,
    "not_an_image": 400,
    "truncated": 400,
    "zero_size": 400,
    "invalid_image": 400,
    "unsupported_format": 415,
    "too_large": 413,
    "too_many_pixels": 422,
    "aspect_ratio": 422,
}

# The registry: every error code the service answers with, and its status. A new code is one line here
# (tests/vitembed/test_error_registry.py fails on a code the server can send that is missing) and one line in
# the client's mapping (client/vitembed_client/errors.py; tests/client fails on a code it does not map).
ERROR_CODES: Mapping[str, int] = MappingProxyType(
    {
        # 400: the body cannot be read as a request
        "bad_request": 400,
        "empty_body": 400,
        "invalid_json": 400,
        "invalid_multipart": 400,
        "invalid_base64": 400,
        "invalid_data_uri": 400,
        "no_images": 400,
        "http_error": 400,  # any other 4xx the framework raises (its status is the answer's)
        **{code: status for code, status in DECODE_STATUS.items()},  # image bytes: 400 / 413 / 415 / 422
        "unauthorized": 401,
        "forbidden": 403,
        "not_found": 404,  # unknown route
        "model_not_found": 404,
        "head_not_found": 404,
        "index_not_found": 404,
        "item_not_found": 404,  # an index item without a usable image (explorer thumbnails, patch similarity)
        "method_not_allowed": 405,
        "body_timeout": 408,  # the body did not arrive within body_timeout_s (connection closed)
        "header_timeout": 408,  # the request head did not arrive within header_timeout_s (connection closed)
        "index_changed": 409,
        "body_too_large": 413,
        "too_many_images": 413,
        "unsupported_media_type": 415,
        # 422: a well-formed request that cannot be honoured
        "invalid_request": 422,
        "invalid_option": 422,
        "invalid_size": 422,
        "dimensions_unsupported": 422,
        "modality_unsupported": 422,  # /v1/embeddings "modality" other than "image" (infinity's field)
        "dtype_overflow": 422,
        "heads_need_json": 422,
        "head_required": 422,
        "head_model_mismatch": 422,
        "head_options_mismatch": 422,
        "upsample_too_large": 422,
        "mixed_sizes": 422,
        "index_required": 422,
        "options_mismatch": 422,
        "model_mismatch": 422,
        "invalid_filter": 422,
        "invalid_vector": 422,
        "invalid_timeout": 422,  # X-Request-Timeout is not a positive number of seconds
        # 429: refused at admission, before decoding, with Retry-After (engine/admission.py)
        "queue_full": 429,  # the hard cap in images
        "overloaded": 429,  # the predicted wait passes the queue-delay target
        "deadline_too_short": 429,  # the predicted wait passes the request's own deadline
        "quota_exceeded": 429,  # over the caller's quota (API keys file), error.limit names it (quotas.py)
        "client_closed_request": CLIENT_CLOSED,
        "internal": 500,
        "non_finite": 500,
        "not_ready": 503,
        "server_busy": 503,  # max_concurrent_requests in flight (Retry-After: 1)
        "index_dropped": 503,
        "replica_unavailable": 503,  # Ray Serve: the replica serving the request stopped (vitembed.ray_serve)
        "deadline_exceeded": 504,
    }
)

_HTTP_CODES: Mapping[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


class ApiError(Exception):
    """An error the service answers on purpose: status, stable code, message for people, optional index."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        index: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.index = index
        self.headers = dict(headers or {})


# ------------------------------------------------------------------------------------------- request ids
def sanitise_request_id(raw: str | None) -> str:
    """Keep a caller's id if anything safe is left of it (≤ 64 of ``[A-Za-z0-9._:-]``), else make one."""
    cleaned = _REQUEST_ID_UNSAFE.sub("", raw or "")[:_REQUEST_ID_MAX]
    return cleaned or uuid.uuid4().hex


def request_id(scope: Scope) -> str:
    rid = scope.get(_REQUEST_ID_KEY)
    if not isinstance(rid, str):
        rid = scope[_REQUEST_ID_KEY] = sanitise_request_id(None)
    return rid


def _incoming_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"x-request-id":
            return str(value.decode("latin-1"))
    return None


# ------------------------------------------------------------------------------------------- bodies
def error_body(code: str, message: str, rid: str, index: int | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if index is not None:
        error["index"] = index
    error["request_id"] = rid
    return {"error": error}


def error_response(
    scope: Scope,
    status: int,
    code: str,
    message: str,
    *,
    index: int | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    rid = request_id(scope)
    merged = {**(headers or {}), REQUEST_ID_HEADER: rid}
    return JSONResponse(error_body(code, message, rid, index), status_code=status, headers=merged)


def internal_error_response(scope: Scope, exc: BaseException) -> JSONResponse:
    rid = request_id(scope)
    log.error(
        "internal error (request_id=%s, %s %s)",
        rid,
        scope.get("method", "?"),
        scope.get("path", "?"),
        exc_info=(type(exc), exc, exc.__traceback__),
    )
    return error_response(scope, 500, "internal", "internal error")


def describe_validation_errors(errors: Sequence[Any], *, limit: int = 5) -> str:
    """Where and what, never the input: pydantic's ``msg`` states the rule, ``loc`` names the field (keys
    the client made up are cut to 64 characters)."""
    parts: list[str] = []
    for error in errors[:limit]:
        loc = [str(p)[:64] for p in error.get("loc", ()) if p != "body"]
        msg = str(error.get("msg", "invalid value")).removeprefix("Value error, ")[:300]
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    if len(errors) > limit:
        parts.append(f"and {len(errors) - limit} more")
    return "; ".join(parts) or "invalid request"


# ------------------------------------------------------------------------------------------- mapping
def status_for(error: VitEmbedError) -> int:
    """The status of a library error; 500 for errors that are never the request's fault."""
    if isinstance(error, ModelNotFoundError):
        return 404
    if isinstance(error, ImageDecodeError):
        return DECODE_STATUS.get(error.code, 400)
    if isinstance(error, InvalidOptionError):  # SizeError included
        return 422
    return 500


def _library_error(request: Request, error: VitEmbedError, index: int | None) -> Response:
    status = status_for(error)
    if status == 500:
        return internal_error_response(request.scope, error)
    return error_response(request.scope, status, error.code, str(error), index=index)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(
        request.scope, exc.status, exc.code, exc.message, index=exc.index, headers=exc.headers
    )


async def _vitembed_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, VitEmbedError)
    return _library_error(request, exc, None)


async def _item_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestImageError)
    return _library_error(request, exc.error, exc.index)


# admission refusals (QueueFullError.reason) -> the error code clients see with 429 + Retry-After
ADMISSION_CODES: Mapping[str, str] = {
    QUEUE_FULL: "queue_full",
    QUEUE_DELAY: "overloaded",
    DEADLINE: "deadline_too_short",
}


def admission_message(exc: QueueFullError, seconds: int) -> str:
    if exc.reason == QUEUE_DELAY:
        return (
            f"the server is overloaded: the predicted wait ({exc.predicted_wait_s:.1f} s) is over its "
            f"queue-delay target ({exc.limit_s:g} s); retry in {seconds} s"
        )
    if exc.reason == DEADLINE:
        return (
            f"the predicted wait ({exc.predicted_wait_s:.1f} s) is longer than the request's deadline "
            f"({exc.limit_s:.3g} s); retry in {seconds} s or allow more time"
        )
    return f"the server is at capacity; retry in {seconds} s"


async def _queue_full(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, QueueFullError)
    seconds = max(1, math.ceil(exc.retry_after_s))
    return error_response(
        request.scope,
        429,
        ADMISSION_CODES.get(exc.reason, "queue_full"),
        admission_message(exc, seconds),
        headers={"Retry-After": str(seconds)},
    )


async def _deadline(request: Request, exc: Exception) -> Response:
    return error_response(
        request.scope, 504, "deadline_exceeded", str(exc) or "the request deadline passed before an answer"
    )


async def _not_ready(request: Request, exc: Exception) -> Response:
    return error_response(request.scope, 503, "not_ready", str(exc) or "the models are not ready")


async def _cancelled(request: Request, exc: Exception) -> Response:
    return error_response(request.scope, CLIENT_CLOSED, "client_closed_request", "the client went away")


async def _validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(request.scope, 422, "invalid_request", describe_validation_errors(exc.errors()))


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status >= 500:
        return internal_error_response(request.scope, exc)
    code = _HTTP_CODES.get(status, "http_error")
    try:
        message = http.HTTPStatus(status).phrase.lower()
    except ValueError:
        message = "request refused"
    if status == 405:
        message = f"method {request.method} is not allowed on this route"
    return error_response(request.scope, status, code, message, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    return internal_error_response(request.scope, exc)


def install_error_handlers(app: FastAPI) -> None:
    handlers = {
        ApiError: _api_error,
        RequestImageError: _item_error,
        VitEmbedError: _vitembed_error,
        QueueFullError: _queue_full,
        DeadlineExceededError: _deadline,
        NotReadyError: _not_ready,
        CancelledWorkError: _cancelled,
        RequestValidationError: _validation,
        StarletteHTTPException: _http_exception,
        Exception: _unexpected,  # Starlette's outermost ServerErrorMiddleware; RequestContext catches first
    }
    for exc_class, handler in handlers.items():
        app.add_exception_handler(exc_class, handler)


# ------------------------------------------------------------------------------------------- middleware
# where RequestContextMiddleware leaves the seconds of a 429's Retry-After, for the connection's protocol
RETRY_AFTER_SCOPE_KEY = "vitembed.retry_after_s"


class RequestContextMiddleware:
    """Pure ASGI, outermost of ours: assigns the request id and echoes it, counts every answer by route
    template and status, and turns any exception that escaped the handlers into the generic 500 (logged
    with its traceback) instead of a plain-text page or a dropped connection."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics, known_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = scope[_REQUEST_ID_KEY] = sanitise_request_id(_incoming_request_id(scope))
        header = (REQUEST_ID_HEADER.lower().encode(), rid.encode())
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [h for h in message.get("headers", []) if h[0].lower() != header[0]]
                if status == 429:  # for the connection (connection_protocol): how long it was told to wait
                    scope[RETRY_AFTER_SCOPE_KEY] = _retry_after(headers)
                message = {**message, "headers": [*headers, header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if status:  # the answer has begun: nothing valid can follow, let the server drop the connection
                log.error("error after the response started (request_id=%s)", rid, exc_info=exc)
                raise
            await internal_error_response(scope, exc)(scope, receive, send_with_id)
        finally:
            self.metrics.requests.labels(_route_template(scope, self.known_paths), str(status or 500)).inc()


def retry_after_seconds(value: bytes) -> float:
    """A ``Retry-After`` header's value in seconds (0 when it is not a number of seconds)."""
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        return 0.0


def _retry_after(headers: list[tuple[bytes, bytes]]) -> float:
    for name, value in headers:
        if name.lower() == b"retry-after":
            return retry_after_seconds(value)
    return 0.0


def _route_template(scope: Scope, known_paths: frozenset[str]) -> str:
    """The matched route's path template, so label values stay bounded; an answer given before routing
    (e.g. a 413 on Content-Length) is labelled with its path when that is a known route."""
    path = getattr(scope.get("route"), "path", None)
    if isinstance(path, str):
        return path
    return str(scope.get("path")) if scope.get("path") in known_paths else "unmatched"
