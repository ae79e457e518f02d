"""The explorer's endpoints in process against the real engine and a real LanceDB index (built by the real
``embed-catalog`` job and ``index build`` from a folder and from a manifest): ``/v1/patch-features`` equals
the library (tokens → PCA computed again with numpy here, the model view, the cost report),
``/v1/patch-similarity`` equals numpy cosines of the library's tokens of both images, thumbnails come only
from the catalog's own source, the page is served with a same-origin-only policy, and errors and auth are
those of every other ``/v1`` route."""

from __future__ import annotations

import base64
import csv
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from PIL import Image
from vitembed.cli.main import main

from vit_backbone import Backbone
from vit_backbone.architectures import arch_from_hf_config
from vit_backbone.catalog.index_search import SimilarityIndex
from vit_backbone.costs import cost_report

if TYPE_CHECKING:
    from conftest import Images, OpenServer

pytestmark = pytest.mark.anyio
TOL = 1e-4  # the API rounds to 6 decimals; the numpy recipe runs in float64 on float32 tokens


def numpy_pca(tokens: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
    """On the patches that hold image (pad's letterbox left out, black)."""
    h, w, d = tokens.shape
    holds = np.ones(h * w, bool) if valid is None else valid.reshape(-1) > 0
    x = tokens.reshape(-1, d).astype(np.float64)[holds]
    centred = x - x.mean(0)
    vt = np.linalg.svd(centred, full_matrices=False)[2][:3]
    vt = vt * np.sign(vt[np.arange(3), np.argmax(np.abs(vt), axis=1)])[:, None]
    p = centred @ vt.T
    out = np.zeros((h * w, 3))
    out[holds] = (p - p.min(0)) / (p.max(0) - p.min(0))
    return out.reshape(h, w, 3)


def png_pixels(encoded: dict[str, Any]) -> np.ndarray:
    assert encoded["media_type"] == "image/png"
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(encoded["base64"]))).convert("RGB"))


@pytest.fixture(scope="module")
def catalog(images: Images, tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> dict[str, Any]:
    """Six distinct pictures in a folder (ids = file names, one in a subfolder) and a manifest catalog of
    two of them, each embedded by the real job and indexed."""
    root = tmp_path_factory.mktemp("explore")
    photos = root / "photos"
    (photos / "sub").mkdir(parents=True)
    data: dict[str, bytes] = {}
    for i in range(6):
        item = f"sub/p{i}.jpg" if i == 5 else f"p{i}.jpg"
        data[item] = images.jpeg(120 + 10 * i, 100 - 5 * i, seed=300 + i)
        (photos / item).write_bytes(data[item])
    (root / "secret.jpg").write_bytes(images.jpeg(50, 50, seed=1))  # outside the catalog's folder
    tiny = f"tiny={tiny_path}"
    assert (
        main(
            [
                "embed-catalog",
                str(photos),
                "--out",
                str(root / "cat"),
                "--model",
                tiny,
                "--precision",
                "float32",
            ]
        )
        == 0
    )
    assert main(["index", "build", str(root / "cat"), "--db", str(root / "db"), "--table", "photos"]) == 0
    manifest = root / "manifest.csv"
    with manifest.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "path"])
        writer.writerow(["first", str(photos / "p0.jpg")])
        writer.writerow(["second", str(photos / "p1.jpg")])
    assert (
        main(
            [
                "embed-catalog",
                str(manifest),
                "--out",
                str(root / "mcat"),
                "--model",
                tiny,
                "--precision",
                "float32",
            ]
        )
        == 0
    )
    assert main(["index", "build", str(root / "mcat"), "--db", str(root / "db"), "--table", "listed"]) == 0
    return {
        "root": root,
        "data": data,
        "indexes": {"photos": f"{root / 'db'}:photos", "listed": f"{root / 'db'}:listed"},
    }


