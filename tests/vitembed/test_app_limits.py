"""Limits and admission at the HTTP edge: body size, image count, auth, queue full, deadline, readiness,
and a disconnected client's queued work being dropped.

Event-ordered: where a request must be waiting while another arrives, the engine's forward pass is paused
(``paused_forward``: it says when a pass has begun and waits until the test releases it), never a sleep."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from vitembed.engine.engine import Engine
from vitembed.metrics import Metrics
from vitembed.server.app import create_app
from vitembed.settings import ServiceSettings

if TYPE_CHECKING:  # fixtures' types (tests/service/conftest.py)
    from conftest import Images, OpenServer

pytestmark = pytest.mark.anyio
Err = Callable[[httpx.Response], dict[str, Any]]


class PausedForward:
    """The engine's forward passes wait until ``release`` is set; ``entered`` is set when one begins."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 30), "no forward pass began"


@pytest.fixture
def paused_forward(monkeypatch: pytest.MonkeyPatch) -> Iterator[PausedForward]:
    paused = PausedForward()
    forward = Engine._forward

    def wait_then_forward(self: Engine, backbone: Any, items: Any) -> Any:
        paused.entered.set()
        paused.release.wait(30)
        return forward(self, backbone, items)

    monkeypatch.setattr(Engine, "_forward", wait_then_forward)  # before the engine starts: it binds it
    yield paused
    paused.release.set()  # never leave a forward thread waiting


async def test_body_over_the_limit_by_content_length_and_chunked(
    serve: OpenServer, images: Images, err: Err
) -> None:
    async with serve(max_body_bytes=4096) as server:
        big = images.png(200, 200, 4)  # ~120 KB of noise
        assert len(big) > 4096
        declared = await server.client.post("/v1/embed", files={"image": big})
        assert declared.status_code == 413
        assert err(declared) == {
            "code": "body_too_large",
            "message": "the request body is over the limit of 4096 bytes",
        }

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the counting receive must stop it
            for _ in range(10):
                yield b"x" * 1000

        chunked = await server.client.post(
            "/v1/embed", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert "content-length" not in chunked.request.headers
        assert chunked.status_code == 413
        assert err(chunked) == {
            "code": "body_too_large",
            "message": "the request body is over the limit of 4096 bytes",
        }
        assert await server.metric("vitembed_requests_total", route="/v1/embed", status="413") == 2

        small = await server.client.post("/v1/embed", files={"image": images.jpeg(40, 40, 1)})
        assert small.status_code == 200, small.text


async def test_too_many_images(serve: OpenServer, images: Images, err: Err) -> None:
    async with serve(max_images_per_request=2) as server:
        data = images.jpeg(40, 40, 1)
        expected = {"code": "too_many_images", "message": "3 images in one request; the limit is 2"}
        multipart = await server.client.post("/v1/embed", files=[("image", data)] * 3)
        assert multipart.status_code == 413 and err(multipart) == expected
        as_json = await server.client.post("/v1/embed", json={"images": [{"base64": images.b64(data)}] * 3})
        assert as_json.status_code == 413 and err(as_json) == expected
        openai_route = await server.client.post("/v1/embeddings", json={"input": [images.data_uri(data)] * 3})
        assert openai_route.status_code == 413 and err(openai_route) == expected
        two = await server.client.post("/v1/embed", files=[("image", data)] * 2)
        assert two.status_code == 200 and len(two.json()["data"]) == 2


async def test_bearer_auth_on_v1_only(serve: OpenServer, images: Images, err: Err) -> None:
    unauthorized = {
        "code": "unauthorized",
        "message": "missing or invalid API key: send Authorization: Bearer <key>",
    }
    async with serve(api_key="s3cret-key") as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic czNjcmV0LWtleQ=="}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/embed"), ("POST", "/v1/embeddings")):
                response = await server.client.request(method, path, headers=headers, content=b"{not json")
                assert response.status_code == 401, (method, path, headers)
                assert response.headers["www-authenticate"] == "Bearer"
                assert err(response) == unauthorized  # checked before the (invalid) body is parsed
        for path in ("/health", "/ready", "/metrics"):
            assert (await server.client.get(path)).status_code == 200
        good = {"Authorization": "Bearer s3cret-key"}
        assert (await server.client.get("/v1/models", headers=good)).status_code == 200
        embedded = await server.client.post("/v1/embed", files={"image": images.jpeg()}, headers=good)
        assert embedded.status_code == 200, embedded.text
    async with serve() as open_server:  # no key configured: no auth
        assert (await open_server.client.get("/v1/models")).status_code == 200


