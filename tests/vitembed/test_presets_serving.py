"""Named presets and the projection through the real app (in process, real engine, real LanceDB table):
a full CLIP checkpoint answers /v1/embed and /v1/embeddings with its projected image embedding (default-v3),
``preset=default-v1`` gives the previous default back, and an index and a head built under default-v1 keep
serving unchanged now that the default is default-v3 (they store their resolved options)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from vitembed.cli.main import main

from vit_backbone import load_backbone
from vit_backbone.catalog.index_build import build_index
from vit_backbone.catalog.index_search import SimilarityIndex
from vit_backbone.heads import load_head

if TYPE_CHECKING:
    from conftest import Images, OpenServer

pytestmark = pytest.mark.anyio
TOL = 1e-5


def _vectors(body: dict) -> np.ndarray:  # type: ignore[type-arg]
    return np.asarray([item["embedding"] for item in body["data"]], dtype=np.float32)


async def test_full_clip_serves_its_projection_and_the_old_default_by_name(
    serve: OpenServer, tiny_checkpoints: dict[str, Path], images: Images
) -> None:
    clip = tiny_checkpoints["clip"]
    bb = load_backbone(clip)
    data = [images.jpeg(90, 70, 0), images.jpeg(64, 96, 1)]
    projection = bb.embed(data, pooling="projection")  # [2, 16]
    tower_cls = bb.embed(data, pooling="cls")  # [2, 32]
    payload = {"images": [{"base64": base64.b64encode(d).decode()} for d in data]}
    async with serve(models={"clip": str(clip)}) as server:
        response = await server.client.post("/v1/embed", json=payload)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["dim"] == 16 and body["provenance"]["pooling"] == "projection"
        assert body["provenance"]["preset"] == "default-v3" and body["provenance"]["policy"] == "crop"
        np.testing.assert_allclose(_vectors(body), projection, rtol=0, atol=TOL)

        response = await server.client.post("/v1/embed", json={**payload, "preset": "default-v1"})
        assert response.status_code == 200, response.text
        body = response.json()
        assert (body["dim"], body["provenance"]["pooling"], body["provenance"]["preset"]) == (
            32,
            "cls",
            "default-v1",
        )
        np.testing.assert_allclose(_vectors(body), tower_cls, rtol=0, atol=TOL)

        uris = [images.data_uri(d) for d in data]
        response = await server.client.post("/v1/embeddings", json={"input": uris, "model": "clip"})
        assert response.status_code == 200, response.text
        openai = np.asarray([item["embedding"] for item in response.json()["data"]], dtype=np.float32)
        unit = projection / np.linalg.norm(projection, axis=1, keepdims=True)  # /v1/embeddings normalises
        np.testing.assert_allclose(openai, unit, rtol=0, atol=TOL)

        response = await server.client.post("/v1/embed", json={**payload, "preset": "default-v9"})
        assert response.status_code == 422, response.text
        assert "default-v1, default-v2, default-v3" in response.text


async def test_an_index_and_a_head_built_under_default_v1_keep_serving(
    serve: OpenServer, tiny_checkpoints: dict[str, Path], images: Images, tmp_path: Path
) -> None:
    clip = tiny_checkpoints["clip"]
    folder = tmp_path / "photos"
    (folder / "red").mkdir(parents=True)
    (folder / "blue").mkdir()
    for i in range(6):
        (folder / ("red" if i % 2 else "blue") / f"p{i}.jpg").write_bytes(images.jpeg(60 + 9 * i, 80, seed=i))
    catalog, db = tmp_path / "cat", tmp_path / "db"
    argv = ["embed-catalog", str(folder), "--out", str(catalog), "--model", f"clip={clip}"]
    assert main([*argv, "--preset", "default-v1", "--precision", "float32"]) == 0
    build_index(catalog, db, "v1")
    meta = SimilarityIndex.open(db, "v1").meta
    assert (meta.pooling, meta.layers, meta.policy, meta.preset) == ("cls", None, "crop", "default-v1")
    head_file = tmp_path / "head.safetensors"
    train = ["heads", "train", "--data", str(folder), "--out", str(head_file), "--model", str(clip)]
    assert main([*train, "--preset", "default-v1", "--no-cache", "--val-fraction", "0.34"]) == 0
    card = load_head(head_file).card
    assert (card.pooling, card.policy, card.preset, card.feature_dim) == ("cls", "crop", "default-v1", 32)

    query = (folder / "red" / "p3.jpg").read_bytes()
    async with serve(
        models={"clip": str(clip)}, indexes={"v1": f"{db}:v1"}, heads={"colour": str(head_file)}
    ) as server:
        response = await server.client.post("/v1/search", files=[("image", ("q.jpg", query, "image/jpeg"))])
        assert response.status_code == 200, response.text
        body = response.json()
        top = body["data"][0]["results"][0]
        assert top["id"].endswith("p3") or top["id"].endswith("p3.jpg"), top
        assert top["score"] == pytest.approx(1.0, abs=TOL)
        assert (body["provenance"]["pooling"], body["provenance"]["preset"]) == ("cls", "default-v1")
        response = await server.client.post(
            "/v1/classify", files=[("image", ("q.jpg", query, "image/jpeg"))], data={"head": "colour"}
        )
        assert response.status_code == 200, response.text
        assert response.json()["provenance"]["preset"] == "default-v1"
        assert response.json()["provenance"]["pooling"] == "cls"


@pytest.mark.slow
async def test_the_embedded_default_is_default_v3_and_default_v2_stays_by_name(
    serve: OpenServer,
    embedded_dir: Path,
    sample_images: list,
    images: Images,  # type: ignore[type-arg]
) -> None:
    """default-v3 on the real embedded weights: trim_squash into 98x98 (a 7x7 grid), CLS and patch mean of
    block 8 averaged with the mirror image; the server equals the library, reports the box it used, and a
    mirrored upload gets its original's vector; default-v2 (224, mean of block 8) by name, as before."""
    import io

    from PIL import ImageOps

    bb = load_backbone("embedded")
    photo = sample_images[0]
    buffer, flipped = io.BytesIO(), io.BytesIO()
    photo.save(buffer, "PNG")
    ImageOps.mirror(photo).save(flipped, "PNG")
    data = [buffer.getvalue(), flipped.getvalue()]
    payload = {"images": [{"base64": base64.b64encode(d).decode()} for d in data], "return_grid": True}
    v3 = bb.embed(data)  # [2, 768]
    v2 = bb.embed(data, preset="default-v2")  # [2, 384]
    async with serve(models={"embedded": "embedded"}) as server:
        response = await server.client.post("/v1/embed", json=payload)
        assert response.status_code == 200, response.text
        body = response.json()
        facts = body["provenance"]
        assert (facts["preset"], facts["pooling"], facts["layers"], facts["policy"], facts["size"]) == (
            "default-v3",
            "cls_mean_hflip",
            [8],
            "trim_squash",
            [98, 98],
        )
        assert body["dim"] == 768 and [item["grid"] for item in body["data"]] == [[7, 7], [7, 7]]
        got = _vectors(body)
        np.testing.assert_allclose(got, v3, rtol=0, atol=TOL)
        unit = got / np.linalg.norm(got, axis=1, keepdims=True)
        assert float(unit[0] @ unit[1]) > 0.9999  # the mirrored upload lands on its original

        response = await server.client.post("/v1/embed", json={**payload, "preset": "default-v2"})
        assert response.status_code == 200, response.text
        body = response.json()
        facts = body["provenance"]
        assert (facts["preset"], facts["pooling"], facts["size"]) == ("default-v2", "mean", None)
        assert [item["grid"] for item in body["data"]] == [[16, 16], [16, 16]]
        np.testing.assert_allclose(_vectors(body), v2, rtol=0, atol=TOL)
        v2_unit = v2 / np.linalg.norm(v2, axis=1, keepdims=True)
        assert float(v2_unit[0] @ v2_unit[1]) < 0.999  # what the mirror averaging changed

        response = await server.client.post("/v1/embed", json={**payload, "pooling": "patch"})
        assert response.status_code == 200, response.text  # dense output keeps the native box
        assert response.json()["provenance"]["size"] is None
        assert [item["grid"] for item in response.json()["data"]] == [[16, 16], [16, 16]]

        response = await server.client.post("/v1/embed", json={**payload, "size": [224, 224]})
        assert response.status_code == 200, response.text
        assert response.json()["provenance"]["size"] == [224, 224]
        assert [item["grid"] for item in response.json()["data"]] == [[16, 16], [16, 16]]