async def test_patch_features_equal_the_library(
    serve: OpenServer, reference: Backbone, images: Images
) -> None:
    photo = images.jpeg(150, 90, seed=7)
    async with serve() as server:
        for policy, size, layer in (("pad", (112, 112), 0), ("dynamic", (112, 112), -1), ("crop", None, 1)):
            fields = {"policy": policy, "layer": str(layer)}
            if size:
                fields["size"] = f"{size[0]},{size[1]}"
            response = await server.client.post("/v1/patch-features", files={"image": photo}, data=fields)
            assert response.status_code == 200, response.text
            body = response.json()
            block = layer % reference.depth
            tokens = reference.embed(photo, pooling="patch", layers=[block], policy=policy, size=size)[0]
            prepared = reference.prepare(photo, policy=policy, size=size)[0]
            assert body["grid"] == list(tokens.shape[:2]) == list(prepared.grid)
            assert body["layer"] == block and body["policy"] == policy and body["model"] == "tiny"
            expected = numpy_pca(tokens, prepared.valid)
            np.testing.assert_allclose(np.array(body["pca"]["rgb"]), expected, atol=TOL)
            if policy == "pad":  # a 150 x 90 photo in a square: letterbox columns, left out and black
                assert prepared.valid is not None and (prepared.valid == 0).any()
                assert not np.array(body["pca"]["foreground"])[prepared.valid == 0].any()
            view = png_pixels(body["view"])
            height, width = prepared.pixel_values.shape[1:]
            assert list(view.shape) == [height, width, 3] == [*body["size"], 3]
            cfg = reference.preprocess_config
            mean, std = np.array(cfg.image_mean), np.array(cfg.image_std)
            expected = np.clip(
                np.rint((prepared.pixel_values.numpy().transpose(1, 2, 0) * std + mean) * 255), 0, 255
            )
            assert np.abs(view.astype(int) - expected).max() == 0
            arch = arch_from_hf_config(reference.config)
            report = cost_report(arch, height, width, params=reference.info().params).to_dict()
            assert body["cost"] == report
        dynamic_grid = (await server.client.post(
            "/v1/patch-features", files={"image": photo}, data={"policy": "dynamic", "size": "112,112"}
        )).json()["grid"]  # fmt: skip
        assert dynamic_grid != [8, 8] and dynamic_grid[0] * dynamic_grid[1] <= 64  # the aspect is kept
        threshold = await server.client.post(
            "/v1/patch-features",
            files={"image": photo},
            data={"background_threshold": "0.5", "size": "112,112"},
        )
        pca = threshold.json()["pca"]
        keep = np.array(pca["foreground"])
        assert pca["threshold"] == 0.5 and 0 < keep.sum() < keep.size
        assert (np.array(pca["rgb"])[~keep] == 0).all()


async def test_patch_features_errors_and_limits(serve: OpenServer, images: Images, err: Any) -> None:
    async with serve() as server:
        post = server.client.post
        response = await post("/v1/patch-features", files={"image": b"plain text, not a picture"})
        assert response.status_code == 400
        assert err(response) == {
            "code": "not_an_image",
            "message": "the bytes are not an image in a recognised format "
            "(accepted: JPEG, PNG, WEBP, GIF, BMP, TIFF)",
            "index": 0,
        }
        two = [("image", images.jpeg()), ("image", images.png())]
        response = await post("/v1/patch-features", files=two)
        assert response.status_code == 422 and err(response) == {
            "code": "invalid_request",
            "message": "send exactly one image, not 2",
        }
        response = await post("/v1/patch-features", files={"image": images.jpeg()}, data={"layer": "5"})
        assert response.status_code == 422 and err(response)["code"] == "invalid_option"
        assert "this model has 2 blocks" in err(response)["message"]
        response = await post("/v1/patch-features", files={"image": images.jpeg()}, data={"size": "100,100"})
        assert response.status_code == 422 and err(response)["code"] == "invalid_size"
        response = await post(
            "/v1/patch-features", files={"image": images.jpeg()}, data={"background_threshold": "2"}
        )
        assert response.status_code == 422 and err(response)["code"] == "invalid_request"
        response = await post("/v1/patch-features", content=b"{}", headers={"content-type": "text/plain"})
        assert response.status_code == 415
        response = await post(
            "/v1/patch-features", json={"images": [{"base64": images.b64(images.jpeg())}], "policy": "squash"}
        )
        assert response.status_code == 200 and response.json()["policy"] == "squash"
        response = await post(
            "/v1/patch-similarity", files={"image": images.jpeg()}, data={"id": "x", "row": "0", "col": "0"}
        )
        assert response.status_code == 404 and err(response) == {
            "code": "index_not_found",
            "message": "no index is served: start the server with --index NAME=DB_PATH:TABLE",
        }


