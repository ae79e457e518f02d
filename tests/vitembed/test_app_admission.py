"""Admission at the HTTP edge, in process: a refusal's code, message and ``Retry-After`` from an injected
throughput estimate, the client's shorter deadline (``X-Request-Timeout``), work past its deadline
dropped before decoding, and the admission metrics."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from promtext import sum_samples
from vitembed.engine.admission import ModelLoad
from vitembed.engine.engine import Engine
from vitembed.engine.wait_estimates import IngestEstimate, ThroughputEstimate
from vitembed.metrics import Metrics
from vitembed.server.app import create_app
from vitembed.settings import ServiceSettings

if TYPE_CHECKING:  # fixtures' types (tests/vitembed/conftest.py)
    from conftest import Images

pytestmark = pytest.mark.anyio
Err = Callable[[httpx.Response], dict[str, Any]]
TOKENS = 17  # the tiny DINOv2 at its defaults: a 4x4 grid plus the CLS token


@dataclass
class Served:
    client: httpx.AsyncClient
    engine: Engine

    async def metric(self, name: str, **labels: str) -> float:
        return sum_samples((await self.client.get("/metrics")).text, name, **labels)


@contextlib.asynccontextmanager
async def serve_engine(tiny_path: Path, **overrides: Any) -> AsyncIterator[Served]:
    """The real app around an engine this test holds (to read and inject its admission state); one forward
    thread, so that the predicted waits asserted are the one-thread rule's (``test_admission`` has the rule
    for passes side by side)."""
    options: dict[str, Any] = {
        "models": {"tiny": str(tiny_path)},
        "precision": "float32",
        "forward_workers": 1,
        **overrides,
    }
    settings = ServiceSettings(**options)
    engine = Engine(settings, Metrics())
    await asyncio.to_thread(engine.start)
    try:
        app = create_app(settings, engine=engine)
        async with (
            LifespanManager(app) as manager,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=manager.app), base_url="http://test"
            ) as client,
        ):
            yield Served(client, engine)
    finally:
        await asyncio.to_thread(engine.stop)


def tiny_load(server: Served) -> ModelLoad:
    return server.engine.load("tiny")


def inject(load: ModelLoad, per_image_s: float) -> None:
    """The forward pass's cost per image; decoding is free (its share is ``test_admission``'s)."""
    load.estimate = ThroughputEstimate()
    load.ingest = IngestEstimate()
    load.observe(TOKENS, 1, per_image_s)


class HeldDecode:
    """The first image the engine prepares waits, admitted and reserved, until ``release`` is set."""

    def __init__(self) -> None:
        self.begun = threading.Event()
        self.release = threading.Event()


@pytest.fixture
def held_decode(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldDecode]:
    held = HeldDecode()
    prepare = Engine._prepare_one

    def hold_the_first(self: Engine, *args: Any) -> Any:
        if not held.begun.is_set():
            held.begun.set()
            held.release.wait(30)
        return prepare(self, *args)

    monkeypatch.setattr(Engine, "_prepare_one", hold_the_first)
    yield held
    held.release.set()


async def test_refusals_carry_the_reason_and_a_retry_after_from_the_predicted_wait(
    tiny_path: Path, images: Images, err: Err, held_decode: HeldDecode
) -> None:
    """One admitted image is held in its decode (event-ordered, not a race with its 2 s batch timer); the
    queue ahead of the next requests is then that image, and each batch waits its 2 s timer. One image per
    pass, so no image shares a request's pass (``test_admission``: the rest of its batch)."""
    async with serve_engine(
        tiny_path, max_wait_ms=2000, queue_delay_target_s=2.0, max_batch_size=1
    ) as server:
        load = tiny_load(server)
        data = images.jpeg(60, 60, 2)
        first = asyncio.ensure_future(server.client.post("/v1/embed", files={"image": data}))
        assert await asyncio.to_thread(held_decode.begun.wait, 30)
        assert load.reserved_images == 1

        inject(load, 3.0)  # ahead 3 s + its own 3 s (charged at most half the target: 1 s) = 4 s > 2 s
        overloaded = await server.client.post("/v1/embed", files={"image": data})
        assert overloaded.status_code == 429, overloaded.text
        assert overloaded.headers["retry-after"] == "2"  # 4 s - 2 s
        assert err(overloaded) == {
            "code": "overloaded",
            "message": "the server is overloaded: the predicted wait (8.0 s) is over its queue-delay "
            "target (2 s); retry in 2 s",
        }

        inject(load, 0.25)  # within the target, but 2 s (timer) + 0.25 + 0.25 > the client's 1.25 s
        short = await server.client.post(
            "/v1/embed", files={"image": data}, headers={"X-Request-Timeout": "1.25"}
        )
        assert short.status_code == 429, short.text
        assert short.headers["retry-after"] == "2"  # 2.5 s predicted - 1.25 s allowed, rounded up
        assert err(short) == {
            "code": "deadline_too_short",
            "message": "the predicted wait (2.5 s) is longer than the request's deadline (1.25 s); "
            "retry in 2 s or allow more time",
        }
        held_decode.release.set()
        assert (await first).status_code == 200
        for reason, count in (("queue_delay", 1), ("deadline", 1)):
            assert await server.metric("vitembed_admission_total", model="tiny", outcome=reason) == count
        assert await server.metric("vitembed_admission_total", outcome="admitted") == 1
        for kind in ("predicted", "actual"):
            assert await server.metric("vitembed_admission_wait_seconds_count", model="tiny", kind=kind) == 1
        assert load.reserved_images == 0 and server.engine.admission.held == 0


