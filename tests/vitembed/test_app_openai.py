"""POST /v1/embeddings: the official ``openai`` client works unchanged and gets the library's numbers."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import openai
import pytest

from vit_backbone import Backbone

if TYPE_CHECKING:  # fixtures' types (tests/service/conftest.py)
    from conftest import Images, Server

pytestmark = pytest.mark.anyio
Err = Callable[[httpx.Response], dict[str, Any]]
TOL = 1e-5


def client_for(server: Server, api_key: str = "unused") -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=server.app)
    return openai.AsyncOpenAI(
        base_url="http://test/v1",
        api_key=api_key,
        http_client=httpx.AsyncClient(transport=transport, base_url="http://test"),
        max_retries=0,
    )


async def test_openai_client_round_trips_base64_and_float(
    server: Server, reference: Backbone, images: Images
) -> None:
    batch = [images.jpeg(90, 70, 0), images.png(70, 90, 1)]
    uris = [images.data_uri(batch[0]), images.data_uri(batch[1], "image/png")]
    expected = reference.embed(batch, normalize=True)  # [2, 32]: unit vectors, as OpenAI's embeddings are
    client = client_for(server)
    default = await client.embeddings.create(model="tiny", input=uris)  # the client asks for base64
    assert default.model == "tiny" and default.object == "list"
    assert [d.index for d in default.data] == [0, 1]
    assert default.usage.prompt_tokens == 0 and default.usage.total_tokens == 0
    got = np.asarray([d.embedding for d in default.data])
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)

    raw = await client.embeddings.create(model="tiny", input=uris, extra_body={"normalize": False})
    np.testing.assert_allclose(
        np.asarray([d.embedding for d in raw.data]), reference.embed(batch), atol=TOL, rtol=0
    )

    as_float = await client.embeddings.create(model="tiny", input=uris[0], encoding_format="float")
    np.testing.assert_allclose(np.asarray(as_float.data[0].embedding), expected[0], atol=TOL, rtol=0)

    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    await client.close()


async def test_raw_shape_and_base64_is_float32_little_endian(
    server: Server, reference: Backbone, images: Images
) -> None:
    data = images.jpeg(64, 80, 3)
    response = await server.client.post(
        "/v1/embeddings", json={"input": images.data_uri(data), "encoding_format": "base64", "user": "u1"}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["model"] == "tiny"  # the first served model when none is named
    assert body["usage"] == {"prompt_tokens": 0, "total_tokens": 0}
    [item] = body["data"]
    assert set(item) == {"object", "index", "embedding"} and item["object"] == "embedding"
    vector = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, reference.embed([data], normalize=True)[0], atol=TOL, rtol=0)


async def test_dimensions_is_refused(server: Server, images: Images, err: Err) -> None:
    client = client_for(server)
    with pytest.raises(openai.UnprocessableEntityError):
        await client.embeddings.create(model="tiny", input=images.data_uri(images.jpeg()), dimensions=16)
    await client.close()
    response = await server.client.post(
        "/v1/embeddings", json={"input": images.data_uri(images.jpeg()), "dimensions": 16}
    )
    assert response.status_code == 422
    assert err(response) == {
        "code": "dimensions_unsupported",
        "message": "'dimensions' is not supported: a backbone's embedding width is fixed "
        "(see GET /v1/models)",
    }


@pytest.mark.parametrize(
    ("bad", "code", "message"),
    [
        (
            "https://example.com/cat.jpg",
            "invalid_data_uri",
            "fetching image URLs is not offered; send the image as a data:image/...;base64, URI",
        ),
        (
            "data:text/plain;base64,aGVsbG8=",
            "invalid_data_uri",
            "each input must be a data:image/...;base64, URI",
        ),
        ("data:image/png,rawbytes", "invalid_data_uri", "each input must be a data:image/...;base64, URI"),
        ("just some text " * 10_000, "invalid_data_uri", "each input must be a data:image/...;base64, URI"),
        (
            "data:image/png;base64,@@@@",
            "invalid_base64",
            "the image is not valid base64 (standard or URL-safe alphabet)",
        ),
    ],
)
async def test_bad_inputs_name_their_index(
    server: Server, images: Images, err: Err, bad: str, code: str, message: str
) -> None:
    response = await server.client.post(
        "/v1/embeddings", json={"input": [images.data_uri(images.jpeg()), bad]}
    )
    assert response.status_code == 400
    assert err(response) == {"code": code, "message": message, "index": 1}
    assert len(response.content) < 600


async def test_bad_image_and_model_through_the_client(server: Server, images: Images) -> None:
    client = client_for(server)
    with pytest.raises(openai.BadRequestError) as bad_image:
        await client.embeddings.create(model="tiny", input=images.data_uri(images.jpeg()[:20]))
    assert bad_image.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="nope", input=images.data_uri(images.jpeg()))
    await client.close()


@pytest.mark.parametrize(
    ("payload", "status", "code", "message"),
    [
        ({"input": []}, 400, "no_images", None),
        (
            {"input": [[1, 2, 3]]},
            422,
            "invalid_request",
            "input.str: Input should be a valid string; input.list[str].0: Input should be a valid string",
        ),
        (
            {"input": "x", "model": "tiny", "extra": 1},
            422,
            "invalid_request",
            "extra: Extra inputs are not permitted",
        ),
        (
            {"input": "x", "encoding_format": "int8"},
            422,
            "invalid_request",
            "encoding_format: Input should be 'float' or 'base64'",
        ),
    ],
)
async def test_request_validation(
    server: Server, err: Err, payload: dict[str, Any], status: int, code: str, message: str | None
) -> None:
    response = await server.client.post("/v1/embeddings", json=payload)
    assert response.status_code == status, response.text
    error = err(response)
    assert error["code"] == code
    if message is not None:
        assert error == {"code": code, "message": message}


async def test_json_only(server: Server, err: Err) -> None:
    response = await server.client.post(
        "/v1/embeddings", content=b"input=x", headers={"Content-Type": "text/plain"}
    )
    assert response.status_code == 415
    assert err(response) == {
        "code": "unsupported_media_type",
        "message": "send the request as application/json",
    }