async def test_patch_similarity_equals_numpy_on_both_images(
    serve: OpenServer, reference: Backbone, catalog: dict[str, Any], images: Images, err: Any
) -> None:
    query = images.jpeg(140, 100, seed=9)
    async with serve(indexes=catalog["indexes"]) as server:
        fields = {
            "index": "photos",
            "id": "sub/p5.jpg",
            "row": "2",
            "col": "5",
            "policy": "squash",
            "size": "98,112",
        }
        response = await server.client.post("/v1/patch-similarity", files={"image": query}, data=fields)
        assert response.status_code == 200, response.text
        body = response.json()
        options: dict[str, Any] = {"pooling": "patch", "layers": [1], "policy": "squash", "size": (98, 112)}
        q = reference.embed(query, **options)[0]  # [7, 8, D]
        t = reference.embed(catalog["data"]["sub/p5.jpg"], **options)[0]
        v = q[2, 5].astype(np.float64)
        expected = (t @ v) / (np.linalg.norm(t, axis=-1) * np.linalg.norm(v))
        np.testing.assert_allclose(np.array(body["similarity"]), expected, atol=TOL)
        best = np.unravel_index(int(np.argmax(expected)), expected.shape)
        assert body["best"]["row"] == best[0] and body["best"]["col"] == best[1]
        assert body["grid"] == body["query_grid"] == [7, 8] and body["size"] == [98, 112]
        assert png_pixels(body["view"]).shape == (98, 112, 3)
        # the item itself as the query: its own patch is the best match, cosine 1
        same = await server.client.post(
            "/v1/patch-similarity",
            files={"image": catalog["data"]["p2.jpg"]},
            data={**fields, "id": "p2.jpg"},
        )
        assert same.json()["best"] == {"row": 2, "col": 5, "score": pytest.approx(1.0, abs=1e-5)}
        for bad, status, code in (
            ({"id": "nope.jpg"}, 404, "item_not_found"),
            ({"id": "../secret.jpg"}, 404, "item_not_found"),
            ({"row": "7"}, 422, "invalid_option"),
            ({"index": "other"}, 404, "index_not_found"),
        ):
            response = await server.client.post(
                "/v1/patch-similarity", files={"image": query}, data={**fields, **bad}
            )
            assert response.status_code == status and err(response)["code"] == code, response.text


async def test_thumbnails_come_only_from_the_catalog(
    serve: OpenServer, catalog: dict[str, Any], err: Any
) -> None:
    async with serve(indexes=catalog["indexes"]) as server:
        get = server.client.get
        for index, item, source in (("photos", "sub/p5.jpg", "sub/p5.jpg"), ("listed", "second", "p1.jpg")):
            response = await get(f"/v1/indexes/{index}/thumbnail", params={"id": item, "max_side": "64"})
            assert response.status_code == 200 and response.headers["content-type"] == "image/jpeg"
            thumb = Image.open(io.BytesIO(response.content))
            original = Image.open(io.BytesIO(catalog["data"][source]))
            assert max(thumb.size) == 64
            scale = 64 / max(original.size)
            assert all(abs(t - o * scale) <= 1 for t, o in zip(thumb.size, original.size, strict=True))
        # ids that are not rows never reach the file system, whatever they spell
        for item in ("../secret.jpg", "/etc/passwd", "p0.jpg/../../secret.jpg", "first"):
            response = await get("/v1/indexes/photos/thumbnail", params={"id": item})
            assert response.status_code == 404 and err(response) == {
                "code": "item_not_found",
                "message": f"index 'photos' has no item {item!r}",
            }
        response = await get("/v1/indexes/photos/thumbnail", params={"id": "p0.jpg", "max_side": "4"})
        assert response.status_code == 422 and err(response)["code"] == "invalid_request"


