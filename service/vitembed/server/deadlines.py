"""A request's deadline: the server's ``request_timeout_s``, or the client's shorter one.

A client may send ``X-Request-Timeout: SECONDS`` (a positive decimal number); the deadline is then the
shorter of that and the server's timeout, counted from when the request arrived. Admission uses it (a
request that cannot be served in time is refused at once with 429), queued work past it is dropped
before decoding or forwarding, and an answer not ready by then is a 504.
"""

from __future__ import annotations

import math
import time

from starlette.requests import Request

from vitembed.server.errors import ApiError
from vitembed.settings import ServiceSettings

TIMEOUT_HEADER = "X-Request-Timeout"
_BUDGET_KEY = "vitembed.budget_s"  # where the request's allowance lives in the ASGI scope
_MAX_HEADER_CHARS = 32


def parse_timeout(raw: str) -> float:
    """Seconds from the header's text; anything but a positive finite number is a 422."""
    text = raw.strip()
    try:
        value = float(text) if len(text) <= _MAX_HEADER_CHARS else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ApiError(
            422,
            "invalid_timeout",
            f"{TIMEOUT_HEADER} must be a positive number of seconds, e.g. 2.5",
        )
    return value


def request_deadline(request: Request, settings: ServiceSettings) -> float:
    """The monotonic deadline of this request (and its allowance, kept for messages: ``budget_s``)."""
    budget = settings.request_timeout_s
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is not None:
        budget = min(budget, parse_timeout(raw))
    request.scope[_BUDGET_KEY] = budget
    return time.monotonic() + budget


def budget_s(request: Request) -> float:
    """The request's allowance in seconds (the server's timeout unless the client sent a shorter one)."""
    budget = request.scope.get(_BUDGET_KEY)
    if isinstance(budget, float | int):
        return float(budget)
    settings: ServiceSettings = request.app.state.settings
    return settings.request_timeout_s
