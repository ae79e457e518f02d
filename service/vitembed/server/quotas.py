"""Per-caller quotas (``vitembed.callers``): images in flight and images per second, decided before decoding.

The rule (``decide_quota``) is a pure function of numbers, tested on an injected clock. The state
(``QuotaBook``) keeps, per caller, the images admitted and not yet answered and a token bucket; a caller's
refusals change nothing, and one caller's state never enters another's decision, so a caller at its quota
takes nothing from anyone else (the server-wide admission of ``engine/admission.py`` still applies to all).

- ``max_images_in_flight``: a request of n images is admitted while the caller's images in flight plus n
  stay within the limit (``Retry-After: 1``: images in flight are answered within the queue-delay target).
  A request of more images than the limit can never fit: 413 ``too_many_images``.
- ``images_per_second`` with ``burst``: a token bucket of ``burst`` images refilled at that rate; a request
  of n images needs n tokens, or a full bucket when n is over the burst (the bucket then goes into debt,
  so the average rate holds and a large request still passes); ``Retry-After`` is when the tokens are there.

Refused: 429 ``quota_exceeded``, the limit named in the body (``error.limit``) and the message, with
``Retry-After``; the same answer on the request head (``early_refusal.py``) and in the app, checked for one
image before the body is read, and for the request's count once parsed. Images are held from admission
until the answer is sent (``QuotaMiddleware``); a request the server then refuses itself (429 at
admission, 503) gets its tokens back.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vitembed.callers import Caller
from vitembed.metrics import Metrics
from vitembed.server.errors import REQUEST_ID_HEADER, ApiError, error_body, request_id

IN_FLIGHT = "max_images_in_flight"
RATE = "images_per_second"
QUOTA_CODE = "quota_exceeded"
IN_FLIGHT_RETRY_S = 1.0
REFUNDED_STATUSES = (429, 503)  # the server refused the work itself: the caller's tokens come back
_CALLER_KEY = "vitembed.caller"  # the identified caller, in the ASGI scope
_HOLD_KEY = "vitembed.quota_hold"


@dataclass(frozen=True)
class QuotaDecision:
    admitted: bool
    limit: str | None = None  # IN_FLIGHT or RATE when refused
    retry_after_s: float = 0.0


def decide_quota(
    *,
    images: int,
    in_flight: int,
    max_in_flight: int | None,
    tokens: float,
    rate: float | None,
    burst: float | None,
) -> QuotaDecision:
    """Admit ``images`` for a caller with ``in_flight`` images held and ``tokens`` in its bucket (refilled
    up to now), or refuse with the binding limit and when to retry (the later of the two when both bind)."""
    refusals: list[QuotaDecision] = []
    if max_in_flight is not None and in_flight + images > max_in_flight:
        refusals.append(QuotaDecision(False, IN_FLIGHT, IN_FLIGHT_RETRY_S))
    if rate is not None and burst is not None:
        need = min(float(images), burst)
        if tokens < need:
            refusals.append(QuotaDecision(False, RATE, (need - tokens) / rate))
    if refusals:
        return max(refusals, key=lambda refusal: refusal.retry_after_s)
    return QuotaDecision(True)


class QuotaExceededError(Exception):
    def __init__(self, caller: Caller, decision: QuotaDecision, in_flight: int) -> None:
        self.caller = caller
        self.limit = decision.limit or IN_FLIGHT
        self.retry_after = max(1, math.ceil(decision.retry_after_s))
        if self.limit == IN_FLIGHT:
            detail = f"{in_flight} of its {IN_FLIGHT}={caller.max_images_in_flight} images are in flight"
        else:
            detail = f"over its {RATE}={caller.images_per_second:g} (burst {caller.burst:g})"
        self.message = f"caller {caller.name!r} is over its quota: {detail}; retry in {self.retry_after} s"
        super().__init__(self.message)

    def body(self, rid: str) -> dict[str, Any]:
        body = error_body(QUOTA_CODE, self.message, rid)
        body["error"]["limit"] = self.limit
        return body

    def headers(self, rid: str) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after), REQUEST_ID_HEADER: rid}

    def raw_response(self, rid: str) -> bytes:
        """The whole HTTP/1.1 answer, for the request-head gate: the app's status, body and headers."""
        data = json.dumps(self.body(rid), separators=(",", ":")).encode()
        head = (
            "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\nretry-after: {self.retry_after}\r\nx-request-id: {rid}\r\n\r\n"
        )
        return head.encode("latin-1") + data


class _Account:
    def __init__(self, caller: Caller, now: float) -> None:
        self.in_flight = 0
        self.tokens = caller.burst or 0.0
        self.updated = now

    def refill(self, caller: Caller, now: float) -> None:
        if caller.images_per_second is not None and caller.burst is not None:
            elapsed = max(0.0, now - self.updated)
            self.tokens = min(caller.burst, self.tokens + elapsed * caller.images_per_second)
        self.updated = now