async def test_queue_full_is_429_with_retry_after_and_the_server_stays_ready(
    serve: OpenServer, images: Images, err: Err, paused_forward: PausedForward
) -> None:
    async with serve(queue_size=1, max_images_per_request=1) as server:
        data = images.jpeg(60, 60, 2)
        first = asyncio.ensure_future(server.client.post("/v1/embed", files={"image": data}))
        await paused_forward.wait_entered()  # the first image is in its forward pass: it holds the one place
        refused = await server.client.post("/v1/embed", files={"image": data})
        assert refused.status_code == 429, refused.text
        retry_after = refused.headers["retry-after"]
        assert retry_after.isdigit() and int(retry_after) >= 1
        assert err(refused) == {
            "code": "queue_full",
            "message": f"the server is at capacity; retry in {retry_after} s",
        }
        assert (await server.client.get("/ready")).status_code == 200
        assert not first.done()
        paused_forward.release.set()
        assert (await first).status_code == 200
        assert (await server.client.post("/v1/embed", files={"image": data})).status_code == 200
        assert await server.metric("vitembed_rejected_total", reason="queue_full") == 1


async def test_deadline_is_504(serve: OpenServer, images: Images, err: Err) -> None:
    async with serve(request_timeout_s=0.001) as server:
        response = await server.client.post("/v1/embed", files={"image": images.jpeg()})
        assert response.status_code == 504, response.text
        assert err(response) == {"code": "deadline_exceeded", "message": "no result within 0.001 s"}
        assert (await server.client.get("/ready")).status_code == 200


async def test_not_ready_until_the_engine_has_started(tiny_path: Path, err: Err, images: Images) -> None:
    settings = ServiceSettings(models={"tiny": str(tiny_path)}, precision="float32")
    engine = Engine(settings, Metrics())  # passed in: the caller starts and stops it
    app = create_app(settings, engine=engine)
    async with (
        LifespanManager(app) as manager,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=manager.app), base_url="http://test") as client,
    ):
        assert (await client.get("/health")).json() == {"status": "ok"}
        ready = await client.get("/ready")
        assert ready.status_code == 503
        assert err(ready) == {"code": "not_ready", "message": "the models are not ready"}
        embed = await client.post("/v1/embed", files={"image": images.jpeg()})
        assert embed.status_code == 503
        assert err(embed) == {
            "code": "not_ready",
            "message": "the models are not ready (loading, or a model worker stopped)",
        }
        await asyncio.to_thread(engine.start)
        try:
            assert (await client.get("/ready")).status_code == 200
            assert (await client.post("/v1/embed", files={"image": images.jpeg()})).status_code == 200
        finally:
            engine.stop()
        assert (await client.get("/ready")).status_code == 503  # a stopped engine is not ready


async def test_a_disconnected_clients_queued_work_is_dropped(
    serve: OpenServer, images: Images, paused_forward: PausedForward
) -> None:
    """Raw ASGI: while another request's forward pass holds the forward thread, the client sends its body,
    its image is queued, and it leaves; the app answers 499 at once (the pass is still paused) and the
    batcher drops the image instead of running a forward pass for it. One forward thread: a second would
    take the image into a pass of its own."""
    async with serve(forward_workers=1) as server:
        registry = server.state.metrics.registry
        blocker = asyncio.ensure_future(server.client.post("/v1/embed", files={"image": images.jpeg()}))
        await paused_forward.wait_entered()
        request = server.client.build_request("POST", "http://test/v1/embed", files={"image": images.jpeg()})
        body = request.read()
        body_sent = False
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            # as a server's receive does once the body is in: it returns when the client leaves, which this
            # client does once its image is queued
            while registry.get_sample_value("vitembed_queue_depth", {"model": "tiny"}) != 1:
                await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/embed",
            "raw_path": b"/v1/embed",
            "root_path": "",
            "query_string": b"",
            "headers": [(k.lower().encode(), v.encode()) for k, v in request.headers.items()],
            "client": ("127.0.0.1", 5000),
            "server": ("test", 80),
        }
        await asyncio.wait_for(server.app(scope, receive, send), timeout=30)
        assert not blocker.done()  # answered while the forward thread was still held: no wait for a pass
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
        assert json.loads(sent[1]["body"])["error"]["code"] == "client_closed_request"

        paused_forward.release.set()
        assert (await blocker).status_code == 200
        # a request after it: the batcher drops the cancelled image before it forms this one's batch
        after = await server.client.post("/v1/embed", files={"image": images.jpeg()})
        assert after.status_code == 200
        assert await server.metric("vitembed_rejected_total", reason="cancelled") == 1
        assert await server.metric("vitembed_forward_passes_total") == 2  # the blocker's and the last one's
        assert await server.metric("vitembed_requests_total", route="/v1/embed", status="499") == 1
