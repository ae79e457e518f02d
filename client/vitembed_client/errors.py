"""Typed exceptions: every error answer becomes one, carrying the server's ``code`` and ``request_id``.

Classes follow the HTTP status (``NotFoundError`` for 404, ``RateLimitError`` for 429, ...); image errors
also derive from ``InvalidImageError`` whatever their status. ``ERROR_CODES`` maps each code of the
server's registry (``vitembed.server.errors.ERROR_CODES``) to its class: a new server code is one line
here. Ray Serve's proxy answers some errors itself in plain text; they get the ``serve_*`` codes below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx


class VitembedError(Exception):
    """Base class of everything this client raises."""


class TransportError(VitembedError):
    """The server could not be reached, or the connection broke before an answer (no status)."""


class ConnectError(TransportError):
    """The connection could not be opened, so nothing was sent: always safe to retry."""


class ResponseFormatError(VitembedError):
    """A success answer that is not what the API promises (wrong media type, unreadable ``.npy``)."""


class APIError(VitembedError):
    """The server answered with an error status. ``status`` of the class is the HTTP status it stands for
    (None: any); the instance's is the one received."""

    status: int | None = None
    retryable = False

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: str,
        request_id: str | None = None,
        index: int | None = None,
        retry_after: float | None = None,
        headers: Mapping[str, str] | None = None,
        attempts: int = 1,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.request_id = request_id
        self.index = index  # the image the error is about, when it is about one
        self.retry_after = retry_after  # seconds, from Retry-After
        self.headers = dict(headers or {})
        self.attempts = attempts  # requests sent, retries included

    def __str__(self) -> str:
        where = f" (image {self.index})" if self.index is not None else ""
        rid = f" [request_id={self.request_id}]" if self.request_id else ""
        return f"{self.status} {self.code}: {self.message}{where}{rid}"


class BadRequestError(APIError):
    status = 400


class AuthenticationError(APIError):
    status = 401


class PermissionDeniedError(APIError):
    status = 403


class NotFoundError(APIError):
    status = 404


class MethodNotAllowedError(APIError):
    status = 405


class RequestTimeoutError(APIError):
    status = 408


class ConflictError(APIError):
    status = 409


class PayloadTooLargeError(APIError):
    status = 413


class UnsupportedMediaTypeError(APIError):
    status = 415


class UnprocessableEntityError(APIError):
    """Options that cannot be honoured, or a well-formed request over a limit."""

    status = 422


class RateLimitError(APIError):
    """The server (or Ray Serve) is at capacity; retried by the client, honouring ``retry_after``."""

    status = 429
    retryable = True


class ClientClosedRequestError(APIError):
    status = 499


class InternalServerError(APIError):
    status = 500


class ServiceUnavailableError(APIError):
    """Not ready, a stopped replica, or Serve shedding load; retried by the client."""

    status = 503
    retryable = True


class GatewayTimeoutError(APIError):
    status = 504


class InvalidImageError(APIError):
    """Image bytes the server refused; ``index`` says which image."""


class MalformedImageError(BadRequestError, InvalidImageError):
    pass


class ImageTooLargeError(PayloadTooLargeError, InvalidImageError):
    pass


class UnsupportedImageFormatError(UnsupportedMediaTypeError, InvalidImageError):
    pass


class ImageLimitError(UnprocessableEntityError, InvalidImageError):
    pass