async def test_stored_options_with_no_size_keep_the_native_box_when_the_default_gains_one(
    serve: OpenServer, make_checkpoint: Any, images: Images, tmp_path: Path
) -> None:
    """An index and a head built when the default had no box (``size: null`` = the native box) keep
    embedding their queries at the native box after the checkpoint's defaults gain one (as the embedded
    backbone's did with default-v3): the library's and the server's searches find the query's own row at
    cosine 1, and head probabilities do not change."""
    import json

    from vit_backbone.catalog.index_search import embed_queries
    from vit_backbone.heads.predict import predict_proba

    model = make_checkpoint("dinov2", seed=11)  # native 56x56, no vitembed.json yet
    folder = tmp_path / "photos"
    for i in range(6):
        (folder / ("red" if i % 2 else "blue")).mkdir(parents=True, exist_ok=True)
        (folder / ("red" if i % 2 else "blue") / f"p{i}.jpg").write_bytes(images.jpeg(60 + 9 * i, 80, seed=i))
    catalog, db, head_file = tmp_path / "cat", tmp_path / "db", tmp_path / "head.safetensors"
    argv = ["embed-catalog", str(folder), "--out", str(catalog), "--model", f"m={model}", "--normalize"]
    assert main([*argv, "--precision", "float32"]) == 0
    build_index(catalog, db, "items")
    train = ["heads", "train", "--data", str(folder), "--out", str(head_file), "--model", str(model)]
    assert main([*train, "--no-cache", "--val-fraction", "0.34"]) == 0
    assert SimilarityIndex.open(db, "items").meta.size is None and load_head(head_file).card.size is None
    query = (folder / "red" / "p3.jpg").read_bytes()
    before = predict_proba(load_backbone(model), load_head(head_file), [query])  # [1, 2]

    defaults = {"pooling": "mean_hflip", "policy": "squash", "size": [28, 28]}
    (model / "vitembed.json").write_text(json.dumps({"defaults": defaults}))  # the default changes
    bb = load_backbone(model)
    assert bb.embed_result([query]).size == (28, 28)  # new requests get the box
    index = SimilarityIndex.open(db, "items")
    top = index.search(embed_queries(bb, index.meta, [query])[0], k=1)[0]
    assert top.id.endswith("p3.jpg") and top.score == pytest.approx(1.0, abs=TOL)
    np.testing.assert_allclose(predict_proba(bb, load_head(head_file), [query]), before, rtol=0, atol=TOL)
    async with serve(
        models={"m": str(model)}, indexes={"items": f"{db}:items"}, heads={"h": str(head_file)}
    ) as server:
        response = await server.client.post("/v1/search", files=[("image", ("q.jpg", query, "image/jpeg"))])
        assert response.status_code == 200, response.text
        hit = response.json()["data"][0]["results"][0]
        assert hit["id"].endswith("p3.jpg") and hit["score"] == pytest.approx(1.0, abs=TOL)
        response = await server.client.post(
            "/v1/classify", files=[("image", ("q.jpg", query, "image/jpeg"))], data={"head": "h", "k": "2"}
        )
        assert response.status_code == 200, response.text
        served = {label["label"]: label["probability"] for label in response.json()["data"][0]["labels"]}
        expected = dict(zip(load_head(head_file).card.classes, before[0].tolist(), strict=True))
        assert served == pytest.approx(expected, abs=TOL)
