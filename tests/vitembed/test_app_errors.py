"""Every class of bad input gets its status and its exact JSON error; none takes the server down, and the
next good request is answered at once."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from vit_backbone.decode import decode
from vit_backbone.errors import ImageDecodeError

if TYPE_CHECKING:  # fixtures' types (tests/service/conftest.py)
    from conftest import Images, Server

pytestmark = pytest.mark.anyio
Err = Callable[[httpx.Response], dict[str, Any]]
ACCEPTED = "JPEG, PNG, WEBP, GIF, BMP, TIFF"
OPTIONS = "model, pooling, layers, size, policy, normalize, dtype, encoding, return_grid, heads, preset"


async def assert_next_good_request_is_fast(server: Server, images: Images) -> None:
    started = time.monotonic()
    response = await server.client.post("/v1/embed", files={"image": images.jpeg(64, 64, 9)})
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < 2.0
    assert (await server.client.get("/ready")).status_code == 200


def library_message(data: bytes) -> str:
    with pytest.raises(ImageDecodeError) as caught:
        decode(data)
    return str(caught.value)


async def test_empty_body(server: Server, err: Err) -> None:
    for headers in (
        {},
        {"Content-Type": "application/json"},
        {"Content-Type": "multipart/form-data; boundary=x"},
    ):
        response = await server.client.post("/v1/embed", content=b"", headers=headers)
        assert response.status_code == 400
        assert err(response) == {"code": "empty_body", "message": "the request body is empty"}


async def test_no_images(server: Server, err: Err) -> None:
    message = (
        'no images: send multipart parts named \'image\', JSON {"images": [{"base64": ...}]}, '
        "or for /v1/embeddings a non-empty 'input'"
    )
    for kwargs in (
        {"json": {"images": []}},
        {"json": {"pooling": "cls"}},
        {"files": {"pooling": (None, b"cls")}},
    ):
        response = await server.client.post("/v1/embed", **kwargs)  # type: ignore[arg-type]
        assert response.status_code == 400, response.text
        assert err(response) == {"code": "no_images", "message": message}


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's, above 89 MP
@pytest.mark.parametrize(
    ("case", "status", "code", "message"),
    [
        (
            "not_an_image",
            400,
            "not_an_image",
            f"the bytes are not an image in a recognised format (accepted: {ACCEPTED})",
        ),
        (
            "jpeg_header_cut",
            400,
            "truncated",
            "the data starts like a JPEG image but its header is truncated or corrupt",
        ),
        ("zero_size", 400, "zero_size", "the PNG image has a zero width or height"),
        (
            "bomb",
            422,
            "too_many_pixels",
            "the image is 10000x10000 = 100000000 pixels, more than the limit of 40000000; "
            "downscale it before upload",
        ),
        (
            "huge_bomb",
            422,
            "too_many_pixels",
            "the image has too many pixels (more than 40000000); downscale it before upload",
        ),
        (
            "strip",
            422,
            "aspect_ratio",
            "the image is 2000x1, an aspect ratio of 2000.0:1, more than the limit of 20:1; "
            "crop it to its content first",
        ),
        ("ico", 415, "unsupported_format", f"ICO images are not accepted; convert to one of {ACCEPTED}"),
        ("empty_part", 400, "empty", "the image is empty (0 bytes)"),
    ],
)
async def test_bad_image_bytes(
    server: Server, images: Images, err: Err, case: str, status: int, code: str, message: str
) -> None:
    bad = {
        "not_an_image": b"hello, this is text",
        "jpeg_header_cut": images.jpeg()[:20],
        "zero_size": images.png_header(0, 10),
        "bomb": images.png_header(10_000, 10_000),  # 68 bytes claiming 100 megapixels
        "huge_bomb": images.png_header(20_000, 20_000),  # past Pillow's own ceiling too
        "strip": images.strip(2000),
        "ico": images.ico(),
        "empty_part": b"",
    }[case]
    good = images.jpeg(64, 64, 5)
    response = await server.client.post("/v1/embed", files=[("image", good), ("image", bad), ("image", good)])
    assert response.status_code == status, response.text
    assert err(response) == {"code": code, "message": message, "index": 1}
    assert len(response.content) < 600  # never the payload
    await assert_next_good_request_is_fast(server, images)


async def test_jpeg_truncated_halfway_through_its_scan_data(server: Server, images: Images, err: Err) -> None:
    whole = images.jpeg(90, 70, 0)
    half = whole[: len(whole) // 2]  # the header parses; decoding the pixels fails
    response = await server.client.post("/v1/embed", files={"image": half})
    assert response.status_code == 400, response.text
    error = err(response)
    assert error == {"code": "truncated", "message": library_message(half), "index": 0}
    assert error["message"].startswith("the JPEG image is truncated or corrupt and could not be decoded (")
    await assert_next_good_request_is_fast(server, images)


async def test_invalid_base64_names_the_image(server: Server, images: Images, err: Err) -> None:
    good = images.b64(images.jpeg())
    response = await server.client.post(
        "/v1/embed", json={"images": [{"base64": good}, {"base64": "not*base64!"}]}
    )
    assert response.status_code == 400, response.text
    assert err(response) == {
        "code": "invalid_base64",
        "message": "the image is not valid base64 (standard or URL-safe alphabet)",
        "index": 1,
    }


async def test_base64_variants_are_accepted(server: Server, images: Images) -> None:
    data = images.jpeg(64, 64, 7)
    plain = images.b64(data)
    wrapped = "\n".join(plain[i : i + 76] for i in range(0, len(plain), 76))  # MIME line breaks
    urlsafe = plain.replace("+", "-").replace("/", "_").rstrip("=")
    payload = {
        "images": [
            {"base64": plain},
            {"base64": wrapped},
            {"base64": urlsafe},
            {"base64": images.data_uri(data)},
        ]
    }
    response = await server.client.post("/v1/embed", json=payload)
    assert response.status_code == 200, response.text
    rows = [item["embedding"] for item in response.json()["data"]]
    assert rows[0] == rows[1] == rows[2] == rows[3]


async def test_image_item_of_the_wrong_shape(server: Server, err: Err) -> None:
    response = await server.client.post("/v1/embed", json={"images": [{"url": "http://example.com/a.jpg"}]})
    assert response.status_code == 422
    assert err(response) == {
        "code": "invalid_request",
        "message": "base64: Field required; url: Extra inputs are not permitted",
        "index": 0,
    }


async def test_a_bare_base64_string_gets_the_expected_shape(server: Server, images: Images, err: Err) -> None:
    encoded = base64.b64encode(images.jpeg()).decode()
    response = await server.client.post("/v1/embed", json={"images": [encoded]})
    assert response.status_code == 422
    assert err(response) == {
        "code": "invalid_request",
        "message": 'images[0] must be an object {"base64": "<encoded image>"}, not a string: '
        'send {"images": [{"base64": "..."}]}',
        "index": 0,
    }
    assert "ImageIn" not in response.text


async def test_a_file_part_says_images_go_in_parts_named_image(
    server: Server, images: Images, err: Err
) -> None:
    response = await server.client.post("/v1/embed", files={"file": images.jpeg()})
    assert response.status_code == 422
    assert err(response) == {
        "code": "invalid_request",
        "message": f"unknown form field 'file': images go in parts named 'image' (curl -F image=@photo.jpg); "
        f"options: {OPTIONS}",
    }


async def test_unknown_model(server: Server, images: Images, err: Err) -> None:
    response = await server.client.post("/v1/embed", files={"image": images.jpeg()}, data={"model": "nope"})
    assert response.status_code == 404
    assert err(response) == {"code": "model_not_found", "message": "model 'nope' is not served; served: tiny"}


async def test_unknown_pooling_and_layers(server: Server, images: Images, err: Err) -> None:
    response = await server.client.post(
        "/v1/embed", files={"image": images.jpeg()}, params={"pooling": "max"}
    )
    assert response.status_code == 422
    assert err(response) == {
        "code": "invalid_option",
        "message": "unknown pooling 'max'; choose one of "
        "cls, pooler, projection, mean, cls_mean, gem, patch, linear_eval, "
        "cls_hflip, mean_hflip, cls_mean_hflip, gem_hflip",
    }
    response = await server.client.post("/v1/embed", files={"image": images.jpeg()}, data={"layers": "5"})
    assert response.status_code == 422
    assert err(response) == {
        "code": "invalid_option",
        "message": "layer 5 does not exist: this model has 2 blocks (valid: 0..1 or -2..-1)",
    }


async def test_size_not_a_multiple_of_the_patch(server: Server, images: Images, err: Err) -> None:
    response = await server.client.post("/v1/embed", files={"image": images.jpeg()}, data={"size": "100,100"})
    assert response.status_code == 422
    assert err(response) == {
        "code": "invalid_size",
        "message": (
            "policy='crop': the requested size 100x100 is not a multiple of the 14x14 patch: "
            "height 100 (nearest multiples of 14: 98 or 112); "
            "width 100 (nearest multiples of 14: 98 or 112). "
            'Pass size= with multiples of the patch, or use policy="dynamic", which snaps to the patch grid '
            "(remainder pixels are never cropped silently)."
        ),
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"size": "224,224,3"},
            "size: size must be one or two whole numbers: 224 (a square) or H,W, e.g. 224,224",
        ),
        ({"size": "a,b"}, "size: size must be whole numbers separated by commas, e.g. 224,224"),
        (
            {"layers": "last"},
            "layers: layers must be whole numbers separated by commas, e.g. -1 or -4,-3,-2,-1",
        ),
        ({"dtype": "float64"}, "dtype: Input should be 'float32' or 'float16'"),
        ({"encoding": "hex"}, "encoding: Input should be 'float' or 'base64'"),
        ({"normalize": "maybe"}, "normalize: Input should be a valid boolean, unable to interpret input"),
        (
            {"bogus": "1"},
            f"unknown form field 'bogus': images go in parts named 'image' (curl -F image=@photo.jpg); "
            f"options: {OPTIONS}",
        ),
    ],
)
async def test_invalid_option_values(
    server: Server, images: Images, err: Err, options: dict[str, str], message: str
) -> None:
    response = await server.client.post("/v1/embed", files={"image": images.jpeg()}, data=options)
    assert response.status_code == 422, response.text
    assert err(response) == {"code": "invalid_request", "message": message}


async def test_an_option_in_two_places_is_refused(server: Server, images: Images, err: Err) -> None:
    response = await server.client.post(
        "/v1/embed", files={"image": images.jpeg()}, data={"pooling": "mean"}, params={"pooling": "cls"}
    )
    assert response.status_code == 422
    assert err(response) == {
        "code": "invalid_request",
        "message": "the option 'pooling' is given both in the query and the body",
    }


async def test_unknown_query_parameter(server: Server, images: Images, err: Err) -> None:
    response = await server.client.post(
        "/v1/embed", files={"image": images.jpeg()}, params={"polling": "cls"}
    )
    assert response.status_code == 422
    assert err(response) == {
        "code": "invalid_request",
        "message": "query.polling: Extra inputs are not permitted",
    }


async def test_wrong_content_type(server: Server, err: Err) -> None:
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        response = await server.client.post("/v1/embed", content=b"images=abc", headers=headers)
        assert response.status_code == 415, response.text
        assert err(response) == {
            "code": "unsupported_media_type",
            "message": "send the request as multipart/form-data or application/json",
        }


async def test_malformed_json_and_multipart(server: Server, err: Err) -> None:
    response = await server.client.post(
        "/v1/embed", content=b'{"images": [', headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert err(response) == {"code": "invalid_json", "message": "the body is not valid JSON"}
    response = await server.client.post("/v1/embed", json=[1, 2])
    assert response.status_code == 422
    assert err(response) == {"code": "invalid_request", "message": "the JSON body must be an object"}

    cut = b'--xyz\r\nContent-Disposition: form-data; name="image"; filename="a.jpg"\r\n\r\n\xff\xd8\xff'
    response = await server.client.post(
        "/v1/embed", content=cut, headers={"Content-Type": "multipart/form-data; boundary=xyz"}
    )
    assert response.status_code == 400
    assert err(response) == {
        "code": "invalid_multipart",
        "message": "the multipart body ends before its closing boundary",
    }
    response = await server.client.post(
        "/v1/embed", content=b"abc", headers={"Content-Type": "multipart/form-data"}
    )
    assert response.status_code == 400
    assert err(response) == {
        "code": "invalid_multipart",
        "message": "the multipart Content-Type has no boundary",
    }


async def test_validation_errors_never_echo_the_payload(server: Server, images: Images, err: Err) -> None:
    secret = "S" * 100_000
    image = {"base64": images.b64(images.jpeg())}
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (
            {"json": {"images": [image], "pooling": secret}},
            {"code": "invalid_request", "message": "pooling: String should have at most 32 characters"},
        ),
        (
            {"json": {"images": [image], "dtype": secret}},
            {"code": "invalid_request", "message": "dtype: Input should be 'float32' or 'float16'"},
        ),
        (
            {"json": {"images": [image], "layers": [secret]}},
            {
                "code": "invalid_request",
                "message": "layers.0: Input should be a valid integer, unable to parse string as an integer",
            },
        ),
        (
            {"json": {"images": [image], secret: 1}},
            {
                "code": "invalid_request",
                "message": f"unknown field {'S' * 64!r}; options: {OPTIONS}",
            },
        ),
        (
            {"json": {"images": [{"base64": secret + "*"}]}},
            {
                "code": "invalid_base64",
                "message": "the image is not valid base64 (standard or URL-safe alphabet)",
                "index": 0,
            },
        ),
        (
            {"data": {"model": secret}, "files": {"image": images.jpeg()}},
            {"code": "invalid_request", "message": "model: String should have at most 128 characters"},
        ),
    ]
    for kwargs, expected in cases:
        response = await server.client.post("/v1/embed", **kwargs)
        assert err(response) == expected
        assert response.status_code in (400, 422)
        assert len(response.content) < 1000 and secret[:200] not in response.text


async def test_json_booleans_and_numbers_are_not_each_other(server: Server, images: Images, err: Err) -> None:
    """The schema says number or boolean, and so does the server: pydantic's lax mode would read JSON true
    as 1 and 1 as true (schemathesis found ``"threshold": false`` accepted on /v1/search). Text forms (query
    and form fields) are still parsed as words and digits."""
    image = {"base64": base64.b64encode(images.jpeg()).decode()}
    for body, field, message in (
        ({"normalize": 1}, "normalize", "must be true or false"),
        ({"layers": [True]}, "layers", "must be numbers, not true or false"),
        ({"size": [True, 56]}, "size", "must be numbers, not true or false"),
    ):
        response = await server.client.post("/v1/embed", json={"images": [image], **body})
        assert response.status_code == 422, body
        assert err(response) == {"code": "invalid_request", "message": f"{field}: {message}"}
    response = await server.client.post("/v1/patch-features", json={"images": [image], "layer": True})
    assert response.status_code == 422
    assert err(response) == {
        "code": "invalid_request",
        "message": "layer: must be a number, not true or false",
    }
    response = await server.client.post(
        "/v1/embed", files={"image": images.jpeg()}, data={"normalize": "yes", "layers": "-1"}
    )
    assert response.status_code == 200, response.text
    assert response.json()["provenance"]["normalized"] is True


async def test_unknown_routes_and_methods_are_json(server: Server, err: Err) -> None:
    response = await server.client.get("/v2/embed")
    assert response.status_code == 404
    assert err(response) == {"code": "not_found", "message": "not found"}
    response = await server.client.get("/v1/embed")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert err(response) == {
        "code": "method_not_allowed",
        "message": "method GET is not allowed on this route",
    }


async def test_non_finite_output_is_a_500_not_a_number(
    serve: Any, images: Images, err: Err, tiny_path: Any, tmp_path: Any
) -> None:
    """A checkpoint whose final norm holds NaN: the server refuses to serialise, names the image."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan"
    shutil.copytree(tiny_path, broken)
    weights = load_file(broken / "model.safetensors")
    key = next(k for k in weights if k.endswith("layernorm.weight"))
    weights[key] = torch.full_like(weights[key], float("nan"))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    async with serve(models={"broken": str(broken)}) as server:
        response = await server.client.post("/v1/embed", files={"image": images.jpeg()})
        assert response.status_code == 500
        assert err(response) == {
            "code": "non_finite",
            "message": "the model produced non-finite values (NaN or infinity) for this image",
            "index": 0,
        }


async def test_unexpected_exception_is_a_generic_logged_500(
    server: Server,
    images: Images,
    err: Err,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:

    def explode(*args: object, **kwargs: object) -> bytes:
        raise RuntimeError("secret internal detail")

    from vitembed.server import routes_embed as app_module

    monkeypatch.setattr(app_module, "embed_json", explode)
    with caplog.at_level(logging.ERROR, logger="vitembed.service"):
        response = await server.client.post(
            "/v1/embed", files={"image": images.jpeg()}, headers={"X-Request-ID": "boom-1"}
        )
    assert response.status_code == 500
    assert response.json() == {
        "error": {"code": "internal", "message": "internal error", "request_id": "boom-1"}
    }
    assert "secret" not in response.text
    [record] = [r for r in caplog.records if "boom-1" in r.getMessage()]
    assert record.exc_info is not None and "secret internal detail" in str(record.exc_info[1])
    monkeypatch.undo()
    await assert_next_good_request_is_fast(server, images)
