"""The 429 that costs almost nothing: admission checked on the request head, in the connection protocol.

Under overload, clients that ignore ``Retry-After`` send requests as fast as they are refused, so the
price of a refusal decides how much CPU is left for the model. Refusing in the app costs the whole ASGI
stack (middleware, routing, dependencies) per request, on the event loop that shares the GIL with the
forward thread. ``AdmissionGate`` answers on the request head instead, before an ASGI task exists: when
not even one image of the addressed model could be admitted now (``Engine.refuse_early``), the protocol
writes the same 429 the app would (error body, ``Retry-After``, ``X-Request-ID``) and discards the body.

Only the embedding routes are gated, only when the model is known from the head (the query's ``model`` or
the only one served), and never for a request the app would refuse first (no or wrong API key, invalid
``X-Request-Timeout``): those go to the app, which answers them exactly as before.
"""

from __future__ import annotations

import hmac
import json
import math
import time
from collections.abc import Sequence
from urllib.parse import parse_qs

from vitembed.engine.admission import QueueFullError
from vitembed.engine.engine import Engine
from vitembed.metrics import Metrics
from vitembed.server.deadlines import TIMEOUT_HEADER
from vitembed.server.errors import ADMISSION_CODES, admission_message, error_body, sanitise_request_id
from vitembed.settings import ServiceSettings

GATED_PATHS = ("/v1/embed", "/v1/embeddings")
_TIMEOUT = TIMEOUT_HEADER.lower().encode()


class AdmissionGate:
    def __init__(self, settings: ServiceSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.engine: Engine | None = None  # set by the app's lifespan once the models are ready

    def __call__(self, path: str, query: bytes, headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
        """The whole HTTP response refusing this request, or None to let the app handle it."""
        engine = self.engine
        if path not in GATED_PATHS or engine is None or not engine.ready:
            return None
        fields = dict(headers)
        if not self._authorised(fields.get(b"authorization")):
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
        model = self._model(path, query)
        if model is None or model not in engine.model_names:
            return None
        try:
            engine.refuse_early(model, time.monotonic() + budget)
        except QueueFullError as refused:
            self.metrics.requests.labels(path, "429").inc()
            return _response(refused, fields.get(b"x-request-id"))
        return None

    def _authorised(self, header: bytes | None) -> bool:
        key = self.settings.api_key
        if key is None:
            return True
        scheme, _, token = (header or b"").partition(b" ")
        return (
            scheme.lower() == b"bearer" and bool(token) and hmac.compare_digest(token.strip(), key.encode())
        )

    def _model(self, path: str, query: bytes) -> str | None:
        named = parse_qs(query.decode("latin-1")).get("model") if path == "/v1/embed" and query else None
        if named:
            return named[0]
        return next(iter(self.settings.models)) if len(self.settings.models) == 1 else None


def _response(refused: QueueFullError, incoming_id: bytes | None) -> bytes:
    seconds = max(1, math.ceil(refused.retry_after_s))
    rid = sanitise_request_id(incoming_id.decode("latin-1") if incoming_id else None)
    code = ADMISSION_CODES.get(refused.reason, "queue_full")
    body = json.dumps(
        error_body(code, admission_message(refused, seconds), rid), separators=(",", ":")
    ).encode()
    head = (
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: {seconds}\r\nx-request-id: {rid}\r\n\r\n"
    )
    return head.encode("latin-1") + body
