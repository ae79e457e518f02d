"""Frozen heads in the server, in process against the real engine: /v1/classify and /v1/embed?heads= equal
the Python API (probabilities to 1e-5), heads cost no extra forward pass, /v1/models lists each head's
card under its model, and every refusal has its exact JSON body."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from heads_synthetic import CLASSES, make_labelled_folder, make_segmentation_folder, segmentation_pair
from vitembed.engine.engine import Engine
from vitembed.engine.served_heads import HeadStartupError, preflight_heads, same_pixels
from vitembed.metrics import Metrics
from vitembed.settings import ServiceSettings

from vit_backbone import Backbone, load_backbone
from vit_backbone.heads import Head, TrainOptions, load_head, save_head, train_head
from vit_backbone.heads.predict import predict_masks, predict_proba

if TYPE_CHECKING:  # fixtures' types (tests/service/conftest.py)
    from conftest import Images, OpenServer, Server

pytestmark = pytest.mark.anyio
TOL = 1e-5
SEG = {"policy": "squash", "size": "112,112"}


@pytest.fixture(scope="module")
def other_path(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("dinov2", seed=1)


@pytest.fixture(scope="module")
def head_paths(
    reference: Backbone, other_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    labelled = make_labelled_folder(root / "labelled", per_class=12)
    seg = make_segmentation_folder(root / "seg", count=20)
    wide = make_segmentation_folder(root / "wide", count=20, size=(112, 224))
    trained = {
        "lin": train_head(reference, labelled, TrainOptions(kind="linear", pooling="mean", layers=(0,))).head,
        "knn": train_head(reference, labelled, TrainOptions(kind="knn")).head,
        "seg": train_head(reference, seg, TrainOptions(kind="patch", size=(112, 112))).head,
        "other_lin": train_head(load_backbone(other_path), labelled, TrainOptions(kind="linear")).head,
        "seg_pad": train_head(
            reference, wide, TrainOptions(kind="patch", policy="pad", size=(224, 224))
        ).head,
    }
    paths = {}
    for name, head in trained.items():
        save_head(head, root / f"{name}.safetensors")
        paths[name] = root / f"{name}.safetensors"
    return paths


@pytest.fixture(scope="module")
def heads(head_paths: dict[str, Path]) -> dict[str, Head]:
    return {name: load_head(path) for name, path in head_paths.items()}


@pytest.fixture(scope="module")
async def server(
    serve: OpenServer, tiny_path: Path, other_path: Path, head_paths: dict[str, Path]
) -> AsyncIterator[Server]:
    models = {"tiny": str(tiny_path), "other": str(other_path)}
    async with serve(models=models, heads={k: str(v) for k, v in head_paths.items()}) as opened:
        yield opened


@pytest.fixture(scope="module")
def photos(images: Images) -> list[bytes]:
    return [images.jpeg(90, 70, 0), images.png(70, 90, 1), images.jpeg(120, 64, 2)]


@pytest.fixture(scope="module")
def shapes() -> list[bytes]:
    """Unseen images of the labelled classes (one per class) as PNG bytes."""
    from heads_synthetic import labelled_image

    out = []
    for c, label in enumerate(CLASSES):
        buffer = io.BytesIO()
        labelled_image(label, 900 + c).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


def labels_of(item: dict[str, Any]) -> tuple[list[str], np.ndarray]:
    return [x["label"] for x in item["labels"]], np.asarray([x["probability"] for x in item["labels"]])


def expected_labels(head: Head, probabilities: np.ndarray, k: int) -> tuple[list[str], np.ndarray]:
    order = np.argsort(-probabilities, kind="stable")[:k]
    return [head.card.classes[i] for i in order], probabilities[order]


async def test_models_list_each_head_with_its_card(server: Server, heads: dict[str, Head]) -> None:
    response = await server.client.get("/v1/models")
    assert response.status_code == 200, response.text
    infos = {model["id"]: model["info"] for model in response.json()["data"]}

    def shown(name: str) -> dict[str, Any]:  # the card without "data", a path on the server's disk
        return {k: v for k, v in heads[name].card.to_dict().items() if k != "data"}

    assert infos["tiny"]["heads"] == {name: shown(name) for name in ("lin", "knn", "seg", "seg_pad")}
    assert infos["other"]["heads"] == {"other_lin": shown("other_lin")}
    assert infos["tiny"]["attention_heads"] == infos["other"]["attention_heads"] == 2  # not the cards
    assert str(Path(heads["lin"].card.data).parent) not in response.text


async def test_classify_multipart_equals_the_python_api(
    server: Server, reference: Backbone, heads: dict[str, Head], shapes: list[bytes]
) -> None:
    response = await server.client.post(
        "/v1/classify", files=[("image", d) for d in shapes], data={"head": "lin", "k": "2"}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert {k: body[k] for k in ("head", "model", "kind")} == {
        "head": "lin",
        "model": "tiny",
        "kind": "linear",
    }
    expected = predict_proba(reference, heads["lin"], shapes)  # [3, 3]
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    for item, row in zip(body["data"], expected, strict=True):
        names, values = labels_of(item)
        want_names, want_values = expected_labels(heads["lin"], row, 2)
        assert names == want_names
        np.testing.assert_allclose(values, want_values, atol=TOL, rtol=0)
    assert [labels_of(item)[0][0] for item in body["data"]] == list(CLASSES)  # and they are right
    card = heads["lin"].card
    assert body["provenance"] == {
        "revision": card.revision,
        "preprocess_hash": card.preprocess_hash,
        "pooling": "mean",
        "layers": [0],
        "policy": "crop",
        "precision": "float32",  # computed here (the test server runs float32)
        "precision_cosine": None,  # float32 as asked: nothing measured
        "head_precision": "float32",  # and when the head was trained
        "preset": "default-v3",  # the named defaults it was trained under
    }


async def test_classify_k_and_its_alias_top_k(server: Server, shapes: list[bytes], err: Any) -> None:
    answers = []
    for where in ("data", "params"):
        for name in ("k", "top_k"):
            response = await server.client.post(
                "/v1/classify", files=[("image", d) for d in shapes], **{where: {"head": "lin", name: "1"}}
            )
            assert response.status_code == 200, response.text
            answers.append([labels_of(item)[0] for item in response.json()["data"]])
    assert all(answer == answers[0] for answer in answers) and len(answers[0][0]) == 1
    both = await server.client.post(
        "/v1/classify", files={"image": shapes[0]}, data={"head": "lin", "k": "1"}, params={"top_k": "2"}
    )
    assert both.status_code == 422
    assert err(both) == {
        "code": "invalid_request",
        "message": "the option 'k' is given both in the query and the body",
    }
    same_place = await server.client.post(
        "/v1/classify", files={"image": shapes[0]}, data={"head": "lin", "k": "1", "top_k": "2"}
    )
    assert err(same_place) == {
        "code": "invalid_request",
        "message": "give 'k' or its alias 'top_k', not both",
    }


async def test_classify_json_query_options_and_npy(
    server: Server, reference: Backbone, heads: dict[str, Head], shapes: list[bytes], images: Images
) -> None:
    payload = {"images": [{"base64": images.b64(d)} for d in shapes]}
    response = await server.client.post("/v1/classify", json=payload, params={"head": "knn", "top_k": "3"})
    assert response.status_code == 200, response.text
    expected = predict_proba(reference, heads["knn"], shapes)
    for item, row in zip(response.json()["data"], expected, strict=True):
        names, values = labels_of(item)
        assert names == expected_labels(heads["knn"], row, 3)[0]
        np.testing.assert_allclose(values, expected_labels(heads["knn"], row, 3)[1], atol=TOL, rtol=0)
    as_npy = await server.client.post(
        "/v1/classify", json={**payload, "head": "knn"}, headers={"Accept": "application/x-npy"}
    )
    assert as_npy.status_code == 200, as_npy.text  # before reading it as .npy
    array = np.load(io.BytesIO(as_npy.content), allow_pickle=False)
    assert array.dtype == np.dtype("<f4") and array.shape == (3, 3)
    np.testing.assert_allclose(array, expected, atol=TOL, rtol=0)
    assert as_npy.headers["x-vitembed-classes"] == '["blue_square","green_triangle","red_circle"]'
    assert as_npy.headers["x-vitembed-head"] == "knn"


async def test_embed_with_heads_is_one_forward_pass_and_equals_the_python_api(
    server: Server, reference: Backbone, heads: dict[str, Head], photos: list[bytes]
) -> None:
    before = await server.metric("vitembed_forward_passes_total", model="tiny")
    response = await server.client.post(
        "/v1/embed", files=[("image", d) for d in photos], data={"heads": "lin,knn"}
    )
    assert response.status_code == 200, response.text
    assert (
        await server.metric("vitembed_forward_passes_total", model="tiny") == before + 1
    )  # 3 images, 3 outputs
    body = response.json()
    assert body["provenance"]["heads"] == {
        "lin": {"kind": "linear", "precision": "float32", "head_precision": "float32"},
        "knn": {"kind": "knn", "precision": "float32", "head_precision": "float32"},
    }
    assert [list(item["heads"]) for item in body["data"]] == [["lin", "knn"]] * 3  # as requested
    reversed_order = await server.client.post(
        "/v1/embed", files=[("image", d) for d in photos], data={"heads": "knn,lin"}
    )
    assert reversed_order.status_code == 200, reversed_order.text
    assert [item["heads"] for item in reversed_order.json()["data"]] == [
        {"knn": item["heads"]["knn"], "lin": item["heads"]["lin"]} for item in body["data"]
    ]
    assert [list(item["heads"]) for item in reversed_order.json()["data"]] == [["knn", "lin"]] * 3
    # the head's size given explicitly, equal to the default it was trained with: the same pixels
    sized = await server.client.post(
        "/v1/embed", files=[("image", d) for d in photos], data={"heads": "lin,knn", "size": "56,56"}
    )
    assert sized.status_code == 200, sized.text
    assert [item["heads"] for item in sized.json()["data"]] == [item["heads"] for item in body["data"]]
    np.testing.assert_allclose(
        [item["embedding"] for item in body["data"]], reference.embed(photos), atol=TOL, rtol=0
    )  # the embedding is unchanged by the heads (default: cls of the last block)
    for name in ("lin", "knn"):
        expected = predict_proba(reference, heads[name], photos)
        for item, row in zip(body["data"], expected, strict=True):
            names, values = labels_of(item["heads"][name])
            assert names == expected_labels(heads[name], row, 3)[0]  # every class, most probable first
            np.testing.assert_allclose(values, expected_labels(heads[name], row, 3)[1], atol=TOL, rtol=0)
    # the same through JSON (a list) and the query string
    payload = {"images": [{"base64": base64.b64encode(d).decode()} for d in photos], "heads": ["knn"]}
    as_json = await server.client.post("/v1/embed", json=payload)
    as_query = await server.client.post(
        "/v1/embed", files=[("image", d) for d in photos], params={"heads": "knn"}
    )
    for other in (as_json, as_query):
        assert other.status_code == 200, other.text
        assert [item["heads"] for item in other.json()["data"]] == [
            {"knn": item["heads"]["knn"]} for item in body["data"]
        ]


async def test_patch_head_grids_and_upsampled_masks(
    server: Server, reference: Backbone, heads: dict[str, Head]
) -> None:
    pairs = [segmentation_pair(70_000 + i) for i in range(2)]
    data = []
    for image, _ in pairs:
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        data.append(buffer.getvalue())
    grids = predict_masks(reference, heads["seg"], data)
    masks = predict_masks(reference, heads["seg"], data, upsample=True)
    embedded = await server.client.post(
        "/v1/embed", files=[("image", d) for d in data], data={**SEG, "heads": "seg"}
    )
    assert embedded.status_code == 200, embedded.text
    assert [item["heads"]["seg"]["grid"] for item in embedded.json()["data"]] == [g.tolist() for g in grids]
    classified = await server.client.post(
        "/v1/classify", files=[("image", d) for d in data], data={"head": "seg", "upsample": "true"}
    )
    assert classified.status_code == 200, classified.text
    body = classified.json()
    assert body["classes"] == ["background", "red_square", "blue_disc"]
    assert [item["grid"] for item in body["data"]] == [g.tolist() for g in grids]
    assert [item["size"] for item in body["data"]] == [[112, 112], [112, 112]]
    for item, mask in zip(body["data"], masks, strict=True):
        assert (item["mask"]["shape"], item["mask"]["dtype"]) == ([112, 112], "uint8")
        decoded = np.frombuffer(base64.b64decode(item["mask"]["base64"]), np.uint8).reshape(112, 112)
        np.testing.assert_array_equal(decoded, mask)
    as_npy = await server.client.post(
        "/v1/classify",
        files=[("image", d) for d in data],
        data={"head": "seg", "upsample": "true"},
        headers={"Accept": "application/x-npy"},
    )
    assert as_npy.status_code == 200, as_npy.text
    array = np.load(io.BytesIO(as_npy.content), allow_pickle=False)
    assert array.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(array, np.stack(masks))


async def test_a_pad_patch_head_marks_the_letterbox_and_masks_only_the_image(
    server: Server, reference: Backbone, heads: dict[str, Head]
) -> None:
    data = []
    for i in range(2):
        image, _ = segmentation_pair(80_000 + i, 112, 224)
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        data.append(buffer.getvalue())
    grids = predict_masks(reference, heads["seg_pad"], data)  # [16, 16]: rows 0-3 and 12-15 letterbox
    masks = predict_masks(reference, heads["seg_pad"], data, upsample=True)  # [112, 224]
    assert all((g[:4] == 255).all() and (g[12:] == 255).all() and (g[4:12] < 3).all() for g in grids)
    classified = await server.client.post(
        "/v1/classify", files=[("image", d) for d in data], data={"head": "seg_pad", "upsample": "true"}
    )
    assert classified.status_code == 200, classified.text
    body = classified.json()
    assert [item["grid"] for item in body["data"]] == [g.tolist() for g in grids]
    for item, mask in zip(body["data"], masks, strict=True):
        assert item["size"] == [112, 224]
        decoded = np.frombuffer(base64.b64decode(item["mask"]["base64"]), np.uint8).reshape(112, 224)
        np.testing.assert_array_equal(decoded, mask)
    embedded = await server.client.post(
        "/v1/embed",
        files=[("image", d) for d in data],
        data={"policy": "pad", "size": "224,224", "heads": "seg_pad"},
    )
    assert embedded.status_code == 200, embedded.text
    assert [item["heads"]["seg_pad"]["grid"] for item in embedded.json()["data"]] == [
        g.tolist() for g in grids
    ]


async def test_refusals_have_exact_bodies(
    server: Server, photos: list[bytes], err: Callable[[Any], dict[str, Any]], images: Images
) -> None:
    files = [("image", d) for d in photos[:1]]
    served = "lin, knn, seg, other_lin, seg_pad"
    cases: list[tuple[Any, int, dict[str, Any]]] = [
        (
            server.client.post("/v1/classify", files=files, data={"head": "nope"}),
            404,
            {"code": "head_not_found", "message": f"head 'nope' is not served; served heads: {served}"},
        ),
        (
            server.client.post("/v1/embed", files=files, data={"heads": "lin,nope"}),
            404,
            {"code": "head_not_found", "message": f"head 'nope' is not served; served heads: {served}"},
        ),
        (
            server.client.post("/v1/embed", files=files, data={"heads": "other_lin"}),
            422,
            {
                "code": "head_model_mismatch",
                "message": "head 'other_lin' runs on model 'other', not 'tiny'; ask for model=other",
            },
        ),
        (
            server.client.post("/v1/embed", files=files, data={"heads": "seg"}),
            422,
            {
                "code": "head_options_mismatch",
                "message": "head 'seg' reads images prepared with policy=squash size=112,112; this request "
                "uses policy=crop size=native: send the head's policy and size with this request",
            },
        ),
        (
            server.client.post("/v1/classify", files=files, data={"head": "lin", "upsample": "true"}),
            422,
            {"code": "invalid_option", "message": "upsample applies to patch heads; 'lin' is a linear head"},
        ),
        (
            server.client.post("/v1/classify", files=files),
            422,
            {"code": "head_required", "message": f"several heads are served; name one with head=: {served}"},
        ),
        (
            server.client.post(
                "/v1/embed", files=files, data={"heads": "lin"}, headers={"Accept": "application/x-npy"}
            ),
            422,
            {
                "code": "heads_need_json",
                "message": "head outputs are returned in JSON: drop Accept: application/x-npy",
            },
        ),
        (
            server.client.post("/v1/classify", files=files, data={"head": "lin", "pooling": "cls"}),
            422,
            {
                "code": "invalid_request",
                "message": "unknown form field 'pooling': images go in parts named 'image' "
                "(curl -F image=@photo.jpg); options: head, k, upsample, upsample_mode",
            },
        ),
        (
            server.client.post(
                "/v1/classify", json={"images": [{"base64": images.b64(photos[0])}], "top_k": 0}
            ),
            422,
            {"code": "invalid_request", "message": "k: Input should be greater than or equal to 1"},
        ),
    ]
    for call, status, expected in cases:
        response = await call
        assert response.status_code == status, response.text
        assert err(response) == expected
    seg_sizes = [images.png(112, 112, 3), images.png(140, 112, 4)]
    mixed = await server.client.post(
        "/v1/classify",
        files=[("image", d) for d in seg_sizes],
        data={"head": "seg", "upsample": "true"},
        headers={"Accept": "application/x-npy"},
    )
    assert mixed.status_code == 422
    assert err(mixed) == {
        "code": "mixed_sizes",
        "message": "one .npy array needs equal sizes, and these are [(112, 112), (112, 140)]: ask for JSON, "
        "or send images of one size",
    }


async def test_upsampled_masks_over_the_limit_are_refused(
    serve: OpenServer, head_paths: dict[str, Path], err: Callable[[Any], dict[str, Any]]
) -> None:
    pairs = [segmentation_pair(71_000 + i) for i in range(2)]
    data = []
    for image, _ in pairs:
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        data.append(buffer.getvalue())
    async with serve(heads={"seg": str(head_paths["seg"])}, max_upsample_pixels=20_000) as small:
        one = await small.client.post(
            "/v1/classify", files=[("image", data[0])], data={"upsample": "true"}
        )  # 112 x 112 = 12,544 pixels: within the limit
        assert one.status_code == 200, one.text
        two = await small.client.post(
            "/v1/classify", files=[("image", d) for d in data], data={"upsample": "true"}
        )
        assert two.status_code == 422, two.text
        assert err(two) == {
            "code": "upsample_too_large",
            "message": "upsample=true would return 25088 mask pixels for these 2 image(s), over the "
            "server's limit of 20000: send fewer or smaller images, or drop upsample and scale the patch "
            "grid yourself",
        }
        grids = await small.client.post("/v1/classify", files=[("image", d) for d in data])
        assert grids.status_code == 200, grids.text  # the grids alone are always small


def test_a_head_that_fits_no_served_model_stops_start_up(
    tiny_path: Path, head_paths: dict[str, Path], heads: dict[str, Head], reference: Backbone
) -> None:
    settings = ServiceSettings(models={"tiny": str(tiny_path)}, heads={"x": str(head_paths["other_lin"])})
    card = heads["other_lin"].card
    message = (
        f"head 'x' ({head_paths['other_lin']}) fits no served model: it was trained on 'dinov2' revision "
        f"{card.revision}, preprocess_hash {card.preprocess_hash}; served: tiny: revision "
        f"{reference.checkpoint.revision}, preprocess_hash {reference.preprocess_config.hash()}"
    )
    with pytest.raises(HeadStartupError) as caught:
        preflight_heads(settings)  # before any weights load (vitembed serve: exit 2)
    assert str(caught.value) == message
    engine = Engine(settings, Metrics())
    try:
        with pytest.raises(HeadStartupError) as caught:
            engine.start()  # the engine's own binding says the same
        assert str(caught.value) == message
        assert not engine.ready
    finally:
        engine.stop()


def test_explicit_default_size_is_the_same_pixels(reference: Backbone) -> None:
    """A head trained without a size accepts a request giving the default size, and the reverse; another
    size, or another policy, is other pixels."""
    pre = reference.preprocessor
    default = pre.config.crop_size  # the tiny DINOv2: shortest edge 64, centre crop 56x56
    assert default == (56, 56)
    assert same_pixels(pre, ("crop", None), ("crop", default))
    assert same_pixels(pre, ("crop", default), ("crop", None))
    assert same_pixels(pre, ("squash", pre.config.default_box), ("squash", None))
    assert not same_pixels(pre, ("crop", None), ("crop", (112, 112)))
    assert not same_pixels(pre, ("crop", None), ("squash", None))
