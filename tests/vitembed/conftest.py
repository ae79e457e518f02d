"""Fixtures for the HTTP tests: the real app and engine on a tiny random-init DINOv2, in process (httpx's
ASGI transport inside the app's lifespan), plus builders for good and hostile image bytes."""

from __future__ import annotations

import base64
import contextlib
import io
import struct
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from asgi_lifespan import LifespanManager
from PIL import Image
from promtext import sum_samples
from vitembed.server.app import create_app
from vitembed.settings import ServiceSettings

from vit_backbone import Backbone, load_backbone


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """asyncio only; session scope lets module-scoped async fixtures share one event loop."""
    return "asyncio"


@dataclass
class Server:
    client: httpx.AsyncClient
    app: Any  # the ASGI app with its lifespan state (LifespanManager.app)
    settings: ServiceSettings
    state: Any = None  # the app's state: its engine, metrics, served indexes

    async def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        return sum_samples((await self.client.get("/metrics")).text, name, **labels)


OpenServer = Callable[..., contextlib.AbstractAsyncContextManager[Server]]


@pytest.fixture(scope="session")
def tiny_path(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["dinov2"]


@pytest.fixture(scope="session")
def reference(tiny_path: Path) -> Backbone:
    """The library on the same checkpoint: what the server must reproduce."""
    return load_backbone(tiny_path)


@pytest.fixture(scope="session")
def serve(tiny_path: Path) -> OpenServer:
    """``async with serve(**settings) as server``: a fresh app serving the tiny model as ``tiny``
    (float32, so results are comparable with the library to 1e-5)."""

    @contextlib.asynccontextmanager
    async def open_server(**overrides: Any) -> AsyncIterator[Server]:
        options: dict[str, Any] = {
            "models": {"tiny": str(tiny_path)},
            "precision": "float32",
            "max_wait_ms": 2,
        }
        settings = ServiceSettings(**{**options, **overrides})
        app = create_app(settings)
        async with (
            LifespanManager(app) as manager,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=manager.app), base_url="http://test"
            ) as client,
        ):
            yield Server(client, manager.app, settings, app.state)

    return open_server


@pytest.fixture(scope="module")
async def server(serve: OpenServer) -> AsyncIterator[Server]:
    """One shared server per test module, default limits."""
    async with serve() as opened:
        yield opened


# ------------------------------------------------------------------------------------------- images
def _rgb(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def encode(image: Image.Image, fmt: str, **params: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


class Images:
    """Good and hostile image bytes, deterministic."""

    @staticmethod
    def jpeg(width: int = 90, height: int = 70, seed: int = 0) -> bytes:
        return encode(_rgb(width, height, seed), "JPEG", quality=90)

    @staticmethod
    def png(width: int = 70, height: int = 90, seed: int = 1) -> bytes:
        return encode(_rgb(width, height, seed), "PNG")

    @staticmethod
    def png_header(width: int, height: int) -> bytes:
        """A PNG whose header claims ``width`` x ``height``, with almost no pixel data (bombs, zero size)."""
        ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + _png_chunk(b"IHDR", ihdr)
            + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 16))
            + _png_chunk(b"IEND", b"")
        )

    @staticmethod
    def strip(width: int = 2000) -> bytes:
        return encode(Image.new("RGB", (width, 1), (10, 20, 30)), "PNG")

    @staticmethod
    def ico() -> bytes:
        return encode(Image.new("RGB", (32, 32), (10, 20, 30)), "ICO")

    @staticmethod
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")

    @staticmethod
    def data_uri(data: bytes, media_type: str = "image/jpeg") -> str:
        return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


@pytest.fixture(scope="session")
def images() -> Images:
    return Images()


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The error object, after checking the envelope: exactly one key, a request id that matches the
    ``X-Request-ID`` header; returned without the id so that tests compare the rest exactly."""
    body = response.json()
    assert list(body) == ["error"], body
    error = dict(body["error"])
    assert error.pop("request_id") == response.headers["x-request-id"]
    assert response.headers["content-type"] == "application/json"
    return error


@pytest.fixture(scope="session")
def err() -> Callable[[httpx.Response], dict[str, Any]]:
    return error_of
