"""The admission gate on the request head (``early_refusal.AdmissionGate``): with a real engine whose
queue is full, it writes the app's own 429 (code, message, Retry-After, request id); every request the app
must judge first (another route, no or wrong key, a bad ``X-Request-Timeout``, another model) goes on. A
request it lets through holds a place (a lease) that the gate hands to it in its scope."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vitembed.engine.engine import EmbedOptions, Engine, RequestTicket
from vitembed.metrics import Metrics
from vitembed.server.early_refusal import LEASE_SCOPE_KEY, AdmissionGate
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


def jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


async def checked_again(engine: Engine, lease: int) -> None:
    engine.refuse_early("tiny", time.monotonic() + 30, lease=True, held=lease)


def test_heads_let_through_hold_their_places_until_their_requests_take_them_over(tiny_path: Path) -> None:
    """Three places (``queue_size``): three heads pass, each leasing one that the gate hands to its request
    (scope entries), so the fourth is refused on its head before any request task has run (a storm of heads
    used to pass the gate all together, to be refused one by one by the app). A request's own early check
    takes its place over (no second one), its admission trades it, and a request that ends without
    admission (a 413, a 422, a lost connection) gives it back at once."""
    settings = ServiceSettings(
        models={"tiny": str(tiny_path)}, precision="float32", queue_size=3, max_images_per_request=1
    )
    engine = Engine(settings, Metrics())
    engine.start()
    load = engine.load("tiny")
    try:
        gate = gate_for(engine)
        answers = [gate("/v1/embed", b"", []) for _ in range(4)]
        assert isinstance(answers[3], bytes) and b'"code":"queue_full"' in answers[3]
        held = [answer[LEASE_SCOPE_KEY] for answer in answers[:3] if isinstance(answer, dict)]
        assert len(held) == 3 and {model for model, _ in held} == {"tiny"}
        assert sorted(load._leases) == sorted(lease for _, lease in held)
        # a body over the limit: the app answers 413 first, so the gate neither refuses nor leases
        too_big = [(b"content-length", str(settings.max_body_bytes + 1).encode())]
        assert gate("/v1/embed", b"", too_big) is None and len(load._leases) == 3

        async def request(lease: int) -> int:
            end = time.monotonic() + 30
            engine.refuse_early("tiny", end, lease=True, held=lease)  # the app's check: takes it over
            taken_over = len(load._leases)
            await engine.embed(
                "tiny", [jpeg(0)], EmbedOptions(), ticket=RequestTicket(end, 30.0), deadline=end
            )
            return taken_over

        assert asyncio.run(request(held[0][1])) == 3  # no second place while its body was read
        assert held[0][1] not in load._leases and load._control.held == 0  # traded, then served
        gate.request_done({LEASE_SCOPE_KEY: held[0]})  # already traded: nothing to give back
        gate.request_done({LEASE_SCOPE_KEY: held[1]})  # ended without admission
        assert held[1][1] not in load._leases
        before = len(load._leases)  # a place given back is not taken over: the request is checked again
        asyncio.run(checked_again(engine, held[1][1]))
        assert len(load._leases) == before + 1
    finally:
        load._leases.clear()
        engine.stop()
