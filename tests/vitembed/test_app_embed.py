"""POST /v1/embed in process against the real engine: the server's numbers equal the library's for the same
bytes and options, in every input shape and output encoding, with exact provenance."""

from __future__ import annotations

import base64
import io
import json
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from vit_backbone import Backbone

if TYPE_CHECKING:  # fixtures' types (tests/service/conftest.py)
    from conftest import Images, Server

pytestmark = pytest.mark.anyio
TOL = 1e-5


@pytest.fixture(scope="module")
def batch(images: Images) -> list[bytes]:
    """Three images of different sizes and formats, in a fixed order."""
    return [images.jpeg(90, 70, 0), images.png(70, 90, 1), images.jpeg(120, 64, 2)]


def provenance(reference: Backbone, **changes: Any) -> dict[str, Any]:
    expected = {
        "model": "tiny",
        "revision": reference.checkpoint.revision,
        "preprocess_hash": reference.preprocess_config.hash(),
        "pooling": "cls",
        "layers": None,
        "normalized": False,
        "dtype": "float32",
        "policy": "crop",
        "interpolation": "transformers",
        "precision": "float32",
        "preset": "default-v3",
        "size": None,
        "precision_cosine": None,
    }
    return {**expected, **changes}


def floats(body: dict[str, Any]) -> np.ndarray:
    return np.asarray([item["embedding"] for item in body["data"]], dtype=np.float64)


def from_base64(body: dict[str, Any], dtype: str) -> np.ndarray:
    return np.stack(
        [np.frombuffer(base64.b64decode(item["embedding"]), dtype=dtype) for item in body["data"]]
    )


async def test_multipart_defaults_equal_the_library(
    server: Server, reference: Backbone, batch: list[bytes]
) -> None:
    response = await server.client.post("/v1/embed", files=[("image", data) for data in batch])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "tiny"
    assert body["dim"] == 32
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert all(set(item) == {"index", "embedding"} for item in body["data"])  # no grid unless asked
    assert body["provenance"] == provenance(reference)
    expected = reference.embed(batch)  # [3, 32]
    np.testing.assert_allclose(floats(body), expected, atol=TOL, rtol=0)


async def test_form_options_and_parts_without_filename(
    server: Server, reference: Backbone, batch: list[bytes]
) -> None:
    files = [("image", ("a.jpg", batch[0], "image/jpeg")), ("image", (None, batch[1])), ("image", batch[2])]
    form = {"pooling": "mean", "layers": "-2,-1", "normalize": "true", "return_grid": "true"}
    response = await server.client.post("/v1/embed", files=files, data=form)
    assert response.status_code == 200, response.text
    body = response.json()
    result = reference.embed_result(batch, pooling="mean", layers=[-2, -1], normalize=True)
    assert body["dim"] == 64
    np.testing.assert_allclose(floats(body), result.vectors, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(floats(body), axis=1), 1.0, atol=1e-6)
    assert [tuple(item["grid"]) for item in body["data"]] == result.grids
    assert body["provenance"] == provenance(reference, pooling="mean", layers=[0, 1], normalized=True)


async def test_json_base64_with_json_options_and_base64_output(
    server: Server, reference: Backbone, images: Images, batch: list[bytes]
) -> None:
    payload = {
        "images": [{"base64": images.b64(data)} for data in batch],
        "layers": -1,
        "size": [112, 84],
        "policy": "squash",
        "encoding": "base64",
    }
    response = await server.client.post("/v1/embed", json=payload)
    assert response.status_code == 200, response.text
    body = response.json()
    expected = reference.embed(batch, layers=[-1], size=(112, 84), policy="squash")
    got = from_base64(body, "<f4")
    assert got.shape == (3, 32)
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
    assert body["provenance"] == provenance(reference, layers=[1], policy="squash", size=[112, 84])


async def test_query_options_with_a_json_body(
    server: Server, reference: Backbone, images: Images, batch: list[bytes]
) -> None:
    payload = {"images": [{"base64": images.b64(data)} for data in batch]}
    params = {"pooling": "gem", "size": "112,112", "policy": "dynamic", "return_grid": "1"}
    response = await server.client.post("/v1/embed", json=payload, params=params)
    assert response.status_code == 200, response.text
    body = response.json()
    result = reference.embed_result(batch, pooling="gem", size=(112, 112), policy="dynamic")
    np.testing.assert_allclose(floats(body), result.vectors, atol=TOL, rtol=0)
    assert [tuple(item["grid"]) for item in body["data"]] == result.grids
    assert len(set(result.grids)) > 1  # dynamic keeps each aspect ratio: mixed grids in one request
    assert body["provenance"] == provenance(reference, pooling="gem", policy="dynamic", size=[112, 112])


