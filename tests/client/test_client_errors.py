"""The client maps every code of the server's registry (``vitembed.server.errors.ERROR_CODES``) to a typed
exception of the code's status: a code added to the server without its client line fails here. Ray Serve's
own plain-text answers (made by Ray's own classes, when Ray Serve is installed) map to their codes."""

from __future__ import annotations

import json

import httpx
import pytest
from vitembed.server.errors import ERROR_CODES as SERVER_CODES
from vitembed.server.errors import error_body
from vitembed_client import ERROR_CODES as CLIENT_CODES
from vitembed_client import (
    APIError,
    InvalidImageError,
    RateLimitError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from vitembed_client.errors import STATUS_CLASSES, error_class, from_response


def _answer(status: int, body: bytes, content_type: str, **headers: str) -> httpx.Response:
    return httpx.Response(status, content=body, headers={"content-type": content_type, **headers})


@pytest.mark.parametrize("code", sorted(SERVER_CODES))
def test_every_server_code_becomes_a_typed_exception_of_its_status(code: str) -> None:
    status = SERVER_CODES[code]
    assert code in CLIENT_CODES, f"the server's code {code!r} ({status}) is not mapped in vitembed_client"
    body = json.dumps(error_body(code, "what happened", "rid-1", index=2)).encode()
    error = from_response(_answer(status, body, "application/json", **{"x-request-id": "rid-1"}))
    assert type(error) is error_class(code, status)
    assert isinstance(error, STATUS_CLASSES.get(status, APIError))
    assert (error.status, error.code, error.message, error.request_id, error.index) == (
        status,
        code,
        "what happened",
        "rid-1",
        2,
    )
    assert error.retryable == (status in (429, 503))


def test_image_codes_are_invalid_image_errors_whatever_their_status() -> None:
    for code in ("empty", "not_an_image", "truncated", "zero_size", "too_large", "unsupported_format"):
        assert issubclass(CLIENT_CODES[code], InvalidImageError)
    assert issubclass(CLIENT_CODES["too_many_pixels"], InvalidImageError)


def test_an_unknown_code_gets_the_class_of_its_status() -> None:
    body = json.dumps(error_body("brand_new_code", "new", "rid")).encode()
    error = from_response(_answer(429, body, "application/json", **{"retry-after": "3"}))
    assert type(error) is RateLimitError and error.code == "brand_new_code" and error.retry_after == 3.0


def test_ray_serve_plain_text_answers_map_to_serve_codes() -> None:
    serve = pytest.importorskip(
        "ray.serve", reason="ray[serve] is not installed: pip install 'vitembed[ray]'"
    )
    from ray.serve._private.http_util import get_http_response_status
    from ray.serve.exceptions import BackPressureError

    del serve
    refused = BackPressureError(
        num_queued_requests=8, max_queued_requests=8, status_code=429, retry_after_s=1
    )
    shed = BackPressureError(num_queued_requests=8, max_queued_requests=8)
    timed_out = get_http_response_status(TimeoutError(), 30.0, "rid-9")
    cases = [
        (429, refused.message, RateLimitError, "serve_backpressure"),
        (503, shed.message, ServiceUnavailableError, "serve_backpressure"),
        (408, str(timed_out.message), RequestTimeoutError, "serve_timeout"),
        (
            503,
            "app_default#Vitembed is unavailable because it failed to deploy.",
            ServiceUnavailableError,
            "serve_unavailable",
        ),
    ]
    for status, text, cls, code in cases:
        error = from_response(
            _answer(status, text.encode(), "text/plain; charset=utf-8", **{"x-request-id": "s1"})
        )
        assert (type(error), error.code, error.message, error.request_id) == (cls, code, text, "s1")
    unknown = from_response(_answer(502, b"Bad Gateway", "text/plain"))
    assert (type(unknown), unknown.code) == (APIError, "http_502")
