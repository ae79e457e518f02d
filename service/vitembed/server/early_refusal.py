"""The 429 that costs almost nothing: admission checked on the request head, in the connection protocol.

Under overload, clients that ignore ``Retry-After`` send requests as fast as they are refused, so the
price of a refusal decides how much CPU is left for the model. Refusing in the app costs the whole ASGI
stack (middleware, routing, dependencies) per request, on the event loop that shares the GIL with the
forward thread. ``AdmissionGate`` answers on the request head instead, before an ASGI task exists: when
not even one image of the addressed model could be admitted now (``Engine.refuse_early``), the protocol
writes the same 429 the app would (error body, ``Retry-After``, ``X-Request-ID``) and discards the body.

Only the embedding routes are gated, only when the model is known from the head (the query's ``model`` or
the only one served), and never for a request the app would refuse first (no or wrong API key, invalid
``X-Request-Timeout``, a declared body over the limit): those go to the app, which answers them exactly as
before. A request let through holds a place while its body is read (a lease, ``Engine.lease_on_head``),
handed to the request in its scope (``LEASE_SCOPE_KEY``): the app's own early check takes it over instead
of checking again, its admission trades it, and the protocol calls ``request_done`` when the request ends,
which gives back a place never traded (a 413, a 422, a lost connection). Without the lease, a storm of
heads arriving before any request task had run all passed the gate (the queue still looked empty) and was
refused one by one by the app, after the whole ASGI stack, at ~2 ms of the event loop each.

A caller with quotas (``quotas.py``) that could not send even one image now gets the app's 429
``quota_exceeded`` here, checked in the app's order: the caller's quota before the server's admission.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs

from vitembed.callers import Caller
from vitembed.engine.admission import QueueFullError
from vitembed.engine.engine import Engine
from vitembed.metrics import Metrics
from vitembed.server.deadlines import TIMEOUT_HEADER
from vitembed.server.errors import ADMISSION_CODES, admission_message, error_body, sanitise_request_id
from vitembed.server.quotas import QuotaBook, QuotaExceededError
from vitembed.settings import ServiceSettings

GATED_PATHS = ("/v1/embed", "/v1/embeddings")
_TIMEOUT = TIMEOUT_HEADER.lower().encode()
# the request's scope: (model, lease id) of the place the gate holds for it (plumbing.refuse_early)
LEASE_SCOPE_KEY = "vitembed.head_lease"


class AdmissionGate:
    def __init__(self, settings: ServiceSettings, metrics: Metrics, quotas: QuotaBook | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.quotas = quotas
        self.engine: Engine | None = None  # set by the app's lifespan once the models are ready

    def __call__(
        self, path: str, query: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> bytes | dict[str, Any] | None:
        """The whole HTTP response refusing this request; or, to let the app handle it, None or entries for
        the request's scope (the place it holds)."""
        engine = self.engine
        if path not in GATED_PATHS or engine is None or not engine.ready:
            return None
        fields = dict(headers)
        authorised, caller = self._caller(fields.get(b"authorization"))
        if not authorised:
            return None
        budget = self.settings.request_timeout_s
        raw_timeout = fields.get(_TIMEOUT)
        if raw_timeout is not None:
            try:
                budget = min(budget, float(raw_timeout))
            except ValueError:
                return None
            if not math.isfinite(budget) or budget <= 0:
                return None
        if _declared_length(fields.get(b"content-length")) > self.settings.max_body_bytes:
            return None  # the app answers 413
        model = self._model(path, query)
        if model is None or model not in engine.model_names:
            return None
        if caller is not None and caller.limited and self.quotas is not None:
            try:
                self.quotas.check(caller, 1)
            except QuotaExceededError as over:
                self.metrics.requests.labels(path, "429").inc()
                return over.raw_response(_request_id(fields.get(b"x-request-id")))
        try:
            lease = engine.lease_on_head(model, time.monotonic() + budget)
        except QueueFullError as refused:
            self.metrics.requests.labels(path, "429").inc()
            return _response(refused, fields.get(b"x-request-id"))
        return None if lease is None else {LEASE_SCOPE_KEY: (model, lease)}

    def request_done(self, scope: dict[str, Any]) -> None:
        """The request's answer is sent or its connection lost: a place it never traded is free again."""
        held = scope.get(LEASE_SCOPE_KEY)
        if held is not None and self.engine is not None:
            self.engine.drop_lease(*held)

    def _caller(self, header: bytes | None) -> tuple[bool, Caller | None]:
        """(authorised, the caller): (True, None) when the server has no keys."""
        keys = self.settings.callers
        if not keys.keyed:
            return True, None
        scheme, _, token = (header or b"").partition(b" ")
        token = token.strip()
        caller = keys.identify(token) if scheme.lower() == b"bearer" and token else None
        return caller is not None, caller

    def _model(self, path: str, query: bytes) -> str | None:
        named = parse_qs(query.decode("latin-1")).get("model") if path == "/v1/embed" and query else None
        if named:
            return named[-1]  # as the app reads a repeated parameter
        return next(iter(self.settings.models)) if len(self.settings.models) == 1 else None


def _response(refused: QueueFullError, incoming_id: bytes | None) -> bytes:
    seconds = max(1, math.ceil(refused.retry_after_s))
    rid = _request_id(incoming_id)
    code = ADMISSION_CODES.get(refused.reason, "queue_full")
    body = json.dumps(
        error_body(code, admission_message(refused, seconds), rid), separators=(",", ":")
    ).encode()
    head = (
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: {seconds}\r\nx-request-id: {rid}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def _declared_length(value: bytes | None) -> int:
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0  # the server answers a malformed length itself


def _request_id(incoming_id: bytes | None) -> str:
    return sanitise_request_id(incoming_id.decode("latin-1") if incoming_id else None)
