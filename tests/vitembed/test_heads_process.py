"""``vitembed serve --head NAME=PATH`` as a real process on 127.0.0.1: ``/v1/classify`` and
``/v1/embed?heads=`` over HTTP equal the Python API (float32, 1e-5)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from heads_synthetic import CLASSES, labelled_image, make_labelled_folder
from test_server_process import ServerProcess, start_server

from vit_backbone import Backbone
from vit_backbone.heads import Head, TrainOptions, load_head, save_head, train_head
from vit_backbone.heads.predict import predict_proba

TOL = 1e-5


@pytest.fixture(scope="module")
def head_path(reference: Backbone, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("process_heads")
    labelled = make_labelled_folder(root / "labelled", per_class=10)
    head = train_head(reference, labelled, TrainOptions(kind="linear", pooling="mean", layers=(0, 1))).head
    save_head(head, root / "shapes.safetensors")
    return root / "shapes.safetensors"


@pytest.fixture(scope="module")
def process(
    tiny_path: Path, head_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_server(tiny_path, tmp_path_factory.mktemp("serve_heads"), "--head", f"shapes={head_path}")
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def shapes() -> list[bytes]:
    out = []
    for c, label in enumerate(CLASSES):
        buffer = io.BytesIO()
        labelled_image(label, 500 + c).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


def test_classify_and_embed_heads_over_http_equal_the_python_api(
    process: ServerProcess, reference: Backbone, head_path: Path, shapes: list[bytes]
) -> None:
    head: Head = load_head(head_path, reference)
    expected = predict_proba(reference, head, shapes)  # [3, 3]
    files = [("image", d) for d in shapes]
    with process.client() as client:
        classified = client.post("/v1/classify", files=files, data={"top_k": "3"})
        embedded = client.post("/v1/embed", files=files, params={"heads": "shapes"})
    assert classified.status_code == 200, classified.text
    assert embedded.status_code == 200, embedded.text
    body = classified.json()
    assert (body["head"], body["model"], body["kind"]) == ("shapes", "tiny", "linear")
    assert body["provenance"]["precision"] == "float32"
    for answer in (body["data"], [item["heads"]["shapes"] for item in embedded.json()["data"]]):
        for item, row in zip(answer, expected, strict=True):
            order = np.argsort(-row, kind="stable")
            assert [x["label"] for x in item["labels"]] == [CLASSES[i] for i in order]
            np.testing.assert_allclose(
                [x["probability"] for x in item["labels"]], row[order], atol=TOL, rtol=0
            )
    assert [item["labels"][0]["label"] for item in body["data"]] == list(CLASSES)  # and right
    np.testing.assert_allclose(
        [item["embedding"] for item in embedded.json()["data"]], reference.embed(shapes), atol=TOL, rtol=0
    )


def test_cli_heads_predict_through_the_server_equals_the_local_one(
    process: ServerProcess, tiny_path: Path, head_path: Path, shapes: list[bytes], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from vitembed.cli.main import main

    files = []
    for n, data in enumerate(shapes):
        (tmp_path / f"s{n}.png").write_bytes(data)
        files.append(str(tmp_path / f"s{n}.png"))
    capsys.readouterr()
    assert main(["heads", "predict", "shapes", *files, "--server", process.url, "--json", "--k", "2"]) == 0
    remote = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (
        main(["heads", "predict", str(head_path), *files, "--model", str(tiny_path), "--json", "--k", "2"])
        == 0
    )
    local = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["image"] for r in remote] == files
    for got, expected in zip(remote, local, strict=True):
        assert [x["label"] for x in got["labels"]] == [x["label"] for x in expected["labels"]]
        np.testing.assert_allclose(
            [x["probability"] for x in got["labels"]],
            [x["probability"] for x in expected["labels"]],
            atol=TOL,
        )
