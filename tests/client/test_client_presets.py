"""A preset's box over HTTP: the ``.npy`` answer's ``X-Vitembed-Size`` header reaches the client as [h, w],
and a catalog embedded through such a server records the box the server used (not the job's unset size),
so that its queries are embedded alike later."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from clientserver import start_server
from PIL import Image
from vitembed.cli.main import main
from vitembed_client import Client

from vit_backbone import load_backbone
from vit_backbone.catalog.shards import read_catalog


def _jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=92)
    return buffer.getvalue()


def test_the_servers_box_reaches_the_client_and_a_remote_catalog(
    make_checkpoint: Callable[..., Path], sample_images: list[Image.Image], tmp_path: Path
) -> None:
    folder = make_checkpoint("dinov2", seed=7)  # native 56x56
    defaults = {"pooling": "mean_hflip", "policy": "squash", "size": [28, 28]}
    (folder / "vitembed.json").write_text(json.dumps({"defaults": defaults}))
    photos = tmp_path / "photos"
    photos.mkdir()
    data = [_jpeg(im.resize((80, 60))) for im in sample_images[:3]]
    for n, encoded in enumerate(data):
        (photos / f"p{n}.jpg").write_bytes(encoded)
    server = start_server(folder, tmp_path)
    try:
        with Client(server.url) as client:
            vectors, facts = client.embed_with_provenance(data)
            assert facts["size"] == [28, 28] and facts["pooling"] == "mean_hflip"
            _, native = client.embed_with_provenance(data[:1], size=56)
            assert native["size"] == [56, 56]
        argv = ["embed-catalog", str(photos), "--out", str(tmp_path / "cat"), "--server", server.url]
        assert main([*argv, "--precision", "float32"]) == 0
    finally:
        server.stop()
    catalog = read_catalog(tmp_path / "cat")
    assert catalog.meta.size == [28, 28] and catalog.meta.pooling == "mean_hflip"
    library = load_backbone(folder).embed(data)  # the same box and pooling, in process
    np.testing.assert_allclose(vectors, library, rtol=0, atol=1e-5)
    np.testing.assert_allclose(catalog.embeddings, library, rtol=0, atol=1e-5)
