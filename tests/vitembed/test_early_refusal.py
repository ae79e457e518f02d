"""The admission gate on the request head (``early_refusal.AdmissionGate``): with a real engine whose
queue is full, it writes the app's own 429 (code, message, Retry-After, request id); every request the app
must judge first (another route, no or wrong key, a bad ``X-Request-Timeout``, another model) goes on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from vitembed.engine.engine import Engine
from vitembed.metrics import Metrics
from vitembed.server.early_refusal import AdmissionGate
from vitembed.settings import ServiceSettings

TOKENS = 17  # the tiny DINOv2 at its defaults


@pytest.fixture(scope="module")
def full_engine(tiny_path: Path) -> Iterator[Engine]:
    """A started engine whose only model has one image reserved in a queue of one."""
    settings = ServiceSettings(
        models={"tiny": str(tiny_path)},
        precision="float32",
        queue_size=1,
        max_images_per_request=1,
        api_key="k3y",
    )
    engine = Engine(settings, Metrics())
    engine.start()
    reservation = engine.load("tiny").admit(1, TOKENS, 30.0)
    yield engine
    reservation.release()
    engine.stop()


def gate_for(engine: Engine) -> AdmissionGate:
    gate = AdmissionGate(engine.settings, engine.metrics)
    gate.engine = engine
    return gate


AUTH = (b"authorization", b"Bearer k3y")


def test_a_refusal_is_the_apps_429_written_on_the_head(full_engine: Engine) -> None:
    answer = gate_for(full_engine)("/v1/embed", b"model=tiny", [AUTH, (b"x-request-id", b"abc-1")])
    assert answer is not None
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 429 Too Many Requests"
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert headers["retry-after"] == "1" and headers["x-request-id"] == "abc-1"
    assert headers["content-type"] == "application/json" and int(headers["content-length"]) == len(body)
    assert json.loads(body) == {
        "error": {
            "code": "queue_full",
            "message": "the server is at capacity; retry in 1 s",
            "request_id": "abc-1",
        }
    }
    assert gate_for(full_engine)("/v1/embeddings", b"", [AUTH]) is not None


@pytest.mark.parametrize(
    ("path", "query", "headers"),
    [
        ("/v1/classify", b"", [AUTH]),  # not a gated route
        ("/v1/embed", b"", []),  # no key: the app answers 401
        ("/v1/embed", b"", [(b"authorization", b"Bearer nope")]),
        ("/v1/embed", b"", [AUTH, (b"x-request-timeout", b"soon")]),  # the app answers 422
        ("/v1/embed", b"", [AUTH, (b"x-request-timeout", b"-1")]),
        ("/v1/embed", b"model=other", [AUTH]),  # the app answers 404
    ],
)
def test_requests_the_app_judges_first_pass_the_gate(
    full_engine: Engine, path: str, query: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    assert gate_for(full_engine)(path, query, headers) is None