async def test_float16_as_numbers_and_as_base64(
    server: Server, reference: Backbone, batch: list[bytes]
) -> None:
    expected = reference.embed(batch).astype(np.float16)
    as_numbers = await server.client.post(
        "/v1/embed", files=[("image", d) for d in batch], data={"dtype": "float16"}
    )
    assert as_numbers.status_code == 200, as_numbers.text
    assert as_numbers.json()["provenance"]["dtype"] == "float16"
    got = floats(as_numbers.json())
    assert np.array_equal(got.astype(np.float16).astype(np.float64), got)  # every number is a float16 value
    np.testing.assert_allclose(got, expected.astype(np.float64), atol=2e-3, rtol=2e-3)

    as_bytes = await server.client.post(
        "/v1/embed", files=[("image", d) for d in batch], params={"dtype": "float16", "encoding": "base64"}
    )
    assert as_bytes.status_code == 200, as_bytes.text
    decoded = from_base64(as_bytes.json(), "<f2")
    assert decoded.dtype == np.float16 and decoded.shape == (3, 32)
    assert np.array_equal(decoded.astype(np.float64), got)  # both encodings carry the same float16 values


async def test_npy_body_round_trips_with_provenance_headers(
    server: Server, reference: Backbone, batch: list[bytes]
) -> None:
    response = await server.client.post(
        "/v1/embed",
        files=[("image", d) for d in batch],
        data={"pooling": "patch", "size": "56,56", "policy": "squash"},
        headers={"Accept": "application/x-npy"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-npy"
    array = np.load(io.BytesIO(response.content), allow_pickle=False)
    assert array.dtype == np.dtype("<f4") and array.shape == (3, 4, 4, 32)
    np.testing.assert_allclose(
        array, reference.embed(batch, pooling="patch", size=(56, 56), policy="squash"), atol=TOL
    )
    headers = response.headers
    assert headers["x-vitembed-model"] == "tiny"
    assert headers["x-vitembed-revision"] == reference.checkpoint.revision
    assert headers["x-vitembed-preprocess-hash"] == reference.preprocess_config.hash()
    assert headers["x-vitembed-pooling"] == "patch"
    assert headers["x-vitembed-layers"] == "null"
    assert headers["x-vitembed-normalized"] == "false"
    assert headers["x-vitembed-dtype"] == "float32"
    assert headers["x-vitembed-policy"] == "squash"
    assert headers["x-vitembed-interpolation"] == "transformers"
    assert headers["x-vitembed-precision"] == "float32"
    assert headers["x-vitembed-dim"] == "32"
    assert json.loads(headers["x-vitembed-grids"]) == [[4, 4]] * 3


async def test_npy_float16(server: Server, reference: Backbone, batch: list[bytes]) -> None:
    response = await server.client.post(
        "/v1/embed",
        files=[("image", d) for d in batch],
        params={"dtype": "float16"},
        headers={"Accept": "application/json;q=0.5, application/x-npy"},
    )
    assert response.status_code == 200, response.text
    array = np.load(io.BytesIO(response.content), allow_pickle=False)
    assert array.dtype == np.dtype("<f2") and array.shape == (3, 32)
    np.testing.assert_allclose(array.astype(np.float32), reference.embed(batch), atol=2e-3, rtol=2e-3)
    assert response.headers["x-vitembed-dtype"] == "float16"


async def test_patch_pooling_as_json_has_grids_by_default(
    server: Server, reference: Backbone, images: Images
) -> None:
    data = images.jpeg(90, 70, 3)
    response = await server.client.post("/v1/embed", files={"image": data}, data={"pooling": "patch"})
    assert response.status_code == 200, response.text
    item = response.json()["data"][0]
    expected = reference.embed([data], pooling="patch")  # [1, 4, 4, 32] at the checkpoint's 56 px crop
    assert item["grid"] == [4, 4]
    np.testing.assert_allclose(np.asarray(item["embedding"]), expected[0], atol=TOL)


async def test_request_ids_are_echoed_sanitised_or_made(server: Server) -> None:
    given = await server.client.get("/health", headers={"X-Request-ID": "trace-42.a:b"})
    assert given.headers["x-request-id"] == "trace-42.a:b"
    unsafe = await server.client.get("/health", headers={"X-Request-ID": 'ab<script>"cd' + "x" * 100})
    assert unsafe.headers["x-request-id"] == ("abscriptcd" + "x" * 100)[:64]
    made = await server.client.get("/health")
    assert len(made.headers["x-request-id"]) == 32
    again = await server.client.get("/health")
    assert again.headers["x-request-id"] != made.headers["x-request-id"]


async def test_health_ready_models_and_metrics(server: Server, reference: Backbone) -> None:
    assert (await server.client.get("/health")).json() == {"status": "ok"}
    ready = await server.client.get("/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}

    listing = (await server.client.get("/v1/models")).json()
    assert listing["object"] == "list"
    [card] = listing["data"]
    assert {k: card[k] for k in ("id", "object", "owned_by", "default")} == {
        "id": "tiny",
        "object": "model",
        "owned_by": "vitembed",
        "default": True,
    }
    facts = json.loads(json.dumps(reference.info().to_dict()))
    assert card["info"] == {
        **{k: v for k, v in facts.items() if k != "heads"},
        "attention_heads": facts["heads"],  # Backbone.info()'s heads: attention heads per block
        "heads": {},  # the served heads (none here)
        "location": str(reference.checkpoint.path),
        "precision": "float32",
        "precision_cosine": None,
    }

    before = await server.metric("vitembed_requests_total", route="/v1/embed", status="415")
    await server.client.post("/v1/embed", content=b"x", headers={"Content-Type": "text/plain"})
    await server.client.get("/no/such/route")
    text = (await server.client.get("/metrics")).text
    assert text.startswith("# HELP") and "vitembed_stage_seconds_bucket" in text
    assert await server.metric("vitembed_requests_total", route="/v1/embed", status="415") == before + 1
    assert await server.metric("vitembed_requests_total", route="unmatched", status="404") >= 1
    assert await server.metric("vitembed_requests_total", route="/health", status="200") >= 1
    for stage in ("decode", "preprocess", "queue", "forward", "serialise"):
        assert await server.metric("vitembed_stage_seconds_count", stage=stage) >= 1
    assert await server.metric("vitembed_forward_passes_total", model="tiny") >= 1


async def test_every_endpoint_is_in_the_openapi_schema(server: Server) -> None:
    schema = (await server.client.get("/openapi.json")).json()
    assert set(schema["paths"]) == {
        "/health",
        "/ready",
        "/metrics",
        "/v1/models",
        "/v1/embed",
        "/v1/embeddings",
        "/v1/search",
        "/v1/indexes",
        "/v1/classify",
        "/v1/patch-features",  # the explorer's routes
        "/v1/patch-similarity",
        "/v1/indexes/{index}/thumbnail",
    }
    embed = schema["paths"]["/v1/embed"]["post"]
    assert set(embed["requestBody"]["content"]) == {"multipart/form-data", "application/json"}
    assert {p["name"] for p in embed["parameters"]} >= {
        "model",
        "pooling",
        "layers",
        "size",
        "dtype",
        "encoding",
    }
    assert "application/x-npy" in embed["responses"]["200"]["content"]
    components = schema["components"]["schemas"]
    assert {"EmbedJsonRequest", "ImageIn", "OpenAIEmbeddingRequest", "ErrorResponse"} <= set(components)
    assert "images" in components["EmbedJsonRequest"]["properties"]


async def test_patch_outputs_carry_the_letterbox_mask(
    server: Server, reference: Backbone, images: Images
) -> None:
    """pad: the JSON grid metadata holds the [h][w] image fraction, the .npy answer its row/column factors."""
    batch = [images.jpeg(200, 60, 4), images.png(56, 56, 5)]  # one letterboxed, one not
    params = {"pooling": "patch", "policy": "pad", "size": "56,56"}
    result = reference.embed_result(batch, pooling="patch", policy="pad", size=(56, 56))
    assert not (result.valid[0] == 1).all()
    response = await server.client.post("/v1/embed", files=[("image", d) for d in batch], data=params)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    for item, mask in zip(data, result.valid, strict=True):
        np.testing.assert_allclose(np.asarray(item["valid"]), mask, atol=1e-6)
    np.testing.assert_allclose(floats(response.json()), result.vectors, atol=TOL)
    npy = await server.client.post(
        "/v1/embed", files=[("image", d) for d in batch], data=params, headers={"Accept": "application/x-npy"}
    )
    assert npy.status_code == 200, npy.text
    factors = json.loads(npy.headers["x-vitembed-valid"])
    assert factors[1] is None  # every patch of the square image is image
    rows, cols = factors[0]
    np.testing.assert_allclose(np.outer(rows, cols), result.valid[0], atol=1e-6)