# code -> class, one line per code of the server's registry (and Ray Serve's own answers)
ERROR_CODES: Mapping[str, type[APIError]] = {
    "bad_request": BadRequestError,
    "empty_body": BadRequestError,
    "invalid_json": BadRequestError,
    "invalid_multipart": BadRequestError,
    "invalid_base64": BadRequestError,
    "invalid_data_uri": BadRequestError,
    "no_images": BadRequestError,
    "http_error": APIError,  # any other 4xx of the framework: the class follows the status received
    "empty": MalformedImageError,
    "not_an_image": MalformedImageError,
    "truncated": MalformedImageError,
    "zero_size": MalformedImageError,
    "invalid_image": MalformedImageError,
    "too_large": ImageTooLargeError,
    "unsupported_format": UnsupportedImageFormatError,
    "too_many_pixels": ImageLimitError,
    "aspect_ratio": ImageLimitError,
    "unauthorized": AuthenticationError,
    "forbidden": PermissionDeniedError,
    "not_found": NotFoundError,
    "model_not_found": NotFoundError,
    "head_not_found": NotFoundError,
    "index_not_found": NotFoundError,
    "item_not_found": NotFoundError,
    "method_not_allowed": MethodNotAllowedError,
    "body_timeout": RequestTimeoutError,
    "header_timeout": RequestTimeoutError,
    "index_changed": ConflictError,
    "body_too_large": PayloadTooLargeError,
    "too_many_images": PayloadTooLargeError,
    "unsupported_media_type": UnsupportedMediaTypeError,
    "invalid_request": UnprocessableEntityError,
    "invalid_option": UnprocessableEntityError,
    "invalid_size": UnprocessableEntityError,
    "dimensions_unsupported": UnprocessableEntityError,
    "modality_unsupported": UnprocessableEntityError,
    "dtype_overflow": UnprocessableEntityError,
    "heads_need_json": UnprocessableEntityError,
    "head_required": UnprocessableEntityError,
    "head_model_mismatch": UnprocessableEntityError,
    "head_options_mismatch": UnprocessableEntityError,
    "upsample_too_large": UnprocessableEntityError,
    "mixed_sizes": UnprocessableEntityError,
    "index_required": UnprocessableEntityError,
    "options_mismatch": UnprocessableEntityError,
    "model_mismatch": UnprocessableEntityError,
    "invalid_filter": UnprocessableEntityError,
    "invalid_vector": UnprocessableEntityError,
    "invalid_timeout": UnprocessableEntityError,
    "queue_full": RateLimitError,
    "overloaded": RateLimitError,
    "deadline_too_short": RateLimitError,
    "quota_exceeded": RateLimitError,
    "client_closed_request": ClientClosedRequestError,
    "internal": InternalServerError,
    "non_finite": InternalServerError,
    "not_ready": ServiceUnavailableError,
    "index_dropped": ServiceUnavailableError,
    "replica_unavailable": ServiceUnavailableError,
    "server_busy": ServiceUnavailableError,
    "deadline_exceeded": GatewayTimeoutError,
    # Ray Serve's proxy, plain-text bodies (see SERVE_BODIES)
    "serve_backpressure": APIError,  # 503 by default, 429 with backpressure_config.status_code: 429
    "serve_unavailable": ServiceUnavailableError,
    "serve_timeout": RequestTimeoutError,
}

# Ray Serve's own plain-text error bodies: (status, how the text begins or what it holds) -> code
SERVE_BODIES: tuple[tuple[int | None, str, str], ...] = (
    (None, "Request dropped due to backpressure", "serve_backpressure"),
    (503, "is unavailable because it failed to deploy", "serve_unavailable"),
    (408, "timed out", "serve_timeout"),
)

STATUS_CLASSES: Mapping[int, type[APIError]] = {
    cls.status: cls
    for cls in (
        BadRequestError,
        AuthenticationError,
        PermissionDeniedError,
        NotFoundError,
        MethodNotAllowedError,
        RequestTimeoutError,
        ConflictError,
        PayloadTooLargeError,
        UnsupportedMediaTypeError,
        UnprocessableEntityError,
        RateLimitError,
        ClientClosedRequestError,
        InternalServerError,
        ServiceUnavailableError,
        GatewayTimeoutError,
    )
    if cls.status is not None
}

RETRYABLE_STATUSES = frozenset({429, 503})


def error_class(code: str, status: int) -> type[APIError]:
    """The class for ``code``; a code this client does not know, or a status-neutral one, gets the class of
    its status (``APIError`` when the status has none)."""
    cls = ERROR_CODES.get(code)
    if cls is not None and cls.status in (None, status):
        if cls.status is None:
            return STATUS_CLASSES.get(status, APIError)
        return cls
    return STATUS_CLASSES.get(status, APIError)


def retry_after_seconds(value: str | None) -> float | None:
    """``Retry-After`` as seconds (the delay form; an HTTP date is ignored)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def _serve_code(status: int, text: str) -> str | None:
    for wanted, marker, code in SERVE_BODIES:
        if (wanted is None or wanted == status) and marker in text:
            return code
    return None


def from_response(response: httpx.Response, *, attempts: int = 1) -> APIError:
    """The typed exception for an error answer: the service's JSON error body, Ray Serve's plain text, or
    anything else (code ``http_<status>``)."""
    status = response.status_code
    headers = {k.lower(): v for k, v in response.headers.items()}
    request_id = headers.get("x-request-id")
    index: int | None = None
    body: Any = None
    if "json" in headers.get("content-type", ""):
        try:
            body = response.json()
        except ValueError:
            body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        code = error["code"]
        message = str(error.get("message", ""))
        request_id = str(error.get("request_id") or request_id or "") or None
        index = error["index"] if isinstance(error.get("index"), int) else None
    else:
        text = response.text.strip()[:500]
        code = _serve_code(status, text) or f"http_{status}"
        message = text or response.reason_phrase or "error"
    cls = error_class(code, status)
    return cls(
        message,
        status=status,
        code=code,
        request_id=request_id,
        index=index,
        retry_after=retry_after_seconds(headers.get("retry-after")),
        headers=headers,
        attempts=attempts,
    )