class Hold:
    """Images a request was admitted with: released once its answer is sent."""

    def __init__(self, book: QuotaBook, caller: Caller, images: int) -> None:
        self.book = book
        self.caller = caller
        self.images = images
        self._done = False

    def release(self, *, refund: bool = False) -> None:
        if not self._done:
            self._done = True
            self.book._release(self, refund)


class QuotaBook:
    """Per-caller images in flight and token buckets; ``clock`` injectable (seconds, monotonic)."""

    def __init__(self, metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._accounts: dict[str, _Account] = {}

    def check(self, caller: Caller, images: int = 1) -> None:
        """Raise ``QuotaExceededError`` if ``images`` could not be admitted now; changes nothing."""
        self._decide(caller, images, take=False)

    def acquire(self, caller: Caller, images: int) -> Hold:
        """Admit ``images`` (held until ``Hold.release``) or raise ``QuotaExceededError`` (or 413 if they
        could never fit)."""
        limit = caller.max_images_in_flight
        if limit is not None and images > limit:
            raise ApiError(
                413,
                "too_many_images",
                f"{images} images in one request, over caller {caller.name!r}'s {IN_FLIGHT}={limit}: "
                f"send at most {limit} per request",
            )
        self._decide(caller, images, take=True)
        return Hold(self, caller, images)

    def in_flight(self, caller: Caller) -> int:
        with self._lock:
            account = self._accounts.get(caller.name)
            return 0 if account is None else account.in_flight

    def _decide(self, caller: Caller, images: int, *, take: bool) -> None:
        with self._lock:
            now = self._clock()
            account = self._accounts.get(caller.name) or self._accounts.setdefault(
                caller.name, _Account(caller, now)
            )
            account.refill(caller, now)
            decision = decide_quota(
                images=images,
                in_flight=account.in_flight,
                max_in_flight=caller.max_images_in_flight,
                tokens=account.tokens,
                rate=caller.images_per_second,
                burst=caller.burst,
            )
            if decision.admitted and take:
                account.in_flight += images
                if caller.images_per_second is not None:
                    account.tokens -= images
            in_flight = account.in_flight
        if not decision.admitted:
            if self._metrics is not None:
                self._metrics.caller_requests.labels(caller.name, decision.limit or IN_FLIGHT).inc()
            raise QuotaExceededError(caller, decision, in_flight)
        if take and self._metrics is not None:
            self._metrics.caller_requests.labels(caller.name, "admitted").inc()
            self._metrics.caller_images.labels(caller.name).inc(images)
            self._metrics.caller_in_flight.labels(caller.name).set(in_flight)

    def _release(self, hold: Hold, refund: bool) -> None:
        caller = hold.caller
        with self._lock:
            account = self._accounts[caller.name]
            account.in_flight -= hold.images
            if refund and caller.images_per_second is not None and caller.burst is not None:
                account.tokens = min(caller.burst, account.tokens + hold.images)
            in_flight = account.in_flight
        if self._metrics is not None:
            self._metrics.caller_in_flight.labels(caller.name).set(in_flight)


# ------------------------------------------------------------------------------------------- the app's side
def set_caller(scope: Scope, caller: Caller | None) -> None:
    scope[_CALLER_KEY] = caller


def request_caller(request: Request) -> Caller | None:
    caller = request.scope.get(_CALLER_KEY)
    return caller if isinstance(caller, Caller) else None


def quota_book(request: Request) -> QuotaBook | None:
    book = getattr(request.app.state, "quotas", None)
    return book if isinstance(book, QuotaBook) else None


def check_quota(request: Request) -> None:
    """Before the body is read: 429 ``quota_exceeded`` if the caller could not send even one image now."""
    caller, book = request_caller(request), quota_book(request)
    if caller is not None and book is not None and caller.limited:
        book.check(caller, 1)


def charge_images(request: Request, images: int) -> None:
    """Once the request's images are counted, before any is decoded: hold them against the caller's quota
    until the answer is sent (``QuotaMiddleware``), or refuse."""
    caller, book = request_caller(request), quota_book(request)
    if caller is None or book is None or not caller.limited or images < 1:
        return
    if isinstance(request.scope.get(_HOLD_KEY), Hold):
        return  # charged once per request
    request.scope[_HOLD_KEY] = book.acquire(caller, images)


async def quota_exceeded(request: Request, exc: Exception) -> Response:
    """The app's exception handler for ``QuotaExceededError``."""
    if not isinstance(exc, QuotaExceededError):
        raise exc
    rid = request_id(request.scope)
    return JSONResponse(exc.body(rid), status_code=429, headers=exc.headers(rid))


class QuotaMiddleware:
    """Pure ASGI: releases a request's quota hold once its answer is sent (or the request fails); a 429 or
    503 answer (refused by the server, not served) gives the caller its tokens back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            hold = scope.get(_HOLD_KEY)
            if isinstance(hold, Hold):
                hold.release(refund=status in REFUNDED_STATUSES)
