"""Connection and request limits, so that idle, slow or too many connections cannot starve the workers.

- ``ConcurrencyLimitMiddleware``: at most ``max_concurrent_requests`` requests in flight (bodies being
  read, work queued or running); one more is answered at once with 503 ``server_busy`` and
  ``Retry-After: 1``. The operations routes (health, readiness, metrics) are never refused.
- ``BodyTimeoutMiddleware``: a request body must arrive whole within ``body_timeout_s`` of the request's
  start; a body trickling in past that is answered 408 ``body_timeout`` and the connection is closed.
  Waiting is asynchronous, so a slow upload never blocks other requests.
- ``BodyLimitMiddleware``: a body over ``max_body_bytes`` is answered 413 ``body_too_large``: a declared
  ``Content-Length`` before a byte is read, a chunked body as the counting ``receive`` passes the limit.

The connection's own limits (the request head's deadline, the Retry-After hold, refusals on the request
head, the graceful drain) live in its protocol: ``connection_protocol.header_timeout_protocol``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vitembed.metrics import Metrics
from vitembed.server.errors import (
    ApiError,
    error_response,
)

log = logging.getLogger("vitembed.service")

EXEMPT_PATHS = frozenset({"/health", "/ready", "/metrics"})


class ConcurrencyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_requests: int, metrics: Metrics) -> None:
        self.app = app
        self.max_requests = max_requests
        self.metrics = metrics
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_requests:
            self.metrics.rejected.labels("concurrency", "connection").inc()
            response = error_response(
                scope,
                503,
                "server_busy",
                f"the server is handling its limit of {self.max_requests} requests; retry in 1 s",
                headers={"Retry-After": "1"},
            )
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class BodyTimeoutMiddleware:
    def __init__(self, app: ASGIApp, *, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.timeout_s
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:  # afterwards, receive only reports a disconnect: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ApiError(
                    408,
                    "body_timeout",
                    f"the request body did not arrive within {self.timeout_s:g} s",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, send)


class BodyLimitMiddleware:
    """Refuse bodies over ``max_body_bytes`` before the framework reads them: a declared Content-Length
    is judged before a byte is read, and a counting ``receive`` stops chunked bodies as they pass it."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> ApiError:
        return ApiError(
            413, "body_too_large", f"the request body is over the limit of {self.max_body_bytes} bytes"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            error = self._too_large()
            await error_response(scope, error.status, error.code, error.message)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()  # answered by the ApiError handler
            return message

        await self.app(scope, counting_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed length; the counting receive still applies
    return None