async def test_work_whose_deadline_passes_before_its_decode_is_dropped_undecoded(
    tiny_path: Path, images: Images, err: Err, held_decode: HeldDecode
) -> None:
    """One decode worker, held on the first image: the second request, admitted on a 0.3 s deadline, waits
    behind it; released after that deadline (within the app's 1 s backstop), its image is dropped before
    decoding and it gets the 504."""
    async with serve_engine(tiny_path, max_wait_ms=2, decode_workers=1) as server:
        load = tiny_load(server)
        data = images.jpeg(60, 60, 3)
        first = asyncio.ensure_future(server.client.post("/v1/embed", files={"image": data}))
        assert await asyncio.to_thread(held_decode.begun.wait, 30)
        inject(load, 0.001)  # 2 ms timer, 1 ms ahead, its own 1 ms, the rest of its batch: far within 0.3 s
        decoded_before = await server.metric("vitembed_stage_seconds_count", stage="decode")
        sent = asyncio.get_running_loop().time()
        second = asyncio.ensure_future(
            server.client.post("/v1/embed", files={"image": data}, headers={"X-Request-Timeout": "0.3"})
        )
        while await server.metric("vitembed_admission_total", model="tiny", outcome="admitted") < 2:
            assert not second.done(), (await second).text  # refused instead of admitted: fail, not hang
            assert asyncio.get_running_loop().time() < sent + 10, "the second request was never admitted"
            await asyncio.sleep(0.01)
        await asyncio.sleep(max(0.0, sent + 0.6 - asyncio.get_running_loop().time()))
        held_decode.release.set()
        expired, ok = await second, await first
        assert ok.status_code == 200, ok.text
        assert expired.status_code == 504, expired.text
        assert err(expired) == {"code": "deadline_exceeded", "message": "no result within 0.3 s"}
        assert await server.metric("vitembed_rejected_total", reason="deadline") == 1
        # the first image's decode only
        assert await server.metric("vitembed_stage_seconds_count", stage="decode") == decoded_before + 1
        assert server.engine.admission.held == 0


async def test_the_client_deadline_header_is_validated_and_honoured(
    tiny_path: Path, images: Images, err: Err
) -> None:
    async with serve_engine(tiny_path, max_wait_ms=2) as server:
        data = images.jpeg(60, 60, 3)
        for bad in ("abc", "0", "-1", "nan", "inf", "1" * 40):
            response = await server.client.post(
                "/v1/embed", files={"image": data}, headers={"X-Request-Timeout": bad}
            )
            assert response.status_code == 422, (bad, response.text)
            assert err(response) == {
                "code": "invalid_timeout",
                "message": "X-Request-Timeout must be a positive number of seconds, e.g. 2.5",
            }
        decoded_before = await server.metric("vitembed_stage_seconds_count", stage="decode")
        expired = await server.client.post(
            "/v1/embed", files={"image": data}, headers={"X-Request-Timeout": "0.000001"}
        )
        assert expired.status_code == 504, expired.text
        assert err(expired) == {"code": "deadline_exceeded", "message": "no result within 1e-06 s"}
        # admitted (the model was idle), then dropped before its image was decoded
        assert await server.metric("vitembed_rejected_total", reason="deadline") == 1
        assert await server.metric("vitembed_stage_seconds_count", stage="decode") == decoded_before
        longer = await server.client.post(  # a longer allowance than the server's is cut to the server's
            "/v1/embeddings", json={"input": images.data_uri(data)}, headers={"X-Request-Timeout": "999"}
        )
        assert longer.status_code == 200, longer.text
        assert server.engine.admission.held == 0
