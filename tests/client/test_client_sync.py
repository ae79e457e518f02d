"""``Client`` against a real ``vitembed serve`` on loopback: the numbers equal the library's for paths, bytes
and PIL images; ``embed_many`` keeps input order when later batches answer first; a 429 flood is retried to
success within the deadline, and past the deadline the typed 429 surfaces; error answers become typed
exceptions with the server's code and request id."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from clientserver import API_KEY, FLOOD_IMAGES, ServerProcess
from PIL import Image
from vitembed_client import (
    AuthenticationError,
    Client,
    MalformedImageError,
    NotFoundError,
    RateLimitError,
    RetryPolicy,
    UnprocessableEntityError,
)

from vit_backbone import Backbone

TOL = 1e-5


class HoldFirstTransport(httpx.HTTPTransport):
    """A real HTTP transport whose first request is held until ``release_after`` other requests have been
    answered: the first batch's answer then arrives last, whatever the server's timing."""

    def __init__(self, release_after: int) -> None:
        super().__init__()
        self.release_after = release_after
        self._lock = threading.Lock()
        self._seen = 0
        self._answered = 0
        self._release = threading.Event()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            first = self._seen == 0
            self._seen += 1
        if first:
            assert self._release.wait(30), "the other batches were not answered"
        response = super().handle_request(request)
        response.read()
        if not first:
            with self._lock:
                self._answered += 1
                if self._answered >= self.release_after:
                    self._release.set()
        return response


def test_embed_equals_the_library_for_paths_bytes_and_pil_images(
    server: ServerProcess,
    reference: Backbone,
    photos: list[bytes],
    write_files: Callable[[list[bytes]], list[Path]],
) -> None:
    batch = photos[:5]
    expected = reference.embed(batch)  # [5, 32]
    pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in batch]
    with Client(server.url) as client:
        from_paths = client.embed(write_files(batch))
        from_bytes = client.embed(batch)
        from_pil = client.embed(pil)
        one = client.embed(batch[2])  # a single image is a batch of one
        patch = client.embed(batch[:2], pooling="patch", normalize=True, layers=[-1], size=(56, 56))
    assert from_paths.dtype == np.float32 and from_paths.shape == (5, 32)
    np.testing.assert_allclose(from_paths, expected, atol=TOL, rtol=0)
    np.testing.assert_allclose(from_bytes, expected, atol=TOL, rtol=0)
    np.testing.assert_allclose(from_pil, reference.embed(pil), atol=TOL, rtol=0)
    np.testing.assert_allclose(one, expected[2:3], atol=TOL, rtol=0)
    want = reference.embed(batch[:2], pooling="patch", normalize=True, layers=[-1], size=(56, 56))
    assert patch.shape == want.shape == (2, 4, 4, 32)
    np.testing.assert_allclose(patch, want, atol=TOL, rtol=0)


def test_embed_many_keeps_input_order_when_the_first_batch_answers_last(
    server: ServerProcess, reference: Backbone, photos: list[bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    images = photos[:22]  # 8 batches of 3 (the last of 1)
    expected = reference.embed(images)
    transport = HoldFirstTransport(release_after=3)  # batch 0 is answered after batches 1-3
    with Client(server.url, transport=transport) as client:
        got = list(client.embed_many(iter(images), batch_size=3, concurrency=4, progress=True))
    assert transport._answered >= 3
    assert len(got) == len(images)
    np.testing.assert_allclose(np.stack(got), expected, atol=TOL, rtol=0)
    bar = capsys.readouterr().err
    assert bar.endswith("\n") and bar.rsplit("\r", 1)[1].startswith(
        "embed 22 images, "
    )  # no length: no total


def test_a_429_flood_is_retried_to_success_within_the_deadline(
    flood_server: ServerProcess, reference: Backbone, photos: list[bytes]
) -> None:
    requests = [photos[i : i + FLOOD_IMAGES] for i in range(0, 6 * FLOOD_IMAGES, FLOOD_IMAGES)]
    refused_before = flood_server.status_count(429)
    policy = RetryPolicy(deadline=30.0, max_attempts=100)
    started = time.monotonic()
    with (
        Client(flood_server.url, api_key=API_KEY, retry=policy) as client,
        ThreadPoolExecutor(len(requests)) as pool,
    ):
        results = list(pool.map(client.embed, requests))
    elapsed = time.monotonic() - started
    assert flood_server.status_count(429) > refused_before  # the flood was refused, then retried
    for got, sent in zip(results, requests, strict=True):
        np.testing.assert_allclose(got, reference.embed(sent), atol=TOL, rtol=0)
    assert elapsed < 30.0


def test_past_the_deadline_the_typed_429_surfaces(flood_server: ServerProcess, photos: list[bytes]) -> None:
    requests = [photos[i : i + FLOOD_IMAGES] for i in range(0, 4 * FLOOD_IMAGES, FLOOD_IMAGES)]
    policy = RetryPolicy(deadline=0.5)  # shorter than the server's Retry-After (≥ 1 s): no retry fits
    with (
        Client(flood_server.url, api_key=API_KEY, retry=policy) as client,
        ThreadPoolExecutor(len(requests)) as pool,
    ):
        outcomes = list(pool.map(lambda images: _outcome(client.embed, images), requests))
    refused = [o for o in outcomes if isinstance(o, RateLimitError)]
    assert refused, outcomes
    assert all(isinstance(o, np.ndarray | RateLimitError) for o in outcomes), outcomes
    error = refused[0]
    assert (error.status, error.attempts) == (429, 1)
    assert error.code in ("queue_full", "overloaded")  # the admission's reasons for a full queue
    assert error.retry_after is not None and error.retry_after >= 1
    assert error.request_id and error.request_id == error.headers["x-request-id"]


def _outcome(func: Callable[..., Any], *args: Any) -> Any:
    try:
        return func(*args)
    except Exception as exc:
        return exc


def test_error_answers_become_typed_exceptions(
    server: ServerProcess, flood_server: ServerProcess, photos: list[bytes]
) -> None:
    with Client(server.url) as client:
        with pytest.raises(MalformedImageError) as caught:
            client.embed([photos[0], photos[1][:200]])
        assert (caught.value.status, caught.value.code, caught.value.index) == (400, "truncated", 1)
        assert caught.value.request_id and len(caught.value.request_id) == 32
        with pytest.raises(NotFoundError) as missing:
            client.embed(photos[0], model="nope")
        assert (missing.value.code, missing.value.status) == ("model_not_found", 404)
        with pytest.raises(UnprocessableEntityError) as bad:
            client.embed(photos[0], size=(100, 100))
        assert bad.value.code == "invalid_size" and "multiple of" in bad.value.message
        assert "invalid_size" in str(bad.value) and bad.value.request_id in str(bad.value)
        with pytest.raises(TypeError, match="unknown option 'colour'"):
            client.embed(photos[0], colour="red")
        models = client.models()
    assert [(m.id, m.default, m.info["dim"]) for m in models] == [("tiny", True, 32)]
    with Client(flood_server.url) as client, pytest.raises(AuthenticationError) as denied:
        client.models()
    assert (denied.value.status, denied.value.code) == (401, "unauthorized")
