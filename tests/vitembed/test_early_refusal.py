"""The admission gate on the request head (``early_refusal.AdmissionGate``): with a real engine whose
queue is full, it writes the app's own 429 (code, message, Retry-After, request id); every request the app
must judge first (another route, no or wrong key, a bad ``X-Request-Timeout``, another model) goes on. A
request it lets through holds a place (a lease) in the context its task inherits."""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vitembed.engine.admission import QueueFullError
from vitembed.engine.engine import EmbedOptions, Engine, RequestTicket
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


def jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def test_heads_let_through_hold_their_places_in_the_context_their_tasks_inherit(tiny_path: Path) -> None:
    """Three places (``queue_size``): three heads pass, each leasing one in its own context (the protocol
    creates the request's task in it), so the fourth is refused on its head, before any task has run (a
    storm of heads used to pass the gate all together, to be refused one by one by the app). The task's
    own early check neither checks again nor takes a second place, and its admission trades the lease."""
    settings = ServiceSettings(
        models={"tiny": str(tiny_path)}, precision="float32", queue_size=3, max_images_per_request=1
    )
    engine = Engine(settings, Metrics())
    engine.start()
    try:
        load = engine.load("tiny")
        gate = gate_for(engine)
        contexts = [contextvars.copy_context() for _ in range(4)]
        answers = [context.run(gate, "/v1/embed", b"", []) for context in contexts]
        assert answers[:3] == [None, None, None]
        assert answers[3] is not None and b'"code":"queue_full"' in answers[3]
        assert len(load._leases) == 3
        deadline = time.monotonic() + 30
        contexts[0].run(engine.refuse_early, "tiny", deadline, lease=True)  # the task's own check
        assert len(load._leases) == 3
        with pytest.raises(QueueFullError):  # a request the gate did not see is checked, and refused
            contextvars.copy_context().run(engine.refuse_early, "tiny", deadline, lease=True)

        async def admitted() -> int:
            end = time.monotonic() + 30
            ticket = RequestTicket(end, 30.0)
            await engine.embed("tiny", [jpeg(0)], EmbedOptions(), ticket=ticket, deadline=end)
            return len(load._leases)

        assert contexts[0].run(asyncio.run, admitted()) == 2  # its lease traded, the other two kept
        assert load._control.held == 0  # and its reservation released once served
    finally:
        load._leases.clear()
        engine.stop()
