"""The catalog with the real embedded backbone and its defaults (default-v3: cls_mean_hflip of block 8,
trim_squash into 98x98): each vector equals the library's ``Backbone.embed`` and the server's
``/v1/embed`` answer for the same file (float32)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from PIL import Image

from vit_backbone import load_backbone
from vit_backbone.catalog.shards import read_catalog

if TYPE_CHECKING:
    from conftest import RunCli  # tests/catalog/conftest.py (typing only: 'conftest' is ambiguous at runtime)

TOL = 1e-5


def server_vectors(files: list[bytes]) -> np.ndarray:
    """``POST /v1/embed`` on the real app (in process, float32, the embedded model)."""
    import httpx
    from asgi_lifespan import LifespanManager
    from vitembed.server.app import create_app
    from vitembed.settings import ServiceSettings

    async def call() -> Any:
        options: dict[str, Any] = {"models": {"embedded": "embedded"}, "precision": "float32"}
        app = create_app(ServiceSettings(**options))
        async with (
            LifespanManager(app) as manager,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=manager.app), base_url="http://test"
            ) as client,
        ):
            response = await client.post("/v1/embed", files=[("image", data) for data in files], timeout=120)
            assert response.status_code == 200, response.text
            return response.json()

    body = asyncio.run(call())
    return np.asarray([item["embedding"] for item in body["data"]], dtype=np.float32)


@pytest.mark.slow
def test_embedded_catalog_equals_library_and_server(
    embedded_dir: Path, sample_images: list[Image.Image], run_cli: RunCli, tmp_path: Path
) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    for n, image in enumerate(sample_images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG" if n % 2 == 0 else "PNG", **({"quality": 92} if n % 2 == 0 else {}))
        (folder / f"photo-{n}.{'jpg' if n % 2 == 0 else 'png'}").write_bytes(buffer.getvalue())
    result = run_cli(folder, tmp_path / "cat", "--batch-size", "3", model="embedded")
    assert result.code == 0, result.err
    catalog = read_catalog(tmp_path / "cat")
    assert catalog.ids == [f"photo-{n}.{'jpg' if n % 2 == 0 else 'png'}" for n in range(len(sample_images))]
    backbone = load_backbone("embedded")
    meta = catalog.meta
    facts = (meta.model, meta.pooling, meta.layers, meta.policy, meta.size, meta.dim, meta.preset)
    assert facts == ("embedded", "cls_mean_hflip", [8], "trim_squash", [98, 98], 768, "default-v3")
    assert meta.revision == backbone.checkpoint.revision
    files = [(folder / i).read_bytes() for i in catalog.ids]
    np.testing.assert_allclose(catalog.embeddings, backbone.embed(files), rtol=0, atol=TOL)
    np.testing.assert_allclose(catalog.embeddings, server_vectors(files), rtol=0, atol=TOL)
