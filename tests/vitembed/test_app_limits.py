"""Limits and admission at the HTTP edge: body size, image count, auth, queue full, deadline, readiness,
and a disconnected client's queued work being dropped."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
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
    serve: OpenServer, images: Images, err: Err
) -> None:
    async with serve(queue_size=1, max_images_per_request=1, max_wait_ms=800) as server:
        data = images.jpeg(60, 60, 2)
        first = asyncio.ensure_future(server.client.post("/v1/embed", files={"image": data}))
        await asyncio.sleep(0.3)  # the first image waits in the queue for its batch to fill
        refused = await server.client.post("/v1/embed", files={"image": data})
        assert refused.status_code == 429, refused.text
        retry_after = refused.headers["retry-after"]
        assert retry_after.isdigit() and int(retry_after) >= 1
        assert err(refused) == {
            "code": "queue_full",
            "message": f"the server is at capacity; retry in {retry_after} s",
        }
        assert (await server.client.get("/ready")).status_code == 200
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


async def test_a_disconnected_clients_queued_work_is_dropped(serve: OpenServer, images: Images) -> None:
    """Raw ASGI: the client sends its body, then leaves while its image waits for a batch (max_wait 1.5 s);
    the app answers at once and the batcher drops the item instead of running a forward pass for it."""
    async with serve(max_wait_ms=1500) as server:
        request = server.client.build_request("POST", "http://test/v1/embed", files={"image": images.jpeg()})
        body = request.read()
        leave_at = time.monotonic() + 0.2
        body_sent = False
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            if time.monotonic() >= leave_at:
                return {"type": "http.disconnect"}
            await asyncio.sleep(3600)  # interrupted by the app's non-blocking disconnect checks
            raise AssertionError("unreachable")

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
        started = time.monotonic()
        await server.app(scope, receive, send)
        assert time.monotonic() - started < 1.0  # did not wait for the batch
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
        assert json.loads(sent[1]["body"])["error"]["code"] == "client_closed_request"

        for _ in range(60):  # the batcher notices at its next wake-up (the 1.5 s batch timer)
            if await server.metric("vitembed_rejected_total", reason="cancelled") == 1:
                break
            await asyncio.sleep(0.1)
        assert await server.metric("vitembed_rejected_total", reason="cancelled") == 1
        assert await server.metric("vitembed_forward_passes_total") == 0
        assert await server.metric("vitembed_requests_total", route="/v1/embed", status="499") == 1
        after = await server.client.post("/v1/embed", files={"image": images.jpeg()})
        assert after.status_code == 200