async def test_a_row_whose_file_left_the_catalog_folder_is_refused(
    serve: OpenServer, catalog: dict[str, Any], err: Any, tmp_path: Path
) -> None:
    """A row id that resolves outside the folder (a symbolic link planted after indexing) is not read."""
    index = SimilarityIndex.open(catalog["root"] / "db", "photos")
    source = index.image_source()
    assert source is not None and source.kind == "folder"
    assert Path(source.location) == (catalog["root"] / "photos").resolve()
    link = Path(source.location) / "p3.jpg"
    saved = link.read_bytes()
    link.unlink()
    link.symlink_to(catalog["root"] / "secret.jpg")
    try:
        async with serve(indexes=catalog["indexes"]) as server:
            response = await server.client.get("/v1/indexes/photos/thumbnail", params={"id": "p3.jpg"})
            assert response.status_code == 404
            assert (
                err(response)["message"]
                == "no image for item 'p3.jpg': not a path inside the catalog's folder"
            )
    finally:
        link.unlink()
        link.write_bytes(saved)


async def test_page_and_auth(serve: OpenServer, images: Images, err: Any) -> None:
    async with serve(api_key="sesame") as server:
        get = server.client.get
        root = await get("/")
        assert root.status_code == 307 and root.headers["location"] == "/explore"
        page = await get("/explore")  # the page itself is public; what it asks for is not
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert (
            "default-src 'none'" in policy
            and "connect-src 'self'" in policy
            and "script-src 'self'" in policy
        )
        assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
        for asset, kind in (
            ("explore.js", "text/javascript"),
            ("explore_draw.js", "text/javascript"),
            ("explore.css", "text/css"),
        ):
            response = await get(f"/explore/assets/{asset}")
            assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
            assert "http://" not in response.text and "https://" not in response.text
        assert (await get("/explore/assets/..%2Fapp.py")).status_code == 404
        assert (await get("/explore/assets/explore.html.bak")).status_code == 404
        response = await server.client.post("/v1/patch-features", files={"image": images.jpeg()})
        assert response.status_code == 401 and err(response)["code"] == "unauthorized"
        response = await server.client.post(
            "/v1/patch-features", files={"image": images.jpeg()}, headers={"Authorization": "Bearer sesame"}
        )
        assert response.status_code == 200
        assert (await get("/v1/indexes/x/thumbnail", params={"id": "a"})).status_code == 401
        schema = (await get("/openapi.json")).json()
        assert {"/v1/patch-features", "/v1/patch-similarity", "/v1/indexes/{index}/thumbnail"} <= set(
            schema["paths"]
        )


async def test_the_view_and_the_tokens_share_the_native_box_under_a_presets_box(
    serve: OpenServer, make_checkpoint: Any, images: Images
) -> None:
    """A checkpoint whose defaults carry a box (as the embedded backbone's default-v3 does: 98x98) still
    shows and maps patches at the native box, as ``pooling=patch`` embeds them: the PNG, the grid and the
    tokens agree."""
    import json

    folder = make_checkpoint("dinov2", seed=5)  # native 56x56: a 4x4 grid
    defaults = {"pooling": "mean_hflip", "policy": "squash", "size": [28, 28]}
    (folder / "vitembed.json").write_text(json.dumps({"defaults": defaults}))
    photo = images.jpeg(150, 90, seed=8)
    async with serve(models={"boxed": str(folder)}) as server:
        response = await server.client.post("/v1/patch-features", files={"image": photo})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["grid"] == [4, 4] and body["size"] == [56, 56]
        assert np.array(body["pca"]["rgb"]).shape[:2] == (4, 4)  # the tokens' grid, not only the view's
        assert list(png_pixels(body["view"]).shape) == [56, 56, 3]
        embedded = await server.client.post("/v1/embed", files={"image": photo}, data={"return_grid": "true"})
        assert embedded.status_code == 200, embedded.text
        assert embedded.json()["data"][0]["grid"] == [2, 2]  # the vector itself: the declared box
        assert embedded.json()["provenance"]["size"] == [28, 28]
