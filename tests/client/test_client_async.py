"""``AsyncClient`` against the same real ``vitembed serve`` processes: parity with the library, input order
kept when the first batch answers last, a 429 flood retried to success within the deadline, typed errors."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
from clientserver import API_KEY, FLOOD_IMAGES, ServerProcess
from vitembed_client import AsyncClient, MalformedImageError, NotFoundError, RetryPolicy

from vit_backbone import Backbone

TOL = 1e-5
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class HoldFirstTransport(httpx.AsyncHTTPTransport):
    """The first request is held until ``release_after`` others have been answered."""

    def __init__(self, release_after: int) -> None:
        super().__init__()
        self.release_after = release_after
        self.seen = 0
        self.answered = 0
        self.release = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        first = self.seen == 0
        self.seen += 1
        if first:
            await asyncio.wait_for(self.release.wait(), 30)
        response = await super().handle_async_request(request)
        await response.aread()
        if not first:
            self.answered += 1
            if self.answered >= self.release_after:
                self.release.set()
        return response


async def test_async_embed_equals_the_library(
    server: ServerProcess, reference: Backbone, photos: list[bytes]
) -> None:
    async with AsyncClient(server.url) as client:
        got = await client.embed(photos[:4], normalize=True)
        models = await client.models()
    np.testing.assert_allclose(got, reference.embed(photos[:4], normalize=True), atol=TOL, rtol=0)
    assert [m.id for m in models] == ["tiny"]


async def test_async_embed_many_keeps_input_order(
    server: ServerProcess, reference: Backbone, photos: list[bytes]
) -> None:
    transport = HoldFirstTransport(release_after=3)
    async with AsyncClient(server.url, transport=transport) as client:
        got = [row async for row in client.embed_many(photos, batch_size=4, concurrency=4, progress=False)]
    assert transport.answered >= 3
    np.testing.assert_allclose(np.stack(got), reference.embed(photos), atol=TOL, rtol=0)


async def test_async_429_flood_is_retried_to_success(
    flood_server: ServerProcess, reference: Backbone, photos: list[bytes]
) -> None:
    requests = [photos[i : i + FLOOD_IMAGES] for i in range(0, 6 * FLOOD_IMAGES, FLOOD_IMAGES)]
    refused_before = flood_server.status_count(429)
    started = time.monotonic()
    async with AsyncClient(flood_server.url, api_key=API_KEY, retry=RetryPolicy(deadline=30.0)) as client:
        results = await asyncio.gather(*(client.embed(images) for images in requests))
    assert time.monotonic() - started < 30.0
    assert flood_server.status_count(429) > refused_before
    for got, sent in zip(results, requests, strict=True):
        np.testing.assert_allclose(got, reference.embed(sent), atol=TOL, rtol=0)


async def test_async_errors_are_typed(server: ServerProcess, photos: list[bytes]) -> None:
    async with AsyncClient(server.url) as client:
        with pytest.raises(MalformedImageError) as caught:
            await client.embed([b"not an image at all"])
        with pytest.raises(NotFoundError) as missing:
            await client.classify(photos[0])
    assert (caught.value.code, caught.value.index, caught.value.status) == ("not_an_image", 0, 400)
    assert caught.value.request_id
    assert (missing.value.code, missing.value.status) == ("head_not_found", 404)
